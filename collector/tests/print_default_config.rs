//! `headroom-collector print-default-config` prints a file `serve` accepts,
//! holding exactly the built-in defaults.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests fail loudly by design

use headroom_collector::config::{CollectorConfig, Overrides};

#[test]
fn printed_defaults_load_back_as_the_defaults() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_headroom-collector"))
        .arg("print-default-config")
        .output()
        .unwrap();
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("collector.toml");
    std::fs::write(&path, &out.stdout).unwrap();
    let loaded = CollectorConfig::load(Some(&path), Overrides::default()).unwrap();
    assert_eq!(loaded, CollectorConfig::default());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("http_listen = \"127.0.0.1:8080\""), "{text}");
}
