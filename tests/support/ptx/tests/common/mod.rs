//! Shared by the tests: a Vec-backed device memory and NVRTC.
#![allow(dead_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use memfit_ptx::Memory;

/// Device memory: allocations at opaque, non-host addresses.
pub struct VecMemory {
    next: u64,
    allocs: Vec<(u64, Vec<u8>)>,
}

impl Default for VecMemory {
    fn default() -> Self {
        VecMemory {
            next: 0x7700_0000_0000,
            allocs: Vec::new(),
        }
    }
}

impl VecMemory {
    /// Allocates `bytes` (256-aligned, with a gap after it), filled with 0xAB.
    pub fn alloc(&mut self, bytes: usize) -> u64 {
        let base = self.next;
        self.next += (bytes as u64).div_ceil(256) * 256 + 4096;
        self.allocs.push((base, vec![0xAB; bytes]));
        base
    }
    pub fn upload(&mut self, data: &[u8]) -> u64 {
        let a = self.alloc(data.len());
        self.allocs.last_mut().unwrap().1.copy_from_slice(data);
        a
    }
    pub fn upload_f32(&mut self, v: &[f32]) -> u64 {
        self.upload(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    pub fn upload_u16(&mut self, v: &[u16]) -> u64 {
        self.upload(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    pub fn bytes(&self, addr: u64) -> &[u8] {
        &self
            .allocs
            .iter()
            .find(|a| a.0 == addr)
            .expect("an allocation")
            .1
    }
    pub fn f32s(&self, addr: u64) -> Vec<f32> {
        self.bytes(addr)
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    pub fn f64s(&self, addr: u64) -> Vec<f64> {
        self.bytes(addr)
            .chunks(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    pub fn u16s(&self, addr: u64) -> Vec<u16> {
        self.bytes(addr)
            .chunks(2)
            .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    pub fn u32s(&self, addr: u64) -> Vec<u32> {
        self.bytes(addr)
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    pub fn u64s(&self, addr: u64) -> Vec<u64> {
        self.bytes(addr)
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    fn find(&mut self, addr: u64, len: usize) -> Result<&mut [u8], String> {
        for (base, data) in &mut self.allocs {
            if addr >= *base && addr + len as u64 <= *base + data.len() as u64 {
                let o = (addr - *base) as usize;
                return Ok(&mut data[o..o + len]);
            }
        }
        Err("outside every allocation".into())
    }
}

impl Memory for VecMemory {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), String> {
        let s = self.find(addr, out.len())?;
        out.copy_from_slice(s);
        Ok(())
    }
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), String> {
        self.find(addr, data.len())?.copy_from_slice(data);
        Ok(())
    }
}

/// Parameter bytes.
pub fn p64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}
pub fn p32(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}
pub fn pf32(v: f32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// The kernel sources of the memfit crate: (name, common.cuh + source).
pub fn kernel_sources() -> Vec<(String, String)> {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../src/backend/cuda/kernels");
    let common = std::fs::read_to_string(dir.join("common.cuh")).expect("common.cuh");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).expect("the kernels directory") {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "cu") {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let src = std::fs::read_to_string(&p).unwrap();
            out.push((name, format!("{common}\n{src}")));
        }
    }
    out.sort();
    out
}

type Create = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type Compile = unsafe extern "C" fn(*mut c_void, c_int, *const *const c_char) -> c_int;
type Size = unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int;
type Get = unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int;
type Destroy = unsafe extern "C" fn(*mut *mut c_void) -> c_int;

/// NVRTC 13, dlopened (found through LD_LIBRARY_PATH).
pub struct Nvrtc {
    lib: libloading::Library,
}

impl Nvrtc {
    /// NVRTC, or `None` after printing why not. With MEMFIT_REQUIRE_NVRTC=1
    /// a missing NVRTC panics.
    pub fn load() -> Option<Nvrtc> {
        let mut why = Vec::new();
        for name in ["libnvrtc.so.13", "libnvrtc.so"] {
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return Some(Nvrtc { lib }),
                Err(e) => why.push(format!("{name}: {e}")),
            }
        }
        let msg = format!("NVRTC not loadable, skipping ({})", why.join("; "));
        if std::env::var("MEMFIT_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
            panic!("{msg} and MEMFIT_REQUIRE_NVRTC=1");
        }
        eprintln!("{msg}");
        None
    }

    /// Compiles `src` with the backend's options for `arch` (e.g. compute_75).
    pub fn compile(&self, name: &str, src: &str, arch: &str) -> String {
        unsafe {
            let create: libloading::Symbol<Create> = self.lib.get(b"nvrtcCreateProgram").unwrap();
            let compile: libloading::Symbol<Compile> =
                self.lib.get(b"nvrtcCompileProgram").unwrap();
            let ptx_size: libloading::Symbol<Size> = self.lib.get(b"nvrtcGetPTXSize").unwrap();
            let get_ptx: libloading::Symbol<Get> = self.lib.get(b"nvrtcGetPTX").unwrap();
            let log_size: libloading::Symbol<Size> =
                self.lib.get(b"nvrtcGetProgramLogSize").unwrap();
            let get_log: libloading::Symbol<Get> = self.lib.get(b"nvrtcGetProgramLog").unwrap();
            let destroy: libloading::Symbol<Destroy> =
                self.lib.get(b"nvrtcDestroyProgram").unwrap();
            let csrc = CString::new(src).unwrap();
            let cname = CString::new(format!("{name}.cu")).unwrap();
            let mut prog = std::ptr::null_mut();
            assert_eq!(
                create(
                    &mut prog,
                    csrc.as_ptr(),
                    cname.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null()
                ),
                0
            );
            let opts: Vec<CString> = [
                "--ftz=false",
                "--prec-sqrt=true",
                "--prec-div=true",
                "--fmad=false",
                &format!("--gpu-architecture={arch}"),
            ]
            .iter()
            .map(|s| CString::new(*s).unwrap())
            .collect();
            let ptrs: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();
            let r = compile(prog, ptrs.len() as c_int, ptrs.as_ptr());
            if r != 0 {
                let mut n = 0;
                log_size(prog, &mut n);
                let mut log = vec![0 as c_char; n + 1];
                get_log(prog, log.as_mut_ptr());
                panic!(
                    "NVRTC failed on {name} for {arch} ({r}): {}",
                    CStr::from_ptr(log.as_ptr()).to_string_lossy()
                );
            }
            let mut n = 0;
            assert_eq!(ptx_size(prog, &mut n), 0);
            let mut buf = vec![0 as c_char; n + 1];
            assert_eq!(get_ptx(prog, buf.as_mut_ptr()), 0);
            destroy(&mut prog);
            CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
        }
    }
}

/// The PTX of one kernel source for `arch`, when NVRTC is there.
pub fn ptx_of(source: &str, arch: &str) -> Option<String> {
    let nv = Nvrtc::load()?;
    let (name, src) = kernel_sources()
        .into_iter()
        .find(|(n, _)| n == source)
        .expect("a kernel source");
    Some(nv.compile(&name, &src, arch))
}
