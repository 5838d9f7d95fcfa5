//! Running under systemd. The units in `deploy/systemd/` pass
//! `systemd-analyze verify` with no complaint at all, and both binaries
//! speak `Type=notify`: READY=1 once they serve, then WATCHDOG=1 pings while
//! their work goes on. The tests play the service manager: they bind the
//! notify socket and read what the daemon sends.

use headroom_tests::harness::built;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn systemd_units_verify_cleanly() {
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/systemd");
    let dir = tempfile::tempdir().unwrap();
    let mut copies = Vec::new();
    for name in ["headroom-agent.service", "headroom-collector.service"] {
        let text = std::fs::read_to_string(units.join(name)).unwrap();
        let binary = name.trim_end_matches(".service");
        let text = text.replace(
            &format!("/usr/bin/{binary}"),
            built(binary).to_str().unwrap(),
        );
        assert!(
            text.contains("Type=notify") && text.contains("WatchdogSec="),
            "{name}"
        );
        let copy = dir.path().join(name);
        std::fs::write(&copy, text).unwrap();
        copies.push(copy);
    }
    let out = match Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&copies)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            headroom_tests::skip_or_fail_under_ci(
                "the systemd unit check",
                format!("systemd-analyze not available: {e}"),
            );
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("headroom-"))
        .collect();
    assert!(
        out.status.success() && complaints.is_empty(),
        "systemd-analyze verify:\n{stderr}"
    );
}

/// Starts `command` as systemd would with a 1 s watchdog, and returns what
/// it sent on the notify socket once READY=1 and three pings have come (or
/// after 15 s).
fn notifications(mut command: Command) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut child = command
        .env("NOTIFY_SOCKET", &socket_path)
        .env("WATCHDOG_USEC", "1000000")
        .env_remove("WATCHDOG_PID")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut messages = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut buf = [0u8; 1024];
    while Instant::now() < deadline {
        if let Ok(n) = socket.recv(&mut buf) {
            messages.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        let pings = messages.iter().filter(|m| m.contains("WATCHDOG=1")).count();
        if messages.iter().any(|m| m.contains("READY=1")) && pings >= 3 {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    messages
}

fn assert_ready_then_fed(messages: &[String]) {
    assert!(
        messages.first().is_some_and(|m| m.contains("READY=1")),
        "READY=1 first: {messages:?}"
    );
    let pings = messages.iter().filter(|m| m.contains("WATCHDOG=1")).count();
    assert!(pings >= 3, "the watchdog is fed: {messages:?}");
}

#[test]
fn agent_reports_ready_and_feeds_the_watchdog() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Command::new(built("headroom-agent"));
    agent
        .args([
            "--source",
            "sim",
            "--sim-node",
            "gpu-node-01",
            "--node-name",
            "notify-node",
        ])
        .args(["--collector-url", "http://127.0.0.1:1"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        // Not the host's /run/headroom, nor its spool.
        .arg("--no-allocator-socket")
        .arg("--spool-dir")
        .arg(dir.path().join("spool"));
    assert_ready_then_fed(&notifications(agent));
}

#[test]
fn collector_reports_ready_and_feeds_the_watchdog() {
    let dir = tempfile::tempdir().unwrap();
    let mut collector = Command::new(built("headroom-collector"));
    collector
        .args([
            "serve",
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .env(
            "HEADROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("h.db").display()),
        );
    assert_ready_then_fed(&notifications(collector));
}
