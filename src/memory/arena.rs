//! The pool's backing store: a caching block allocator in the style of
//! PyTorch's CUDA caching allocator, without its streams.
//!
//! Memory comes from the system in large *segments*. A request takes the
//! smallest free block that covers it (best fit) and splits off the rest;
//! a freed block merges with free neighbours in its segment. So a freed
//! 50 MiB activation can serve three 16 MiB workspaces next, and two freed
//! neighbours can serve one request of their combined size: a training step
//! whose sizes change from layer to layer still reaches a steady state that
//! asks the system for nothing, even when the segments must stay under a
//! tight budget. (The previous free list reused only exact (dtype, length)
//! matches; under a budget close to the peak it evicted and re-asked the
//! system for over 1 GiB of fresh pages per ResNet-50 step.)
//!
//! Blocks are typeless bytes: a freed f32 buffer can hold bf16 next.
//! Segments are zero-initialised when created, so every byte a block hands
//! out is initialised (old contents of whatever type, all valid bit
//! patterns for the element types here).
//!
//! A segment is address space; memory backs it page by page, only where a
//! block was handed out, and a free block's pages can go back to the system
//! while the segment stays. So fragmentation costs address space, not
//! memory, and what the pool holds is its pages (`resident`).
//! - Host segments are anonymous `mmap`s: pages committed (zeroed by the
//!   kernel) on first touch, given back with `madvise(MADV_DONTNEED)`. A
//!   budget-sized segment costs resident memory only for the bytes the step
//!   uses (`alloc_zeroed` with page alignment memsets the whole segment: a
//!   4 GiB budget made a 159 MiB run 4 GiB resident).
//! - Device segments are reserved device addresses (`cuMemAddressReserve`)
//!   with memory mapped into them in [`DEVICE_PAGE`]s when a block is
//!   handed out (`cuMemCreate` + `cuMemMap`, zeroed on the stream), unmapped
//!   when given back: PyTorch's expandable segments. With whole `cuMemAlloc`
//!   segments a step that fragments holds more than its budget (ResNet-50
//!   bf16 on a 3.5 GiB budget: 4.94 GiB held for 3.58 GiB live).

#[cfg(not(unix))]
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::{BTreeMap, BTreeSet};
use std::ptr::NonNull;

/// Block sizes and offsets are multiples of this (a cache line; every
/// element type's alignment divides it).
pub(crate) const BLOCK_ALIGN: usize = 64;
/// A host page: the unit host memory is held and given back in.
pub(crate) const HOST_PAGE: usize = 4096;
/// The unit device memory is mapped and unmapped in (each page its own
/// `cuMemCreate`). 2 MiB is the mapping granularity of current NVIDIA cards
/// (a card whose granularity does not divide it is refused), and PyTorch's
/// expandable segments' page for small blocks.
pub(crate) const DEVICE_PAGE: usize = 2 << 20;
/// A remainder smaller than this stays with the block it was cut from
/// instead of becoming a free block of its own: slivers only fragment.
const MIN_SPLIT: usize = 4096;

pub(crate) use crate::tensor::Place;

struct Block {
    bytes: usize,
    free: bool,
}

/// Page ranges of a segment, as disjoint `start..end` by start (page
/// multiples), with their total.
#[derive(Default)]
struct PageSet {
    ranges: BTreeMap<usize, usize>,
    bytes: usize,
}

/// The pages of `page` bytes a block at `offset` of `bytes` touches
/// (outward to pages).
fn pages_over(offset: usize, bytes: usize, page: usize) -> (usize, usize) {
    (
        offset / page * page,
        (offset + bytes).next_multiple_of(page),
    )
}

/// The whole pages inside a block at `offset` of `bytes` (inward): those
/// no neighbour shares.
fn pages_inside(offset: usize, bytes: usize, page: usize) -> (usize, usize) {
    (
        offset.next_multiple_of(page),
        (offset + bytes) / page * page,
    )
}

