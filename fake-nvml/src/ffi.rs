//! The C side of every export: return codes, the panic guard, and checked
//! reads and writes through caller-supplied pointers.

use std::ffi::{CStr, c_char, c_uint};
use std::mem::MaybeUninit;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;

use nvml_wrapper_sys::bindings as sys;

pub(crate) use sys::nvmlReturn_t;

pub(crate) const SUCCESS: nvmlReturn_t = sys::nvmlReturn_enum_NVML_SUCCESS;
pub(crate) const UNINITIALIZED: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
pub(crate) const INVALID_ARGUMENT: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
pub(crate) const NOT_SUPPORTED: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
pub(crate) const NOT_FOUND: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
pub(crate) const INSUFFICIENT_SIZE: nvmlReturn_t =
    sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
pub(crate) const TIMEOUT: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT;
pub(crate) const GPU_IS_LOST: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
pub(crate) const ARGUMENT_VERSION_MISMATCH: nvmlReturn_t =
    sys::nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
pub(crate) const UNKNOWN: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// What an export's body returns; `Ok` becomes `NVML_SUCCESS`.
pub(crate) type NvmlResult<T = ()> = Result<T, nvmlReturn_t>;

/// Runs an export's body, turning its result into a return code. A panic
/// must never unwind into C: it becomes `NVML_ERROR_UNKNOWN`.
pub(crate) fn guard(body: impl FnOnce() -> NvmlResult) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// An out-parameter: a caller-supplied pointer checked for null.
#[derive(Debug)]
pub(crate) struct Out<T>(NonNull<T>);

impl<T> Out<T> {
    /// `NVML_ERROR_INVALID_ARGUMENT` for a null pointer.
    ///
    /// # Safety
    ///
    /// `ptr` must be null or valid for reads and writes of one `T` until the
    /// export returns: the contract every `nvml.h` out-parameter has.
    pub(crate) unsafe fn new(ptr: *mut T) -> NvmlResult<Self> {
        NonNull::new(ptr).map(Self).ok_or(INVALID_ARGUMENT)
    }

    /// The pointer, for reading a field the caller filled in (such as a
    /// struct's `version`) without reading the rest.
    pub(crate) fn as_ptr(&self) -> *const T {
        self.0.as_ptr()
    }

    pub(crate) fn set(&self, value: T) {
        // SAFETY: non-null, and valid for a write of `T` per `Out::new`'s
        // contract. `write` does not drop the old value, which may be
        // uninitialised memory the caller handed us.
        unsafe { self.0.as_ptr().write(value) }
    }
}

/// A caller-supplied array of `len` elements, possibly uninitialised.
///
/// # Safety
///
/// `ptr` must be null or valid for writes of `len` consecutive `T`s, not
/// aliased elsewhere, until the export returns.
pub(crate) unsafe fn out_slice<'a, T>(
    ptr: *mut T,
    len: usize,
) -> NvmlResult<&'a mut [MaybeUninit<T>]> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, valid and unaliased for `len` elements per this
    // function's contract; `MaybeUninit` makes no claim about the contents.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<MaybeUninit<T>>(), len) })
}

/// Copies `text` and a terminating NUL into a caller's `length`-byte buffer,
/// as NVML's string getters do: `NVML_ERROR_INSUFFICIENT_SIZE` if it does
/// not fit.
///
/// # Safety
///
/// `buffer` must be null or valid for writes of `length` bytes.
pub(crate) unsafe fn copy_str(buffer: *mut c_char, length: c_uint, text: &str) -> NvmlResult {
    if buffer.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = text.as_bytes();
    if bytes.len() >= length as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `buffer` is valid for `length` bytes and `bytes.len() + 1 <=
    // length`; a caller's buffer cannot overlap our string.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buffer, bytes.len());
        buffer.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Reads a caller's NUL-terminated string.
///
/// # Safety
///
/// `text` must be null or point to a NUL-terminated string that stays valid
/// until the export returns.
pub(crate) unsafe fn read_str<'a>(text: *const c_char) -> NvmlResult<&'a str> {
    if text.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let text = unsafe { CStr::from_ptr(text) };
    text.to_str().map_err(|_| INVALID_ARGUMENT)
}

/// `nvmlErrorString`'s table, worded as NVIDIA's library words it.
pub(crate) fn error_string(code: nvmlReturn_t) -> &'static CStr {
    match code {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        sys::nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        sys::nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER => c"Insufficient External Power",
        sys::nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        TIMEOUT => c"Timeout",
        sys::nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE => c"Interrupt request issue",
        sys::nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND => c"NVML Shared Library Not Found",
        sys::nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        sys::nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM => c"Corrupted infoROM",
        GPU_IS_LOST => c"GPU is lost",
        sys::nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED => c"GPU requires restart",
        sys::nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM => {
            c"The operating system has blocked the request."
        }
        sys::nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH => {
            c"RM has detected an NVML/RM version mismatch."
        }
        sys::nvmlReturn_enum_NVML_ERROR_IN_USE => c"In use by another client",
        sys::nvmlReturn_enum_NVML_ERROR_MEMORY => c"Insufficient Memory",
        sys::nvmlReturn_enum_NVML_ERROR_NO_DATA => c"No data",
        sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => {
            c"Insufficient resources for request"
        }
        ARGUMENT_VERSION_MISMATCH => c"Version mismatch between struct and API",
        sys::nvmlReturn_enum_NVML_ERROR_DEPRECATED => c"Deprecated",
        sys::nvmlReturn_enum_NVML_ERROR_NOT_READY => c"Not ready",
        sys::nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND => c"GPU not found",
        sys::nvmlReturn_enum_NVML_ERROR_INVALID_STATE => c"Invalid state",
        _ => c"Unknown Error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_str_needs_room_for_the_nul() {
        let mut buffer = [0x55 as c_char; 4];
        // SAFETY: a local 4-byte buffer.
        let too_long = unsafe { copy_str(buffer.as_mut_ptr(), 4, "abcd") };
        assert_eq!(too_long, Err(INSUFFICIENT_SIZE));
        // SAFETY: as above.
        assert_eq!(unsafe { copy_str(buffer.as_mut_ptr(), 4, "abc") }, Ok(()));
        assert_eq!(buffer, [b'a' as c_char, b'b' as c_char, b'c' as c_char, 0]);
        // SAFETY: null is allowed and rejected.
        let null = unsafe { copy_str(std::ptr::null_mut(), 4, "a") };
        assert_eq!(null, Err(INVALID_ARGUMENT));
    }

    #[test]
    fn guard_turns_a_panic_into_unknown() {
        let code = guard(|| panic!("boom"));
        assert_eq!(code, UNKNOWN);
        assert_eq!(guard(|| Err(NOT_FOUND)), NOT_FOUND);
        assert_eq!(guard(|| Ok(())), SUCCESS);
    }

    #[test]
    fn every_code_has_a_message() {
        assert_eq!(error_string(GPU_IS_LOST), c"GPU is lost");
        assert_eq!(error_string(12_345), c"Unknown Error");
    }
}
