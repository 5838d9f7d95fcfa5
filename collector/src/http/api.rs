//! JSON API handlers, `/api/v1/...`.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::fleet_summary::{FULLEST_DEFAULT, FULLEST_MAX};
use super::stream::DevicePick;
use super::text::check_id;
use headroom_store::{
    AllocatorSeries, AllocatorSeriesQuery, EventView, FleetHistoryPoint, NodeView, OwnerMatch,
    ProcessSeries, ProcessView, ProcessesOn, SeriesPoint, StoreError,
};

/// A process counts as current when it was seen this recently.
pub(super) const PROCESS_WINDOW_MS: i64 = 30_000;
const DEFAULT_RANGE_MS: i64 = 15 * 60 * 1000;
const MAX_RANGE_MS: i64 = 400 * 24 * 3600 * 1000;

#[derive(Debug)]
pub enum ApiError {
    BadRequest(String),
    NotFound(String),
    /// An extractor refused the request (bad JSON, query or path, a body
    /// over the limit) with the status it chose.
    Rejected(StatusCode, String),
    Store(StoreError),
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return Self::Rejected(status, super::errors::too_large());
        }
        Self::Rejected(status, rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        Self::Rejected(rejection.status(), rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::Rejected(rejection.status(), rejection.body_text())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

#[derive(Serialize)]
struct ErrorBody {
    error: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, error) = match self {
            Self::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            Self::NotFound(m) => (StatusCode::NOT_FOUND, m),
            Self::Rejected(status, m) => (status, m),
            Self::Store(e) => {
                tracing::error!(error = %e, "API query failed");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "storage unavailable".to_owned(),
                )
            }
        };
        (status, Json(ErrorBody { error })).into_response()
    }
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    let path: String = uri.path().chars().take(200).collect();
    ApiError::NotFound(format!("no such page or API route: {path}"))
}

pub async fn nodes(State(state): State<AppState>) -> Result<Json<Vec<NodeView>>, ApiError> {
    Ok(Json(state.store.nodes().await?))
}

#[derive(Debug, Deserialize)]
pub struct GpusQuery {
    /// That node's devices only.
    node: Option<String>,
    /// That device, its GPU and the GPU's MIG instances only.
    uuid: Option<String>,
}

/// Every device with its newest sample, from the read the live stream
/// shares (at most a few seconds old; see `stream.rs`); or one node's, or
/// one GPU's with its MIG instances, which a page about them needs
/// rather than the whole fleet's (64 MB at 100,000 GPUs).
pub async fn gpus(
    State(state): State<AppState>,
    query: Result<Query<GpusQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query?;
    let given = |value: Option<String>| value.filter(|v| !v.is_empty());
    let pick = match (given(query.node), given(query.uuid)) {
        (None, None) => None,
        (Some(node), None) => Some(DevicePick::Node(node)),
        (None, Some(uuid)) => Some(DevicePick::Gpu(uuid)),
        (Some(_), Some(_)) => {
            return Err(ApiError::BadRequest(
                "ask for a `node` or a `uuid`, not both".to_owned(),
            ));
        }
    };
    let unavailable = || {
        ApiError::Rejected(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage unavailable".to_owned(),
        )
    };
    let Some(pick) = pick else {
        let json = state.fleet.overview_json().await.ok_or_else(unavailable)?;
        return Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response());
    };
    let devices = state
        .fleet
        .devices_picked(&pick)
        .await
        .ok_or_else(unavailable)?;
    if let DevicePick::Gpu(uuid) = &pick
        && devices.is_empty()
    {
        let uuid: String = uuid.chars().take(200).collect();
        return Err(ApiError::NotFound(format!(
            "no GPU or MIG instance {uuid} in the fleet"
        )));
    }
    Ok(Json(devices).into_response())
}

#[derive(Debug, Deserialize)]
pub struct FleetQuery {
    /// How many of the fullest devices to list (1..=1000, default 100).
    fullest: Option<usize>,
}

/// The fleet summed, by node, and its fullest devices: the overview that
/// grows with the nodes rather than the devices, from the same shared read
/// as `gpus`.
pub async fn fleet(
    State(state): State<AppState>,
    query: Result<Query<FleetQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query?;
    let fullest = query.fullest.unwrap_or(FULLEST_DEFAULT);
    if !(1..=FULLEST_MAX).contains(&fullest) {
        return Err(ApiError::BadRequest(format!(
            "`fullest` ({fullest}) must be between 1 and {FULLEST_MAX}"
        )));
    }
    match state.fleet.summary_json(fullest).await {
        Some(json) => Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response()),
        None => Err(ApiError::Rejected(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage unavailable".to_owned(),
        )),
    }
}

