//! A fake `libnvidia-ml.so` that serves a Headroom simulation scenario
//! through the NVML C ABI, with fault injection (lost GPUs, hung calls,
//! missing PCIe counters, XID events, MIG reconfiguration).
//!
//! Built as `libnvidia_ml.so`. NVML clients load it by path
//! (`Nvml::builder().lib_path(..)` in nvml-wrapper) or through a
//! `libnvidia-ml.so.1` symlink on `LD_LIBRARY_PATH` (pynvml, gpustat). See
//! `README.md` for the environment variables and the faults file.
//!
//! Every struct layout and return code comes from `nvml-wrapper-sys`
//! (bindgen output of NVIDIA's `nvml.h`), and `abi_check` proves at compile
//! time that every export has the exact signature `nvml.h` declares.
//!
//! Layout: `config` reads the environment and the faults file once, at the
//! first `nvmlInit*`; `host` holds the process-global state and the
//! init/shutdown refcount; `snapshot` evaluates the scenario at most once
//! per 5 ms and integrates the PCIe counters; `call` is the prologue every
//! device function runs (handle check, lost GPU, hang); the remaining modules
//! are the exported functions, grouped by what they answer.

// This crate *is* an FFI boundary: raw pointers from C callers are its inputs.
// Every `unsafe` block carries a `// SAFETY:` comment.
#![allow(unsafe_code)]
// Every export's safety contract is the one `nvml.h` documents for the C
// function of the same name (valid pointers of the declared types and sizes);
// repeating it on ~80 functions would add nothing.
#![allow(clippy::missing_safety_doc)]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("handles encode GPU and MIG indices in 64-bit pointer values");

mod abi_check;
mod call;
mod config;
mod device;
mod events;
mod ffi;
mod fields;
mod gpustat_compat;
mod handles;
mod health;
mod host;
mod layout;
mod mig;
mod processes;
mod snapshot;
mod system;
