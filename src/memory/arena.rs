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
//! Host segments are anonymous `mmap`s: address space reserved, pages
//! committed (zeroed by the kernel) on first touch. A budget-sized segment
//! therefore costs resident memory only for the bytes the step actually
//! uses, so the process's RSS follows the tracked peak, not the budget
//! (`alloc_zeroed` with page alignment memsets the whole segment: a 4 GiB
//! budget made a 159 MiB run 4 GiB resident).

#[cfg(not(unix))]
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::{BTreeMap, BTreeSet};
use std::ptr::NonNull;

/// Block sizes and offsets are multiples of this (a cache line; every
/// element type's alignment divides it).
pub(crate) const BLOCK_ALIGN: usize = 64;
/// Segment base alignment (a page).
const SEGMENT_ALIGN: usize = 4096;
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

/// The pages a block at `offset` of `bytes` touches (outward to pages).
fn pages_over(offset: usize, bytes: usize) -> (usize, usize) {
    (
        offset / SEGMENT_ALIGN * SEGMENT_ALIGN,
        (offset + bytes).next_multiple_of(SEGMENT_ALIGN),
    )
}

/// The whole pages inside a block at `offset` of `bytes` (inward): those
/// no neighbour shares.
fn pages_inside(offset: usize, bytes: usize) -> (usize, usize) {
    (
        offset.next_multiple_of(SEGMENT_ALIGN),
        (offset + bytes) / SEGMENT_ALIGN * SEGMENT_ALIGN,
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
    /// Device memory of CUDA device `n` (`cuMemAlloc`, zeroed by a memset
    /// on the device's stream). The segment's base is the device address.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    Cuda(u32),
    /// No memory: the meta device's simulation. Blocks are laid out exactly
    /// as a real source's would be, so a simulated step predicts the
    /// reserved and resident bytes (fragmentation included), not only the
    /// live ones. `on_touch`: as host pages (the simulation of a CPU), else
    /// as device memory.
    Meta { on_touch: bool },
}

impl Source {
    /// Whether the system commits a segment's pages only as they are
    /// touched, and takes them back when given (`madvise`): host pages.
    /// Device memory is committed whole when the segment is made.
    fn commits_on_touch(self) -> bool {
        match self {
            Source::Host => true,
            Source::Meta { on_touch } => on_touch,
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Source::Cuda(_) => false,
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
    /// The pages the system may hold for the segment: all of device
    /// memory; of host pages, those of blocks handed out since the segment
    /// was made or the pages were given back (a block handed out is taken
    /// to be written whole).
    held: PageSet,
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
        Layout::from_size_align(bytes, SEGMENT_ALIGN).expect("segment size fits a layout")
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
                // A drop cannot return an error; a failed free leaks the
                // segment (the context is torn down at exit anyway).
                if let Ok(core) = crate::device::cuda::core(n) {
                    let _ = core.free(self.base.as_ptr().addr() as u64);
                }
            }
        }
    }
}