impl PageSet {
    /// Adds `start..end`; returns the bytes that were not in the set.
    fn insert(&mut self, mut start: usize, mut end: usize) -> usize {
        let before = self.bytes;
        // Ranges that overlap or touch `start..end` merge into it.
        while let Some((&s, &e)) = self
            .ranges
            .range(..=end)
            .next_back()
            .filter(|&(_, &e)| e >= start)
        {
            start = start.min(s);
            end = end.max(e);
            self.ranges.remove(&s);
            self.bytes -= e - s;
        }
        self.ranges.insert(start, end);
        self.bytes += end - start;
        self.bytes - before
    }

    /// Where a scan of the ranges meeting `start..` begins: the start of
    /// the range holding `start`, else `start`.
    fn scan_from(&self, start: usize) -> usize {
        self.ranges
            .range(..start)
            .next_back()
            .map_or(start, |(&s, _)| s)
    }

    /// Bytes of the set inside `start..end`.
    fn count(&self, start: usize, end: usize) -> usize {
        let first = self.scan_from(start);
        self.ranges
            .range(first..end)
            .map(|(&s, &e)| e.min(end).saturating_sub(s.max(start)))
            .sum()
    }

    /// The parts of `start..end` not in the set, in order.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    fn gaps(&self, start: usize, end: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut at = start;
        for (&s, &e) in self.ranges.range(self.scan_from(start)..end) {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    /// Takes `start..end` out of the set; returns the bytes removed.
    fn remove(&mut self, start: usize, end: usize) -> usize {
        let before = self.bytes;
        let first = self.scan_from(start);
        let hit: Vec<(usize, usize)> = self
            .ranges
            .range(first..end)
            .map(|(&s, &e)| (s, e))
            .filter(|&(_, e)| e > start)
            .collect();
        for (s, e) in hit {
            self.ranges.remove(&s);
            self.bytes -= e - s;
            if s < start {
                self.ranges.insert(s, start);
                self.bytes += start - s;
            }
            if e > end {
                self.ranges.insert(end, e);
                self.bytes += e - end;
            }
        }
        before - self.bytes
    }
}

/// Where an arena's segments come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Source {
    /// Host pages (an anonymous `mmap`, committed on first touch).
    #[default]
    Host,
    /// Device memory of CUDA device `n`: reserved addresses, [`DEVICE_PAGE`]s
    /// mapped into them (zeroed by a memset on the device's stream). The
    /// segment's base is the device address.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    Cuda(u32),
    /// No memory: the meta device's simulation. Blocks are laid out exactly
    /// as a real source's would be, so a simulated step predicts the
    /// reserved and resident bytes (fragmentation included), not only the
    /// live ones. `page`: [`HOST_PAGE`] (the simulation of a CPU) or
    /// [`DEVICE_PAGE`] (of a GPU).
    Meta { page: usize },
}

impl Source {
    /// The unit memory is held and given back in, and segments are
    /// sized in.
    fn page(self) -> usize {
        match self {
            Source::Host => HOST_PAGE,
            Source::Meta { page } => page,
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Source::Cuda(_) => DEVICE_PAGE,
        }
    }
}

struct Segment {
    /// The first byte: a host pointer, or (CUDA) the device address as a
    /// pointer without provenance, never dereferenced.
    base: NonNull<u8>,
    source: Source,
    bytes: usize,
    /// Every block of the segment by offset; they tile it without gaps.
    blocks: BTreeMap<usize, Block>,
    /// The pages the system may hold for the segment: those of blocks
    /// handed out since the segment was made or the pages were given back
    /// (a host block handed out is taken to be written whole; a device
    /// block's pages are mapped then).
    held: PageSet,
    /// (CUDA) The memory handle of each mapped page, by offset: exactly the
    /// pages of `held`.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    device_pages: BTreeMap<usize, u64>,
}

