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
//!
//! A fleet with more devices than `[http] stream_devices_max` is sent to a
//! client that did not name a node as a row per node and the devices at
//! risk ([`super::node_rows`]); `?node=NAME` follows one node's devices
//! whatever the fleet's size.
//!
//! The same reads answer `GET /api/v1/gpus`, its JSON made once per read
//! for every caller ([`FleetFeed::overview_json`]): at 100,000 GPUs that
//! answer is 64 MB, and a client asking in a loop would otherwise cost a
//! store read and the encoding each time.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, OnceCell, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::AppState;
use super::auth::Identity;
use super::device_summary::{DeviceAlerts, Owner, alerts_by_device, owners_by_device};
use super::fleet_summary::{FULLEST_DEFAULT, FleetSummary, SummaryMade};
use super::node_rows::{FleetByNode, NodeRow};
use crate::metrics::{CollectorMetrics, HttpRefusal};
use headroom_common::Clock;
use headroom_store::alerts::{ActiveAlertCounts, AlertFilter};
use headroom_store::{DeviceView, FleetDevices, NodeView, ProcessesOn, Store};

const PERIOD: Duration = Duration::from_secs(1);
/// `GET /api/v1/gpus` answers from a read up to this old rather than wait
/// for the next, which it starts; older than this, it waits.
const OVERVIEW_SERVED_UP_TO: Duration = Duration::from_secs(3);
/// What a client over the limit is told to wait before trying again.
const RETRY_AFTER_S: u32 = 5;

