//! `/api/v1/stream`: the fleet overview, live, as server-sent events. The
//! first event (`snapshot`) carries every node, device and the alert counts;
//! after that, once a second, an `update` carries only the devices whose
//! latest sample changed (and those that went away), so a dashboard of
//! thousands of GPUs costs a few kilobytes a second, not a reload.
//!
//! What it costs the collector is bounded however many follow it: the
//! fleet is read from the store once a period for all clients together
//! ([`FleetFeed`]), each client keeping only what it was last sent, and at
//! most `[http] max_stream_clients` follow at once; one more is answered
//! `503` with `Retry-After`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Serialize;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::AppState;
use super::auth::Identity;
use crate::metrics::{CollectorMetrics, HttpRefusal};
use headroom_store::alerts::{ActiveAlertCounts, AlertFilter, AlertView};
use headroom_store::{DeviceView, NodeView, Store};

const PERIOD: Duration = Duration::from_secs(1);
/// What a client over the limit is told to wait before trying again.
const RETRY_AFTER_S: u32 = 5;

/// The fleet as read at one moment, shared by every client.
#[derive(Debug)]
enum Fleet {
    Read {
        nodes: Vec<NodeView>,
        devices: Vec<DeviceView>,
        alerts: Option<ActiveAlertCounts>,
        /// Firing alerts by the device they are on.
        device_alerts: BTreeMap<String, DeviceAlerts>,
    },
    /// The store could not answer.
    Unavailable,
}

/// The stream's one reader of the store and its admission: however many
/// clients follow, the fleet is read at most once a period, and at most
/// `max_clients` follow at once.
#[derive(Debug)]
pub struct FleetFeed {
    store: Arc<dyn Store>,
    metrics: Arc<CollectorMetrics>,
    slots: Arc<Semaphore>,
    max_clients: u32,
    /// The last read and when it finished. Held while reading, so clients
    /// that ask meanwhile wait for that read instead of starting their own.
    latest: Mutex<Option<(Instant, Arc<Fleet>)>>,
}

impl FleetFeed {
    pub fn new(store: Arc<dyn Store>, max_clients: u32, metrics: Arc<CollectorMetrics>) -> Self {
        Self {
            store,
            metrics,
            slots: Arc::new(Semaphore::new(max_clients.max(1) as usize)),
            max_clients,
            latest: Mutex::new(None),
        }
    }

    /// A place for one more client, if there is one.
    fn join(&self) -> Option<Seat> {
        let permit = self.slots.clone().try_acquire_owned().ok()?;
        self.metrics.http_stream_client(true);
        Some(Seat {
            _permit: permit,
            metrics: self.metrics.clone(),
        })
    }

    /// The fleet as of at most a period ago.
    async fn current(&self) -> Arc<Fleet> {
        let mut latest = self.latest.lock().await;
        if let Some((at, fleet)) = latest.as_ref()
            && at.elapsed() < PERIOD
        {
            return fleet.clone();
        }
        self.metrics.http_stream_read();
        let fleet = Arc::new(self.read().await);
        *latest = Some((Instant::now(), fleet.clone()));
        fleet
    }

    async fn read(&self) -> Fleet {
        match (self.store.nodes().await, self.store.latest_devices().await) {
            (Ok(nodes), Ok(devices)) => Fleet::Read {
                nodes,
                devices,
                alerts: self.store.active_alert_counts().await.ok(),
                device_alerts: self
                    .store
                    .alerts(AlertFilter::Firing, MAX_FIRING_ALERTS)
                    .await
                    .map(|alerts| by_device(&alerts))
                    .unwrap_or_default(),
            },
            (Err(error), _) | (_, Err(error)) => {
                tracing::debug!(%error, "fleet stream: store unavailable");
                Fleet::Unavailable
            }
        }
    }
}

/// Firing alerts read for the tiles, at most; past it the tiles of the
/// rest show their memory level only (the alert counts stay exact).
const MAX_FIRING_ALERTS: i64 = 10_000;

/// What fires on one device, for its tile: a tile never says "OK" under a
/// firing alert.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
struct DeviceAlerts {
    /// "critical" when any is, else "warning".
    severity: &'static str,
    /// The rules firing, sorted, each once.
    rules: Vec<String>,
}

