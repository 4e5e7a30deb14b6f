//! Batches for training and evaluation: the [`Dataset`] trait (random access
//! to one transformed image at a time), its two implementations, and the
//! [`Loader`] that assembles an epoch's batches, in order, on background
//! threads. Knows nothing of tensors, pools or models: a batch is plain
//! `Vec`s, which `train` copies into its pool.
//!
//! Output is a function of (dataset, order, epoch, batch size) only: every
//! sample draws its randomness from its own position in the epoch
//! ([`super::sample_rng`]) and batches are delivered in order, so the worker
//! count changes speed, never results.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::Scope;

use super::InMemoryDataset;
use super::folder::ImageFolder;
use super::transform::{Transform, sample_rng};
use crate::error::{Error, Result};

/// Labelled images, loaded one at a time. `Sync` so that loader threads
/// share it.
pub trait Dataset: Sync {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Label range: labels are `0..classes()`.
    fn classes(&self) -> usize;

    /// (h, w) of every image [`Dataset::load`] writes.
    fn image_hw(&self) -> (usize, usize);

    fn label(&self, i: usize) -> usize;

    /// Writes sample `i`, transformed and normalised, to `out` (h, w, 3).
    /// `epoch` and `position` (its index in the epoch's order) seed any
    /// random augmentation. `Ok(false)`: the sample could not be read and
    /// was skipped (already reported on stderr); `out` is then unspecified.
    fn load(&self, i: usize, epoch: usize, position: usize, out: &mut [f32]) -> Result<bool>;

    /// Samples skipped so far over the dataset's life.
    fn skipped(&self) -> usize {
        0
    }
}

fn check_load(op: &'static str, i: usize, len: usize, out: usize, want: usize) -> Result<()> {
    if i >= len {
        return Err(Error::invalid(
            op,
            format!("sample {i} is out of range (len {len})"),
        ));
    }
    if out != want {
        return Err(Error::ShapeMismatch {
            op,
            expected: format!("{want} floats"),
            got: format!("{out} floats"),
        });
    }
    Ok(())
}

/// Already transformed: `load` copies, whatever the epoch.
impl Dataset for InMemoryDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn image_hw(&self) -> (usize, usize) {
        (self.h, self.w)
    }

    fn label(&self, i: usize) -> usize {
        self.labels[i]
    }

    fn load(&self, i: usize, _epoch: usize, _position: usize, out: &mut [f32]) -> Result<bool> {
        let px = self.h * self.w * 3;
        check_load("InMemoryDataset::load", i, self.len(), out.len(), px)?;
        out.copy_from_slice(self.image(i));
        Ok(true)
    }
}

/// Files decoded on demand and transformed; `seed` (with the epoch and
/// position) drives the random augmentation.
#[derive(Clone, Debug)]
pub struct ImageFolderDataset {
    pub folder: ImageFolder,
    pub transform: Transform,
    pub seed: u64,
}

impl Dataset for ImageFolderDataset {
    fn len(&self) -> usize {
        self.folder.len()
    }

    fn classes(&self) -> usize {
        self.folder.classes.len()
    }

    fn image_hw(&self) -> (usize, usize) {
        (self.transform.size, self.transform.size)
    }

    fn label(&self, i: usize) -> usize {
        self.folder.samples[i].label
    }

    fn load(&self, i: usize, epoch: usize, position: usize, out: &mut [f32]) -> Result<bool> {
        let want = self.transform.output_len();
        check_load("ImageFolderDataset::load", i, self.len(), out.len(), want)?;
        let Some(img) = self.folder.load(i) else {
            return Ok(false);
        };
        let mut rng = sample_rng(self.seed, epoch, position);
        self.transform.apply(&img, &mut rng, out)?;
        Ok(true)
    }

    fn skipped(&self) -> usize {
        self.folder.skipped()
    }
}

/// One batch: the readable samples of a window of the epoch's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub images: Vec<f32>, // (labels.len(), h, w, 3)
    pub labels: Vec<usize>,
    /// Samples of the window dropped as unreadable; `labels.len() +
    /// skipped` is the window's length.
    pub skipped: usize,
}

/// Loads the window `order[first..first + len]` of `epoch` into one batch.
fn load_batch(data: &dyn Dataset, order: &[usize], first: usize, epoch: usize) -> Result<Batch> {
    let (h, w) = data.image_hw();
    let px = h * w * 3;
    let mut images = vec![0.0; order.len() * px];
    let mut labels = Vec::with_capacity(order.len());
    for (k, &i) in order.iter().enumerate() {
        // Readable samples are packed: a skipped one's slot is reused.
        let n = labels.len();
        if data.load(i, epoch, first + k, &mut images[n * px..(n + 1) * px])? {
            labels.push(data.label(i));
        }
    }
    let skipped = order.len() - labels.len();
    images.truncate(labels.len() * px);
    Ok(Batch {
        images,
        labels,
        skipped,
    })
}

