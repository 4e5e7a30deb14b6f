//! The CUDA driver API functions memfit (through cudarc) calls.
//!
//! Handles are small numbers cast to pointers, never host addresses. One
//! device, one primary context; a call that needs a context fails with
//! `CUDA_ERROR_INVALID_CONTEXT` on a thread that has not made it current,
//! as the real driver does.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::Arc;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUfunction, CUmemAccess_flags,
    CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationProp, CUmemAllocationType,
    CUmemGenericAllocationHandle, CUmemLocationType, CUmodule, CUresult, CUstream,
};

use crate::queue::Op;
use crate::state::{DEVICE_NAME, Event, Fake, fake};

/// The one primary context.
const PRIMARY: usize = 0xC0C0_0000;

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn h<T>(v: usize) -> *mut T {
    v as *mut T
}

/// The error every call gives once a failure ended the context.
fn sticky(f: &Fake) -> Option<CUresult> {
    f.sticky.as_ref().map(|s| {
        if s.illegal_address {
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
        } else {
            CUresult::CUDA_ERROR_LAUNCH_FAILED
        }
    })
}

/// The checks of a call that needs the context: initialised, current on
/// this thread, not ended by a failure.
fn ready(f: &Fake) -> Result<(), CUresult> {
    if !f.initialised {
        return Err(CUresult::CUDA_ERROR_NOT_INITIALIZED);
    }
    if CURRENT.with(Cell::get) != PRIMARY {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    match sticky(f) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

macro_rules! ready {
    ($f:expr) => {
        if let Err(e) = ready(&$f) {
            return e;
        }
    };
}

fn done(r: Result<(), crate::queue::Failed>, f: &Fake) -> CUresult {
    match r {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(_) => sticky(f).unwrap_or(CUresult::CUDA_ERROR_LAUNCH_FAILED),
    }
}

/// Refuses a call with a message (stderr) and `e`.
fn refuse(e: CUresult, why: String) -> CUresult {
    eprintln!("fake CUDA: {why}");
    e
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    fake().initialised = true;
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    if v.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    unsafe { v.write(13000) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    if !fake().initialised {
        return CUresult::CUDA_ERROR_NOT_INITIALIZED;
    }
    if count.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    unsafe { count.write(1) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    if !fake().initialised {
        return CUresult::CUDA_ERROR_NOT_INITIALIZED;
    }
    if ordinal != 0 {
        return CUresult::CUDA_ERROR_INVALID_DEVICE;
    }
    unsafe { dev.write(0) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    if dev != 0 {
        return CUresult::CUDA_ERROR_INVALID_DEVICE;
    }
    if name.is_null() || len <= 0 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    let bytes = DEVICE_NAME.as_bytes();
    let n = bytes.len().min(len as usize - 1);
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), name, n);
        name.add(n).write(0);
    }
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: CUdevice_attribute,
    dev: CUdevice,
) -> CUresult {
    use CUdevice_attribute as A;
    if dev != 0 {
        return CUresult::CUDA_ERROR_INVALID_DEVICE;
    }
    let cc = fake().cc;
    let v = match attrib {
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => cc.0,
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => cc.1,
        A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => 132,
        A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X | A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y => 1024,
        A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z => 64,
        A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X => i32::MAX,
        A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y | A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z => 65535,
        A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK => 48 << 10,
        A::CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
        // No stream-ordered allocator: cudarc then allocates with cuMemAlloc.
        A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED => 0,
        A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING => 1,
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED => 1,
        _ => 0,
    };
    if pi.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    unsafe { pi.write(v) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    if dev != 0 {
        return CUresult::CUDA_ERROR_INVALID_DEVICE;
    }
    unsafe { bytes.write(fake().mem.total_bytes) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    if !fake().initialised {
        return CUresult::CUDA_ERROR_NOT_INITIALIZED;
    }
    if dev != 0 {
        return CUresult::CUDA_ERROR_INVALID_DEVICE;
    }
    unsafe { ctx.write(h(PRIMARY)) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    if dev != 0 {
        return CUresult::CUDA_ERROR_INVALID_DEVICE;
    }
    // The context (and its memory) lives for the process: memfit keeps its
    // devices' cores for the process too.
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    let c = ctx as usize;
    if c != 0 && c != PRIMARY {
        return CUresult::CUDA_ERROR_INVALID_CONTEXT;
    }
    CURRENT.with(|cur| cur.set(c));
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult {
    unsafe { ctx.write(h(CURRENT.with(Cell::get))) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    cuCtxSetCurrent(ctx)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut CUcontext) -> CUresult {
    if !ctx.is_null() {
        unsafe { ctx.write(h(CURRENT.with(Cell::get))) };
    }
    CURRENT.with(|c| c.set(0));
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    let mut f = fake();
    ready!(f);
    let r = f.flush();
    done(r, &f)
}

// ---------------------------------------------------------------------------
// Memory

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let f = fake();
    ready!(f);
    unsafe {
        free.write(f.mem.total_bytes - f.mem.live_bytes);
        total.write(f.mem.total_bytes);
    }
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    let mut f = fake();
    ready!(f);
    if bytes == 0 || ptr.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    match f.mem.alloc(bytes) {
        Some(at) => {
            unsafe { ptr.write(at) };
            CUresult::CUDA_SUCCESS
        }
        None => CUresult::CUDA_ERROR_OUT_OF_MEMORY,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    let mut f = fake();
    ready!(f);
    // cuMemFree synchronises: queued work that reads the memory runs first.
    if f.flush().is_err() {
        return done(Err(crate::queue::Failed), &f);
    }
    match f.mem.free(ptr) {
        Ok(_) => CUresult::CUDA_SUCCESS,
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

// Virtual memory management: reserve addresses, create physical memory,
// map it, grant access (what memfit's pool maps device memory in granules
// with).

/// The checks of a `CUmemAllocationProp`: pinned memory of device 0.
unsafe fn device_prop(prop: *const CUmemAllocationProp) -> Result<(), CUresult> {
    // SAFETY: the caller's pointer, checked for null.
    let Some(p) = (unsafe { prop.as_ref() }) else {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    };
    if p.type_ != CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
        || p.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        || p.location.id != 0
    {
        return Err(refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "cuMemCreate/cuMemGetAllocationGranularity: only pinned memory of device 0".into(),
        ));
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    _option: CUmemAllocationGranularity_flags,
) -> CUresult {
    if let Err(e) = unsafe { device_prop(prop) } {
        return e;
    }
    if granularity.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    unsafe { granularity.write(crate::memory::DEVICE_ALIGN as usize) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    _alignment: usize,
    _addr: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if ptr.is_null() || flags != 0 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    match f.mem.reserve(size) {
        Ok(at) => {
            unsafe { ptr.write(at) };
            CUresult::CUDA_SUCCESS
        }
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    let mut f = fake();
    ready!(f);
    match f.mem.unreserve(ptr, size) {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if let Err(e) = unsafe { device_prop(prop) } {
        return e;
    }
    if handle.is_null() || flags != 0 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    match f.mem.create(size) {
        Ok(Some(h)) => {
            unsafe { handle.write(h) };
            CUresult::CUDA_SUCCESS
        }
        Ok(None) => CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    let mut f = fake();
    ready!(f);
    match f.mem.release(handle) {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if flags != 0 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    match f.mem.map(ptr, size, offset, handle) {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

/// Does not wait for queued work (neither does the real driver): work
/// queued before it that touches the range fails when it runs.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let mut f = fake();
    ready!(f);
    match f.mem.unmap(ptr, size) {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if desc.is_null() || count != 1 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked for null; count is 1.
    let d = unsafe { &*desc };
    if d.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        || d.location.id != 0
        || d.flags != CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    {
        return refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "cuMemSetAccess: only read-write access for device 0".into(),
        );
    }
    match f.mem.set_access(ptr, size) {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(why) => refuse(CUresult::CUDA_ERROR_INVALID_VALUE, why),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if bytes == 0 || pp.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    let p = f.pinned.alloc(bytes);
    unsafe { pp.write(p.cast()) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    let mut f = fake();
    ready!(f);
    // As cuMemFreeHost, after the queued work (a copy may use it).
    if f.flush().is_err() {
        return done(Err(crate::queue::Failed), &f);
    }
    if f.pinned.free(p.cast()) {
        CUresult::CUDA_SUCCESS
    } else {
        refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("cuMemFreeHost({p:p}): not page-locked memory from cuMemHostAlloc"),
        )
    }
}

/// Checks a device range at the call, as the real driver validates its
/// arguments before queueing.
fn check_device(f: &Fake, op: &str, addr: u64, len: usize) -> Result<(), CUresult> {
    f.mem
        .check(addr, len)
        .map_err(|why| refuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("{op}: {why}")))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    value: u8,
    n: usize,
    _s: CUstream,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if let Err(e) = check_device(&f, "cuMemsetD8Async", dst, n) {
        return e;
    }
    let r = f.enqueue(Op::Fill { dst, value, len: n });
    done(r, &f)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, n: usize) -> CUresult {
    let r = unsafe { cuMemsetD8Async(dst, value, n, std::ptr::null_mut()) };
    if r != CUresult::CUDA_SUCCESS {
        return r;
    }
    cuCtxSynchronize()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    _s: CUstream,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if let Err(e) = check_device(&f, "cuMemcpyHtoDAsync", dst, n) {
        return e;
    }
    if src.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract: n readable bytes at src.
    let bytes = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) }.to_vec();
    let op = if f.pinned.contains(src as usize, n) {
        Op::UploadPinned {
            dst,
            src: src as usize,
            len: n,
            snapshot: bytes,
        }
    } else {
        Op::Upload { dst, data: bytes }
    };
    let r = f.enqueue(op);
    done(r, &f)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
) -> CUresult {
    let r = unsafe { cuMemcpyHtoDAsync_v2(dst, src, n, std::ptr::null_mut()) };
    if r != CUresult::CUDA_SUCCESS {
        return r;
    }
    cuCtxSynchronize()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    _s: CUstream,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if let Err(e) = check_device(&f, "cuMemcpyDtoHAsync", src, n) {
        return e;
    }
    if dst.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    if f.pinned.contains(dst as usize, n) {
        let r = f.enqueue(Op::DownloadPinned {
            dst: dst as usize,
            src,
            len: n,
        });
        return done(r, &f);
    }
    // To pageable memory the copy is synchronous: the queued work first.
    if f.flush().is_err() {
        return done(Err(crate::queue::Failed), &f);
    }
    // SAFETY: the caller's contract: n writable bytes at dst.
    let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
    match f.mem.read(src, out) {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(why) => refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("cuMemcpyDtoHAsync: {why}"),
        ),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    let r = unsafe { cuMemcpyDtoHAsync_v2(dst, src, n, std::ptr::null_mut()) };
    if r != CUresult::CUDA_SUCCESS {
        return r;
    }
    cuCtxSynchronize()
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    _s: CUstream,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if let Err(e) = check_device(&f, "cuMemcpyDtoDAsync (source)", src, n)
        .and_then(|()| check_device(&f, "cuMemcpyDtoDAsync (destination)", dst, n))
    {
        return e;
    }
    let r = f.enqueue(Op::Copy { dst, src, len: n });
    done(r, &f)
}

// ---------------------------------------------------------------------------
// Streams and events

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(s: *mut CUstream, _flags: c_uint) -> CUresult {
    let mut f = fake();
    ready!(f);
    let id = f.handle();
    f.streams.insert(id, ());
    unsafe { s.write(h(id)) };
    CUresult::CUDA_SUCCESS
}

fn known_stream(f: &Fake, s: CUstream) -> bool {
    s.is_null() || f.streams.contains_key(&(s as usize))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(s: CUstream) -> CUresult {
    let mut f = fake();
    if f.streams.remove(&(s as usize)).is_none() {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(s: CUstream) -> CUresult {
    let mut f = fake();
    ready!(f);
    if !known_stream(&f, s) {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    let r = f.flush();
    done(r, &f)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(s: CUstream, e: CUevent, _flags: c_uint) -> CUresult {
    let f = fake();
    ready!(f);
    if !known_stream(&f, s) || !f.events.contains_key(&(e as usize)) {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    // One queue in call order: later work already waits for earlier.
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(e: *mut CUevent, _flags: c_uint) -> CUresult {
    let mut f = fake();
    ready!(f);
    let id = f.handle();
    f.events.insert(id, Event { pending: 0 });
    unsafe { e.write(h(id)) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    let mut f = fake();
    if f.events.remove(&(e as usize)).is_none() {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    let mut f = fake();
    ready!(f);
    let id = e as usize;
    if !known_stream(&f, s) || !f.events.contains_key(&id) {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    f.events.get_mut(&id).expect("checked").pending += 1;
    let r = f.enqueue(Op::Record { event: id });
    done(r, &f)
}

/// Runs queued work until `event`'s records have all run.
fn wait_event(f: &mut Fake, id: usize) -> Result<(), crate::queue::Failed> {
    if f.events.get(&id).is_some_and(|e| e.pending > 0) {
        f.flush()?;
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    let mut f = fake();
    ready!(f);
    let id = e as usize;
    if !f.events.contains_key(&id) {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    let r = wait_event(&mut f, id);
    done(r, &f)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    // A GPU that is behind finishes eventually: the queue runs now.
    cuEventSynchronize(e)
}

// ---------------------------------------------------------------------------
// Modules and kernels

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut CUmodule, image: *const c_void) -> CUresult {
    let mut f = fake();
    ready!(f);
    if image.is_null() || m.is_null() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the image of a PTX module is NUL-terminated text.
    let text = unsafe { std::ffi::CStr::from_ptr(image.cast::<c_char>()) };
    let Ok(text) = text.to_str() else {
        return refuse(
            CUresult::CUDA_ERROR_INVALID_IMAGE,
            "cuModuleLoadData: not PTX text".into(),
        );
    };
    match memfit_ptx::Module::parse(text) {
        Ok(module) => {
            let id = f.handle();
            f.modules.insert(id, Arc::new(module));
            unsafe { m.write(h(id)) };
            CUresult::CUDA_SUCCESS
        }
        Err(e) => refuse(
            CUresult::CUDA_ERROR_INVALID_PTX,
            format!("cuModuleLoadData: {e}"),
        ),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(m: CUmodule) -> CUresult {
    let mut f = fake();
    if f.modules.remove(&(m as usize)).is_none() {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    func: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    let Some(module) = f.modules.get(&(m as usize)).cloned() else {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    };
    // SAFETY: a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    if module.kernel(&name).is_none() {
        return CUresult::CUDA_ERROR_NOT_FOUND;
    }
    let id = f.handle();
    f.functions.insert(id, (module, name));
    unsafe { func.write(h(id)) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    func: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let mut f = fake();
    ready!(f);
    if !known_stream(&f, s) {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    }
    let Some((module, name)) = f.functions.get(&(func as usize)).cloned() else {
        return CUresult::CUDA_ERROR_INVALID_HANDLE;
    };
    let kernel = module
        .kernel(&name)
        .expect("checked at cuModuleGetFunction");
    let threads = bx as u64 * by as u64 * bz as u64;
    if [gx, gy, gz, bx, by, bz].contains(&0)
        || threads > 1024
        || bz > 64
        || gy > 65535
        || gz > 65535
    {
        return refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!(
                "cuLaunchKernel {name}: grid ({gx},{gy},{gz}) block ({bx},{by},{bz}) is not launchable"
            ),
        );
    }
    if kernel.static_shared_bytes() + shared as usize > 48 << 10 {
        return refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!(
                "cuLaunchKernel {name}: {} bytes of shared memory",
                kernel.static_shared_bytes() + shared as usize
            ),
        );
    }
    if !extra.is_null() {
        return refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("cuLaunchKernel {name}: `extra` is not supported here"),
        );
    }
    let decl = kernel.params();
    if !decl.is_empty() && params.is_null() {
        return refuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("cuLaunchKernel {name}: no kernelParams"),
        );
    }
    // As the driver: each kernelParams[i] points to a value of the size the
    // kernel declares for parameter i.
    let values: Vec<Vec<u8>> = decl
        .iter()
        .enumerate()
        .map(|(i, p)| {
            // SAFETY: the caller's contract (one pointer per parameter).
            unsafe {
                let at = *params.add(i);
                std::slice::from_raw_parts(at.cast::<u8>(), p.bytes).to_vec()
            }
        })
        .collect();
    let r = f.enqueue(Op::Launch {
        module: module.clone(),
        kernel: name,
        grid: [gx, gy, gz],
        block: [bx, by, bz],
        shared,
        params: values,
    });
    done(r, &f)
}

// ---------------------------------------------------------------------------
// Errors

fn static_str(s: &'static [u8]) -> *const c_char {
    s.as_ptr().cast()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(e: CUresult, out: *mut *const c_char) -> CUresult {
    let s: &'static [u8] = match e {
        CUresult::CUDA_SUCCESS => b"no error\0",
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS => {
            b"an illegal memory access was encountered (fake CUDA: see its message on stderr)\0"
        }
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => b"out of memory\0",
        CUresult::CUDA_ERROR_INVALID_VALUE => b"invalid argument\0",
        CUresult::CUDA_ERROR_INVALID_CONTEXT => b"invalid device context\0",
        CUresult::CUDA_ERROR_INVALID_PTX => {
            b"a PTX JIT compilation failed (fake CUDA: see stderr)\0"
        }
        _ => b"fake CUDA error (see stderr)\0",
    };
    unsafe { out.write(static_str(s)) };
    CUresult::CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(e: CUresult, out: *mut *const c_char) -> CUresult {
    let name: &'static str = Box::leak(format!("{e:?}\0").into_boxed_str());
    unsafe { out.write(name.as_ptr().cast()) };
    CUresult::CUDA_SUCCESS
}
