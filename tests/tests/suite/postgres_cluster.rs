//! What only Postgres does: partitions made ahead and dropped past
//! retention, one maintenance leader among several collectors (and another
//! one when it dies), and exactly-once storage when collectors race on the
//! same batches, and the fleet overview's checkpoints seen from another
//! collector.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use headroom_collector::ingest::validate::{self, Limits};
use headroom_common::Clock;
use headroom_proto::v1 as pb;
use headroom_store::ProcessesOn;
use headroom_store::model::{NodeSession, StoreBatch, WriteOutcome};
use headroom_store::rollup::{
    DAY_MS, HOUR_MS, MINUTE_MS, SampleWrites, StorageConfig, bucket_start,
};
use headroom_store::{PostgresStore, Store};
use headroom_tests::fixtures::{self, BOOT, GIB, NODE, now_ms};
use headroom_tests::harness::RunningCollector;
use headroom_tests::postgres::{self, TestDatabase, day_suffix};
use sqlx::{Connection, PgConnection};

async fn collector(db: &TestDatabase) -> PostgresStore {
    PostgresStore::connect(&db.url, StorageConfig::default())
        .await
        .unwrap()
}

/// A collector that writes a row per sample, as before chunks (kept for a
/// rolling upgrade).
async fn collector_writing_rows(db: &TestDatabase) -> PostgresStore {
    let storage = StorageConfig {
        sample_writes: SampleWrites::Rows,
        ..StorageConfig::default()
    };
    PostgresStore::connect(&db.url, storage).await.unwrap()
}

/// Two collectors on one database, their checkpoints paced by one manual
/// clock that starts at `start_ms`.
async fn two_collectors(db: &TestDatabase, start_ms: i64) -> (PostgresStore, PostgresStore, Clock) {
    let clock = Clock::manual(start_ms);
    let first = collector(db).await.with_clock(clock.clone());
    let second = collector(db).await.with_clock(clock.clone());
    (first, second, clock)
}

async fn partitions(store: &PostgresStore) -> HashSet<String> {
    sqlx::query_scalar::<_, String>(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid",
    )
    .fetch_all(store.pool())
    .await
    .unwrap()
    .into_iter()
    .collect()
}

async fn register(store: &dyn Store, req: &pb::RegisterRequest) -> NodeSession {
    let reg = validate::registration(req, &Limits::default()).unwrap();
    store.register(&reg, now_ms()).await.unwrap()
}

fn rows_at(session: &NodeSession, batch: &pb::Batch, now: i64) -> StoreBatch {
    validate::batch(batch.clone(), session, now, &Limits::default()).unwrap()
}

#[tokio::test]
async fn partitions_exist_ahead_and_go_whole_past_retention() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let store = collector(&db).await;
    let now = now_ms();
    let made = partitions(&store).await;
    for table in [
        "gpu_samples",
        "process_samples",
        "allocator_samples_packed",
        "events",
        "gpu_samples_1m",
    ] {
        for day in [now - 6 * DAY_MS, now, now + DAY_MS] {
            let name = format!("{table}_p{}", day_suffix(day));
            assert!(made.contains(&name), "{name} missing from {made:?}");
        }
    }

    // A spool replayed from eight days ago: the write makes its partitions.
    let session = register(&store, &fixtures::register(NODE, BOOT)).await;
    let old = bucket_start(now - 8 * DAY_MS, MINUTE_MS);
    let batch = rows_at(&session, &fixtures::batch(1, old), old + 1000);
    assert_eq!(
        store.write_batch(&batch).await.unwrap(),
        WriteOutcome::Committed
    );
    // Its chunks are written at the flush, which makes their partitions.
    store.flush(true).await.unwrap();
    let old_raw = format!("gpu_samples_packed_p{}", day_suffix(old));
    let old_minutes = format!("gpu_samples_1m_p{}", day_suffix(old));
    assert!(partitions(&store).await.contains(&old_raw));

    let report = store.maintain(now).await.unwrap();
    assert!(report.leader);
    assert!(report.partitions_created > 0, "two days ahead: {report:?}");
    let after = partitions(&store).await;
    assert!(
        !after.contains(&old_raw),
        "a day of chunks past retention dropped"
    );
    assert!(after.contains(&old_minutes), "its minutes are kept 90 days");
    assert!(after.contains(&format!("gpu_samples_p{}", day_suffix(now + 2 * DAY_MS))));
    // Dropping, not deleting: no row-by-row work, and the minutes answer.
    let chart = store
        .device_series(fixtures::GPU0, old - MINUTE_MS, old + MINUTE_MS, 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(chart.iter().map(|p| p.samples).sum::<i64>(), 1);
    store.close().await;
    db.drop_database().await;
}

#[tokio::test]
async fn one_collector_leads_maintenance_and_another_takes_over_when_it_dies() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let first = collector(&db).await;
    let second = collector(&db).await;
    let now = now_ms();
    assert!(first.maintain(now).await.unwrap().leader);
    assert!(!second.maintain(now).await.unwrap().leader);
    assert!(first.maintain(now).await.unwrap().leader, "keeps leading");

    // The leader's connection dies (a crash, a network partition): the
    // database releases its lock, and the next pass elsewhere takes over.
    // The timeout makes the call wait until the backend has exited: on a
    // busy machine a signalled backend can still hold the lock for a while.
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(l.pid, 30000) FROM pg_locks l
         JOIN pg_database d ON d.oid = l.database
         WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database()",
    )
    .fetch_all(second.pool())
    .await
    .unwrap();
    assert_eq!(killed, vec![true], "exactly one session-level lock");
    assert!(second.maintain(now).await.unwrap().leader);
    assert!(
        !first.maintain(now).await.unwrap().leader,
        "the old leader finds it lost the lock and stands by"
    );

    // A clean shutdown hands over at once.
    second.close().await;
    assert!(first.maintain(now).await.unwrap().leader);
    first.close().await;
    db.drop_database().await;
}

