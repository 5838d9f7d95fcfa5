//! Soak: AGENTS (default 100) simulated 8-GPU agents, each with a disk spool
//! of its own, stream at the production cadence (10 Hz polls, one batch a
//! second) to the collector binary on Postgres for MINUTES (default 30).
//! Half-way (or at minute RESTART) the collector is SIGKILLed and started
//! again 5 s later. Every 30 s
//! it prints the collector's RSS, this process's RSS (the agents) and the
//! batches committed. At the end every node's GPU 0 samples must tile time:
//! no gap and no duplicate, across the restart too.
//!
//! ```sh
//! cargo build --release -p headroom-collector
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!   cargo run --release -p headroom-tests --example soak -- [AGENTS] [MINUTES] [RESTART]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: fail loudly

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use headroom_agent::source::SimSource;
use headroom_agent::{AgentHandle, AgentSettings};
use headroom_sim::Scenario;
use headroom_store::redact_url;
use headroom_tests::fixtures::now_ms;
use headroom_tests::postgres;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

fn collector_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|p| p.parent()).unwrap();
    let path = dir.join("headroom-collector");
    assert!(
        path.exists(),
        "{} is missing: cargo build --release -p headroom-collector",
        path.display()
    );
    path
}

fn start_collector(url: &str, grpc: &str, http: &str, log: &std::path::Path) -> Child {
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    Command::new(collector_binary())
        .arg("serve")
        .args(["--grpc-listen", grpc, "--http-listen", http])
        .env("HEADROOM_DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn committed(http: &str) -> u64 {
    let Ok(response) = reqwest::get(format!("http://{http}/metrics")).await else {
        return 0;
    };
    let text = response.text().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("headroom_collector_batches_total{outcome=\"committed\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// AGENTS nodes like the demo's gpu-node-01: 8 H100s, each with a training
/// rank whose memory warms up to a plateau (every GPU its own UUID).
fn fleet(agents: usize) -> String {
    let mut toml = String::from("seed = 7\n");
    for i in 0..agents {
        toml.push_str(&format!(
            r#"
[[node]]
name = "soak-{i:03}"
driver_version = "550.54.15"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "81559MiB"
reserved = "512MiB"
count = 8
utilization = 96

[[node.gpu.process]]
pid = {pid}
name = "python train.py"
user = "alice"
uid = 1001
slurm_job_id = "{job}"
memory = {{ shape = "warmup_plateau", start = "2GiB", plateau = "71GiB", warmup_s = 240, jitter = "256MiB" }}
"#,
            pid = 100_000 + i,
            job = 5_000_000 + i,
        ));
    }
    toml
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let agents: usize = args.get(1).map_or(100, |a| a.parse().unwrap());
    let minutes: u64 = args.get(2).map_or(30, |a| a.parse().unwrap());
    // When the collector is SIGKILLed, in minutes: half-way unless given.
    let restart_minute: Option<u64> = args.get(3).map(|a| a.parse().unwrap());
    let db = postgres::fresh_database()
        .await
        .expect("the soak needs Postgres: set DATABASE_URL");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("collector.log");
    let (grpc, http) = (free_port(), free_port());
    println!(
        "soak: {agents} agents x 8 GPUs, {minutes} min, collector on {}",
        redact_url(&db.url)
    );
    let mut collector = start_collector(&db.url, &grpc, &http, &log);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let scenario = Scenario::from_toml_str(&fleet(agents)).unwrap();
    let mut handles: Vec<AgentHandle> = Vec::with_capacity(agents);
    for i in 0..agents {
        let settings = AgentSettings {
            collector_url: format!("http://{grpc}"),
            node: format!("soak-{i:03}"),
            token: None,
            tls: None,
            spool: Some(headroom_agent::outbox::SpoolConfig {
                dir: dir.path().join(format!("spool-{i:03}")),
                max_bytes: 256 << 20,
                segment_bytes: 4 << 20,
                fsync_interval: Duration::from_secs(1),
            }),
            boot_id: String::new(),
            poll_interval: Duration::from_millis(100),
            sample_interval: Duration::from_secs(1),
            max_pending_batches: 3600,
            flush_above: 1.5,
            metrics_listen: None,
            allocator_socket: None,
            dcgm_metric_names: false,
        };
        let source = SimSource::new(&scenario, &format!("soak-{i:03}")).unwrap();
        handles.push(headroom_agent::start(settings, Box::new(source)).unwrap());
    }
    let started = Instant::now();
    let total = Duration::from_secs(minutes * 60);
    let restart_at = restart_minute.map_or(total / 2, |m| Duration::from_secs(m * 60));
    let mut restarted = false;
    println!("| t (s) | collector RSS (MiB) | agents' process RSS (MiB) | batches committed |");
    println!("|---|---|---|---|");
    let mut committed_before_restart = 0;
    while started.elapsed() < total {
        tokio::time::sleep(Duration::from_secs(30)).await;
        if !restarted && started.elapsed() >= restart_at {
            committed_before_restart = committed(&http).await;
            let _ = collector.kill();
            let _ = collector.wait();
            println!(
                "| {} | (collector SIGKILLed) | | |",
                started.elapsed().as_secs()
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
            collector = start_collector(&db.url, &grpc, &http, &log);
            restarted = true;
            continue;
        }
        println!(
            "| {} | {:.1} | {:.1} | {} |",
            started.elapsed().as_secs(),
            rss_mib(collector.id()),
            rss_mib(std::process::id()),
            committed_before_restart + committed(&http).await
        );
    }
    let end = now_ms();
    // Let the last seconds (and any replay) land before counting.
    tokio::time::sleep(Duration::from_secs(15)).await;

    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let rows: Vec<(String, i64, i32)> = sqlx::query_as(
        "SELECT n.name, s.ts_ms, s.interval_ms FROM gpu_samples s
         JOIN devices d ON d.id = s.device_id JOIN nodes n ON n.id = d.node_id
         WHERE d.parent_id IS NULL AND d.gpu_index = 0 AND s.ts_ms <= $1
         ORDER BY n.name, s.ts_ms",
    )
    .bind(end)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let (mut samples, mut breaks, mut duplicates, mut nodes) = (0usize, 0usize, 0usize, 0usize);
    for node in rows.chunk_by(|a, b| a.0 == b.0) {
        nodes += 1;
        samples += node.len();
        for pair in node.windows(2) {
            let gap = pair[1].1 - i64::from(pair[1].2) - pair[0].1;
            if pair[1].1 == pair[0].1 {
                duplicates += 1;
            } else if gap.abs() > 5 {
                breaks += 1;
            }
        }
    }
    for handle in handles {
        handle.stop().await;
    }
    let _ = collector.kill();
    let _ = collector.wait();
    println!(
        "nodes {nodes}/{agents}; GPU 0 samples {samples}; breaks in the tiling (lost intervals) {breaks}; duplicates {duplicates}"
    );
    db.drop_database().await;
    assert_eq!(nodes, agents, "every agent stored samples");
    assert_eq!(breaks, 0, "no interval lost");
    assert_eq!(duplicates, 0, "no interval stored twice");
}
