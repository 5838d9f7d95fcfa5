//! The HTTP side: JSON API and the fleet page, on axum.

mod alerts;
mod api;
pub mod auth;
mod device_summary;
mod errors;
mod fleet_summary;
pub mod hosts;
mod jobs;
pub mod listener;
mod node_rows;
pub mod peers;
mod process_summary;
mod session;
pub mod settings;
mod stream;
#[cfg(test)]
mod test_fleet;
mod text;

pub use listener::serve_http;
pub use settings::HttpServerConfig;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::HeaderValue;
use axum::http::header;
use axum::response::{Html, IntoResponse};
use axum::routing::{delete, get, post};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::set_header::SetResponseHeaderLayer;
use tower_http::timeout::TimeoutLayer;

use crate::metrics::{CollectorMetrics, StoreFigures};
use headroom_common::Clock;
use headroom_store::Store;

#[derive(Debug, Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub clock: Clock,
    pub metrics: Arc<CollectorMetrics>,
    /// Who may read and who may act.
    pub auth: Arc<auth::HttpAuth>,
    /// Turns true when the collector stops: endless responses (the event
    /// stream) end then, so a graceful shutdown is not held up by an open
    /// dashboard.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// The live stream's shared fleet reads and its client limit.
    pub fleet: Arc<stream::FleetFeed>,
    /// Which `Host` names requests may carry.
    pub hosts: Arc<hosts::AllowedHosts>,
}

impl AppState {
    /// The state of a server with the `[http]` limits of `http`.
    pub fn new(
        store: Arc<dyn Store>,
        clock: Clock,
        metrics: Arc<CollectorMetrics>,
        auth: Arc<auth::HttpAuth>,
        shutdown: tokio::sync::watch::Receiver<bool>,
        http: &HttpServerConfig,
    ) -> Self {
        Self {
            fleet: Arc::new(stream::FleetFeed::new(
                store.clone(),
                clock.clone(),
                http.max_stream_clients,
                http.stream_devices_max,
                metrics.clone(),
            )),
            hosts: Arc::new(hosts::AllowedHosts::new(http, auth.mode(), metrics.clone())),
            store,
            clock,
            metrics,
            auth,
            shutdown,
        }
    }
}

const INDEX_HTML: &str = include_str!("../../../web/index.html");

/// One of the dashboard script's ES modules, `web/app/NAME`, served at
/// `/assets/app/NAME` and revalidated like the entry module `app.js`.
macro_rules! app_module {
    ($name:literal) => {
        (
            concat!("app/", $name),
            "text/javascript; charset=utf-8",
            "no-cache",
            include_str!(concat!("../../../web/app/", $name)),
        )
    };
}

