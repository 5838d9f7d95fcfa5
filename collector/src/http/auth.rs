//! Who may read the dashboard and the API, and who may change anything.
//!
//! `[http_auth] mode`:
//! - `none`: everyone who reaches `http_listen` is an admin (the one-machine
//!   demo; keep it on loopback).
//! - `tokens`: a dashboard token (`headroom-collector token create --role
//!   viewer|admin --name …`) as `Authorization: Bearer …`, or the cookie the
//!   dashboard's sign-in sets from it.
//! - `proxy`: a reverse proxy that signs users in names them in
//!   `user_header`; only requests from `trusted_proxies` may carry it. Bearer
//!   tokens work too (Prometheus, scripts).
//!
//! Viewers read; admins also acknowledge alerts and create or expire
//! silences. Every state-changing request must come from the dashboard's
//! own origin (`Sec-Fetch-Site`, else `Origin` against `Host`), so another
//! site cannot make a signed-in browser act (CSRF); requests from outside a
//! browser carry neither header and pass.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::auth::cache::{Grant, TokenCache};
use crate::auth::lockout::Lockout;
use crate::auth::token_sha256;
use crate::metrics::CollectorMetrics;
use headroom_store::tokens::TokenRole;

/// The sign-in cookie; it holds the dashboard token itself, readable by no
/// script (`HttpOnly`) and sent on no request from another site (`SameSite`).
pub const SESSION_COOKIE: &str = "headroom_token";
/// How long a browser stays signed in; revoking the token ends it sooner.
const SESSION_MAX_AGE_S: u32 = 7 * 24 * 3600;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HttpAuthMode {
    #[default]
    None,
    Tokens,
    Proxy,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpAuthConfig {
    pub mode: HttpAuthMode,
    /// `proxy`: the request header that names the signed-in user.
    pub user_header: String,
    /// `proxy`: users who may act (acknowledge, silence); everyone else the
    /// proxy lets through may read.
    pub admin_users: Vec<String>,
    /// `proxy`: addresses `user_header` is believed from; from anywhere
    /// else it is refused, so nobody can name themselves past the proxy.
    pub trusted_proxies: Vec<IpNet>,
    /// `tokens`: mark the sign-in cookie `Secure` (sent over HTTPS only).
    /// Turn it on when a TLS proxy serves the dashboard.
    pub secure_cookie: bool,
}

impl Default for HttpAuthConfig {
    fn default() -> Self {
        Self {
            mode: HttpAuthMode::None,
            user_header: "X-Forwarded-User".into(),
            admin_users: Vec::new(),
            trusted_proxies: ["127.0.0.1/32", "::1/128"]
                .iter()
                .filter_map(|net| net.parse().ok())
                .collect(),
            secure_cookie: false,
        }
    }
}

impl HttpAuthConfig {
    pub fn problem(&self) -> Option<String> {
        if self.mode != HttpAuthMode::Proxy {
            return None;
        }
        if header::HeaderName::try_from(self.user_header.as_str()).is_err() {
            return Some(format!(
                "[http_auth] user_header = {:?} is not a valid header name",
                self.user_header
            ));
        }
        if self.trusted_proxies.is_empty() {
            return Some(
                "[http_auth] mode = \"proxy\" needs trusted_proxies: the addresses the proxy connects from"
                    .into(),
            );
        }
        None
    }
}

/// The address a request came from, when the server was started with
/// connect info (tests that drive the router directly have none).
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub Option<IpAddr>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Self(peer_of(&parts.extensions)))
    }
}

fn peer_of(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    // An IPv4 client of a `[::]` listener arrives as ::ffff:a.b.c.d; as
    // itself it matches IPv4 trusted_proxies and gets a lockout of its own.
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| addr.ip().to_canonical())
}

/// Who a request was authenticated as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The token's holder or the proxy's user; `None` with `mode = "none"`
    /// or a token enrolled without a name.
    pub user: Option<String>,
    pub role: TokenRole,
    /// The token it came with, so a long response (the live stream) can
    /// notice a revocation; `None` for the proxy's users and `mode = "none"`.
    pub token_sha256: Option<String>,
}

impl Identity {
    pub fn may_act(&self) -> bool {
        self.role == TokenRole::Admin
    }
}

