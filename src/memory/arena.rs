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
}

struct Segment {
    /// The first byte: a host pointer, or (CUDA) the device address as a
    /// pointer without provenance, never dereferenced.
    base: NonNull<u8>,
    source: Source,
    bytes: usize,
    /// Every block of the segment by offset; they tile it without gaps.
    blocks: BTreeMap<usize, Block>,
}

/// Zeroed host pages for a segment, committed lazily by the kernel. Aborts
/// as any Rust allocation when the address space runs out.
#[cfg(unix)]
fn host_pages(bytes: usize) -> NonNull<u8> {
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
        let layout = std::alloc::Layout::from_size_align(bytes, SEGMENT_ALIGN)
            .unwrap_or(std::alloc::Layout::new::<u8>());
        std::alloc::handle_alloc_error(layout)
    }
    NonNull::new(ptr.cast::<u8>()).expect("mmap returns a non-null mapping")
}

/// Gives back host pages from [`host_pages`].
#[cfg(unix)]
fn free_host_pages(base: NonNull<u8>, bytes: usize) {
    // SAFETY: `base` and `bytes` are exactly one mapping from host_pages.
    unsafe {
        libc::munmap(base.as_ptr().cast(), bytes);
    }
}

#[cfg(not(unix))]
fn host_pages(bytes: usize) -> NonNull<u8> {
    let layout = Segment::layout(bytes);
    // SAFETY: bytes > 0 (every request is at least one block).
    let ptr = unsafe { alloc_zeroed(layout) };
    NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
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
    /// Bytes of all segments.
    reserved: usize,
    /// Bytes of free blocks.
    free_bytes: usize,
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

    pub(crate) fn reserved(&self) -> usize {
        self.reserved
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
            // A device address: integer arithmetic, no host pointer.
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Source::Cuda(_) => seg.base.map_addr(|a| a.saturating_add(place.offset)),
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
    /// BLOCK_ALIGN) and makes it one free block. Host memory that runs out
    /// aborts as any Rust allocation; a device that runs out (or fails) is
    /// an error (`Error::Cuda`, op `cuMemAlloc`).
    pub(crate) fn add_segment(&mut self, bytes: usize) -> crate::error::Result<()> {
        let base = match self.source {
            Source::Host => host_pages(bytes),
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
        let mut blocks = BTreeMap::new();
        blocks.insert(0, Block { bytes, free: true });
        self.segments[index] = Some(Segment {
            base,
            source: self.source,
            bytes,
            blocks,
        });
        self.free.insert((bytes, index, 0));
        self.free_bytes += bytes;
        self.reserved += bytes;
        Ok(())
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
            self.reserved -= bytes;
            self.segments[i] = None; // Segment::drop frees the memory
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
        let mut reserved = 0;
        for (i, s) in a.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            reserved += s.bytes;
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
        assert_eq!(a.reserved, reserved);
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
        assert_eq!(a.reserved(), 0);
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
        assert_eq!(a.reserved(), 12 * K);
        assert_eq!(a.release_unused(usize::MAX), 4 * K, "the held one stays");
        check(&a);
        a.give(held);
        assert_eq!(a.release_unused(usize::MAX), 8 * K);
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
        assert_eq!(a.free_bytes(), a.reserved());
    }
}