/// Zeroed host pages for a segment, committed lazily by the kernel; None
/// when the system refuses the mapping.
#[cfg(unix)]
fn host_pages(bytes: usize) -> Option<NonNull<u8>> {
    // SAFETY: a fresh private anonymous mapping aliases nothing; the
    // arguments are valid for any size > 0. MAP_NORESERVE: the budget is a
    // reservation of address space, not of swap.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(ptr.cast::<u8>())
}

/// Gives the pages of `bytes` at `base` (page-aligned) back to the system;
/// the next touch reads zeros.
#[cfg(unix)]
fn forget_host_pages(base: NonNull<u8>, bytes: usize) {
    // SAFETY: the range lies inside one mapping from host_pages, within a
    // free block that no storage holds. MADV_DONTNEED on a private
    // anonymous mapping drops the pages; the range stays mapped.
    unsafe {
        libc::madvise(base.as_ptr().cast(), bytes, libc::MADV_DONTNEED);
    }
}

/// Without `madvise` the pages stay.
#[cfg(not(unix))]
fn forget_host_pages(_base: NonNull<u8>, _bytes: usize) {}

/// Gives back host pages from [`host_pages`].
#[cfg(unix)]
fn free_host_pages(base: NonNull<u8>, bytes: usize) {
    // SAFETY: `base` and `bytes` are exactly one mapping from host_pages.
    unsafe {
        libc::munmap(base.as_ptr().cast(), bytes);
    }
}

#[cfg(not(unix))]
fn host_pages(bytes: usize) -> Option<NonNull<u8>> {
    let layout = Segment::layout(bytes);
    // SAFETY: bytes > 0 (every request is at least one block).
    let ptr = unsafe { alloc_zeroed(layout) };
    NonNull::new(ptr)
}

#[cfg(not(unix))]
fn free_host_pages(base: NonNull<u8>, bytes: usize) {
    // SAFETY: allocated by host_pages with this layout.
    unsafe { dealloc(base.as_ptr(), Segment::layout(bytes)) }
}

impl Segment {
    #[cfg(not(unix))]
    fn layout(bytes: usize) -> Layout {
        Layout::from_size_align(bytes, HOST_PAGE).expect("segment size fits a layout")
    }

    /// (CUDA) The mapped pages in `start..end` (page multiples), as
    /// (address, bytes, handle), taken out of `device_pages`.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    fn take_device_pages(&mut self, start: usize, end: usize) -> Vec<(u64, usize, u64)> {
        let offsets: Vec<usize> = self
            .device_pages
            .range(start..end)
            .map(|(&o, _)| o)
            .collect();
        let base = self.base.as_ptr().addr() as u64;
        offsets
            .into_iter()
            .map(|o| {
                let handle = self.device_pages.remove(&o).expect("listed");
                (base + o as u64, DEVICE_PAGE, handle)
            })
            .collect()
    }

    fn is_unused(&self) -> bool {
        self.blocks.len() == 1 && self.blocks.values().all(|b| b.free)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        match self.source {
            // Mapped by `Arena::add_segment` (host_pages) with this size; the
            // arena drops a segment only when no block of it is in use (or
            // when the pool itself goes, which outlives every tensor: each
            // holds a lease on the pool).
            Source::Host => free_host_pages(self.base, self.bytes),
            Source::Meta { .. } => {}
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Source::Cuda(n) => {
                // A drop cannot return an error; a failed unmap leaks the
                // segment (the context is torn down at exit anyway).
                if let Ok(core) = crate::device::cuda::core(n) {
                    let pages = self.take_device_pages(0, self.bytes);
                    if core.unmap(&pages).is_ok() {
                        let _ = core.free_addresses(self.base.as_ptr().addr() as u64, self.bytes);
                    }
                }
            }
        }
    }
}

// SAFETY: a segment is plain memory owned by the arena; access to its bytes
// goes through blocks that are each held by one storage at a time.
unsafe impl Send for Segment {}

