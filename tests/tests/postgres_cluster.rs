//! What only Postgres does: partitions made ahead and dropped past
//! retention, one maintenance leader among several collectors (and another
//! one when it dies), and exactly-once storage when collectors race on the
//! same batches.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests fail loudly by design

use std::collections::HashSet;
use std::sync::Arc;

use headroom_collector::ingest::validate::{self, Limits};
use headroom_collector::model::{NodeSession, StoreBatch, WriteOutcome};
use headroom_collector::store::rollup::{DAY_MS, MINUTE_MS, StorageConfig, bucket_start};
use headroom_collector::store::{PostgresStore, Store};
use headroom_proto::v1 as pb;
use headroom_tests::fixtures::{self, BOOT, NODE, now_ms};
use headroom_tests::postgres::{self, TestDatabase};

async fn collector(db: &TestDatabase) -> PostgresStore {
    PostgresStore::connect(&db.url, StorageConfig::default())
        .await
        .unwrap()
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

/// `YYYYMMDD` of the UTC day holding `ts_ms` (days-from-civil, inverted).
fn day_suffix(ts_ms: i64) -> String {
    let z = ts_ms.div_euclid(DAY_MS) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}")
}

#[test]
fn day_suffix_names_the_utc_day() {
    assert_eq!(day_suffix(0), "19700101");
    assert_eq!(day_suffix(1_764_460_800_000), "20251130");
    assert_eq!(day_suffix(1_709_164_800_000 + DAY_MS - 1), "20240229");
}

async fn register(store: &dyn Store, req: &pb::RegisterRequest) -> NodeSession {
    let reg = validate::registration(req, &Limits::default()).unwrap();
    store.register(&reg, now_ms()).await.unwrap()
}

fn rows_at(session: &NodeSession, batch: &pb::Batch, now: i64) -> StoreBatch {
    validate::batch(batch, session, now, &Limits::default()).unwrap()
}

#[tokio::test]
async fn partitions_exist_ahead_and_go_whole_past_retention() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let store = collector(&db).await;
    let now = now_ms();
    let made = partitions(&store).await;
    for table in ["gpu_samples", "process_samples", "events", "gpu_samples_1m"] {
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
    let old_raw = format!("gpu_samples_p{}", day_suffix(old));
    let old_minutes = format!("gpu_samples_1m_p{}", day_suffix(old));
    assert!(partitions(&store).await.contains(&old_raw));

    let report = store.maintain(now).await.unwrap();
    assert!(report.leader);
    assert!(report.partitions_created > 0, "two days ahead: {report:?}");
    let after = partitions(&store).await;
    assert!(!after.contains(&old_raw), "raw day past retention dropped");
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
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(l.pid) FROM pg_locks l
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
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM gpu_samples")
        .fetch_one(a.pool())
        .await
        .unwrap();
    let distinct_rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT DISTINCT device_id, ts_ms FROM gpu_samples) s",
    )
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(rows, distinct_rows, "no sample stored twice");
    assert_eq!(
        rows,
        2 * distinct.len() as i64,
        "two GPU samples per stored batch"
    );
    a.close().await;
    b.close().await;
    db.drop_database().await;
}
