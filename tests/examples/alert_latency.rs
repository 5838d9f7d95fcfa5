//! Alert latency: from the moment simulated GPU memory crosses the watermark
//! to the moment a webhook for it arrives at a real HTTP receiver.
//!
//! ```sh
//! cargo run --release -p headroom-tests --example alert_latency -- [AGENTS] [SECONDS]
//! ```
//!
//! Runs AGENTS (default 100) simulated 8-GPU agents in this process, each
//! streaming over gRPC on loopback to a collector (Postgres when DATABASE_URL
//! is set, else SQLite in a temporary folder) with the default watermark rule
//! (warning at 90 %, `for` 0 s) and one webhook. GPU 0 of every node spikes
//! from 50 % to 95 % for 10 s every 30 s; each spike is one crossing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: fail loudly

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use headroom_agent::AgentSettings;
use headroom_agent::source::SimSource;
use headroom_collector::Collector;
use headroom_collector::clock::Clock;
use headroom_collector::rules::config::RulesConfig;
use headroom_collector::store::{self, SqliteStore, Store};
use headroom_sim::Scenario;
use headroom_tests::fixtures::now_ms;
use headroom_tests::harness::RunningCollector;

const PERIOD_S: i64 = 30;

/// (node, arrival time) of every firing watermark webhook.
type Arrivals = Arc<Mutex<Vec<(String, i64)>>>;
const SPIKE_S: i64 = 10;

fn scenario(agents: usize) -> String {
    let mut toml = String::new();
    for n in 0..agents {
        writeln!(
            toml,
            r#"[[node]]
name = "bench-{n:03}"
[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
[[node.gpu.process]]
pid = 1000
name = "python train.py"
memory = {{ shape = "spike", base = "40GiB", peak = "76GiB", every_s = {PERIOD_S}, duration_s = {SPIKE_S} }}
[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
count = 7
[[node.gpu.process]]
pid = 2000
name = "python serve.py"
memory = {{ shape = "steady", level = "30GiB", jitter = "512MiB" }}
"#
        )
        .unwrap();
    }
    toml
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let agents: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(100);
    let seconds: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(95);

    // The receiver records (node, arrival time) of every firing watermark webhook.
    let arrivals: Arrivals = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    let app = Router::new()
        .route(
            "/hook",
            post(|State(arrivals): State<Arrivals>, body: Bytes| async move {
                let at = now_ms();
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                if v["status"] == "firing" && v["alert"]["rule"] == "watermark" {
                    let node = v["alert"]["labels"]["node"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned();
                    arrivals.lock().unwrap().push((node, at));
                }
                "ok"
            }),
        )
        .with_state(arrivals.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dir = tempfile::tempdir().unwrap();
    let (store, backend): (Arc<dyn Store>, &str) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (store::connect(&url).await.unwrap(), "postgres"),
        _ => {
            let url = format!("sqlite://{}", dir.path().join("bench.db").display());
            (
                Arc::new(SqliteStore::connect(&url).await.unwrap()),
                "sqlite",
            )
        }
    };
    let rules = RulesConfig::parse(
        &format!("[[notify.webhook]]\nname = \"bench\"\nurl = \"{hook}\"\nsecret = \"bench\"\n"),
        Path::new("bench-rules.toml"),
    )
    .unwrap();
    let collector = RunningCollector::start_collector(
        Collector::with_rules(store, rules, Clock::System)
            .await
            .unwrap(),
    )
    .await;

    let scenario = Scenario::from_toml_str(&scenario(agents)).unwrap();
    let mut handles = Vec::new();
    let mut started: HashMap<String, i64> = HashMap::new();
    for node in scenario.nodes() {
        let source = SimSource::new(&scenario, &node.name).unwrap();
        started.insert(node.name.clone(), source.started_epoch_ms());
        handles.push(
            headroom_agent::start(
                AgentSettings {
                    collector_url: collector.grpc_url(),
                    node: node.name.clone(),
                    boot_id: format!("bench-{}", now_ms()),
                    poll_interval: Duration::from_millis(100),
                    sample_interval: Duration::from_secs(1),
                    max_pending_batches: 3600,
                    flush_above: 0.90,
                },
                Box::new(source),
            )
            .unwrap(),
        );
    }
    eprintln!(
        "{agents} agents × 8 GPUs streaming to the collector on {backend}; measuring for {seconds} s …"
    );
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    for h in handles {
        h.stop().await;
    }
    collector.stop().await;

    // Each arrival belongs to the latest spike of its node that began before it.
    let mut latencies: Vec<i64> = Vec::new();
    let mut per_node_spike: HashMap<(String, i64), usize> = HashMap::new();
    for (node, at) in arrivals.lock().unwrap().iter() {
        let Some(start) = started.get(node) else {
            continue;
        };
        let k = (at - start) / (PERIOD_S * 1000);
        if k < 1 {
            continue;
        }
        let crossing = start + k * PERIOD_S * 1000;
        *per_node_spike.entry((node.clone(), k)).or_default() += 1;
        latencies.push(at - crossing);
    }
    latencies.sort_unstable();
    let expected: i64 = started
        .values()
        .map(|_| (seconds as i64 - 1) / PERIOD_S)
        .sum();
    let duplicates = per_node_spike.values().filter(|c| **c > 1).count();
    if latencies.is_empty() {
        println!("no alerts arrived");
        return;
    }
    println!(
        "alert latency, watermark crossing -> webhook received ({agents} agents x 8 GPUs, {backend}, 10 Hz polls, 1 s samples):"
    );
    println!(
        "  crossings {expected}, alerts {}, duplicates {duplicates}",
        latencies.len()
    );
    println!(
        "  p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
        percentile(&latencies, 50.0),
        percentile(&latencies, 90.0),
        percentile(&latencies, 99.0),
        latencies[latencies.len() - 1]
    );
}
