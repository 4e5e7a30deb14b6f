//! Where storage lives and what the hardware there can do.
//!
//! A [`Device`] names a place for tensor storage and kernels: the host CPU,
//! or *meta*, a device with no storage that stands in for a real one so the
//! planner can run a whole step as accounting only. The kernels of each
//! real device live in a submodule (`cpu`: the gemm crate, rayon and our
//! bf16 kernels); the backend boundary above (`crate::backend`) dispatches
//! on the device of a tensor's storage. This module knows nothing of
//! tensors, pools or models.

pub mod cpu;
/// The CUDA probe (which libraries load, which GPU is there).
#[cfg(any(feature = "cuda", feature = "cuda-12"))]
pub mod cuda;

/// A device that holds real storage and runs kernels. The meta device
/// stands in for one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// This machine's CPU.
    Cpu,
    /// CUDA device number `n` (the driver's ordinal).
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    Cuda(u32),
}

/// Where a tensor's storage lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory; kernels on the CPU.
    Cpu,
    /// Shapes only: tensors are accounted for in the pool but hold no
    /// bytes, and kernels do nothing. Capabilities and workspace sizes are
    /// those of the target, so a step simulated here allocates exactly
    /// what it allocates there (the planner's simulator).
    Meta(Target),
    /// CUDA device number `n`: storage is device memory (a device address),
    /// kernels are queued on the device's one compute stream.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    Cuda(u32),
}

impl Device {
    /// Whether kernels run and storage holds values (false for meta).
    pub fn computes(self) -> bool {
        !matches!(self, Device::Meta(_))
    }

    /// The real device this one is or stands in for.
    pub fn target(self) -> Target {
        match self {
            Device::Cpu => Target::Cpu,
            Device::Meta(t) => t,
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Device::Cuda(n) => Target::Cuda(n),
        }
    }

    /// What the (target) hardware can do.
    pub fn capabilities(self) -> Capabilities {
        match self.target() {
            Target::Cpu => Capabilities::cpu(),
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Target::Cuda(n) => Capabilities::cuda(n),
        }
    }

    pub fn name(self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Meta(t) => format!("meta({})", Device::from(t).name()),
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Device::Cuda(n) => format!("cuda:{n}"),
        }
    }
}

impl From<Target> for Device {
    fn from(t: Target) -> Device {
        match t {
            Target::Cpu => Device::Cpu,
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Target::Cuda(n) => Device::Cuda(n),
        }
    }
}

/// Layout of convolution weights in a device's storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvWeightLayout {
    /// (kh, kw, cin, cout): the CPU GEMM's right operand as stored.
    Hwio,
}

/// What a device can do, in one place: the layers, the planner and the
/// binary ask here instead of probing the hardware themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// bf16 products run natively (AVX512-BF16 on the CPU); otherwise bf16
    /// mode multiplies pre-rounded operands in f32 (same values, no speed-up).
    pub native_bf16: bool,
    /// Convolutions read bf16-stored activations in place and BN+ReLU
    /// writes its bf16 output directly, so no whole f32 copy of a bf16
    /// tensor is made (the CPU, with or without bf16 dot products: its f32
    /// GEMM widens one tile of rows at a time; a GPU with bf16 tensor
    /// cores, through cuDNN's bf16 convolutions).
    pub reads_bf16: bool,
    /// Layout of convolution weights in storage.
    pub conv_weight_layout: ConvWeightLayout,
    /// Kernels give the same bits run after run (fixed reduction orders).
    pub deterministic: bool,
}

impl Capabilities {
    /// This machine's CPU (probed once per process by the kernels).
    pub fn cpu() -> Self {
        Capabilities {
            native_bf16: cpu::bf16_gemm_available(),
            reads_bf16: true,
            conv_weight_layout: ConvWeightLayout::Hwio,
            deterministic: true,
        }
    }

