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

#[tokio::test]
async fn an_oversized_chunked_body_is_refused_with_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (c, _dir) = collector().await;
    // No Content-Length: the size is found out only while reading.
    let mut stream = tokio::net::TcpStream::connect(c.http_addr).await.unwrap();
    let head = "POST /api/v1/silences HTTP/1.1\r\nHost: 127.0.0.1\r\n\
                Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\
                Connection: close\r\n\r\n";
    stream.write_all(head.as_bytes()).await.unwrap();
    let opening = br#"{"matchers":{"node":"gpu-node-01"},"created_by":"ops","comment":""#;
    let filler = vec![b'x'; 16 * 1024];
    let mut chunks: Vec<&[u8]> = vec![opening];
    chunks.extend(std::iter::repeat_n(
        filler.as_slice(),
        MAX_REQUEST_BODY_BYTES / filler.len() + 1,
    ));
    for chunk in chunks {
        let framed = [format!("{:x}\r\n", chunk.len()).as_bytes(), chunk, b"\r\n"].concat();
        // The server may answer and close before the last chunk.
        if stream.write_all(&framed).await.is_err() {
            break;
        }
    }
    let _ = stream.write_all(b"0\r\n\r\n").await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_end(&mut answer),
    )
    .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.contains("application/json") && answer.contains("limit"),
        "{answer}"
    );
    c.stop().await;
}

#[tokio::test]
async fn every_error_is_json_and_says_what_was_wrong() {
    let (c, _dir) = collector().await;
    let client = reqwest::Client::new();
    let post_json = |path: &str, body: &'static str| {
        client
            .post(c.api(path))
            .header("content-type", "application/json")
            .body(body)
    };
    let cases = [
        (client.get(c.api("/no/such/page")), 404, "/no/such/page"),
        (client.get(c.api("/assets/nothing.js")), 404, "nothing.js"),
        (client.put(c.api("/api/v1/gpus")), 405, "PUT"),
        (
            client.delete(c.api("/api/v1/alerts")),
            405,
            "/api/v1/alerts",
        ),
        (post_json("/api/v1/silences", "{not json"), 400, "JSON"),
        (
            post_json("/api/v1/silences", r#"{"matchers":{}}"#),
            422,
            "missing field",
        ),
        (
            client
                .post(c.api("/api/v1/silences"))
                .header("content-type", "text/plain")
                .body("{}"),
            415,
            "Content-Type",
        ),
        (
            client.get(c.api("/api/v1/gpus/GPU-1/series?max_points=lots")),
            400,
            "max_points",
        ),
        (
            client.get(c.api("/api/v1/alerts?state=sideways")),
            400,
            "sideways",
        ),
        (
            post_json("/api/v1/alerts/first/ack", r#"{"by":"ops"}"#),
            400,
            "first",
        ),
        (client.delete(c.api("/api/v1/silences/x")), 400, "x"),
        (
            client.get(c.api("/api/v1/gpus/GPU-1/processes/pid/allocator")),
            400,
            "pid",
        ),
        (
            client
                .post(c.api("/api/v1/silences"))
                .header("content-type", "application/json")
                .body(vec![b' '; MAX_REQUEST_BODY_BYTES + 1]),
            413,
            "limit",
        ),
    ];
    for (request, status, says) in cases {
        let response = request.send().await.unwrap();
        let what = format!("{} {}", response.status(), response.url().path());
        assert_eq!(response.status().as_u16(), status, "{what}");
        assert_eq!(
            response.headers()["content-type"],
            "application/json",
            "{what}"
        );
        let body: serde_json::Value = response.json().await.unwrap();
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{what}: {body}");
    }
    c.stop().await;
}
