//! Device memory: host bytes behind device addresses that are not host
//! pointers, and the page-locked host allocations.
//!
//! Two ways to device memory, as on the real driver: `cuMemAlloc` (an
//! allocation that is its own address range), and the virtual memory
//! calls (`cuMemAddressReserve` an address range, `cuMemCreate` physical
//! memory, `cuMemMap` it into the range, `cuMemSetAccess` before use).
//! Either way an address range maps to *storage* (the bytes); a mapped
//! range is a *region*. Only storage counts as memory in use, so a
//! reservation costs nothing until pages are mapped into it.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

/// First device address: non-canonical on x86-64 (bits 63..47 are not all
/// equal), so dereferencing it on the host faults instead of reading
/// something.
pub const DEVICE_BASE: u64 = 0x4000_0000_0000_0000;

/// Allocations start on this boundary and leave at least this much
/// unmapped address space after them: an overrun lands nowhere. Also the
/// granularity of `cuMemCreate` and `cuMemMap` (a real card's is 2 MiB).
pub const DEVICE_ALIGN: u64 = 2 << 20;

/// A mapped address range: `bytes` of storage `key` from `offset`.
struct Region {
    bytes: usize,
    key: u64,
    offset: usize,
    /// `cuMemSetAccess` granted read and write (a `cuMemAlloc` always).
    access: bool,
}

/// Bytes of device memory: a `cuMemAlloc`'s, or a `cuMemCreate`'s.
struct Storage {
    bytes: Vec<u8>,
    /// A `cuMemCreate` handle not yet released (its memory goes when it is
    /// released and no region maps it any more).
    handle_held: bool,
    /// Regions mapping it.
    maps: usize,
}

#[derive(Default)]
pub struct DeviceMemory {
    regions: BTreeMap<u64, Region>,
    storage: HashMap<u64, Storage>,
    /// `cuMemAddressReserve` ranges: start and bytes.
    reservations: BTreeMap<u64, usize>,
    next: u64,
    next_handle: u64,
    /// Bytes of storage now, and the most ever.
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
            next_handle: 0x5EED_0000,
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

    /// Fresh address space of `bytes`, with a gap after it.
    fn addresses(&mut self, bytes: usize) -> u64 {
        let at = self.next;
        self.next += (bytes as u64).div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN + DEVICE_ALIGN;
        at
    }

    /// New storage of `bytes`, or None when the card would be over its
    /// size. The real driver leaves new memory undefined; this one fills it
    /// with 0xFF bytes (NaN as f32), so nothing can rely on lucky zeros.
    fn new_storage(&mut self, key: u64, bytes: usize, handle_held: bool) -> bool {
        if bytes == 0 || self.live_bytes + bytes > self.total_bytes {
            self.log(format!("alloc {bytes} refused (live {})", self.live_bytes));
            return false;
        }
        self.storage.insert(
            key,
            Storage {
                bytes: vec![0xFF; bytes],
                handle_held,
                maps: 0,
            },
        );
        self.live_bytes += bytes;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        self.allocs_made += 1;
        true
    }

    /// Drops storage `key` once nothing holds it.
    fn drop_if_unheld(&mut self, key: u64) {
        let s = &self.storage[&key];
        if s.handle_held || s.maps > 0 {
            return;
        }
        let bytes = s.bytes.len();
        self.storage.remove(&key);
        self.live_bytes -= bytes;
        self.frees_made += 1;
        self.log(format!("free {bytes} (live {})", self.live_bytes));
    }

    /// `cuMemAlloc`: `bytes` of device memory at a fresh address, or None
    /// when the card would be over its size.
    pub fn alloc(&mut self, bytes: usize) -> Option<u64> {
        let at = self.next;
        if !self.new_storage(at, bytes, false) {
            return None;
        }
        self.addresses(bytes);
        self.storage.get_mut(&at).expect("just made").maps = 1;
        self.regions.insert(
            at,
            Region {
                bytes,
                key: at,
                offset: 0,
                access: true,
            },
        );
        self.log(format!(
            "alloc {bytes} at {at:#x} (live {})",
            self.live_bytes
        ));
        Some(at)
    }

    /// `cuMemFree`: frees the allocation that starts at `at`; Err when none
    /// does.
    pub fn free(&mut self, at: u64) -> Result<usize, String> {
        match self.regions.get(&at) {
            Some(r) if r.key == at => {
                let bytes = r.bytes;
                self.regions.remove(&at);
                self.storage
                    .get_mut(&at)
                    .expect("a cuMemAlloc's storage")
                    .maps = 0;
                self.drop_if_unheld(at);
                Ok(bytes)
            }
            _ => Err(format!(
                "cuMemFree({at:#x}): no cuMemAlloc starts there{}",
                self.describe(at)
            )),
        }
    }

