//! Reaching the real things behind the hook: glibc's `dlsym` (the hook exports its own) and the
//! driver's functions in `libcuda.so.1`.
//!
//! Everything here is lock-free and re-entrant: a pointer is looked up on first use and cached
//! in an atomic (two threads racing do the same lookup twice, harmlessly). Nothing here calls
//! the hook's own exported functions, so a lookup made while the dynamic loader, libc or
//! libcuda's constructors are running cannot recurse into an unfinished initialisation.

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static LIBCUDA: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static LIBNVML: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// glibc's `dlsym`, found with `dlvsym` (not hooked). glibc 2.34 moved it into libc with a new
/// version; older glibc only has GLIBC_2.2.5.
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        for v in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: dlvsym takes a pseudo-handle and two NUL-terminated constant strings.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        if p.is_null() {
            return None;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: `p` is non-null and is glibc's `dlsym`, whose C signature `DlsymFn` is.
    Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// The driver library's handle (the one the program loaded, matched by soname).
pub fn libcuda() -> *mut c_void {
    open_lib(&LIBCUDA, c"libcuda.so.1")
}

/// NVML's handle (`libnvidia-ml.so.1`), for the memory queries the hook answers.
pub fn libnvml() -> *mut c_void {
    open_lib(&LIBNVML, c"libnvidia-ml.so.1")
}

fn open_lib(cache: &AtomicPtr<c_void>, soname: &CStr) -> *mut c_void {
    let h = cache.load(Ordering::Acquire);
    if !h.is_null() {
        return h;
    }
    // SAFETY: dlopen with a NUL-terminated constant name; RTLD_NOLOAD first reuses what the
    // program loaded. No hook state is touched, so a recursive entry is harmless.
    let h = unsafe {
        let h = libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        if h.is_null() {
            libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY)
        } else {
            h
        }
    };
    if !h.is_null() {
        cache.store(h, Ordering::Release);
    }
    h
}

/// Which library a [`Slot`] names a function of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lib {
    Cuda,
    Nvml,
    /// The libcupti the hook loaded (`cupti.rs`, `KUBESHARE_HOOK_CUPTI`).
    Cupti,
}

/// A real driver function, looked up by its exported name on first use.
pub struct Slot {
    /// NUL-terminated (see [`slots!`]).
    name: &'static str,
    lib: Lib,
    ptr: AtomicPtr<c_void>,
}

impl Slot {
    /// `name` must end with a NUL byte; [`slots!`] makes such names.
    pub const fn new(name: &'static str) -> Self {
        Self::of(Lib::Cuda, name)
    }

    /// A slot of a function of `lib`.
    pub const fn of(lib: Lib, name: &'static str) -> Self {
        Slot {
            name,
            lib,
            ptr: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The function's exported name.
    pub fn name(&self) -> &CStr {
        CStr::from_bytes_with_nul(self.name.as_bytes()).unwrap_or(c"")
    }

    /// The real function's address, or null when the driver lacks it.
    #[inline]
    pub fn get(&self) -> *mut c_void {
        let p = self.ptr.load(Ordering::Acquire);
        if !p.is_null() {
            return p;
        }
        self.resolve()
    }

    #[cold]
    fn resolve(&self) -> *mut c_void {
        let lib = match self.lib {
            Lib::Cuda => libcuda(),
            Lib::Nvml => libnvml(),
            Lib::Cupti => crate::cupti::lib(),
        };
        let (Some(dl), h) = (real_dlsym(), lib) else {
            return std::ptr::null_mut();
        };
        if h.is_null() {
            return std::ptr::null_mut();
        }
        let Ok(name) = CStr::from_bytes_with_nul(self.name.as_bytes()) else {
            return std::ptr::null_mut();
        };
        // SAFETY: glibc's dlsym on a live handle with a NUL-terminated name.
        let p = unsafe { dl(h, name.as_ptr()) };
        if !p.is_null() {
            self.ptr.store(p, Ordering::Release);
        }
        p
    }
}

/// Calls the real driver function `NAME` through the caller's slot `r::NAME` (see
/// [`slots!`]), as the function type `cuda_abi::pfn::NAME`, returning `CUDA_ERROR_NOT_FOUND`
/// when the driver lacks it: `real!(NAME, args...)`. Slot and type are picked by the one
/// name, so they cannot disagree. The arguments are passed through unchanged to the driver.
#[macro_export]
macro_rules! real {
    ($name:ident $(, $arg:expr)* $(,)?) => {{
        let p = r::$name.get();
        if p.is_null() {
            ::cuda_abi::CUDA_ERROR_NOT_FOUND
        } else {
            // SAFETY: the slot holds the address the driver exports under this name, whose
            // signature is `pfn::$name` (the C headers' declaration); non-null checked above.
            let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, ::cuda_abi::pfn::$name>(p) };
            #[allow(unused_unsafe)]
            // SAFETY: the wrappers forward their own caller's arguments, which the driver's
            // contract for this function already binds the caller to; the hook's own calls
            // pass live locals as out-parameters and handles the driver gave it.
            unsafe {
                f($($arg),*)
            }
        }
    }};
}

/// Declares one [`Slot`] static per driver function, named after it.
#[macro_export]
macro_rules! slots {
    ($($n:ident),* $(,)?) => {
        $(pub static $n: $crate::real::Slot = $crate::real::Slot::new(concat!(stringify!($n), "\0"));)*
    };
}

/// Declares one NVML [`Slot`] static per function, named after it.
#[macro_export]
macro_rules! nvml_slots {
    ($($n:ident),* $(,)?) => {
        $(pub static $n: $crate::real::Slot = $crate::real::Slot::of($crate::real::Lib::Nvml, concat!(stringify!($n), "\0"));)*
    };
}