/// Two collectors receive the same batches (an agent that failed over
/// replays its unacknowledged spool to the other one) and write them
/// concurrently, in groups of different shapes: every batch is stored
/// exactly once and committed by exactly one of them.
#[tokio::test]
async fn two_collectors_racing_on_the_same_batches_store_each_once() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let a = Arc::new(collector(&db).await);
    let b = Arc::new(collector(&db).await);
    let session = register(&*a, &fixtures::register(NODE, BOOT)).await;
    let other = register(&*b, &fixtures::register_other_node()).await;
    let now = now_ms();
    let start = now - 200_000;
    let mut batches = Vec::new();
    for seq in 1..=150u64 {
        let ts = start + seq as i64 * 1000;
        batches.push(rows_at(&session, &fixtures::batch(seq, ts), now));
        batches.push(rows_at(&other, &fixtures::other_node_batch(seq, ts), now));
    }
    let batches = Arc::new(batches);
    let race = |store: Arc<PostgresStore>, group: usize| {
        let batches = Arc::clone(&batches);
        tokio::spawn(async move {
            let mut committed = Vec::new();
            for chunk in batches.chunks(group) {
                let outcomes = store.write_batches(chunk).await.unwrap();
                for (batch, outcome) in chunk.iter().zip(outcomes) {
                    if outcome == WriteOutcome::Committed {
                        committed.push((batch.node_id, batch.seq));
                    }
                }
            }
            committed
        })
    };
    let (from_a, from_b) = tokio::join!(race(a.clone(), 7), race(b.clone(), 16));
    let mut all: Vec<(i64, u64)> = from_a.unwrap();
    all.extend(from_b.unwrap());
    let distinct: HashSet<(i64, u64)> = all.iter().copied().collect();
    assert_eq!(distinct.len(), all.len(), "no batch committed twice");
    // Each collector writes every agent's batches in order, so none is
    // skipped: all 300 are stored.
    assert_eq!(distinct.len(), batches.len(), "every batch committed once");
    // A batch one collector accepted, the other may have taken as a replay
    // (its samples not yet durable): both hold its samples until they
    // flush, at once, and the flush that comes second leaves them out.
    let (flushed_a, flushed_b) = tokio::join!(a.flush(true), b.flush(true));
    let left_out = flushed_a.unwrap().left_out + flushed_b.unwrap().left_out;
    let (chunk_samples, raw_rows): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT COALESCE(sum(samples), 0)::int8 FROM gpu_samples_packed),
                (SELECT count(*) FROM gpu_samples)",
    )
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(raw_rows, 0, "no sample is written as a row");
    assert_eq!(
        chunk_samples,
        2 * distinct.len() as i64,
        "two GPU samples per stored batch, none twice ({left_out} left out by a flush)"
    );
    a.close().await;
    b.close().await;
    db.drop_database().await;
}

/// The fleet overview of `store`: the device `uuid`'s latest sample time
/// and memory in use.
async fn latest_of(store: &PostgresStore, uuid: &str) -> (i64, i64) {
    let devices = store.latest_devices().await.unwrap().to_vec();
    let device = devices.iter().find(|d| &*d.uuid == uuid).unwrap();
    let latest = device.latest.as_ref().unwrap();
    (latest.timestamp_ms, latest.memory_used_bytes)
}

#[tokio::test]
async fn the_serving_collector_shows_every_second_and_another_a_checkpoint_at_most_5_s_old() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let start = now - 60_000;
    // The agent is live: each batch is written at the time it was sampled.
    let (serving, other, clock) = two_collectors(&db, start).await;
    let session = register(&serving, &fixtures::register(NODE, BOOT)).await;
    let gib = 1i64 << 30;
    let write = |seq: u64, used: i64| {
        let ts = start + seq as i64 * 1000;
        clock.set_ms(ts);
        let mut b = fixtures::batch(seq, ts);
        b.gpu_samples[0] = fixtures::gpu_sample(fixtures::GPU0, ts, used as u64);
        rows_at(&session, &b, now)
    };
    let at = |seq: u64| start + seq as i64 * 1000;

    serving.write_batches(&[write(1, 40 * gib)]).await.unwrap();
    assert_eq!(
        latest_of(&other, fixtures::GPU0).await,
        (at(1), 40 * gib),
        "first sight"
    );
    // 2 MiB more: the collector serving the agent shows it; the other one
    // still has the checkpoint.
    serving
        .write_batches(&[write(2, 40 * gib + (2 << 20))])
        .await
        .unwrap();
    assert_eq!(
        latest_of(&serving, fixtures::GPU0).await,
        (at(2), 40 * gib + (2 << 20))
    );
    assert_eq!(latest_of(&other, fixtures::GPU0).await, (at(1), 40 * gib));
    // A jump of 1 % of the GPU's 80 GiB or more is checkpointed at once.
    serving.write_batches(&[write(3, 41 * gib)]).await.unwrap();
    assert_eq!(latest_of(&other, fixtures::GPU0).await, (at(3), 41 * gib));
    // Steady for 5 s: the checkpoint moves.
    for seq in 4..=8 {
        serving
            .write_batches(&[write(seq, 41 * gib)])
            .await
            .unwrap();
        let (ts, _) = latest_of(&other, fixtures::GPU0).await;
        assert!(
            ts >= at(seq) - 5_000,
            "checkpoint {ts} too old at {}",
            at(seq)
        );
        // Each read of the serving collector starts from the figures of
        // the one before and lays over them the samples that came since.
        assert_eq!(
            latest_of(&serving, fixtures::GPU0).await,
            (at(seq), 41 * gib),
            "the serving collector a second behind"
        );
    }
    assert_eq!(latest_of(&other, fixtures::GPU0).await.0, at(8));
    // The agent moves to the other collector: its samples show at once, and
    // the first collector's memory does not hide them.
    let moved = register(&other, &fixtures::register(NODE, "boot-2")).await;
    clock.set_ms(at(9));
    let mut b = fixtures::batch(1, at(9));
    b.boot_id = "boot-2".into();
    b.gpu_samples[0] = fixtures::gpu_sample(fixtures::GPU0, at(9), (41 * gib + (4 << 20)) as u64);
    other
        .write_batches(&[rows_at(&moved, &b, now)])
        .await
        .unwrap();
    assert_eq!(
        latest_of(&serving, fixtures::GPU0).await,
        (at(9), 41 * gib + (4 << 20))
    );
    serving.close().await;
    other.close().await;
    db.drop_database().await;
}

/// A node's last-seen time is a checkpoint like `gpu_latest`'s rows: the
/// collector serving the agent shows it to the second, another at most 5 s
/// late, and closing writes the newest.
#[tokio::test]
async fn a_node_is_seen_to_the_second_where_served_and_at_most_5_s_late_elsewhere() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let (serving, other, clock) = two_collectors(&db, now).await;
    let session = register(&serving, &fixtures::register(NODE, BOOT)).await;
    let last_seen = |store: &PostgresStore| {
        let store = store.clone();
        async move { store.nodes().await.unwrap()[0].last_seen_ms }
    };
    // The agent is live, its samples newer than its registration.
    let at = |seq: u64| now + 10_000 + seq as i64 * 1000;
    let mut behind = false;
    for seq in 1..=12 {
        clock.set_ms(at(seq));
        let batch = rows_at(&session, &fixtures::batch(seq, at(seq)), at(seq));
        serving.write_batches(&[batch]).await.unwrap();
        assert_eq!(last_seen(&serving).await, at(seq));
        let seen = last_seen(&other).await;
        assert!(
            (at(seq) - 5_000..=at(seq)).contains(&seen),
            "another collector sees the node at {seen}, at {}",
            at(seq)
        );
        behind |= seen < at(seq);
    }
    assert!(behind, "the row is written at most every 5 s");
    serving.close().await;
    assert_eq!(last_seen(&other).await, at(12));
    other.close().await;
    db.drop_database().await;
}

