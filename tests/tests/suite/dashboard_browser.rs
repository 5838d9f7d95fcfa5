//! The dashboard in a real browser: runs `headroom-collector demo` (SQLite,
//! the simulated fleet) and drives Debian's Chromium through it with
//! playwright-core (`tests/browser/dashboard.mjs`): the fleet's tiles, a
//! live update, a GPU page with its chart drawn, process tables that fit
//! 1280 px, an acknowledged alert, and a firing alert on its device's tile.
//! A second run signs in (`[http_auth] mode = "tokens"`) as a viewer and an
//! admin (`tests/browser/signin.mjs`). Screenshots land in
//! `target/browser-artifacts/`.
//!
//! Needs `chromium`, `node` and `npm ci --prefix tests/browser`; skips
//! without them, and fails instead under `CI=true` (`.ci/run` installs them).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom_tests::harness::{KillOnDrop, built, free_loopback_addr};

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

/// Whether the browser tests can run here; under `CI=true` they must.
fn browser_available() -> bool {
    let Some(missing) = missing_tools() else {
        return true;
    };
    headroom_tests::skip_or_fail_under_ci("the browser test", format!("missing {missing}"));
    false
}

fn artifacts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/browser-artifacts")
}

/// Runs `tests/browser/{script}` with `args`; fails the test with its output
/// unless it reports `"ok":true`.
fn run_script(script: &str, args: &[&str]) {
    let out = Command::new("node")
        .arg(browser_dir().join(script))
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

#[test]
fn dashboard_in_chromium_shows_the_fleet_a_gpu_chart_and_acknowledges_an_alert() {
    if !browser_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Unattributed memory fires at once instead of after 2 min, so that
    // the fleet has a firing alert for its tiles to show.
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, "[unattributed]\nfor = \"0s\"\n").unwrap();
    let mut demo = Command::new(built("headroom-collector"))
        .args(["demo", "--http-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .arg("--rules")
        .arg(&rules)
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

    let artifacts = artifacts_dir();
    // Screenshots of an earlier run must not pass for this one's.
    let shots = [
        "1-fleet.png",
        "2-gpu.png",
        "3-alerts.png",
        "4-fleet-alerts.png",
    ];
    for shot in shots {
        let _ = std::fs::remove_file(artifacts.join(shot));
    }
    run_script("dashboard.mjs", &[&url, &artifacts.to_string_lossy()]);
    for shot in shots {
        assert!(artifacts.join(shot).exists(), "{shot} missing");
    }
    drop(demo);
}

#[test]
fn signing_in_with_tokens_in_chromium_separates_viewers_from_admins() {
    if !browser_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("collector.toml");
    std::fs::write(
        &config,
        format!(
            "database_url = \"sqlite://{}\"\n[http_auth]\nmode = \"tokens\"\n",
            dir.path().join("headroom.db").display()
        ),
    )
    .unwrap();
    let token = |role: &str, name: &str| {
        let out = Command::new(built("headroom-collector"))
            .args([
                "token", "create", "--role", role, "--name", name, "--config",
            ])
            .arg(&config)
            .env_remove("HEADROOM_DATABASE_URL")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let viewer = token("viewer", "carol");
    let admin = token("admin", "alice");
    let http = free_loopback_addr();
    let _collector = KillOnDrop(
        Command::new(built("headroom-collector"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .args(["--grpc-listen", &free_loopback_addr().to_string()])
            .args(["--http-listen", &http.to_string()])
            .env_remove("HEADROOM_DATABASE_URL")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://{http}");
    wait_until_healthy(&url);
    run_script(
        "signin.mjs",
        &[&url, &viewer, &admin, &artifacts_dir().to_string_lossy()],
    );
}

fn wait_until_healthy(url: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        while reqwest::get(format!("{url}/healthz")).await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the collector at {url} never answered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}
