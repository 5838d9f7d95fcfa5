//! Running under systemd (`Type=notify`): tell the service manager when
//! start-up is done and, while the daemon's own work makes progress, keep
//! its watchdog fed. Shared by the agent and the collector. Outside systemd
//! (no `NOTIFY_SOCKET`) every call here does nothing.

use std::time::Duration;

/// Start-up is finished: listeners are bound, the first inventory is read.
pub fn ready(status: &str) {
    if let Err(error) = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(status),
    ]) {
        tracing::warn!(%error, "cannot notify systemd that start-up is finished");
    }
}

/// The daemon is shutting down.
pub fn stopping() {
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
}

/// When `WatchdogSec=` is set, pings systemd at half its period for as long
/// as `progress` keeps changing: a daemon whose work has stalled (a wedged
/// poll loop, a stuck runtime) stops pinging and systemd restarts it. The
/// returned task runs until dropped or aborted.
pub fn spawn_watchdog<F>(progress: F) -> Option<tokio::task::JoinHandle<()>>
where
    F: Fn() -> u64 + Send + 'static,
{
    let period = sd_notify::watchdog_enabled()?;
    let every = (period / 2).max(Duration::from_millis(100));
    tracing::info!(
        watchdog_ms = period.as_millis() as u64,
        "systemd watchdog enabled"
    );
    Some(tokio::spawn(async move {
        let mut last = None;
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let now = progress();
            if last == Some(now) {
                tracing::error!(
                    "no progress since the last watchdog ping; letting systemd's watchdog fire"
                );
                continue;
            }
            last = Some(now);
            if let Err(error) = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]) {
                tracing::warn!(%error, "cannot ping the systemd watchdog");
            }
        }
    }))
}
