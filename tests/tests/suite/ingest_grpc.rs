//! The ingest protocol over real gRPC on loopback: acks, replays, and bad
//! input from agents.

use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_client::IngestClient;
use headroom_tests::fixtures::{self, BOOT, GIB, GPU0, NODE, now_ms};
use headroom_tests::harness::RunningCollector;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

struct Fixture {
    collector: RunningCollector,
    store: std::sync::Arc<dyn headroom_store::Store>,
    _dir: tempfile::TempDir,
}

async fn collector() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ingest.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    Fixture {
        collector: RunningCollector::start(store.clone()).await,
        store,
        _dir: dir,
    }
}

async fn client(c: &RunningCollector) -> IngestClient<Channel> {
    IngestClient::connect(c.grpc_url()).await.unwrap()
}

/// Sends `batches` on one stream and collects the answers until the stream
/// ends or `expect` answers arrived.
async fn exchange(
    client: &mut IngestClient<Channel>,
    batches: Vec<pb::Batch>,
    expect: usize,
) -> Vec<Result<u64, tonic::Status>> {
    let (tx, rx) = mpsc::channel(16);
    for b in batches {
        tx.send(b).await.unwrap();
    }
    let mut answers = vec![];
    let mut acks = match client.stream(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => return vec![Err(status)],
    };
    while answers.len() < expect {
        match acks.message().await {
            // Taken in; its samples may still wait in open chunks.
            Ok(Some(ack)) => answers.push(Ok(ack.accepted_seq)),
            Ok(None) => break,
            Err(status) => {
                answers.push(Err(status));
                break;
            }
        }
    }
    drop(tx);
    answers
}

fn expect_error(answers: &[Result<u64, tonic::Status>], code: Code, needle: &str) {
    let status = answers
        .iter()
        .find_map(|a| a.as_ref().err())
        .unwrap_or_else(|| panic!("expected {code:?}, got {answers:?}"));
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(needle),
        "{:?} lacks {needle:?}",
        status.message()
    );
}

async fn samples_at(c: &RunningCollector, uuid: &str, ts: i64) -> i64 {
    let series = c
        .get_json(&format!(
            "/api/v1/gpus/{uuid}/series?from={}&to={}",
            ts - 1,
            ts + 1
        ))
        .await;
    series["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["samples"].as_i64().unwrap())
        .sum()
}

#[tokio::test]
async fn batch_before_register_is_refused() {
    let f = collector().await;
    let mut client = client(&f.collector).await;
    let answers = exchange(&mut client, vec![fixtures::batch(1, now_ms())], 1).await;
    expect_error(&answers, Code::FailedPrecondition, "before Register");
    f.collector.stop().await;
}

#[tokio::test]
async fn acks_follow_commits_and_a_replayed_batch_is_stored_once() {
    let f = collector().await;
    let mut client = client(&f.collector).await;
    let reg = client
        .register(fixtures::register(NODE, BOOT))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reg.committed_seq, 0);
    let ts = now_ms() - 3000;
    let answers = exchange(
        &mut client,
        vec![fixtures::batch(1, ts), fixtures::batch(2, ts + 1000)],
        2,
    )
    .await;
    assert_eq!(
        answers
            .iter()
            .map(|a| *a.as_ref().unwrap())
            .collect::<Vec<_>>(),
        vec![1, 2]
    );

    // A flush writes their samples; the agent lost the acks and replays
    // both on a new connection.
    f.store.flush(true).await.unwrap();
    let mut client = self::client(&f.collector).await;
    let reg = client
        .register(fixtures::register(NODE, BOOT))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        reg.committed_seq, 2,
        "Register tells the agent what is already stored"
    );
    let answers = exchange(
        &mut client,
        vec![
            fixtures::batch(1, ts),
            fixtures::batch(2, ts + 1000),
            fixtures::batch(3, ts + 2000),
        ],
        3,
    )
    .await;
    assert_eq!(
        answers
            .iter()
            .map(|a| *a.as_ref().unwrap())
            .collect::<Vec<_>>(),
        vec![2, 2, 3]
    );
    assert_eq!(samples_at(&f.collector, GPU0, ts).await, 1);
    assert_eq!(samples_at(&f.collector, GPU0, ts + 1000).await, 1);
    assert_eq!(samples_at(&f.collector, GPU0, ts + 2000).await, 1);
    f.collector.stop().await;
}

