//! Driving Debian's Chromium through `tests/browser/*.mjs` (playwright-core)
//! from any test: whether the tools are here, one browser test at a time,
//! and running a script that must report `"ok":true`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// `tests/browser`, where the scripts and their node modules are.
pub fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("browser")
}

/// Where scripts leave their screenshots.
pub fn artifacts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/browser-artifacts")
}

/// What is missing for a browser test, if anything.
fn missing_tools() -> Option<String> {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !Path::new(&chromium).exists() {
        return Some(format!("{chromium} (Debian: apt-get install chromium)"));
    }
    if Command::new("node").arg("--version").output().is_err() {
        return Some("node".into());
    }
    if !scripts_dir().join("node_modules/playwright-core").exists() {
        return Some("playwright-core (npm ci --prefix tests/browser)".into());
    }
    None
}

/// Whether browser tests can run here; under `CI=true` they must.
pub fn available(what: &str) -> bool {
    let Some(missing) = missing_tools() else {
        return true;
    };
    crate::skip_or_fail_under_ci(what, format!("missing {missing}"));
    false
}

static ONE_BROWSER_TEST: Mutex<()> = Mutex::new(());

/// Held for the whole of each browser test, its collector included: one at
/// a time, so that the 2,000-GPU fleet's 250 simulated agents never starve
/// another test's page of the machine's cores (their waits are sized for a
/// page that has them).
pub fn turn() -> MutexGuard<'static, ()> {
    // A test that failed poisons the lock; the next one may still run.
    ONE_BROWSER_TEST
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Runs `tests/browser/{script}` with `args`; fails the test with its output
/// unless it reports `"ok":true`.
pub fn run_script(script: &str, args: &[&str]) {
    let out = Command::new("node")
        .arg(scripts_dir().join(script))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed (screenshots in {}):\n{stdout}\n{stderr}",
        artifacts_dir().display()
    );
    assert!(stdout.contains("\"ok\":true"), "{stdout}");
}
