//! The tracked pool. Every tensor buffer is allocated here, tagged with a
//! [`Category`] and a name, so live and peak bytes are facts, not estimates.
//!
//! * Accounting is by the bytes of storage tensors hold (`live`), per category
//!   and in total, with peaks. `reserved` counts the memory held from the
//!   system (live blocks, their rounding, and free cached blocks whose
//!   pages were not given back), like PyTorch's reserved vs allocated.
//! * Storage comes from a caching block allocator ([`arena`]): best fit,
//!   split and merge, so a training step does no system allocation after
//!   the first, even when its sizes vary.
//! * An optional hard budget on live bytes: a request that would cross it
//!   fails with [`Error::OutOfBudget`] and a [`BudgetReport`]. Reserved
//!   memory (what the system holds for the pool) is kept under the budget
//!   as well, from the first allocation on:
//!   one segment of twice the budget's address space, whose pages are held
//!   only as blocks are handed out (host pages the kernel commits on first
//!   touch; device pages of 2 MiB mapped with CUDA's virtual memory calls).
//!   Before a request would hold more than the budget, free blocks' pages
//!   go back to the system (`madvise`; `cuMemUnmap`). So fragmentation (no
//!   free block large enough, though the live bytes fit) costs address
//!   space, not memory; what rounding to pages adds is counted in
//!   [`MemoryStats::reserved_peak`], which the planner's simulation
//!   predicts.
//! * An optional timeline records every alloc/free event.
//! * A pool allocates on one [`Device`]. A pool on the *meta* device
//!   ([`Pool::shapes_only`], [`Pool::on`]) does the same accounting with
//!   empty storage, and the backend runs no kernels on it: running the
//!   executor on it predicts the exact allocation sequence and peak of a
//!   step in microseconds, without the memory (the planner's simulator).

pub(crate) mod arena;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub use crate::accounting::{BudgetReport, ByCategory, Category, Tag, fmt_bytes};
use crate::device::{Device, Target};
use crate::error::{Error, Result};
use crate::tensor::{DType, Lease, Lender, Shape, Storage, Tensor};
use arena::{Arena, block_size};

/// Segment size of a pool without a budget: large enough that a ResNet-50
/// step's buffers share a few segments (and free neighbours can merge).
const SEGMENT_BYTES: usize = 64 << 20;
/// A segment under a budget spans this many times the budget of address
/// space (its pages are held only where blocks were handed out, and given
/// back before the budget is crossed).
const SPACE_PER_BUDGET: usize = 2;
/// Under a budget, the one arena segment is at most this large, so a huge
/// budget does not ask the system for an address range beyond reason.
const MAX_SEGMENT_BYTES: usize = 64 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Alloc,
    Free,
}

/// One timeline entry.
#[derive(Clone, Debug)]
pub struct Event {
    /// Seconds since recording started.
    pub seconds: f64,
    pub kind: EventKind,
    pub tag: Tag,
    pub id: u64,
    pub category: Category,
    pub bytes: usize,
    /// Total live bytes after the event.
    pub live_total: usize,
}

/// A snapshot of the pool's counters.
#[derive(Clone, Debug, Default)]
pub struct MemoryStats {
    pub live: ByCategory,
    /// Each category's own high-water mark.
    pub peak: ByCategory,
    /// The highest total of live bytes.
    pub peak_total: usize,
    /// Live bytes per category at the moment `peak_total` was reached.
    pub at_peak: ByCategory,
    /// Memory held from the system (at most): the pages (4 KiB on the
    /// host, 2 MiB on a device) of blocks in use and of free blocks whose
    /// pages were not given back.
    pub reserved: usize,
    /// The highest `reserved` so far.
    pub reserved_peak: usize,
    /// Address space of the segments.
    pub mapped: usize,
    /// Segments asked of the system.
    pub system_allocs: u64,
    /// Their bytes.
    pub system_alloc_bytes: usize,
    /// Storage requests served from cached segments.
    pub reuses: u64,
    /// The largest buffers live when `peak_total` was reached, as (tag,
    /// category, bytes), largest first: what sets the peak. Filled only by
    /// a pool asked to ([`Pool::record_peak_buffers`]; the planner's
    /// simulator is).
    pub largest_at_peak: Vec<(String, Category, usize)>,
}