fn by_device(alerts: &[AlertView]) -> BTreeMap<String, DeviceAlerts> {
    let mut map: BTreeMap<String, DeviceAlerts> = BTreeMap::new();
    for alert in alerts {
        let Some(uuid) = alert.labels.get("device_uuid").and_then(|u| u.as_str()) else {
            continue;
        };
        let entry = map.entry(uuid.to_owned()).or_default();
        if alert.severity == "critical" || entry.severity == "critical" {
            entry.severity = "critical";
        } else {
            entry.severity = "warning";
        }
        if !entry.rules.contains(&alert.rule) {
            entry.rules.push(alert.rule.clone());
            entry.rules.sort();
        }
    }
    map
}

/// A client's place among `max_stream_clients`, given back when its stream
/// ends (the client left, its token was revoked, or the collector stops).
#[derive(Debug)]
struct Seat {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<CollectorMetrics>,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.metrics.http_stream_client(false);
    }
}

#[derive(Serialize)]
struct FleetMessage<'a> {
    nodes: &'a [NodeView],
    gpus: Vec<&'a DeviceView>,
    removed: Vec<&'a str>,
    alerts: Option<ActiveAlertCounts>,
    /// Every device with a firing alert, in every message: the set is small
    /// and a resolved alert is its absence.
    device_alerts: &'a BTreeMap<String, DeviceAlerts>,
}

struct Follower {
    state: AppState,
    _seat: Seat,
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
        let fleet = self.state.fleet.current().await;
        let Fleet::Read {
            nodes,
            devices,
            alerts,
            device_alerts,
        } = fleet.as_ref()
        else {
            // Named, so the page can say its figures are stale.
            return Event::default()
                .event("unavailable")
                .data("the collector cannot read its store; retrying");
        };
        let stamp = |d: &DeviceView| d.latest.as_ref().map(|l| l.timestamp_ms);
        let (kind, changed, removed) = match &self.sent {
            None => ("snapshot", devices.iter().collect(), Vec::new()),
            Some(sent) => {
                let changed: Vec<&DeviceView> = devices
                    .iter()
                    .filter(|d| sent.get(&d.uuid) != Some(&stamp(d)))
                    .collect();
                let present: HashSet<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
                let removed: Vec<&str> = sent
                    .keys()
                    .map(String::as_str)
                    .filter(|u| !present.contains(u))
                    .collect();
                ("update", changed, removed)
            }
        };
        let message = FleetMessage {
            nodes,
            gpus: changed,
            removed,
            alerts: *alerts,
            device_alerts,
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
) -> Response {
    let Some(seat) = state.fleet.join() else {
        state.metrics.http_refused(HttpRefusal::StreamClients);
        let mut response = (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "error": format!(
                "the live stream has its {} clients ([http] max_stream_clients); retry in {RETRY_AFTER_S} s",
                state.fleet.max_clients
            ) })),
        )
            .into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        return response;
    };
    let mut shutdown = state.shutdown.clone();
    let follower = Follower {
        state,
        _seat: seat,
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
        Some((Ok::<_, Infallible>(event), f))
    })
    .take_until(async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alert(rule: &str, severity: &str, labels: serde_json::Value) -> AlertView {
        AlertView {
            id: 1,
            fingerprint: String::new(),
            rule: rule.to_owned(),
            severity: severity.to_owned(),
            state: "firing".to_owned(),
            labels,
            summary: String::new(),
            details: serde_json::Value::Null,
            started_at_ms: 0,
            fired_at_ms: Some(0),
            resolved_at_ms: None,
            updated_at_ms: 0,
            acknowledged_by: None,
            acknowledged_at_ms: None,
            remedy: String::new(),
        }
    }

    #[test]
    fn a_device_shows_its_worst_severity_and_each_rule_once() {
        let a = serde_json::json!({ "node": "n1", "device_uuid": "GPU-a" });
        let map = by_device(&[
            alert("watermark", "warning", a.clone()),
            alert("time_to_oom", "critical", a.clone()),
            alert("watermark", "warning", a),
            alert(
                "leak",
                "warning",
                serde_json::json!({ "device_uuid": "GPU-b", "pid": "7" }),
            ),
            // A node's alert is on no device.
            alert(
                "agent_silent",
                "critical",
                serde_json::json!({ "node": "n1" }),
            ),
        ]);
        assert_eq!(map.len(), 2);
        assert_eq!(map["GPU-a"].severity, "critical");
        assert_eq!(map["GPU-a"].rules, ["time_to_oom", "watermark"]);
        assert_eq!(map["GPU-b"].severity, "warning");
        assert_eq!(map["GPU-b"].rules, ["leak"]);
    }
}
