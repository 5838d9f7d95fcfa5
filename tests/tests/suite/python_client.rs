//! The Python package's own tests (`clients/python/tests`, standard-library
//! unittest, no GPU or PyTorch needed) run as part of `cargo test`, so the
//! one test command covers the client that training jobs load.

use std::path::Path;
use std::process::Command;

#[test]
fn python_client_unit_tests_pass() {
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/python");
    let output = Command::new("python3")
        .args(["-m", "unittest", "discover", "-s", "tests", "-t", "."])
        .current_dir(&client)
        // No stray bytecode in the source tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 is needed to test clients/python");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    // unittest reports "Ran N tests" on stderr; zero would mean discovery broke.
    let ran = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("Ran ")?
                .split(' ')
                .next()?
                .parse::<u32>()
                .ok()
        })
        .unwrap_or(0);
    assert!(ran >= 20, "only {ran} Python tests ran:\n{stderr}");
}
