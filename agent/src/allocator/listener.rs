//! The local socket training processes report on. Every connection is tied
//! to its sender by the kernel (`SO_PEERCRED`): a report counts only for the
//! process that holds the connection, whatever pid it claims, and one that
//! claims another process's pid is refused. Bounded in clients, line length
//! and rate, so a misbehaving job cannot make the agent miss a GPU poll.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_stream::StreamExt;
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};

use super::AllocatorReports;
use super::report::{self, MAX_LINE_BYTES};
use crate::attribution::process::parse_status;
use crate::metrics::{AgentMetrics, AllocatorOutcome};

/// Reports closer together than this from one connection are dropped: the
/// client sends one a second, and the sampler joins one per interval.
const MIN_REPORT_SPACING: Duration = Duration::from_millis(100);

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
}

#[derive(Debug, Clone)]
pub struct ListenerConfig {
    pub path: PathBuf,
    /// The host's /proc, to learn a sender's pid inside its own namespace.
    pub procfs_root: PathBuf,
    pub max_clients: usize,
}

/// Binds the socket, replacing a stale one a previous run left (but never
/// one that still answers), and opens it to every local user: jobs run as
/// anyone, and the kernel vouches for who each sender is.
pub fn bind(path: &Path) -> Result<UnixListener, ListenError> {
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
    let listener = UnixListener::bind(path).map_err(bind_error)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(bind_error)?;
    Ok(listener)
}

/// Accepts reporters until the task is aborted.
pub async fn serve(
    listener: UnixListener,
    config: ListenerConfig,
    reports: Arc<AllocatorReports>,
    metrics: Arc<AgentMetrics>,
) {
    let slots = Arc::new(Semaphore::new(config.max_clients));
    let connections = AtomicU64::new(0);
    let procfs_root = Arc::new(config.procfs_root);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "allocator socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.record_allocator(AllocatorOutcome::RefusedClient);
            tracing::warn!(
                max_clients = config.max_clients,
                "allocator socket: too many reporting processes; connection refused"
            );
            continue;
        };
        let connection = connections.fetch_add(1, Ordering::Relaxed);
        let reports = reports.clone();
        let metrics = metrics.clone();
        let procfs_root = procfs_root.clone();
        tokio::spawn(async move {
            metrics.allocator_client_connected(true);
            handle(stream, connection, &procfs_root, &reports, &metrics).await;
            metrics.allocator_client_connected(false);
            drop(slot);
        });
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
    let mut lines = FramedRead::new(stream, LinesCodec::new_with_max_length(MAX_LINE_BYTES));
    let mut last_accepted: Option<Instant> = None;
    let mut complained = false;
    let mut complain = |what: String| {
        if complained {
            tracing::debug!(pid, "{what}");
        } else {
            complained = true;
            tracing::warn!(pid, "allocator report refused: {what}");
        }
    };
    while let Some(line) = lines.next().await {
        let line = match line {
            Ok(line) => line,
            Err(LinesCodecError::MaxLineLengthExceeded) => {
                metrics.record_allocator(AllocatorOutcome::TooLong);
                complain(format!(
                    "a line longer than {MAX_LINE_BYTES} bytes; connection closed"
                ));
                break;
            }
            Err(LinesCodecError::Io(error)) => {
                // Invalid UTF-8 lands here too.
                metrics.record_allocator(AllocatorOutcome::Malformed);
                complain(format!("unreadable input ({error}); connection closed"));
                break;
            }
        };
        match report::parse(line.as_bytes()) {
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
                let now = Instant::now();
                if last_accepted.is_some_and(|t| now.duration_since(t) < MIN_REPORT_SPACING) {
                    metrics.record_allocator(AllocatorOutcome::RateLimited);
                    continue;
                }
                last_accepted = Some(now);
                metrics.record_allocator(AllocatorOutcome::Accepted);
                reports.record(pid, connection, report.devices);
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
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
        let listener = bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o666, "every local user may report");
        let reports = Arc::new(AllocatorReports::default());
        let metrics = AgentMetrics::new(
            "n",
            &Inventory {
                driver_version: String::new(),
                gpus: vec![],
            },
        );
        let server = tokio::spawn(serve(
            listener,
            ListenerConfig {
                path: path.clone(),
                procfs_root: PathBuf::from("/proc"),
                max_clients: 4,
            },
            reports.clone(),
            metrics.clone(),
        ));

        let own = std::process::id();
        let mut client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        // Another process's pid first: refused, nothing recorded.
        client.write_all(line(own + 1, 5).as_bytes()).unwrap();
        client.write_all(b"{\"v\":1,\n").unwrap();
        until("the refusals", || {
            counter(&metrics, "wrong_pid") == 1 && counter(&metrics, "malformed") == 1
        })
        .await;
        assert!(reports.is_empty());
        client.write_all(line(own, 7).as_bytes()).unwrap();
        until("the report", || reports.len() == 1).await;
        // Too fast after the last one: dropped.
        client.write_all(line(own, 9).as_bytes()).unwrap();
        until("rate limiting", || counter(&metrics, "rate_limited") == 1).await;
        assert_eq!(counter(&metrics, "accepted"), 1);

        // A line past the limit ends that connection only.
        let mut flooder = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let _ = flooder.write_all(&vec![b'x'; MAX_LINE_BYTES + 2]);
        until("the overlong line", || counter(&metrics, "too_long") == 1).await;
        drop(client);
        until("the closed connection's report to go", || {
            reports.is_empty()
        })
        .await;
        server.abort();
    }

    #[tokio::test]
    async fn replaces_a_stale_socket_but_not_a_live_one() {
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