/// Maps device memory into `start..end` of `seg` where no page is mapped
/// yet, one [`DEVICE_PAGE`] at a time; on failure unmaps what it mapped,
/// so the segment is as it was.
#[cfg(any(feature = "cuda", feature = "cuda-12"))]
fn map_device_pages(
    n: u32,
    seg: &mut Segment,
    start: usize,
    end: usize,
) -> crate::error::Result<()> {
    let gaps = seg.held.gaps(start, end);
    if gaps.is_empty() {
        return Ok(());
    }
    let core = crate::device::cuda::core(n)?;
    let base = seg.base.as_ptr().addr() as u64;
    let mut made: Vec<(u64, usize, u64)> = Vec::new();
    for (s, e) in gaps {
        for off in (s..e).step_by(DEVICE_PAGE) {
            match core.map_zeroed(base + off as u64, DEVICE_PAGE) {
                Ok(handle) => made.push((base + off as u64, DEVICE_PAGE, handle)),
                Err(err) => {
                    let _ = core.unmap(&made);
                    return Err(err.into());
                }
            }
        }
    }
    for (addr, _, handle) in made {
        seg.device_pages.insert((addr - base) as usize, handle);
    }
    Ok(())
}

#[derive(Default)]
pub(crate) struct Arena {
    source: Source,
    segments: Vec<Option<Segment>>,
    /// Free blocks as (bytes, segment, offset): the first entry at or above
    /// a size is the best fit, ties broken by address so runs repeat.
    free: BTreeSet<(usize, usize, usize)>,
    /// Bytes of all segments (address space).
    mapped: usize,
    /// Bytes of free blocks.
    free_bytes: usize,
    /// Bytes of the segments' held pages (`Segment::held`).
    resident: usize,
}

/// Rounds a request up to the block granularity (at least one unit).
pub(crate) fn block_size(bytes: usize) -> usize {
    bytes.max(1).next_multiple_of(BLOCK_ALIGN)
}

impl Arena {
    /// An arena whose segments come from `source`.
    pub(crate) fn new(source: Source) -> Self {
        Arena {
            source,
            ..Arena::default()
        }
    }

    pub(crate) fn mapped(&self) -> usize {
        self.mapped
    }

    /// See the field: what the system holds for the arena, at most.
    pub(crate) fn resident(&self) -> usize {
        self.resident
    }

    /// The unit the arena holds memory in (and sizes segments in).
    #[cfg(test)]
    pub(crate) fn page(&self) -> usize {
        self.source.page()
    }

    #[cfg(test)]
    pub(crate) fn free_bytes(&self) -> usize {
        self.free_bytes
    }

    /// The largest free block, in bytes.
    #[cfg(test)]
    pub(crate) fn largest_free(&self) -> usize {
        self.free.last().map_or(0, |&(b, _, _)| b)
    }

    /// The address of a block's first byte.
    pub(crate) fn address(&self, place: Place) -> NonNull<u8> {
        let seg = self.segments[place.segment]
            .as_ref()
            .expect("a block's segment is alive");
        match seg.source {
            // SAFETY: offset + bytes <= segment bytes (blocks tile the segment).
            Source::Host => unsafe { seg.base.add(place.offset) },
            // A device address or a simulated one: integer arithmetic, no
            // host pointer.
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Source::Cuda(_) => seg.base.map_addr(|a| a.saturating_add(place.offset)),
            Source::Meta { .. } => seg.base.map_addr(|a| a.saturating_add(place.offset)),
        }
    }

