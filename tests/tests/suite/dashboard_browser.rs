//! The dashboard in a real browser: runs `headroom-collector demo` (SQLite,
//! the simulated fleet) and drives Debian's Chromium through it with
//! playwright-core (`tests/browser/dashboard.mjs`): the fleet's tiles, a
//! live update, a GPU page with its chart drawn, process tables that fit
//! 1280 px, where a training process's and a job's memory goes (bars that
//! add up, the largest share, the advice), an acknowledged alert, and a
//! firing alert on its device's tile.
//! A fleet of 2,000 GPUs (`tests/browser/fleet_grid.mjs`): one cell per
//! device on one 1440x900 screen, the at-risk list against the API, owners,
//! keyboard navigation, charts sharing a time axis.
//! A fleet over `[http] stream_devices_max` (`tests/browser/fleet_nodes.mjs`):
//! a cell per node, a node's devices streamed alone, a GPU page that loads
//! without the fleet's list.
//! A second run signs in (`[http_auth] mode = "tokens"`) as a viewer and an
//! admin (`tests/browser/signin.mjs`). Screenshots land in
//! `target/browser-artifacts/`.
//!
//! Needs `chromium`, `node` and `npm ci --prefix tests/browser`; skips
//! without them, and fails instead under `CI=true` (`.ci/run` installs them).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom_tests::browser::{artifacts_dir, run_script, turn as browser_turn};
use headroom_tests::harness::{KillOnDrop, built, free_loopback_addr};