/// How many buffers [`MemoryStats::largest_at_peak`] names.
pub const PEAK_BUFFERS: usize = 8;

struct LiveEntry {
    tag: Tag,
    category: Category,
    bytes: usize,
}

#[derive(Default)]
struct PoolState {
    live: [usize; 6],
    peak: [usize; 6],
    live_total: usize,
    peak_total: usize,
    at_peak: [usize; 6],
    budget: Option<usize>,
    /// The budget the arena's segments are shaped by: `budget`, or (a
    /// simulation) one that lays them out without refusing anything.
    segment_budget: Option<usize>,
    arena: Arena,
    reserved_peak: usize,
    system_allocs: u64,
    system_alloc_bytes: usize,
    reuses: u64,
    next_id: u64,
    entries: HashMap<u64, LiveEntry>,
    timeline: Option<Vec<Event>>,
    timeline_start: Option<std::time::Instant>,
    /// Whether a new peak snapshots its largest buffers.
    peak_buffers_on: bool,
    largest_at_peak: Vec<(String, Category, usize)>,
}

impl PoolState {
    /// A block of at least `bytes` (a block size): from the arena's free
    /// blocks, else from a new segment.
    fn take_block(&mut self, bytes: usize) -> Result<arena::Place> {
        let place = self.take_block_unrecorded(bytes)?;
        self.reserved_peak = self.reserved_peak.max(self.arena.resident());
        Ok(place)
    }

    fn take_block_unrecorded(&mut self, bytes: usize) -> Result<arena::Place> {
        if let Some(budget) = self.segment_budget
            && self.arena.resident() + bytes > budget
        {
            // Under a budget the free blocks' pages go back to the system
            // before the request would hold more than the budget. So
            // fragmentation costs address space, not memory.
            self.arena.forget_free_pages(budget.saturating_sub(bytes))?;
        }
        if let Some(place) = self.take_from_arena(bytes)? {
            self.reuses += 1;
            return Ok(place);
        }
        let segment = match self.segment_budget {
            None => bytes.max(SEGMENT_BYTES),
            Some(budget) => {
                // Pages cost memory only where blocks are handed out: the
                // segment is address space beyond the budget, for the
                // blocks that fragmentation scatters (the budget bounds the
                // pages).
                let (space, most) = (budget.saturating_mul(SPACE_PER_BUDGET), MAX_SEGMENT_BYTES);
                let room = |a: &Arena| space.saturating_sub(a.mapped());
                if room(&self.arena) < bytes {
                    // Unused segments (say, from before the budget was
                    // set) make way for one that can hold the request.
                    let short = bytes - room(&self.arena);
                    self.arena.release_unused(short);
                }
                let room = room(&self.arena);
                if room >= bytes {
                    // All the room the budget leaves, in one segment: every
                    // later block is carved from it and its free neighbours
                    // merge, so the step settles into it.
                    (room / arena::BLOCK_ALIGN * arena::BLOCK_ALIGN).min(most.max(bytes))
                } else {
                    // The request fits the budget's live bytes, but no free
                    // block is large enough (fragmentation): go over the
                    // budget's reserve rather than fail a step that fits.
                    bytes
                }
            }
        };
        let segment = match self.arena.add_segment(segment) {
            Ok(made) => made,
            // The system may refuse the address space the budget asks
            // for: give back the cached unused segments and ask for the
            // request alone, as PyTorch's caching allocator does before it
            // reports OOM.
            Err(_) => {
                self.arena.release_unused(usize::MAX);
                self.arena.add_segment(bytes)?
            }
        };
        self.system_allocs += 1;
        self.system_alloc_bytes += segment;
        Ok(self
            .take_from_arena(bytes)?
            .expect("a new segment holds the request"))
    }

