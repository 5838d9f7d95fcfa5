//! The agent and collector binaries as separate processes, each writing to
//! a log file the test prints when it fails, and what a test reads from
//! them: the agent's backlog and a GPU's stored samples.

use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

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
    let log = log_file(log);
    let mut command = Command::new(built("headroom-collector"));
    command
        .arg("serve")
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

/// (end of interval, its length) of `node`'s GPU 0 samples in the Postgres
/// database at `url`, in time order; empty while it cannot be reached.
pub async fn gpu0_samples(url: &str, node: &str) -> Vec<(i64, i64)> {
    let Ok(mut conn) = PgConnection::connect(url).await else {
        return Vec::new();
    };
    sqlx::query_as::<_, (i64, i32)>(
        "SELECT s.ts_ms, s.interval_ms FROM gpu_samples s
         JOIN devices d ON d.id = s.device_id JOIN nodes n ON n.id = d.node_id
         WHERE n.name = $1 AND d.parent_id IS NULL AND d.gpu_index = 0
         ORDER BY s.ts_ms",
    )
    .bind(node)
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default()
    .into_iter()
    .map(|(ts, interval)| (ts, i64::from(interval)))
    .collect()
}