/// The dashboard's files, built into the binary: no CDN, nothing to deploy
/// beside it. Vendored libraries change only with a new binary, so they
/// may be cached; the app's own files are revalidated. The script is ES
/// modules, loaded as they are (no build step): `app.js` imports those of
/// `web/app/`, each listed here (a test checks the list against the folder
/// and every import against the list).
const ASSETS: &[(&str, &str, &str, &str)] = &[
    (
        "app.js",
        "text/javascript; charset=utf-8",
        "no-cache",
        include_str!("../../../web/app.js"),
    ),
    app_module!("alerts.js"),
    app_module!("charts.js"),
    app_module!("composition.js"),
    app_module!("devices.js"),
    app_module!("fleet.js"),
    app_module!("fleet_history.js"),
    app_module!("format.js"),
    app_module!("gpu.js"),
    app_module!("grid.js"),
    app_module!("processes.js"),
    app_module!("router.js"),
    app_module!("session.js"),
    app_module!("state.js"),
    app_module!("stream.js"),
    (
        "app.css",
        "text/css; charset=utf-8",
        "no-cache",
        include_str!("../../../web/app.css"),
    ),
    (
        "uPlot.iife.min.js",
        "text/javascript; charset=utf-8",
        "public, max-age=86400",
        include_str!("../../../web/vendor/uPlot.iife.min.js"),
    ),
    (
        "uPlot.min.css",
        "text/css; charset=utf-8",
        "public, max-age=86400",
        include_str!("../../../web/vendor/uPlot.min.css"),
    ),
];

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/nodes", get(api::nodes))
        .route("/api/v1/gpus", get(api::gpus))
        .route("/api/v1/fleet", get(api::fleet))
        .route("/api/v1/gpus/{uuid}/series", get(api::series))
        .route("/api/v1/fleet/history", get(api::fleet_history))
        .route(ASSET_ROUTE, get(asset))
        .route("/api/v1/stream", get(stream::fleet))
        .route(
            "/api/v1/gpus/{uuid}/processes/series",
            get(api::process_series),
        )
        .route("/api/v1/gpus/{uuid}/events", get(api::device_events))
        .route("/api/v1/processes", get(api::processes))
        .route("/api/v1/processes/summary", get(process_summary::summary))
        .route("/api/v1/jobs", get(jobs::list))
        .route("/api/v1/jobs/{id}/report", get(jobs::report))
        .route(
            "/api/v1/gpus/{uuid}/processes/{pid}/allocator",
            get(api::allocator),
        )
        .route("/api/v1/alerts", get(alerts::list))
        .route("/api/v1/alerts/{id}/ack", post(alerts::acknowledge))
        .route(
            "/api/v1/silences",
            get(alerts::silences).post(alerts::create_silence),
        )
        .route("/api/v1/silences/{id}", delete(alerts::expire_silence))
        .route(
            "/api/v1/session",
            get(session::current)
                .post(session::sign_in)
                .delete(session::sign_out),
        )
        .fallback(api::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.auth.clone(),
            auth::authorize,
        ))
        .layer(TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        // The API takes small JSON (a silence, an acknowledgement).
        .layer(RequestBodyLimitLayer::new(MAX_REQUEST_BODY_BYTES))
        // Before anything else looks at a request: one for another host
        // (DNS rebinding) gets nowhere, not even the sign-in lockout.
        .layer(axum::middleware::from_fn_with_state(
            state.hosts.clone(),
            hosts::check_host,
        ))
        // Outside every layer that answers errors, so all of them are JSON.
        .layer(axum::middleware::from_fn(errors::json_errors))
        .layer(always(
            header::CONTENT_SECURITY_POLICY,
            CONTENT_SECURITY_POLICY,
        ))
        .layer(always(header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .layer(always(header::X_FRAME_OPTIONS, "DENY"))
        .layer(always(header::REFERRER_POLICY, "no-referrer"))
        .with_state(state)
}

/// Largest request body the API reads; more is `413 Payload Too Large`.
pub const MAX_REQUEST_BODY_BYTES: usize = 64 * 1024;

/// How long a handler may take to answer; then `408 Request Timeout`.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The dashboard loads only its own scripts and styles, talks only to its
/// own origin, and may not be framed; no response is sniffed into another
/// type or leaks its URL to other sites.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
    style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; \
    frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

fn always(name: header::HeaderName, value: &'static str) -> SetResponseHeaderLayer<HeaderValue> {
    SetResponseHeaderLayer::if_not_present(name, HeaderValue::from_static(value))
}

/// Prometheus scrape. A store that cannot answer leaves its figures out
/// rather than failing the scrape: ingest counters matter most when the
/// database is in trouble.
/// How long readiness waits for the database before saying no.
const READY_DB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Ready while the database answers: `/healthz` says the process lives,
/// this whether it can serve the dashboard and store what agents send.
async fn readyz(axum::extract::State(state): axum::extract::State<AppState>) -> impl IntoResponse {
    let why = match tokio::time::timeout(READY_DB_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => return (axum::http::StatusCode::OK, "ready\n"),
        Ok(Err(error)) => {
            tracing::warn!(%error, "not ready: the database does not answer");
            "not ready: the database does not answer\n"
        }
        Err(_) => "not ready: the database did not answer within 2 s\n",
    };
    (axum::http::StatusCode::SERVICE_UNAVAILABLE, why)
}

async fn metrics(axum::extract::State(state): axum::extract::State<AppState>) -> impl IntoResponse {
    let alerts = state.store.active_alert_counts().await.ok();
    let figures = StoreFigures {
        alerts,
        outbox_undelivered: state.store.undelivered_notifications().await.ok(),
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(figures),
    )
}

/// The dashboard's files: `FILE` or, for the script's modules, `app/FILE`.
const ASSET_ROUTE: &str = "/assets/{*file}";

async fn asset(
    uri: axum::http::Uri,
    axum::extract::Path(file): axum::extract::Path<String>,
) -> axum::response::Response {
    match ASSETS.iter().find(|(name, ..)| *name == file) {
        Some((_, content_type, cache, body)) => (
            [
                (header::CONTENT_TYPE, *content_type),
                (header::CACHE_CONTROL, *cache),
            ],
            *body,
        )
            .into_response(),
        None => api::not_found(uri).await.into_response(),
    }
}

async fn index() -> impl IntoResponse {
    ([(header::CACHE_CONTROL, "no-cache")], Html(INDEX_HTML))
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::BTreeSet;

    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use tower_service::Service;

    fn served(name: &str) -> Option<&'static str> {
        ASSETS
            .iter()
            .find(|(file, ..)| *file == name)
            .map(|(.., body)| *body)
    }

    /// The script's modules: the entry and those under `app/`.
    fn modules() -> impl Iterator<Item = (&'static str, &'static str)> {
        ASSETS
            .iter()
            .filter(|(name, ..)| *name == "app.js" || name.starts_with("app/"))
            .map(|(name, _, _, body)| (*name, *body))
    }

    /// What a module imports (`import … from "./NAME.js"`, `import
    /// "./NAME.js"`, `export … from`), as the names of the assets; each
    /// import on one line.
    fn imports(name: &str, body: &str) -> Vec<String> {
        let dir = name
            .rsplit_once('/')
            .map_or(String::new(), |(dir, _)| format!("{dir}/"));
        let mut found = Vec::new();
        for line in body.lines().map(str::trim) {
            let from = line.starts_with("import \"")
                || ((line.starts_with("import ") || line.starts_with("export "))
                    && line.contains(" from \""));
            if !from {
                assert!(
                    !line.starts_with("import ") && !line.starts_with("} from "),
                    "{name}: keep each import on one line: {line}"
                );
                continue;
            }
            let spec = line.split('"').nth(1).unwrap();
            let relative = spec
                .strip_prefix("./")
                .unwrap_or_else(|| panic!("{name} imports {spec}: only ./NAME.js is served"));
            found.push(format!("{dir}{relative}"));
        }
        found
    }

    #[test]
    fn every_module_in_web_app_is_served_as_it_is_on_disk() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../web/app");
        let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .filter(|name| name.ends_with(".js"))
            .collect();
        let listed: BTreeSet<String> = modules()
            .filter_map(|(name, _)| name.strip_prefix("app/"))
            .map(str::to_owned)
            .collect();
        assert_eq!(on_disk, listed, "web/app/ against the ASSETS table");
        for name in &on_disk {
            let text = std::fs::read_to_string(dir.join(name)).unwrap();
            assert_eq!(
                served(&format!("app/{name}")),
                Some(text.as_str()),
                "{name}"
            );
        }
    }

    /// A module that is not served, or one that nothing imports, would
    /// break the page (or linger) without a compile error: every import
    /// names a served module, and every module is reached from `app.js`.
    #[test]
    fn every_import_names_a_served_module_and_app_js_reaches_them_all() {
        let mut reached = BTreeSet::from(["app.js".to_owned()]);
        let mut todo = vec!["app.js".to_owned()];
        while let Some(name) = todo.pop() {
            let body = served(&name).unwrap();
            for import in imports(&name, body) {
                assert!(
                    served(&import).is_some(),
                    "{name} imports {import}, which is not served"
                );
                if reached.insert(import.clone()) {
                    todo.push(import);
                }
            }
        }
        let all: BTreeSet<String> = modules().map(|(name, _)| name.to_owned()).collect();
        assert_eq!(reached, all, "modules that app.js does not reach");
        assert!(all.len() > 10, "{all:?}");
    }

    /// The page loads `app.js` as a module and preloads every other one,
    /// so that the browser fetches them at once rather than import after
    /// import.
    #[test]
    fn the_page_loads_the_entry_module_and_preloads_the_others() {
        assert!(
            INDEX_HTML.contains(r#"<script type="module" src="/assets/app.js"></script>"#),
            "{INDEX_HTML}"
        );
        let preloaded: BTreeSet<&str> = INDEX_HTML
            .split(r#"<link rel="modulepreload" href="/assets/"#)
            .skip(1)
            .map(|rest| &rest[..rest.find('"').unwrap()])
            .collect();
        let others: BTreeSet<&str> = modules()
            .map(|(name, _)| name)
            .filter(|name| *name != "app.js")
            .collect();
        assert_eq!(preloaded, others);
    }

    async fn get_asset(assets: &mut Router, path: &str) -> axum::response::Response {
        std::future::poll_fn(|cx| Service::<Request<Body>>::poll_ready(assets, cx))
            .await
            .unwrap();
        let request = Request::get(path).body(Body::empty()).unwrap();
        assets.call(request).await.unwrap()
    }

    #[tokio::test]
    async fn assets_are_served_with_their_type_and_caching_and_others_are_404() {
        let mut assets: Router = Router::new().route(ASSET_ROUTE, get(asset));
        for (path, content_type, cache) in [
            (
                "/assets/app.js",
                "text/javascript; charset=utf-8",
                "no-cache",
            ),
            (
                "/assets/app/state.js",
                "text/javascript; charset=utf-8",
                "no-cache",
            ),
            (
                "/assets/app/fleet.js",
                "text/javascript; charset=utf-8",
                "no-cache",
            ),
            ("/assets/app.css", "text/css; charset=utf-8", "no-cache"),
            (
                "/assets/uPlot.iife.min.js",
                "text/javascript; charset=utf-8",
                "public, max-age=86400",
            ),
        ] {
            let response = get_asset(&mut assets, path).await;
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            assert_eq!(
                response.headers()[header::CONTENT_TYPE],
                content_type,
                "{path}"
            );
            assert_eq!(response.headers()[header::CACHE_CONTROL], cache, "{path}");
        }
        for path in [
            "/assets/nothing.js",
            "/assets/app/nothing.js",
            "/assets/app/",
            "/assets/app/../app.js",
            "/assets/app/app/state.js",
            "/assets/state.js",
        ] {
            let response = get_asset(&mut assets, path).await;
            assert_eq!(response.status(), StatusCode::NOT_FOUND, "{path}");
        }
    }
}