#[tokio::test]
async fn bad_batches_are_rejected_by_name_without_harming_accepted_data_or_other_agents() {
    let f = collector().await;
    let mut client = client(&f.collector).await;
    client
        .register(fixtures::register(NODE, BOOT))
        .await
        .unwrap();
    client
        .register(fixtures::register_other_node())
        .await
        .unwrap();
    let ts = now_ms() - 2000;
    assert!(exchange(&mut client, vec![fixtures::batch(1, ts)], 1).await[0].is_ok());

    let mut used_over_total = fixtures::batch(2, ts + 1000);
    used_over_total.gpu_samples[0].memory_used_max_bytes = 81 * GIB;
    let answers = exchange(&mut client, vec![used_over_total], 1).await;
    expect_error(&answers, Code::InvalidArgument, "memory_used_max_bytes");

    let future = fixtures::batch(2, now_ms() + 3_600_000);
    let answers = exchange(&mut client, vec![future], 1).await;
    expect_error(
        &answers,
        Code::InvalidArgument,
        "ahead of the collector's clock",
    );

    let mut huge_name = fixtures::batch(2, ts + 1000);
    huge_name.process_samples[0].name = "x".repeat(1 << 20);
    let answers = exchange(&mut client, vec![huge_name], 1).await;
    expect_error(&answers, Code::InvalidArgument, "name of pid 777");

    let mut unknown_gpu = fixtures::batch(2, ts + 1000);
    unknown_gpu.gpu_samples[0].uuid = "GPU-not-registered".into();
    let answers = exchange(&mut client, vec![unknown_gpu], 1).await;
    expect_error(&answers, Code::InvalidArgument, "GPU-not-registered");

    let mut negative_start = fixtures::batch(2, ts + 1000);
    negative_start.process_samples[0].start_time_ms = -5;
    let answers = exchange(&mut client, vec![negative_start], 1).await;
    expect_error(&answers, Code::InvalidArgument, "start_time_ms");

    let mut bad_label = fixtures::batch(2, ts + 1000);
    bad_label.process_samples[0]
        .pod_labels
        .insert("team name".into(), "vision".into());
    let answers = exchange(&mut client, vec![bad_label], 1).await;
    expect_error(
        &answers,
        Code::InvalidArgument,
        "key \"team name\" is not a Kubernetes label key",
    );

    // Another agent streams on, and this one resumes with a good batch.
    let other = fixtures::other_node_batch(1, ts + 1000);
    assert_eq!(
        *exchange(&mut client, vec![other], 1).await[0]
            .as_ref()
            .unwrap(),
        1
    );
    assert_eq!(
        *exchange(&mut client, vec![fixtures::batch(2, ts + 1000)], 1).await[0]
            .as_ref()
            .unwrap(),
        2
    );
    assert_eq!(
        samples_at(&f.collector, GPU0, ts).await,
        1,
        "accepted data is intact"
    );
    assert_eq!(samples_at(&f.collector, GPU0, ts + 1000).await, 1);
    f.collector.stop().await;
}

#[tokio::test]
async fn bad_registrations_are_rejected_by_name() {
    let f = collector().await;
    let mut client = client(&f.collector).await;
    let mut empty_node = fixtures::register(NODE, BOOT);
    empty_node.node.clear();
    let err = client.register(empty_node).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("node is empty"), "{}", err.message());

    let mut mig_too_big = fixtures::register(NODE, BOOT);
    mig_too_big.gpus[2]
        .mig_instances
        .push(fixtures::mig("MIG-third", 3));
    let err = client.register(mig_too_big).await.unwrap_err();
    assert!(err.message().contains("add up to"), "{}", err.message());

    let mut twice = fixtures::register(NODE, BOOT);
    twice.gpus[1].uuid = twice.gpus[0].uuid.clone();
    let err = client.register(twice).await.unwrap_err();
    assert!(err.message().contains("appears twice"), "{}", err.message());
    f.collector.stop().await;
}

