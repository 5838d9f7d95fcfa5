//! `/api/v1/stream`: the fleet overview, live, as server-sent events. The
//! first event (`snapshot`) carries every node, device and the alert counts;
//! after that, once a second, an `update` carries only the devices whose
//! latest sample changed (and those that went away), so a dashboard of
//! thousands of GPUs costs a few kilobytes a second, not a reload.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::Extension;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde::Serialize;

use super::AppState;
use super::auth::Identity;
use headroom_store::alerts::ActiveAlertCounts;
use headroom_store::{DeviceView, NodeView};

const PERIOD: Duration = Duration::from_secs(1);

#[derive(Serialize)]
struct FleetMessage<'a> {
    nodes: &'a [NodeView],
    gpus: Vec<&'a DeviceView>,
    removed: Vec<&'a str>,
    alerts: Option<ActiveAlertCounts>,
}

struct Follower {
    state: AppState,
    /// The token the stream was opened with, checked on every event: a
    /// revoked token ends the stream instead of following the fleet forever.
    token_sha256: Option<String>,
    /// What this client was last sent: each device's latest sample time.
    sent: Option<HashMap<String, Option<i64>>>,
    /// False until the first event went out: only that one is not paced.
    started: bool,
}

impl Follower {
    /// False once the stream's token is revoked; a store that cannot say
    /// keeps the stream (its events say the figures are stale).
    async fn still_allowed(&self) -> bool {
        match (&self.token_sha256, self.state.auth.tokens()) {
            (Some(hash), Some(tokens)) => tokens.still_active(hash).await.unwrap_or(true),
            _ => true,
        }
    }

    async fn next_event(&mut self) -> Event {
        let (nodes, devices) = match (
            self.state.store.nodes().await,
            self.state.store.latest_devices().await,
        ) {
            (Ok(nodes), Ok(devices)) => (nodes, devices),
            (Err(error), _) | (_, Err(error)) => {
                tracing::debug!(%error, "fleet stream: store unavailable");
                // Named, so the page can say its figures are stale.
                return Event::default()
                    .event("unavailable")
                    .data("the collector cannot read its store; retrying");
            }
        };
        let alerts = self.state.store.active_alert_counts().await.ok();
        let stamp = |d: &DeviceView| d.latest.as_ref().map(|l| l.timestamp_ms);
        let (kind, changed, removed) = match &self.sent {
            None => ("snapshot", devices.iter().collect(), Vec::new()),
            Some(sent) => {
                let changed: Vec<&DeviceView> = devices
                    .iter()
                    .filter(|d| sent.get(&d.uuid) != Some(&stamp(d)))
                    .collect();
                let present: std::collections::HashSet<&str> =
                    devices.iter().map(|d| d.uuid.as_str()).collect();
                let removed: Vec<&str> = sent
                    .keys()
                    .map(String::as_str)
                    .filter(|u| !present.contains(u))
                    .collect();
                ("update", changed, removed)
            }
        };
        let message = FleetMessage {
            nodes: &nodes,
            gpus: changed,
            removed,
            alerts,
        };
        let event = Event::default()
            .event(kind)
            .json_data(&message)
            .unwrap_or_else(|_| Event::default().comment("encoding failed"));
        self.sent = Some(devices.iter().map(|d| (d.uuid.clone(), stamp(d))).collect());
        event
    }
}

pub async fn fleet(
    State(state): State<AppState>,
    identity: Option<Extension<Identity>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut shutdown = state.shutdown.clone();
    let follower = Follower {
        state,
        token_sha256: identity.and_then(|Extension(i)| i.token_sha256),
        sent: None,
        started: false,
    };
    let events = futures::stream::unfold(follower, |mut f| async move {
        if f.started {
            tokio::time::sleep(PERIOD).await;
        }
        if !f.still_allowed().await {
            tracing::info!("fleet stream ended: its token was revoked");
            return None;
        }
        f.started = true;
        let event = f.next_event().await;
        Some((Ok(event), f))
    })
    .take_until(async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}
