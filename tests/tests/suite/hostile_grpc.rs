//! What one sender can do to the collector over gRPC, and what it cannot:
//! lose an honest node's big batches, poison a stream's numbering, take
//! another node's GPU, grow the inventory without bound, claim more memory
//! than a GPU has, flood the logs with its own input, or hold connections
//! it never uses. Each probe runs on loopback against a real collector.

use std::time::Duration;

use headroom_agent::AgentSettings;
use headroom_agent::source::SimSource;
use headroom_collector::Collector;
use headroom_collector::ingest::validate::Limits;
use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_client::IngestClient;
use headroom_sim::Scenario;
use headroom_store::Store;
use headroom_store::tokens::TokenRole;
use headroom_tests::fixtures::{self, BOOT, GIB, GPU0, NODE, OTHER_NODE, now_ms};
use headroom_tests::harness::{RunningCollector, eventually, sim_agent_settings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

struct Fixture {
    collector: RunningCollector,
    store: std::sync::Arc<dyn Store>,
    _dir: tempfile::TempDir,
}

async fn collector_with(limits: Limits, require_tokens: bool) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("hostile.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    let collector = Collector::builder(store.clone())
        .limits(limits)
        .require_agent_tokens(require_tokens)
        .build()
        .await
        .unwrap();
    Fixture {
        collector: RunningCollector::start_collector(collector).await,
        store,
        _dir: dir,
    }
}

async fn client(c: &RunningCollector) -> IngestClient<Channel> {
    IngestClient::connect(c.grpc_url()).await.unwrap()
}

fn with_token<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        let value: MetadataValue<_> = format!("Bearer {token}").parse().unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// Sends `batches` on one stream; the acks, then the status that ended it.
async fn send(
    client: &mut IngestClient<Channel>,
    batches: Vec<pb::Batch>,
    token: Option<&str>,
) -> (Vec<u64>, Option<tonic::Status>) {
    let (tx, rx) = mpsc::channel(batches.len().max(1));
    let expected = batches.len();
    for b in batches {
        tx.send(b).await.unwrap();
    }
    let mut acks = match client
        .stream(with_token(ReceiverStream::new(rx), token))
        .await
    {
        Ok(r) => r.into_inner(),
        Err(status) => return (vec![], Some(status)),
    };
    let mut acked = vec![];
    let ended = loop {
        if acked.len() == expected {
            break None;
        }
        match tokio::time::timeout(Duration::from_secs(20), acks.message()).await {
            // Taken in; its samples may still wait in open chunks.
            Ok(Ok(Some(ack))) => acked.push(ack.accepted_seq),
            Ok(Ok(None)) => break None,
            Ok(Err(status)) => break Some(status),
            Err(_) => panic!("no answer within 20 s after acks {acked:?}"),
        }
    };
    drop(tx);
    (acked, ended)
}

async fn gpu_samples_stored(c: &RunningCollector, uuid: &str, ts: i64) -> usize {
    let series = c
        .get_json(&format!(
            "/api/v1/gpus/{uuid}/series?from={}&to={}",
            ts - 1,
            ts + 1
        ))
        .await;
    series["points"].as_array().map_or(0, Vec::len)
}

#[tokio::test]
async fn a_batch_over_the_message_limit_is_refused_with_resource_exhausted_not_dropped_in_silence()
{
    let limits = Limits {
        max_message_bytes: 4 << 20,
        ..Limits::default()
    };
    let f = collector_with(limits, false).await;
    let mut c = client(&f.collector).await;
    c.register(fixtures::register(NODE, BOOT)).await.unwrap();
    let ts = now_ms() - 5_000;
    let mut big = fixtures::batch(2, ts + 1_000);
    big.process_samples = (0..1_120)
        .map(|pid| pb::ProcessSample {
            name: "x".repeat(4_000),
            ..fixtures::process_sample(GPU0, ts + 1_000, pid + 1, GIB / 64)
        })
        .collect();
    let (acked, ended) = send(&mut c, vec![fixtures::batch(1, ts), big], None).await;
    assert_eq!(acked, vec![1], "the batch before the big one is stored");
    let status = ended.expect("the stream ends with a status");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("max_message_bytes"), "{status:?}");
    // The stream is not poisoned: the next batch on a new stream is stored.
    let (acked, ended) = send(&mut c, vec![fixtures::batch(3, ts + 2_000)], None).await;
    assert_eq!((acked, ended.map(|s| s.code())), (vec![3], None));
    assert_eq!(gpu_samples_stored(&f.collector, GPU0, ts + 2_000).await, 1);
}