    /// CUDA device `ordinal`, from the probe (asked once per device and
    /// cached, see [`cuda::device_facts`]); when the probe fails (no GPU
    /// here: a plan made on a machine without one), the documented default
    /// device [`cuda::DEFAULT_COMPUTE_CAPABILITY`] stands in.
    ///
    /// * `reads_bf16` where the card has bf16 tensor cores
    ///   ([`cuda::hardware_bf16`], compute capability 8.0 and up): under
    ///   bf16 the convolutions run cuDNN in bf16 with f32 accumulation on
    ///   bf16-stored activations, BN, the residual add, ReLU masks and the
    ///   max-pool backward read and write bf16, as on the CPU.
    /// * `native_bf16` is false: the layers still hand the convolution a
    ///   weight rounded to bf16 (the backend's OHWI copy is then an exact
    ///   bf16 conversion) and the linear layer's GEMM is f32 of rounded
    ///   operands.
    /// * `conv_weight_layout` is `Hwio`, the layout the layers store: the
    ///   backend transposes the weight into cuDNN's NHWC filter layout
    ///   (cout, kh, kw, cin) inside the convolution's workspace.
    /// * `deterministic`: the backend pins deterministic cuDNN algorithms
    ///   and uses no atomics in its reductions.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    pub fn cuda(ordinal: u32) -> Self {
        let facts = cuda::device_facts(ordinal);
        Capabilities {
            native_bf16: false,
            reads_bf16: cuda::hardware_bf16(facts.compute_capability),
            conv_weight_layout: ConvWeightLayout::Hwio,
            deterministic: true,
        }
    }
}

/// Why [`select`] refused a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SelectError {
    /// Not a device name; the message names the accepted forms.
    Usage(String),
    /// The device is not usable here: `what` names what is missing, `hint`
    /// how to get it (`crate::error` makes it `Error::CudaUnavailable`).
    Unavailable { what: String, hint: String },
}

impl std::fmt::Display for SelectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SelectError::Usage(m) => write!(f, "{m}"),
            SelectError::Unavailable { what, hint } => write!(f, "{what}: {hint}"),
        }
    }
}

/// Whether `--device auto` may pick the CUDA backend. Every op of the
/// boundary has a CUDA arm (`backend::cuda::ops`), but none has run on a
/// GPU yet, so this stays false
/// until `tests/cuda_vs_cpu.rs` has passed on one: `auto` stays on the CPU
/// and says why; `--device cuda` uses the backend anyway.
pub const CUDA_BACKEND_COMPLETE: bool = false;

/// The GPU number `kind` names (`cuda` is 0, `cuda:N` is N), or None.
pub fn cuda_ordinal(kind: &str) -> Option<u32> {
    match kind.trim().strip_prefix("cuda")? {
        "" => Some(0),
        rest => rest.strip_prefix(':')?.parse().ok(),
    }
}

/// The device for `--device KIND`: `cpu`, `cuda` (device 0), `cuda:N`, or
/// `auto` (CUDA device 0 when the probe finds it usable and the backend is
/// complete, else the CPU). Returns the device and one line saying which
/// device was chosen and why.
pub fn select(kind: &str) -> std::result::Result<(Device, String), SelectError> {
    let kind = kind.trim();
    match kind {
        "cpu" => Ok((Device::Cpu, "device: cpu (--device cpu)".into())),
        "auto" => Ok(select_auto()),
        _ => match cuda_ordinal(kind) {
            Some(ordinal) => select_cuda(ordinal),
            None if kind.starts_with("cuda") => Err(SelectError::Usage(format!(
                "unknown device '{kind}': use cuda:N with N a GPU number, e.g. cuda:0"
            ))),
            None => Err(SelectError::Usage(format!(
                "unknown device '{kind}': use cpu, cuda, cuda:N (N a GPU number) or auto"
            ))),
        },
    }
}

