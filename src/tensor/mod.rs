//! Shapes, element types and contiguous storage. Activations are NHWC.
//!
//! A [`Tensor`] owns its storage for as long as it lives and hands it back to
//! the [`Pool`](crate::memory::Pool) it came from when dropped, so the pool's
//! live-byte count is exactly the storage of the tensors that exist.

use std::ptr::NonNull;

use half::{bf16, f16};

mod precision;

pub use precision::Precision;

use std::sync::Arc;

use crate::accounting::{Category, Tag};
use crate::device::Device;

/// Element type of a tensor's storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    I64,
    /// Packed bits (masks), 8 per byte; the shape counts bits.
    Bits,
}

impl DType {
    /// Bytes of storage for `numel` elements.
    pub fn storage_bytes(self, numel: usize) -> usize {
        self.storage_len(numel) * self.unit_bytes()
    }

    /// Bytes of one storage unit (an element; a byte of 8 bits for masks).
    pub fn unit_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
            DType::Bits => 1,
        }
    }

    /// Number of storage units (elements; bytes for masks) for `numel`.
    pub fn storage_len(self, numel: usize) -> usize {
        match self {
            DType::Bits => numel.div_ceil(8),
            _ => numel,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::Bits => "bits",
        }
    }
}

/// Up to four dimensions, stored inline so building a shape never allocates.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: [usize; 4],
    rank: usize,
}

impl Shape {
    pub fn new(dims: &[usize]) -> Self {
        assert!(dims.len() <= 4, "rank > 4 is not supported");
        let mut d = [1; 4];
        d[..dims.len()].copy_from_slice(dims);
        Shape {
            dims: d,
            rank: dims.len(),
        }
    }

    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.rank]
    }

    pub fn numel(&self) -> usize {
        self.dims().iter().product()
    }

    /// (n, h, w, c) of a rank-4 NHWC shape.
    pub fn nhwc(&self) -> (usize, usize, usize, usize) {
        assert_eq!(self.rank, 4, "nhwc() on shape {self:?}");
        (self.dims[0], self.dims[1], self.dims[2], self.dims[3])
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

/// Where a block of pool memory lives (the pool's arena hands these out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) segment: usize,
    pub(crate) offset: usize,
    /// The block's size, at least the bytes requested.
    pub(crate) bytes: usize,
}

/// The pool's side of a loan, as a tensor sees it. `memory` implements it,
/// so a tensor can give its storage back without `tensor` importing the
/// pool (which imports `tensor`).
pub(crate) trait Lender: Send + Sync {
    /// Takes back the storage of loan `id` and its bytes.
    fn give_back(&self, id: u64, storage: Storage);
    fn meta_of(&self, id: u64) -> Option<(Tag, Category)>;
    fn tag_of(&self, id: u64) -> String;
    /// A new loan from the same pool, on `device` (a backend's scratch:
    /// see [`Tensor::scratch`]).
    fn lend(
        self: Arc<Self>,
        device: Device,
        shape: Shape,
        dtype: DType,
        category: Category,
        tag: Tag,
        zero: bool,
    ) -> crate::error::Result<Tensor>;
}

/// A tensor's claim on pool storage; returns it on release.
pub struct Lease {
    lender: Arc<dyn Lender>,
    id: u64,
    bytes: usize,
    device: Device,
}