    /// [`Arena::take`]; when a device has no memory for the block's pages
    /// (another process, or a card smaller than the budget), every free
    /// block's pages go back first and it tries once more.
    fn take_from_arena(&mut self, bytes: usize) -> Result<Option<arena::Place>> {
        match self.arena.take(bytes) {
            Err(Error::Cuda { .. }) => {
                self.arena.forget_free_pages(0)?;
                self.arena.take(bytes)
            }
            taken => taken,
        }
    }

    /// Live buffers as (tag, category, bytes), largest first.
    fn live_buffers(&self) -> Vec<(String, Category, usize)> {
        let mut v: Vec<_> = self
            .entries
            .values()
            .map(|e| (e.tag.to_string(), e.category, e.bytes))
            .collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        v
    }

    /// The [`PEAK_BUFFERS`] largest live buffers, largest first.
    fn largest_buffers(&self) -> Vec<(String, Category, usize)> {
        let mut v: Vec<(&LiveEntry, usize)> = self.entries.values().map(|e| (e, e.bytes)).collect();
        let keep = PEAK_BUFFERS.min(v.len());
        if keep < v.len() {
            v.select_nth_unstable_by(keep, |a, b| b.1.cmp(&a.1));
            v.truncate(keep);
        }
        let mut v: Vec<_> = v
            .into_iter()
            .map(|(e, b)| (e.tag.to_string(), e.category, b))
            .collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        v
    }

    fn report(&self, tag: &Tag, category: Category, requested: usize) -> BudgetReport {
        let mut largest = self.live_buffers();
        largest.truncate(8);
        BudgetReport {
            tag: tag.to_string(),
            category,
            requested,
            budget: self.budget.unwrap_or(usize::MAX),
            live: ByCategory(self.live),
            largest,
        }
    }
}

/// A handle to the pool; clones share it.
#[derive(Clone)]
pub struct Pool {
    state: Arc<Mutex<PoolState>>,
    /// Where the storage lives; on the meta device it is empty and
    /// kernels do not run (accounting only).
    device: Device,
}

impl Default for Pool {
    fn default() -> Self {
        Pool::on(Device::Cpu)
    }
}

impl Pool {
    /// A pool of host memory.
    pub fn new() -> Self {
        Pool::default()
    }

    /// A pool whose storage lives on `device`.
    ///
    /// A pool on a CUDA device takes its segments from device memory
    /// (reserved addresses with 2 MiB pages mapped into them, started on
    /// first use: a missing driver is an error at
    /// the first allocation, never a panic).
    pub fn on(device: Device) -> Self {
        let source = match device {
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Device::Cuda(n) => arena::Source::Cuda(n),
            Device::Meta(target) => arena::Source::Meta {
                page: if target == Target::Cpu {
                    arena::HOST_PAGE
                } else {
                    arena::DEVICE_PAGE
                },
            },
            Device::Cpu => arena::Source::Host,
        };
        let state = PoolState {
            arena: Arena::new(source),
            ..PoolState::default()
        };
        Pool {
            state: Arc::new(Mutex::new(state)),
            device,
        }
    }

    /// The device this pool's storage lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// A pool that refuses to hold more than `budget` live bytes.
    pub fn with_budget(budget: usize) -> Self {
        let pool = Pool::new();
        pool.set_budget(Some(budget));
        pool
    }

    /// A pool on the meta device standing in for this machine's CPU: it
    /// accounts for every allocation but backs none with memory; tensors
    /// from it have empty storage and the backend runs no kernels on them,
    /// so a step run on it reproduces the real step's allocations exactly.
    pub fn shapes_only() -> Self {
        Pool::on(Device::Meta(Target::Cpu))
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        lock(&self.state)
    }

    pub fn set_budget(&self, budget: Option<usize>) {
        let mut s = self.lock();
        s.budget = budget;
        s.segment_budget = budget;
    }