/// 1,120 processes with 4 KB command lines on one 8-GPU node, against a
/// collector that decodes at most 4 MiB (the smallest it may be set to):
/// the agent cuts each interval's 4.6 MB batch into parts and every
/// process arrives; none is dropped and the agent does not loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_a_thousand_long_command_lines_gets_all_of_them_stored() {
    let limits = Limits {
        max_message_bytes: 4 << 20,
        ..Limits::default()
    };
    let f = collector_with(limits, false).await;
    let command = format!("python serve.py {}", "--flag=value ".repeat(306));
    assert!(command.len() > 3_900 && command.len() <= 4_096);
    let mut scenario = String::from("seed = 1\n[[node]]\nname = \"big-node\"\n");
    for gpu in 0..8 {
        scenario.push_str(
            "[[node.gpu]]\nmodel = \"NVIDIA H100 80GB HBM3\"\nmemory_total = \"81559MiB\"\n",
        );
        for p in 0..140 {
            scenario.push_str(&format!(
                "[[node.gpu.process]]\npid = {}\nname = {command:?}\nuser = \"svc\"\nmemory = {{ shape = \"steady\", level = \"256MiB\" }}\n",
                10_000 + gpu * 1_000 + p
            ));
        }
    }
    let scenario = Scenario::from_toml_str(&scenario).unwrap();
    let agent = headroom_agent::start(
        AgentSettings {
            poll_interval: Duration::from_millis(100),
            sample_interval: Duration::from_millis(1_000),
            metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
            ..sim_agent_settings(f.collector.grpc_url(), "big-node")
        },
        Box::new(SimSource::new(&scenario, "big-node").unwrap()),
    )
    .unwrap();
    eventually(
        "all 1,120 processes stored",
        Duration::from_secs(60),
        || async {
            let processes = f.collector.get_json("/api/v1/processes").await;
            let stored = processes.as_array().map_or(0, |all| {
                all.iter().filter(|p| p["node"] == "big-node").count()
            });
            (stored == 1_120).then_some(())
        },
    )
    .await;
    let metrics = reqwest::get(format!("http://{}/metrics", agent.metrics_addr().unwrap()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let dropped = metrics
        .lines()
        .find(|l| l.starts_with("headroom_agent_dropped_batches_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap();
    assert_eq!(dropped, "0", "no batch was refused:\n{metrics}");
    agent.stop().await;
}

#[tokio::test]
async fn a_sequence_number_far_ahead_is_refused_and_the_stream_keeps_storing() {
    let f = collector_with(Limits::default(), false).await;
    let mut c = client(&f.collector).await;
    c.register(fixtures::register(NODE, BOOT)).await.unwrap();
    let ts = now_ms() - 10_000;
    for forged in [u64::MAX, 1 << 63, 10_000_001] {
        let poison = pb::Batch {
            gpu_samples: vec![],
            process_samples: vec![],
            ..fixtures::batch(forged, ts)
        };
        let (acked, ended) = send(&mut c, vec![poison], None).await;
        let status = ended.unwrap_or_else(|| panic!("seq {forged} was acked: {acked:?}"));
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    }
    // The real batches that follow are stored, not taken for replays.
    let (acked, _) = send(
        &mut c,
        vec![fixtures::batch(1, ts), fixtures::batch(2, ts + 1_000)],
        None,
    )
    .await;
    assert_eq!(acked, vec![1, 2]);
    assert_eq!(gpu_samples_stored(&f.collector, GPU0, ts + 1_000).await, 1);
}

#[tokio::test]
async fn a_node_token_cannot_take_another_nodes_gpu() {
    let f = collector_with(Limits::default(), true).await;
    let (_, victim_token) =
        fixtures::enrol_token(&*f.store, TokenRole::Agent, Some(NODE), None).await;
    let (_, thief_token) =
        fixtures::enrol_token(&*f.store, TokenRole::Agent, Some(OTHER_NODE), None).await;
    let mut c = client(&f.collector).await;
    c.register(with_token(
        fixtures::register(NODE, BOOT),
        Some(&victim_token),
    ))
    .await
    .unwrap();
    // The thief names the victim's GPU in its own inventory.
    let mut claim = fixtures::register_other_node();
    claim.gpus[0].uuid = GPU0.into();
    let refused = c
        .register(with_token(claim.clone(), Some(&thief_token)))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains(NODE), "{refused:?}");
    // Nor can it write to it by naming the GPU in a batch.
    c.register(with_token(
        fixtures::register_other_node(),
        Some(&thief_token),
    ))
    .await
    .unwrap();
    let ts = now_ms() - 5_000;
    let mut fake = fixtures::other_node_batch(1, ts);
    fake.gpu_samples[0].uuid = GPU0.into();
    fake.gpu_samples[0].memory_used_last_bytes = 79 * GIB;
    let (_, ended) = send(&mut c, vec![fake], Some(&thief_token)).await;
    assert_eq!(ended.map(|s| s.code()), Some(Code::InvalidArgument));
    let gpus = f.collector.get_json("/api/v1/gpus").await;
    let owner = gpus
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["uuid"] == GPU0)
        .map(|g| g["node"].clone());
    assert_eq!(owner, Some(serde_json::json!(NODE)));
    assert_eq!(gpu_samples_stored(&f.collector, GPU0, ts).await, 0);
    // Once the operator releases it (the GPU really moved), it may move.
    assert_eq!(
        f.store.release_device(GPU0, now_ms()).await.unwrap(),
        Some(NODE.to_owned())
    );
    c.register(with_token(claim, Some(&thief_token)))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_gpu_leaves_its_node_when_the_node_stops_listing_it() {
    let f = collector_with(Limits::default(), false).await;
    let mut c = client(&f.collector).await;
    c.register(fixtures::register(NODE, BOOT)).await.unwrap();
    let mut moved = fixtures::register_other_node();
    moved.gpus[0].uuid = GPU0.into();
    assert_eq!(
        c.register(moved.clone()).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    // The old node re-registers without it (it was pulled from the host).
    let mut without = fixtures::register(NODE, "boot-b");
    without.gpus.retain(|g| g.uuid != GPU0);
    c.register(without).await.unwrap();
    c.register(moved).await.unwrap();
}

#[tokio::test]
async fn registrations_with_ever_new_devices_stop_at_the_node_budget() {
    let limits = Limits {
        max_devices_per_node: 600,
        ..Limits::default()
    };
    let f = collector_with(limits, false).await;
    let mut c = client(&f.collector).await;
    let flood = |round: usize| pb::RegisterRequest {
        gpus: (0..256)
            .map(|g| pb::Gpu {
                uuid: format!("GPU-flood-{round}-{g}"),
                index: g,
                name: "fake".into(),
                memory_total_bytes: 80 * GIB,
                ..Default::default()
            })
            .collect(),
        ..fixtures::register(NODE, &format!("boot-{round}"))
    };
    c.register(flood(0)).await.unwrap();
    c.register(flood(1)).await.unwrap();
    let refused = c.register(flood(2)).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("max_devices_per_node"),
        "{refused:?}"
    );
    // Registering devices already on record is not growth: it goes through.
    c.register(flood(1)).await.unwrap();
    let nodes = f.collector.get_json("/api/v1/nodes").await;
    assert_eq!(nodes[0]["gpu_count"], 256);
}

#[tokio::test]
async fn a_process_holding_more_than_its_gpu_is_refused() {
    let f = collector_with(Limits::default(), false).await;
    let mut c = client(&f.collector).await;
    c.register(fixtures::register(NODE, BOOT)).await.unwrap();
    let mut b = fixtures::batch(1, now_ms() - 5_000);
    b.process_samples[0].memory_used_last_bytes = 200 * GIB;
    b.process_samples[0].memory_used_max_bytes = 200 * GIB;
    let (acked, ended) = send(&mut c, vec![b], None).await;
    assert!(acked.is_empty());
    let status = ended.unwrap();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("memory_total_bytes"),
        "{status:?}"
    );
}

#[tokio::test]
async fn a_megabyte_of_node_name_is_not_echoed_back() {
    let f = collector_with(Limits::default(), false).await;
    let mut c = client(&f.collector).await;
    let mut req = fixtures::register(NODE, BOOT);
    req.node = "n".repeat(1 << 20);
    let refused = c.register(req).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().len() < 400,
        "{} bytes echoed",
        refused.message().len()
    );
    assert!(refused.message().contains("1048576 bytes"), "{refused:?}");
}