/// Runs `headroom-collector demo` with `args` on a SQLite file in `dir`;
/// returns it (killed on drop) and its dashboard's URL once it prints one.
fn start_demo(dir: &Path, args: &[&std::ffi::OsStr]) -> (KillOnDrop, String) {
    let mut demo = Command::new(built("headroom-collector"))
        .args(["demo", "--http-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(args)
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
    (demo, url)
}

/// Runs `script` against `url`, after removing the screenshots it must
/// make, and checks that it made them.
fn run_with_shots(script: &str, url: &str, shots: &[&str]) {
    let artifacts = artifacts_dir();
    // Screenshots of an earlier run must not pass for this one's.
    for shot in shots {
        let _ = std::fs::remove_file(artifacts.join(shot));
    }
    run_script(script, &[url, &artifacts.to_string_lossy()]);
    for shot in shots {
        assert!(artifacts.join(shot).exists(), "{shot} missing");
    }
}

#[test]
fn dashboard_in_chromium_shows_the_fleet_a_gpu_chart_and_acknowledges_an_alert() {
    if !headroom_tests::browser::available("the browser test") {
        return;
    }
    let _turn = browser_turn();
    let dir = tempfile::tempdir().unwrap();
    // Unattributed memory fires at once instead of after 2 min, so that
    // the fleet has a firing alert for its tiles to show.
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, "[unattributed]\nfor = \"0s\"\n").unwrap();
    let (demo, url) = start_demo(dir.path(), &["--rules".as_ref(), rules.as_os_str()]);
    run_with_shots(
        "dashboard.mjs",
        &url,
        &[
            "1-fleet.png",
            "2-gpu.png",
            "3-alerts.png",
            "4-fleet-alerts.png",
        ],
    );
    drop(demo);
}

/// `nodes` nodes of 8 GPUs: seven training GPUs (a Slurm job per node) and
/// one serving GPU (a pod), every fortieth of which holds 77 of 80 GiB, so
/// that the watermark fires on a few devices among 2,000.
fn fleet_of(nodes: usize) -> String {
    const USERS: [&str; 7] = ["alice", "bob", "carol", "dave", "erin", "frank", "grace"];
    let mut out = String::new();
    for n in 0..nodes {
        let train_level = 30 + n % 30;
        let serve_level = if n % 40 == 3 { 77 } else { 20 + n % 50 };
        out += &format!(
            "[[node]]\nname = \"gpu-{n:03}\"\n\
             [[node.gpu]]\nmodel = \"NVIDIA H100 80GB HBM3\"\nmemory_total = \"80GiB\"\nreserved = \"512MiB\"\ncount = 7\n\
             [[node.gpu.process]]\npid = 2000\nname = \"python train.py\"\nuser = \"{train_user}\"\nslurm_job_id = \"{job}\"\n\
             memory = {{ shape = \"steady\", level = \"{train_level}GiB\", jitter = \"256MiB\" }}\n\
             [[node.gpu]]\nmodel = \"NVIDIA H100 80GB HBM3\"\nmemory_total = \"80GiB\"\nreserved = \"512MiB\"\n\
             [[node.gpu.process]]\npid = 9000\nname = \"python serve.py\"\nuser = \"{serve_user}\"\npod_uid = \"{n:08x}-0000-4000-8000-000000000000\"\n\
             memory = {{ shape = \"steady\", level = \"{serve_level}GiB\", jitter = \"128MiB\" }}\n",
            train_user = USERS[n % USERS.len()],
            serve_user = USERS[(n + 3) % USERS.len()],
            job = 4_100_000 + n,
        );
    }
    out
}

/// Runs the demo on `scenario` (written to `dir`) with the watermark
/// firing on the first sample over the line, and `args` besides.
fn start_fleet_demo(dir: &Path, scenario: &str, args: &[&std::ffi::OsStr]) -> (KillOnDrop, String) {
    let scenario_path = dir.join("fleet.toml");
    std::fs::write(&scenario_path, scenario).unwrap();
    let rules = dir.join("rules.toml");
    std::fs::write(&rules, "[watermark]\nfor = \"0s\"\n").unwrap();
    let mut all: Vec<&std::ffi::OsStr> = vec![
        "--scenario".as_ref(),
        scenario_path.as_os_str(),
        "--rules".as_ref(),
        rules.as_os_str(),
    ];
    all.extend_from_slice(args);
    start_demo(dir, &all)
}

#[test]
fn the_fleet_view_of_2000_gpus_fits_one_screen_ranks_what_is_at_risk_and_names_owners() {
    if !headroom_tests::browser::available("the browser test") {
        return;
    }
    let _turn = browser_turn();
    let dir = tempfile::tempdir().unwrap();
    let (demo, url) = start_fleet_demo(dir.path(), &fleet_of(250), &[]);
    run_with_shots(
        "fleet_grid.mjs",
        &url,
        &["5-grid.png", "6-grid-tooltip.png", "7-node-tiles.png"],
    );
    drop(demo);
}

#[test]
fn a_fleet_over_the_stream_limit_shows_a_cell_per_node_and_opens_a_nodes_devices() {
    if !headroom_tests::browser::available("the browser test") {
        return;
    }
    let _turn = browser_turn();
    let dir = tempfile::tempdir().unwrap();
    // 321 GPUs, over a limit of 100: what 100,000 GPUs are over 5,000;
    // one node's GPU in MIG mode, for its page's layout.
    let mig_node = "[[node]]\nname = \"gpu-mig\"\n\
        [[node.gpu]]\nmodel = \"NVIDIA A100-SXM4-80GB\"\nmemory_total = \"81920MiB\"\nreserved = \"512MiB\"\n\
        [[node.gpu.mig]]\nprofile = \"3g.40gb\"\nmemory_total = \"40192MiB\"\ngpu_instance_id = 2\n\
        [[node.gpu.mig.process]]\npid = 74001\nname = \"python notebook.py\"\nuser = \"priya\"\n\
        memory = { shape = \"steady\", level = \"22GiB\", jitter = \"128MiB\" }\n\
        [[node.gpu.mig]]\nprofile = \"2g.20gb\"\nmemory_total = \"19968MiB\"\ngpu_instance_id = 3\n\
        [[node.gpu.mig.process]]\npid = 74115\nname = \"python serve.py\"\nuser = \"svc-nlp\"\n\
        memory = { shape = \"steady\", level = \"12GiB\", jitter = \"128MiB\" }\n";
    let (demo, url) = start_fleet_demo(
        dir.path(),
        &(fleet_of(40) + mig_node),
        &["--stream-devices-max".as_ref(), "100".as_ref()],
    );
    run_with_shots(
        "fleet_nodes.mjs",
        &url,
        &["8-nodes.png", "9-node-devices.png"],
    );
    drop(demo);
}

#[test]
fn signing_in_with_tokens_in_chromium_separates_viewers_from_admins() {
    if !headroom_tests::browser::available("the browser test") {
        return;
    }
    let _turn = browser_turn();
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