    /// Shapes the arena's segments as under `budget` (see [`Pool::set_budget`])
    /// without refusing what crosses it: a simulation measures how far a
    /// step goes over, in live and in reserved bytes, where a refusal would
    /// stop it at the first allocation.
    pub fn shape_segments_by(&self, budget: Option<usize>) {
        self.lock().segment_budget = budget;
    }

    pub fn budget(&self) -> Option<usize> {
        self.lock().budget
    }

    /// Start (or restart) recording a timeline of events.
    pub fn record_timeline(&self, on: bool) {
        let mut s = self.lock();
        s.timeline = if on { Some(Vec::new()) } else { None };
        s.timeline_start = on.then(std::time::Instant::now);
    }

    pub fn timeline(&self) -> Vec<Event> {
        self.lock().timeline.clone().unwrap_or_default()
    }

    pub fn stats(&self) -> MemoryStats {
        let s = self.lock();
        MemoryStats {
            live: ByCategory(s.live),
            peak: ByCategory(s.peak),
            peak_total: s.peak_total,
            at_peak: ByCategory(s.at_peak),
            largest_at_peak: s.largest_at_peak.clone(),
            reserved: s.arena.resident(),
            reserved_peak: s.reserved_peak,
            mapped: s.arena.mapped(),
            system_allocs: s.system_allocs,
            system_alloc_bytes: s.system_alloc_bytes,
            reuses: s.reuses,
        }
    }

    pub fn live_bytes(&self) -> usize {
        self.lock().live_total
    }

    /// Forget the peaks: they restart from what is live now.
    pub fn reset_peak(&self) {
        let mut s = self.lock();
        s.peak = s.live;
        s.peak_total = s.live_total;
        s.at_peak = s.live;
        if s.peak_buffers_on {
            s.largest_at_peak = s.largest_buffers();
        }
    }

    /// Snapshot the largest live buffers at every new peak
    /// ([`MemoryStats::largest_at_peak`]). Off by default: a snapshot walks
    /// the live buffers, and a first forward sets a new peak at almost
    /// every allocation.
    pub fn record_peak_buffers(&self, on: bool) {
        let mut s = self.lock();
        s.peak_buffers_on = on;
        s.largest_at_peak = if on { s.largest_buffers() } else { Vec::new() };
    }

    /// Return every unused segment to the system.
    pub fn empty_cache(&self) {
        self.lock().arena.release_unused(usize::MAX);
    }

    /// Live buffers as (tag, category, bytes), largest first.
    pub fn live_buffers(&self) -> Vec<(String, Category, usize)> {
        self.lock().live_buffers()
    }

    /// A tensor whose contents are unspecified (whatever the reused storage
    /// held, or zeros when fresh). Callers must overwrite every element.
    pub fn empty(
        &self,
        dims: &[usize],
        dtype: DType,
        category: Category,
        tag: Tag,
    ) -> Result<Tensor> {
        self.allocate(Shape::new(dims), dtype, category, tag, false)
    }

    /// A zero-filled tensor.
    pub fn zeros(
        &self,
        dims: &[usize],
        dtype: DType,
        category: Category,
        tag: Tag,
    ) -> Result<Tensor> {
        self.allocate(Shape::new(dims), dtype, category, tag, true)
    }

    /// Shorthands for f32 tensors, the common case.
    pub fn empty_f32(&self, dims: &[usize], category: Category, tag: Tag) -> Result<Tensor> {
        self.empty(dims, DType::F32, category, tag)
    }

    pub fn zeros_f32(&self, dims: &[usize], category: Category, tag: Tag) -> Result<Tensor> {
        self.zeros(dims, DType::F32, category, tag)
    }

