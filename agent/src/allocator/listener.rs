//! The local socket training processes report on. Every connection is tied
//! to its sender by the kernel (`SO_PEERCRED`): a report counts only for the
//! process that holds the connection, whatever pid it claims, and one that
//! claims another process's pid is refused. Bounded in clients (overall and
//! per user), line length, rate and idle time, and served on a thread of its
//! own, so a misbehaving job can neither starve the uplink nor make the agent
//! miss a GPU poll.

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};

use super::report::{self, MAX_LINE_BYTES};
use super::{AllocatorReports, Sender};
use crate::attribution::process::{parse_btime, parse_stat, parse_status, start_time_ms};
use crate::metrics::{AgentMetrics, AllocatorOutcome};
use crate::time::epoch_ms_now;

/// Lines closer together than this on one connection are dropped unread:
/// the client sends one a second, and the sampler joins one per interval.
const MIN_LINE_SPACING: Duration = Duration::from_millis(100);
/// A connection that sends no line for this long is closed (the client
/// reconnects on its next report).
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("cannot create {dir} for the allocator socket: {source}")]
    Directory {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("another process already listens on {path} (a second agent on this host?)")]
    InUse { path: PathBuf },
    #[error("cannot listen on {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the allocator socket's thread: {0}")]
    Thread(std::io::Error),
}

#[derive(Debug, Clone)]
pub struct ListenerConfig {
    pub path: PathBuf,
    /// The host's /proc, to learn a sender's start time and its pid inside
    /// its own namespace.
    pub procfs_root: PathBuf,
    pub max_clients: usize,
    /// Connections one user may hold at once, so one user's jobs cannot
    /// lock out everyone else's.
    pub max_clients_per_user: usize,
}

/// Binds the socket, replacing a stale one a previous run left (but never
/// one that still answers), and opens it to every local user: jobs run as
/// anyone, and the kernel vouches for who each sender is.
pub fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, ListenError> {
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(|source| ListenError::Directory {
            dir: dir.to_owned(),
            source,
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ListenError::InUse {
                    path: path.to_owned(),
                });
            }
            let _ = std::fs::remove_file(path);
        }
        Ok(_) => {
            return Err(ListenError::NotASocket {
                path: path.to_owned(),
            });
        }
        Err(_) => {}
    }
    let bind_error = |source| ListenError::Bind {
        path: path.to_owned(),
        source,
    };
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(bind_error)?;
    listener.set_nonblocking(true).map_err(bind_error)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(bind_error)?;
    Ok(listener)
}

/// The listener's thread; dropping or stopping it ends the thread and
/// removes the socket file.
#[derive(Debug)]
pub struct ListenerHandle {
    path: PathBuf,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ListenerHandle {
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ListenerHandle {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Binds and serves on a thread with a runtime of its own.
pub fn spawn(
    config: ListenerConfig,
    reports: Arc<AllocatorReports>,
    metrics: Arc<AgentMetrics>,
) -> Result<ListenerHandle, ListenError> {
    let listener = bind(&config.path)?;
    let (stop, stopped) = watch::channel(false);
    let path = config.path.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ListenError::Thread)?;
    let thread = std::thread::Builder::new()
        .name("headroom-allocator".into())
        .spawn(move || runtime.block_on(serve(listener, config, reports, metrics, stopped)))
        .map_err(ListenError::Thread)?;
    Ok(ListenerHandle {
        path,
        stop,
        thread: Some(thread),
    })
}

/// Accepts reporters until `stop` turns true.
pub async fn serve(
    listener: std::os::unix::net::UnixListener,
    config: ListenerConfig,
    reports: Arc<AllocatorReports>,
    metrics: Arc<AgentMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let listener = match UnixListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, "allocator socket: cannot serve");
            return;
        }
    };
    let per_user: Arc<Mutex<HashMap<u32, usize>>> = Arc::default();
    let open = Arc::new(AtomicU64::new(0));
    let mut next_connection: u64 = 0;
    let config = Arc::new(config);
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "allocator socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = Slot::claim(&stream, &config, &per_user, &open) else {
            metrics.record_allocator(AllocatorOutcome::RefusedClient);
            tracing::warn!(
                max_clients = config.max_clients,
                max_clients_per_user = config.max_clients_per_user,
                "allocator socket: too many reporting processes; connection refused"
            );
            continue;
        };
        next_connection += 1;
        let connection = next_connection;
        let reports = reports.clone();
        let metrics = metrics.clone();
        let config = config.clone();
        tasks.spawn(async move {
            metrics.allocator_client_connected(true);
            handle(stream, connection, &config.procfs_root, &reports, &metrics).await;
            metrics.allocator_client_connected(false);
            drop(slot);
        });
    }
}