/// A steady process's last-seen time is a checkpoint paced by the wall
/// clock: an agent replaying half a minute of its spool in an instant has
/// the process listed current by the collector that serves it, and by
/// another once it has been quiet for 10 s, or when the first one closes.
#[tokio::test]
async fn a_replayed_steady_process_is_seen_where_served_and_written_once_quiet() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let (serving, other, clock) = two_collectors(&db, now).await;
    let session = register(&serving, &fixtures::register(NODE, BOOT)).await;
    let start = now - 120_000;
    let at = |i: u64| start + i as i64 * 1000;
    let gib = 1u64 << 30;
    let batch = |i: u64| {
        let b = hop_batch(BOOT, i + 1, at(i), 40 * gib, 10 * gib, true);
        rows_at(&session, &b, now)
    };
    let last_seen = |store: &PostgresStore| {
        let store = store.clone();
        async move {
            let listed = store.processes(start, ProcessesOn::Fleet).await.unwrap();
            listed.iter().find(|p| p.pid == 777).map(|p| p.last_seen_ms)
        }
    };
    for i in 0..30 {
        serving.write_batches(&[batch(i)]).await.unwrap();
    }
    assert_eq!(last_seen(&serving).await, Some(at(29)));
    assert_eq!(
        last_seen(&other).await,
        Some(at(0)),
        "written once, at first sight"
    );
    // Ten seconds later the process is gone from the agent's batches.
    clock.set_ms(now + 10_000);
    let mut quiet = hop_batch(BOOT, 31, at(30), 40 * gib, 10 * gib, true);
    quiet.process_samples.clear();
    serving
        .write_batches(&[rows_at(&session, &quiet, now)])
        .await
        .unwrap();
    assert_eq!(
        last_seen(&other).await,
        Some(at(29)),
        "its newest, once quiet"
    );
    // Back, and replayed again: closing writes its newest.
    for i in 31..40 {
        serving.write_batches(&[batch(i)]).await.unwrap();
    }
    assert_ne!(last_seen(&other).await, Some(at(39)));
    serving.close().await;
    assert_eq!(last_seen(&other).await, Some(at(39)));
    other.close().await;
    db.drop_database().await;
}

/// A process's memory and its allocator's newest report are checkpoints
/// too: the collector serving the agent lists them to the second; another
/// lists them at most 10 s late, at once when memory moves by a sixteenth
/// or the allocator counts an OOM, and as they were last when the first
/// one closes. A job that reports every second no longer rewrites its row
/// every second.
#[tokio::test]
async fn a_process_and_its_allocator_report_are_current_where_served_and_checkpointed_elsewhere() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let start = now - 60_000;
    // The agent is live: each batch is written at the time it was sampled.
    let (serving, other, clock) = two_collectors(&db, start).await;
    let session = register(&serving, &fixtures::register(NODE, BOOT)).await;
    let at = |seq: u64| start + seq as i64 * 1000;
    let batch = |seq: u64, used: u64, ooms: u64| {
        clock.set_ms(at(seq));
        let mut b = hop_batch(BOOT, seq, at(seq), 40 * GIB, used, true);
        b.process_samples[0].allocator = Some(pb::AllocatorStats {
            timestamp_ms: at(seq) - 10,
            allocated_bytes: 8 * GIB - seq * (1 << 20),
            reserved_bytes: 9 * GIB,
            active_bytes: 8 * GIB,
            inactive_split_bytes: 0,
            peak_allocated_bytes: 8 * GIB,
            alloc_retries: 0,
            ooms,
            composition: None,
        });
        rows_at(&session, &b, now)
    };
    // What a collector lists for the process: its memory, last-seen time
    // and newest allocator report's time.
    let listed = |store: &PostgresStore| {
        let store = store.clone();
        async move {
            let listed = store.processes(start, ProcessesOn::Fleet).await.unwrap();
            let p = listed.iter().find(|p| p.pid == 777).unwrap();
            let report = p.allocator.as_ref().unwrap();
            (
                p.memory_used_bytes,
                p.last_seen_ms,
                report.timestamp_ms,
                report.ooms,
            )
        }
    };
    // Its peak first, then memory a few MiB under it each second, and a
    // report each second.
    let peak = 10 * GIB;
    serving.write_batches(&[batch(1, peak, 0)]).await.unwrap();
    for seq in 2..=10 {
        let used = peak - seq * (4 << 20);
        serving.write_batches(&[batch(seq, used, 0)]).await.unwrap();
        assert_eq!(
            listed(&serving).await,
            (used as i64, at(seq), at(seq) - 10, 0),
            "the serving collector a second behind"
        );
        assert_eq!(
            listed(&other).await,
            (peak as i64, at(1), at(1) - 10, 0),
            "another collector: the row as first written"
        );
    }
    // Ten seconds on, the checkpoints move.
    let used = peak - 11 * (4 << 20);
    serving.write_batches(&[batch(11, used, 0)]).await.unwrap();
    assert_eq!(listed(&other).await, (used as i64, at(11), at(11) - 10, 0));
    // An OOM counted by the allocator shows at once.
    serving.write_batches(&[batch(12, used, 1)]).await.unwrap();
    let (_, _, report_ms, ooms) = listed(&other).await;
    assert_eq!((report_ms, ooms), (at(12) - 10, 1), "an OOM at once");
    // So does memory that drops by a sixteenth or more.
    serving
        .write_batches(&[batch(13, 6 * GIB, 1)])
        .await
        .unwrap();
    let (memory, seen, _, _) = listed(&other).await;
    assert_eq!((memory, seen), ((6 * GIB) as i64, at(13)), "a drop at once");
    // A small move, then the serving collector closes: its newest goes to
    // the row.
    serving
        .write_batches(&[batch(14, 6 * GIB - (1 << 20), 1)])
        .await
        .unwrap();
    assert_ne!(listed(&other).await.1, at(14));
    serving.close().await;
    assert_eq!(
        listed(&other).await,
        ((6 * GIB - (1 << 20)) as i64, at(14), at(14) - 10, 1)
    );
    other.close().await;
    db.drop_database().await;
}

/// One write holding a new peak and then a lower sample of the same
/// process: the row takes the peak and the newest memory, so another
/// collector lists what the process holds now.
#[tokio::test]
async fn a_peak_and_a_drop_in_one_write_leave_the_row_at_the_drop() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let start = now - 60_000;
    let (serving, other, clock) = two_collectors(&db, start).await;
    let session = register(&serving, &fixtures::register(NODE, BOOT)).await;
    let at = |seq: u64| start + seq as i64 * 1000;
    let batch = |seq: u64, used: u64| {
        rows_at(
            &session,
            &hop_batch(BOOT, seq, at(seq), 40 * GIB, used, true),
            now,
        )
    };
    clock.set_ms(at(1));
    serving.write_batches(&[batch(1, 10 * GIB)]).await.unwrap();
    clock.set_ms(at(3));
    serving
        .write_batches(&[batch(2, 12 * GIB), batch(3, 9 * GIB)])
        .await
        .unwrap();
    let listed = other.processes(start, ProcessesOn::Fleet).await.unwrap();
    let p = listed.iter().find(|p| p.pid == 777).unwrap();
    assert_eq!(
        (p.memory_used_bytes, p.memory_peak_bytes, p.last_seen_ms),
        ((9 * GIB) as i64, (12 * GIB + GIB / 4) as i64, at(3)),
        "the newest memory, the peak of the interval before"
    );
    serving.close().await;
    other.close().await;
    db.drop_database().await;
}