/// The fleet as read at one moment, shared by every client.
// Made once a second and only ever held in an `Arc`: the variants' sizes
// cost nothing.
#[expect(clippy::large_enum_variant)]
#[derive(Debug)]
enum Fleet {
    Read {
        nodes: Vec<NodeView>,
        /// Shared with the overview's encoding, which runs on its own
        /// thread; a device's view is made when it is sent.
        devices: FleetDevices,
        alerts: Option<ActiveAlertCounts>,
        /// Active alerts by the device they are on.
        device_alerts: BTreeMap<String, DeviceAlerts>,
        /// The owners of each device, as of `owners_read_at`: shared by
        /// reads until it is [`OWNERS_PERIOD`] old, so a client can tell
        /// an unchanged set by its pointer.
        owners: Arc<BTreeMap<String, Vec<Owner>>>,
        owners_read_at: Instant,
        /// The devices whose owners were read; `None`: every device's.
        owners_of: Option<Arc<HashSet<String>>>,
        /// `devices` as `GET /api/v1/gpus` answers, made by its first caller.
        overview_json: OnceCell<Bytes>,
        /// What `GET /api/v1/fleet` answers from, made by its first caller.
        summary: OnceCell<Arc<SummaryMade>>,
        /// The fleet by node, for clients of a fleet over
        /// `stream_devices_max`, made by the first.
        by_node: OnceCell<Arc<FleetByNode>>,
        /// The collector's clock when the read was made.
        read_at_ms: i64,
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
    clock: Clock,
    metrics: Arc<CollectorMetrics>,
    slots: Arc<Semaphore>,
    max_clients: u32,
    /// Above this many devices, a client that names no node is sent the
    /// fleet by node.
    devices_max: usize,
    /// The last read and when it finished.
    latest: std::sync::Mutex<Option<(Instant, Arc<Fleet>)>>,
    /// Held while reading, so clients that ask meanwhile wait for that read
    /// instead of starting their own.
    reading: Mutex<()>,
    /// True while a read started for the overview API runs on its own.
    refreshing: AtomicBool,
    /// The nodes clients follow (`?node=`), with how many follow each:
    /// whose owners a fleet sent by node reads.
    followed: std::sync::Mutex<HashMap<String, usize>>,
}

impl FleetFeed {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Clock,
        max_clients: u32,
        devices_max: u32,
        metrics: Arc<CollectorMetrics>,
    ) -> Self {
        Self {
            store,
            clock,
            metrics,
            slots: Arc::new(Semaphore::new(max_clients.max(1) as usize)),
            max_clients,
            devices_max: devices_max as usize,
            latest: std::sync::Mutex::new(None),
            reading: Mutex::new(()),
            refreshing: AtomicBool::new(false),
            followed: std::sync::Mutex::new(HashMap::new()),
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

    /// The last read, if it finished less than `age` ago.
    fn read_within(&self, age: Duration) -> Option<Arc<Fleet>> {
        let latest = self.latest.lock().ok()?;
        let (at, fleet) = latest.as_ref()?;
        (at.elapsed() < age).then(|| fleet.clone())
    }

    /// The fleet as of at most a period ago.
    async fn current(&self) -> Arc<Fleet> {
        if let Some(fleet) = self.read_within(PERIOD) {
            return fleet;
        }
        let _turn = self.reading.lock().await;
        if let Some(fleet) = self.read_within(PERIOD) {
            return fleet;
        }
        self.metrics.http_stream_read();
        let previous = self
            .latest
            .lock()
            .ok()
            .and_then(|latest| latest.as_ref().map(|(_, fleet)| fleet.clone()));
        let fleet = Arc::new(self.read(previous.as_deref()).await);
        if let Ok(mut latest) = self.latest.lock() {
            *latest = Some((Instant::now(), fleet.clone()));
        }
        fleet
    }

    /// The fleet for the overview API: the last read while it is at most
    /// [`OVERVIEW_SERVED_UP_TO`] old (starting the next one when it is over
    /// a period old), so a caller waits for a read only when none is recent.
    /// What it answers is never more than that old, and at fleet scale its
    /// time does not grow with a store read.
    async fn recent(self: &Arc<Self>, answer: Answer) -> Arc<Fleet> {
        if let Some(fleet) = self.read_within(PERIOD) {
            return fleet;
        }
        let Some(fleet) = self.read_within(OVERVIEW_SERVED_UP_TO) else {
            return self.current().await;
        };
        if !self.refreshing.swap(true, Ordering::AcqRel) {
            let feed = self.clone();
            tokio::spawn(async move {
                // The answer too, so no caller waits for its making either.
                let fleet = feed.current().await;
                match answer {
                    Answer::Devices => {
                        overview_json_of(fleet).await;
                    }
                    Answer::Summary => {
                        summary_of(fleet).await;
                    }
                    Answer::Picked => {}
                }
                feed.refreshing.store(false, Ordering::Release);
            });
        }
        fleet
    }

    /// `GET /api/v1/gpus`'s body: every device with its newest sample, as
    /// JSON; `None` while the store cannot answer.
    pub async fn overview_json(self: &Arc<Self>) -> Option<Bytes> {
        overview_json_of(self.recent(Answer::Devices).await).await
    }

    /// `GET /api/v1/gpus?node=` and `?uuid=`: the devices picked from the
    /// same read as the whole list, in the overview's order; `None` while
    /// the store cannot answer.
    pub async fn devices_picked(self: &Arc<Self>, pick: &DevicePick) -> Option<Vec<DeviceView>> {
        let fleet = self.recent(Answer::Picked).await;
        let Fleet::Read { devices, .. } = fleet.as_ref() else {
            return None;
        };
        let views = |slots: Vec<usize>| slots.into_iter().filter_map(|s| devices.view(s));
        Some(match pick {
            DevicePick::Node(node) => views(devices.slots_of_node(node)).collect(),
            DevicePick::Gpu(uuid) => {
                let Some(device) = devices
                    .stamps()
                    .position(|(u, _)| **u == **uuid)
                    .and_then(|slot| devices.view(slot))
                else {
                    return Some(Vec::new());
                };
                // A GPU's instances are on its node.
                let gpu = device.parent_uuid.clone().unwrap_or(device.uuid.clone());
                views(devices.slots_of_node(&device.node))
                    .filter(|d| d.uuid == gpu || d.parent_uuid.as_ref() == Some(&gpu))
                    .collect()
            }
        })
    }

    /// `GET /api/v1/fleet`'s body: the fleet summed, by node, and its
    /// `fullest` devices, as JSON; `None` while the store cannot answer.
    pub async fn summary_json(self: &Arc<Self>, fullest: usize) -> Option<Bytes> {
        let fleet = self.recent(Answer::Summary).await;
        let made = summary_of(fleet.clone()).await?;
        if fullest == FULLEST_DEFAULT {
            return Some(made.default_json.clone());
        }
        // Another count is encoded for its caller, off the runtime's
        // workers: every node's entry is in it (2.5 MB at 12,500 nodes).
        let encoded = off_workers(move || {
            let Fleet::Read { alerts, .. } = fleet.as_ref() else {
                return Err("the store could not answer".to_owned());
            };
            made.summary
                .to_json(alerts.as_ref(), fullest)
                .map_err(|e| e.to_string())
        })
        .await;
        match encoded {
            Ok(json) => Some(Bytes::from(json)),
            Err(error) => {
                tracing::error!(%error, "could not encode the fleet summary");
                None
            }
        }
    }

    async fn read(&self, previous: Option<&Fleet>) -> Fleet {
        match (self.store.nodes().await, self.store.latest_devices().await) {
            (Ok(nodes), Ok(devices)) => {
                let device_alerts = self
                    .store
                    .alerts(AlertFilter::Active, MAX_ACTIVE_ALERTS)
                    .await
                    .map(|alerts| alerts_by_device(&alerts))
                    .unwrap_or_default();
                let read_at_ms = self.clock.now_ms();
                let by_node = OnceCell::new();
                let ((owners, owners_read_at), owners_of) = if devices.len() > self.devices_max {
                    // No client is sent every device: the rows are made
                    // now, and the owners read are those of the devices
                    // sent, a few hundred rather than the fleet's.
                    let (made, owners, of) = self
                        .owners_sent_by_node(previous, &nodes, &devices, &device_alerts, read_at_ms)
                        .await;
                    if let Some(made) = made {
                        let _ = by_node.set(made);
                    }
                    (owners, Some(of))
                } else {
                    (self.owners(previous, &devices).await, None)
                };
                Fleet::Read {
                    alerts: self.store.active_alert_counts().await.ok(),
                    device_alerts,
                    nodes,
                    devices,
                    owners,
                    owners_read_at,
                    owners_of,
                    overview_json: OnceCell::new(),
                    summary: OnceCell::new(),
                    by_node,
                    read_at_ms,
                }
            }
            (Err(error), _) | (_, Err(error)) => {
                tracing::debug!(%error, "fleet stream: store unavailable");
                Fleet::Unavailable
            }
        }
    }

    /// A fleet sent by node: its rows (made off the runtime's workers) and
    /// the owners of the devices its clients are sent, the rows' devices
    /// at risk and the devices of the nodes followed. The owners are read
    /// again every [`OWNERS_PERIOD`]; meanwhile only those of a device not
    /// read before are, at once.
    async fn owners_sent_by_node(
        &self,
        previous: Option<&Fleet>,
        nodes: &[NodeView],
        devices: &FleetDevices,
        device_alerts: &BTreeMap<String, DeviceAlerts>,
        read_at_ms: i64,
    ) -> (
        Option<Arc<FleetByNode>>,
        (Arc<BTreeMap<String, Vec<Owner>>>, Instant),
        Arc<HashSet<String>>,
    ) {
        let (nodes_now, devices_now, alerts_now) =
            (nodes.to_vec(), devices.clone(), device_alerts.clone());
        let made = off_workers(move || {
            Ok(Arc::new(FleetByNode::of(
                &nodes_now,
                &devices_now,
                &alerts_now,
                read_at_ms,
            )))
        })
        .await
        .inspect_err(|error| tracing::error!(%error, "could not sum the fleet by node"))
        .ok();
        let mut uuids: HashSet<String> = made
            .iter()
            .flat_map(|m| m.at_risk.iter().map(|d| d.uuid.to_string()))
            .collect();
        // A GPU's owners are its instances' too.
        let instances: Vec<String> = devices
            .mig_parents()
            .filter(|(_, parent)| uuids.contains(*parent))
            .map(|(instance, _)| instance.to_owned())
            .collect();
        uuids.extend(instances);
        if let Ok(followed) = self.followed.lock()
            && !followed.is_empty()
        {
            for slot in devices.slots_on_nodes(|node| followed.contains_key(node)) {
                uuids.extend(devices.stamp(slot).map(|(uuid, _)| uuid.to_string()));
            }
        }
        // Within the period, only the devices not read before are read,
        // and laid over the owners already read.
        let kept = match previous {
            Some(Fleet::Read {
                owners,
                owners_read_at,
                owners_of: Some(read_for),
                ..
            }) if owners_read_at.elapsed() < OWNERS_PERIOD => {
                Some((owners.clone(), *owners_read_at, read_for.clone()))
            }
            _ => None,
        };
        let missing: Vec<String> = match &kept {
            Some((_, _, read_for)) => uuids.difference(read_for).cloned().collect(),
            None => uuids.iter().cloned().collect(),
        };
        if let Some((owners, at, read_for)) = &kept
            && missing.is_empty()
        {
            return (made, (owners.clone(), *at), read_for.clone());
        }
        let read = self
            .store
            .processes(
                self.clock.now_ms() - OWNER_WINDOW_MS,
                ProcessesOn::Devices(&missing),
            )
            .await;
        let processes = match read {
            Ok(processes) => processes,
            Err(error) => {
                // The owners already read stay, and are read again at the
                // next read of the fleet.
                tracing::debug!(%error, "fleet stream: processes unavailable");
                return match kept {
                    Some((owners, at, read_for)) => (made, (owners, at), read_for),
                    None => (made, (Arc::default(), Instant::now()), Arc::default()),
                };
            }
        };
        let read_now = owners_by_device(&processes, devices);
        match kept {
            Some((owners, at, read_for)) => {
                // Only the devices read now: a GPU read before keeps the
                // owners its instances gave it then.
                let mut merged = (*owners).clone();
                merged.extend(
                    read_now
                        .into_iter()
                        .filter(|(uuid, _)| missing.contains(uuid)),
                );
                let mut read_for = (*read_for).clone();
                read_for.extend(missing);
                (made, (Arc::new(merged), at), Arc::new(read_for))
            }
            None => (made, (Arc::new(read_now), Instant::now()), Arc::new(uuids)),
        }
    }

    /// The previous read's owners while they are fresh, else a new read;
    /// a store that cannot list processes keeps the previous owners.
    async fn owners(
        &self,
        previous: Option<&Fleet>,
        devices: &FleetDevices,
    ) -> (Arc<BTreeMap<String, Vec<Owner>>>, Instant) {
        // Owners read for a fleet sent by node are only some devices'.
        let kept = match previous {
            Some(Fleet::Read {
                owners,
                owners_read_at,
                owners_of: None,
                ..
            }) => Some((owners.clone(), *owners_read_at)),
            _ => None,
        };
        if let Some((owners, at)) = &kept
            && at.elapsed() < OWNERS_PERIOD
        {
            return (owners.clone(), *at);
        }
        match self
            .store
            .processes(self.clock.now_ms() - OWNER_WINDOW_MS, ProcessesOn::Fleet)
            .await
        {
            Ok(processes) => (
                Arc::new(owners_by_device(&processes, devices)),
                Instant::now(),
            ),
            Err(error) => {
                tracing::debug!(%error, "fleet stream: processes unavailable");
                kept.unwrap_or_else(|| (Arc::default(), Instant::now()))
            }
        }
    }
}

/// `fleet`'s devices as `GET /api/v1/gpus` answers, encoded by the first
/// caller and shared by the rest. The encoding runs off the runtime's
/// workers: at 100,000 GPUs it is 64 MB and about 100 ms of CPU, which
/// would stall every other request on its worker meanwhile.
async fn overview_json_of(fleet: Arc<Fleet>) -> Option<Bytes> {
    made_once(
        fleet,
        |fleet| match fleet {
            Fleet::Read { overview_json, .. } => Some(overview_json),
            Fleet::Unavailable => None,
        },
        |fleet| match fleet {
            Fleet::Read { devices, .. } => serde_json::to_vec(devices)
                .map(Bytes::from)
                .map_err(|e| e.to_string()),
            Fleet::Unavailable => Err(STORE_UNAVAILABLE.to_owned()),
        },
        "the fleet overview",
    )
    .await
}

/// What `cell` holds in a read, made by `make` the first time it is asked
/// for, off the runtime's workers (at 100,000 GPUs each makes every
/// device's view, or 64 MB of JSON), and shared by the rest; `None` when
/// the store could not answer or the making failed (logged as `what`).
async fn made_once<T: Clone + Send + Sync + 'static>(
    fleet: Arc<Fleet>,
    cell: fn(&Fleet) -> Option<&OnceCell<T>>,
    make: fn(&Fleet) -> Result<T, String>,
    what: &'static str,
) -> Option<T> {
    let made = cell(&fleet)?
        .get_or_try_init(|| {
            let fleet = fleet.clone();
            off_workers(move || make(&fleet))
        })
        .await;
    match made {
        Ok(made) => Some(made.clone()),
        Err(error) => {
            tracing::error!(%error, "could not make {what}");
            None
        }
    }
}

/// Why a read's answer could not be made.
const STORE_UNAVAILABLE: &str = "the store could not answer";

/// Runs `make` off the runtime's workers, where a fleet-sized encoding
/// would stall every other request on its worker; a panic in it comes back
/// as an error, as its own errors do.
async fn off_workers<T: Send + 'static>(
    make: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(make)
        .await
        .map_err(|e| e.to_string())?
}