    /// `cuMemAddressReserve`: `bytes` of addresses, no memory.
    pub fn reserve(&mut self, bytes: usize) -> Result<u64, String> {
        if bytes == 0 || !(bytes as u64).is_multiple_of(DEVICE_ALIGN) {
            return Err(format!(
                "cuMemAddressReserve({bytes}): not a positive multiple of the granularity {DEVICE_ALIGN}"
            ));
        }
        let at = self.addresses(bytes);
        self.reservations.insert(at, bytes);
        self.log(format!(
            "reserve {bytes} at {at:#x} (live {})",
            self.live_bytes
        ));
        Ok(at)
    }

    /// `cuMemAddressFree`: the whole of one reservation, nothing mapped in it.
    pub fn unreserve(&mut self, at: u64, bytes: usize) -> Result<(), String> {
        if self.reservations.get(&at) != Some(&bytes) {
            return Err(format!(
                "cuMemAddressFree({at:#x}, {bytes}): not a reservation"
            ));
        }
        let end = at + bytes as u64;
        if let Some((s, _)) = self.regions.range(at..end).next() {
            return Err(format!(
                "cuMemAddressFree({at:#x}, {bytes}): {s:#x} is still mapped (cuMemUnmap first)"
            ));
        }
        self.reservations.remove(&at);
        self.log(format!(
            "unreserve {bytes} at {at:#x} (live {})",
            self.live_bytes
        ));
        Ok(())
    }

    /// `cuMemCreate`: a handle to `bytes` of physical memory, or None when
    /// the card would be over its size.
    pub fn create(&mut self, bytes: usize) -> Result<Option<u64>, String> {
        if bytes == 0 || !(bytes as u64).is_multiple_of(DEVICE_ALIGN) {
            return Err(format!(
                "cuMemCreate({bytes}): not a positive multiple of the granularity {DEVICE_ALIGN}"
            ));
        }
        self.next_handle += 1;
        let h = self.next_handle;
        if !self.new_storage(h, bytes, true) {
            return Ok(None);
        }
        self.log(format!(
            "alloc {bytes} handle {h:#x} (live {})",
            self.live_bytes
        ));
        Ok(Some(h))
    }

    /// `cuMemRelease`: the memory goes once no mapping uses it.
    pub fn release(&mut self, handle: u64) -> Result<(), String> {
        match self.storage.get_mut(&handle) {
            Some(s) if s.handle_held => {
                s.handle_held = false;
                self.drop_if_unheld(handle);
                Ok(())
            }
            _ => Err(format!("cuMemRelease({handle:#x}): not a live handle")),
        }
    }

    /// `cuMemMap`: `bytes` of `handle` from `offset` at `at`, inside one
    /// reservation, over nothing mapped.
    pub fn map(&mut self, at: u64, bytes: usize, offset: usize, handle: u64) -> Result<(), String> {
        let what = || format!("cuMemMap({at:#x}, {bytes}, {offset}, {handle:#x})");
        if bytes == 0 || !(at | bytes as u64 | offset as u64).is_multiple_of(DEVICE_ALIGN) {
            return Err(format!("{}: not aligned to the granularity", what()));
        }
        let end = at + bytes as u64;
        let inside = self
            .reservations
            .range(..=at)
            .next_back()
            .is_some_and(|(&s, &b)| end <= s + b as u64);
        if !inside {
            return Err(format!("{}: outside every reservation", what()));
        }
        let below = self.regions.range(..at).next_back();
        if below.is_some_and(|(&s, r)| s + r.bytes as u64 > at)
            || self.regions.range(at..end).next().is_some()
        {
            return Err(format!("{}: the range is already mapped", what()));
        }
        match self.storage.get_mut(&handle) {
            Some(s) if s.handle_held && offset + bytes <= s.bytes.len() => s.maps += 1,
            _ => return Err(format!("{}: not a live handle of that size", what())),
        }
        self.regions.insert(
            at,
            Region {
                bytes,
                key: handle,
                offset,
                access: false,
            },
        );
        Ok(())
    }

