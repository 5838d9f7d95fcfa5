//! An allocator chunk's minutes (`allocator_samples_packed.minutes`) on
//! both stores, beyond the conformance suite: an hour of a job's reports,
//! compacted, keeps them; a chart of buckets a minute or wider reads them
//! and shows what the reports showed before compaction; minutes that no
//! longer decode cost nothing, the chart reading that chunk's reports
//! instead. The database is reached beside the store, as an operator's
//! `psql` or `sqlite3` would.

use std::sync::Arc;

use headroom_collector::ingest::validate::{self, Limits};
use headroom_store::model::StoreBatch;
use headroom_store::rollup::{HOUR_MS, MINUTE_MS, bucket_start};
use headroom_store::{AllocatorPoint, AllocatorSeriesQuery, Store};
use headroom_tests::fixtures::{self, BOOT, GIB, GPU0, NODE, now_ms};
use headroom_tests::postgres;

/// The store's database, as an operator reaches it.
enum Beside {
    Postgres(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
}

impl Beside {
    /// Runs `sql`; the first column of its first row, where it has one.
    async fn run(&self, sql: &str) -> Option<i64> {
        match self {
            Beside::Postgres(pool) => sqlx::query_scalar(sql).fetch_optional(pool).await,
            Beside::Sqlite(pool) => sqlx::query_scalar(sql).fetch_optional(pool).await,
        }
        .expect(sql)
    }

    /// A BLOB (`bytea`) literal of the bytes in `hex`.
    fn blob(&self, hex: &str) -> String {
        match self {
            Beside::Postgres(_) => format!("'\\x{hex}'"),
            Beside::Sqlite(_) => format!("X'{hex}'"),
        }
    }
}

#[tokio::test]
async fn an_hour_charts_from_its_minutes_and_from_its_reports_where_they_are_damaged_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("headroom.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    let beside = Beside::Sqlite(sqlx::SqlitePool::connect(&url).await.unwrap());
    an_hour_charts_from_its_minutes_and_from_its_reports_where_they_are_damaged(store, beside)
        .await;
}

#[tokio::test]
async fn an_hour_charts_from_its_minutes_and_from_its_reports_where_they_are_damaged_on_postgres() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let store = headroom_store::connect(&db.url).await.unwrap();
    let beside = Beside::Postgres(sqlx::PgPool::connect(&db.url).await.unwrap());
    an_hour_charts_from_its_minutes_and_from_its_reports_where_they_are_damaged(store, beside)
        .await;
    db.drop_database().await;
}

async fn an_hour_charts_from_its_minutes_and_from_its_reports_where_they_are_damaged(
    store: Arc<dyn Store>,
    beside: Beside,
) {
    let reg = validate::registration(&fixtures::register(NODE, BOOT), &Limits::default()).unwrap();
    let session = store.register(&reg, now_ms()).await.unwrap();
    let now = now_ms();
    let hour = bucket_start(now - 3 * HOUR_MS, HOUR_MS);
    let batch = |seq: u64| {
        let ts = hour + seq as i64 * 10_000;
        let mut b = fixtures::batch(seq, ts);
        let mut job = fixtures::process_sample(GPU0, ts, 900, 20 * GIB);
        job.start_time_ms = hour - HOUR_MS;
        job.allocator = Some(headroom_proto::v1::AllocatorStats {
            timestamp_ms: ts - 10,
            allocated_bytes: (seq % 17) * GIB,
            reserved_bytes: 100 * GIB,
            active_bytes: (seq % 17) * GIB,
            inactive_split_bytes: seq % 5,
            peak_allocated_bytes: 100 * GIB,
            alloc_retries: seq / 100,
            ooms: 0,
            composition: None,
        });
        b.process_samples.push(job);
        validate::batch(b, &session, now, &Limits::default()).unwrap()
    };
    for minute in 0..60u64 {
        let group: Vec<StoreBatch> = (1..=6).map(|i| batch(minute * 6 + i)).collect();
        store.write_batches(&group).await.unwrap();
        store.flush(true).await.unwrap();
    }
    // Ranges charted at 13 points (buckets of 4.6 to 4.8 minutes, each the
    // highest of its reports' figures): the hour and a minute each side;
    // exactly the hour's reports, the ends included; and three that cut
    // through it, which read the chunk's reports.
    let (first, last) = (hour + 10_000 - 10, hour + 360 * 10_000 - 10);
    let ranges = [
        (hour - MINUTE_MS, hour + HOUR_MS + MINUTE_MS),
        (first, last),
        (
            hour + 10 * MINUTE_MS + 30_000,
            hour + 40 * MINUTE_MS + 15_000,
        ),
        (hour + 10 * MINUTE_MS + 30_000, hour + HOUR_MS + MINUTE_MS),
        (hour - MINUTE_MS, hour + 40 * MINUTE_MS + 15_000),
    ];
    let chart = async |(from_ms, to_ms): (i64, i64)| {
        store
            .allocator_series(&AllocatorSeriesQuery {
                device_uuid: GPU0,
                pid: 900,
                start_time_ms: None,
                from_ms,
                to_ms,
                max_points: 13,
            })
            .await
            .unwrap()
            .unwrap()
            .points
    };
    let mut before = Vec::new();
    for range in ranges {
        before.push(chart(range).await);
    }
    assert_eq!(before[0].len(), 13);
    let reports = |points: &[AllocatorPoint]| points.iter().map(|p| p.reports).sum::<i64>();
    assert_eq!(reports(&before[0]), 360);
    assert_eq!(reports(&before[1]), 360);
    assert_eq!(
        reports(&before[2]),
        178,
        "the 64th report (10:39.99) to the 241st"
    );
    store.maintain(now).await.unwrap();
    let with_minutes = beside
        .run("SELECT count(*) FROM allocator_samples_packed WHERE minutes IS NOT NULL AND samples = 360")
        .await;
    assert_eq!(
        with_minutes,
        Some(1),
        "the hour compacted into one chunk, with its minutes"
    );
    for (range, before) in ranges.iter().zip(&before) {
        assert_eq!(&chart(*range).await, before, "{range:?}");
    }
    // The reports damaged: the chart still whole, from the minutes alone.
    // Then the reports back and the minutes damaged.
    for damage in [
        "CREATE TABLE saved AS SELECT data FROM allocator_samples_packed WHERE minutes IS NOT NULL"
            .to_owned(),
        format!(
            "UPDATE allocator_samples_packed SET data = {} WHERE minutes IS NOT NULL",
            beside.blob("01ff")
        ),
        String::new(),
        format!(
            "UPDATE allocator_samples_packed SET data = (SELECT data FROM saved), minutes = {}
             WHERE minutes IS NOT NULL",
            beside.blob("02ff")
        ),
    ] {
        if damage.is_empty() {
            for (range, before) in ranges[..2].iter().zip(&before) {
                assert_eq!(
                    &chart(*range).await,
                    before,
                    "read from the minutes: {range:?}"
                );
            }
        } else {
            beside.run(&damage).await;
        }
    }
    for (range, before) in ranges.iter().zip(&before) {
        assert_eq!(
            &chart(*range).await,
            before,
            "read from the reports: {range:?}"
        );
    }
    store.close().await;
}
