//! The HTTP side's defences a browser and a careless client meet: security
//! headers on every response (the page may load only its own scripts and
//! may not be framed), and a request body over the limit refused before it
//! is read.

use headroom_collector::http::MAX_REQUEST_BODY_BYTES;
use headroom_tests::fixtures::now_ms;
use headroom_tests::harness::RunningCollector;
use serde_json::json;

async fn collector() -> (RunningCollector, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("http.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    (RunningCollector::start(store).await, dir)
}

#[tokio::test]
async fn every_response_carries_the_security_headers() {
    let (c, _dir) = collector().await;
    for path in ["/", "/api/v1/gpus", "/assets/app.js", "/no/such/page"] {
        let response = reqwest::get(c.api(path)).await.unwrap();
        let headers = response.headers();
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"),
            "{path}: {csp}"
        );
        assert_eq!(headers["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(headers["x-frame-options"], "DENY", "{path}");
        assert_eq!(headers["referrer-policy"], "no-referrer", "{path}");
    }
    c.stop().await;
}

#[tokio::test]
async fn an_oversized_body_is_refused_and_a_normal_one_accepted() {
    let (c, _dir) = collector().await;
    let client = reqwest::Client::new();
    let silence = |comment: String| {
        json!({
            "matchers": { "node": "gpu-node-01" },
            "comment": comment,
            "created_by": "ops",
            "ends_at_ms": now_ms() + 3_600_000,
        })
    };
    let huge = client
        .post(c.api("/api/v1/silences"))
        .json(&silence("x".repeat(MAX_REQUEST_BODY_BYTES + 1)))
        .send()
        .await
        .unwrap();
    assert_eq!(huge.status(), reqwest::StatusCode::PAYLOAD_TOO_LARGE);
    let normal = client
        .post(c.api("/api/v1/silences"))
        .json(&silence("maintenance window".into()))
        .send()
        .await
        .unwrap();
    assert_eq!(normal.status(), reqwest::StatusCode::CREATED);
    c.stop().await;
}