// SAFETY: a segment is plain memory owned by the arena; access to its bytes
// goes through blocks that are each held by one storage at a time.
unsafe impl Send for Segment {}

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

    /// Whether [`Arena::forget_free_pages`] can lower `resident`.
    pub(crate) fn commits_on_touch(&self) -> bool {
        self.source.commits_on_touch()
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
    /// split when the remainder is worth keeping apart.
    pub(crate) fn take(&mut self, bytes: usize) -> Option<Place> {
        let &(size, segment, offset) = self.free.range((bytes, 0, 0)..).next()?;
        self.free.remove(&(size, segment, offset));
        self.free_bytes -= size;
        let seg = self.segments[segment]
            .as_mut()
            .expect("free block's segment");
        let mut used = size;
        if size - bytes >= MIN_SPLIT {
            used = bytes;
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
        if self.source.commits_on_touch() {
            let (start, end) = pages_over(offset, used);
            self.resident += seg.held.insert(start, end.min(seg.bytes));
        }
        Some(Place {
            segment,
            offset,
            bytes: used,
        })
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

    /// Asks the source for a zeroed segment of `bytes` (a multiple of
    /// BLOCK_ALIGN) and makes it one free block. A refused host mapping is
    /// an error (`Error::HostMemory`); a device that runs out (or fails) is
    /// an error (`Error::Cuda`, op `cuMemAlloc`).
    pub(crate) fn add_segment(&mut self, bytes: usize) -> crate::error::Result<()> {
        let base = match self.source {
            Source::Host => host_pages(bytes).ok_or(crate::error::Error::HostMemory { bytes })?,
            // Never dereferenced: meta storage holds no elements.
            Source::Meta { .. } => {
                NonNull::new(std::ptr::without_provenance_mut::<u8>(SEGMENT_ALIGN))
                    .expect("a non-zero address")
            }
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Source::Cuda(n) => {
                let addr = crate::device::cuda::core(n)?.alloc_zeroed(bytes)?;
                NonNull::new(std::ptr::without_provenance_mut::<u8>(addr as usize)).ok_or(
                    crate::error::Error::Cuda {
                        op: "cuMemAlloc",
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
        // Device memory is committed now; host pages when touched.
        let mut held = PageSet::default();
        if !self.source.commits_on_touch() {
            held.insert(0, bytes);
        }
        let resident = held.bytes;
        let mut blocks = BTreeMap::new();
        blocks.insert(0, Block { bytes, free: true });
        self.segments[index] = Some(Segment {
            base,
            source: self.source,
            bytes,
            blocks,
            held,
        });
        self.free.insert((bytes, index, 0));
        self.free_bytes += bytes;
        self.mapped += bytes;
        self.resident += resident;
        Ok(())
    }

    /// Gives the pages of free blocks back to the system (host pages; the
    /// meta device's simulation of them), the blocks holding the most first,
    /// until `resident` is at most `target` or every free block's pages
    /// went back. A block keeps the partial pages at its ends (a neighbour
    /// in use shares them). Returns the bytes given back. Device memory
    /// stays: it goes back only with its segment.
    pub(crate) fn forget_free_pages(&mut self, target: usize) -> usize {
        if !self.source.commits_on_touch() || self.resident <= target {
            return 0;
        }
        // (held bytes, segment, first page, end page) of each free block.
        let mut candidates: Vec<(usize, usize, usize, usize)> = Vec::new();
        for (i, seg) in self.segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            for (&off, b) in seg.blocks.iter().filter(|(_, b)| b.free) {
                let (start, end) = pages_inside(off, b.bytes);
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
        for (_, i, start, end) in candidates {
            if self.resident <= target {
                break;
            }
            let seg = self.segments[i].as_mut().expect("a listed segment");
            if seg.source == Source::Host {
                // SAFETY: start < end <= the segment's bytes.
                forget_host_pages(unsafe { seg.base.add(start) }, end - start);
            }
            let gone = seg.held.remove(start, end);
            forgotten += gone;
            self.resident -= gone;
        }
        forgotten
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
                assert!(start < e && e <= s.bytes.next_multiple_of(SEGMENT_ALIGN));
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
        let x = a.take(16 * K).unwrap();
        let y = a.take(16 * K).unwrap();
        let z = a.take(16 * K).unwrap();
        check(&a);
        assert_eq!(a.free_bytes(), 16 * K);
        assert!(a.take(32 * K).is_none(), "only 16 pages are left");
        a.give(x);
        a.give(y); // merges with x
        check(&a);
        assert_eq!(a.largest_free(), 32 * K);
        let w = a.take(32 * K).unwrap();
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
        let p = a.take(5 * K + BLOCK_ALIGN).unwrap();
        assert_eq!(p.bytes, 6 * K, "the remainder is below MIN_SPLIT: kept");
        assert_eq!(a.take(4 * K).unwrap().bytes, 4 * K);
        let q = a.take(3 * K).unwrap();
        assert_eq!((q.bytes, a.largest_free()), (3 * K, 7 * K));
        check(&a);
    }

    #[test]
    fn unused_segments_go_back_smallest_first() {
        let mut a = Arena::default();
        a.add_segment(8 * K).unwrap();
        a.add_segment(2 * K).unwrap();
        a.add_segment(4 * K).unwrap();
        let held = a.take(8 * K).unwrap();
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
        let x = a.take(16 * K + 128).unwrap();
        let y = a.take(8 * K).unwrap();
        // Whole pages: x's 17th is y's first.
        assert_eq!(a.resident(), 24 * K + K);
        // SAFETY: x is a block of x.bytes this test holds.
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.address(x).as_ptr(), x.bytes) };
        bytes.fill(7);
        a.give(x);
        check(&a);
        assert_eq!(a.resident(), 25 * K, "a freed block may still be held");
        let forgotten = a.forget_free_pages(0);
        check(&a);
        // x starts the segment: its first 16 pages go back; its last 128
        // bytes share a page with y, which is in use.
        assert_eq!(forgotten, 16 * K);
        assert_eq!(a.resident(), 9 * K);
        // SAFETY: the block is free and untouched by anyone else; reading
        // its bytes is reading the mapping.
        let after = unsafe { std::slice::from_raw_parts(a.address(x).as_ptr(), 16 * K) };
        assert!(after.iter().all(|&b| b == 0), "given-back pages read zero");
        let x2 = a.take(16 * K).unwrap();
        assert_eq!(a.resident(), 25 * K, "taken again: held again");
        a.give(x2);
        a.give(y);
        check(&a);
    }

    /// Device memory is held whole from the start, and stays.
    #[test]
    fn device_like_segments_are_resident_whole() {
        let mut a = Arena::new(Source::Meta { on_touch: false });
        a.add_segment(64 * K).unwrap();
        assert_eq!(a.resident(), 64 * K);
        let x = a.take(16 * K).unwrap();
        a.give(x);
        assert_eq!(a.forget_free_pages(0), 0);
        assert_eq!(a.resident(), 64 * K);
        check(&a);
    }

    /// Random alloc/free sequences keep every invariant and never hand out
    /// overlapping blocks.
    #[test]
    fn random_sequences_keep_the_invariants() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut a = Arena::default();
        a.add_segment(256 * K).unwrap();
        a.add_segment(64 * K).unwrap();
        let mut held: Vec<Place> = Vec::new();
        for _ in 0..3000 {
            if next() % 3 != 0 || held.is_empty() {
                let bytes = block_size((next() % (48 * K as u64)) as usize);
                if let Some(p) = a.take(bytes) {
                    assert!(p.bytes >= bytes && p.bytes < bytes + MIN_SPLIT);
                    held.push(p);
                }
            } else if next() % 7 == 0 {
                a.forget_free_pages((next() % (128 * K as u64)) as usize);
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
        a.forget_free_pages(0);
        check(&a);
        assert_eq!(a.resident(), 0, "whole free segments go back whole");
    }
}