/// What the API answers a bad request at `path`: a 400 whose JSON names
/// the problem in `error`.
async fn refused(collector: &RunningCollector, path: &str) -> String {
    let r = reqwest::get(collector.api(path)).await.unwrap();
    assert_eq!(r.status(), 400, "{path}");
    let body: serde_json::Value = r.json().await.unwrap();
    body["error"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn api_rejects_bad_ranges_and_unknown_devices_clearly() {
    let f = collector().await;
    let mut client = client(&f.collector).await;
    client
        .register(fixtures::register(NODE, BOOT))
        .await
        .unwrap();
    let error = refused(
        &f.collector,
        &format!("/api/v1/gpus/{GPU0}/series?from=10&to=5"),
    )
    .await;
    assert!(
        error.contains("`from` (10) must be before `to` (5)"),
        "{error}"
    );
    let error = refused(
        &f.collector,
        &format!("/api/v1/gpus/{GPU0}/series?from=abc"),
    )
    .await;
    assert!(error.contains("from"), "{error}");
    let r = reqwest::get(f.collector.api("/api/v1/gpus/GPU-nope/series"))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // The fleet's history takes the same range parameters.
    let r = reqwest::get(f.collector.api("/api/v1/fleet/history?max_points=100"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["points"].is_array(), "{body}");
    assert!(body["to"].as_i64() > body["from"].as_i64(), "{body}");
    let error = refused(&f.collector, "/api/v1/fleet/history?from=10&to=5").await;
    assert!(
        error.contains("`from` (10) must be before `to` (5)"),
        "{error}"
    );
    refused(&f.collector, "/api/v1/fleet/history?max_points=0").await;
    f.collector.stop().await;
}

/// Samples wait in open chunks: each ack says the batch is accepted but
/// not yet durable; once a flush writes them, the stream hears so without
/// sending anything more, and a new connection's Register answers the
/// durable mark. A batch accepted but not durable is replayed after the
/// collector that held it dies.
#[tokio::test]
async fn acks_carry_the_accepted_and_the_durable_mark_on_postgres() {
    let Some(db) = headroom_tests::postgres::fresh_database().await else {
        return;
    };
    acks_carry_the_accepted_and_the_durable_mark(&db.url).await;
    db.drop_database().await;
}

#[tokio::test]
async fn acks_carry_the_accepted_and_the_durable_mark_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("acks.db").display());
    acks_carry_the_accepted_and_the_durable_mark(&url).await;
}

async fn acks_carry_the_accepted_and_the_durable_mark(url: &str) {
    let storage = headroom_store::rollup::StorageConfig {
        chunk_flush_s: 2,
        ..Default::default()
    };
    let store = headroom_store::connect_with(url, storage.clone())
        .await
        .unwrap();
    let collector = RunningCollector::start(store.clone()).await;
    let mut client = client(&collector).await;
    client
        .register(fixtures::register(NODE, BOOT))
        .await
        .unwrap();
    let ts = now_ms() - 3000;
    let (tx, rx) = mpsc::channel(16);
    tx.send(fixtures::batch(1, ts)).await.unwrap();
    tx.send(fixtures::batch(2, ts + 1000)).await.unwrap();
    let mut acks = client
        .stream(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut marks = vec![];
    for _ in 0..2 {
        let ack = acks.message().await.unwrap().unwrap();
        marks.push((ack.accepted_seq, ack.committed_seq));
    }
    assert_eq!(marks, [(1, 0), (2, 0)], "accepted, nothing durable yet");
    // The chart shows them already, from the open chunks.
    assert_eq!(samples_at(&collector, GPU0, ts + 1000).await, 1);
    let flushed = tokio::time::timeout(std::time::Duration::from_secs(10), acks.message())
        .await
        .expect("an ack once the flush wrote the samples")
        .unwrap()
        .unwrap();
    assert_eq!((flushed.accepted_seq, flushed.committed_seq), (2, 2));

    // Batch 3 is accepted, then its collector dies with it in open chunks.
    tx.send(fixtures::batch(3, ts + 2000)).await.unwrap();
    let ack = acks.message().await.unwrap().unwrap();
    assert_eq!((ack.accepted_seq, ack.committed_seq), (3, 2));
    drop(tx);
    collector.stop().await;
    drop(store);
    let store = headroom_store::connect_with(url, storage).await.unwrap();
    let collector = RunningCollector::start(store.clone()).await;
    let mut client = self::client(&collector).await;
    let reg = client
        .register(fixtures::register(NODE, BOOT))
        .await
        .unwrap()
        .into_inner();
    // 2 unless a flush came between the ack and the stop (a slow machine).
    assert!(
        [2, 3].contains(&reg.committed_seq),
        "Register answers the durable mark: {}",
        reg.committed_seq
    );
    let answers = exchange(&mut client, vec![fixtures::batch(3, ts + 2000)], 1).await;
    assert!(answers[0].is_ok(), "{answers:?}");
    assert_eq!(samples_at(&collector, GPU0, ts + 2000).await, 1);
    collector.stop().await;
    store.close().await;
}
