//! Nothing lost under faults: the agent and collector binaries on a Postgres
//! cluster of the test's own, while the test SIGKILLs the collector and
//! keeps it away for 600 intervals (10 minutes at the production cadence of
//! 1 s), SIGKILLs the agent and restarts it on the same spool, and crashes
//! Postgres under the running collector for 5 s (`HEADROOM_CHAOS_DB_OUTAGE_S`
//! sets another length). Afterwards every interval the agent
//! sampled is stored exactly once: the samples of a GPU tile time without a
//! gap or an overlap, except across the one moment the agent was dead.
//! The collector writes chunks every second, so every kill finds samples
//! in open chunks: the agent's spool holds them until they are written.
//! A second case runs two collectors behind a balancer and kills the one
//! holding the agent's stream: the agent moves to the other, which takes
//! the samples the dead one held open, each once.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use headroom_tests::balancer::Balancer;
use headroom_tests::fixtures::now_ms;
use headroom_tests::harness::{KillOnDrop, eventually, free_loopback_addr, scrape_metric};
use headroom_tests::postgres::{self, Cluster};
use headroom_tests::processes::{self, SimAgent, pending_batches};

const NODE: &str = "chaos-node";
const SAMPLE_MS: i64 = 20;
/// The collector's outage, in intervals.
const OUTAGE_INTERVALS: i64 = 600;

/// How often the collector writes its open chunks.
const FLUSH_MS: i64 = 1000;

fn start_collector(url: &str, grpc: SocketAddr, http: SocketAddr, log: &Path) -> KillOnDrop {
    processes::start_collector_flushing_every((FLUSH_MS / 1000) as u32, url, None, grpc, http, log)
}

fn start_agent(grpc: SocketAddr, metrics: SocketAddr, spool: &Path, log: &Path) -> KillOnDrop {
    processes::start_agent(&SimAgent {
        sim_node: "gpu-node-01",
        node: NODE,
        sample_ms: SAMPLE_MS,
        grpc,
        metrics,
        spool,
        log,
    })
}

async fn gpu0_samples(url: &str) -> Vec<(i64, i64)> {
    processes::gpu0_samples(url, NODE).await
}

/// Batches a live agent holds at any moment (one every 20 ms): those in
/// flight, and those accepted whose samples wait for the next flush.
const LIVE_IN_FLIGHT: u64 = 3 + (FLUSH_MS / SAMPLE_MS) as u64 + 10;

/// Waits until the agent's backlog is down to what is live; returns a time
/// before which every interval it sampled is committed.
async fn drained(metrics: SocketAddr, what: &str) -> i64 {
    eventually(what, Duration::from_secs(90), || async {
        let seen_at = now_ms();
        let pending = pending_batches(metrics).await?;
        (pending <= LIVE_IN_FLIGHT).then_some(seen_at - (LIVE_IN_FLIGHT as i64 + 3) * SAMPLE_MS)
    })
    .await
}

