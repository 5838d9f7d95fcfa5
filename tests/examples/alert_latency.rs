//! Alert latency: from the moment simulated GPU memory crosses the watermark
//! to the moment a webhook for it arrives at a real HTTP receiver.
//!
//! ```sh
//! cargo run --release -p headroom-tests --example alert_latency -- [AGENTS] [SECONDS] [--with-prometheus]
//! ```
//!
//! Runs AGENTS (default 100) simulated 8-GPU agents in this process, each
//! streaming over gRPC on loopback to a collector (Postgres when DATABASE_URL
//! is set, else SQLite in a temporary folder) with the default watermark rule
//! (warning at 90 %, `for` 0 s) and one webhook. GPU 0 of every node spikes
//! from 50 % to 95 % for 10 s every 30 s; each spike is one crossing.
//!
//! With `--with-prometheus`, the same agents also serve `/metrics`, and two
//! real Prometheus + Alertmanager pairs (Debian's `prometheus` and
//! `prometheus-alertmanager`) run side by side with an equivalent rule
//! (`(used + reserved) / total > 0.9`, `for: 0s`): one with the documented
//! default intervals (scrape and evaluation 1 m, `group_wait` 30 s,
//! `group_interval` 5 m), one tuned to 1 s / 1 s / 0 s. Their webhooks go to
//! the same receiver, so all three pipelines see the same crossings.
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
use headroom_rules::config::RulesConfig;
use headroom_sim::Scenario;
use headroom_store::Store;
use headroom_tests::fixtures::now_ms;
use headroom_tests::harness::RunningCollector;

const PERIOD_S: i64 = 30;

/// Every firing notification for GPU 0 that reached the receiver.
#[derive(Debug, Clone)]
struct Arrival {
    pipeline: String,
    node: String,
    at_ms: i64,
    /// Headroom's only: the time of the sample that fired the alert (the
    /// agent's interval end), which splits the agent's share from the
    /// collector's.
    sample_ms: Option<i64>,
}

type Arrivals = Arc<Mutex<Vec<Arrival>>>;

/// One Prometheus + Alertmanager pair, killed when dropped.
struct PromStack {
    children: Vec<std::process::Child>,
}

