//! OOM early warning end to end: simulated memory crosses the watermark, the
//! collector's rules fire, and a real HTTP receiver gets a signed webhook;
//! the outbox survives a crash and delivers exactly once.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use headroom_agent::source::SimSource;
use headroom_agent::{AgentHandle, AgentSettings};
use headroom_collector::Collector;
use headroom_rules::config::RulesConfig;
use headroom_sim::Scenario;
use headroom_store::Store;
use headroom_tests::harness::{RunningCollector, eventually};
use headroom_tests::postgres;
use headroom_tests::receiver::{Received, Receiver};
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;

const SECRET: &str = "s3cret-for-tests";

/// 70 GiB growing 2 GiB/s on an 80 GiB GPU: over 90 % within a second,
/// out of memory in five; then the job dies and memory falls.
pub(crate) const SCENARIO: &str = r#"
[[node]]
name = "oom-node"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu.process]]
pid = 31337
name = "python train.py --batch-size 4096"
user = "carol"
slurm_job_id = "555"
memory = { shape = "ramp_to_oom", start = "70GiB", rate_per_min = "120GiB" }
"#;

/// Steady at 92.5 % of the GPU: one warning that stays firing.
const STEADY_HIGH: &str = r#"
[[node]]
name = "oom-node"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu.process]]
pid = 4040
name = "python serve.py"
user = "dave"
memory = { shape = "steady", level = "74GiB" }
"#;

fn rules(receiver: &Receiver) -> RulesConfig {
    RulesConfig::parse(
        &format!(
            "[notify]\ndashboard_url = \"http://headroom.test/\"\n\
             [[notify.webhook]]\nname = \"test-hook\"\nurl = \"{}\"\nsecret = \"{SECRET}\"\n",
            receiver.url()
        ),
        Path::new("test-rules.toml"),
    )
    .unwrap()
}

fn start_agent(collector: &RunningCollector, scenario: &str) -> AgentHandle {
    let scenario = Scenario::from_toml_str(scenario).unwrap();
    headroom_agent::start(
        AgentSettings {
            spool: None,
            tls: None,
            token: None,
            collector_url: collector.grpc_url(),
            node: "oom-node".into(),
            boot_id: "boot-1".into(),
            poll_interval: Duration::from_millis(20),
            sample_interval: Duration::from_millis(200),
            max_pending_batches: 1000,
            flush_above: 0.90,
            metrics_listen: None,
            allocator_socket: None,
            dcgm_metric_names: false,
        },
        Box::new(SimSource::new(&scenario, "oom-node").unwrap()),
    )
    .unwrap()
}

/// Recomputes the signature the way a receiver would, from the documented recipe.
fn assert_signed(r: &Received) {
    let header = |name: &str| r.headers.get(name).unwrap().to_str().unwrap().to_owned();
    let ts = header("x-headroom-timestamp");
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(format!("{ts}.{}", r.body).as_bytes());
    let expected: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(header("x-headroom-signature"), format!("sha256={expected}"));
    let body: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        header("idempotency-key"),
        body["idempotency_key"].as_str().unwrap()
    );
    let age = headroom_tests::fixtures::now_ms() / 1000 - ts.parse::<i64>().unwrap();
    assert!((0..60).contains(&age), "timestamp is current");
}

