//! Alerts, acknowledgements and silences over the JSON API.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::api::ApiError;
use super::auth::Identity;
use super::text::{Lines, MAX_TEXT_BYTES, check_text};
use headroom_store::alerts::{AlertFilter, AlertView, NewSilence, SilenceView};

#[derive(Debug, Deserialize)]
pub struct AlertsQuery {
    state: Option<AlertFilter>,
    limit: Option<i64>,
}

pub async fn list(
    State(state): State<AppState>,
    query: Result<Query<AlertsQuery>, QueryRejection>,
) -> Result<Json<Vec<AlertView>>, ApiError> {
    let Query(q) = query?;
    let limit = q.limit.unwrap_or(500);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::BadRequest(format!(
            "`limit` = {limit} is outside 1..=10000"
        )));
    }
    Ok(Json(
        state
            .store
            .alerts(q.state.unwrap_or(AlertFilter::Active), limit)
            .await?,
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AckBody {
    /// Who acknowledges; a signed-in user's own name replaces it.
    #[serde(default)]
    by: String,
}

/// Who did it, for the record: the signed-in user when there is one (so
/// nobody can act in another's name), else what the request says.
fn actor(identity: Option<&Identity>, claimed: String) -> String {
    identity.and_then(|i| i.user.clone()).unwrap_or(claimed)
}

/// A name or label: one line of printable text.
fn check_line(field: &str, value: &str) -> Result<(), ApiError> {
    check_text(field, value, Lines::One, MAX_TEXT_BYTES)
}

pub async fn acknowledge(
    State(state): State<AppState>,
    id: Result<Path<i64>, PathRejection>,
    identity: Option<Extension<Identity>>,
    body: Result<Json<AckBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Path(id) = id?;
    let Json(body) = body?;
    let by = actor(identity.as_ref().map(|Extension(i)| i), body.by);
    check_line("by", &by)?;
    if state
        .store
        .acknowledge_alert(id, &by, state.clock.now_ms())
        .await?
    {
        Ok(Json(json!({ "acknowledged": true })))
    } else {
        Err(ApiError::NotFound(format!("no active alert {id}")))
    }
}

pub async fn silences(State(state): State<AppState>) -> Result<Json<Vec<SilenceView>>, ApiError> {
    Ok(Json(state.store.silences(state.clock.now_ms()).await?))
}

pub async fn create_silence(
    State(state): State<AppState>,
    identity: Option<Extension<Identity>>,
    body: Result<Json<NewSilence>, JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(mut silence) = body?;
    silence.created_by = actor(identity.as_ref().map(|Extension(i)| i), silence.created_by);
    if silence.matchers.is_empty() {
        return Err(ApiError::BadRequest(
            "`matchers` is empty: a silence must name at least one label".into(),
        ));
    }
    for (k, v) in &silence.matchers {
        check_line("matchers (a label name)", k)?;
        check_line(&format!("matchers.{}", k.escape_debug()), v)?;
    }
    check_text("comment", &silence.comment, Lines::Many, MAX_TEXT_BYTES)?;
    check_line("created_by", &silence.created_by)?;
    let now = state.clock.now_ms();
    if silence.ends_at_ms <= now {
        return Err(ApiError::BadRequest(format!(
            "`ends_at_ms` ({}) is not in the future",
            silence.ends_at_ms
        )));
    }
    let id = state.store.create_silence(&silence, now).await?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

pub async fn expire_silence(
    State(state): State<AppState>,
    id: Result<Path<i64>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let Path(id) = id?;
    if state.store.expire_silence(id, state.clock.now_ms()).await? {
        Ok(Json(json!({ "expired": true })))
    } else {
        Err(ApiError::NotFound(format!("no active silence {id}")))
    }
}