    /// Best fit for `bytes` (a multiple of BLOCK_ALIGN) among free blocks,
    /// split when the remainder is worth keeping apart; None when no free
    /// block is large enough. Device pages the block needs are mapped
    /// first: a device out of memory is an error (`Error::Cuda`, op
    /// `cuMemCreate`) that leaves the arena as it was.
    pub(crate) fn take(&mut self, bytes: usize) -> crate::error::Result<Option<Place>> {
        let Some(&(size, segment, offset)) = self.free.range((bytes, 0, 0)..).next() else {
            return Ok(None);
        };
        let used = if size - bytes >= MIN_SPLIT {
            bytes
        } else {
            size
        };
        let page = self.source.page();
        let seg = self.segments[segment]
            .as_mut()
            .expect("free block's segment");
        let (start, end) = pages_over(offset, used, page);
        let end = end.min(seg.bytes);
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        if let Source::Cuda(n) = self.source {
            map_device_pages(n, seg, start, end)?;
        }
        self.free.remove(&(size, segment, offset));
        self.free_bytes -= size;
        if used < size {
            let rest = size - bytes;
            seg.blocks.insert(
                offset + bytes,
                Block {
                    bytes: rest,
                    free: true,
                },
            );
            self.free.insert((rest, segment, offset + bytes));
            self.free_bytes += rest;
        }
        let block = seg.blocks.get_mut(&offset).expect("block in its segment");
        block.bytes = used;
        block.free = false;
        self.resident += seg.held.insert(start, end);
        Ok(Some(Place {
            segment,
            offset,
            bytes: used,
        }))
    }

    /// Returns a block, merging it with free neighbours.
    pub(crate) fn give(&mut self, place: Place) {
        let seg = self.segments[place.segment]
            .as_mut()
            .expect("a block's segment is alive");
        let (mut offset, mut bytes) = (place.offset, place.bytes);
        let next = offset + bytes;
        if let Some(b) = seg.blocks.get(&next).filter(|b| b.free) {
            let nb = b.bytes;
            self.free.remove(&(nb, place.segment, next));
            seg.blocks.remove(&next);
            bytes += nb;
            self.free_bytes -= nb;
        }
        if let Some((&prev, b)) = seg.blocks.range(..offset).next_back()
            && b.free
        {
            let pb = b.bytes;
            self.free.remove(&(pb, place.segment, prev));
            seg.blocks.remove(&offset);
            offset = prev;
            bytes += pb;
            self.free_bytes -= pb;
        }
        seg.blocks.insert(offset, Block { bytes, free: true });
        self.free.insert((bytes, place.segment, offset));
        self.free_bytes += bytes;
    }