fn watermark_firings(received: &[Received]) -> Vec<Value> {
    received
        .iter()
        .map(|r| serde_json::from_str::<Value>(&r.body).unwrap())
        .filter(|b| b["alert"]["rule"] == "watermark" && b["status"] == "firing")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ramp_to_oom_sends_a_signed_webhook_that_names_the_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("alerts.db").display());
    let store: Arc<dyn Store> = headroom_store::connect(&url).await.unwrap();
    let receiver = Receiver::start().await;
    let collector = RunningCollector::start_collector(
        Collector::builder(store)
            .rules(rules(&receiver))
            .build()
            .await
            .unwrap(),
    )
    .await;
    let agent = start_agent(&collector, SCENARIO);

    let first = eventually("a watermark webhook", Duration::from_secs(30), || async {
        receiver
            .accepted()
            .into_iter()
            .find(|r| !watermark_firings(std::slice::from_ref(r)).is_empty())
    })
    .await;
    assert_signed(&first);
    let body: Value = serde_json::from_str(&first.body).unwrap();
    assert_eq!(body["version"], 1);
    assert_eq!(body["alert"]["labels"]["node"], "oom-node");
    assert_eq!(body["alert"]["labels"]["gpu"], "0");
    assert!(
        body["alert"]["summary"]
            .as_str()
            .unwrap()
            .contains("GPU 0 on oom-node")
    );
    assert!(body["alert"]["details"]["used_fraction"].as_f64().unwrap() >= 0.9);
    assert!(
        body["dashboard_url"]
            .as_str()
            .unwrap()
            .starts_with("http://headroom.test/?gpu=GPU-")
    );

    // The job dies of OOM (the ramp reaches 80 GiB), memory falls, and the
    // resolution is announced on the same channel, signed too.
    let resolved = eventually("a resolved webhook", Duration::from_secs(30), || async {
        receiver.accepted().into_iter().find(|r| {
            let b: Value = serde_json::from_str(&r.body).unwrap();
            b["alert"]["rule"] == "watermark" && b["status"] == "resolved"
        })
    })
    .await;
    assert_signed(&resolved);

    // The alert's whole life is visible through the API.
    let alerts = collector.get_json("/api/v1/alerts?state=resolved").await;
    assert!(
        alerts
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["rule"] == "watermark"
                && a["fired_at_ms"].is_i64()
                && a["resolved_at_ms"].as_i64() > a["fired_at_ms"].as_i64()),
        "{alerts}"
    );
    agent.stop().await;
    collector.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_survives_a_crash_and_delivers_exactly_once() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let receiver = Receiver::start().await;
    receiver.answer_with(503);
    let store = headroom_store::connect(&db.url).await.unwrap();
    let collector = RunningCollector::start_collector(
        Collector::builder(store.clone())
            .rules(rules(&receiver))
            .build()
            .await
            .unwrap(),
    )
    .await;
    let agent = start_agent(&collector, STEADY_HIGH);
    // The receiver refuses: the notification waits in the outbox.
    eventually("a refused delivery", Duration::from_secs(30), || async {
        (!receiver.received().is_empty()).then_some(())
    })
    .await;
    assert!(store.undelivered_notifications().await.unwrap() >= 1);
    agent.stop().await;
    collector.kill().await;

    // After the crash the receiver is back, and a new collector takes over.
    receiver.answer_with(200);
    let store = headroom_store::connect(&db.url).await.unwrap();
    let collector = RunningCollector::start_collector(
        Collector::builder(store.clone())
            .rules(rules(&receiver))
            .build()
            .await
            .unwrap(),
    )
    .await;
    let agent = start_agent(&collector, STEADY_HIGH);
    eventually(
        "the held notification to arrive",
        Duration::from_secs(30),
        || async {
            (store.undelivered_notifications().await.unwrap() == 0
                && !receiver.accepted().is_empty())
            .then_some(())
        },
    )
    .await;
    // Give a duplicate every chance to show up: more samples over the line,
    // and more outbox rounds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let accepted = receiver.accepted();
    let firings = watermark_firings(&accepted);
    let keys: std::collections::HashSet<_> = firings
        .iter()
        .map(|b| b["idempotency_key"].clone())
        .collect();
    assert_eq!(
        keys.len(),
        firings.len(),
        "no notification delivered twice: {firings:?}"
    );
    assert_eq!(
        firings.len(),
        1,
        "held once, delivered once, not announced again after the restart: {firings:?}"
    );
    assert_eq!(firings[0]["alert"]["severity"], "warning");
    for r in &accepted {
        assert_signed(r);
    }
    agent.stop().await;
    collector.stop().await;
    db.drop_database().await;
}