/// How an epoch's batches are made: from `data`, `batch_size` samples a
/// batch (the last may be shorter, and so may any with skipped samples),
/// by `workers` threads (0: on the calling thread, when the batch is asked
/// for).
///
/// ```
/// use memfit::data::{Loader, SyntheticGratings};
///
/// let data = SyntheticGratings::generate(10, 8, 2, 0);
/// let loader = Loader { data: &data, batch_size: 4, workers: 2 };
/// // Threads live in a scope that outlives the iterator.
/// let sizes = std::thread::scope(|s| -> memfit::Result<Vec<usize>> {
///     let mut sizes = Vec::new();
///     for batch in loader.epoch(s, (0..10).rev().collect(), 1) {
///         let batch = batch?;
///         assert_eq!(batch.images.len(), batch.labels.len() * 8 * 8 * 3);
///         sizes.push(batch.labels.len());
///     }
///     Ok(sizes)
/// })?;
/// assert_eq!(sizes, [4, 4, 2]);
/// # Ok::<(), memfit::Error>(())
/// ```
#[derive(Clone, Copy)]
pub struct Loader<'a> {
    pub data: &'a dyn Dataset,
    pub batch_size: usize,
    pub workers: usize,
}

/// Batches each worker may hold finished and undelivered; the queue is
/// therefore about 2 × workers batches.
const QUEUE_PER_WORKER: usize = 2;

impl<'a> Loader<'a> {
    /// The batches of one epoch over `order` (dataset indices), in order.
    /// Worker threads are spawned in `scope` and stop when the batches
    /// run out, after the first error, or when the iterator is dropped.
    pub fn epoch<'scope>(
        &self,
        scope: &'scope Scope<'scope, 'a>,
        order: Vec<usize>,
        epoch: usize,
    ) -> Batches<'a> {
        self.epoch_part(scope, order, epoch, Part::WHOLE)
    }

    /// [`Loader::epoch`] for one rank of a data-parallel run: each batch
    /// holds only `part`'s shard ([`crate::dist::shard`]) of its window of
    /// `order`, loaded with the positions it has in the whole epoch, so
    /// the ranks' shards together are exactly the batches of
    /// [`Loader::epoch`].
    pub fn epoch_part<'scope>(
        &self,
        scope: &'scope Scope<'scope, 'a>,
        order: Vec<usize>,
        epoch: usize,
        part: Part,
    ) -> Batches<'a> {
        let batch_size = self.batch_size.max(1);
        let total = order.len().div_ceil(batch_size);
        let order: Arc<[usize]> = order.into();
        let workers = self.workers.min(total);
        let mut receivers = Vec::with_capacity(workers);
        for k in 0..workers {
            let (tx, rx) = sync_channel(QUEUE_PER_WORKER);
            receivers.push(rx);
            let (data, order) = (self.data, order.clone());
            // Worker k makes batches k, k + workers, ...: delivering them
            // round-robin restores the order with no reordering buffer.
            scope.spawn(move || worker(data, &order, batch_size, part, epoch, k, workers, tx));
        }
        Batches {
            data: self.data,
            order,
            batch_size,
            part,
            epoch,
            receivers,
            next: 0,
            total,
            failed: false,
        }
    }

    /// All batches of an epoch, on a scope of their own (tests, small sets).
    pub fn collect_epoch(&self, order: Vec<usize>, epoch: usize) -> Result<Vec<Batch>> {
        std::thread::scope(|s| self.epoch(s, order, epoch).collect())
    }
}

/// Which shard of every window a loader loads: `rank` of `ranks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub rank: usize,
    pub ranks: usize,
}

impl Part {
    /// Every sample of every window (one process).
    pub const WHOLE: Part = Part { rank: 0, ranks: 1 };
}

/// `part`'s shard of batch `b` of `order` and its first position in the
/// epoch.
fn window(order: &[usize], b: usize, batch_size: usize, part: Part) -> (&[usize], usize) {
    let first = b * batch_size;
    let whole = &order[first..(first + batch_size).min(order.len())];
    let r = crate::dist::shard(whole.len(), part.rank, part.ranks);
    (&whole[r.clone()], first + r.start)
}

#[allow(clippy::too_many_arguments)]
fn worker(
    data: &dyn Dataset,
    order: &[usize],
    batch_size: usize,
    part: Part,
    epoch: usize,
    first_batch: usize,
    stride: usize,
    tx: SyncSender<Result<Batch>>,
) {
    let total = order.len().div_ceil(batch_size);
    for b in (first_batch..total).step_by(stride) {
        let (window, first) = window(order, b, batch_size, part);
        let batch = load_batch(data, window, first, epoch);
        let failed = batch.is_err();
        // A closed channel means the consumer stopped early: nothing to do.
        if tx.send(batch).is_err() || failed {
            return;
        }
    }
}