/// GPU 0's samples through the first stored past `cutoff`. On a busy
/// machine the agent can sample late, so what it sampled just before the
/// cutoff may still be on its way: this waits for a sample past it, not
/// for a clock. Batches of a stream commit in order, so once that one is
/// in, every earlier one is too; it is kept, so that a check of the tiling
/// runs through the cutoff.
async fn stored_through(url: &str, cutoff: i64, logs: impl Fn() -> String) -> Vec<(i64, i64)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let all = gpu0_samples(url).await;
        if let Some(past) = all.iter().position(|(ts, _)| *ts > cutoff) {
            return all[..=past].to_vec();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a sample past the cutoff {cutoff} is stored (newest {:?}, now {})\n{}",
            all.last(),
            now_ms(),
            logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Where an interval does not start where the one before it ended (to
/// rounding): (that end, the next start).
/// The status `/readyz` answers at `addr`, if it answers.
async fn readiness(addr: SocketAddr) -> Option<u16> {
    let response = reqwest::get(format!("http://{addr}/readyz")).await.ok()?;
    Some(response.status().as_u16())
}

fn breaks(samples: &[(i64, i64)]) -> Vec<(i64, i64)> {
    samples
        .windows(2)
        .filter(|w| (w[1].0 - w[1].1 - w[0].0).abs() > 5)
        .map(|w| (w[0].0, w[1].0 - w[1].1))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_interval_is_stored_once_through_collector_agent_and_postgres_crashes() {
    let cluster = match Cluster::create_durable() {
        Ok(cluster) => cluster,
        Err(error) => {
            headroom_tests::skip_or_fail_under_ci(
                "the chaos test",
                format!("no Postgres cluster: {error:#}"),
            );
            return;
        }
    };
    let url = cluster.admin_url();
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("spool");
    let (collector_log, agent_log) = (
        dir.path().join("collector.log"),
        dir.path().join("agent.log"),
    );
    let logs = || {
        format!(
            "--- collector log ---\n{}\n--- agent log ---\n{}",
            std::fs::read_to_string(&collector_log).unwrap_or_default(),
            std::fs::read_to_string(&agent_log).unwrap_or_default()
        )
    };
    let (grpc, http, metrics) = (
        free_loopback_addr(),
        free_loopback_addr(),
        free_loopback_addr(),
    );

    let collector = start_collector(&url, grpc, http, &collector_log);
    let agent = start_agent(grpc, metrics, &spool, &agent_log);
    eventually("samples to arrive", Duration::from_secs(60), || async {
        (gpu0_samples(&url).await.len() >= 50).then_some(())
    })
    .await;

    // The collector dies mid-stream and stays away; the agent spools.
    collector.kill();
    tokio::time::sleep(Duration::from_millis((OUTAGE_INTERVALS * SAMPLE_MS) as u64)).await;
    assert!(
        pending_batches(metrics).await.unwrap() >= OUTAGE_INTERVALS as u64 * 9 / 10,
        "the outage is held in the spool\n{}",
        logs()
    );
    let mut collector = start_collector(&url, grpc, http, &collector_log);
    drained(metrics, "the outage's backlog to be replayed").await;

    // The agent dies mid-stream; its successor finds the spool.
    let agent_killed = now_ms();
    agent.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let agent_restarted = now_ms();
    let agent = start_agent(grpc, metrics, &spool, &agent_log);
    eventually(
        "the restarted agent to deliver",
        Duration::from_secs(60),
        || async {
            let samples = gpu0_samples(&url).await;
            (samples
                .last()
                .is_some_and(|(ts, _)| *ts > agent_restarted + 1000))
            .then_some(())
        },
    )
    .await;

    // Postgres crashes under the collector and comes back: 5 s here, the
    // issue's 60 s with HEADROOM_CHAOS_DB_OUTAGE_S=60.
    let db_outage = std::env::var("HEADROOM_CHAOS_DB_OUTAGE_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    cluster.stop_immediately().unwrap();
    // Readiness tells the balancer: the collector without its database is
    // not ready, the agent, still reading its GPUs, is.
    eventually(
        "the collector to report not ready",
        Duration::from_secs(10),
        || async { (readiness(http).await == Some(503)).then_some(()) },
    )
    .await;
    assert_eq!(readiness(metrics).await, Some(200), "{}", logs());
    tokio::time::sleep(Duration::from_secs(db_outage)).await;
    assert!(
        collector.is_running(),
        "the collector survives a database outage\n{}",
        logs()
    );
    cluster.start().unwrap();
    eventually(
        "the collector to be ready again",
        Duration::from_secs(30),
        || async { (readiness(http).await == Some(200)).then_some(()) },
    )
    .await;
    let cutoff = drained(metrics, "the database outage's backlog to be stored").await;
    assert!(collector.is_running(), "{}", logs());

    let samples = stored_through(&url, cutoff, logs).await;
    // A repeated end of interval is a sample stored twice (same length) or
    // an interval of no length; name it, with where it fell among the faults.
    let repeats: Vec<(i64, i64, i64)> = samples
        .windows(2)
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| (w[0].0, w[0].1, w[1].1))
        .collect();
    assert!(
        repeats.is_empty(),
        "a sample stored twice: (end, first length, second length) {repeats:?}; \
         agent killed at {agent_killed}, restarted at {agent_restarted}, cutoff {cutoff}\n{}",
        logs()
    );
    let breaks = breaks(&samples);
    assert_eq!(
        breaks.len(),
        1,
        "exactly one break, where the agent was dead; breaks (last end, next start): {breaks:?}\n{}",
        logs()
    );
    let (last_before, first_after) = breaks[0];
    assert!(
        last_before >= agent_killed - 10 * SAMPLE_MS && last_before <= agent_killed,
        "only intervals not yet handed to the spool die with the agent (last {last_before}, killed {agent_killed})"
    );
    assert!(
        first_after >= agent_restarted,
        "{first_after} < {agent_restarted}"
    );
    assert!(
        samples.len() as i64 > OUTAGE_INTERVALS + 200,
        "{} samples",
        samples.len()
    );
    agent.kill();
    collector.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_moves_to_the_other_collector_when_the_one_holding_it_is_killed() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("spool");
    let (first_log, second_log, agent_log) = (
        dir.path().join("first.log"),
        dir.path().join("second.log"),
        dir.path().join("agent.log"),
    );
    let logs = || {
        [&first_log, &second_log, &agent_log]
            .iter()
            .map(|log| {
                format!(
                    "--- {} ---\n{}",
                    log.display(),
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (first_grpc, first_http, second_grpc, second_http, metrics) = (
        free_loopback_addr(),
        free_loopback_addr(),
        free_loopback_addr(),
        free_loopback_addr(),
        free_loopback_addr(),
    );
    let first = start_collector(&db.url, first_grpc, first_http, &first_log);
    let second = start_collector(&db.url, second_grpc, second_http, &second_log);
    let balancer = Balancer::start(vec![first_grpc, second_grpc]).await;
    let agent = start_agent(balancer.addr, metrics, &spool, &agent_log);
    eventually("samples to arrive", Duration::from_secs(60), || async {
        (gpu0_samples(&db.url).await.len() >= 100).then_some(())
    })
    .await;

    // Up to a second of batches sits in the first collector's open chunks.
    let killed_at = now_ms();
    first.kill();
    // The batches the first collector held open come back to the second
    // as replays: accepted before, their samples taken again.
    eventually(
        "the agent to replay to the second collector",
        Duration::from_secs(60),
        || async {
            let replayed = scrape_metric(
                second_http,
                "headroom_collector_batches_total{outcome=\"replayed\"}",
            )
            .await;
            (replayed > 0.0).then_some(())
        },
    )
    .await;
    // Two more seconds through the second collector, then all of it stored.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cutoff = drained(metrics, "the agent's backlog to be stored").await;
    let samples = stored_through(&db.url, cutoff, logs).await;
    assert!(
        samples
            .first()
            .is_some_and(|(ts, _)| *ts < killed_at - 1000)
            && samples.last().is_some_and(|(ts, _)| *ts > killed_at),
        "the samples span the kill at {killed_at}: {:?} to {:?}\n{}",
        samples.first(),
        samples.last(),
        logs()
    );
    let repeats = samples.windows(2).filter(|w| w[0].0 == w[1].0).count();
    assert_eq!(repeats, 0, "no sample stored twice\n{}", logs());
    // The agent never stopped: no break, across the kill either.
    let breaks = breaks(&samples);
    assert!(
        breaks.is_empty(),
        "no interval lost; breaks (last end, next start) {breaks:?}, killed at {killed_at}\n{}",
        logs()
    );
    agent.kill();
    second.kill();
    drop(balancer);
    db.drop_database().await;
}