#[tokio::test]
async fn an_xid_event_becomes_an_alert_that_names_its_meaning() {
    use headroom_proto::v1 as pb;
    use headroom_tests::fixtures::{self, BOOT, GPU1, NODE};
    let dir = tempfile::tempdir().unwrap();
    let collector = RunningCollector::start_sqlite_with_default_rules(dir.path()).await;
    let mut client = pb::ingest_client::IngestClient::connect(collector.grpc_url())
        .await
        .unwrap();
    client
        .register(fixtures::register(NODE, BOOT))
        .await
        .unwrap();
    let mut batch = fixtures::batch(1, fixtures::now_ms() - 1000);
    batch.events.push(pb::Event {
        kind: pb::EventKind::Xid as i32,
        timestamp_ms: fixtures::now_ms() - 1000,
        uuid: GPU1.into(),
        code: 48,
        pid: 777,
        detail: "DBE (double bit error) detected".into(),
    });
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(batch).await.unwrap();
    let mut acks = client
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(acks.message().await.unwrap().unwrap().accepted_seq, 1);
    let alerts = collector.get_json("/api/v1/alerts?state=firing").await;
    let xid = alerts
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["rule"] == "xid")
        .unwrap_or_else(|| panic!("no XID alert in {alerts}"));
    assert_eq!(xid["severity"], "critical");
    assert_eq!(xid["labels"]["gpu"], "1");
    assert_eq!(xid["labels"]["xid"], "48");
    assert!(
        xid["summary"]
            .as_str()
            .unwrap()
            .contains("double-bit ECC error"),
        "{xid}"
    );
    drop(tx);
    collector.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_gets_one_message_for_the_alerts_of_one_node() {
    const TWO_FULL_GPUS: &str = r#"
[[node]]
name = "full-node"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
count = 2

[[node.gpu.process]]
pid = 7000
name = "python train.py"
user = "erin"
slurm_job_id = "777"
memory = { shape = "steady", level = "77GiB" }
"#;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("slack.db").display());
    let store: Arc<dyn Store> = headroom_store::connect(&url).await.unwrap();
    let slack = Receiver::start().await;
    let rules = RulesConfig::parse(
        &format!(
            "[[notify.slack]]\nname = \"gpu-alerts\"\nwebhook_url = \"{}\"\n",
            slack.url()
        ),
        Path::new("slack-rules.toml"),
    )
    .unwrap();
    let collector = RunningCollector::start_collector(
        Collector::builder(store)
            .rules(rules)
            .build()
            .await
            .unwrap(),
    )
    .await;
    let scenario = Scenario::from_toml_str(TWO_FULL_GPUS).unwrap();
    let agent = headroom_agent::start(
        AgentSettings {
            spool: None,
            tls: None,
            token: None,
            collector_url: collector.grpc_url(),
            node: "full-node".into(),
            boot_id: "b".into(),
            poll_interval: Duration::from_millis(20),
            sample_interval: Duration::from_millis(200),
            max_pending_batches: 1000,
            flush_above: 0.90,
            metrics_listen: None,
            allocator_socket: None,
            dcgm_metric_names: false,
        },
        Box::new(SimSource::new(&scenario, "full-node").unwrap()),
    )
    .unwrap();
    let message = eventually("a Slack message", Duration::from_secs(30), || async {
        slack.accepted().into_iter().next()
    })
    .await;
    let body: Value = serde_json::from_str(&message.body).unwrap();
    let text = body["text"].as_str().unwrap();
    assert!(
        text.starts_with("2 alerts:"),
        "both GPUs' watermark alerts in one message: {text}"
    );
    assert!(
        text.contains("GPU 0 on full-node") && text.contains("GPU 1 on full-node"),
        "{text}"
    );
    let headers = body["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "header")
        .count();
    assert_eq!(headers, 2, "{body}");
    assert!(
        message.headers.get("x-headroom-signature").is_none(),
        "Slack is not signed"
    );
    agent.stop().await;
    collector.stop().await;
}