#[tokio::test]
async fn late_samples_written_by_two_collectors_during_rollups_are_all_rolled_up() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let a = Arc::new(collector(&db).await);
    let b = Arc::new(collector(&db).await);
    let node_a = register(&*a, &fixtures::register(NODE, BOOT)).await;
    let node_b = register(&*b, &fixtures::register_other_node()).await;
    let now = now_ms();
    // A minute whose hour is not closed, so that neither its chunks nor its
    // rollups are compacted while the test reads them as they were written.
    let minute = bucket_start(now - 4 * MINUTE_MS, MINUTE_MS);
    let at = move |i: u64| minute + i as i64 * 1000;
    // The minute is rolled up before most of its samples arrive, as when
    // agents replay their spools after an outage.
    a.write_batches(&[rows_at(&node_a, &fixtures::batch(1, at(0)), now)])
        .await
        .unwrap();
    a.flush(true).await.unwrap();
    while a.maintain(now).await.unwrap().minutes_rolled_up > 0 {}

    let replay = move |store: Arc<PostgresStore>, session: NodeSession, other: bool| {
        tokio::spawn(async move {
            for i in 1..60u64 {
                let b = if other {
                    fixtures::other_node_batch(i + 1, at(i))
                } else {
                    fixtures::batch(i + 1, at(i))
                };
                let outcome = store.write_batches(&[rows_at(&session, &b, now)]).await;
                assert_eq!(outcome.unwrap(), vec![WriteOutcome::Committed]);
                // Chunks of the late minute, merged into its rollup row
                // while rollup passes run.
                if i % 7 == 0 {
                    store.flush(true).await.unwrap();
                }
            }
        })
    };
    let rollups = {
        let a = a.clone();
        tokio::spawn(async move {
            for _ in 0..40 {
                a.maintain(now).await.unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    let (ra, rb, rr) = tokio::join!(
        replay(a.clone(), node_a, false),
        replay(b.clone(), node_b, true),
        rollups
    );
    ra.unwrap();
    rb.unwrap();
    rr.unwrap();
    a.flush(true).await.unwrap();
    b.flush(true).await.unwrap();
    // The leader's next passes redo the hours those flushes marked.
    loop {
        let pass = a.maintain(now).await.unwrap();
        assert!(pass.leader);
        if pass.minutes_rolled_up + pass.hours_rolled_up == 0 {
            break;
        }
    }

    // Every sample of the minute is in its rollup row, whatever order the
    // writers, the flushes and the rollup passes took.
    let (rolled, stored): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT sum(samples)::int8 FROM gpu_minutes($1, $1 + $2)),
                (SELECT sum(samples)::int8 FROM gpu_samples_packed
                 WHERE first_ts_ms >= $1 AND last_ts_ms < $1 + $2)",
    )
    .bind(minute)
    .bind(MINUTE_MS)
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(stored, 2 * 60 + 2 * 59, "two GPUs per batch, both nodes");
    assert_eq!(rolled, stored);
    // The hour the minute watermark is in is rolled up once it has ended.
    let pending: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM rollup_pending p WHERE NOT (p.step_ms = $1
             AND p.bucket_ms + $1 > (SELECT done_until_ms FROM rollup_progress WHERE step_ms = $2))",
    )
    .bind(HOUR_MS)
    .bind(MINUTE_MS)
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(pending, 0, "no mark left behind");
    a.close().await;
    b.close().await;
    db.drop_database().await;
}

/// A writer marking a late minute waits for no rollup of that minute: here
/// a transaction holds the minute's mark deleted, as the rollup job does
/// for the length of its rollup. The write commits meanwhile, its mark
/// outlives the job's, and the next pass rolls the minute up with it.
#[tokio::test]
async fn a_late_write_does_not_wait_for_a_rollup_of_its_minute() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    // Where samples are written as rows, a write marks its late minutes.
    let store = collector_writing_rows(&db).await;
    let session = register(&store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let minute = bucket_start(now - 30 * MINUTE_MS, MINUTE_MS);
    store
        .write_batches(&[rows_at(&session, &fixtures::batch(1, minute), now)])
        .await
        .unwrap();
    let mut rollup = store.pool().begin().await.unwrap();
    let taken: Vec<i64> = sqlx::query_scalar(
        "DELETE FROM rollup_pending WHERE step_ms = $1 AND bucket_ms = $2 RETURNING bucket_ms",
    )
    .bind(MINUTE_MS)
    .bind(minute)
    .fetch_all(&mut *rollup)
    .await
    .unwrap();
    assert!(!taken.is_empty(), "the first write marked its minute");

    let late = [rows_at(&session, &fixtures::batch(2, minute + 1000), now)];
    let outcome = tokio::time::timeout(Duration::from_secs(20), store.write_batches(&late))
        .await
        .expect("the late write waited for the rollup transaction");
    assert_eq!(outcome.unwrap(), vec![WriteOutcome::Committed]);
    rollup.commit().await.unwrap();

    while store.maintain(now).await.unwrap().minutes_rolled_up > 0 {}
    let (rolled, raw): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT sum(samples)::int8 FROM gpu_samples_1m WHERE ts_ms = $1),
                (SELECT count(*) FROM gpu_samples WHERE ts_ms >= $1 AND ts_ms < $1 + $2)",
    )
    .bind(minute)
    .bind(MINUTE_MS)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(raw, 4, "two GPUs in each of the two batches");
    assert_eq!(rolled, raw);
    store.close().await;
    db.drop_database().await;
}

/// A batch of `boot` at `ts` with GPU0 at `gpu0_used` and process 777 on
/// GPU0 (one incarnation, whatever `ts`) at `process_used`; GPU1 only when
/// `with_gpu1`.
fn hop_batch(
    boot: &str,
    seq: u64,
    ts: i64,
    gpu0_used: u64,
    process_used: u64,
    with_gpu1: bool,
) -> pb::Batch {
    let mut b = fixtures::batch(seq, ts);
    b.boot_id = boot.into();
    b.gpu_samples[0] = fixtures::gpu_sample(fixtures::GPU0, ts, gpu0_used);
    if !with_gpu1 {
        b.gpu_samples.truncate(1);
    }
    let mut p = fixtures::process_sample(fixtures::GPU0, ts, 777, process_used);
    p.start_time_ms = 1_700_000_000_000;
    b.process_samples = vec![p];
    b
}

#[tokio::test]
async fn quiet_devices_and_a_closing_collector_leave_their_newest_sample_in_the_overview() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let start = now - 60_000;
    let (serving, other, clock) = two_collectors(&db, start).await;
    let session = register(&serving, &fixtures::register(NODE, BOOT)).await;
    let gib = 1u64 << 30;
    let at = |seq: u64| start + seq as i64 * 1000;
    // The agent is live: each batch is written at the time it was sampled.
    let live = |seq: u64| {
        clock.set_ms(at(seq));
        at(seq)
    };
    serving
        .write_batches(&[rows_at(
            &session,
            &hop_batch(BOOT, 1, live(1), 40 * gib, gib, true),
            now,
        )])
        .await
        .unwrap();
    serving
        .write_batches(&[rows_at(
            &session,
            &hop_batch(BOOT, 2, live(2), 40 * gib, gib, true),
            now,
        )])
        .await
        .unwrap();
    assert_eq!(latest_of(&other, fixtures::GPU1).await.0, at(1));
    // GPU1 falls silent (its agent reports GPU0 only); 5 s later its last
    // sample reaches the row.
    for seq in 3..=8 {
        let b = hop_batch(BOOT, seq, live(seq), 40 * gib, gib, false);
        serving
            .write_batches(&[rows_at(&session, &b, now)])
            .await
            .unwrap();
    }
    assert_eq!(latest_of(&other, fixtures::GPU1).await.0, at(2));
    // GPU0's newest sample is not checkpointed yet; closing writes it.
    let b = hop_batch(BOOT, 9, live(9), 40 * gib + (2 << 20), gib, false);
    serving
        .write_batches(&[rows_at(&session, &b, now)])
        .await
        .unwrap();
    assert_ne!(latest_of(&other, fixtures::GPU0).await.0, at(9));
    serving.close().await;
    assert_eq!(
        latest_of(&other, fixtures::GPU0).await,
        (at(9), (40 * gib + (2 << 20)) as i64)
    );
    other.close().await;
    db.drop_database().await;
}