    /// An f32 tensor holding a copy of `values`.
    pub fn from_f32(
        &self,
        dims: &[usize],
        values: &[f32],
        category: Category,
        tag: Tag,
    ) -> Result<Tensor> {
        let shape = Shape::new(dims);
        if shape.numel() != values.len() {
            return Err(Error::ShapeMismatch {
                op: "Pool::from_f32",
                expected: format!("{} values for {dims:?}", shape.numel()),
                got: values.len().to_string(),
            });
        }
        let mut t = self.allocate(shape, DType::F32, category, tag, false)?;
        // The pool sits under the backends: it fills host storage itself
        // and uploads to a device through the device's stream.
        match self.device {
            Device::Cpu => t.f32_mut().copy_from_slice(values),
            Device::Meta(_) => {}
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Device::Cuda(n) => crate::device::cuda::core(n)?.upload(t.device_address(), values)?,
        }
        Ok(t)
    }

    /// Zeroes fresh storage: host bytes, or a memset on the device's stream.
    #[inline]
    fn zero(&self, st: &mut Storage) -> Result<()> {
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        if let Device::Cuda(n) = self.device {
            let core = crate::device::cuda::core(n)?;
            return Ok(core.memset_zero(st.device_address(), st.len() * st.dtype().unit_bytes())?);
        }
        st.fill_zero();
        Ok(())
    }

    fn allocate(
        &self,
        shape: Shape,
        dtype: DType,
        category: Category,
        tag: Tag,
        zero: bool,
    ) -> Result<Tensor> {
        let numel = shape.numel();
        let bytes = dtype.storage_bytes(numel);
        let len = if self.device.computes() {
            dtype.storage_len(numel)
        } else {
            0
        };
        let mut s = self.lock();
        if let Some(budget) = s.budget
            && s.live_total + bytes > budget
        {
            return Err(Error::OutOfBudget(Box::new(
                s.report(&tag, category, bytes),
            )));
        }
        // The meta device lays out blocks too (holding no elements), so its
        // segments and their fragmentation are the real pool's.
        let storage = if dtype.storage_len(numel) == 0 {
            Storage::empty(dtype)
        } else {
            let place = s.take_block(block_size(bytes))?;
            let mut st = Storage::in_block(s.arena.address(place), dtype, len, place);
            if zero {
                self.zero(&mut st)?;
            }
            st
        };
        let id = s.next_id;
        s.next_id += 1;
        let c = category.index();
        s.live[c] += bytes;
        s.live_total += bytes;
        s.peak[c] = s.peak[c].max(s.live[c]);
        let new_peak = s.live_total > s.peak_total;
        if new_peak {
            s.peak_total = s.live_total;
            s.at_peak = s.live;
        }
        let live_total = s.live_total;
        let seconds = s.timeline_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
        if let Some(tl) = s.timeline.as_mut() {
            tl.push(Event {
                seconds,
                tag: tag.clone(),
                kind: EventKind::Alloc,
                id,
                category,
                bytes,
                live_total,
            });
        }
        s.entries.insert(
            id,
            LiveEntry {
                tag,
                category,
                bytes,
            },
        );
        if new_peak && s.peak_buffers_on {
            s.largest_at_peak = s.largest_buffers();
        }
        drop(s);
        let lender: Arc<dyn Lender> = self.state.clone();
        let lease = Lease::new(lender, id, bytes, self.device);
        Ok(Tensor::from_parts(shape, storage, lease))
    }
}

/// Locks a pool's state. A panic while holding the lock leaves counters
/// that are still consistent (each update is a few integer writes), so
/// recover.
fn lock(state: &Mutex<PoolState>) -> MutexGuard<'_, PoolState> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// The pool's side of a tensor's loan: storage comes back here.
impl Lender for Mutex<PoolState> {
    fn give_back(&self, id: u64, storage: Storage) {
        let mut s = lock(self);
        let Some(entry) = s.entries.remove(&id) else {
            return;
        };
        let c = entry.category.index();
        s.live[c] -= entry.bytes;
        s.live_total -= entry.bytes;
        let live_total = s.live_total;
        let seconds = s.timeline_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
        if let Some(tl) = s.timeline.as_mut() {
            tl.push(Event {
                seconds,
                tag: entry.tag.clone(),
                kind: EventKind::Free,
                id,
                category: entry.category,
                bytes: entry.bytes,
                live_total,
            });
        }
        if let Some(place) = storage.place() {
            s.arena.give(place);
        }
    }

