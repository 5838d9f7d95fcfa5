//! The HTTP server against a hostile client (issue 29), over real loopback
//! connections: slow and idle connections are closed, connections and
//! live-stream clients are capped and the stream reads the store once a
//! second for all of them, a request for another host (DNS rebinding) is
//! refused in the open demo mode, and text Postgres cannot hold is refused
//! with 400 on both backends instead of failing as "storage unavailable".
//! The fleet overview asked in a loop costs a store read a second, not one
//! per request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_collector::Collector;
use headroom_collector::http::HttpServerConfig;
use headroom_collector::http::auth::{HttpAuthConfig, HttpAuthMode};
use headroom_collector::ingest::validate::{self, Limits};
use headroom_store::Store;
use headroom_tests::fixtures::{self, now_ms};
use headroom_tests::harness::{RunningCollector, eventually};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn sqlite() -> (Arc<dyn Store>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("hostile.db").display());
    (headroom_store::connect(&url).await.unwrap(), dir)
}

async fn start(store: Arc<dyn Store>, http: HttpServerConfig) -> RunningCollector {
    start_with(store, http, HttpAuthConfig::default()).await
}

async fn start_with(
    store: Arc<dyn Store>,
    http: HttpServerConfig,
    auth: HttpAuthConfig,
) -> RunningCollector {
    let collector = Collector::builder(store)
        .http_server(http)
        .http_auth(auth)
        .build()
        .await
        .unwrap();
    RunningCollector::start_collector(collector).await
}