/// The UUIDs in another collector's fleet overview, in its order.
async fn overview_uuids(store: &PostgresStore) -> Vec<String> {
    store
        .latest_devices()
        .await
        .unwrap()
        .views()
        .map(|device| device.uuid.to_string())
        .collect()
}

#[tokio::test]
async fn the_overview_on_another_collector_follows_devices_added_changed_and_released() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let (serving, other, _clock) = two_collectors(&db, now_ms()).await;
    register(&serving, &fixtures::register(NODE, BOOT)).await;
    let first = overview_uuids(&other).await;
    assert_eq!(
        first,
        [
            fixtures::GPU0,
            fixtures::GPU1,
            fixtures::GPU2,
            fixtures::MIG_A,
            fixtures::MIG_B
        ],
        "the first read of the overview lays out the node"
    );
    // Read again with nothing changed: the same layout.
    assert_eq!(overview_uuids(&other).await, first);
    // A node registers on the serving collector after the other one has
    // laid the fleet out: it shows up there at once.
    register(&serving, &fixtures::register_other_node()).await;
    assert_eq!(overview_uuids(&other).await.len(), 10);
    // The first node comes back without its MIG instances and with GPU1
    // renamed by a driver update.
    let mut changed = fixtures::register(NODE, "boot-b");
    changed.gpus[2].mig_instances.clear();
    changed.gpus[1].name = "NVIDIA H100 80GB HBM3 (renamed)".into();
    register(&serving, &changed).await;
    let devices = other.latest_devices().await.unwrap().to_vec();
    let mine: Vec<&str> = devices
        .iter()
        .filter(|d| &*d.node == NODE)
        .map(|d| d.uuid.as_ref())
        .collect();
    assert_eq!(mine, [fixtures::GPU0, fixtures::GPU1, fixtures::GPU2]);
    let gpu1 = devices.iter().find(|d| &*d.uuid == fixtures::GPU1).unwrap();
    assert_eq!(&*gpu1.name, "NVIDIA H100 80GB HBM3 (renamed)");
    // A device released by an operator leaves the other's overview too.
    assert_eq!(
        serving
            .release_device(fixtures::GPU0, now_ms())
            .await
            .unwrap()
            .as_deref(),
        Some(NODE)
    );
    assert!(
        !overview_uuids(&other)
            .await
            .contains(&fixtures::GPU0.to_owned())
    );
    serving.close().await;
    other.close().await;
    db.drop_database().await;
}

#[tokio::test]
async fn the_overview_on_another_collector_sees_figures_committed_while_it_read() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let (serving, other, _clock) = two_collectors(&db, now).await;
    let session = register(&serving, &fixtures::register(NODE, BOOT)).await;
    serving
        .write_batches(&[rows_at(&session, &fixtures::batch(1, now), now)])
        .await
        .unwrap();
    // The first read shows the written sample.
    let (_, before) = latest_of(&other, fixtures::GPU1).await;
    // A writer's transaction stays open across the next read, while other
    // transactions start and commit after it.
    let commit_some = |n: usize| {
        let url = db.url.clone();
        async move {
            let mut conn = PgConnection::connect(&url).await.unwrap();
            for _ in 0..n {
                sqlx::query("SELECT pg_current_xact_id()")
                    .execute(&mut conn)
                    .await
                    .unwrap();
            }
        }
    };
    let mut slow = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut slow).await.unwrap();
    sqlx::query(
        "UPDATE gpu_latest SET used_last = 12345
         WHERE device_id = (SELECT id FROM devices WHERE uuid = $1)",
    )
    .bind(fixtures::GPU1)
    .execute(&mut slow)
    .await
    .unwrap();
    commit_some(3).await;
    assert_eq!(
        latest_of(&other, fixtures::GPU1).await.1,
        before,
        "not committed yet"
    );
    sqlx::query("COMMIT").execute(&mut slow).await.unwrap();
    commit_some(3).await;
    // The write is older than transactions the last read saw committed;
    // the next read still fetches it.
    assert_eq!(latest_of(&other, fixtures::GPU1).await.1, 12345);
    assert_eq!(
        latest_of(&other, fixtures::GPU1).await.1,
        12345,
        "and keeps it"
    );
    serving.close().await;
    other.close().await;
    db.drop_database().await;
}

#[tokio::test]
async fn a_process_whose_agent_hops_between_collectors_shows_its_current_memory() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let start = now - 120_000;
    // The agent is live: each batch is written at the time it was sampled.
    let (a, b, clock) = two_collectors(&db, start).await;
    let gib = 1u64 << 30;
    let at = |s: i64| {
        clock.set_ms(start + s * 1000);
        start + s * 1000
    };
    let memory = |store: &PostgresStore| {
        let store = store.clone();
        async move {
            let listed = store.processes(0, ProcessesOn::Fleet).await.unwrap();
            let p = listed.iter().find(|p| p.pid == 777).unwrap();
            (p.memory_used_bytes, p.last_seen_ms)
        }
    };
    let on_a = register(&a, &fixtures::register(NODE, "boot-1")).await;
    a.write_batches(&[rows_at(
        &on_a,
        &hop_batch("boot-1", 1, at(0), 40 * gib, 10 * gib, true),
        now,
    )])
    .await
    .unwrap();
    // The agent restarts against the other collector; the process grows.
    let on_b = register(&b, &fixtures::register(NODE, "boot-2")).await;
    b.write_batches(&[rows_at(
        &on_b,
        &hop_batch("boot-2", 1, at(1), 40 * gib, 12 * gib, true),
        now,
    )])
    .await
    .unwrap();
    assert_eq!(memory(&a).await, ((12 * gib) as i64, at(1)));
    // Back on the first collector, the process is at its old size again: the
    // value the first collector last wrote, but not the row's.
    let on_a = register(&a, &fixtures::register(NODE, "boot-3")).await;
    // Ten seconds after its last write the first collector moves the row's
    // last-seen time, and the memory with it.
    let batch = hop_batch("boot-3", 1, at(10), 40 * gib, 10 * gib, true);
    a.write_batches(&[rows_at(&on_a, &batch, now)])
        .await
        .unwrap();
    assert_eq!(memory(&b).await, ((10 * gib) as i64, at(10)));
    a.close().await;
    b.close().await;
    db.drop_database().await;
}