    fn meta_of(&self, id: u64) -> Option<(Tag, Category)> {
        lock(self)
            .entries
            .get(&id)
            .map(|e| (e.tag.clone(), e.category))
    }

    fn lend(
        self: Arc<Self>,
        device: Device,
        shape: Shape,
        dtype: DType,
        category: Category,
        tag: Tag,
        zero: bool,
    ) -> Result<Tensor> {
        Pool {
            state: self,
            device,
        }
        .allocate(shape, dtype, category, tag, zero)
    }

    fn tag_of(&self, id: u64) -> String {
        lock(self)
            .entries
            .get(&id)
            .map(|e| e.tag.to_string())
            .unwrap_or_else(|| format!("#{id}"))
    }
}

/// Writes a timeline as CSV (`seconds,event,category,tensor,bytes,live_total`)
/// for plotting.
pub fn write_timeline_csv(events: &[Event], path: &std::path::Path) -> Result<()> {
    use std::io::Write;
    let io_err = |e: std::io::Error| Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).map_err(io_err)?);
    writeln!(w, "seconds,event,category,tensor,bytes,live_total").map_err(io_err)?;
    for e in events {
        let kind = match e.kind {
            EventKind::Alloc => "alloc",
            EventKind::Free => "free",
        };
        writeln!(
            w,
            "{:.6},{kind},{},{},{},{}",
            e.seconds,
            e.category.name(),
            e.tag,
            e.bytes,
            e.live_total
        )
        .map_err(io_err)?;
    }
    w.flush().map_err(io_err)
}

/// The process's peak resident memory (`VmHWM` of `/proc/self/status`),
/// reported beside the tracked peak: it includes what the pool cannot see
/// (the binary, thread stacks, the GEMM's packing buffers, the loader's
/// batches in flight). `None` where the file does not exist (not Linux).
pub fn process_peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// This machine's physical memory (`MemTotal` of `/proc/meminfo`).
pub fn physical_memory_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A warning for a budget the machine cannot hold: above its physical
/// memory, the budget bounds nothing and the run would swap or be killed.
pub fn budget_warning(budget: usize, physical: Option<usize>) -> Option<String> {
    let physical = physical?;
    (budget > physical).then(|| {
        format!(
            "--memory-budget {} is more than this machine's physical memory ({}): it will not stop the run from swapping or being killed",
            fmt_bytes(budget),
            fmt_bytes(physical)
        )
    })
}