/// Reads until the server closes the connection; how long that took, or
/// `None` if it was still open after `limit`.
async fn closed_within(
    stream: &mut tokio::net::tcp::OwnedReadHalf,
    limit: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return started.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

#[tokio::test]
async fn a_slow_header_sender_is_cut_off_after_the_header_read_timeout() {
    let (store, _dir) = sqlite().await;
    let c = start(
        store,
        HttpServerConfig {
            header_read_timeout_s: 1,
            ..HttpServerConfig::default()
        },
    )
    .await;
    let (mut read, mut write) = TcpStream::connect(c.http_addr).await.unwrap().into_split();
    write
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    // Slowloris: a header line every 200 ms, never the blank line.
    let trickle = tokio::spawn(async move {
        for i in 0..50 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if write
                .write_all(format!("X-Slow-{i}: x\r\n").as_bytes())
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let took = closed_within(&mut read, Duration::from_secs(8)).await;
    trickle.abort();
    let took = took.expect("a connection trickling headers was still open after 8 s");
    assert!(took < Duration::from_secs(4), "closed only after {took:?}");
    // Meanwhile and after, everyone else is served.
    assert_eq!(
        reqwest::get(c.api("/healthz")).await.unwrap().status(),
        StatusCode::OK
    );
    c.stop().await;
}

#[tokio::test]
async fn idle_connections_are_closed_silent_or_kept_alive() {
    let (store, _dir) = sqlite().await;
    let c = start(
        store,
        HttpServerConfig {
            header_read_timeout_s: 1,
            ..HttpServerConfig::default()
        },
    )
    .await;
    // One that never says anything.
    let (mut silent, _keep) = TcpStream::connect(c.http_addr).await.unwrap().into_split();
    // One that asks once and then keeps the connection open.
    let (mut kept, mut kept_write) = TcpStream::connect(c.http_addr).await.unwrap().into_split();
    kept_write
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 512];
    let n = kept.read(&mut first).await.unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    for (what, stream) in [("silent", &mut silent), ("kept-alive", &mut kept)] {
        let took = closed_within(stream, Duration::from_secs(8))
            .await
            .unwrap_or_else(|| panic!("the {what} connection was still open after 8 s"));
        assert!(
            took < Duration::from_secs(4),
            "{what}: closed after {took:?}"
        );
    }
    c.stop().await;
}

#[tokio::test]
async fn a_stalled_request_body_is_closed_after_the_idle_timeout() {
    let (store, _dir) = sqlite().await;
    let c = start(
        store,
        HttpServerConfig {
            idle_timeout_s: 1,
            ..HttpServerConfig::default()
        },
    )
    .await;
    let (mut read, mut write) = TcpStream::connect(c.http_addr).await.unwrap().into_split();
    // Headers complete, then 10 of the 1,000 body bytes promised, then nothing.
    write
        .write_all(
            b"POST /api/v1/silences HTTP/1.1\r\nHost: 127.0.0.1\r\n\
              Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"matcher",
        )
        .await
        .unwrap();
    let took = closed_within(&mut read, Duration::from_secs(10))
        .await
        .expect("a connection with a stalled body was still open after 10 s");
    assert!(took < Duration::from_secs(5), "closed only after {took:?}");
    drop(write);
    c.stop().await;
}

#[tokio::test]
async fn connections_over_the_limit_are_answered_503_and_closed() {
    let (store, _dir) = sqlite().await;
    let c = start(
        store,
        HttpServerConfig {
            max_connections: 4,
            max_stream_clients: 1,
            ..HttpServerConfig::default()
        },
    )
    .await;
    // Four clients ask once and keep their connections open (keep-alive):
    // each answer proves the server holds that connection.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = TcpStream::connect(c.http_addr).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut answer = [0u8; 512];
        let n = stream.read(&mut answer).await.unwrap();
        assert!(answer[..n].starts_with(b"HTTP/1.1 200"));
        held.push(stream);
    }
    let mut over = TcpStream::connect(c.http_addr).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), over.read_to_end(&mut answer))
        .await
        .expect("the connection over the limit was neither answered nor closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer.contains("application/json") && answer.contains("max_connections"),
        "{answer}"
    );
    drop(held.pop());
    // A slot is free again: served, and the refusal was counted.
    let refused = eventually(
        "a freed connection slot",
        Duration::from_secs(5),
        || async {
            let client = reqwest::Client::new();
            let response = client.get(c.api("/metrics")).send().await.ok()?;
            (response.status() == StatusCode::OK).then_some(response.text().await.ok()?)
        },
    )
    .await;
    let count: f64 = refused
        .lines()
        .find_map(|l| {
            l.strip_prefix("headroom_collector_http_refused_total{reason=\"connections\"} ")
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no refused-connections count:\n{refused}"));
    assert!(count >= 1.0, "{refused}");
    drop(held);
    c.stop().await;
}

#[tokio::test]
async fn live_stream_clients_are_capped_and_share_one_read_a_second() {
    let (store, _dir) = sqlite().await;
    let c = start(
        store,
        HttpServerConfig {
            max_stream_clients: 8,
            ..HttpServerConfig::default()
        },
    )
    .await;
    let client = reqwest::Client::new();
    let reads_before = c
        .metric("headroom_collector_http_stream_fleet_reads_total")
        .await;
    let started = Instant::now();
    let mut streams = Vec::new();
    for _ in 0..8 {
        let mut stream = client.get(c.api("/api/v1/stream")).send().await.unwrap();
        assert_eq!(stream.status(), StatusCode::OK);
        let first = stream.chunk().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("event: snapshot"));
        streams.push(stream);
    }
    let over = client.get(c.api("/api/v1/stream")).send().await.unwrap();
    assert_eq!(over.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(over.headers()["retry-after"], "5");
    let body: Value = over.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("max_stream_clients"),
        "{body}"
    );
    assert_eq!(
        c.metric("headroom_collector_http_stream_clients").await,
        8.0
    );
    // Every client follows for three more events.
    for stream in &mut streams {
        let mut updates = 0;
        while updates < 3 {
            let chunk = stream.chunk().await.unwrap().unwrap();
            updates += String::from_utf8_lossy(&chunk)
                .matches("event: update")
                .count();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let reads = c
        .metric("headroom_collector_http_stream_fleet_reads_total")
        .await
        - reads_before;
    // One read a second for all 8, not 8: with a second's slack each side.
    assert!(
        reads <= seconds.ceil() + 2.0,
        "{reads} fleet reads in {seconds:.1} s for 8 clients"
    );
    // One leaves; its place is given back and a new client gets in.
    drop(streams.pop());
    eventually("a freed stream place", Duration::from_secs(10), || async {
        let response = client.get(c.api("/api/v1/stream")).send().await.ok()?;
        (response.status() == StatusCode::OK).then_some(())
    })
    .await;
    drop(streams);
    c.stop().await;
}

/// GPU0's newest sample time in the overview the API answers.
async fn gpu0_in_overview(c: &RunningCollector) -> Option<i64> {
    let gpus = c.get_json("/api/v1/gpus").await;
    gpus.as_array()?
        .iter()
        .find(|d| d["uuid"] == fixtures::GPU0)?["latest"]["timestamp_ms"]
        .as_i64()
}

#[tokio::test]
async fn the_overview_api_asked_in_a_loop_reads_the_store_once_a_second_and_stays_current() {
    let (store, _dir) = sqlite().await;
    let reg = validate::registration(
        &fixtures::register(fixtures::NODE, fixtures::BOOT),
        &Limits::default(),
    )
    .unwrap();
    let session = store.register(&reg, now_ms()).await.unwrap();
    let write = |seq: u64, ts: i64| {
        let batch = validate::batch(
            fixtures::batch(seq, ts),
            &session,
            now_ms(),
            &Limits::default(),
        )
        .unwrap();
        let store = store.clone();
        async move { store.write_batches(&[batch]).await.unwrap() }
    };
    let first_ts = now_ms() - 1_000;
    write(1, first_ts).await;
    let c = start(store.clone(), HttpServerConfig::default()).await;
    let reads_before = c
        .metric("headroom_collector_http_stream_fleet_reads_total")
        .await;
    // A client (a leaked token, a script gone wrong) asks in a loop.
    let started = Instant::now();
    let mut answers = 0;
    while started.elapsed() < Duration::from_secs(3) {
        assert_eq!(gpu0_in_overview(&c).await, Some(first_ts));
        answers += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    let reads = c
        .metric("headroom_collector_http_stream_fleet_reads_total")
        .await
        - reads_before;
    assert!(answers > 10, "only {answers} answers in {seconds:.1} s");
    // The answers came from the shared fleet reads (the API reads the store
    // no other way): at least one, and one a second at most.
    assert!(
        (1.0..=seconds.ceil() + 2.0).contains(&reads),
        "{reads} store reads for {answers} answers in {seconds:.1} s"
    );
    // A new sample shows within a few seconds, however often it is asked.
    let second_ts = now_ms();
    write(2, second_ts).await;
    eventually(
        "the new sample in the overview",
        Duration::from_secs(5),
        || async { (gpu0_in_overview(&c).await == Some(second_ts)).then_some(()) },
    )
    .await;
    c.stop().await;
}

#[tokio::test]
async fn without_sign_in_a_request_for_another_host_is_refused() {
    let (store, _dir) = sqlite().await;
    let c = start(store, HttpServerConfig::default()).await;
    let client = reqwest::Client::new();
    let port = c.http_addr.port();
    let get = |host: String| {
        client
            .get(c.api("/api/v1/gpus"))
            .header("host", host)
            .send()
    };
    for ok in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
    ] {
        assert_eq!(
            get(ok.clone()).await.unwrap().status(),
            StatusCode::OK,
            "{ok}"
        );
    }
    let rebound = get(format!("attacker.test:{port}")).await.unwrap();
    assert_eq!(rebound.status(), StatusCode::MISDIRECTED_REQUEST);
    let body: Value = rebound.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("attacker.test"),
        "{body}"
    );

    // A page on the rebound name tries to lift a silence.
    let created: Value = client
        .post(c.api("/api/v1/silences"))
        .json(&json!({
            "matchers": { "node": "gpu-node-01" },
            "comment": "maintenance",
            "created_by": "ops",
            "ends_at_ms": now_ms() + 3_600_000,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["id"].as_i64().unwrap();
    let lifted = client
        .delete(c.api(&format!("/api/v1/silences/{id}")))
        .header("host", format!("attacker.test:{port}"))
        .header("origin", format!("http://attacker.test:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(lifted.status(), StatusCode::MISDIRECTED_REQUEST);
    let silences = c.get_json("/api/v1/silences").await;
    assert_eq!(silences.as_array().unwrap().len(), 1, "{silences}");
    c.stop().await;
}

#[tokio::test]
async fn allowed_hosts_add_names_and_apply_in_every_mode() {
    let (store, _dir) = sqlite().await;
    let listed = HttpServerConfig {
        allowed_hosts: vec!["gpu-monitor.example.com".into()],
        ..HttpServerConfig::default()
    };
    let c = start(store.clone(), listed.clone()).await;
    let status = |c: &RunningCollector, host: &str| {
        let request = reqwest::Client::new()
            .get(c.api("/healthz"))
            .header("host", host.to_owned());
        async move { request.send().await.unwrap().status() }
    };
    assert_eq!(status(&c, "gpu-monitor.example.com").await, StatusCode::OK);
    assert_eq!(
        status(&c, "attacker.test").await,
        StatusCode::MISDIRECTED_REQUEST
    );
    c.stop().await;
    let tokens = HttpAuthConfig {
        mode: HttpAuthMode::Tokens,
        ..HttpAuthConfig::default()
    };
    // Signing in: any name unless a list is given, then only the list's.
    let open = start_with(store.clone(), HttpServerConfig::default(), tokens.clone()).await;
    assert_eq!(status(&open, "anything.example").await, StatusCode::OK);
    open.stop().await;
    let strict = start_with(store, listed, tokens).await;
    assert_eq!(
        status(&strict, "anything.example").await,
        StatusCode::MISDIRECTED_REQUEST
    );
    assert_eq!(
        status(&strict, "gpu-monitor.example.com").await,
        StatusCode::OK
    );
    strict.stop().await;
}

/// Text the store cannot hold or a log should not: refused with 400 naming
/// the field, and nothing stored.
async fn refuses_unstorable_text(c: &RunningCollector, backend: &str) {
    let client = reqwest::Client::new();
    let silence = |matcher: &str, comment: &str, created_by: &str| {
        json!({
            "matchers": { "node": matcher },
            "comment": comment,
            "created_by": created_by,
            "ends_at_ms": now_ms() + 3_600_000,
        })
    };
    for (body, field) in [
        (silence("gpu-node-01", "nul \0 here", "ops"), "comment"),
        (silence("gpu-node-01", "fine", "ops\0"), "created_by"),
        (silence("gpu-node-01", "fine", "ops\nroot"), "created_by"),
        (silence("gpu\0node", "fine", "ops"), "matchers"),
        (silence("gpu-node-01", "bell \u{7}", "ops"), "comment"),
    ] {
        let response = client
            .post(c.api("/api/v1/silences"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            StatusCode::BAD_REQUEST,
            "{backend}: {body}"
        );
        let error: Value = response.json().await.unwrap();
        assert!(
            error["error"].as_str().unwrap().contains(field),
            "{backend}: {error}"
        );
    }
    let ack = client
        .post(c.api("/api/v1/alerts/1/ack"))
        .json(&json!({ "by": "ops\0" }))
        .send()
        .await
        .unwrap();
    assert_eq!(ack.status(), StatusCode::BAD_REQUEST, "{backend}");
    for path in [
        "/api/v1/gpus/GPU-%00/series",
        "/api/v1/gpus/GPU-%00/events",
        "/api/v1/gpus/GPU-%00/processes/series",
        "/api/v1/gpus/GPU-%00/processes/1/allocator",
    ] {
        let response = client.get(c.api(path)).send().await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::BAD_REQUEST,
            "{backend}: {path}"
        );
        let error: Value = response.json().await.unwrap();
        assert!(error["error"].as_str().unwrap().contains("uuid"), "{error}");
    }
    let silences = c.get_json("/api/v1/silences").await;
    assert_eq!(silences, json!([]), "{backend}: stored anyway");
    // A comment over several lines is still fine.
    let multi = client
        .post(c.api("/api/v1/silences"))
        .json(&silence("gpu-node-01", "line one\nline two", "ops"))
        .send()
        .await
        .unwrap();
    assert_eq!(multi.status(), StatusCode::CREATED, "{backend}");
}

#[tokio::test]
async fn text_with_nul_is_refused_with_400_on_sqlite() {
    let (store, _dir) = sqlite().await;
    let c = start(store, HttpServerConfig::default()).await;
    refuses_unstorable_text(&c, "SQLite").await;
    c.stop().await;
}

#[tokio::test]
async fn text_with_nul_is_refused_with_400_on_postgres() {
    let Some(db) = headroom_tests::postgres::fresh_database().await else {
        return;
    };
    let store = headroom_store::connect(&db.url).await.unwrap();
    let c = start(store, HttpServerConfig::default()).await;
    refuses_unstorable_text(&c, "Postgres").await;
    c.stop().await;
    db.drop_database().await;
}
