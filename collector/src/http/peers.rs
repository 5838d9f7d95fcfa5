//! The endpoint other collectors sharing the database call for the samples
//! this one holds open (`crate::peers` is the caller). It answers only to
//! the secret kept in that database, so it sits outside the dashboard's
//! sign-in and `Host` checks: no browser holds that secret.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;

use crate::auth::token_sha256;
use crate::peers::OPEN_SAMPLES_PATH;
use headroom_store::Store;
use headroom_store::peers::OpenSamplesQuery;

/// A process chart asks for at most the processes one device had over its
/// range; far more than any GPU runs.
const MAX_PROCESS_IDS: usize = 10_000;

/// Room for [`MAX_PROCESS_IDS`] ids as JSON.
const MAX_QUERY_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone)]
struct Endpoint {
    store: Arc<dyn Store>,
    secret_sha256: Arc<str>,
}

/// The routes other collectors call, answering to `secret`.
pub fn router(store: Arc<dyn Store>, secret: &str) -> Router {
    Router::new()
        .route(OPEN_SAMPLES_PATH, post(open_samples))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            super::REQUEST_TIMEOUT,
        ))
        .layer(RequestBodyLimitLayer::new(MAX_QUERY_BYTES))
        .with_state(Endpoint {
            store,
            secret_sha256: token_sha256(secret).into(),
        })
}

async fn open_samples(
    State(endpoint): State<Endpoint>,
    headers: HeaderMap,
    query: Result<Json<OpenSamplesQuery>, JsonRejection>,
) -> Response {
    // Hashes compared, so the time taken says nothing of the secret.
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(token_sha256);
    if presented.as_deref() != Some(&*endpoint.secret_sha256) {
        return (
            StatusCode::UNAUTHORIZED,
            "this endpoint answers collectors sharing this one's database, with their secret\n",
        )
            .into_response();
    }
    let Json(query) = match query {
        Ok(query) => query,
        Err(rejection) => {
            return (rejection.status(), rejection.body_text()).into_response();
        }
    };
    if query.from_ms > query.to_ms || query.process_ids.len() > MAX_PROCESS_IDS {
        return (
            StatusCode::BAD_REQUEST,
            format!("a query needs from_ms <= to_ms and at most {MAX_PROCESS_IDS} process ids\n"),
        )
            .into_response();
    }
    Json(endpoint.store.open_samples(&query)).into_response()
}