/// Why a request was not let through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No credential, or one that is wrong: 401.
    Unauthenticated(String),
    /// Too many failures from this address: 429.
    LockedOut { retry_after_s: u64 },
    /// The caller is known but may not do this, or the request came from
    /// another site: 403.
    Forbidden(String),
    /// The token list could not be read: 503.
    Unavailable(String),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            Self::Unauthenticated(m) => (StatusCode::UNAUTHORIZED, m),
            Self::Forbidden(m) => (StatusCode::FORBIDDEN, m),
            Self::Unavailable(m) => (StatusCode::SERVICE_UNAVAILABLE, m),
            Self::LockedOut { retry_after_s } => {
                let mut response = (
                    StatusCode::TOO_MANY_REQUESTS,
                    axum::Json(serde_json::json!({
                        "error": format!("too many failed sign-ins from this address; retry in {retry_after_s} s")
                    })),
                )
                    .into_response();
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
                return response;
            }
        };
        (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
    }
}

#[derive(Debug)]
pub struct HttpAuth {
    config: HttpAuthConfig,
    /// `None` with `mode = "none"`.
    tokens: Option<Arc<TokenCache>>,
    user_header: Option<header::HeaderName>,
    lockout: Lockout,
    metrics: Arc<CollectorMetrics>,
}

impl HttpAuth {
    pub fn new(
        config: HttpAuthConfig,
        tokens: Arc<TokenCache>,
        metrics: Arc<CollectorMetrics>,
    ) -> Self {
        let user_header = (config.mode == HttpAuthMode::Proxy)
            .then(|| header::HeaderName::try_from(config.user_header.as_str()).ok())
            .flatten();
        Self {
            tokens: (config.mode != HttpAuthMode::None).then_some(tokens),
            user_header,
            config,
            lockout: Lockout::new("a dashboard request"),
            metrics,
        }
    }

    pub fn mode(&self) -> HttpAuthMode {
        self.config.mode
    }

    pub fn secure_cookie(&self) -> bool {
        self.config.secure_cookie
    }

    /// Who sent a request with these headers from `peer`.
    pub async fn identify(
        &self,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Result<Identity, Refusal> {
        let Some(tokens) = &self.tokens else {
            return Ok(Identity {
                user: None,
                role: TokenRole::Admin,
                token_sha256: None,
            });
        };
        // The proxy's word first: proxies may pass on an Authorization
        // header of their own (an identity provider's token).
        if let Some(name) = &self.user_header
            && headers.contains_key(name)
        {
            return self.proxy_user(headers.get_all(name), peer);
        }
        // Only Bearer is ours: a Basic header from a proxy in front must
        // not hide the sign-in cookie.
        if let Some(token) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
        {
            return self.check_token(tokens, token.trim(), peer).await;
        }
        if self.config.mode == HttpAuthMode::Tokens
            && let Some(token) = session_cookie(headers)
        {
            return self.check_token(tokens, token, peer).await;
        }
        Err(Refusal::Unauthenticated(match self.config.mode {
            HttpAuthMode::Proxy => format!(
                "not signed in: no {} header from the proxy and no bearer token",
                self.config.user_header
            ),
            _ => "not signed in: sign in with a dashboard token (`headroom-collector token create --role viewer --name …`)".into(),
        }))
    }

    /// Checks a dashboard token; `token` is what the user or the cookie gave.
    pub async fn check_token(
        &self,
        tokens: &TokenCache,
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<Identity, Refusal> {
        let hash = token_sha256(token);
        let locked_out = peer.and_then(|ip| self.lockout.locked_out(ip));
        let found = match locked_out {
            // Locked out: the list is read at most once per refresh, so
            // guessing costs neither a query nor a log line, while a
            // revocation still counts and a valid token behind the same
            // address (a NAT, a TLS proxy) still gets in.
            Some(_) => tokens.lookup_stale_only(&hash).await,
            None => tokens.lookup(&hash).await,
        };
        let grant = match (found, locked_out) {
            (Ok(Some(grant)), _) => grant,
            (Ok(None), Some(wait)) => {
                self.metrics.http_auth_failure();
                return Err(Refusal::LockedOut {
                    retry_after_s: wait.as_secs().max(1),
                });
            }
            (Ok(None), None) => {
                return Err(self.refuse(peer, "unknown or revoked dashboard token"));
            }
            (Err(error), _) => {
                self.metrics.storage_error();
                tracing::error!(%error, "loading tokens failed");
                // The detail (hosts, roles) is for the log, not for callers
                // who have not signed in.
                return Err(Refusal::Unavailable(
                    "the collector cannot read its token list; see its log".into(),
                ));
            }
        };
        match grant {
            Grant {
                role: role @ (TokenRole::Viewer | TokenRole::Admin),
                name,
                ..
            } => Ok(Identity {
                user: name,
                role,
                token_sha256: Some(hash),
            }),
            Grant {
                role: TokenRole::Agent,
                ..
            } => Err(self.refuse(
                peer,
                "this is an agent token; the dashboard takes a viewer or admin token",
            )),
        }
    }

    /// The cache, when tokens are checked at all.
    pub fn tokens(&self) -> Option<&TokenCache> {
        self.tokens.as_deref()
    }

    fn proxy_user(
        &self,
        values: header::GetAll<'_, HeaderValue>,
        peer: Option<IpAddr>,
    ) -> Result<Identity, Refusal> {
        let trusted = peer.is_some_and(|ip| {
            self.config
                .trusted_proxies
                .iter()
                .any(|net| net.contains(&ip))
        });
        if !trusted {
            return Err(self.refuse(
                peer,
                &format!(
                    "{} came from an address not in [http_auth] trusted_proxies",
                    self.config.user_header
                ),
            ));
        }
        // A proxy that appends its header instead of replacing the client's
        // would leave two: believe neither.
        let mut values = values.iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return Err(self.refuse(
                peer,
                &format!(
                    "{} appears more than once: the proxy must replace the client's",
                    self.config.user_header
                ),
            ));
        };
        let user = value
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|u| !u.is_empty() && u.len() <= 256)
            .ok_or_else(|| {
                self.refuse(
                    peer,
                    &format!("{} is empty, too long or not text", self.config.user_header),
                )
            })?;
        let role = if self.config.admin_users.iter().any(|a| a == user) {
            TokenRole::Admin
        } else {
            TokenRole::Viewer
        };
        Ok(Identity {
            user: Some(user.to_owned()),
            role,
            token_sha256: None,
        })
    }