/// What an overview caller asks for, made ahead by the read it starts.
#[derive(Debug, Clone, Copy)]
enum Answer {
    /// `GET /api/v1/gpus`.
    Devices,
    /// `GET /api/v1/fleet`.
    Summary,
    /// `GET /api/v1/gpus?node=` or `?uuid=`: nothing to make ahead.
    Picked,
}

/// Which devices `GET /api/v1/gpus` lists when asked for some.
#[derive(Debug)]
pub enum DevicePick {
    /// A node's.
    Node(String),
    /// A device, its GPU and the GPU's MIG instances.
    Gpu(String),
}

/// `fleet` summed for `GET /api/v1/fleet`, and its answer with the default
/// number of fullest devices, made by the first caller off the runtime's
/// workers (at 100,000 GPUs it makes every device's view, some 10 ms) and
/// shared by the rest.
async fn summary_of(fleet: Arc<Fleet>) -> Option<Arc<SummaryMade>> {
    made_once(
        fleet,
        |fleet| match fleet {
            Fleet::Read { summary, .. } => Some(summary),
            Fleet::Unavailable => None,
        },
        |fleet| {
            let Fleet::Read {
                nodes,
                devices,
                alerts,
                ..
            } = fleet
            else {
                return Err(STORE_UNAVAILABLE.to_owned());
            };
            let summary = FleetSummary::of(nodes, devices);
            let default_json = summary
                .to_json(alerts.as_ref(), FULLEST_DEFAULT)
                .map_err(|e| e.to_string())?;
            Ok(Arc::new(SummaryMade {
                summary,
                default_json: Bytes::from(default_json),
            }))
        },
        "the fleet's summary",
    )
    .await
}