#[cfg(any(feature = "cuda", feature = "cuda-12"))]
fn select_cuda(ordinal: u32) -> std::result::Result<(Device, String), SelectError> {
    match cuda::probe(ordinal as usize) {
        Ok(info) => {
            let mut note = format!("device: {info} (--device cuda:{ordinal})");
            if !CUDA_BACKEND_COMPLETE {
                note.push_str(
                    "; note: the CUDA backend has never been checked on a GPU in this build",
                );
            }
            Ok((Device::Cuda(ordinal), note))
        }
        Err(m) => Err(SelectError::Unavailable {
            what: m.what,
            hint: m.hint,
        }),
    }
}

#[cfg(not(any(feature = "cuda", feature = "cuda-12")))]
fn select_cuda(_ordinal: u32) -> std::result::Result<(Device, String), SelectError> {
    Err(SelectError::Unavailable {
        what: "this memfit build has no CUDA support".into(),
        hint: "rebuild with --features cuda (CUDA 13: Turing and newer GPUs) or --features \
               cuda-12 (CUDA 12.8: Pascal and Volta too)"
            .into(),
    })
}

#[cfg(any(feature = "cuda", feature = "cuda-12"))]
fn select_auto() -> (Device, String) {
    match cuda::probe(0) {
        Ok(info) if CUDA_BACKEND_COMPLETE => (
            Device::Cuda(0),
            format!("device: {info} (auto: a CUDA device works)"),
        ),
        Ok(info) => (
            Device::Cpu,
            format!(
                "device: cpu (auto: {info} works, but the CUDA backend has not been checked on \
                 a GPU in this build; --device cuda uses it anyway)"
            ),
        ),
        Err(m) => (
            Device::Cpu,
            format!("device: cpu (auto: no usable CUDA device: {m})"),
        ),
    }
}

#[cfg(not(any(feature = "cuda", feature = "cuda-12")))]
fn select_auto() -> (Device, String) {
    (
        Device::Cpu,
        "device: cpu (auto: this build has no CUDA support; rebuild with --features cuda for \
         NVIDIA GPUs)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_parses_and_refuses_with_reasons() {
        let (d, note) = select("cpu").unwrap();
        assert_eq!(d, Device::Cpu);
        assert!(note.contains("cpu"), "{note}");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda1", ""] {
            let e = select(bad).unwrap_err();
            assert!(matches!(e, SelectError::Usage(_)), "{bad}: {e}");
            assert!(e.to_string().contains("cuda:N"), "{e}");
        }
    }

    /// On a machine without a usable GPU (this one, CI): `cuda` is an error
    /// naming what is missing, `auto` picks the CPU and says why.
    #[test]
    fn select_without_a_gpu() {
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        if cuda::probe(0).is_ok() {
            println!("skipped: a CUDA device is here");
            return;
        }
        let e = select("cuda").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, SelectError::Unavailable { .. }), "{msg}");
        if cfg!(any(feature = "cuda", feature = "cuda-12")) {
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            if !cuda::Library::Driver.is_present() {
                assert!(msg.contains("libcuda.so.1"), "{msg}");
                assert!(msg.contains("NVIDIA driver"), "{msg}");
            }
        } else {
            assert!(msg.contains("--features cuda"), "{msg}");
        }
        assert!(select("cuda:3").is_err());
        let (d, note) = select("auto").unwrap();
        assert_eq!(d, Device::Cpu);
        assert!(note.starts_with("device: cpu (auto: "), "{note}");
        if cfg!(any(feature = "cuda", feature = "cuda-12")) {
            assert!(note.contains("no usable CUDA device"), "{note}");
        } else {
            assert!(note.contains("no CUDA support"), "{note}");
        }
    }

    #[test]
    fn meta_answers_as_its_target() {
        let meta = Device::Meta(Target::Cpu);
        assert!(!meta.computes());
        assert!(Device::Cpu.computes());
        assert_eq!(meta.capabilities(), Device::Cpu.capabilities());
        assert_eq!(meta.target(), Target::Cpu);
        assert_eq!(meta.name(), "meta(cpu)");
    }
}