/// Parses a byte size: `4GiB`, `512MB`, `1.5G`, `1048576`. Binary units
/// (KiB, MiB, GiB, TiB; K, M, G, T alone are binary too) and decimal ones
/// (KB, MB, GB, TB).
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        Error::invalid(
            "size",
            format!("'{s}' is not a size (examples: 4GiB, 512MB, 1048576)"),
        )
    };
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The snapshot is the live set when the total peaked, largest first,
    /// capped at PEAK_BUFFERS, and later smaller totals leave it alone.
    #[test]
    fn the_largest_buffers_at_the_peak_are_remembered() {
        let pool = Pool::shapes_only();
        pool.record_peak_buffers(true);
        let t = |n: usize, name: &'static str| {
            pool.empty_f32(&[n], Category::Activations, Tag::fixed(name))
                .unwrap()
        };
        let small: Vec<Tensor> = (0..PEAK_BUFFERS).map(|_| t(1, "small")).collect();
        let a = t(1000, "a");
        let b = t(3000, "b");
        drop(a);
        let c = t(500, "c"); // below the peak (small + a + b)
        let stats = pool.stats();
        assert_eq!(stats.largest_at_peak.len(), PEAK_BUFFERS);
        assert_eq!(
            stats.largest_at_peak[0],
            ("b".into(), Category::Activations, 12000)
        );
        assert_eq!(
            stats.largest_at_peak[1],
            ("a".into(), Category::Activations, 4000)
        );
        assert!(stats.largest_at_peak[2..].iter().all(|e| e.0 == "small"));
        drop((b, c, small));
        pool.record_peak_buffers(false);
        assert!(pool.stats().largest_at_peak.is_empty());
        // Off by default.
        assert!(Pool::shapes_only().stats().largest_at_peak.is_empty());
    }

    #[test]
    fn a_budget_above_physical_memory_is_warned_about() {
        let gib = 1 << 30;
        let w = budget_warning(64 * gib, Some(16 * gib)).expect("a warning");
        assert!(w.contains("64.00 GiB") && w.contains("16.00 GiB"), "{w}");
        assert_eq!(budget_warning(8 * gib, Some(16 * gib)), None);
        assert_eq!(budget_warning(8 * gib, None), None);
        // On Linux both readings exist and are plausible.
        if cfg!(target_os = "linux") {
            assert!(physical_memory_bytes().is_some_and(|b| b > 1 << 20));
            assert!(process_peak_rss_bytes().is_some_and(|b| b > 0));
        }
    }

    #[test]
    fn parses_sizes_and_rejects_nonsense() {
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512MB").unwrap(), 512_000_000);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes(" 1048576 ").unwrap(), 1 << 20);
        for bad in ["", "GiB", "-4GiB", "4 parsecs", "0", "1..2G", "nan"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} accepted");
        }
    }

    const MIB: usize = 1 << 20;

    #[test]
    fn scratch_comes_from_the_tensors_pool_as_workspace_and_goes_back() {
        let pool = Pool::with_budget(MIB);
        let x = pool
            .zeros_f32(&[1000], Category::Activations, Tag::fixed("x"))
            .unwrap();
        {
            let s = x.scratch(10, Tag::fixed("scratch"), true).unwrap();
            assert_eq!(
                (s.numel(), s.dtype(), s.device()),
                (3, DType::F32, Device::Cpu)
            );
            assert!(s.f32().iter().all(|&v| v == 0.0));
            assert_eq!(s.meta().1, Category::Workspace);
            let st = pool.stats();
            assert_eq!(st.live.get(Category::Workspace), 12);
            assert_eq!(st.live.total(), 4000 + 12);
            // The pool's budget holds for scratch too.
            assert!(x.scratch(MIB, Tag::fixed("too big"), false).is_err());
        }
        assert_eq!(pool.stats().live.get(Category::Workspace), 0);
        assert_eq!(pool.stats().peak.get(Category::Workspace), 12);
        // A meta tensor's scratch is counted, not backed.
        let meta = Pool::shapes_only();
        let m = meta
            .empty_f32(&[8], Category::Activations, Tag::fixed("m"))
            .unwrap();
        let s = m.scratch(64, Tag::fixed("meta scratch"), false).unwrap();
        assert_eq!(s.device(), m.device());
        assert_eq!(meta.stats().live.get(Category::Workspace), 64);
    }

    #[test]
    fn freed_storage_serves_other_sizes_and_types() {
        let pool = Pool::new();
        let a = pool
            .zeros_f32(&[1 << 20], Category::Activations, Tag::fixed("a"))
            .unwrap();
        drop(a);
        // Smaller, and of another type: carved from the freed 4 MiB.
        let mut b = pool
            .zeros(
                &[3 << 20],
                DType::BF16,
                Category::Workspace,
                Tag::fixed("b"),
            )
            .unwrap();
        let c = pool
            .empty_f32(&[100], Category::Activations, Tag::fixed("c"))
            .unwrap();
        let s = pool.stats();
        assert_eq!((s.system_allocs, s.reuses), (1, 2));
        // The segment is address space; the pages held are those handed
        // out: b's 6 MiB over a's 4, and c's page.
        assert_eq!((s.mapped, s.reserved), (SEGMENT_BYTES, 6 * MIB + 4096));
        assert_eq!(
            s.live.total(),
            6 * MIB + 400,
            "live bytes are the requests'"
        );
        assert!(
            b.bf16().iter().all(|v| v.to_f32() == 0.0),
            "zeros() zeroes reused bytes"
        );
        b.bf16_mut()[0] = half::bf16::ONE;
        drop((b, c));
        pool.empty_cache();
        assert_eq!(pool.stats().reserved, 0, "an unused segment goes back");
    }

    #[test]
    fn a_budget_keeps_reserved_memory_under_it() {
        let budget = 10 * MIB;
        let pool = Pool::with_budget(budget);
        let f32s = |n: usize| {
            pool.empty_f32(&[n], Category::Activations, Tag::fixed("x"))
                .unwrap()
        };
        // A step-like pattern of changing sizes, repeated: one segment the
        // size of the budget serves it all.
        for _ in 0..3 {
            let a = f32s(MIB / 2); // 2 MiB
            let b = f32s(MIB); // 4 MiB
            drop(a);
            let c = f32s(MIB / 4);
            let d = f32s(3 * MIB / 8);
            drop((b, c));
            let e = f32s(3 * MIB / 2); // 6 MiB, where a, b and c were
            drop((d, e));
        }
        let s = pool.stats();
        assert_eq!((s.system_allocs, s.reuses), (1, 14));
        // One segment of address space; pages held only as far as the
        // live peak reached (e over a, b and c, beside d).
        assert_eq!(s.mapped, 2 * budget);
        assert_eq!((s.reserved, s.reserved_peak), (s.peak_total, s.peak_total));
    }

    /// Eight pieces of `unit` bytes make the peak, every other one is freed:
    /// a request of two units fits the budget but no free block.
    fn fragment(pool: &Pool, unit: usize) -> (Vec<Tensor>, Tensor) {
        let piece = |n, tag| {
            pool.empty_f32(&[n / 4], Category::Activations, Tag::fixed(tag))
                .unwrap()
        };
        let all: Vec<_> = (0..8).map(|_| piece(unit, "x")).collect();
        let odd: Vec<_> = all
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .map(|(_, t)| t)
            .collect();
        (odd, piece(2 * unit, "two"))
    }

    #[test]
    fn fragmentation_under_a_budget_costs_host_address_space_not_memory() {
        let budget = 8 * MIB;
        let pool = Pool::with_budget(budget);
        let (odd, two) = fragment(&pool, MIB);
        let s = pool.stats();
        assert_eq!((s.live.total(), s.peak_total), (6 * MIB, 8 * MIB));
        // The 2 MiB come from the segment's address space beyond the
        // budget; two free MiBs' pages went back first (as many as the
        // request needed), so what the system holds never crossed it.
        assert_eq!((s.system_allocs, s.mapped), (1, 2 * budget));
        assert_eq!((s.reserved, s.reserved_peak), (budget, budget));
        drop((odd, two));
        pool.empty_cache();
        assert_eq!(pool.stats().reserved, 0);
    }

    /// Device memory too is mapped page by page into address space beyond
    /// the budget, so fragmentation of whole device pages costs addresses,
    /// not memory.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    #[test]
    fn fragmentation_of_device_memory_costs_address_space_not_memory() {
        let page = arena::DEVICE_PAGE;
        let budget = 8 * page;
        let pool = Pool::on(Device::Meta(Target::Cuda(0)));
        pool.set_budget(Some(budget));
        let (odd, two) = fragment(&pool, page);
        let s = pool.stats();
        assert_eq!((s.live.total(), s.peak_total), (6 * page, budget));
        assert_eq!((s.system_allocs, s.mapped), (1, 2 * budget));
        assert_eq!((s.reserved, s.reserved_peak), (budget, budget));
        drop((odd, two));
        pool.empty_cache();
        assert_eq!(pool.stats().reserved, 0);
    }
}