    /// Asks the source for a segment of at least `bytes` (rounded up to
    /// [`Arena::page`]) and makes it one free block; returns its size. A
    /// refused host mapping is an error (`Error::HostMemory`); a device
    /// that refuses the addresses (or fails) is an error (`Error::Cuda`, op
    /// `cuMemAddressReserve`).
    pub(crate) fn add_segment(&mut self, bytes: usize) -> crate::error::Result<usize> {
        let bytes = bytes.max(1).next_multiple_of(self.source.page());
        let base = match self.source {
            Source::Host => host_pages(bytes).ok_or(crate::error::Error::HostMemory { bytes })?,
            // Never dereferenced: meta storage holds no elements.
            Source::Meta { .. } => NonNull::new(std::ptr::without_provenance_mut::<u8>(HOST_PAGE))
                .expect("a non-zero address"),
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Source::Cuda(n) => {
                let core = crate::device::cuda::core(n)?;
                if !DEVICE_PAGE.is_multiple_of(core.granularity) {
                    return Err(crate::error::Error::Cuda {
                        op: "cuMemGetAllocationGranularity",
                        reason: format!(
                            "device {n} maps memory in units of {} bytes, which do not divide \
                             the pool's {DEVICE_PAGE}-byte pages",
                            core.granularity
                        ),
                    });
                }
                let addr = core.reserve_addresses(bytes)?;
                NonNull::new(std::ptr::without_provenance_mut::<u8>(addr as usize)).ok_or(
                    crate::error::Error::Cuda {
                        op: "cuMemAddressReserve",
                        reason: "returned address 0".into(),
                    },
                )?
            }
        };
        let index = self
            .segments
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| {
                self.segments.push(None);
                self.segments.len() - 1
            });
        // Memory comes when blocks are handed out.
        let mut blocks = BTreeMap::new();
        blocks.insert(0, Block { bytes, free: true });
        self.segments[index] = Some(Segment {
            base,
            source: self.source,
            bytes,
            blocks,
            held: PageSet::default(),
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            device_pages: BTreeMap::new(),
        });
        self.free.insert((bytes, index, 0));
        self.free_bytes += bytes;
        self.mapped += bytes;
        Ok(bytes)
    }

    /// Gives the pages of free blocks back to the system (host pages,
    /// device pages, or the meta device's simulation of them), the blocks
    /// holding the most first, until `resident` is at most `target` or
    /// every free block's pages went back. A block keeps the partial pages
    /// at its ends (a neighbour in use shares them). Returns the bytes
    /// given back; a device that fails to unmap is an error.
    pub(crate) fn forget_free_pages(&mut self, target: usize) -> crate::error::Result<usize> {
        if self.resident <= target {
            return Ok(0);
        }
        let page = self.source.page();
        // (held bytes, segment, first page, end page) of each free block.
        let mut candidates: Vec<(usize, usize, usize, usize)> = Vec::new();
        for (i, seg) in self.segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            for (&off, b) in seg.blocks.iter().filter(|(_, b)| b.free) {
                let (start, end) = pages_inside(off, b.bytes, page);
                if start < end {
                    let held = seg.held.count(start, end);
                    if held > 0 {
                        candidates.push((held, i, start, end));
                    }
                }
            }
        }
        // Most held first, ties by address: a run forgets the same blocks
        // every time, which the simulation relies on.
        candidates.sort_unstable_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        let mut forgotten = 0;
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        let mut unmap = Vec::new();
        for (_, i, start, end) in candidates {
            if self.resident <= target {
                break;
            }
            let seg = self.segments[i].as_mut().expect("a listed segment");
            match seg.source {
                // SAFETY: start < end <= the segment's bytes.
                Source::Host => forget_host_pages(unsafe { seg.base.add(start) }, end - start),
                Source::Meta { .. } => {}
                #[cfg(any(feature = "cuda", feature = "cuda-12"))]
                Source::Cuda(_) => unmap.extend(seg.take_device_pages(start, end)),
            }
            let gone = seg.held.remove(start, end);
            forgotten += gone;
            self.resident -= gone;
        }
        // One wait for the stream, then every page at once.
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        if let Source::Cuda(n) = self.source {
            crate::device::cuda::core(n)?.unmap(&unmap)?;
        }
        Ok(forgotten)
    }

    /// Returns unused segments to the system, smallest first, until at
    /// least `want` bytes went back (all of them for `usize::MAX`). Returns
    /// the bytes released.
    pub(crate) fn release_unused(&mut self, want: usize) -> usize {
        let mut unused: Vec<(usize, usize)> = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().filter(|s| s.is_unused()).map(|s| (s.bytes, i)))
            .collect();
        unused.sort_unstable();
        let mut released = 0;
        for (bytes, i) in unused {
            if released >= want {
                break;
            }
            self.free.remove(&(bytes, i, 0));
            self.free_bytes -= bytes;
            self.mapped -= bytes;
            let seg = self.segments[i].take(); // Segment::drop frees the memory
            self.resident -= seg.map_or(0, |s| s.held.bytes);
            released += bytes;
        }
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arena's invariants: blocks tile each segment, the free set is
    /// exactly the free blocks, no two free blocks are neighbours, and the
    /// byte counters agree.
    fn check(a: &Arena) {
        let mut free = BTreeSet::new();
        let mut mapped = 0;
        for (i, s) in a.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            mapped += s.bytes;
            let mut at = 0;
            let mut prev_free = false;
            for (&off, b) in &s.blocks {
                assert_eq!(off, at, "gap or overlap in segment {i}");
                assert!(!(prev_free && b.free), "unmerged free neighbours");
                if b.free {
                    free.insert((b.bytes, i, off));
                }
                prev_free = b.free;
                at += b.bytes;
            }
            assert_eq!(at, s.bytes);
        }
        assert_eq!(free, a.free);
        assert_eq!(a.free_bytes, free.iter().map(|f| f.0).sum::<usize>());
        assert_eq!(a.mapped, mapped);
        let mut resident = 0;
        for s in a.segments.iter().flatten() {
            let mut end = 0;
            for (&start, &e) in &s.held.ranges {
                assert!(
                    start > end || end == 0 && start == 0,
                    "held ranges touch or overlap"
                );
                assert!(start < e && e <= s.bytes.next_multiple_of(a.page()));
                end = e;
            }
            assert_eq!(
                s.held.bytes,
                s.held.ranges.iter().map(|(a, b)| b - a).sum::<usize>()
            );
            for (&off, b) in s.blocks.iter().filter(|(_, b)| !b.free) {
                assert_eq!(
                    s.held.count(off, off + b.bytes),
                    b.bytes,
                    "a block in use is held"
                );
            }
            resident += s.held.bytes;
        }
        assert_eq!(a.resident, resident);
    }

    /// A page; sizes below are in pages.
    const K: usize = 4096;

    #[test]
    fn best_fit_splits_and_frees_merge() {
        let mut a = Arena::default();
        a.add_segment(64 * K).unwrap();
        let x = a.take(16 * K).unwrap().unwrap();
        let y = a.take(16 * K).unwrap().unwrap();
        let z = a.take(16 * K).unwrap().unwrap();
        check(&a);
        assert_eq!(a.free_bytes(), 16 * K);
        assert!(a.take(32 * K).unwrap().is_none(), "only 16 pages are left");
        a.give(x);
        a.give(y); // merges with x
        check(&a);
        assert_eq!(a.largest_free(), 32 * K);
        let w = a.take(32 * K).unwrap().unwrap();
        assert_eq!((w.segment, w.offset), (x.segment, x.offset));
        a.give(z);
        check(&a);
        assert_eq!(a.largest_free(), 32 * K, "z merged with the tail");
        a.give(w);
        check(&a);
        assert_eq!(a.largest_free(), 64 * K, "all merged back");
        assert_eq!(a.release_unused(usize::MAX), 64 * K);
        check(&a);
        assert_eq!(a.mapped(), 0);
    }

    #[test]
    fn best_fit_prefers_the_tightest_block() {
        let mut a = Arena::default();
        a.add_segment(10 * K).unwrap();
        a.add_segment(4 * K).unwrap();
        a.add_segment(6 * K).unwrap();
        let p = a.take(5 * K + BLOCK_ALIGN).unwrap().unwrap();
        assert_eq!(p.bytes, 6 * K, "the remainder is below MIN_SPLIT: kept");
        assert_eq!(a.take(4 * K).unwrap().unwrap().bytes, 4 * K);
        let q = a.take(3 * K).unwrap().unwrap();
        assert_eq!((q.bytes, a.largest_free()), (3 * K, 7 * K));
        check(&a);
    }

    #[test]
    fn unused_segments_go_back_smallest_first() {
        let mut a = Arena::default();
        a.add_segment(8 * K).unwrap();
        a.add_segment(2 * K).unwrap();
        a.add_segment(4 * K).unwrap();
        let held = a.take(8 * K).unwrap().unwrap();
        assert_eq!(a.release_unused(K), 2 * K);
        assert_eq!(a.mapped(), 12 * K);
        assert_eq!(a.release_unused(usize::MAX), 4 * K, "the held one stays");
        check(&a);
        a.give(held);
        assert_eq!(a.release_unused(usize::MAX), 8 * K);
        check(&a);
    }

    /// Free blocks' host pages go back to the system: `resident` falls to
    /// the partial pages at their ends, and the memory reads zeros after.
    #[test]
    fn forgotten_pages_go_back_and_read_zero() {
        let mut a = Arena::default();
        a.add_segment(64 * K).unwrap();
        assert_eq!(a.resident(), 0, "untouched host pages are not held");
        let x = a.take(16 * K + 128).unwrap().unwrap();
        let y = a.take(8 * K).unwrap().unwrap();
        // Whole pages: x's 17th is y's first.
        assert_eq!(a.resident(), 24 * K + K);
        // SAFETY: x is a block of x.bytes this test holds.
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.address(x).as_ptr(), x.bytes) };
        bytes.fill(7);
        a.give(x);
        check(&a);
        assert_eq!(a.resident(), 25 * K, "a freed block may still be held");
        let forgotten = a.forget_free_pages(0).unwrap();
        check(&a);
        // x starts the segment: its first 16 pages go back; its last 128
        // bytes share a page with y, which is in use.
        assert_eq!(forgotten, 16 * K);
        assert_eq!(a.resident(), 9 * K);
        // SAFETY: the block is free and untouched by anyone else; reading
        // its bytes is reading the mapping.
        let after = unsafe { std::slice::from_raw_parts(a.address(x).as_ptr(), 16 * K) };
        assert!(after.iter().all(|&b| b == 0), "given-back pages read zero");
        let x2 = a.take(16 * K).unwrap().unwrap();
        assert_eq!(a.resident(), 25 * K, "taken again: held again");
        a.give(x2);
        a.give(y);
        check(&a);
    }

    /// Device memory is held in whole device pages: a segment rounds up to
    /// them, a block holds the pages it touches, and a free block's own
    /// pages go back (those it shares with a block in use stay).
    #[test]
    fn device_pages_are_held_where_blocks_are() {
        const P: usize = DEVICE_PAGE;
        let mut a = Arena::new(Source::Meta { page: P });
        assert_eq!(a.add_segment(5 * P + 1).unwrap(), 6 * P);
        assert_eq!(a.resident(), 0, "reserved addresses hold no memory");
        let x = a.take(P + BLOCK_ALIGN).unwrap().unwrap();
        let y = a.take(2 * P).unwrap().unwrap();
        check(&a);
        // x: pages 0 and 1; y: from P + 64, pages 1 to 3.
        assert_eq!(a.resident(), 4 * P);
        a.give(x);
        assert_eq!(a.forget_free_pages(0).unwrap(), P, "page 1 is y's too");
        assert_eq!(a.resident(), 3 * P);
        check(&a);
        a.give(y);
        assert_eq!(a.forget_free_pages(0).unwrap(), 3 * P);
        assert_eq!(a.resident(), 0);
        check(&a);
    }

    /// Random alloc/free sequences keep every invariant and never hand out
    /// overlapping blocks.
    #[test]
    fn random_sequences_keep_the_invariants() {
        random_sequence(Arena::default());
        random_sequence(Arena::new(Source::Meta { page: DEVICE_PAGE }));
    }

    fn random_sequence(mut a: Arena) {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        a.add_segment(256 * K).unwrap();
        a.add_segment(64 * K).unwrap();
        let mut held: Vec<Place> = Vec::new();
        for _ in 0..3000 {
            if next() % 3 != 0 || held.is_empty() {
                let bytes = block_size((next() % (48 * K as u64)) as usize);
                if let Some(p) = a.take(bytes).unwrap() {
                    assert!(p.bytes >= bytes && p.bytes < bytes + MIN_SPLIT);
                    held.push(p);
                }
            } else if next() % 7 == 0 {
                a.forget_free_pages((next() % (128 * K as u64)) as usize)
                    .unwrap();
            } else {
                let i = (next() % held.len() as u64) as usize;
                a.give(held.swap_remove(i));
            }
            let mut spans: Vec<_> = held
                .iter()
                .map(|p| (p.segment, p.offset, p.offset + p.bytes))
                .collect();
            spans.sort_unstable();
            for w in spans.windows(2) {
                assert!(w[0].0 != w[1].0 || w[0].2 <= w[1].1, "overlap {w:?}");
            }
        }
        check(&a);
        for p in held.drain(..) {
            a.give(p);
        }
        check(&a);
        assert_eq!(a.free_bytes(), a.mapped());
        a.forget_free_pages(0).unwrap();
        check(&a);
        assert_eq!(a.resident(), 0, "whole free segments go back whole");
    }
}
