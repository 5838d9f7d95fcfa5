//! The collector's memory under hostile load (issue 29): the collector
//! binary given runs as a child process on free loopback ports, and its
//! resident memory (`VmRSS`, and the peak, `VmHWM`, from
//! `/proc/PID/status`) is read as three scenarios push at it.
//!
//! ```sh
//! cargo build --release -p headroom-collector
//! cargo run --release -p headroom-tests --example hostile_load -- \
//!   --collector target/release/headroom-collector [A|B|C|all]...
//! ```
//!
//! A. One agent token (`[agents] require_token = true`, SQLite) sends 1,000
//!    `Register` calls for its own node, each with a new boot_id and 256 new
//!    device UUIDs (the default per-call limit), 4 at a time. RSS at the
//!    start, after 250, 500 and 1,000 calls and 30 s after; the calls
//!    accepted and refused, by status code. The calls stop early after
//!    120 s or past 8 GiB of RSS (6fecaf5 keeps every device of every boot
//!    in every cached session: memory grows with the square of the calls).
//! B. 250 fake agents × 8 GPUs (2,000 GPUs) register and stream one batch a
//!    second (8 GPU samples, 2 process samples, timestamps = now) to a
//!    collector on Postgres (a throwaway database on the server
//!    `DATABASE_URL` names, or on a throwaway cluster; SQLite when neither
//!    can be had). After 10 s, 500 clients open `GET /api/v1/stream` and read
//!    it for 30 s, then disconnect. RSS before the clients, the most while
//!    they read, right after and 20 s after they leave; the clients accepted
//!    and refused; `GET /metrics` timed every 5 s while they read; batches
//!    acknowledged per second before, during and after.
//! C. 200 slow connections to a collector on SQLite: 100 to the HTTP port
//!    that send a request header one byte every 3 s (slowloris), 50 to the
//!    gRPC port that send only the HTTP/2 preface and 50 that send nothing.
//!    How many the server has not closed (a read returning 0 or an error)
//!    at 10, 30, 60, 120 and 150 s (past the default 120 s gRPC idle
//!    timeout), RSS, and whether a fresh `GET /healthz` and a
//!    fresh gRPC `Register` are still served meanwhile.
//!
//! The load runs in this process, on the same cores as the collector: on a
//! small machine the figures of B include the generator's CPU contention.
// A benchmark: fail loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// `..Default::default()` on every wire message, even where each field is
// set today: fields the proto gains later keep their defaults.
#![allow(clippy::needless_update)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_client::IngestClient;
use headroom_tests::fixtures::now_ms;
use headroom_tests::harness::{KillOnDrop, free_loopback_addr};
use headroom_tests::postgres;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

const GIB: u64 = 1 << 30;
const NODE_A: &str = "hostile-node";
const REGISTERS_A: usize = 1000;
const DEVICES_PER_REGISTER: usize = 256;
/// A stops early past this RSS or this time, to spare the machine.
const MAX_RSS_MIB_A: f64 = 8192.0;
const BUDGET_A: Duration = Duration::from_secs(120);
const AGENTS_B: usize = 250;
const GPUS_PER_AGENT: usize = 8;
const CLIENTS_B: usize = 500;
const SLOW_HTTP: usize = 100;
const SLOW_GRPC_PREFACE: usize = 50;
const SLOW_GRPC_SILENT: usize = 50;
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// What a slowloris connection sends, one byte every 3 s: never a whole
/// header (about 2 minutes' worth, then `a` forever).
const SLOWLORIS: &[u8] = b"GET /api/v1/gpus HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";

// ---------------------------------------------------------------- memory