#[tokio::test]
async fn connections_that_say_nothing_are_closed() {
    let limits = Limits {
        grpc_idle_timeout_s: 1,
        ..Limits::default()
    };
    let f = collector_with(limits, false).await;
    let mut silent = tokio::net::TcpStream::connect(f.collector.grpc_addr)
        .await
        .unwrap();
    let mut preface_only = tokio::net::TcpStream::connect(f.collector.grpc_addr)
        .await
        .unwrap();
    preface_only
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    for (what, conn) in [("silent", &mut silent), ("preface only", &mut preface_only)] {
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            let mut buf = [0u8; 1024];
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "the {what} connection is still open after 10 s"
        );
    }
    // A connection in use stays up past the timeout.
    let mut c = client(&f.collector).await;
    c.register(fixtures::register(NODE, BOOT)).await.unwrap();
    let ts = now_ms() - 10_000;
    for seq in 1..=3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let (acked, _) = send(&mut c, vec![fixtures::batch(seq, ts + seq as i64)], None).await;
        assert_eq!(acked, vec![seq]);
    }
}

#[tokio::test]
async fn one_connection_gets_only_so_many_streams_at_once() {
    let limits = Limits {
        max_streams_per_connection: 2,
        ..Limits::default()
    };
    let f = collector_with(limits, false).await;
    let channel = Channel::from_shared(f.collector.grpc_url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = IngestClient::new(channel);
    c.register(fixtures::register(NODE, BOOT)).await.unwrap();
    let mut open = vec![];
    for _ in 0..2 {
        let (tx, rx) = mpsc::channel::<pb::Batch>(1);
        let acks = c.stream(ReceiverStream::new(rx)).await.unwrap();
        open.push((tx, acks));
    }
    let (_tx, rx) = mpsc::channel::<pb::Batch>(1);
    let third = tokio::time::timeout(
        Duration::from_millis(1_500),
        c.clone().stream(ReceiverStream::new(rx)),
    )
    .await;
    assert!(third.is_err(), "a third stream opened on one connection");
    open.pop();
    let (_tx, rx) = mpsc::channel::<pb::Batch>(1);
    tokio::time::timeout(Duration::from_secs(10), c.stream(ReceiverStream::new(rx)))
        .await
        .expect("a stream opens once another closed")
        .unwrap();
}

/// The operator's way out when a GPU really moved while its old host is
/// down: `release-device`, on the database `serve` uses.
#[tokio::test]
async fn release_device_lets_a_moved_gpu_register_on_its_new_node() {
    let f = collector_with(Limits::default(), false).await;
    let mut c = client(&f.collector).await;
    c.register(fixtures::register(NODE, BOOT)).await.unwrap();
    let url = format!("sqlite://{}", f._dir.path().join("hostile.db").display());
    // Async, so the collector in this test's one-thread runtime keeps
    // running: a blocking wait could freeze it inside a write transaction
    // while the command waits for SQLite's write lock.
    let release = |uuid: &str| {
        tokio::process::Command::new(headroom_tests::harness::built("headroom-collector"))
            .args(["release-device", uuid, "--database-url", &url])
            .output()
    };
    let unknown = release("GPU-nobody").await.unwrap();
    assert!(!unknown.status.success());
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("no device has UUID \"GPU-nobody\""),
        "{unknown:?}"
    );
    let released = release(GPU0).await.unwrap();
    assert!(released.status.success(), "{released:?}");
    assert!(String::from_utf8_lossy(&released.stdout).contains(NODE));
    let mut moved = fixtures::register_other_node();
    moved.gpus[0].uuid = GPU0.into();
    c.register(moved).await.unwrap();
}