    /// `cuMemUnmap`: every mapping inside `[at, at + bytes)`, which must
    /// cover them whole. The caller must have waited for the work that uses
    /// them: queued work that touches them later fails here.
    pub fn unmap(&mut self, at: u64, bytes: usize) -> Result<(), String> {
        let end = at + bytes as u64;
        let below = self.regions.range(..at).next_back();
        if below.is_some_and(|(&s, r)| s + r.bytes as u64 > at) {
            return Err(format!(
                "cuMemUnmap({at:#x}, {bytes}): cuts a mapping that starts below it"
            ));
        }
        let hit: Vec<u64> = self.regions.range(at..end).map(|(&s, _)| s).collect();
        if hit.is_empty() {
            return Err(format!(
                "cuMemUnmap({at:#x}, {bytes}): nothing mapped there"
            ));
        }
        for s in &hit {
            let r = &self.regions[s];
            if s + r.bytes as u64 > end || r.key == *s {
                return Err(format!(
                    "cuMemUnmap({at:#x}, {bytes}): {s:#x} is not a cuMemMap inside the range"
                ));
            }
        }
        for s in hit {
            let r = self.regions.remove(&s).expect("listed above");
            self.storage.get_mut(&r.key).expect("mapped storage").maps -= 1;
            self.drop_if_unheld(r.key);
        }
        Ok(())
    }

    /// `cuMemSetAccess`: read and write for the mappings in the range, which
    /// must be mapped throughout.
    pub fn set_access(&mut self, at: u64, bytes: usize) -> Result<(), String> {
        self.pieces(at, bytes, false)?;
        let end = at + bytes as u64;
        let first = self
            .regions
            .range(..=at)
            .next_back()
            .map_or(at, |(&s, _)| s);
        for (_, r) in self.regions.range_mut(first..end) {
            r.access = true;
        }
        Ok(())
    }

    /// Where `addr` is relative to the mapped ranges, for error messages.
    pub fn describe(&self, addr: u64) -> String {
        match self.regions.range(..=addr).next_back() {
            Some((base, r)) => format!(
                " (nearest mapping below: {base:#x}, {} bytes, ends {:#x})",
                r.bytes,
                base + r.bytes as u64
            ),
            None => " (below every mapping)".to_string(),
        }
    }

    /// `[addr, addr + len)` as pieces of storage in address order: (key,
    /// offset, bytes). Err unless mapped throughout (and, `need_access`,
    /// accessible).
    fn pieces(
        &self,
        addr: u64,
        len: usize,
        need_access: bool,
    ) -> Result<Vec<(u64, usize, usize)>, String> {
        let outside = || {
            format!(
                "{len} bytes at {addr:#x} are outside every allocation{}",
                self.describe(addr)
            )
        };
        let mut out = Vec::new();
        let mut at = addr;
        let end = addr.checked_add(len as u64).ok_or_else(outside)?;
        loop {
            let (&start, r) = self.regions.range(..=at).next_back().ok_or_else(outside)?;
            let off = (at - start) as usize;
            if off > r.bytes || (off == r.bytes && at < end) {
                return Err(outside());
            }
            if need_access && !r.access {
                return Err(format!(
                    "{len} bytes at {addr:#x}: mapped without cuMemSetAccess"
                ));
            }
            let n = (r.bytes - off).min((end - at) as usize);
            out.push((r.key, r.offset + off, n));
            at += n as u64;
            if at == end {
                return Ok(out);
            }
        }
    }

    /// The storage and offset of `[addr, addr + len)` when one accessible
    /// mapping holds all of it (every kernel's load and store).
    fn within_one(&self, addr: u64, len: usize) -> Option<(u64, usize)> {
        let (&start, r) = self.regions.range(..=addr).next_back()?;
        let off = (addr - start) as usize;
        (r.access && off.checked_add(len)? <= r.bytes).then_some((r.key, r.offset + off))
    }

    pub fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), String> {
        if let Some((key, off)) = self.within_one(addr, out.len()) {
            out.copy_from_slice(&self.storage[&key].bytes[off..off + out.len()]);
            return Ok(());
        }
        let mut done = 0;
        for (key, off, n) in self.pieces(addr, out.len(), true)? {
            out[done..done + n].copy_from_slice(&self.storage[&key].bytes[off..off + n]);
            done += n;
        }
        Ok(())
    }

    pub fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), String> {
        if let Some((key, off)) = self.within_one(addr, data.len()) {
            let s = self.storage.get_mut(&key).expect("mapped storage");
            s.bytes[off..off + data.len()].copy_from_slice(data);
            return Ok(());
        }
        let mut done = 0;
        for (key, off, n) in self.pieces(addr, data.len(), true)? {
            let s = self.storage.get_mut(&key).expect("mapped storage");
            s.bytes[off..off + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        Ok(())
    }

    pub fn fill(&mut self, addr: u64, value: u8, len: usize) -> Result<(), String> {
        for (key, off, n) in self.pieces(addr, len, true)? {
            let s = self.storage.get_mut(&key).expect("mapped storage");
            s.bytes[off..off + n].fill(value);
        }
        Ok(())
    }

    /// Checks `[addr, addr + len)` is device memory (no copy).
    pub fn check(&self, addr: u64, len: usize) -> Result<(), String> {
        self.pieces(addr, len, true).map(|_| ())
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