impl Lease {
    pub(crate) fn new(lender: Arc<dyn Lender>, id: u64, bytes: usize, device: Device) -> Self {
        Lease {
            lender,
            id,
            bytes,
            device,
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn tag(&self) -> String {
        self.lender.tag_of(self.id)
    }

    /// The device the storage lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The tag and category the storage was allocated under.
    pub(crate) fn meta(&self) -> Option<(Tag, Category)> {
        self.lender.meta_of(self.id)
    }

    pub(crate) fn release(&self, storage: Storage) {
        self.lender.give_back(self.id, storage);
    }

    /// A new loan from the pool this one came from.
    fn lend(
        &self,
        shape: Shape,
        dtype: DType,
        category: Category,
        tag: Tag,
        zero: bool,
    ) -> crate::error::Result<Tensor> {
        self.lender
            .clone()
            .lend(self.device, shape, dtype, category, tag, zero)
    }
}

/// Backing storage: a block of pool memory holding `len` units of one
/// element type. On a device (CUDA) `ptr` is the block's device address,
/// never dereferenced on the host: [`Tensor`]'s views refuse device
/// storage. Blocks are typeless bytes in the pool's arena (see
/// `memory::arena`); the storage owns its block exclusively until the tensor
/// holding it hands it back.
#[derive(Debug)]
pub struct Storage {
    ptr: NonNull<u8>,
    dtype: DType,
    len: usize,
    /// The block, or None for storage that holds no bytes (a shapes-only
    /// pool's, or an empty tensor's).
    place: Option<Place>,
}

// SAFETY: a storage is the only handle to its block's bytes (like a Vec of
// plain numbers), so moving it to or sharing it with another thread is safe.
unsafe impl Send for Storage {}
unsafe impl Sync for Storage {}

impl Storage {
    /// Storage over a block at `ptr` (aligned to 64 bytes, at least
    /// `dtype.storage_bytes`-worth of `len` units, initialised).
    pub(crate) fn in_block(ptr: NonNull<u8>, dtype: DType, len: usize, place: Place) -> Self {
        debug_assert_eq!(ptr.as_ptr() as usize % 64, 0);
        debug_assert!(place.bytes >= len * dtype.unit_bytes());
        Storage {
            ptr,
            dtype,
            len,
            place: Some(place),
        }
    }

    /// Storage with no bytes.
    pub(crate) fn empty(dtype: DType) -> Self {
        Storage {
            // Aligned for every element type, never dereferenced.
            ptr: NonNull::<u64>::dangling().cast(),
            dtype,
            len: 0,
            place: None,
        }
    }

    /// The block's device address (for device storage; see the type's doc).
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    pub(crate) fn device_address(&self) -> u64 {
        if self.place.is_none() {
            0
        } else {
            self.ptr.as_ptr().addr() as u64
        }
    }

    pub(crate) fn place(&self) -> Option<Place> {
        self.place
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Units of storage (elements; bytes for a bit mask).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fill_zero(&mut self) {
        // SAFETY: the block holds at least this many bytes; zero bytes are
        // a valid value of every element type.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len * self.dtype.unit_bytes()) }
    }

    /// The units as `T`, which must be this storage's unit type (checked by
    /// the caller, [`Tensor::check_unit`]).
    fn slice<T: Unit>(&self) -> &[T] {
        debug_assert_eq!(T::DTYPE, self.dtype);
        // SAFETY: T is the dtype's unit type, ptr is aligned for it, the
        // block holds len initialised units, and the shared borrow of self
        // keeps them from changing.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>(), self.len) }
    }

    fn slice_mut<T: Unit>(&mut self) -> &mut [T] {
        debug_assert_eq!(T::DTYPE, self.dtype);
        // SAFETY: as in `slice`, and the exclusive borrow of self (the only
        // handle to the block) makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<T>(), self.len) }
    }
}

/// A storage unit type and the dtype it stores, so a typed view cannot
/// pair one type's bytes with another's name.
trait Unit: Copy {
    const DTYPE: DType;
}

impl Unit for f32 {
    const DTYPE: DType = DType::F32;
}

impl Unit for bf16 {
    const DTYPE: DType = DType::BF16;
}

impl Unit for f16 {
    const DTYPE: DType = DType::F16;
}

/// Bit masks are stored a byte (8 bits) per unit.
impl Unit for u8 {
    const DTYPE: DType = DType::Bits;
}

/// A contiguous tensor whose storage is on loan from a pool.
pub struct Tensor {
    shape: Shape,
    storage: Option<Storage>, // Some until drop
    lease: Lease,
}

impl Tensor {
    pub(crate) fn from_parts(shape: Shape, storage: Storage, lease: Lease) -> Self {
        Tensor {
            shape,
            storage: Some(storage),
            lease,
        }
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    pub fn dtype(&self) -> DType {
        self.storage().dtype()
    }

    /// The device this tensor's storage lives on.
    pub fn device(&self) -> Device {
        self.lease.device()
    }

    /// Bytes of storage this tensor holds in the pool.
    pub fn bytes(&self) -> usize {
        self.lease.bytes()
    }

    pub fn tag(&self) -> String {
        self.lease.tag()
    }

    /// The tag and category this tensor's storage was allocated under.
    pub fn meta(&self) -> (Tag, Category) {
        self.lease
            .meta()
            .unwrap_or((Tag::fixed("?"), Category::Workspace))
    }

    /// A scratch tensor of at least `bytes` bytes (f32 units; contents
    /// unspecified, or zeros when `zero`) from the same pool as `self`,
    /// under category workspace: how a backend function gets memory for
    /// partial sums, flags or uploaded labels without a new parameter at
    /// the boundary. It counts against the pool's budget and peak like any
    /// tensor and goes back to the pool when dropped. Only the CUDA backend
    /// asks for one (the CPU's kernels keep such state on the stack).
    pub fn scratch(&self, bytes: usize, tag: Tag, zero: bool) -> crate::error::Result<Tensor> {
        let units = bytes.div_ceil(DType::F32.unit_bytes());
        self.lease.lend(
            Shape::new(&[units]),
            DType::F32,
            Category::Workspace,
            tag,
            zero,
        )
    }

    /// Reinterpret with a new shape of the same element count.
    pub fn reshape(mut self, dims: &[usize]) -> Self {
        let shape = Shape::new(dims);
        assert_eq!(
            shape.numel(),
            self.numel(),
            "reshape {:?} -> {dims:?}",
            self.shape
        );
        self.shape = shape;
        self
    }

    fn storage(&self) -> &Storage {
        self.storage.as_ref().expect("storage present until drop")
    }

    fn storage_mut(&mut self) -> &mut Storage {
        self.storage.as_mut().expect("storage present until drop")
    }

    // Typed views. A wrong dtype is a bug in the engine, never user input,
    // so these panic with the tensor's tag rather than return an error.
    fn check_unit<T: Unit>(&self) {
        let found = self.storage().dtype;
        if found != T::DTYPE {
            panic!(
                "{}: expected {} storage, found {}",
                self.tag(),
                T::DTYPE.name(),
                found.name()
            );
        }
    }

    // A host view of device storage is a bug in the engine too: the
    // backend reads device tensors by address ([`Tensor::device_address`])
    // and the layers above it never read slices. On builds without a
    // device backend this check compiles to nothing.
    #[inline]
    fn check_host(&self) {
        // A meta device standing for a GPU panics too, so the planner's
        // and the tests' runs on it catch a host view before a GPU does.
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        if let Device::Cuda(n) | Device::Meta(crate::device::Target::Cuda(n)) = self.device() {
            panic!(
                "engine bug: {} lives on {} (cuda:{n}); a host view of device storage was \
                 asked (copy it with backend::copy_to_host)",
                self.tag(),
                self.device().name()
            );
        }
    }

    fn view<T: Unit>(&self) -> &[T] {
        self.check_unit::<T>();
        self.check_host();
        self.storage().slice()
    }

    fn view_mut<T: Unit>(&mut self) -> &mut [T] {
        self.check_unit::<T>();
        self.check_host();
        self.storage_mut().slice_mut()
    }

    /// The device address of this tensor's storage (0 when it holds no
    /// bytes). For the CUDA backend; the address is never dereferenced on
    /// the host.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    pub(crate) fn device_address(&self) -> u64 {
        self.storage().device_address()
    }

    /// Bytes of storage units this tensor holds (its length in units times
    /// the unit size), as the kernels see it.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    pub(crate) fn storage_bytes(&self) -> usize {
        let s = self.storage();
        s.len * s.dtype.unit_bytes()
    }

    pub fn f32(&self) -> &[f32] {
        self.view()
    }

    pub fn f32_mut(&mut self) -> &mut [f32] {
        self.view_mut()
    }

    pub fn bits(&self) -> &[u8] {
        self.view()
    }

    pub fn bits_mut(&mut self) -> &mut [u8] {
        self.view_mut()
    }

    pub fn bf16(&self) -> &[bf16] {
        self.view()
    }

    pub fn bf16_mut(&mut self) -> &mut [bf16] {
        self.view_mut()
    }

    pub fn f16(&self) -> &[f16] {
        self.view()
    }

    pub fn f16_mut(&mut self) -> &mut [f16] {
        self.view_mut()
    }

    /// Zeroes every element (on a CUDA device: a memset queued on its
    /// stream; a failure there is an engine bug and panics, like a host
    /// view would).
    pub fn fill_zero(&mut self) {
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        if let Device::Cuda(n) = self.device() {
            let (addr, bytes) = (self.device_address(), self.storage_bytes());
            crate::device::cuda::core(n)
                .map_err(|e| format!("{e:?}"))
                .and_then(|c| c.memset_zero(addr, bytes).map_err(|e| e.to_string()))
                .unwrap_or_else(|e| panic!("engine bug: zeroing {} on cuda:{n}: {e}", self.tag()));
            return;
        }
        self.storage_mut().fill_zero();
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Some(storage) = self.storage.take() {
            self.lease.release(storage);
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({}, {:?}, {:?})",
            self.tag(),
            self.shape,
            self.dtype()
        )
    }
}