/// Parts of the owner a process must have, each a substring (the
/// dashboard's user, job and pod filters); absent or empty, any.
#[derive(Debug, Default, Deserialize)]
pub struct OwnerQuery {
    user: Option<String>,
    slurm_job_id: Option<String>,
    pod_uid: Option<String>,
}

impl OwnerQuery {
    pub(super) fn of_slurm_job(slurm_job_id: Option<String>) -> Self {
        Self {
            slurm_job_id,
            ..Self::default()
        }
    }

    pub(super) fn owner_match(&self) -> Result<OwnerMatch<'_>, ApiError> {
        fn part<'a>(name: &str, value: &'a Option<String>) -> Result<&'a str, ApiError> {
            let value = value.as_deref().unwrap_or_default();
            if value.contains('\0') {
                return Err(ApiError::BadRequest(format!(
                    "`{name}` holds a NUL character, which no owner has"
                )));
            }
            Ok(value)
        }
        Ok(OwnerMatch {
            user: part("user", &self.user)?,
            slurm_job_id: part("slurm_job_id", &self.slurm_job_id)?,
            pod_uid: part("pod_uid", &self.pod_uid)?,
        })
    }
}

#[derive(Debug, Deserialize)]
pub struct ProcessesQuery {
    /// That node's processes only.
    node: Option<String>,
    #[serde(flatten)]
    owner: OwnerQuery,
}

/// The processes seen lately; a node's alone when asked, which a GPU's
/// page needs rather than the fleet's (200,000 at 100,000 GPUs), and only
/// those whose owner matches when the dashboard filters by one.
pub async fn processes(
    State(state): State<AppState>,
    query: Result<Query<ProcessesQuery>, QueryRejection>,
) -> Result<Json<Vec<ProcessView>>, ApiError> {
    let Query(query) = query?;
    let owner = query.owner.owner_match()?;
    let since = state.clock.now_ms() - PROCESS_WINDOW_MS;
    Ok(Json(
        match query.node.as_deref().filter(|n| !n.is_empty()) {
            // A node's processes are few: matched here.
            Some(node) => {
                let mut processes = state
                    .store
                    .processes(since, ProcessesOn::Node(node))
                    .await?;
                processes.retain(|p| owner.matches(p));
                processes
            }
            None => state.store.processes(since, fleet_or_owners(owner)).await?,
        },
    ))
}