/// `VmRSS` and `VmHWM` of `pid` in MiB; `None` once it is gone.
fn memory(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map(|kb| kb / 1024.0)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// One row of a scenario's table.
struct Row {
    at: String,
    rss: Option<(f64, f64)>,
    note: String,
}

fn print_table(title: &str, rows: &[Row]) {
    println!("\n{title}\n");
    println!("| point | RSS (MiB) | peak RSS, VmHWM (MiB) | notes |");
    println!("|---|---:|---:|---|");
    for row in rows {
        let (rss, hwm) = match row.rss {
            Some((rss, hwm)) => (format!("{rss:.1}"), format!("{hwm:.1}")),
            None => ("(exited)".into(), String::new()),
        };
        println!("| {} | {rss} | {hwm} | {} |", row.at, row.note);
    }
}

fn tally(counts: &BTreeMap<String, usize>) -> String {
    counts
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

// ------------------------------------------------------------- collector

struct Config<'a> {
    database_url: &'a str,
    require_token: bool,
}

/// The collector binary running on free loopback ports.
struct Child {
    process: KillOnDrop,
    pid: u32,
    grpc: SocketAddr,
    http: SocketAddr,
    log: PathBuf,
}

impl Child {
    fn write_config(dir: &Path, config: &Config<'_>) -> (PathBuf, SocketAddr, SocketAddr) {
        let (grpc, http) = (free_loopback_addr(), free_loopback_addr());
        let path = dir.join("collector.toml");
        std::fs::write(
            &path,
            format!(
                "grpc_listen = \"{grpc}\"\nhttp_listen = \"{http}\"\ndatabase_url = \"{}\"\n\n\
                 [agents]\nrequire_token = {}\n",
                config.database_url, config.require_token
            ),
        )
        .unwrap();
        (path, grpc, http)
    }

    fn command(bin: &Path, log: &Path) -> std::process::Command {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let mut command = std::process::Command::new(bin);
        for var in [
            "HEADROOM_CONFIG",
            "HEADROOM_DATABASE_URL",
            "HEADROOM_GRPC_LISTEN",
            "HEADROOM_HTTP_LISTEN",
            "HEADROOM_HTTP_AUTH",
            "HEADROOM_RULES",
        ] {
            command.env_remove(var);
        }
        command
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stderr(log);
        command
    }

    /// `headroom-collector token create --node NODE`: the token it prints.
    async fn create_token(bin: &Path, config: &Path, log: &Path, node: &str) -> String {
        let mut command = Self::command(bin, log);
        command
            .arg("token")
            .arg("--config")
            .arg(config)
            .args(["create", "--node", node]);
        let output = tokio::process::Command::from(command)
            .output()
            .await
            .unwrap();
        assert!(
            output.status.success(),
            "token create failed: see {}",
            log.display()
        );
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    }

    async fn start(bin: &Path, dir: &Path, config: &Config<'_>) -> (Self, PathBuf) {
        let (path, grpc, http) = Self::write_config(dir, config);
        let log = dir.join("collector.log");
        (Self::serve(bin, &path, grpc, http, log).await, path)
    }

    async fn serve(
        bin: &Path,
        config: &Path,
        grpc: SocketAddr,
        http: SocketAddr,
        log: PathBuf,
    ) -> Self {
        let out = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let process = KillOnDrop(
            Self::command(bin, &log)
                .arg("serve")
                .arg("--config")
                .arg(config)
                .stdout(out)
                .spawn()
                .unwrap(),
        );
        let pid = process.0.id();
        let mut this = Self {
            process,
            pid,
            grpc,
            http,
            log,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(
                this.process.is_running(),
                "the collector exited on start:\n{}",
                this.log_tail()
            );
            if let Ok(r) = client.get(this.url("/healthz")).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the collector did not come up:\n{}",
                this.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        this
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    fn memory(&self) -> Option<(f64, f64)> {
        memory(self.pid)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Kills it; says whether it was still running (it did not crash).
    fn finish(mut self) -> bool {
        let running = self.process.is_running();
        if !running {
            println!(
                "!! the collector exited during the scenario ({:?}); its log ends:\n{}",
                self.process.0.try_wait(),
                self.log_tail()
            );
        }
        self.process.kill();
        running
    }
}

async fn grpc_channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap()
}

fn code_name(status: &tonic::Status) -> String {
    format!("{:?}", status.code())
}

// ------------------------------------------------------------ scenario A

fn register_a(i: usize) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: NODE_A.into(),
        boot_id: format!("hostile-boot-{i:05}"),
        agent_version: "hostile-load".into(),
        gpus: (0..DEVICES_PER_REGISTER)
            .map(|g| pb::Gpu {
                uuid: format!("GPU-{i:08x}-{g:04x}-4000-8000-00000000beef"),
                index: g as u32,
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total_bytes: 80 * GIB,
                ..Default::default()
            })
            .collect(),
        sample_interval_ms: 1000,
        ..Default::default()
    }
}

async fn scenario_a(bin: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("headroom.db").display());
    let config = Config {
        database_url: &url,
        require_token: true,
    };
    let (path, grpc, http) = Child::write_config(dir.path(), &config);
    let log = dir.path().join("collector.log");
    let token = Child::create_token(bin, &path, &log, NODE_A).await;
    let child = Child::serve(bin, &path, grpc, http, log).await;
    let client = IngestClient::new(grpc_channel(child.grpc).await);
    let bearer: tonic::metadata::AsciiMetadataValue = format!("Bearer {token}").parse().unwrap();

    let mut rows = vec![Row {
        at: "start".into(),
        rss: child.memory(),
        note: String::new(),
    }];
    let started = Instant::now();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let mut calls = futures::stream::iter(0..REGISTERS_A)
        .map(|i| {
            let mut client = client.clone();
            let mut request = tonic::Request::new(register_a(i));
            request
                .metadata_mut()
                .insert("authorization", bearer.clone());
            async move {
                match client.register(request).await {
                    Ok(_) => "OK".to_owned(),
                    Err(status) => code_name(&status),
                }
            }
        })
        .buffered(4);
    let mut done = 0;
    while let Some(outcome) = calls.next().await {
        *outcomes.entry(outcome).or_default() += 1;
        done += 1;
        if [250, 500, 1000].contains(&done) {
            rows.push(Row {
                at: format!(
                    "after {done} calls ({:.1} s)",
                    started.elapsed().as_secs_f64()
                ),
                rss: child.memory(),
                note: tally(&outcomes),
            });
        }
        let rss = child.memory();
        let over = rss.is_some_and(|(rss, _)| rss > MAX_RSS_MIB_A);
        if done < REGISTERS_A && (over || started.elapsed() > BUDGET_A) {
            rows.push(Row {
                at: format!(
                    "stopped after {done} calls, {:.1} s (limits: {} s, {MAX_RSS_MIB_A} MiB)",
                    started.elapsed().as_secs_f64(),
                    BUDGET_A.as_secs()
                ),
                rss: child.memory(),
                note: tally(&outcomes),
            });
            break;
        }
    }
    drop(calls);
    tokio::time::sleep(Duration::from_secs(30)).await;
    rows.push(Row {
        at: "30 s after the last call".into(),
        rss: child.memory(),
        note: String::new(),
    });
    let survived = child.finish();
    print_table(
        &format!(
            "A. {REGISTERS_A} Register calls from one token, {DEVICES_PER_REGISTER} new devices and a new boot_id each (SQLite)"
        ),
        &rows,
    );
    println!(
        "calls by status: {}; collector {}",
        tally(&outcomes),
        if survived { "still running" } else { "EXITED" }
    );
}

