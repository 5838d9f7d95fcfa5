//! `/api/v1/session`: who the dashboard is signed in as, and signing in and
//! out with a dashboard token (`[http_auth] mode = "tokens"`).

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::AppState;
use super::auth::{HttpAuthMode, Identity, Peer, Refusal, session_cookie_header};
use crate::auth::DASHBOARD_TOKEN_PREFIX;

/// The page asks this first: signed in (as whom, may they act) or not, and
/// how to sign in.
pub async fn current(
    State(state): State<AppState>,
    Peer(peer): Peer,
    headers: HeaderMap,
) -> Response {
    let mode = state.auth.mode();
    match state.auth.identify(&headers, peer).await {
        Ok(identity) => Json(signed_in(mode, &identity)).into_response(),
        Err(Refusal::Unauthenticated(error)) => (
            StatusCode::UNAUTHORIZED,
            Json(json!({ "auth": mode, "error": error })),
        )
            .into_response(),
        Err(other) => other.into_response(),
    }
}

fn signed_in(mode: HttpAuthMode, identity: &Identity) -> serde_json::Value {
    // Never the token, nor its hash.
    json!({
        "auth": mode,
        "user": identity.user,
        "role": identity.role,
        "may_act": identity.may_act(),
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignIn {
    token: String,
}

/// Checks a dashboard token and, if it is good, keeps it in a cookie the
/// page's scripts cannot read.
pub async fn sign_in(
    State(state): State<AppState>,
    Peer(peer): Peer,
    body: Result<Json<SignIn>, JsonRejection>,
) -> Response {
    let auth = &state.auth;
    let (HttpAuthMode::Tokens, Some(tokens)) = (auth.mode(), auth.tokens()) else {
        return (
            StatusCode::CONFLICT,
            Json(json!({ "error": format!(
                "signing in with a token is off: [http_auth] mode = {:?}",
                auth.mode()
            ) })),
        )
            .into_response();
    };
    let Json(SignIn { token }) = match body {
        Ok(body) => body,
        Err(rejection) => return super::api::ApiError::from(rejection).into_response(),
    };
    let token = token.trim();
    // Only what a dashboard token can look like goes into a cookie.
    let well_formed = token
        .strip_prefix(DASHBOARD_TOKEN_PREFIX)
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    if !well_formed {
        let reason = if token.starts_with(crate::auth::AGENT_TOKEN_PREFIX) {
            "this is an agent token; the dashboard takes a viewer or admin token (hrd_…)"
        } else {
            "not a dashboard token: they start with hrd_ and have 64 hex digits"
        };
        return auth.refuse(peer, reason).into_response();
    }
    match auth.check_token(tokens, token, peer).await {
        Ok(identity) => {
            tracing::info!(
                user = identity.user.as_deref().unwrap_or("-"),
                role = identity.role.as_str(),
                "dashboard sign-in"
            );
            (
                [(
                    header::SET_COOKIE,
                    session_cookie_header(Some(token), auth.secure_cookie()),
                )],
                Json(signed_in(auth.mode(), &identity)),
            )
                .into_response()
        }
        Err(refusal) => refusal.into_response(),
    }
}

pub async fn sign_out(State(state): State<AppState>) -> Response {
    (
        [(
            header::SET_COOKIE,
            session_cookie_header(None, state.auth.secure_cookie()),
        )],
        Json(json!({ "signed_out": true })),
    )
        .into_response()
}
