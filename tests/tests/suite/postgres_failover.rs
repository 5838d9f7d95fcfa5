//! Postgres failover under a running collector: a durable primary with a
//! synchronous streaming standby (`pg_basebackup -R`), the collector given
//! both as one multi-host URL with `target_session_attrs=read-write`, an
//! agent streaming. The primary crashes, the standby is promoted, and the
//! collector follows it by itself: afterwards every interval the agent
//! sampled is stored exactly once, an alert raised after the failover
//! fires, and every webhook is delivered once.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use headroom_tests::fixtures::now_ms;
use headroom_tests::harness::{eventually, free_loopback_addr};
use headroom_tests::postgres::Cluster;
use headroom_tests::processes::{
    SimAgent, pending_batches, start_agent, start_collector_flushing_every,
};
use headroom_tests::receiver::Receiver;
use serde_json::Value;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

const NODE: &str = "failover-node";
/// Started after the failover: its alerts can only fire on the new primary.
const LATE_NODE: &str = "failover-late-node";
const SAMPLE_MS: i64 = 20;
/// How often the collector writes its open chunks.
const FLUSH_MS: i64 = 1000;
/// Batches a live agent holds at any moment (one every 20 ms): those in
/// flight, and those accepted whose samples wait for the next flush.
const LIVE_IN_FLIGHT: u64 = 3 + (FLUSH_MS / SAMPLE_MS) as u64 + 10;

async fn gpu0_samples(url: &str) -> Vec<(i64, i64)> {
    headroom_tests::processes::gpu0_samples(url, NODE).await
}

