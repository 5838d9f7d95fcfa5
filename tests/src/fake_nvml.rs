//! The fake libnvidia-ml (`fake-nvml/`), built for the tests that load it.
//!
//! `cargo test` builds a cdylib only when the run asks for it directly, and
//! a copy left in `target/debug` by an earlier `cargo build` may be stale.
//! So the tests build it themselves, with the same cargo, into a target
//! directory of its own (the running cargo holds the lock on the main one):
//! a no-op check when nothing changed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Path of the freshly built `libnvidia_ml.so`; builds it on first use.
pub fn library() -> PathBuf {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(build).clone()
}

fn build() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = workspace.join("target").join("fake-nvml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--locked", "-p", "headroom-fake-nvml"])
        .arg("--target-dir")
        .arg(&target)
        .current_dir(&workspace)
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build the fake libnvidia-ml: {e}"));
    assert!(status.success(), "building the fake libnvidia-ml failed");
    let library = target.join("debug").join("libnvidia_ml.so");
    assert!(library.exists(), "{} was not built", library.display());
    library
}
