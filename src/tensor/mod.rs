//! Shapes, element types and contiguous storage. Activations are NHWC.
//!
//! A [`Tensor`] owns its storage for as long as it lives and hands it back to
//! the [`Pool`](crate::memory::Pool) it came from when dropped, so the pool's
//! live-byte count is exactly the storage of the tensors that exist.

use half::{bf16, f16};

use crate::memory::Lease;

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
        match self {
            DType::F32 => 4 * numel,
            DType::BF16 | DType::F16 => 2 * numel,
            DType::I64 => 8 * numel,
            DType::Bits => numel.div_ceil(8),
        }
    }

    /// Number of storage units (elements of the backing `Vec`) for `numel`.
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

/// Backing storage, one variant per element type.
#[derive(Debug)]
pub enum Storage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    I64(Vec<i64>),
    Bits(Vec<u8>),
}

impl Storage {
    /// A zero-filled storage of `len` units (a fresh system allocation).
    pub fn zeroed(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => Storage::F32(vec![0.0; len]),
            DType::BF16 => Storage::BF16(vec![bf16::ZERO; len]),
            DType::F16 => Storage::F16(vec![f16::ZERO; len]),
            DType::I64 => Storage::I64(vec![0; len]),
            DType::Bits => Storage::Bits(vec![0; len]),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::BF16(_) => DType::BF16,
            Storage::F16(_) => DType::F16,
            Storage::I64(_) => DType::I64,
            Storage::Bits(_) => DType::Bits,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::BF16(v) => v.len(),
            Storage::F16(v) => v.len(),
            Storage::I64(v) => v.len(),
            Storage::Bits(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn fill_zero(&mut self) {
        match self {
            Storage::F32(v) => v.fill(0.0),
            Storage::BF16(v) => v.fill(bf16::ZERO),
            Storage::F16(v) => v.fill(f16::ZERO),
            Storage::I64(v) => v.fill(0),
            Storage::Bits(v) => v.fill(0),
        }
    }
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

    /// Bytes of storage this tensor holds in the pool.
    pub fn bytes(&self) -> usize {
        self.lease.bytes()
    }

    pub fn tag(&self) -> String {
        self.lease.tag()
    }

    /// The tag and category this tensor's storage was allocated under.
    pub fn meta(&self) -> (crate::memory::Tag, crate::memory::Category) {
        self.lease.meta().unwrap_or((
            crate::memory::Tag::fixed("?"),
            crate::memory::Category::Workspace,
        ))
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
    pub fn f32(&self) -> &[f32] {
        match self.storage() {
            Storage::F32(v) => v,
            s => panic!(
                "{}: expected f32 storage, found {:?}",
                self.tag(),
                s.dtype()
            ),
        }
    }

    pub fn f32_mut(&mut self) -> &mut [f32] {
        match self.storage.as_mut() {
            Some(Storage::F32(v)) => v,
            other => panic!(
                "{}: expected f32 storage, found {:?}",
                self.lease.tag(),
                other.map(|s| s.dtype())
            ),
        }
    }

    pub fn bits(&self) -> &[u8] {
        match self.storage() {
            Storage::Bits(v) => v,
            s => panic!(
                "{}: expected bit storage, found {:?}",
                self.tag(),
                s.dtype()
            ),
        }
    }

    pub fn bits_mut(&mut self) -> &mut [u8] {
        match self.storage.as_mut() {
            Some(Storage::Bits(v)) => v,
            other => panic!(
                "{}: expected bits storage, found {:?}",
                self.lease.tag(),
                other.map(|s| s.dtype())
            ),
        }
    }

    pub fn bf16(&self) -> &[bf16] {
        match self.storage() {
            Storage::BF16(v) => v,
            s => panic!(
                "{}: expected bf16 storage, found {:?}",
                self.tag(),
                s.dtype()
            ),
        }
    }

    pub fn bf16_mut(&mut self) -> &mut [bf16] {
        match self.storage.as_mut() {
            Some(Storage::BF16(v)) => v,
            other => panic!(
                "{}: expected bf16 storage, found {:?}",
                self.lease.tag(),
                other.map(|s| s.dtype())
            ),
        }
    }

    pub fn f16(&self) -> &[f16] {
        match self.storage() {
            Storage::F16(v) => v,
            s => panic!(
                "{}: expected f16 storage, found {:?}",
                self.tag(),
                s.dtype()
            ),
        }
    }

    pub fn f16_mut(&mut self) -> &mut [f16] {
        match self.storage.as_mut() {
            Some(Storage::F16(v)) => v,
            other => panic!(
                "{}: expected f16 storage, found {:?}",
                self.lease.tag(),
                other.map(|s| s.dtype())
            ),
        }
    }

    pub fn fill_zero(&mut self) {
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