/// A connection's place under the overall and per-user limits, given back
/// when it closes.
struct Slot {
    uid: u32,
    per_user: Arc<Mutex<HashMap<u32, usize>>>,
    open: Arc<AtomicU64>,
}

impl Slot {
    fn claim(
        stream: &UnixStream,
        config: &ListenerConfig,
        per_user: &Arc<Mutex<HashMap<u32, usize>>>,
        open: &Arc<AtomicU64>,
    ) -> Option<Self> {
        let uid = stream.peer_cred().ok()?.uid();
        let mut users = per_user.lock().ok()?;
        let mine = users.entry(uid).or_default();
        if open.load(Ordering::Relaxed) >= config.max_clients as u64
            || *mine >= config.max_clients_per_user
        {
            return None;
        }
        *mine += 1;
        open.fetch_add(1, Ordering::Relaxed);
        Some(Self {
            uid,
            per_user: per_user.clone(),
            open: open.clone(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        if let Ok(mut users) = self.per_user.lock()
            && let Some(count) = users.get_mut(&self.uid)
        {
            *count = count.saturating_sub(1);
            if *count == 0 {
                users.remove(&self.uid);
            }
        }
    }
}

async fn handle(
    stream: UnixStream,
    connection: u64,
    procfs_root: &Path,
    reports: &AllocatorReports,
    metrics: &AgentMetrics,
) {
    let peer = match stream.peer_cred() {
        Ok(cred) => cred.pid().and_then(|p| u32::try_from(p).ok()),
        Err(_) => None,
    };
    let Some(pid) = peer.filter(|p| *p > 0) else {
        metrics.record_allocator(AllocatorOutcome::WrongPid);
        tracing::warn!(
            "allocator socket: the kernel gives no pid for a sender (is it in a PID namespace this agent cannot see?); connection closed"
        );
        return;
    };
    let own_pids = pids_of(pid, procfs_root);
    let sender = Sender {
        pid,
        start_time_ms: start_time_of(pid, procfs_root),
        connection,
    };
    let mut lines = FramedRead::new(stream, LinesCodec::new_with_max_length(MAX_LINE_BYTES));
    let mut last_line: Option<Instant> = None;
    let mut complained = false;
    let mut complain = |what: String| {
        if complained {
            tracing::debug!(pid, "{what}");
        } else {
            complained = true;
            tracing::warn!(pid, "allocator report refused: {what}");
        }
    };
    loop {
        let line = match tokio::time::timeout(IDLE_TIMEOUT, lines.next()).await {
            Err(_) => {
                tracing::debug!(pid, "allocator socket: idle connection closed");
                break;
            }
            Ok(None) => break,
            Ok(Some(Ok(line))) => line,
            Ok(Some(Err(LinesCodecError::MaxLineLengthExceeded))) => {
                metrics.record_allocator(AllocatorOutcome::TooLong);
                complain(format!(
                    "a line longer than {MAX_LINE_BYTES} bytes; connection closed"
                ));
                break;
            }
            Ok(Some(Err(LinesCodecError::Io(error)))) => {
                // Invalid UTF-8 lands here too.
                metrics.record_allocator(AllocatorOutcome::Malformed);
                complain(format!("unreadable input ({error}); connection closed"));
                break;
            }
        };
        // Every line counts against the rate, and a line over it is not
        // even parsed: a flood costs the agent a read, no more.
        let now = Instant::now();
        if last_line.is_some_and(|t| now.duration_since(t) < MIN_LINE_SPACING) {
            metrics.record_allocator(AllocatorOutcome::RateLimited);
            continue;
        }
        last_line = Some(now);
        match report::parse(line.as_bytes(), epoch_ms_now()) {
            Err(error) => {
                metrics.record_allocator(AllocatorOutcome::Malformed);
                complain(error.to_string());
            }
            Ok(report) if !own_pids.contains(&report.claimed_pid) => {
                metrics.record_allocator(AllocatorOutcome::WrongPid);
                complain(format!(
                    "claims pid {} but the kernel says the sender is pid {pid}",
                    report.claimed_pid
                ));
            }
            Ok(report) => {
                metrics.record_allocator(AllocatorOutcome::Accepted);
                for problem in &report.dropped {
                    complain(problem.clone());
                }
                reports.record(sender, report.devices);
            }
        }
    }
    reports.forget(pid, connection);
}

/// The pids a sender may call itself: its pid in this agent's namespace and,
/// for a process in a container, its pid inside its own namespace (what
/// `os.getpid()` returns there).
fn pids_of(pid: u32, procfs_root: &Path) -> Vec<u32> {
    let mut pids = vec![pid];
    if let Ok(status) = std::fs::read_to_string(procfs_root.join(pid.to_string()).join("status"))
        && let Some(inner) = parse_status(&status).nspid.last()
        && *inner != pid
    {
        pids.push(*inner);
    }
    pids
}

/// When the sender started (epoch ms), as attribution computes it for the
/// NVML samples the report will be joined to.
fn start_time_of(pid: u32, procfs_root: &Path) -> Option<i64> {
    let stat = std::fs::read(procfs_root.join(pid.to_string()).join("stat")).ok()?;
    let btime = parse_btime(&std::fs::read_to_string(procfs_root.join("stat")).ok()?)?;
    start_time_ms(btime, parse_stat(&stat)?.start_ticks)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::source::Inventory;

    fn line(pid: u32, reserved: u64) -> String {
        format!(
            "{{\"v\":1,\"pid\":{pid},\"ts_ms\":1,\"devices\":[{{\"index\":0,\"uuid\":\"GPU-aa\",\"allocated_bytes\":1,\"reserved_bytes\":{reserved},\"active_bytes\":1,\"inactive_split_bytes\":0,\"peak_allocated_bytes\":1,\"alloc_retries\":0,\"ooms\":0}}]}}\n"
        )
    }

    fn counter(metrics: &AgentMetrics, outcome: &str) -> u64 {
        let text = metrics.render();
        let prefix =
            format!("headroom_agent_allocator_reports_total{{node=\"n\",outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap()
            .parse()
            .unwrap()
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..200 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test]
    async fn accepts_its_own_pid_refuses_another_and_cuts_overlong_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/allocator.sock");
        let reports = Arc::new(AllocatorReports::default());
        let metrics = AgentMetrics::new(
            "n",
            &Inventory {
                driver_version: String::new(),
                gpus: vec![],
            },
        );
        let server = spawn(
            ListenerConfig {
                path: path.clone(),
                procfs_root: PathBuf::from("/proc"),
                max_clients: 8,
                max_clients_per_user: 2,
            },
            reports.clone(),
            metrics.clone(),
        )
        .unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o666, "every local user may report");

        let own = std::process::id();
        let mut client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        // Another process's pid: refused, nothing recorded. The garbage line
        // right behind it is over the rate and dropped unread.
        let burst = format!("{}{{\"v\":1,\n", line(own + 1, 5));
        client.write_all(burst.as_bytes()).unwrap();
        until("the refusals", || {
            counter(&metrics, "wrong_pid") == 1 && counter(&metrics, "rate_limited") == 1
        })
        .await;
        assert!(reports.is_empty());
        std::thread::sleep(MIN_LINE_SPACING);
        client.write_all(b"{\"v\":1,\n").unwrap();
        until("the malformed line", || counter(&metrics, "malformed") == 1).await;
        std::thread::sleep(MIN_LINE_SPACING);
        client.write_all(line(own, 7).as_bytes()).unwrap();
        until("the report", || reports.len() == 1).await;
        assert_eq!(counter(&metrics, "accepted"), 1);

        // This user's second connection is allowed, the third is not.
        let second = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let third = std::os::unix::net::UnixStream::connect(&path).unwrap();
        until("the per-user limit", || {
            counter(&metrics, "refused_client") == 1
        })
        .await;
        drop(second);
        drop(third);

        // A line past the limit ends that connection only.
        until("the freed slot", || {
            metrics
                .render()
                .contains("headroom_agent_allocator_clients{node=\"n\"} 1")
        })
        .await;
        let mut flooder = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let _ = flooder.write_all(&vec![b'x'; MAX_LINE_BYTES + 2]);
        until("the overlong line", || counter(&metrics, "too_long") == 1).await;
        drop(client);
        until("the closed connection's report to go", || {
            reports.is_empty()
        })
        .await;
        server.stop();
        assert!(!path.exists(), "the socket is removed on stop");
    }

    #[test]
    fn replaces_a_stale_socket_but_not_a_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("allocator.sock");
        let first = bind(&path).unwrap();
        let err = bind(&path).unwrap_err().to_string();
        assert!(err.contains("already listens"), "{err}");
        drop(first);
        // The file a dead agent left behind is taken over.
        assert!(path.exists());
        bind(&path).unwrap();
    }

    #[test]
    fn refuses_to_replace_a_file_that_is_not_a_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("allocator.sock");
        std::fs::write(&path, "precious").unwrap();
        let err = bind(&path).unwrap_err().to_string();
        assert!(err.contains("is not a socket"), "{err}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "precious");
    }
}