/// `fleet` by node, made by its first client in that scope off the
/// runtime's workers (at 100,000 GPUs it makes every device's view) and
/// shared by the rest.
async fn by_node_of(fleet: Arc<Fleet>) -> Option<Arc<FleetByNode>> {
    made_once(
        fleet,
        |fleet| match fleet {
            Fleet::Read { by_node, .. } => Some(by_node),
            Fleet::Unavailable => None,
        },
        |fleet| match fleet {
            Fleet::Read {
                nodes,
                devices,
                device_alerts,
                read_at_ms,
                ..
            } => Ok(Arc::new(FleetByNode::of(
                nodes,
                devices,
                device_alerts,
                *read_at_ms,
            ))),
            Fleet::Unavailable => Err(STORE_UNAVAILABLE.to_owned()),
        },
        "the fleet by node",
    )
    .await
}

/// Active alerts read for the tiles and the at-risk list, at most; past
/// it the rest show their memory level only (the alert counts stay exact).
const MAX_ACTIVE_ALERTS: i64 = 10_000;

/// How often the owners of each device are read: they change when a job
/// starts or ends, not every second, and the read costs one row per
/// process in the fleet.
const OWNERS_PERIOD: Duration = Duration::from_secs(5);

/// A process counts as a device's owner when it was seen this recently
/// (as in `/api/v1/processes`).
const OWNER_WINDOW_MS: i64 = 30_000;

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

