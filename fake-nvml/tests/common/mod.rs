//! Shared by the integration tests: where the built library and the
//! fixtures are, and running one test body in a fresh process.
//!
//! The fake library reads its configuration once per process and NVML
//! state is process-global, so every test that needs a configuration runs
//! its body in a child: the test re-runs this test binary filtered to
//! itself, with the configuration in the environment and a marker variable
//! that tells the child to run the body instead of spawning again.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Output};

use nvml_wrapper::Nvml;

pub const SCENARIO_VAR: &str = "HEADROOM_FAKE_NVML_SCENARIO";
pub const NODE_VAR: &str = "HEADROOM_FAKE_NVML_NODE";
pub const FAULTS_VAR: &str = "HEADROOM_FAKE_NVML_FAULTS";
const CHILD_VAR: &str = "HEADROOM_FAKE_NVML_TEST_CHILD";

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

/// The library, freshly built (see `headroom_tests::fake_nvml`).
pub fn library() -> PathBuf {
    headroom_tests::fake_nvml::library()
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The scenario every configured test serves (node `test-node`).
pub fn scenario_path() -> PathBuf {
    fixture("node.toml")
}

pub fn scenario() -> headroom_sim::Scenario {
    headroom_sim::Scenario::load(&scenario_path()).expect("the fixture scenario")
}

pub fn init() -> Nvml {
    Nvml::builder()
        .lib_path(library().as_os_str())
        .init()
        .expect("nvmlInit_v2 on the fake library")
}

/// In the parent: runs `test` (this test's own name) in a child process
/// with `env` (every `HEADROOM_FAKE_NVML_*` variable not given is unset),
/// asserts it passed, and returns its output; the caller then returns. In
/// the child: returns `None`, and the caller runs the body.
pub fn in_child(test: &str, env: &[(&str, &OsStr)]) -> Option<Output> {
    if std::env::var(CHILD_VAR).is_ok_and(|name| name == test) {
        return None;
    }
    let mut child = Command::new(std::env::current_exe().expect("the test binary's path"));
    child
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, test)
        .env_remove(SCENARIO_VAR)
        .env_remove(NODE_VAR)
        .env_remove(FAULTS_VAR);
    for (name, value) in env {
        child.env(name, value);
    }
    let output = child.output().expect("run the test binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{test} failed in its child process ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    Some(output)
}

/// `in_child` with the fixture scenario and, if given, a faults fixture.
pub fn in_configured_child(test: &str, faults: Option<&str>) -> Option<Output> {
    let scenario = scenario_path();
    let faults = faults.map(fixture);
    let mut env: Vec<(&str, &OsStr)> = vec![
        (SCENARIO_VAR, scenario.as_os_str()),
        (NODE_VAR, OsStr::new("test-node")),
    ];
    if let Some(faults) = &faults {
        env.push((FAULTS_VAR, faults.as_os_str()));
    }
    in_child(test, &env)
}
