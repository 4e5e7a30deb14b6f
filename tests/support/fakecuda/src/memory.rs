//! Device memory: host bytes behind device addresses that are not host
//! pointers, and the page-locked host allocations.

use std::collections::BTreeMap;
use std::io::Write;

/// First device address: non-canonical on x86-64 (bits 63..47 are not all
/// equal), so dereferencing it on the host faults instead of reading
/// something.
pub const DEVICE_BASE: u64 = 0x4000_0000_0000_0000;

/// Allocations start on this boundary and leave at least this much
/// unmapped address space after them: an overrun lands nowhere.
pub const DEVICE_ALIGN: u64 = 2 << 20;

/// One `cuMemAlloc`.
pub struct Allocation {
    pub bytes: Vec<u8>,
}

#[derive(Default)]
pub struct DeviceMemory {
    allocs: BTreeMap<u64, Allocation>,
    next: u64,
    /// Bytes allocated now, and the most ever.
    pub live_bytes: usize,
    pub peak_bytes: usize,
    pub allocs_made: u64,
    pub frees_made: u64,
    /// The card's size (`FAKECUDA_MEMORY_BYTES`, default 16 GiB).
    pub total_bytes: usize,
    log: Option<std::fs::File>,
}

impl DeviceMemory {
    pub fn new(total_bytes: usize, log: Option<std::fs::File>) -> Self {
        DeviceMemory {
            next: DEVICE_BASE,
            total_bytes,
            log,
            ..Default::default()
        }
    }

    fn log(&mut self, line: String) {
        if let Some(f) = &mut self.log {
            let _ = writeln!(f, "{line}");
        }
    }

    /// `bytes` of device memory, or None when the card would be over its
    /// size. The real driver leaves new memory undefined; this one fills it
    /// with 0xFF bytes (NaN as f32), so nothing can rely on lucky zeros.
    pub fn alloc(&mut self, bytes: usize) -> Option<u64> {
        if bytes == 0 || self.live_bytes + bytes > self.total_bytes {
            self.log(format!("alloc {bytes} refused (live {})", self.live_bytes));
            return None;
        }
        let at = self.next;
        let span = (bytes as u64).div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN + DEVICE_ALIGN;
        self.next += span;
        self.allocs.insert(
            at,
            Allocation {
                bytes: vec![0xFF; bytes],
            },
        );
        self.live_bytes += bytes;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        self.allocs_made += 1;
        self.log(format!(
            "alloc {bytes} at {at:#x} (live {})",
            self.live_bytes
        ));
        Some(at)
    }

    /// Frees the allocation that starts at `at`; Err when none does.
    pub fn free(&mut self, at: u64) -> Result<usize, String> {
        match self.allocs.remove(&at) {
            Some(a) => {
                self.live_bytes -= a.bytes.len();
                self.frees_made += 1;
                self.log(format!(
                    "free {} at {at:#x} (live {})",
                    a.bytes.len(),
                    self.live_bytes
                ));
                Ok(a.bytes.len())
            }
            None => Err(format!(
                "cuMemFree({at:#x}): no allocation starts there{}",
                self.describe(at)
            )),
        }
    }

    /// Where `addr` is relative to the allocations, for error messages.
    pub fn describe(&self, addr: u64) -> String {
        match self.allocs.range(..=addr).next_back() {
            Some((base, a)) => format!(
                " (nearest allocation below: {base:#x}, {} bytes, ends {:#x})",
                a.bytes.len(),
                base + a.bytes.len() as u64
            ),
            None => " (below every allocation)".to_string(),
        }
    }

    /// The allocation holding all of `[addr, addr + len)`, and the offset.
    fn find(&self, addr: u64, len: usize) -> Result<(u64, usize), String> {
        if let Some((base, a)) = self.allocs.range(..=addr).next_back() {
            let off = (addr - base) as usize;
            if off.checked_add(len).is_some_and(|end| end <= a.bytes.len()) {
                return Ok((*base, off));
            }
        }
        Err(format!(
            "{len} bytes at {addr:#x} are outside every allocation{}",
            self.describe(addr)
        ))
    }

    pub fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), String> {
        let (base, off) = self.find(addr, out.len())?;
        out.copy_from_slice(&self.allocs[&base].bytes[off..off + out.len()]);
        Ok(())
    }

    pub fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), String> {
        let (base, off) = self.find(addr, data.len())?;
        let a = self.allocs.get_mut(&base).expect("found above");
        a.bytes[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    pub fn fill(&mut self, addr: u64, value: u8, len: usize) -> Result<(), String> {
        let (base, off) = self.find(addr, len)?;
        let a = self.allocs.get_mut(&base).expect("found above");
        a.bytes[off..off + len].fill(value);
        Ok(())
    }

    /// Checks `[addr, addr + len)` is device memory (no copy).
    pub fn check(&self, addr: u64, len: usize) -> Result<(), String> {
        self.find(addr, len).map(|_| ())
    }

    pub fn read_f32(&self, addr: u64, count: usize) -> Result<Vec<f32>, String> {
        let mut bytes = vec![0u8; count * 4];
        self.read(addr, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub fn write_f32(&mut self, addr: u64, values: &[f32]) -> Result<(), String> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(addr, &bytes)
    }
}

impl memfit_ptx::Memory for DeviceMemory {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), String> {
        self.read(addr, out)
    }

    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), String> {
        self.write(addr, data)
    }
}

/// Page-locked host memory from `cuMemHostAlloc`: real host bytes (the
/// caller writes them directly), remembered so that copies from them can
/// be queued and checked.
#[derive(Default)]
pub struct Pinned {
    blocks: BTreeMap<usize, Box<[u8]>>,
}

impl Pinned {
    pub fn alloc(&mut self, bytes: usize) -> *mut u8 {
        let mut b = vec![0u8; bytes.max(1)].into_boxed_slice();
        let p = b.as_mut_ptr();
        self.blocks.insert(p as usize, b);
        p
    }

    pub fn free(&mut self, p: *mut u8) -> bool {
        self.blocks.remove(&(p as usize)).is_some()
    }

    /// Whether all of `[p, p + len)` is page-locked memory from here.
    pub fn contains(&self, p: usize, len: usize) -> bool {
        self.blocks
            .range(..=p)
            .next_back()
            .is_some_and(|(base, b)| p + len <= base + b.len())
    }
}