/// A client's follow of one node, counted while its stream lasts: the
/// owners read for a fleet sent by node include that node's devices'.
struct NodeFollow {
    feed: Arc<FleetFeed>,
    node: String,
}

impl NodeFollow {
    fn new(feed: Arc<FleetFeed>, node: String) -> Self {
        if let Ok(mut followed) = feed.followed.lock() {
            *followed.entry(node.clone()).or_default() += 1;
        }
        Self { feed, node }
    }
}

impl Drop for NodeFollow {
    fn drop(&mut self) {
        if let Ok(mut followed) = self.feed.followed.lock()
            && let Some(count) = followed.get_mut(&self.node)
        {
            *count -= 1;
            if *count == 0 {
                followed.remove(&self.node);
            }
        }
    }
}

/// What a client is sent: chosen by what it asked for and the fleet's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Scope {
    /// Every device, one by one.
    Devices,
    /// The devices of the node the client named.
    Node,
    /// A row per node and the devices at risk: a fleet over
    /// `stream_devices_max`, to a client that named no node.
    Nodes,
}

#[derive(Serialize)]
struct FleetMessage<'a> {
    scope: Scope,
    /// Every node; the one named in the `node` scope.
    nodes: &'a [NodeView],
    gpus: Vec<DeviceView>,
    removed: Vec<&'a str>,
    alerts: Option<ActiveAlertCounts>,
    /// Every device in scope with an active alert, in every message: the
    /// set is small and a resolved alert is its absence.
    device_alerts: BTreeMap<&'a str, &'a DeviceAlerts>,
    /// Owners of the devices whose owners changed since the last message
    /// (all of them in the snapshot); an empty list: no owner any more.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    owners: BTreeMap<String, &'a [Owner]>,
}

/// The `nodes` scope's message.
#[derive(Serialize)]
struct ByNodeMessage<'a> {
    scope: Scope,
    /// GPUs and MIG instances in the fleet.
    devices: usize,
    /// The rows that changed since the last message (all in the snapshot).
    node_rows: Vec<&'a NodeRow>,
    removed_nodes: Vec<&'a str>,
    /// The devices at risk whose view, alerts or owners changed since the
    /// last message (all in the snapshot): the at-risk list is made from
    /// them, with their alerts and owners.
    gpus: Vec<&'a DeviceView>,
    /// Devices no longer at risk.
    removed: Vec<&'a str>,
    alerts: Option<ActiveAlertCounts>,
    /// Of the devices in `gpus`: one without an entry has no alert, or
    /// no owner.
    device_alerts: BTreeMap<&'a str, &'a DeviceAlerts>,
    owners: BTreeMap<&'a str, &'a [Owner]>,
}

/// A device at risk as a client of the `nodes` scope was last sent it.
type AtRiskSent = (DeviceView, Option<DeviceAlerts>, Vec<Owner>);

#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    /// Follow this node's devices alone, whatever the fleet's size.
    node: Option<String>,
}

struct Follower {
    state: AppState,
    _seat: Seat,
    /// The token the stream was opened with, checked on every event: a
    /// revoked token ends the stream instead of following the fleet forever.
    token_sha256: Option<String>,
    /// The node the client asked to follow, if any.
    node: Option<String>,
    _follow: Option<NodeFollow>,
    /// The scope of the last message; a message in another starts anew
    /// with a snapshot.
    sent_scope: Option<Scope>,
    /// The read this client was last sent, in the `devices` and `node`
    /// scopes.
    sent: Option<FleetDevices>,
    /// In the `node` scope, the slots of that node's devices in `sent`.
    sent_slots: Vec<usize>,
    /// The owners this client was last sent.
    sent_owners: Option<Arc<BTreeMap<String, Vec<Owner>>>>,
    /// The rows this client was last sent, in the `nodes` scope.
    sent_by_node: Option<Arc<FleetByNode>>,
    /// The devices at risk this client was last sent, in the `nodes` scope.
    sent_at_risk: HashMap<Arc<str>, AtRiskSent>,
    /// False until the first event went out: only that one is not paced.
    started: bool,
}

fn unavailable() -> Event {
    // Named, so the page can say its figures are stale.
    Event::default()
        .event("unavailable")
        .data("the collector cannot read its store; retrying")
}