    pub fn refuse(&self, peer: Option<IpAddr>, reason: &str) -> Refusal {
        self.metrics.http_auth_failure();
        self.lockout.record_failure(peer, reason);
        Refusal::Unauthenticated(reason.to_owned())
    }
}

/// The dashboard token in the sign-in cookie, if the request has one.
fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == SESSION_COOKIE)
        .map(|(_, value)| value)
        .filter(|value| !value.is_empty())
}

/// `Set-Cookie` that signs a browser in with `token`, or out with `None`.
pub fn session_cookie_header(token: Option<&str>, secure: bool) -> HeaderValue {
    let secure = if secure { "; Secure" } else { "" };
    let text = match token {
        Some(token) => format!(
            "{SESSION_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_MAX_AGE_S}{secure}"
        ),
        None => format!("{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{secure}"),
    };
    // Tokens are `hrd_` and hex (checked before a cookie is set), so the
    // value is always a valid header; an empty one signs out regardless.
    HeaderValue::from_str(&text)
        .unwrap_or_else(|_| HeaderValue::from_static("headroom_token=; Path=/; Max-Age=0"))
}

/// Refuses a state-changing request that another site's page made: what
/// `Sec-Fetch-Site` says, or, from browsers without it, whether `Origin`
/// names this host. Requests with neither come from outside a browser
/// (curl, scripts), which no other site can drive.
pub fn check_same_origin(method: &Method, headers: &HeaderMap) -> Result<(), Refusal> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return Ok(());
    }
    let cross_site = || {
        Refusal::Forbidden(
            "cross-origin request refused: changes are accepted only from the dashboard's own pages"
                .into(),
        )
    };
    if let Some(site) = headers.get("sec-fetch-site") {
        return match site.as_bytes() {
            b"same-origin" | b"none" => Ok(()),
            _ => Err(cross_site()),
        };
    }
    let Some(origin) = headers.get(header::ORIGIN) else {
        return Ok(());
    };
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, rest)| rest);
    // Behind a proxy that rewrites Host, the host the browser saw is in
    // X-Forwarded-Host; another site's page cannot set that header without
    // a preflight this server never grants.
    let same = |name| {
        headers
            .get(name)
            .and_then(|h| h.to_str().ok())
            .zip(origin_host)
            .is_some_and(|(host, origin)| origin.eq_ignore_ascii_case(host))
    };
    if same(header::HOST) || same(header::HeaderName::from_static("x-forwarded-host")) {
        Ok(())
    } else {
        Err(cross_site())
    }
}

/// What a path needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    /// The page, its assets, the health check and the sign-in itself.
    Nothing,
    Viewer,
    Admin,
}

fn needs(method: &Method, path: &str) -> Needs {
    let public = path == "/"
        || path == "/healthz"
        || path == "/readyz"
        || path == "/api/v1/session"
        || path.starts_with("/assets/");
    if public {
        Needs::Nothing
    } else if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        Needs::Viewer
    } else {
        Needs::Admin
    }
}

