//! Every error the HTTP server answers is JSON, `{"error": "..."}`, the
//! shape of the API's own: the layers in front of the handlers (timeout,
//! body limit) and axum's own answers (405, extractor rejections) are plain
//! text or empty, and this rewrites them, saying what was wrong.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;

use super::{MAX_REQUEST_BODY_BYTES, REQUEST_TIMEOUT};

/// The most of a plain-text error body kept as the message.
const MAX_ERROR_TEXT: usize = 4096;
/// The most of a request path repeated in a message.
const MAX_PATH_ECHO: usize = 200;

/// The middleware: passes successes and JSON errors through, and turns any
/// other error into JSON.
pub async fn json_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path: String = request.uri().path().chars().take(MAX_PATH_ECHO).collect();
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_ERROR_TEXT)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_owned())
        .unwrap_or_default();
    let error = message(status, &method, &path, text);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::json!({ "error": error }).to_string();
    Response::from_parts(parts, Body::from(body))
}

fn message(status: StatusCode, method: &Method, path: &str, text: String) -> String {
    match status {
        StatusCode::NOT_FOUND => format!("no such page or API route: {path}"),
        // axum adds `Allow` after this layer ran.
        StatusCode::METHOD_NOT_ALLOWED => format!(
            "method {method} is not allowed on {path} (the Allow header lists those that are)"
        ),
        StatusCode::REQUEST_TIMEOUT => format!(
            "{method} {path} took longer than {} s and was abandoned",
            REQUEST_TIMEOUT.as_secs()
        ),
        StatusCode::PAYLOAD_TOO_LARGE => too_large(),
        _ if !text.is_empty() => text,
        _ => status
            .canonical_reason()
            .unwrap_or("the request failed")
            .to_owned(),
    }
}

/// What a request over the body limit is told, however it was found out
/// (a `Content-Length` over it, or a chunked body that grew past it).
pub fn too_large() -> String {
    format!(
        "the request body is larger than the limit of {MAX_REQUEST_BODY_BYTES} bytes ({} KiB)",
        MAX_REQUEST_BODY_BYTES / 1024
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::Router;
    use axum::routing::get;
    use tower_http::timeout::TimeoutLayer;

    use super::*;
    use crate::http::{HttpServerConfig, serve_http};

    /// The 30 s timeout itself is too long for a test: the same layers with
    /// a short one, served over loopback as the collector serves them.
    #[tokio::test]
    async fn a_request_that_times_out_is_told_so_in_json() {
        let router = Router::new()
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    "late"
                }),
            )
            .layer(TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                Duration::from_millis(100),
            ))
            .layer(axum::middleware::from_fn(json_errors));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            serve_http(
                listener,
                router,
                &HttpServerConfig::default(),
                Default::default(),
                async move {
                    let _ = stopped.await;
                },
            )
            .await
        });
        let response = reqwest::get(format!("http://{addr}/slow")).await.unwrap();
        assert_eq!(response.status(), reqwest::StatusCode::REQUEST_TIMEOUT);
        assert_eq!(response.headers()["content-type"], "application/json");
        let body: serde_json::Value = response.json().await.unwrap();
        let error = body["error"].as_str().unwrap();
        assert!(
            error.contains("GET /slow") && error.contains("30 s"),
            "{error}"
        );
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    }
}