fn event_of(kind: &str, message: &impl Serialize) -> Event {
    Event::default()
        .event(kind)
        .json_data(message)
        .unwrap_or_else(|_| Event::default().comment("encoding failed"))
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
        let Fleet::Read { devices, .. } = fleet.as_ref() else {
            return unavailable();
        };
        // Back to every device only well below the limit, so that a fleet
        // at the limit does not send every client a snapshot each second.
        let max = self.state.fleet.devices_max;
        let by_node = devices.len() > max
            || (self.sent_scope == Some(Scope::Nodes) && devices.len() > max - max / 10);
        let scope = match &self.node {
            Some(_) => Scope::Node,
            None if by_node => Scope::Nodes,
            None => Scope::Devices,
        };
        if self.sent_scope != Some(scope) {
            // Until a message of the new scope goes out, the next is its
            // snapshot, whatever this one's fate.
            self.sent_scope = None;
            self.sent = None;
            self.sent_slots.clear();
            self.sent_owners = None;
            self.sent_by_node = None;
            self.sent_at_risk.clear();
        }
        let kind = if self.sent_scope == Some(scope) {
            "update"
        } else {
            "snapshot"
        };
        let event = match scope {
            Scope::Nodes => {
                let Some(by_node) = by_node_of(fleet.clone()).await else {
                    return unavailable();
                };
                let event = by_node_event(
                    kind,
                    &fleet,
                    &by_node,
                    self.sent_by_node.as_deref(),
                    &mut self.sent_at_risk,
                );
                self.sent_by_node = Some(by_node);
                event
            }
            Scope::Devices => self.devices_event(kind, &fleet),
            Scope::Node => self.node_event(kind, &fleet),
        };
        self.sent_scope = Some(scope);
        event
    }

    fn devices_event(&mut self, kind: &str, fleet: &Fleet) -> Event {
        let Fleet::Read {
            nodes,
            devices,
            alerts,
            device_alerts,
            owners,
            ..
        } = fleet
        else {
            return unavailable();
        };
        let (changed, removed) = devices_changed(self.sent.as_ref(), devices);
        let event = event_of(
            kind,
            &FleetMessage {
                scope: Scope::Devices,
                nodes,
                gpus: changed,
                removed,
                alerts: *alerts,
                device_alerts: device_alerts.iter().map(|(k, v)| (k.as_str(), v)).collect(),
                owners: owners_changed(self.sent_owners.as_deref(), owners),
            },
        );
        self.sent = Some(devices.clone());
        self.sent_owners = Some(owners.clone());
        event
    }

    fn node_event(&mut self, kind: &str, fleet: &Fleet) -> Event {
        let Fleet::Read {
            nodes,
            devices,
            alerts,
            device_alerts,
            owners,
            owners_of,
            ..
        } = fleet
        else {
            return unavailable();
        };
        let name = self.node.as_deref().unwrap_or_default();
        let same_layout = self
            .sent
            .as_ref()
            .is_some_and(|sent| sent.same_layout(devices));
        let slots = if same_layout {
            self.sent_slots.clone()
        } else {
            devices.slots_of_node(name)
        };
        let uuids: HashSet<&str> = slots
            .iter()
            .filter_map(|&slot| devices.stamp(slot))
            .map(|(uuid, _)| &**uuid)
            .collect();
        let (changed, removed) = node_devices_changed(
            self.sent.as_ref().map(|s| (s, &self.sent_slots[..])),
            devices,
            &slots,
        );
        let owners_sent: BTreeMap<String, &[Owner]> = if same_layout {
            let mut changed = owners_changed(self.sent_owners.as_deref(), owners);
            changed.retain(|uuid, _| uuids.contains(uuid.as_str()));
            changed
        } else {
            // The node's devices may be new to the client while their
            // owners are not new to the read: every one of them, then,
            // whose owners the read holds (a read made before the client
            // came may not have read its node's).
            uuids
                .iter()
                .filter(|&&uuid| owners_of.as_ref().is_none_or(|of| of.contains(uuid)))
                .map(|&uuid| {
                    let held = owners.get(uuid).map_or(&[][..], Vec::as_slice);
                    (uuid.to_owned(), held)
                })
                .collect()
        };
        let node = nodes.iter().position(|n| n.name == name);
        let event = event_of(
            kind,
            &FleetMessage {
                scope: Scope::Node,
                nodes: node.map_or(&[][..], |i| &nodes[i..=i]),
                gpus: changed,
                removed,
                alerts: *alerts,
                device_alerts: device_alerts
                    .iter()
                    .filter(|(uuid, _)| uuids.contains(uuid.as_str()))
                    .map(|(k, v)| (k.as_str(), v))
                    .collect(),
                owners: owners_sent,
            },
        );
        self.sent = Some(devices.clone());
        self.sent_slots = slots;
        self.sent_owners = Some(owners.clone());
        event
    }
}

/// The `nodes` scope's event: the rows that changed since `sent`, and the
/// devices at risk whose view, alerts or owners changed since
/// `sent_at_risk` (what the client holds, brought up to date here), or
/// that are no longer at risk. With 200 devices alerting at 100,000 GPUs,
/// sending them whole every second took 163 kB a second per page; only the
/// changed ones, 50 kB.
fn by_node_event(
    kind: &str,
    fleet: &Fleet,
    by_node: &FleetByNode,
    sent: Option<&FleetByNode>,
    sent_at_risk: &mut HashMap<Arc<str>, AtRiskSent>,
) -> Event {
    let Fleet::Read {
        alerts,
        device_alerts,
        owners,
        ..
    } = fleet
    else {
        return unavailable();
    };
    let (node_rows, removed_nodes) = by_node.changed_since(sent);
    let (gpus, removed, now_at_risk) =
        at_risk_changed(sent_at_risk, &by_node.at_risk, device_alerts, owners);
    let event = event_of(
        kind,
        &ByNodeMessage {
            scope: Scope::Nodes,
            devices: by_node.devices,
            node_rows,
            removed_nodes,
            alerts: *alerts,
            device_alerts: gpus
                .iter()
                .filter_map(|d| device_alerts.get_key_value(&*d.uuid))
                .map(|(k, v)| (k.as_str(), v))
                .collect(),
            owners: gpus
                .iter()
                .filter_map(|d| owners.get_key_value(&*d.uuid))
                .map(|(k, v)| (k.as_str(), v.as_slice()))
                .collect(),
            gpus,
            removed,
        },
    );
    *sent_at_risk = now_at_risk;
    event
}

