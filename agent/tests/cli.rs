//! The agent binary's answers to a bad setup: a clear message, a non-zero exit.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests fail loudly by design

use std::process::Command;

fn agent() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_headroom-agent"));
    // Only what the test passes counts, never the developer's environment.
    for (key, _) in std::env::vars() {
        if key.starts_with("HEADROOM_") {
            c.env_remove(key);
        }
    }
    c
}

fn stderr_of(mut c: Command) -> (i32, String) {
    let out = c
        .output()
        .unwrap_or_else(|e| panic!("running the agent: {e}"));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn garbage_scenario_file_is_named_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("fleet.toml");
    std::fs::write(
        &path,
        "[[node]]\nname = \"n\"\n[[node.gpu]]\nmodel = 5\n\u{0}garbage",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut c = agent();
    c.args(["--source", "sim", "--scenario"]).arg(&path);
    let (code, stderr) = stderr_of(c);
    assert_eq!(code, 78, "{stderr}");
    assert!(stderr.contains("fleet.toml"), "{stderr}");
}

#[test]
fn without_nvml_the_agent_stops_instead_of_simulating() {
    // The default source is the real GPUs; a library that cannot be loaded
    // is an error that names it, never a silent switch to simulated data.
    let mut c = agent();
    c.args(["--nvml-library", "/nonexistent/libnvidia-ml.so.1"]);
    let (code, stderr) = stderr_of(c);
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains("cannot load the NVIDIA management library")
            && stderr.contains("/nonexistent/libnvidia-ml.so.1"),
        "{stderr}"
    );
    assert!(!stderr.contains("SIMULATED"), "{stderr}");
}

#[test]
fn unknown_scenario_node_lists_the_known_ones() {
    let mut c = agent();
    c.args(["--source", "sim", "--sim-node", "nope"]);
    let (code, stderr) = stderr_of(c);
    assert_eq!(code, 78);
    assert!(
        stderr.contains("\"nope\"") && stderr.contains("gpu-node-01"),
        "{stderr}"
    );
}

#[test]
fn example_config_in_deploy_parses() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/agent.toml");
    let config = headroom_agent::config::AgentConfig::load(
        Some(std::path::Path::new(path)),
        headroom_agent::config::Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.collector_url,
        "https://collector.example.internal:50051"
    );
    assert!(config.tls_ca_file.is_some());
}

#[test]
fn printed_defaults_load_back_as_the_defaults() {
    let mut c = agent();
    c.arg("--print-default-config");
    let out = c.output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("source = \"nvml\""), "{text}");
    let loaded =
        headroom_agent::config::AgentConfig::from_toml(&text, std::path::Path::new("printed"))
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(loaded, headroom_agent::config::AgentConfig::default());
}