/// Makes every commit on `primary` wait for the standby, and waits until
/// the standby is in sync: what the collector was told is committed is then
/// on the standby when the primary dies.
async fn make_synchronous(primary: &Cluster) {
    let mut conn = PgConnection::connect(&primary.admin_url()).await.unwrap();
    sqlx::query("ALTER SYSTEM SET synchronous_standby_names = '*'")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&mut conn)
        .await
        .unwrap();
    eventually(
        "the standby to be synchronous",
        Duration::from_secs(30),
        || async {
            let mut conn = PgConnection::connect(&primary.admin_url()).await.ok()?;
            let state: Option<String> =
                sqlx::query_scalar("SELECT sync_state FROM pg_stat_replication LIMIT 1")
                    .fetch_optional(&mut conn)
                    .await
                    .ok()?;
            (state.as_deref() == Some("sync")).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_collector_follows_a_promoted_standby_and_stores_every_interval_once() {
    let clusters = Cluster::create_durable().and_then(|primary| {
        let standby = Cluster::standby_of(&primary)?;
        Ok((primary, standby))
    });
    let (primary, standby) = match clusters {
        Ok(clusters) => clusters,
        Err(error) => {
            headroom_tests::skip_or_fail_under_ci(
                "the failover test",
                format!("no primary and standby: {error:#}"),
            );
            return;
        }
    };
    make_synchronous(&primary).await;
    let url = format!(
        "postgres://postgres@{},{}/postgres?target_session_attrs=read-write",
        primary.host(),
        standby.host()
    );

    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    // Every GPU in use fires a warning: the late node's fire only after the
    // failover.
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        format!(
            // At 20 ms samples the default ten silent intervals are 200 ms,
            // which a loaded machine's scheduling alone exceeds; what this
            // test counts is the watermark alerts across the failover.
            "[agent_silent]\nintervals = 1000\n\
             [watermark]\nwarning = 0.05\ncritical = 0.99\nclear_below = 0.02\n\
             [notify]\ndashboard_url = \"http://headroom.test/\"\n\
             [[notify.webhook]]\nname = \"failover-hook\"\nurl = \"{}\"\nsecret = \"s3cret\"\n",
            receiver.url()
        ),
    )
    .unwrap();
    let collector_log = dir.path().join("collector.log");
    let agent_log = dir.path().join("agent.log");
    let logs = || {
        format!(
            "--- collector log ---\n{}\n--- agent log ---\n{}",
            std::fs::read_to_string(&collector_log).unwrap_or_default(),
            std::fs::read_to_string(&agent_log).unwrap_or_default()
        )
    };
    let (grpc, http, metrics, late_metrics) = (
        free_loopback_addr(),
        free_loopback_addr(),
        free_loopback_addr(),
        free_loopback_addr(),
    );
    let mut collector = start_collector_flushing_every(
        (FLUSH_MS / 1000) as u32,
        &url,
        Some(&rules),
        grpc,
        http,
        &collector_log,
    );
    let spool = dir.path().join("spool");
    let agent = start_agent(&SimAgent {
        sim_node: "gpu-node-01",
        node: NODE,
        sample_ms: SAMPLE_MS,
        grpc,
        metrics,
        spool: &spool,
        log: &agent_log,
    });
    let primary_url = primary.admin_url();
    eventually(
        "samples on the primary",
        Duration::from_secs(60),
        || async { (gpu0_samples(&primary_url).await.len() >= 100).then_some(()) },
    )
    .await;

    // The primary crashes; the operator (or the failover tool) promotes the
    // standby. The collector is told nothing.
    let stopped = Instant::now();
    primary.stop_immediately().unwrap();
    standby.promote().unwrap();
    let promoted = stopped.elapsed();
    let new_primary = standby.admin_url();
    // Replayed to the end once promoted: anything more is the collector's.
    let stored_before = gpu0_samples(&new_primary).await.len();
    let first_commit = eventually(
        "a sample committed on the new primary",
        Duration::from_secs(60),
        || async {
            (gpu0_samples(&new_primary).await.len() > stored_before).then(|| stopped.elapsed())
        },
    )
    .await;
    assert!(collector.is_running(), "{}", logs());

    // A node that starts now raises alerts the old primary never saw.
    let late_spool = dir.path().join("late-spool");
    let late_agent = start_agent(&SimAgent {
        sim_node: "gpu-node-02",
        node: LATE_NODE,
        sample_ms: SAMPLE_MS,
        grpc,
        metrics: late_metrics,
        spool: &late_spool,
        log: &agent_log,
    });
    let firing = |node: &'static str| {
        let receiver = receiver.clone();
        move || {
            let receiver = receiver.clone();
            async move {
                let bodies: Vec<Value> = receiver
                    .accepted()
                    .iter()
                    .filter_map(|r| serde_json::from_str::<Value>(&r.body).ok())
                    .filter(|b| b["status"] == "firing" && b["alert"]["labels"]["node"] == node)
                    .collect();
                (!bodies.is_empty()).then_some(bodies)
            }
        }
    };
    eventually(
        "an alert raised after the failover to be delivered",
        Duration::from_secs(60),
        firing(LATE_NODE),
    )
    .await;

    let cutoff = eventually(
        "the backlog to be stored",
        Duration::from_secs(90),
        || async {
            let seen_at = now_ms();
            let pending = pending_batches(metrics).await?;
            (pending <= LIVE_IN_FLIGHT).then_some(seen_at - (LIVE_IN_FLIGHT as i64 + 3) * SAMPLE_MS)
        },
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let samples: Vec<(i64, i64)> = loop {
        let all = gpu0_samples(&new_primary).await;
        if let Some(past) = all.iter().position(|(ts, _)| *ts > cutoff) {
            break all[..=past].to_vec();
        }
        assert!(
            Instant::now() < deadline,
            "a sample past the cutoff is stored\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let duplicated = samples.windows(2).filter(|w| w[0].0 == w[1].0).count();
    // Each interval starts where the previous one ended (to rounding); a
    // gap is intervals lost.
    let lost_ms: i64 = samples
        .windows(2)
        .map(|w| w[1].0 - w[1].1 - w[0].0)
        .filter(|gap| gap.abs() > 5)
        .sum();
    println!(
        "failover: first sample committed on the new primary {} ms after the primary stopped \
         (promotion took {} ms); {} samples stored, {} lost ({lost_ms} ms of intervals), \
         {duplicated} duplicated",
        first_commit.as_millis(),
        promoted.as_millis(),
        samples.len(),
        lost_ms / SAMPLE_MS,
    );
    assert_eq!(duplicated, 0, "no sample stored twice\n{}", logs());
    assert_eq!(lost_ms, 0, "no interval lost\n{}", logs());
    assert!(
        std::fs::read_to_string(&collector_log)
            .unwrap_or_default()
            .contains("the database host taking writes changed"),
        "the collector says it failed over\n{}",
        logs()
    );

    // Every webhook once: one firing message per alert, whichever primary
    // its outbox row was written to.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut firings: BTreeMap<String, usize> = BTreeMap::new();
    for body in receiver
        .accepted()
        .iter()
        .filter_map(|r| serde_json::from_str::<Value>(&r.body).ok())
        .filter(|b| b["status"] == "firing")
    {
        *firings
            .entry(
                body["alert"]["fingerprint"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
            .or_default() += 1;
    }
    let repeated: Vec<_> = firings.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "each alert's firing is delivered once: {repeated:?}\n{}",
        logs()
    );
    late_agent.kill();
    agent.kill();
    collector.kill();
}