/// Of the devices `at_risk` now, with their alerts and owners, those not
/// as the client was `sent` them, and the uuids of those sent that are no
/// longer at risk; with what the client holds once sent those.
fn at_risk_changed<'a>(
    sent: &'a HashMap<Arc<str>, AtRiskSent>,
    at_risk: &'a [DeviceView],
    device_alerts: &BTreeMap<String, DeviceAlerts>,
    owners: &BTreeMap<String, Vec<Owner>>,
) -> (
    Vec<&'a DeviceView>,
    Vec<&'a str>,
    HashMap<Arc<str>, AtRiskSent>,
) {
    let mut changed = Vec::new();
    let mut now = HashMap::with_capacity(at_risk.len());
    for device in at_risk {
        let entry: AtRiskSent = (
            device.clone(),
            device_alerts.get(&*device.uuid).cloned(),
            owners.get(&*device.uuid).cloned().unwrap_or_default(),
        );
        if sent.get(&device.uuid) != Some(&entry) {
            changed.push(device);
        }
        now.insert(device.uuid.clone(), entry);
    }
    let mut removed: Vec<&str> = sent
        .keys()
        .filter(|uuid| !now.contains_key(*uuid))
        .map(|uuid| &**uuid)
        .collect();
    removed.sort_unstable();
    (changed, removed, now)
}

/// The views of one node's devices (in `slots` of `now`) whose newest
/// sample differs from what the client was `sent` (the read and that
/// node's slots in it), and the uuids of those that went.
fn node_devices_changed<'a>(
    sent: Option<(&'a FleetDevices, &[usize])>,
    now: &FleetDevices,
    slots: &[usize],
) -> (Vec<DeviceView>, Vec<&'a str>) {
    let Some((sent, sent_slots)) = sent else {
        return (
            slots.iter().filter_map(|&s| now.view(s)).collect(),
            Vec::new(),
        );
    };
    if now.same_layout(sent) {
        let changed = slots
            .iter()
            .filter(|&&slot| now.stamp(slot).map(|(_, t)| t) != sent.stamp(slot).map(|(_, t)| t))
            .filter_map(|&slot| now.view(slot))
            .collect();
        return (changed, Vec::new());
    }
    let before: HashMap<&str, Option<i64>> = sent_slots
        .iter()
        .filter_map(|&slot| sent.stamp(slot))
        .map(|(uuid, stamp)| (&**uuid, stamp))
        .collect();
    let mut present: HashSet<&str> = HashSet::new();
    let mut changed = Vec::new();
    for &slot in slots {
        let Some((uuid, stamp)) = now.stamp(slot) else {
            continue;
        };
        present.insert(uuid);
        if before.get(&**uuid) != Some(&stamp) {
            changed.extend(now.view(slot));
        }
    }
    let removed = before
        .keys()
        .copied()
        .filter(|uuid| !present.contains(uuid))
        .collect();
    (changed, removed)
}

/// The views of the devices whose newest sample differs from what the
/// client was `sent` (every device when it was sent none), and the uuids
/// of those that went. Views are made for the devices sent, not for the
/// fleet; while the layout is the one the client was sent, devices are
/// compared slot by slot, so a steady second costs no map of the fleet per
/// client.
fn devices_changed<'a>(
    sent: Option<&'a FleetDevices>,
    now: &FleetDevices,
) -> (Vec<DeviceView>, Vec<&'a str>) {
    let Some(sent) = sent else {
        return (now.views().collect(), Vec::new());
    };
    if now.same_layout(sent) {
        let changed = now
            .stamps()
            .zip(sent.stamps())
            .enumerate()
            .filter(|(_, ((_, stamp), (_, sent_stamp)))| stamp != sent_stamp)
            .filter_map(|(slot, _)| now.view(slot))
            .collect();
        return (changed, Vec::new());
    }
    let sent_stamps: HashMap<&str, Option<i64>> = sent
        .stamps()
        .map(|(uuid, stamp)| (&**uuid, stamp))
        .collect();
    let changed = now
        .stamps()
        .enumerate()
        .filter(|(_, (uuid, stamp))| sent_stamps.get(&***uuid) != Some(stamp))
        .filter_map(|(slot, _)| now.view(slot))
        .collect();
    let present: HashSet<&str> = now.stamps().map(|(uuid, _)| &**uuid).collect();
    let removed = sent
        .stamps()
        .map(|(uuid, _)| &**uuid)
        .filter(|uuid| !present.contains(uuid))
        .collect();
    (changed, removed)
}

