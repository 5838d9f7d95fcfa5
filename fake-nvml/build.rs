//! Links the library with `-z nodelete`: nvml-wrapper `dlclose`s NVML when an
//! `Nvml` is dropped, and unloading would reset the process-global state
//! (the scenario clock, event sets) and unmap code that a thread stuck in a
//! `[[hang]]`-faulted call is still running.

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