/// The collector holding a stream dies (no close, as under SIGKILL) with
/// ten batches written as chunks and ten more in open chunks; the agent
/// moves to another collector. It registers there, learns the durable mark
/// and sends everything after it again: those batches were accepted (their
/// events stored, their rules run), so only their samples are taken, and
/// every sample ends on disk once.
#[tokio::test]
async fn a_stream_moves_to_another_collector_when_the_one_holding_it_dies() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let now = now_ms();
    let start = now - 60_000;
    let batch = |session: &NodeSession, seq: u64| {
        rows_at(
            session,
            &fixtures::batch(seq, start + seq as i64 * 1000),
            now,
        )
    };
    let first = collector(&db).await;
    let session = register(&first, &fixtures::register(NODE, BOOT)).await;
    for seq in 1..=20 {
        if seq == 11 {
            first.flush(true).await.unwrap();
        }
        assert_eq!(
            first.write_batch(&batch(&session, seq)).await.unwrap(),
            WriteOutcome::Committed
        );
    }
    assert_eq!(first.durable_seq(session.node_id, BOOT), Some(10));
    drop(first);

    let second = collector(&db).await;
    let moved = register(&second, &fixtures::register(NODE, BOOT)).await;
    assert_eq!((moved.committed_seq, moved.durable_seq), (20, 10));
    for seq in 11..=30 {
        let expected = if seq <= 20 {
            WriteOutcome::Replayed
        } else {
            WriteOutcome::Committed
        };
        assert_eq!(
            second.write_batch(&batch(&moved, seq)).await.unwrap(),
            expected,
            "batch {seq}"
        );
    }
    // Before the flush the chart already shows them all, once.
    let chart = second
        .device_series(fixtures::GPU0, start, now, 1000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(chart.len(), 30);
    assert!(chart.iter().all(|p| p.samples == 1));
    second.flush(true).await.unwrap();
    let mut conn = second.pool().acquire().await.unwrap();
    let gpu0 = *moved.device_ids.get(fixtures::GPU0).unwrap();
    let stored = PostgresStore::stored_gpu_samples(&mut conn, &[gpu0], start, now)
        .await
        .unwrap();
    let times: Vec<i64> = stored.iter().map(|s| s.timestamp_ms).collect();
    let expected: Vec<i64> = (1..=30).map(|seq| start + seq * 1000).collect();
    assert_eq!(times, expected, "every sample on disk once");
    drop(conn);
    assert_eq!(second.durable_seq(moved.node_id, BOOT), Some(30));
    second.close().await;
    db.drop_database().await;
}

/// A collector holding samples open for a minute: none is written while a
/// test runs unless it flushes them itself.
async fn collector_flushing_each_minute(db: &TestDatabase) -> Arc<PostgresStore> {
    let storage = StorageConfig {
        chunk_flush_s: 60,
        ..StorageConfig::default()
    };
    Arc::new(PostgresStore::connect(&db.url, storage).await.unwrap())
}

async fn chart_points(collector: &RunningCollector, from: i64, to: i64) -> usize {
    let chart = collector
        .get_json(&format!(
            "/api/v1/gpus/{}/series?from={from}&to={to}",
            fixtures::GPU0
        ))
        .await;
    chart["points"].as_array().unwrap().len()
}

#[tokio::test]
async fn a_chart_on_one_collector_shows_the_samples_another_holds_open() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let holding_store = collector_flushing_each_minute(&db).await;
    let other_store = collector_flushing_each_minute(&db).await;
    let holding = RunningCollector::start_advertised(holding_store.clone()).await;
    let other = RunningCollector::start_advertised(other_store.clone()).await;

    let now = now_ms();
    let start = now - 20_000;
    let session = register(holding_store.as_ref(), &fixtures::register(NODE, BOOT)).await;
    for seq in 1..=10 {
        let ts = start + seq as i64 * 1000;
        let mut batch = fixtures::batch(seq, ts);
        // A job that reports its allocator every second, beside the
        // fixture's process.
        let mut job = fixtures::process_sample(fixtures::GPU0, ts, 900, 20 * GIB);
        job.start_time_ms = start - 60_000;
        job.allocator = Some(pb::AllocatorStats {
            timestamp_ms: ts - 10,
            allocated_bytes: 10 * GIB + seq,
            reserved_bytes: 12 * GIB,
            active_bytes: 10 * GIB,
            inactive_split_bytes: 0,
            peak_allocated_bytes: 11 * GIB,
            alloc_retries: 0,
            ooms: 0,
            composition: None,
        });
        batch.process_samples.push(job);
        let batch = rows_at(&session, &batch, now);
        assert_eq!(
            holding_store.write_batch(&batch).await.unwrap(),
            WriteOutcome::Committed
        );
    }
    let gpu0 = *session.device_ids.get(fixtures::GPU0).unwrap();
    let mut conn = other_store.pool().acquire().await.unwrap();
    let on_disk = PostgresStore::stored_gpu_samples(&mut conn, &[gpu0], start, now)
        .await
        .unwrap();
    drop(conn);
    assert!(on_disk.is_empty(), "the samples are open, not yet written");

    // The other collector's charts show every open sample, once.
    assert_eq!(chart_points(&other, start, now).await, 10);
    let processes = other
        .get_json(&format!(
            "/api/v1/gpus/{}/processes/series?from={start}&to={now}",
            fixtures::GPU0
        ))
        .await;
    let held = holding
        .get_json(&format!(
            "/api/v1/gpus/{}/processes/series?from={start}&to={now}",
            fixtures::GPU0
        ))
        .await;
    assert_eq!(processes["processes"], held["processes"]);
    // The fixture's process restarts every second: ten processes, a point
    // each; the job, ten points.
    let points: usize = processes["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["points"].as_array().unwrap().len())
        .sum();
    assert_eq!(points, 20);
    // And the job's allocator chart, every report held open.
    let allocator_path = format!(
        "/api/v1/gpus/{}/processes/900/allocator?from={start}&to={now}",
        fixtures::GPU0
    );
    let reports = other.get_json(&allocator_path).await;
    assert_eq!(reports, holding.get_json(&allocator_path).await);
    assert_eq!(reports["points"].as_array().unwrap().len(), 10);
    let peer_reads =
        |result: &str| format!("headroom_collector_peer_reads_total{{result=\"{result}\"}}");
    assert_eq!(other.metric(&peer_reads("ok")).await, 3.0);

    // The endpoint answers only to the secret the collectors share.
    let client = reqwest::Client::new();
    let query = serde_json::json!({"device_id": gpu0, "from_ms": start, "to_ms": now});
    let endpoint = holding.api("/internal/v1/open-samples");
    for token in [None, Some("not-the-secret")] {
        let mut request = client.post(&endpoint).json(&query);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let status = request.send().await.unwrap().status();
        assert_eq!(status, reqwest::StatusCode::UNAUTHORIZED, "{token:?}");
    }
    let secret: String = sqlx::query_scalar("SELECT secret FROM peer_secret")
        .fetch_one(holding_store.pool())
        .await
        .unwrap();
    let answer: serde_json::Value = client
        .post(&endpoint)
        .bearer_auth(&secret)
        .json(&query)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["gpu"].as_array().unwrap().len(), 10);

    // A holder that stopped answering costs charts its open samples (its
    // agent sends them again elsewhere), not the chart.
    holding.kill().await;
    assert_eq!(chart_points(&other, start, now).await, 0);
    assert_eq!(chart_points(&other, start, now).await, 0);
    assert_eq!(other.metric(&peer_reads("failed")).await, 1.0);
    assert_eq!(other.metric(&peer_reads("skipped")).await, 1.0);

    // Closed, a collector writes what it held and stops naming itself the
    // holder, so nobody asks it.
    holding_store.close().await;
    assert_eq!(chart_points(&other, start, now).await, 10);
    let written = other.get_json(&allocator_path).await;
    assert_eq!(
        written["points"], reports["points"],
        "the reports as chunks"
    );
    let holder: Option<String> = sqlx::query_scalar("SELECT stream_holder FROM nodes")
        .fetch_one(other_store.pool())
        .await
        .unwrap();
    assert_eq!(holder, None);
    other.stop().await;
    other_store.close().await;
    db.drop_database().await;
}