/// The middleware: refuses cross-site changes, then anyone the path needs
/// and the request is not, and hands handlers the [`Identity`].
pub async fn authorize(
    State(auth): State<Arc<HttpAuth>>,
    mut request: Request,
    next: Next,
) -> Response {
    if let Err(refusal) = check_same_origin(request.method(), request.headers()) {
        auth.metrics.http_auth_failure();
        tracing::warn!(peer = ?peer_of(request.extensions()), path = request.uri().path(),
            origin = ?request.headers().get(header::ORIGIN), "refused a cross-site change");
        return refusal.into_response();
    }
    let need = needs(request.method(), request.uri().path());
    if need == Needs::Nothing {
        return next.run(request).await;
    }
    let peer = peer_of(request.extensions());
    let identity = match auth.identify(request.headers(), peer).await {
        Ok(identity) => identity,
        Err(refusal) => return refusal.into_response(),
    };
    if need == Needs::Admin && !identity.may_act() {
        auth.metrics.http_auth_failure();
        tracing::warn!(
            ?peer,
            user = identity.user.as_deref().unwrap_or("-"),
            path = request.uri().path(),
            "refused a viewer's change"
        );
        return Refusal::Forbidden(format!(
            "{} may read but not change anything: acknowledging and silencing need an admin",
            identity.user.as_deref().unwrap_or("this viewer token")
        ))
        .into_response();
    }
    request.extensions_mut().insert(identity);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn cross_site_changes_are_refused_and_reads_and_scripts_pass() {
        let post = Method::POST;
        assert!(
            check_same_origin(&Method::GET, &headers(&[("sec-fetch-site", "cross-site")])).is_ok()
        );
        assert!(
            check_same_origin(&post, &headers(&[])).is_ok(),
            "curl sends neither header"
        );
        assert!(check_same_origin(&post, &headers(&[("sec-fetch-site", "same-origin")])).is_ok());
        for site in ["cross-site", "same-site"] {
            assert!(check_same_origin(&post, &headers(&[("sec-fetch-site", site)])).is_err());
        }
        let ok = headers(&[("origin", "http://gpu-mon:8080"), ("host", "gpu-mon:8080")]);
        assert!(check_same_origin(&Method::DELETE, &ok).is_ok());
        let evil = headers(&[("origin", "https://evil.example"), ("host", "gpu-mon:8080")]);
        assert!(check_same_origin(&Method::DELETE, &evil).is_err());
        let proxied = headers(&[
            ("origin", "https://headroom.example.com"),
            ("host", "127.0.0.1:8080"),
            ("x-forwarded-host", "headroom.example.com"),
        ]);
        assert!(check_same_origin(&post, &proxied).is_ok());
        let opaque = headers(&[("origin", "null"), ("host", "gpu-mon:8080")]);
        assert!(check_same_origin(&post, &opaque).is_err());
    }

    #[test]
    fn the_session_cookie_is_found_among_others_and_set_safely() {
        let h = headers(&[("cookie", "a=1; headroom_token=hrd_abc; b=2")]);
        assert_eq!(session_cookie(&h), Some("hrd_abc"));
        assert_eq!(
            session_cookie(&headers(&[("cookie", "headroom_token=")])),
            None
        );
        let set = session_cookie_header(Some("hrd_abc"), true);
        let set = set.to_str().unwrap();
        for part in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/"] {
            assert!(set.contains(part), "{set}");
        }
        assert!(
            session_cookie_header(None, false)
                .to_str()
                .unwrap()
                .contains("Max-Age=0")
        );
    }

    #[test]
    fn reads_need_a_viewer_changes_an_admin_and_the_page_nothing() {
        assert_eq!(needs(&Method::GET, "/"), Needs::Nothing);
        assert_eq!(needs(&Method::GET, "/assets/app.js"), Needs::Nothing);
        assert_eq!(needs(&Method::POST, "/api/v1/session"), Needs::Nothing);
        assert_eq!(needs(&Method::GET, "/metrics"), Needs::Viewer);
        assert_eq!(needs(&Method::GET, "/api/v1/gpus"), Needs::Viewer);
        assert_eq!(needs(&Method::GET, "/api/v1/fleet/history"), Needs::Viewer);
        assert_eq!(needs(&Method::POST, "/api/v1/alerts/1/ack"), Needs::Admin);
        assert_eq!(needs(&Method::DELETE, "/api/v1/silences/3"), Needs::Admin);
    }

    #[test]
    fn proxy_mode_needs_trusted_proxies_and_a_valid_header() {
        let mut config = HttpAuthConfig {
            mode: HttpAuthMode::Proxy,
            ..HttpAuthConfig::default()
        };
        assert_eq!(config.problem(), None);
        config.user_header = "bad header".into();
        assert!(config.problem().unwrap().contains("user_header"));
        config.user_header = "X-Remote-User".into();
        config.trusted_proxies.clear();
        assert!(config.problem().unwrap().contains("trusted_proxies"));
    }
}