/// An epoch's batches, in order; see [`Loader::epoch`].
pub struct Batches<'a> {
    data: &'a dyn Dataset,
    order: Arc<[usize]>,
    batch_size: usize,
    part: Part,
    epoch: usize,
    /// One per worker; empty: load on the calling thread.
    receivers: Vec<Receiver<Result<Batch>>>,
    next: usize,
    total: usize,
    failed: bool,
}

impl Iterator for Batches<'_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.next >= self.total || self.failed {
            return None;
        }
        let b = self.next;
        self.next += 1;
        let batch = if self.receivers.is_empty() {
            let (window, first) = window(&self.order, b, self.batch_size, self.part);
            load_batch(self.data, window, first, self.epoch)
        } else {
            let rx = &self.receivers[b % self.receivers.len()];
            // A worker only hangs up early by panicking; the scope
            // re-raises that panic when it ends.
            rx.recv()
                .unwrap_or_else(|_| Err(Error::invalid("Loader", "a loader thread stopped early")))
        };
        self.failed = batch.is_err();
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.failed {
            0
        } else {
            self.total - self.next
        };
        (0, Some(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sample i is an image filled with i; labels i % 3; indices listed in
    /// `bad` are "unreadable".
    struct Numbers {
        len: usize,
        bad: Vec<usize>,
    }

    impl Dataset for Numbers {
        fn len(&self) -> usize {
            self.len
        }
        fn classes(&self) -> usize {
            3
        }
        fn image_hw(&self) -> (usize, usize) {
            (1, 2)
        }
        fn label(&self, i: usize) -> usize {
            i % 3
        }
        fn load(&self, i: usize, epoch: usize, position: usize, out: &mut [f32]) -> Result<bool> {
            check_load("Numbers", i, self.len, out.len(), 6)?;
            out.fill(i as f32 + 1000.0 * epoch as f32 + 0.001 * position as f32);
            Ok(!self.bad.contains(&i))
        }
    }

    #[test]
    fn batches_are_in_order_with_skips_dropped_for_any_worker_count() {
        let data = Numbers {
            len: 23,
            bad: vec![4, 5, 17],
        };
        let order: Vec<usize> = (0..23).rev().collect();
        let reference = Loader {
            data: &data,
            batch_size: 4,
            workers: 0,
        }
        .collect_epoch(order.clone(), 2)
        .unwrap();
        assert_eq!(reference.len(), 6);
        assert_eq!(reference[0].labels, vec![22 % 3, 21 % 3, 20 % 3, 19 % 3]);
        assert_eq!(reference[0].images[0], 22.0 + 2000.0);
        // Window 4 is positions 16..20 = samples 6, 5, 4, 3: two skipped.
        assert_eq!(reference[4].skipped, 2);
        assert_eq!(reference[4].labels, vec![0, 0]);
        assert_eq!(reference[4].images.len(), 2 * 6);
        assert_eq!(reference[4].images[6], 3.0 + 1000.0 * 2.0 + 0.001 * 19.0);
        assert_eq!(reference[5].labels.len(), 3); // 23 = 5 * 4 + 3
        for workers in [1, 2, 3, 8, 40] {
            let got = Loader {
                data: &data,
                batch_size: 4,
                workers,
            }
            .collect_epoch(order.clone(), 2)
            .unwrap();
            assert_eq!(got, reference, "{workers} workers");
        }
    }

    #[test]
    fn errors_end_the_epoch_and_early_drop_stops_the_workers() {
        let data = Numbers {
            len: 10,
            bad: vec![],
        };
        for workers in [0, 2] {
            let loader = Loader {
                data: &data,
                batch_size: 3,
                workers,
            };
            // Index 99 does not exist: the second batch is an error, and
            // the iterator ends after it.
            let got: Vec<Result<Batch>> =
                std::thread::scope(|s| loader.epoch(s, vec![0, 1, 2, 3, 99, 5, 6, 7], 0).collect());
            assert_eq!(got.len(), 2, "{workers} workers");
            assert!(got[0].is_ok());
            let e = got[1].as_ref().unwrap_err().to_string();
            assert!(e.contains("sample 99 is out of range"), "{e}");
            // Taking one batch of many and dropping the rest returns.
            let first = std::thread::scope(|s| loader.epoch(s, (0..10).collect(), 0).next());
            assert_eq!(first.unwrap().unwrap().labels, vec![0, 1, 2]);
        }
    }

    #[test]
    fn in_memory_load_copies_and_checks_its_arguments() {
        let d = InMemoryDataset {
            images: (0..2 * 12).map(|v| v as f32).collect(),
            labels: vec![1, 0],
            h: 2,
            w: 2,
            classes: 2,
        };
        let mut out = vec![0.0; 12];
        assert!(d.load(1, 5, 9, &mut out).unwrap());
        assert_eq!(out, d.image(1));
        assert!(d.load(2, 0, 0, &mut out).is_err());
        assert!(d.load(0, 0, 0, &mut out[1..]).is_err());
    }
}