/// The owners that differ from what the client was sent (every one when
/// it was sent none); a device that lost its owners maps to an empty list.
fn owners_changed<'a>(
    sent: Option<&BTreeMap<String, Vec<Owner>>>,
    now: &'a BTreeMap<String, Vec<Owner>>,
) -> BTreeMap<String, &'a [Owner]> {
    let Some(sent) = sent else {
        return now.iter().map(|(k, v)| (k.clone(), v.as_slice())).collect();
    };
    if std::ptr::eq(sent, now) {
        return BTreeMap::new();
    }
    let mut changed: BTreeMap<String, &[Owner]> = now
        .iter()
        .filter(|(uuid, owners)| sent.get(uuid.as_str()) != Some(owners))
        .map(|(k, v)| (k.clone(), v.as_slice()))
        .collect();
    for uuid in sent.keys().filter(|uuid| !now.contains_key(uuid.as_str())) {
        changed.insert(uuid.clone(), &[]);
    }
    changed
}

pub async fn fleet(
    State(state): State<AppState>,
    identity: Option<Extension<Identity>>,
    query: Result<Query<StreamQuery>, QueryRejection>,
) -> Response {
    let node = match query {
        Ok(Query(query)) => query.node.filter(|node| !node.is_empty()),
        Err(rejection) => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(serde_json::json!({ "error": format!(
                    "/api/v1/stream takes ?node=NAME or nothing: {}", rejection.body_text()
                ) })),
            )
                .into_response();
        }
    };
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
    let follow = node
        .clone()
        .map(|node| NodeFollow::new(state.fleet.clone(), node));
    let follower = Follower {
        state,
        _seat: seat,
        token_sha256: identity.and_then(|Extension(i)| i.token_sha256),
        _follow: follow,
        node,
        sent_scope: None,
        sent: None,
        sent_slots: Vec::new(),
        sent_owners: None,
        sent_by_node: None,
        sent_at_risk: HashMap::new(),
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

    fn owner(user: &str, memory_bytes: i64) -> Owner {
        Owner {
            user: user.to_owned(),
            slurm_job_id: String::new(),
            pod_uid: String::new(),
            memory_bytes,
        }
    }

    #[test]
    fn a_client_of_the_nodes_scope_is_sent_only_the_devices_at_risk_that_changed_or_went() {
        use super::super::test_fleet::device;
        let uuids = |devices: &[&DeviceView]| {
            devices
                .iter()
                .map(|d| d.uuid.to_string())
                .collect::<Vec<_>>()
        };
        let at_risk = vec![
            device("n1", "GPU-a", None, 80, Some((70, 75))),
            device("n1", "GPU-b", None, 80, Some((60, 60))),
            device("n2", "GPU-c", None, 80, Some((50, 50))),
        ];
        let mut alerts = BTreeMap::new();
        let mut owners: BTreeMap<String, Vec<Owner>> =
            [("GPU-a".to_owned(), vec![owner("alice", 1)])].into();
        let nothing_sent = HashMap::new();
        let (changed, removed, sent) = at_risk_changed(&nothing_sent, &at_risk, &alerts, &owners);
        assert_eq!(uuids(&changed), ["GPU-a", "GPU-b", "GPU-c"]);
        assert!(removed.is_empty());

        let (changed, removed, _) = at_risk_changed(&sent, &at_risk, &alerts, &owners);
        assert!(changed.is_empty() && removed.is_empty(), "nothing changed");

        // A new sample on one, an alert on another, a new owner on a
        // third: each is sent again.
        let mut now = at_risk.clone();
        now[0].latest.as_mut().unwrap().timestamp_ms += 1_000;
        alerts.insert(
            "GPU-b".to_owned(),
            DeviceAlerts {
                severity: Some("warning"),
                rules: vec!["watermark".to_owned()],
                ..DeviceAlerts::default()
            },
        );
        owners.insert("GPU-c".to_owned(), vec![owner("carol", 2)]);
        let (changed, removed, _) = at_risk_changed(&sent, &now, &alerts, &owners);
        assert_eq!(uuids(&changed), ["GPU-a", "GPU-b", "GPU-c"]);
        assert!(removed.is_empty());

        // One leaves the list, one loses its owner.
        let now = vec![at_risk[0].clone(), at_risk[1].clone()];
        let (changed, removed, held) =
            at_risk_changed(&sent, &now, &BTreeMap::new(), &BTreeMap::new());
        assert_eq!(uuids(&changed), ["GPU-a"], "its owner went");
        assert_eq!(removed, ["GPU-c"]);
        assert_eq!(held.len(), 2);
    }

    #[test]
    fn a_client_is_sent_only_the_owners_that_changed_and_those_that_went() {
        let before: BTreeMap<String, Vec<Owner>> = [
            ("GPU-a".to_owned(), vec![owner("alice", 1)]),
            ("GPU-b".to_owned(), vec![owner("bob", 1)]),
        ]
        .into();
        assert_eq!(owners_changed(None, &before).len(), 2);
        assert!(owners_changed(Some(&before), &before).is_empty());
        let after: BTreeMap<String, Vec<Owner>> = [
            ("GPU-a".to_owned(), vec![owner("alice", 1)]),
            ("GPU-c".to_owned(), vec![owner("carol", 1)]),
        ]
        .into();
        let changed = owners_changed(Some(&before), &after);
        assert_eq!(changed.keys().collect::<Vec<_>>(), ["GPU-b", "GPU-c"]);
        assert!(changed["GPU-b"].is_empty());
        assert_eq!(changed["GPU-c"][0].user, "carol");
    }
}