/// The next `kind` event of a live stream (`snapshot` or `update`) whose
/// `gpus` or `removed` is not empty, as JSON; `pending` holds what was read
/// past it.
async fn next_stream_change(
    stream: &mut reqwest::Response,
    pending: &mut String,
    kind: &str,
) -> serde_json::Value {
    next_stream_event(stream, pending, kind, |message| {
        message["gpus"].as_array().is_some_and(|g| !g.is_empty())
            || message["removed"].as_array().is_some_and(|r| !r.is_empty())
    })
    .await
}

/// The next event of `kind` whose message passes `wanted`.
async fn next_stream_event(
    stream: &mut reqwest::Response,
    pending: &mut String,
    kind: &str,
    wanted: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let header = format!("event: {kind}\n");
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            while let Some(end) = pending.find("\n\n") {
                let event: String = pending.drain(..end + 2).collect();
                let Some(body) = event.strip_prefix(header.as_str()) else {
                    continue;
                };
                let data = body.trim_end().strip_prefix("data: ").unwrap();
                let message: serde_json::Value = serde_json::from_str(data).unwrap();
                if wanted(&message) {
                    return message;
                }
            }
            let chunk = stream.chunk().await.unwrap().expect("the stream ended");
            pending.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {kind} as awaited within 20 s"))
}

fn uuids(list: &serde_json::Value) -> Vec<&str> {
    let mut uuids: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.get("uuid").unwrap_or(d).as_str().unwrap())
        .collect();
    uuids.sort_unstable();
    uuids
}

