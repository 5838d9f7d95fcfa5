//! The agent and collector binaries as separate processes, each writing to
//! a log file the test prints when it fails, and what a test reads from
//! them: the agent's backlog and a GPU's stored samples.

use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

use headroom_store::PostgresStore;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

use crate::harness::{KillOnDrop, built};

/// `path`, appended to, for a process's stdout and stderr.
pub fn log_file(path: &Path) -> File {
    File::options()
        .create(true)
        .append(true)
        .open(path)
        .unwrap()
}

/// `headroom-collector serve` on `database_url`, with `rules` when given.
pub fn start_collector(
    database_url: &str,
    rules: Option<&Path>,
    grpc: SocketAddr,
    http: SocketAddr,
    log: &Path,
) -> KillOnDrop {
    start_configured_collector(database_url, rules, None, grpc, http, log)
}

/// [`start_collector`] writing its open chunks every `flush_s` seconds
/// (from a configuration file beside `log`), so that what an agent sends
/// is on disk, and acknowledged as durable, within about that long.
pub fn start_collector_flushing_every(
    flush_s: u32,
    database_url: &str,
    rules: Option<&Path>,
    grpc: SocketAddr,
    http: SocketAddr,
    log: &Path,
) -> KillOnDrop {
    let config = log.with_extension("toml");
    std::fs::write(&config, format!("[storage]\nchunk_flush_s = {flush_s}\n")).unwrap();
    start_configured_collector(database_url, rules, Some(&config), grpc, http, log)
}

/// [`start_collector`] with a configuration file.
pub fn start_configured_collector(
    database_url: &str,
    rules: Option<&Path>,
    config: Option<&Path>,
    grpc: SocketAddr,
    http: SocketAddr,
    log: &Path,
) -> KillOnDrop {
    let log = log_file(log);
    let mut command = Command::new(built("headroom-collector"));
    if let Some(config) = config {
        command.arg("serve").arg("--config").arg(config);
    } else {
        command.arg("serve");
    }
    command
        .args(["--grpc-listen", &grpc.to_string()])
        .args(["--http-listen", &http.to_string()]);
    if let Some(rules) = rules {
        command.arg("--rules").arg(rules);
    }
    KillOnDrop(
        command
            .env("HEADROOM_DATABASE_URL", database_url)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// Where a simulated agent runs and how fast it samples.
#[derive(Debug)]
pub struct SimAgent<'a> {
    /// The demo scenario's node it simulates.
    pub sim_node: &'a str,
    /// The name it registers as.
    pub node: &'a str,
    pub sample_ms: i64,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    pub spool: &'a Path,
    pub log: &'a Path,
}

/// `headroom-agent --source sim`, spooling to `spool`.
pub fn start_agent(agent: &SimAgent<'_>) -> KillOnDrop {
    let log = log_file(agent.log);
    KillOnDrop(
        Command::new(built("headroom-agent"))
            .args(["--source", "sim", "--sim-node", agent.sim_node])
            .args(["--node-name", agent.node])
            .args(["--collector-url", &format!("http://{}", agent.grpc)])
            .args(["--metrics-listen", &agent.metrics.to_string()])
            .args(["--poll-interval-ms", "10"])
            .args(["--sample-interval-ms", &agent.sample_ms.to_string()])
            .arg("--no-allocator-socket")
            .arg("--spool-dir")
            .arg(agent.spool)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// The agent's count of batches the collector has not acknowledged.
pub async fn pending_batches(metrics: SocketAddr) -> Option<u64> {
    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with("headroom_agent_pending_batches{"))?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()
}

/// (end of interval, its length) of `node`'s GPU 0 samples on disk in the
/// Postgres database at `url` (rows and chunks; not what a collector holds
/// in open chunks), in time order; empty while it cannot be reached.
pub async fn gpu0_samples(url: &str, node: &str) -> Vec<(i64, i64)> {
    let Ok(mut conn) = PgConnection::connect(url).await else {
        return Vec::new();
    };
    let device: Option<i64> = sqlx::query_scalar(
        "SELECT d.id::int8 FROM devices d JOIN nodes n ON n.id = d.node_id
         WHERE n.name = $1 AND d.parent_id IS NULL AND d.gpu_index = 0",
    )
    .bind(node)
    .fetch_optional(&mut conn)
    .await
    .ok()
    .flatten();
    let Some(device) = device else {
        return Vec::new();
    };
    PostgresStore::stored_gpu_samples(&mut conn, &[device], 0, i64::MAX / 2)
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.timestamp_ms, i64::from(s.interval_ms)))
        .collect()
}