// ------------------------------------------------------------ scenario B

fn gpu_uuid_b(agent: usize, gpu: usize) -> String {
    format!("GPU-{agent:08x}-{gpu:04x}-4000-8000-0000000b0b0b")
}

fn register_b(agent: usize) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: format!("bench-node-{agent:03}"),
        boot_id: "bench-boot".into(),
        agent_version: "hostile-load".into(),
        driver_version: "550.54.15".into(),
        gpus: (0..GPUS_PER_AGENT)
            .map(|g| pb::Gpu {
                uuid: gpu_uuid_b(agent, g),
                index: g as u32,
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total_bytes: 80 * GIB,
                pcie_generation: 5,
                pcie_width: 16,
                ..Default::default()
            })
            .collect(),
        sample_interval_ms: 1000,
        ..Default::default()
    }
}

fn batch_b(agent: usize, seq: u64, ts: i64) -> pb::Batch {
    let used = |g: usize| (20 + (agent + g) as u64 % 40) * GIB + (seq % 64) * (2 << 20);
    pb::Batch {
        node: format!("bench-node-{agent:03}"),
        boot_id: "bench-boot".into(),
        seq,
        gpu_samples: (0..GPUS_PER_AGENT)
            .map(|g| pb::GpuSample {
                uuid: gpu_uuid_b(agent, g),
                timestamp_ms: ts,
                interval_ms: 1000,
                poll_count: 10,
                memory_used_last_bytes: used(g),
                memory_used_min_bytes: used(g) - 256 * (1 << 20),
                memory_used_max_bytes: used(g) + 512 * (1 << 20),
                memory_reserved_bytes: 512 * (1 << 20),
                memory_total_bytes: 80 * GIB,
                utilization_pct: Some(90),
                ..Default::default()
            })
            .collect(),
        process_samples: (0..2)
            .map(|p| pb::ProcessSample {
                uuid: gpu_uuid_b(agent, p),
                timestamp_ms: ts,
                pid: 100_000 + p as u32,
                start_time_ms: 1_700_000_000_000,
                memory_used_last_bytes: used(p) - GIB,
                memory_used_max_bytes: used(p) - GIB / 2,
                name: "python train.py".into(),
                uid: 1001,
                user: "alice".into(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[derive(Default)]
struct AgentStats {
    registered: AtomicUsize,
    acked: AtomicU64,
    failed: AtomicUsize,
}

/// One fake agent: its own connection, `Register`, then one batch a second
/// on a `Stream` until `stop`.
async fn fake_agent(
    grpc: SocketAddr,
    agent: usize,
    mut stop: watch::Receiver<bool>,
    stats: Arc<AgentStats>,
) {
    let run = async {
        let mut client = IngestClient::new(
            Endpoint::from_shared(format!("http://{grpc}"))
                .unwrap()
                .connect()
                .await
                .map_err(|e| e.to_string())?,
        );
        client
            .register(register_b(agent))
            .await
            .map_err(|s| code_name(&s))?;
        stats.registered.fetch_add(1, Ordering::Relaxed);
        let (batches, rx) = mpsc::channel(8);
        let mut acks = client
            .stream(ReceiverStream::new(rx))
            .await
            .map_err(|s| code_name(&s))?
            .into_inner();
        let counted = stats.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(_)) = acks.message().await {
                counted.acked.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Spread the agents over the second, as real ones are.
        tokio::time::sleep(Duration::from_millis((agent as u64 * 4) % 1000)).await;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut seq = 0;
        loop {
            tokio::select! {
                _ = stop.changed() => break,
                _ = tick.tick() => {
                    seq += 1;
                    if batches.send(batch_b(agent, seq, now_ms())).await.is_err() {
                        return Err("stream closed".to_owned());
                    }
                }
            }
        }
        drop(batches);
        let _ = tokio::time::timeout(Duration::from_secs(5), reader).await;
        Ok::<(), String>(())
    };
    if let Err(e) = run.await {
        stats.failed.fetch_add(1, Ordering::Relaxed);
        eprintln!("agent {agent}: {e}");
    }
}

#[derive(Default)]
struct ClientStats {
    bytes: AtomicU64,
    /// Clients that received at least one byte of the stream.
    fed: AtomicUsize,
}

/// One dashboard on the live stream: reads until `stop`. Its outcome: the
/// HTTP status, or the error.
async fn sse_client(
    http: reqwest::Client,
    url: String,
    mut stop: watch::Receiver<bool>,
    stats: Arc<ClientStats>,
) -> String {
    let response = tokio::select! {
        _ = stop.changed() => return "never answered".into(),
        r = http.get(&url).send() => r,
    };
    let mut response = match response {
        Ok(r) => r,
        Err(e) if e.is_connect() => return "connect error".into(),
        Err(e) if e.is_timeout() => return "timeout".into(),
        Err(_) => return "request error".into(),
    };
    let status = response.status();
    if !status.is_success() {
        return format!("HTTP {}", status.as_u16());
    }
    let mut first = true;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            chunk = response.chunk() => match chunk {
                Ok(Some(chunk)) => {
                    if first {
                        stats.fed.fetch_add(1, Ordering::Relaxed);
                        first = false;
                    }
                    stats.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
                Ok(None) => return format!("HTTP {} (ended by the server)", status.as_u16()),
                Err(_) => return format!("HTTP {} (broken)", status.as_u16()),
            }
        }
    }
    format!("HTTP {}", status.as_u16())
}

fn acked_per_s(stats: &AgentStats, from: (Instant, u64)) -> f64 {
    let acked = stats.acked.load(Ordering::Relaxed);
    (acked - from.1) as f64 / from.0.elapsed().as_secs_f64()
}

async fn scenario_b(bin: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let db = postgres::fresh_database().await;
    let url = match &db {
        Some(db) => db.url.clone(),
        None => format!("sqlite://{}", dir.path().join("headroom.db").display()),
    };
    let backend = if db.is_some() { "Postgres" } else { "SQLite" };
    let (child, _) = Child::start(
        bin,
        dir.path(),
        &Config {
            database_url: &url,
            require_token: false,
        },
    )
    .await;
    let mut rows = vec![Row {
        at: "started, idle".into(),
        rss: child.memory(),
        note: String::new(),
    }];

    let (stop_agents, agents_stop) = watch::channel(false);
    let agent_stats = Arc::new(AgentStats::default());
    let agents: Vec<_> = (0..AGENTS_B)
        .map(|i| {
            tokio::spawn(fake_agent(
                child.grpc,
                i,
                agents_stop.clone(),
                agent_stats.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mark = (Instant::now(), agent_stats.acked.load(Ordering::Relaxed));
    tokio::time::sleep(Duration::from_secs(5)).await;
    rows.push(Row {
        at: format!(
            "{} GPUs streaming, before the clients",
            AGENTS_B * GPUS_PER_AGENT
        ),
        rss: child.memory(),
        note: format!(
            "{}/{AGENTS_B} agents registered, {:.0} batches acked/s",
            agent_stats.registered.load(Ordering::Relaxed),
            acked_per_s(&agent_stats, mark)
        ),
    });

    // The clients, each on a connection of its own.
    let (stop_clients, clients_stop) = watch::channel(false);
    let client_stats = Arc::new(ClientStats::default());
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .connect_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mark = (Instant::now(), agent_stats.acked.load(Ordering::Relaxed));
    let clients: Vec<_> = (0..CLIENTS_B)
        .map(|_| {
            tokio::spawn(sse_client(
                http.clone(),
                child.url("/api/v1/stream"),
                clients_stop.clone(),
                client_stats.clone(),
            ))
        })
        .collect();
    // `GET /metrics` every 5 s meanwhile, on a connection of its own each.
    let metrics_url = child.url("/metrics");
    let timings = tokio::spawn(async move {
        let scraper = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let mut took = Vec::new();
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let t = Instant::now();
            let ok = match scraper.get(&metrics_url).send().await {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            };
            took.push((t.elapsed(), ok));
        }
        took
    });
    let during = Instant::now();
    let mut peak: Option<(f64, f64)> = None;
    while during.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Some(m) = child.memory() {
            peak = Some(peak.map_or(m, |p| (p.0.max(m.0), p.1.max(m.1))));
        }
    }
    let fed = client_stats.fed.load(Ordering::Relaxed);
    let bytes = client_stats.bytes.load(Ordering::Relaxed);
    rows.push(Row {
        at: format!("{CLIENTS_B} stream clients, 30 s (max)"),
        rss: peak,
        note: format!(
            "{fed} clients got data, {:.1} MiB read in all; {:.0} batches acked/s",
            bytes as f64 / 1048576.0,
            acked_per_s(&agent_stats, mark)
        ),
    });
    let _ = stop_clients.send(true);
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for client in clients {
        *outcomes.entry(client.await.unwrap()).or_default() += 1;
    }
    drop(http);
    let mut took = timings.await.unwrap();
    rows.push(Row {
        at: "clients disconnected".into(),
        rss: child.memory(),
        note: String::new(),
    });
    let mark = (Instant::now(), agent_stats.acked.load(Ordering::Relaxed));
    tokio::time::sleep(Duration::from_secs(20)).await;
    rows.push(Row {
        at: "20 s after the clients left".into(),
        rss: child.memory(),
        note: format!("{:.0} batches acked/s", acked_per_s(&agent_stats, mark)),
    });
    let _ = stop_agents.send(true);
    for agent in agents {
        let _ = agent.await;
    }
    let survived = child.finish();
    if let Some(db) = db {
        db.drop_database().await;
    }
    print_table(
        &format!(
            "B. {AGENTS_B} agents × {GPUS_PER_AGENT} GPUs streaming, {CLIENTS_B} clients on /api/v1/stream for 30 s ({backend})"
        ),
        &rows,
    );
    println!("stream clients by outcome: {}", tally(&outcomes));
    took.sort();
    let failed = took.iter().filter(|t| !t.1).count();
    if let (Some(p50), Some(max)) = (took.get(took.len() / 2), took.last()) {
        println!(
            "GET /metrics while the clients read ({} calls): p50 {:.0} ms, max {:.0} ms{}",
            took.len(),
            p50.0.as_secs_f64() * 1000.0,
            max.0.as_secs_f64() * 1000.0,
            if failed > 0 {
                format!(", {failed} failed or timed out (10 s)")
            } else {
                String::new()
            }
        );
    }
    println!(
        "agents: {} registered, {} failed, {} batches acked in all; collector {}",
        agent_stats.registered.load(Ordering::Relaxed),
        agent_stats.failed.load(Ordering::Relaxed),
        agent_stats.acked.load(Ordering::Relaxed),
        if survived { "still running" } else { "EXITED" }
    );
}

// ------------------------------------------------------------ scenario C

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slow {
    Slowloris,
    Preface,
    Silent,
}

/// Writes `bytes` with the `net` feature alone (no `io-util`).
async fn write_all(stream: &TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        stream.writable().await?;
        match stream.try_write(&bytes[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Holds one slow connection until the server closes it or `stop`; the
/// counter of `kind`'s open connections goes up while it is open.
async fn slow_connection(
    addr: SocketAddr,
    kind: Slow,
    mut stop: watch::Receiver<bool>,
    open: Arc<AtomicUsize>,
) {
    let Ok(stream) = TcpStream::connect(addr).await else {
        return;
    };
    open.fetch_add(1, Ordering::Relaxed);
    let mut alive = kind != Slow::Preface || write_all(&stream, H2_PREFACE).await.is_ok();
    let mut tick = tokio::time::interval(Duration::from_secs(3));
    let mut next = 0;
    let mut buf = [0u8; 4096];
    while alive {
        tokio::select! {
            _ = stop.changed() => break,
            ready = stream.readable() => {
                alive = ready.is_ok() && match stream.try_read(&mut buf) {
                    Ok(0) => false,
                    Ok(_) => true, // SETTINGS, a 408: wait for the close
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                };
            }
            _ = tick.tick(), if kind == Slow::Slowloris => {
                let byte = SLOWLORIS.get(next).copied().unwrap_or(b'a');
                next += 1;
                alive = write_all(&stream, &[byte]).await.is_ok();
            }
        }
    }
    open.fetch_sub(1, Ordering::Relaxed);
}

/// Whether a fresh client is still served: `GET /healthz` and a gRPC
/// `Register`, each with a 5 s limit; what each took, or why not.
async fn fresh_clients_served(child: &Child) -> String {
    let t = Instant::now();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let healthz = match http.get(child.url("/healthz")).send().await {
        Ok(r) if r.status().is_success() => format!("{:.0} ms", t.elapsed().as_secs_f64() * 1000.0),
        Ok(r) => format!("HTTP {}", r.status().as_u16()),
        Err(e) if e.is_timeout() => "timeout".into(),
        Err(_) => "error".into(),
    };
    let t = Instant::now();
    let register = tokio::time::timeout(Duration::from_secs(5), async {
        let channel = Endpoint::from_shared(format!("http://{}", child.grpc))
            .unwrap()
            .connect()
            .await
            .map_err(|_| "connect error".to_owned())?;
        let mut request = register_b(0);
        request.node = "probe-node".into();
        IngestClient::new(channel)
            .register(request)
            .await
            .map_err(|s| code_name(&s))
    })
    .await;
    let register = match register {
        Ok(Ok(_)) => format!("{:.0} ms", t.elapsed().as_secs_f64() * 1000.0),
        Ok(Err(e)) => e,
        Err(_) => "timeout".into(),
    };
    format!("healthz {healthz}, Register {register}")
}

async fn scenario_c(bin: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("headroom.db").display());
    let (child, _) = Child::start(
        bin,
        dir.path(),
        &Config {
            database_url: &url,
            require_token: false,
        },
    )
    .await;
    let mut rows = vec![Row {
        at: "start".into(),
        rss: child.memory(),
        note: fresh_clients_served(&child).await,
    }];
    let (stop, stopped) = watch::channel(false);
    let counters: [(Slow, usize, SocketAddr, Arc<AtomicUsize>); 3] = [
        (Slow::Slowloris, SLOW_HTTP, child.http, Arc::default()),
        (Slow::Preface, SLOW_GRPC_PREFACE, child.grpc, Arc::default()),
        (Slow::Silent, SLOW_GRPC_SILENT, child.grpc, Arc::default()),
    ];
    let mut tasks = Vec::new();
    for (kind, n, addr, open) in &counters {
        for _ in 0..*n {
            tasks.push(tokio::spawn(slow_connection(
                *addr,
                *kind,
                stopped.clone(),
                open.clone(),
            )));
        }
    }
    let started = Instant::now();
    let open = |i: usize| counters[i].3.load(Ordering::Relaxed);
    for at in [10, 30, 60, 120, 150] {
        tokio::time::sleep(Duration::from_secs(at).saturating_sub(started.elapsed())).await;
        rows.push(Row {
            at: format!("{at} s"),
            rss: child.memory(),
            note: format!(
                "open: slowloris {}/{SLOW_HTTP}, HTTP/2 preface only {}/{SLOW_GRPC_PREFACE}, nothing sent {}/{SLOW_GRPC_SILENT}; {}",
                open(0),
                open(1),
                open(2),
                fresh_clients_served(&child).await
            ),
        });
        if open(0) + open(1) + open(2) == 0 {
            break;
        }
    }
    let _ = stop.send(true);
    for task in tasks {
        let _ = task.await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    rows.push(Row {
        at: "5 s after this side closed the rest".into(),
        rss: child.memory(),
        note: String::new(),
    });
    let survived = child.finish();
    print_table(
        &format!(
            "C. {} slow connections: {SLOW_HTTP} slowloris on HTTP, {SLOW_GRPC_PREFACE} HTTP/2 preface only and {SLOW_GRPC_SILENT} silent on gRPC (SQLite)",
            SLOW_HTTP + SLOW_GRPC_PREFACE + SLOW_GRPC_SILENT
        ),
        &rows,
    );
    println!(
        "collector {}",
        if survived { "still running" } else { "EXITED" }
    );
}

// ------------------------------------------------------------------ main

#[tokio::main]
async fn main() {
    let mut collector: Option<PathBuf> = None;
    let mut scenarios: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--collector" => collector = args.next().map(PathBuf::from),
            "all" => scenarios.extend(["A", "B", "C"].map(String::from)),
            s if ["A", "B", "C"].contains(&s.to_uppercase().as_str()) => {
                scenarios.push(s.to_uppercase());
            }
            other => panic!("unexpected argument {other:?}: --collector PATH [A|B|C|all]..."),
        }
    }
    let collector =
        collector.expect("--collector PATH (the headroom-collector binary) is required");
    let collector = std::fs::canonicalize(&collector)
        .unwrap_or_else(|e| panic!("{}: {e}", collector.display()));
    if scenarios.is_empty() {
        scenarios.extend(["A", "B", "C"].map(String::from));
    }
    println!("hostile load against {}", collector.display());
    let started = Instant::now();
    for scenario in &scenarios {
        let t = Instant::now();
        match scenario.as_str() {
            "A" => scenario_a(&collector).await,
            "B" => scenario_b(&collector).await,
            _ => scenario_c(&collector).await,
        }
        println!("({scenario} took {:.0} s)", t.elapsed().as_secs_f64());
    }
    println!("\n(all took {:.0} s)", started.elapsed().as_secs_f64());
}