impl Drop for PromStack {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts Prometheus scraping `targets` and an Alertmanager posting to `hook`.
fn start_prometheus(
    dir: &Path,
    name: &str,
    targets: &[String],
    scrape_eval: &str,
    group_wait: &str,
    group_interval: &str,
    hook: &str,
) -> PromStack {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let am_port = free_port();
    let prom_port = free_port();
    let target_list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: {scrape_eval}\n  evaluation_interval: {scrape_eval}\n\
             rule_files: ['rules.yml']\n\
             alerting:\n  alertmanagers:\n  - static_configs:\n    - targets: ['127.0.0.1:{am_port}']\n\
             scrape_configs:\n- job_name: headroom-agents\n  static_configs:\n  - targets: [{}]\n",
            target_list.join(", ")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("rules.yml"),
        "groups:\n- name: gpu-memory\n  rules:\n  - alert: GpuMemoryHigh\n    \
         expr: (headroom_gpu_memory_used_bytes + headroom_gpu_memory_reserved_bytes) / headroom_gpu_memory_total_bytes > 0.9\n    \
         for: 0s\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("alertmanager.yml"),
        format!(
            "route:\n  receiver: hook\n  group_by: ['node', 'gpu']\n  group_wait: {group_wait}\n  \
             group_interval: {group_interval}\n  repeat_interval: 4h\n\
             receivers:\n- name: hook\n  webhook_configs:\n  - url: '{hook}'\n    send_resolved: false\n"
        ),
    )
    .unwrap();
    let quiet = || std::process::Stdio::null();
    let prometheus = std::process::Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .arg("--log.level=warn")
        .stdout(quiet())
        .stderr(quiet())
        .spawn()
        .expect("prometheus (Debian package `prometheus`) must be installed");
    let alertmanager = std::process::Command::new("prometheus-alertmanager")
        .arg(format!(
            "--config.file={}",
            dir.join("alertmanager.yml").display()
        ))
        .arg(format!("--storage.path={}", dir.join("am").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{am_port}"))
        .arg("--cluster.listen-address=")
        .arg("--log.level=warn")
        .stdout(quiet())
        .stderr(quiet())
        .spawn()
        .expect("prometheus-alertmanager (Debian package) must be installed");
    PromStack {
        children: vec![prometheus, alertmanager],
    }
}
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
    let with_prometheus = args.iter().any(|a| a == "--with-prometheus");

    // The receiver records every firing notification for GPU 0, per pipeline.
    let arrivals: Arrivals = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = Router::new()
        .route(
            "/hook",
            post(|State(arrivals): State<Arrivals>, body: Bytes| async move {
                let at = now_ms();
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let labels = &v["alert"]["labels"];
                if v["status"] == "firing"
                    && v["alert"]["rule"] == "watermark"
                    && labels["gpu"] == "0"
                {
                    arrivals.lock().unwrap().push(Arrival {
                        pipeline: "headroom".into(),
                        node: labels["node"].as_str().unwrap_or("").to_owned(),
                        at_ms: at,
                        sample_ms: v["alert"]["at_ms"].as_i64(),
                    });
                }
                "ok"
            }),
        )
        .route(
            "/am/{pipeline}",
            post(
                |State(arrivals): State<Arrivals>,
                 axum::extract::Path(pipeline): axum::extract::Path<String>,
                 body: Bytes| async move {
                    let at = now_ms();
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    for alert in v["alerts"].as_array().into_iter().flatten() {
                        if alert["status"] == "firing" && alert["labels"]["gpu"] == "0" {
                            arrivals.lock().unwrap().push(Arrival {
                                pipeline: pipeline.clone(),
                                node: alert["labels"]["node"].as_str().unwrap_or("").to_owned(),
                                at_ms: at,
                                sample_ms: None,
                            });
                        }
                    }
                    "ok"
                },
            ),
        )
        .with_state(arrivals.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let hook = format!("{base}/hook");

    let dir = tempfile::tempdir().unwrap();
    let (store, backend): (Arc<dyn Store>, &str) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (headroom_store::connect(&url).await.unwrap(), "postgres"),
        _ => {
            let url = format!("sqlite://{}", dir.path().join("bench.db").display());
            (headroom_store::connect(&url).await.unwrap(), "sqlite")
        }
    };
    let rules = RulesConfig::parse(
        &format!("[[notify.webhook]]\nname = \"bench\"\nurl = \"{hook}\"\nsecret = \"bench\"\n"),
        Path::new("bench-rules.toml"),
    )
    .unwrap();
    let collector = RunningCollector::start_collector(
        Collector::builder(store)
            .rules(rules)
            .build()
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
                    spool: None,
                    tls: None,
                    token: None,
                    collector_url: collector.grpc_url(),
                    node: node.name.clone(),
                    boot_id: format!("bench-{}", now_ms()),
                    poll_interval: Duration::from_millis(100),
                    sample_interval: Duration::from_secs(1),
                    max_pending_batches: 3600,
                    flush_above: 0.90,
                    metrics_listen: with_prometheus.then(|| "127.0.0.1:0".parse().unwrap()),
                    allocator_socket: None,
                    dcgm_metric_names: false,
                },
                Box::new(source),
            )
            .unwrap(),
        );
    }
    let stacks = if with_prometheus {
        let targets: Vec<String> = handles
            .iter()
            .filter_map(|h| h.metrics_addr().map(|a| a.to_string()))
            .collect();
        vec![
            start_prometheus(
                dir.path(),
                "defaults",
                &targets,
                "1m",
                "30s",
                "5m",
                &format!("{base}/am/prometheus-defaults"),
            ),
            start_prometheus(
                dir.path(),
                "tuned",
                &targets,
                "1s",
                "0s",
                "1s",
                &format!("{base}/am/prometheus-tuned"),
            ),
        ]
    } else {
        Vec::new()
    };
    eprintln!(
        "{agents} agents × 8 GPUs streaming to the collector on {backend}; measuring for {seconds} s …"
    );
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let ended = now_ms();
    let collector_metrics = reqwest::get(collector.api("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    drop(stacks);
    for h in handles {
        h.stop().await;
    }
    collector.stop().await;

    // Each arrival belongs to the latest spike of its node that began before
    // it; repeated notifications of one spike count once (the first).
    // Crossings counted are those at least GRACE_MS before the end, so every
    // pipeline had the same chance to report them.
    const GRACE_MS: i64 = 5_000;
    let cutoff = ended - GRACE_MS;
    let expected: i64 = started
        .values()
        .map(|start| ((cutoff - start) / (PERIOD_S * 1000)).max(0))
        .sum();
    println!(
        "alert latency, crossing -> webhook received ({agents} agents x 8 GPUs, Headroom on {backend}, 10 Hz polls, 1 s samples, {seconds} s, {expected} crossings):"
    );
    let arrivals = arrivals.lock().unwrap().clone();
    let mut pipelines: Vec<String> = arrivals.iter().map(|a| a.pipeline.clone()).collect();
    pipelines.sort();
    pipelines.dedup();
    if with_prometheus {
        for p in ["prometheus-defaults", "prometheus-tuned"] {
            if !pipelines.iter().any(|q| q == p) {
                pipelines.push(p.into());
            }
        }
    }
    for pipeline in pipelines {
        // Per crossing, its first notification: (latency, agent's share).
        let mut first: HashMap<(String, i64), (i64, Option<i64>)> = HashMap::new();
        let mut repeats = 0;
        for a in arrivals.iter().filter(|a| a.pipeline == pipeline) {
            let Some(start) = started.get(&a.node) else {
                continue;
            };
            let k = (a.at_ms - start) / (PERIOD_S * 1000);
            if k < 1 {
                continue;
            }
            let crossing = start + k * PERIOD_S * 1000;
            if crossing > cutoff {
                continue;
            }
            match first.entry((a.node.clone(), k)) {
                std::collections::hash_map::Entry::Occupied(_) => repeats += 1,
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert((a.at_ms - crossing, a.sample_ms.map(|s| s - crossing)));
                }
            }
        }
        let mut latencies: Vec<i64> = first.values().map(|(l, _)| *l).collect();
        latencies.sort_unstable();
        if latencies.is_empty() {
            println!("  {pipeline:<20} crossings alerted 0 of {expected}");
            continue;
        }
        println!(
            "  {pipeline:<20} crossings alerted {} of {expected} (repeats {repeats}); p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
            latencies.len(),
            percentile(&latencies, 50.0),
            percentile(&latencies, 90.0),
            percentile(&latencies, 99.0),
            latencies[latencies.len() - 1]
        );
        let mut agent: Vec<i64> = first.values().filter_map(|(_, a)| *a).collect();
        let mut after: Vec<i64> = first
            .values()
            .filter_map(|(l, a)| a.map(|a| l - a))
            .collect();
        if agent.is_empty() {
            continue;
        }
        agent.sort_unstable();
        after.sort_unstable();
        println!(
            "    where the time went (p50 · p99): agent, crossing -> its sample's interval end {} · {} ms; collector, that sample -> webhook received {} · {} ms",
            percentile(&agent, 50.0),
            percentile(&agent, 99.0),
            percentile(&after, 50.0),
            percentile(&after, 99.0),
        );
        let stage = |stage: &str, q: f64| {
            histogram_quantile(
                &collector_metrics,
                "headroom_collector_alert_delay_seconds",
                stage,
                q,
            )
            .map_or("-".to_owned(), |s| format!("{:.0}", s * 1000.0))
        };
        println!(
            "    collector's own histograms from the sample (p50 · p99, bucket-interpolated, every alert): outbox committed {} · {} ms; receiver said yes {} · {} ms",
            stage("committed", 0.5),
            stage("committed", 0.99),
            stage("delivered", 0.5),
            stage("delivered", 0.99),
        );
    }
}

/// The `q` quantile of the histogram `name{stage="…"}` in a Prometheus
/// text exposition, interpolated linearly within its bucket as
/// Prometheus' `histogram_quantile` does.
fn histogram_quantile(text: &str, name: &str, stage: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{stage=\"{stage}\",le=\"");
    let mut buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|line| line.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (bound, count) = rest.split_once("\"} ")?;
            let bound = if bound == "+Inf" {
                f64::INFINITY
            } else {
                bound.parse().ok()?
            };
            Some((bound, count.trim().parse().ok()?))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut below = (0.0, 0.0);
    for (bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                return Some(below.0);
            }
            let share = if count > below.1 {
                (rank - below.1) / (count - below.1)
            } else {
                0.0
            };
            return Some(below.0 + (bound - below.0) * share);
        }
        below = (bound, count);
    }
    None
}
