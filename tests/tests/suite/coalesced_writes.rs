//! The writers that coalesce many streams' batches: concurrent batches
//! share one transaction, each still gets its own outcome, and one bad
//! batch does not fail the others it was grouped with.

use std::sync::Arc;

use futures::future::join_all;
use headroom_collector::ingest::coalesce::{WriteError, Written};
use headroom_collector::ingest::validate::{self, Limits};
use headroom_collector::ingest::{Coalescer, WriterConfig};
use headroom_collector::metrics::{CollectorMetrics, StoreFigures};
use headroom_proto::v1 as pb;
use headroom_store::Store;
use headroom_store::model::{NodeSession, StoreBatch, WriteOutcome};
use headroom_tests::fixtures::{self, BOOT, NODE, now_ms};
use headroom_tests::postgres;

async fn register(store: &dyn Store, req: &pb::RegisterRequest) -> NodeSession {
    let reg = validate::registration(req, &Limits::default()).unwrap();
    store.register(&reg, now_ms()).await.unwrap()
}

fn rows(session: &NodeSession, batch: &pb::Batch) -> StoreBatch {
    validate::batch(batch.clone(), session, now_ms(), &Limits::default()).unwrap()
}

fn counter(metrics: &CollectorMetrics, name: &str) -> u64 {
    let text = metrics.render(StoreFigures::default());
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
}

/// Forty batches from two agents handed over at once (the test runtime
/// polls them all before any writer runs) are written in few transactions,
/// each with the outcome it would have had alone.
async fn concurrent_batches_share_writes(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let other = register(&*store, &fixtures::register_other_node()).await;
    let metrics = Arc::new(CollectorMetrics::default());
    let writers = Coalescer::start(store.clone(), &WriterConfig::default(), metrics.clone());
    let ts = now_ms() - 60_000;
    let mut batches = Vec::new();
    for seq in 1..=20u64 {
        let at = ts + seq as i64 * 1000;
        batches.push(rows(&session, &fixtures::batch(seq, at)));
        batches.push(rows(&other, &fixtures::other_node_batch(seq, at)));
    }
    // A replay of an early batch, behind the later ones: a duplicate.
    batches.push(rows(&session, &fixtures::batch(3, ts + 3000)));
    let results: Vec<Written> = join_all(batches.into_iter().map(|b| writers.write(b))).await;
    let outcomes: Vec<WriteOutcome> = results
        .iter()
        .map(|w| *w.outcome.as_ref().unwrap())
        .collect();
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == WriteOutcome::Committed)
            .count(),
        40
    );
    // Stored once either way: a duplicate, or where samples wait in open
    // chunks, its samples taken again (and held once).
    assert!(
        matches!(
            outcomes[40],
            WriteOutcome::Duplicate { .. } | WriteOutcome::Replayed
        ),
        "{:?}",
        outcomes[40]
    );
    assert_eq!(
        results[7].batch.seq, 4,
        "each batch comes back to its stream"
    );
    let writes = counter(&metrics, "headroom_collector_write_groups_total");
    assert_eq!(
        counter(&metrics, "headroom_collector_write_group_batches_total"),
        41
    );
    assert!(writes <= 3, "41 batches in {writes} writes");
    let series = store
        .device_series(fixtures::GPU0, ts, ts + 30_000, 1000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(series.len(), 20, "one sample per batch, none twice");
    assert!(series.iter().all(|p| p.samples == 1));
    store.flush(true).await.unwrap();
    let written = store
        .device_series(fixtures::GPU0, ts, ts + 30_000, 1000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(written, series, "the same once written as chunks");
}

#[tokio::test]
async fn concurrent_batches_share_writes_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("c.db").display());
    concurrent_batches_share_writes(headroom_store::connect(&url).await.unwrap()).await;
}

#[tokio::test]
async fn concurrent_batches_share_writes_on_postgres() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    concurrent_batches_share_writes(headroom_store::connect(&db.url).await.unwrap()).await;
    db.drop_database().await;
}

/// A batch the database refuses (here a device id past the column's range,
/// which validation would never produce) fails alone: the batches written
/// with it are redone one by one and committed.
#[tokio::test]
async fn one_refused_batch_does_not_fail_its_group() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let store = headroom_store::connect(&db.url).await.unwrap();
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let other = register(&*store, &fixtures::register_other_node()).await;
    let metrics = Arc::new(CollectorMetrics::default());
    let writers = Coalescer::start(store.clone(), &WriterConfig::default(), metrics.clone());
    let ts = now_ms() - 60_000;
    let mut poisoned = rows(&other, &fixtures::other_node_batch(1, ts));
    poisoned.gpu_samples[0].device_id = 1 << 40;
    let batches = vec![
        rows(&session, &fixtures::batch(1, ts)),
        poisoned,
        rows(&session, &fixtures::batch(2, ts + 1000)),
    ];
    let results: Vec<Written> = join_all(batches.into_iter().map(|b| writers.write(b))).await;
    assert!(matches!(results[0].outcome, Ok(WriteOutcome::Committed)));
    assert!(
        matches!(&results[1].outcome, Err(WriteError::Store(e)) if e.to_string().contains("device id 1099511627776 is out of range")),
        "{:?}",
        results[1].outcome
    );
    assert!(matches!(results[2].outcome, Ok(WriteOutcome::Committed)));
    assert_eq!(
        counter(&metrics, "headroom_collector_write_group_splits_total"),
        1
    );
    // The refused batch left nothing behind: its agent may resend it.
    let again = store
        .session(fixtures::OTHER_NODE, BOOT)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.committed_seq, 0);
    db.drop_database().await;
}