/// Every process, or those whose owner matches when a part is asked for.
pub(super) fn fleet_or_owners(owner: OwnerMatch<'_>) -> ProcessesOn<'_> {
    if owner.is_any() {
        ProcessesOn::Fleet
    } else {
        ProcessesOn::Owners(owner)
    }
}

#[derive(Debug, Deserialize)]
pub struct SeriesQuery {
    /// Epoch milliseconds; default `to` − 15 minutes.
    from: Option<i64>,
    /// Epoch milliseconds; default now.
    to: Option<i64>,
    /// At most this many points (1..=10000, default 1000).
    max_points: Option<u32>,
}

impl SeriesQuery {
    /// `(from, to, max_points)` with the defaults filled in and the limits
    /// checked.
    fn resolve(&self, now_ms: i64) -> Result<(i64, i64, u32), ApiError> {
        let to = self.to.unwrap_or(now_ms);
        let from = self.from.unwrap_or(to.saturating_sub(DEFAULT_RANGE_MS));
        if from >= to {
            return Err(ApiError::BadRequest(format!(
                "`from` ({from}) must be before `to` ({to})"
            )));
        }
        match to.checked_sub(from) {
            Some(span) if span <= MAX_RANGE_MS => {}
            _ => {
                return Err(ApiError::BadRequest(format!(
                    "range from {from} to {to} is longer than the 400-day limit"
                )));
            }
        }
        let max_points = self.max_points.unwrap_or(1000);
        if !(1..=10_000).contains(&max_points) {
            return Err(ApiError::BadRequest(format!(
                "`max_points` = {max_points} is outside 1..=10000"
            )));
        }
        Ok((from, to, max_points))
    }
}

#[derive(Debug, Serialize)]
pub struct SeriesResponse {
    uuid: String,
    from: i64,
    to: i64,
    points: Vec<SeriesPoint>,
}

pub async fn series(
    State(state): State<AppState>,
    Path(uuid): Path<String>,
    query: Result<Query<SeriesQuery>, QueryRejection>,
) -> Result<Json<SeriesResponse>, ApiError> {
    check_id("uuid", &uuid)?;
    let Query(q) = query?;
    let (from, to, max_points) = q.resolve(state.clock.now_ms())?;
    match state
        .store
        .device_series(&uuid, from, to, max_points)
        .await?
    {
        Some(points) => Ok(Json(SeriesResponse {
            uuid,
            from,
            to,
            points,
        })),
        None => Err(ApiError::NotFound(format!(
            "no GPU or MIG instance {uuid:?}"
        ))),
    }
}

#[derive(Debug, Serialize)]
pub struct FleetHistoryResponse {
    from: i64,
    to: i64,
    points: Vec<FleetHistoryPoint>,
}

/// The whole fleet's memory against its capacity, GPUs low on headroom and
/// alerts fired over a range, from the fleet rollups (the newest two to
/// three minutes are not rolled up yet).
pub async fn fleet_history(
    State(state): State<AppState>,
    query: Result<Query<SeriesQuery>, QueryRejection>,
) -> Result<Json<FleetHistoryResponse>, ApiError> {
    let Query(q) = query?;
    let (from, to, max_points) = q.resolve(state.clock.now_ms())?;
    let points = state.store.fleet_history(from, to, max_points).await?;
    Ok(Json(FleetHistoryResponse { from, to, points }))
}

/// The fields of [`SeriesQuery`] plus the process incarnation (not
/// flattened: serde's flatten cannot read numbers from a query string).
#[derive(Debug, Deserialize)]
pub struct AllocatorQuery {
    from: Option<i64>,
    to: Option<i64>,
    max_points: Option<u32>,
    /// Which incarnation of the pid (its start time); the newest by default.
    start_time_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
pub struct AllocatorResponse {
    from: i64,
    to: i64,
    #[serde(flatten)]
    series: AllocatorSeries,
}

/// What a process's own allocator reported over time: allocated against
/// reserved, fragmentation, retries and OOMs.
pub async fn allocator(
    State(state): State<AppState>,
    path: Result<Path<(String, i64)>, PathRejection>,
    query: Result<Query<AllocatorQuery>, QueryRejection>,
) -> Result<Json<AllocatorResponse>, ApiError> {
    let Path((uuid, pid)) = path?;
    check_id("uuid", &uuid)?;
    let Query(q) = query?;
    let range = SeriesQuery {
        from: q.from,
        to: q.to,
        max_points: q.max_points,
    };
    let (from, to, max_points) = range.resolve(state.clock.now_ms())?;
    let series = state
        .store
        .allocator_series(&AllocatorSeriesQuery {
            device_uuid: &uuid,
            pid,
            start_time_ms: q.start_time_ms,
            from_ms: from,
            to_ms: to,
            max_points,
        })
        .await?;
    match series {
        Some(series) => Ok(Json(AllocatorResponse { from, to, series })),
        None => Err(ApiError::NotFound(format!("no process {pid} on {uuid:?}"))),
    }
}

#[derive(Debug, Serialize)]
pub struct ProcessSeriesResponse {
    uuid: String,
    from: i64,
    to: i64,
    processes: Vec<ProcessSeries>,
}

/// Memory of each process on one device over a range, for a stacked chart.
pub async fn process_series(
    State(state): State<AppState>,
    Path(uuid): Path<String>,
    query: Result<Query<SeriesQuery>, QueryRejection>,
) -> Result<Json<ProcessSeriesResponse>, ApiError> {
    check_id("uuid", &uuid)?;
    let Query(q) = query?;
    let (from, to, max_points) = q.resolve(state.clock.now_ms())?;
    match state
        .store
        .process_series(&uuid, from, to, max_points)
        .await?
    {
        Some(processes) => Ok(Json(ProcessSeriesResponse {
            uuid,
            from,
            to,
            processes,
        })),
        None => Err(ApiError::NotFound(format!(
            "no GPU or MIG instance {uuid:?}"
        ))),
    }
}

#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    from: Option<i64>,
    to: Option<i64>,
    /// At most this many, newest first (1..=10000, default 500).
    limit: Option<i64>,
}

/// XID errors, lost GPUs, hung calls and MIG changes of one device.
pub async fn device_events(
    State(state): State<AppState>,
    Path(uuid): Path<String>,
    query: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Json<Vec<EventView>>, ApiError> {
    check_id("uuid", &uuid)?;
    let Query(q) = query?;
    let range = SeriesQuery {
        from: q.from,
        to: q.to,
        max_points: None,
    };
    let (from, to, _) = range.resolve(state.clock.now_ms())?;
    let limit = q.limit.unwrap_or(500);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::BadRequest(format!(
            "`limit` = {limit} is outside 1..=10000"
        )));
    }
    match state.store.device_events(&uuid, from, to, limit).await? {
        Some(events) => Ok(Json(events)),
        None => Err(ApiError::NotFound(format!(
            "no GPU or MIG instance {uuid:?}"
        ))),
    }
}