/// A node's rows by name, from a `nodes` scope message.
fn node_rows(message: &serde_json::Value) -> std::collections::BTreeMap<&str, &serde_json::Value> {
    message["node_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| (row["node"].as_str().unwrap(), row))
        .collect()
}

#[tokio::test]
async fn a_fleet_over_the_stream_limit_is_streamed_by_node_and_a_named_node_device_by_device() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let store = Arc::new(collector(&db).await);
    let session = register(store.as_ref(), &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 5_000;
    store
        .write_batch(&rows_at(&session, &fixtures::batch(1, ts), ts + 100))
        .await
        .unwrap();
    // One node's five devices fit the limit; two nodes' ten do not.
    let http = headroom_collector::http::HttpServerConfig {
        stream_devices_max: 6,
        ..Default::default()
    };
    let built = headroom_collector::Collector::builder(store.clone())
        .http_server(http)
        .build()
        .await
        .unwrap();
    let running = RunningCollector::start_collector(built).await;
    let mut fleet = reqwest::get(running.api("/api/v1/stream")).await.unwrap();
    let mut fleet_pending = String::new();
    let other_url = format!("/api/v1/stream?node={}", fixtures::OTHER_NODE);
    let mut other = reqwest::get(running.api(&other_url)).await.unwrap();
    let mut other_pending = String::new();

    let snapshot = next_stream_change(&mut fleet, &mut fleet_pending, "snapshot").await;
    assert_eq!(snapshot["scope"], "devices");
    assert_eq!(uuids(&snapshot["gpus"]).len(), 5);
    let nobody = next_stream_event(&mut other, &mut other_pending, "snapshot", |_| true).await;
    assert_eq!(nobody["scope"], "node");
    assert_eq!(nobody["nodes"], serde_json::json!([]), "not registered yet");

    // The fleet grows past the limit: the fleet's client starts anew, by node.
    let other_session = register(store.as_ref(), &fixtures::register_other_node()).await;
    let by_node = next_stream_event(&mut fleet, &mut fleet_pending, "snapshot", |_| true).await;
    assert_eq!(by_node["scope"], "nodes", "{by_node}");
    assert_eq!(by_node["devices"], 10);
    let rows = node_rows(&by_node);
    assert_eq!(rows.len(), 2, "{by_node}");
    let first = rows[NODE];
    assert_eq!(
        (&first["gpus"], &first["mig_instances"]),
        (&serde_json::json!(3), &serde_json::json!(2))
    );
    assert_eq!(first["level"], "ok", "{first}");
    assert!(
        first["used_pct"].as_u64().is_some_and(|pct| pct > 0),
        "{first}"
    );
    assert_eq!(rows[fixtures::OTHER_NODE]["level"], "none", "no sample yet");
    assert_eq!(
        uuids(&by_node["gpus"]),
        [fixtures::GPU0, fixtures::GPU1],
        "the devices at risk are those with the least headroom"
    );
    assert_eq!(
        by_node["owners"][fixtures::GPU0][0]["user"],
        "alice",
        "with their owners: {by_node}"
    );

    // The named node's client is sent its devices and its node, no other.
    let theirs = next_stream_change(&mut other, &mut other_pending, "update").await;
    let their_uuids = uuids(&theirs["gpus"]);
    assert_eq!(their_uuids.len(), 5, "{theirs}");
    assert!(
        their_uuids.iter().all(|uuid| uuid.ends_with("-other")),
        "{theirs}"
    );
    assert_eq!(theirs["nodes"].as_array().map(Vec::len), Some(1));
    assert_eq!(theirs["nodes"][0]["name"], fixtures::OTHER_NODE);

    // The other node reports: its row alone changes, and its client gets
    // the sample, nearly full (75 of 80 GiB), and the owner of a process
    // on a GPU not at risk (it has no sample), read because a client
    // follows the node.
    let other_gpu0 = format!("{}-other", fixtures::GPU0);
    let other_gpu1 = format!("{}-other", fixtures::GPU1);
    let mut reported = fixtures::batch(1, ts + 1_000);
    reported.node = fixtures::OTHER_NODE.into();
    reported.gpu_samples = vec![fixtures::gpu_sample(&other_gpu0, ts + 1_000, 75 << 30)];
    reported.process_samples = vec![fixtures::process_sample(
        &other_gpu1,
        ts + 1_000,
        4242,
        7 << 30,
    )];
    store
        .write_batch(&rows_at(&other_session, &reported, ts + 1_100))
        .await
        .unwrap();
    // Meanwhile the first node's process grows: its owners change, for the
    // fleet's clients, not the other node's.
    let mut grown = fixtures::batch(2, ts + 1_000);
    grown.process_samples[0].memory_used_last_bytes = 30 << 30;
    store
        .write_batch(&rows_at(&session, &grown, ts + 1_100))
        .await
        .unwrap();
    let update = next_stream_event(&mut fleet, &mut fleet_pending, "update", |m| {
        node_rows(m).contains_key(fixtures::OTHER_NODE)
    })
    .await;
    let rows = node_rows(&update);
    // The first node's cell changes only if it fell silent meanwhile.
    assert!(
        rows.get(NODE)
            .is_none_or(|row| !row["silent_since_ms"].is_null()),
        "{update}"
    );
    assert!(
        rows[fixtures::OTHER_NODE]["headroom_pct"]
            .as_i64()
            .is_some_and(|pct| pct < 10)
    );
    assert_eq!(rows[fixtures::OTHER_NODE]["low"], 1);
    assert!(
        uuids(&update["gpus"]).contains(&format!("{}-other", fixtures::GPU0).as_str()),
        "the fullest device is among those at risk: {update}"
    );
    // Owners are read every 5 s: the sample and the owner may come apart.
    let (mut sample_seen, mut owner_seen) = (false, false);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !(sample_seen && owner_seen) {
        assert!(
            std::time::Instant::now() < deadline,
            "within 30 s: the sample {sample_seen}, the owner {owner_seen}"
        );
        let theirs = next_stream_event(&mut other, &mut other_pending, "update", |_| true).await;
        sample_seen |= theirs["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["latest"]["memory_used_bytes"] == 75_i64 << 30);
        let owners = theirs["owners"].as_object().cloned().unwrap_or_default();
        assert!(
            owners.keys().all(|uuid| uuid.ends_with("-other")),
            "none of another node's owners: {theirs}"
        );
        owner_seen |= owners
            .get(&other_gpu1)
            .and_then(|o| o.as_array())
            .is_some_and(|o| o.iter().any(|owner| owner["user"] == "alice"));
    }
    // The devices at risk are sent again only when they change: with
    // nothing more written, an update soon carries none of them, and
    // removes none.
    let quiet = next_stream_event(&mut fleet, &mut fleet_pending, "update", |m| {
        m["gpus"].as_array().is_some_and(Vec::is_empty)
    })
    .await;
    assert_eq!(quiet["removed"], serde_json::json!([]), "{quiet}");

    // The API lists a node's devices, or a GPU's, without the fleet's.
    let client = reqwest::Client::new();
    let get = |path: String| client.get(running.api(&path)).send();
    let listed: serde_json::Value = get(format!("/api/v1/gpus?node={}", fixtures::OTHER_NODE))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(uuids(&listed), their_uuids);
    let family: serde_json::Value = get(format!("/api/v1/gpus?uuid={}", fixtures::MIG_A))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut expected = vec![fixtures::GPU2, fixtures::MIG_A, fixtures::MIG_B];
    expected.sort_unstable();
    assert_eq!(
        uuids(&family),
        expected,
        "the instance, its GPU and its sibling"
    );
    let unknown = get("/api/v1/gpus?uuid=GPU-nope".into()).await.unwrap();
    assert_eq!(unknown.status(), reqwest::StatusCode::NOT_FOUND);
    assert!(unknown.text().await.unwrap().contains("GPU-nope"));
    let both = get(format!("/api/v1/gpus?uuid={}&node={NODE}", fixtures::GPU0))
        .await
        .unwrap();
    assert_eq!(both.status(), reqwest::StatusCode::BAD_REQUEST);

    // The fleet shrinks well below the limit: every device again, anew.
    let mut smaller = fixtures::register(NODE, "boot-b");
    smaller.gpus.truncate(1);
    register(store.as_ref(), &smaller).await;
    let mut smaller_other = fixtures::register_other_node();
    smaller_other.boot_id = "boot-b".into();
    smaller_other.gpus.truncate(1);
    register(store.as_ref(), &smaller_other).await;
    let every = next_stream_event(&mut fleet, &mut fleet_pending, "snapshot", |m| {
        m["scope"] == "devices"
    })
    .await;
    assert_eq!(uuids(&every["gpus"]), [fixtures::GPU0, other_gpu0.as_str()]);
    running.stop().await;
    store.close().await;
}

#[tokio::test]
async fn the_live_stream_sends_only_the_devices_that_changed_those_added_and_those_released() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let store = Arc::new(collector(&db).await);
    let session = register(store.as_ref(), &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 5_000;
    let batch = rows_at(&session, &fixtures::batch(1, ts), ts + 100);
    store.write_batch(&batch).await.unwrap();
    let running = RunningCollector::start(store.clone()).await;
    let mut stream = reqwest::get(running.api("/api/v1/stream")).await.unwrap();
    let mut pending = String::new();

    let snapshot = next_stream_change(&mut stream, &mut pending, "snapshot").await;
    let mut all = vec![
        fixtures::GPU0,
        fixtures::GPU1,
        fixtures::GPU2,
        fixtures::MIG_A,
        fixtures::MIG_B,
    ];
    all.sort_unstable();
    assert_eq!(uuids(&snapshot["gpus"]), all);

    // One GPU reports: the update carries it alone, with its new sample.
    let mut only_gpu1 = fixtures::batch(2, ts + 1_000);
    only_gpu1.gpu_samples.retain(|s| s.uuid == fixtures::GPU1);
    only_gpu1.process_samples.clear();
    store
        .write_batch(&rows_at(&session, &only_gpu1, ts + 1_100))
        .await
        .unwrap();
    let update = next_stream_change(&mut stream, &mut pending, "update").await;
    assert_eq!(uuids(&update["gpus"]), [fixtures::GPU1], "{update}");
    assert_eq!(update["gpus"][0]["latest"]["timestamp_ms"], ts + 1_000);
    assert_eq!(uuids(&update["removed"]), Vec::<&str>::new());

    // Another node registers: its devices come, none of the first node's.
    register(store.as_ref(), &fixtures::register_other_node()).await;
    let update = next_stream_change(&mut stream, &mut pending, "update").await;
    let added = uuids(&update["gpus"]);
    assert_eq!(added.len(), 5, "{update}");
    assert!(
        added.iter().all(|uuid| uuid.ends_with("-other")),
        "{update}"
    );
    let node_names: Vec<&str> = update["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    assert_eq!(node_names, [NODE, fixtures::OTHER_NODE]);

    // The first node comes back without one MIG instance: it is removed.
    let mut fewer = fixtures::register(NODE, "boot-b");
    fewer.gpus[2]
        .mig_instances
        .retain(|m| m.uuid != fixtures::MIG_B);
    register(store.as_ref(), &fewer).await;
    let update = next_stream_change(&mut stream, &mut pending, "update").await;
    assert_eq!(uuids(&update["removed"]), [fixtures::MIG_B], "{update}");
    let first_node = &update["nodes"][0];
    assert_eq!(
        (&first_node["boot_id"], &first_node["mig_instance_count"]),
        (&serde_json::json!("boot-b"), &serde_json::json!(1)),
        "the node list follows a registration: {update}"
    );
    running.stop().await;
    store.close().await;
}
