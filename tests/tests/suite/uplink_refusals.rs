//! What the agent does with a collector's refusal: a refused registration
//! (an inventory over the collector's limits) keeps every batch queued until
//! the operator fixes it; a refused batch is dropped and counted, since
//! sending it again would fail forever.

use std::net::SocketAddr;
use std::time::Duration;

use headroom_agent::source::SimSource;
use headroom_agent::{AgentHandle, AgentSettings};
use headroom_collector::Collector;
use headroom_collector::ingest::validate::Limits;
use headroom_sim::Scenario;
use headroom_tests::harness::{RunningCollector, eventually, sim_agent_settings};

async fn collector_with(limits: Limits) -> (RunningCollector, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("refusals.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    let collector = Collector::builder(store)
        .limits(limits)
        .build()
        .await
        .unwrap();
    (RunningCollector::start_collector(collector).await, dir)
}

fn start_agent(c: &RunningCollector) -> AgentHandle {
    headroom_agent::start(
        AgentSettings {
            poll_interval: Duration::from_millis(20),
            sample_interval: Duration::from_millis(100),
            metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
            ..sim_agent_settings(c.grpc_url(), "gpu-node-01")
        },
        Box::new(SimSource::new(&Scenario::demo(), "gpu-node-01").unwrap()),
    )
    .unwrap()
}

/// (pending, dropped) from the agent's /metrics.
async fn queue(metrics: SocketAddr) -> (u64, u64) {
    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap()
            .parse()
            .unwrap()
    };
    (
        value("headroom_agent_pending_batches{"),
        value("headroom_agent_dropped_batches_total{"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_keeps_every_batch() {
    let (c, _db) = collector_with(Limits {
        max_devices: 2,
        ..Limits::default()
    })
    .await;
    let agent = start_agent(&c);
    let metrics = agent.metrics_addr().unwrap();
    let (pending, dropped) =
        eventually("intervals to queue up", Duration::from_secs(30), || async {
            let (pending, dropped) = queue(metrics).await;
            (pending >= 20).then_some((pending, dropped))
        })
        .await;
    assert!(pending >= 20);
    assert_eq!(dropped, 0, "nothing is dropped for a refused registration");
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_is_dropped_and_counted() {
    let (c, _db) = collector_with(Limits {
        max_samples_per_batch: 2,
        ..Limits::default()
    })
    .await;
    let agent = start_agent(&c);
    let metrics = agent.metrics_addr().unwrap();
    eventually(
        "refused batches to be dropped",
        Duration::from_secs(30),
        || async {
            let (_, dropped) = queue(metrics).await;
            (dropped >= 3).then_some(())
        },
    )
    .await;
    agent.stop().await;
    c.stop().await;
}
