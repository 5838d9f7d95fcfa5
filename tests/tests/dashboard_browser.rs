//! The dashboard in a real browser: runs `headroom-collector demo` (SQLite,
//! the simulated fleet) and drives Debian's Chromium through it with
//! playwright-core (`tests/browser/dashboard.mjs`): the fleet's tiles, a
//! live update, a GPU page with its chart drawn, an acknowledged alert.
//! Screenshots land in `target/browser-artifacts/`.
//!
//! Needs `chromium`, `node` and `npm ci --prefix tests/browser`; skips
//! without them, and fails instead under `CI=true` (`.ci/run` installs them).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests fail loudly by design

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom_tests::harness::{KillOnDrop, built};

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("browser")
}

/// What is missing for the browser test, if anything.
fn missing_tools() -> Option<String> {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !Path::new(&chromium).exists() {
        return Some(format!("{chromium} (Debian: apt-get install chromium)"));
    }
    if Command::new("node").arg("--version").output().is_err() {
        return Some("node".into());
    }
    if !browser_dir().join("node_modules/playwright-core").exists() {
        return Some("playwright-core (npm ci --prefix tests/browser)".into());
    }
    None
}

#[test]
fn dashboard_in_chromium_shows_the_fleet_a_gpu_chart_and_acknowledges_an_alert() {
    if let Some(missing) = missing_tools() {
        assert!(
            std::env::var("CI").is_err(),
            "CI=true and the browser test cannot run: missing {missing}"
        );
        eprintln!("SKIPPING: the browser test needs {missing}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut demo = Command::new(built("headroom-collector"))
        .args(["demo", "--http-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(demo.stdout.take().unwrap());
    let demo = KillOnDrop(demo);
    // Read the URL, then keep draining: a closed pipe would end the demo at
    // its next line of output.
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            if let Some(rest) = line.trim().strip_prefix("dashboard: ") {
                let _ = url_tx.send(rest.trim_end_matches('/').to_owned());
            }
        }
    });
    let url = url_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the demo printed no dashboard URL");

    let artifacts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/browser-artifacts");
    // Screenshots of an earlier run must not pass for this one's.
    let _ = std::fs::remove_dir_all(&artifacts);
    let out = Command::new("node")
        .arg(browser_dir().join("dashboard.mjs"))
        .arg(&url)
        .arg(&artifacts)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "browser test failed (screenshots in {}):\n{stdout}\n{stderr}",
        artifacts.display()
    );
    assert!(stdout.contains("\"ok\":true"), "{stdout}");
    for shot in ["1-fleet.png", "2-gpu.png", "3-alerts.png"] {
        assert!(artifacts.join(shot).exists(), "{shot} missing");
    }
    drop(demo);
}
