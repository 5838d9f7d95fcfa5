//! One suite, both backends: every case runs against SQLite and against a
//! real Postgres (see `headroom_tests::postgres`).

use std::sync::Arc;

use headroom_collector::ingest::validate::{self, Limits};
use headroom_proto::v1 as pb;
use headroom_store::alerts::{
    ActiveAlertCounts, AlertFilter, AlertUpdate, NewNotification, NewSilence, UpdateKind,
};
use headroom_store::model::{DeviceBudget, NodeSession, StoreBatch, WriteOutcome};
use headroom_store::rollup::{self, DAY_MS, HOUR_MS, MINUTE_MS, MaintenanceReport};
use headroom_store::tokens::{NewToken, TokenRole};
use headroom_store::{AllocatorSeriesQuery, FleetHistoryPoint, ProcessView, Store, StoreError};
use headroom_store::{OwnerMatch, ProcessesOn};
use headroom_tests::fixtures::{self, BOOT, GIB, GPU0, GPU1, GPU2, MIG_A, MIG_B, NODE, now_ms};
use headroom_tests::postgres;

async fn register(store: &dyn Store, req: &pb::RegisterRequest) -> NodeSession {
    let reg = validate::registration(req, &Limits::default()).unwrap();
    store.register(&reg, now_ms()).await.unwrap()
}

/// Writes what the store holds in open chunks (its flush would, within a
/// minute), then runs a maintenance pass: what a collector has done by the
/// time a user reads rollups.
async fn settle(store: &dyn Store, now_ms: i64) -> Result<MaintenanceReport, StoreError> {
    store.flush(true).await?;
    store.maintain(now_ms).await
}

async fn write(store: &dyn Store, session: &NodeSession, batch: &pb::Batch) -> WriteOutcome {
    let rows = validate::batch(batch.clone(), session, now_ms(), &Limits::default()).unwrap();
    store.write_batch(&rows).await.unwrap()
}

async fn registration_assigns_ids_and_keeps_them(store: Arc<dyn Store>) {
    let first = register(&*store, &fixtures::register(NODE, BOOT)).await;
    assert_eq!(first.committed_seq, 0);
    assert_eq!(first.device_ids.len(), 5, "3 GPUs and 2 MIG instances");
    let again = register(&*store, &fixtures::register(NODE, BOOT)).await;
    assert_eq!(again.device_ids, first.device_ids);
    let loaded = store.session(NODE, BOOT).await.unwrap().unwrap();
    assert_eq!(loaded.device_ids, first.device_ids);
    assert!(store.session(NODE, "other-boot").await.unwrap().is_none());
    assert!(store.session("nobody", BOOT).await.unwrap().is_none());

    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!((nodes[0].gpu_count, nodes[0].mig_instance_count), (3, 2));
    assert_eq!(nodes[0].driver_version, "550.54.15");
}

async fn mig_reconfiguration_hides_removed_instances(store: Arc<dyn Store>) {
    register(&*store, &fixtures::register(NODE, BOOT)).await;
    let mut req = fixtures::register(NODE, BOOT);
    req.gpus[2].mig_instances = vec![fixtures::mig(MIG_A, 1)];
    let session = register(&*store, &req).await;
    // A batch sampled before the change may arrive after it: the session
    // still accepts the removed instance, the fleet view no longer shows it.
    assert!(session.device_ids.contains_key(MIG_B));
    let devices = store.latest_devices().await.unwrap().to_vec();
    let uuids: Vec<&str> = devices.iter().map(|d| d.uuid.as_ref()).collect();
    assert_eq!(uuids, vec![GPU0, GPU1, GPU2, MIG_A]);
    let mig = &devices[3];
    assert_eq!(mig.kind, "mig");
    assert_eq!(mig.parent_uuid.as_deref(), Some(GPU2));
    assert_eq!(mig.mig_profile.as_deref(), Some("3g.40gb"));
    assert_eq!(mig.memory_total_bytes, (40 * GIB) as i64);
}

async fn batch_shows_up_in_latest_series_and_processes(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 5_000;
    assert_eq!(
        write(&*store, &session, &fixtures::batch(1, ts)).await,
        WriteOutcome::Committed
    );

    let devices = store.latest_devices().await.unwrap().to_vec();
    let gpu0 = devices.iter().find(|d| &*d.uuid == GPU0).unwrap();
    let latest = gpu0.latest.as_ref().unwrap();
    assert_eq!(latest.timestamp_ms, ts);
    assert_eq!(latest.memory_used_bytes, (40 * GIB) as i64);
    assert_eq!(latest.memory_used_max_bytes, (41 * GIB) as i64);
    // 80 GiB total − 40 GiB used − 0.5 GiB reserved.
    assert_eq!(latest.headroom_bytes, (39 * GIB + GIB / 2) as i64);
    assert!(
        (latest.headroom_pct - 49.4).abs() < 0.05,
        "{}",
        latest.headroom_pct
    );
    assert_eq!(latest.peak_headroom_bytes, (38 * GIB + GIB / 2) as i64);
    assert_eq!(latest.utilization_pct, Some(70));
    assert_eq!(latest.pcie_rx_bytes_per_s, Some(2_000_000));
    let gpu2 = devices.iter().find(|d| &*d.uuid == GPU2).unwrap();
    assert!(gpu2.latest.is_none(), "no sample for GPU2 yet");

    let series = store
        .device_series(GPU1, ts - 1000, ts + 1000, 100)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(series.len(), 1);
    assert_eq!(series[0].samples, 1);
    assert_eq!(series[0].memory_used_bytes, (10 * GIB) as i64);
    assert!(
        store
            .device_series("GPU-unknown", 0, 1, 10)
            .await
            .unwrap()
            .is_none()
    );

    let procs = store.processes(ts - 1, ProcessesOn::Fleet).await.unwrap();
    assert_eq!(procs.len(), 1);
    let p = &procs[0];
    assert_eq!(
        (p.pid, p.user.as_str(), p.slurm_job_id.as_str()),
        (777, "alice", "4242")
    );
    assert_eq!(
        (p.container_runtime.as_str(), p.pod_qos_class.as_str()),
        ("docker", "")
    );
    assert_eq!(p.device_uuid, GPU0);
    assert_eq!(p.node, NODE);
    assert_eq!(p.memory_used_bytes, (39 * GIB) as i64);
    assert!(
        store
            .processes(ts + 1, ProcessesOn::Fleet)
            .await
            .unwrap()
            .is_empty(),
        "not seen since ts+1"
    );
    assert_eq!(
        store
            .processes(ts - 1, ProcessesOn::Node(NODE))
            .await
            .unwrap(),
        procs,
        "the node's own"
    );
    assert!(
        store
            .processes(ts - 1, ProcessesOn::Node("another-node"))
            .await
            .unwrap()
            .is_empty(),
        "none of another node's"
    );
    let on = |uuids: &[&str]| uuids.iter().map(|u| (*u).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        store
            .processes(ts - 1, ProcessesOn::Devices(&on(&[GPU1, GPU0])))
            .await
            .unwrap(),
        procs,
        "those on the devices named"
    );
    assert!(
        store
            .processes(ts - 1, ProcessesOn::Devices(&on(&[GPU1])))
            .await
            .unwrap()
            .is_empty(),
        "none on a device not named"
    );
    assert!(
        store
            .processes(ts + 1, ProcessesOn::Node(NODE))
            .await
            .unwrap()
            .is_empty()
            && store
                .processes(ts + 1, ProcessesOn::Devices(&on(&[GPU0])))
                .await
                .unwrap()
                .is_empty(),
        "a node's or a device's, not seen since ts+1"
    );

    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes[0].last_seen_ms.max(ts), nodes[0].last_seen_ms);
}

async fn replayed_batch_is_stored_once(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 10_000;
    assert_eq!(
        write(&*store, &session, &fixtures::batch(1, ts)).await,
        WriteOutcome::Committed
    );
    assert_eq!(
        write(&*store, &session, &fixtures::batch(2, ts + 1000)).await,
        WriteOutcome::Committed
    );
    // Before its samples are durable a replay is taken again, stored once;
    // after, it is a duplicate, and the agent may forget it.
    assert_eq!(
        write(&*store, &session, &fixtures::batch(1, ts)).await,
        WriteOutcome::Replayed
    );
    store.flush(true).await.unwrap();
    assert_eq!(
        write(&*store, &session, &fixtures::batch(1, ts)).await,
        WriteOutcome::Duplicate { committed_seq: 2 }
    );
    assert_eq!(
        write(&*store, &session, &fixtures::batch(2, ts + 1000)).await,
        WriteOutcome::Duplicate { committed_seq: 2 }
    );
    let series = store
        .device_series(GPU0, ts - 1, ts + 2000, 1000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        series.iter().map(|p| p.samples).collect::<Vec<_>>(),
        vec![1, 1]
    );
    // The committed seq survives re-registration, so the agent knows what to drop.
    let again = register(&*store, &fixtures::register(NODE, BOOT)).await;
    assert_eq!((again.committed_seq, again.durable_seq), (2, 2));
    // A new boot of the node starts its own sequence.
    let new_boot = register(&*store, &fixtures::register(NODE, "boot-b")).await;
    assert_eq!(new_boot.committed_seq, 0);
    let mut b = fixtures::batch(1, ts + 2000);
    b.boot_id = "boot-b".into();
    assert_eq!(write(&*store, &new_boot, &b).await, WriteOutcome::Committed);
}

async fn latest_never_goes_back_in_time(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 10_000;
    write(&*store, &session, &fixtures::batch(1, ts + 5000)).await;
    // A later batch carrying an older interval (a replay from another spool).
    write(&*store, &session, &fixtures::batch(2, ts)).await;
    let devices = store.latest_devices().await.unwrap().to_vec();
    let gpu0 = devices.iter().find(|d| &*d.uuid == GPU0).unwrap();
    assert_eq!(gpu0.latest.as_ref().unwrap().timestamp_ms, ts + 5000);
}

async fn series_folds_buckets_keeping_extremes(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let start = (now_ms() - 60_000) / 10_000 * 10_000;
    for i in 0..10u64 {
        let mut b = fixtures::batch(i + 1, start + i as i64 * 1000);
        b.gpu_samples[0] = fixtures::gpu_sample(GPU0, start + i as i64 * 1000, (10 + i) * GIB);
        write(&*store, &session, &b).await;
    }
    let series = store
        .device_series(GPU0, start, start + 9_999, 5)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(series.len(), 5);
    assert!(series.iter().all(|p| p.samples == 2));
    // First bucket: used 10 and 11 GiB, min 9, max 12.
    assert_eq!(series[0].memory_used_min_bytes, (9 * GIB) as i64);
    assert_eq!(series[0].memory_used_max_bytes, (12 * GIB) as i64);
    assert_eq!(series[0].memory_used_bytes, (10 * GIB + GIB / 2) as i64);
    assert_eq!(series[4].memory_used_max_bytes, (20 * GIB) as i64);
    assert_eq!(series[0].timestamp_ms, start + 1000);
}

async fn process_keeps_its_peak_and_latest(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 10_000;
    let mut b1 = fixtures::batch(1, ts);
    b1.process_samples[0] = fixtures::process_sample(GPU0, ts, 777, 30 * GIB);
    b1.process_samples[0].start_time_ms = ts - 1000;
    let mut b2 = fixtures::batch(2, ts + 1000);
    b2.process_samples[0] = fixtures::process_sample(GPU0, ts + 1000, 777, 20 * GIB);
    b2.process_samples[0].start_time_ms = ts - 1000;
    // Same pid, new start time: a different process (pid reuse).
    b2.process_samples.push({
        let mut p = fixtures::process_sample(GPU1, ts + 1000, 777, 5 * GIB);
        p.start_time_ms = ts + 500;
        p.user = "bob".into();
        p
    });
    write(&*store, &session, &b1).await;
    write(&*store, &session, &b2).await;
    let procs = store.processes(ts, ProcessesOn::Fleet).await.unwrap();
    assert_eq!(procs.len(), 2);
    let alice = procs.iter().find(|p| p.user == "alice").unwrap();
    assert_eq!(alice.memory_used_bytes, (20 * GIB) as i64);
    assert_eq!(alice.memory_peak_bytes, (30 * GIB + GIB / 4) as i64);
    assert_eq!(alice.first_seen_ms, ts);
    assert_eq!(alice.last_seen_ms, ts + 1000);
    let bob = procs.iter().find(|p| p.user == "bob").unwrap();
    assert_eq!(bob.device_uuid, GPU1);
}

/// The dashboard's user, job and pod filters, answered by the store: each
/// part a literal, case-sensitive substring, all parts together, and the
/// same answer as the fleet's list filtered in Rust.
async fn processes_are_found_by_their_owner(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 10_000;
    let mut batch = fixtures::batch(1, ts);
    let owned = |uuid: &str, pid: u32, user: &str, job: &str, pod: &str| {
        let mut p = fixtures::process_sample(uuid, ts, pid, u64::from(pid) * GIB);
        (p.user, p.slurm_job_id, p.pod_uid) = (user.into(), job.into(), pod.into());
        p
    };
    batch.process_samples = vec![
        owned(GPU0, 1, "alice", "4242", ""),
        owned(GPU1, 2, "bob", "", "9f3e0000-pod"),
        owned(GPU1, 3, "carol_x", "1424", ""),
    ];
    write(&*store, &session, &batch).await;
    let fleet = store.processes(ts - 1, ProcessesOn::Fleet).await.unwrap();
    assert_eq!(fleet.len(), 3);
    async fn pids(
        store: &dyn Store,
        since_ms: i64,
        fleet: &[ProcessView],
        owner: OwnerMatch<'_>,
    ) -> Vec<i64> {
        let found = store
            .processes(since_ms, ProcessesOn::Owners(owner))
            .await
            .unwrap();
        let expected: Vec<_> = fleet.iter().filter(|p| owner.matches(p)).cloned().collect();
        assert_eq!(
            found, expected,
            "the store and `OwnerMatch::matches` agree on {owner:?}"
        );
        found.iter().map(|p| p.pid).collect()
    }
    let pids = |owner| pids(&*store, ts - 1, &fleet, owner);
    let user = |user| OwnerMatch {
        user,
        ..OwnerMatch::default()
    };
    let job = |slurm_job_id| OwnerMatch {
        slurm_job_id,
        ..OwnerMatch::default()
    };
    assert_eq!(
        pids(OwnerMatch::default()).await,
        [3, 2, 1],
        "no part: every process"
    );
    assert_eq!(pids(user("li")).await, [1]);
    assert_eq!(pids(user("Alice")).await, [0i64; 0], "case counts");
    assert_eq!(pids(user("%")).await, [0i64; 0], "no LIKE wildcards");
    assert_eq!(pids(user("_")).await, [3], "an underscore is an underscore");
    assert_eq!(pids(job("424")).await, [3, 1]);
    assert_eq!(pids(job("4242")).await, [1]);
    let pod = OwnerMatch {
        pod_uid: "9f3e",
        ..OwnerMatch::default()
    };
    assert_eq!(pids(pod).await, [2]);
    let both = OwnerMatch {
        user: "alice",
        slurm_job_id: "1424",
        pod_uid: "",
    };
    assert_eq!(pids(both).await, [0i64; 0], "every part must match");
    assert!(
        store
            .processes(ts + 1, ProcessesOn::Owners(user("alice")))
            .await
            .unwrap()
            .is_empty(),
        "a process not seen lately is not current, whoever owns it"
    );
}

async fn allocator_reports_are_stored_once_per_report(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 10_000;
    let report = |at: i64, allocated: u64, retries: u64| pb::AllocatorStats {
        timestamp_ms: at,
        allocated_bytes: allocated,
        reserved_bytes: 50 * GIB,
        active_bytes: allocated,
        inactive_split_bytes: 3 * GIB,
        peak_allocated_bytes: 40 * GIB,
        alloc_retries: retries,
        ooms: 1,
        composition: None,
    };
    let sample = |at: i64, stats: Option<pb::AllocatorStats>| {
        let mut p = fixtures::process_sample(GPU0, at, 777, 52 * GIB);
        p.start_time_ms = ts - 60_000;
        p.allocator = stats;
        p
    };
    // The agent joins the newest report to every interval until a newer one
    // comes: the same report in two batches is one point.
    let mut b1 = fixtures::batch(1, ts);
    b1.process_samples = vec![sample(ts, Some(report(ts - 100, 30 * GIB, 2)))];
    let mut b2 = fixtures::batch(2, ts + 1000);
    b2.process_samples = vec![sample(ts + 1000, Some(report(ts - 100, 30 * GIB, 2)))];
    let mut b3 = fixtures::batch(3, ts + 2000);
    b3.process_samples = vec![
        sample(ts + 2000, Some(report(ts + 1900, 35 * GIB, 5))),
        fixtures::process_sample(GPU1, ts + 2000, 888, 4 * GIB),
    ];
    // A later batch carrying an older report (an agent's delayed interval)
    // does not take the latest back.
    let mut b4 = fixtures::batch(4, ts + 3000);
    b4.process_samples = vec![sample(ts + 3000, Some(report(ts + 1000, 31 * GIB, 3)))];
    // A flush between two batches carrying one report (written as chunks,
    // the report is in a chunk and held again) leaves it one point too.
    write(&*store, &session, &b1).await;
    store.flush(true).await.unwrap();
    for b in [&b2, &b3, &b4] {
        write(&*store, &session, b).await;
    }
    let procs = store.processes(ts, ProcessesOn::Fleet).await.unwrap();
    let trainer = procs.iter().find(|p| p.pid == 777).unwrap();
    let latest = trainer.allocator.as_ref().unwrap();
    assert_eq!(latest.timestamp_ms, ts + 1900);
    assert_eq!(latest.allocated_bytes, (35 * GIB) as i64);
    assert_eq!(latest.fragmentation_bytes, (15 * GIB) as i64);
    assert!((latest.fragmentation_ratio - 0.3).abs() < 1e-9);
    assert_eq!(latest.alloc_retries, 5);
    assert!(
        procs
            .iter()
            .find(|p| p.pid == 888)
            .unwrap()
            .allocator
            .is_none()
    );

    let query = |pid: i64, start: Option<i64>| AllocatorSeriesQuery {
        device_uuid: GPU0,
        pid,
        start_time_ms: start,
        from_ms: ts - 1000,
        to_ms: ts + 5000,
        max_points: 100,
    };
    let series = store
        .allocator_series(&query(777, None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(series.start_time_ms, ts - 60_000);
    let retries: Vec<i64> = series.points.iter().map(|p| p.alloc_retries).collect();
    assert_eq!(
        retries,
        vec![2, 3, 5],
        "one point per report, in report order"
    );
    assert_eq!(series.points[0].fragmentation_bytes, (20 * GIB) as i64);
    assert_eq!(series.points[2].reserved_bytes, (50 * GIB) as i64);
    // Written (as chunks, where they are), the reports chart the same.
    store.flush(true).await.unwrap();
    let written = store
        .allocator_series(&query(777, None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(written, series);
    // Folded into one bucket, the highest values survive.
    let one = store
        .allocator_series(&AllocatorSeriesQuery {
            max_points: 1,
            ..query(777, None)
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(one.points.len(), 1);
    assert_eq!(one.points[0].reports, 3);
    assert_eq!(one.points[0].fragmentation_bytes, (20 * GIB) as i64);
    assert_eq!(one.points[0].alloc_retries, 5);
    assert!(
        store
            .allocator_series(&query(999, None))
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .allocator_series(&query(777, Some(ts)))
            .await
            .unwrap()
            .is_none(),
        "no incarnation started then"
    );
}

/// What a job's client counts in its tensors is stored with its allocator
/// report, split into shares that add up to what the driver sees, and a
/// figure that cannot be true is dropped without losing the report.
async fn memory_composition_is_stored_split_and_checked(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let ts = now_ms() - 10_000;
    let part = |bytes: u64, dtype: &str| {
        Some(pb::CompositionPart {
            bytes,
            dtype: dtype.to_owned(),
        })
    };
    let report = |at: i64, optimizer: u64| pb::AllocatorStats {
        timestamp_ms: at,
        allocated_bytes: 30 * GIB,
        reserved_bytes: 50 * GIB,
        active_bytes: 30 * GIB,
        inactive_split_bytes: GIB,
        peak_allocated_bytes: 40 * GIB,
        alloc_retries: 0,
        ooms: 0,
        composition: Some(pb::MemoryComposition {
            weights: part(7 * GIB, "bfloat16"),
            gradients: part(7 * GIB, "bfloat16"),
            optimizer_state: part(optimizer, "float32"),
        }),
    };
    let sample = |at: i64, stats: pb::AllocatorStats| {
        let mut p = fixtures::process_sample(GPU0, at, 777, 52 * GIB);
        p.start_time_ms = ts - 60_000;
        p.allocator = Some(stats);
        p
    };
    let mut b1 = fixtures::batch(1, ts);
    b1.process_samples = vec![sample(ts, report(ts - 100, 14 * GIB))];
    write(&*store, &session, &b1).await;

    let procs = store.processes(ts, ProcessesOn::Fleet).await.unwrap();
    let latest = procs[0].allocator.as_ref().unwrap();
    let b = latest.breakdown.expect("a counted composition is split");
    assert_eq!(b.weights_bytes, Some(7 * GIB));
    assert_eq!(b.weights_dtype, Some(headroom_common::Dtype::Bfloat16));
    assert_eq!(b.optimizer_state_bytes, Some(14 * GIB));
    assert_eq!(
        b.optimizer_state_dtype,
        Some(headroom_common::Dtype::Float32)
    );
    assert_eq!(
        b.activations_bytes,
        12 * GIB,
        "the 40 GiB peak less 28 counted"
    );
    assert_eq!(b.cache_bytes, 10 * GIB, "50 reserved less the peak");
    assert_eq!(
        b.outside_allocator_bytes,
        2 * GIB,
        "52 the driver sees less 50"
    );
    assert_eq!(b.total_bytes, 52 * GIB);
    assert_eq!(
        b.largest().unwrap().0,
        headroom_common::Share::OptimizerState
    );

    // 45 GiB of optimizer state cannot be live tensors of a 40 GiB peak: that
    // part is dropped, the others and the allocator's figures are kept.
    let mut b2 = fixtures::batch(2, ts + 1000);
    b2.process_samples = vec![sample(ts + 1000, report(ts + 900, 45 * GIB))];
    write(&*store, &session, &b2).await;
    let procs = store.processes(ts, ProcessesOn::Fleet).await.unwrap();
    let latest = procs[0].allocator.as_ref().unwrap();
    assert_eq!(latest.timestamp_ms, ts + 900, "the report itself is stored");
    let b = latest.breakdown.unwrap();
    assert_eq!(b.optimizer_state_bytes, None);
    assert_eq!(b.weights_bytes, Some(7 * GIB));
    assert!(
        !b.complete,
        "the rest of the peak is no longer only activations"
    );

    let series = store
        .allocator_series(&AllocatorSeriesQuery {
            device_uuid: GPU0,
            pid: 777,
            start_time_ms: None,
            from_ms: ts - 1000,
            to_ms: ts + 5000,
            max_points: 100,
        })
        .await
        .unwrap()
        .unwrap();
    let optimizer: Vec<Option<i64>> = series
        .points
        .iter()
        .map(|p| p.optimizer_state_bytes)
        .collect();
    assert_eq!(optimizer, vec![Some((14 * GIB) as i64), None]);
    assert_eq!(series.points[1].weights_bytes, Some((7 * GIB) as i64));
}

async fn gpu_page_reads_process_series_and_events(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let start = now_ms() - 60_000;
    for i in 0..10u64 {
        let ts = start + i as i64 * 1000;
        let mut b = fixtures::batch(i + 1, ts);
        b.process_samples = [
            fixtures::process_sample(GPU0, ts, 777, (30 + i) * GIB),
            fixtures::process_sample(GPU0, ts, 778, 5 * GIB),
            fixtures::process_sample(GPU1, ts, 779, 9 * GIB),
        ]
        .into_iter()
        .map(|mut p| {
            p.start_time_ms = start - 60_000;
            p
        })
        .collect();
        if i == 4 {
            b.events = vec![pb::Event {
                kind: pb::EventKind::Xid as i32,
                timestamp_ms: ts,
                uuid: GPU0.into(),
                code: 79,
                pid: 0,
                detail: "fallen off the bus".into(),
            }];
        }
        write(&*store, &session, &b).await;
    }
    // Two buckets of 5 s: every process's points share the buckets' ends,
    // so they stack, and each keeps its bucket's highest value.
    let series = store
        .process_series(GPU0, start, start + 9_999, 2)
        .await
        .unwrap()
        .unwrap();
    let pids: Vec<i64> = series.iter().map(|p| p.pid).collect();
    assert_eq!(pids, vec![777, 778], "biggest first, only this GPU's");
    assert_eq!(
        series[0].points,
        vec![
            (start + 4999, (34 * GIB + GIB / 4) as i64),
            (start + 9999, (39 * GIB + GIB / 4) as i64)
        ],
        "memory used at its highest poll"
    );
    assert_eq!(series[1].points[0].0, start + 4999);
    assert_eq!(series[0].peak_bytes, (39 * GIB + GIB / 4) as i64);
    assert!(
        store
            .process_series("GPU-nope", start, start + 1, 10)
            .await
            .unwrap()
            .is_none()
    );

    let events = store
        .device_events(GPU0, start, start + 10_000, 100)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!((events[0].kind.as_str(), events[0].code), ("xid", 79));
    assert_eq!(events[0].timestamp_ms, start + 4000);
    assert!(
        store
            .device_events(GPU1, start, start + 10_000, 100)
            .await
            .unwrap()
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .device_events("GPU-nope", start, start + 1, 10)
            .await
            .unwrap()
            .is_none()
    );
}

fn update(kind: UpdateKind, at_ms: i64, channels: &[&str]) -> AlertUpdate {
    AlertUpdate {
        fingerprint: "fp-1".into(),
        rule: "watermark".into(),
        severity: "warning".into(),
        kind,
        at_ms,
        labels: r#"{"node":"n1","gpu":"0"}"#.into(),
        summary: format!("summary at {at_ms}"),
        details: r#"{"used_fraction":0.93}"#.into(),
        remedy: format!("remedy at {at_ms}"),
        notifications: channels
            .iter()
            .map(|c| NewNotification {
                channel: (*c).into(),
                idempotency_key: format!("fp-1:{at_ms}:{c}"),
                payload: format!("{{\"at\":{at_ms}}}"),
                group_key: if *c == "slack" {
                    "n1".into()
                } else {
                    String::new()
                },
                deliver_at_ms: at_ms,
            })
            .collect(),
    }
}

async fn alert_lifecycle_notifies_once_per_change(store: Arc<dyn Store>) {
    let s = &*store;
    let pending = s
        .apply_alert(&update(UpdateKind::Pending, 1000, &["hook"]))
        .await
        .unwrap();
    assert!(!pending.notified);
    assert_eq!(
        s.active_alert_counts().await.unwrap(),
        ActiveAlertCounts {
            pending: 1,
            firing: 0
        }
    );
    let fired = s
        .apply_alert(&update(
            UpdateKind::Firing { escalated: false },
            2000,
            &["hook", "slack"],
        ))
        .await
        .unwrap();
    assert!(fired.notified);
    assert_eq!(
        fired.alert_id, pending.alert_id,
        "one row from pending to firing"
    );
    let again = s
        .apply_alert(&update(
            UpdateKind::Firing { escalated: false },
            3000,
            &["hook"],
        ))
        .await
        .unwrap();
    assert!(!again.notified, "already firing: not news");
    assert_eq!(s.undelivered_notifications().await.unwrap(), 2);
    let due = s.claim_notifications(2000, 60_000, 10).await.unwrap();
    let slack = due.iter().find(|d| d.channel == "slack").unwrap();
    assert_eq!(
        slack.group_key, "n1",
        "the group travels with the notification"
    );

    let active = s.alerts(AlertFilter::Active, 10).await.unwrap();
    assert_eq!(active.len(), 1);
    assert_eq!(
        s.active_alert_counts().await.unwrap(),
        ActiveAlertCounts {
            pending: 0,
            firing: 1
        }
    );
    assert_eq!(active[0].state, "firing");
    assert_eq!(active[0].fired_at_ms, Some(2000));
    assert_eq!(active[0].started_at_ms, 1000);
    assert_eq!(active[0].labels["node"], "n1");
    assert_eq!(active[0].details["used_fraction"], 0.93);

    // Acknowledged: an escalation is recorded but not announced.
    assert!(
        s.acknowledge_alert(active[0].id, "alice", 3500)
            .await
            .unwrap()
    );
    assert!(!s.acknowledge_alert(9999, "alice", 3500).await.unwrap());
    let escalated = s
        .apply_alert(&update(
            UpdateKind::Firing { escalated: true },
            4000,
            &["hook"],
        ))
        .await
        .unwrap();
    assert!(!escalated.notified);
    let resolved = s
        .apply_alert(&update(UpdateKind::Resolved, 5000, &["hook"]))
        .await
        .unwrap();
    assert!(resolved.notified);
    let done = s.alerts(AlertFilter::Resolved, 10).await.unwrap();
    assert_eq!(
        done[0].remedy, "remedy at 4000",
        "a resolution keeps the advice of what fired"
    );
    assert_eq!(done[0].resolved_at_ms, Some(5000));
    assert_eq!(
        done[0].summary, "summary at 4000",
        "the resolution keeps what fired"
    );
    assert_eq!(done[0].acknowledged_by.as_deref(), Some("alice"));
    assert!(s.alerts(AlertFilter::Active, 10).await.unwrap().is_empty());
    // Resolving again is nothing.
    assert!(
        s.apply_alert(&update(UpdateKind::Resolved, 6000, &["hook"]))
            .await
            .unwrap()
            .alert_id
            .is_none()
    );
}

async fn outbox_leases_retries_and_delivers(store: Arc<dyn Store>) {
    let s = &*store;
    s.apply_alert(&update(
        UpdateKind::Firing { escalated: false },
        1000,
        &["a", "b"],
    ))
    .await
    .unwrap();
    let claimed = s.claim_notifications(1000, 60_000, 10).await.unwrap();
    assert_eq!(claimed.len(), 2);
    assert!(claimed.iter().all(|c| c.group_key.is_empty()));
    assert_eq!(claimed[0].attempts, 1);
    assert!(
        s.claim_notifications(2000, 60_000, 10)
            .await
            .unwrap()
            .is_empty(),
        "leased"
    );
    s.notifications_delivered(&[claimed[0].id], 2000)
        .await
        .unwrap();
    s.notification_failed(claimed[1].id, 5000, "HTTP 503")
        .await
        .unwrap();
    assert_eq!(s.undelivered_notifications().await.unwrap(), 1);
    assert!(
        s.claim_notifications(4999, 60_000, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let retry = s.claim_notifications(5000, 60_000, 10).await.unwrap();
    assert_eq!(retry.len(), 1);
    assert_eq!(retry[0].channel, "b");
    assert_eq!(retry[0].attempts, 2);
    // An expired lease (a collector died mid-send) makes it due again.
    assert_eq!(
        s.claim_notifications(70_000, 60_000, 10)
            .await
            .unwrap()
            .len(),
        1
    );
}

async fn notifications_are_claimed_with_their_alert_and_marked_together(store: Arc<dyn Store>) {
    let s = &*store;
    let fired = s
        .apply_alert(&update(
            UpdateKind::Firing { escalated: false },
            1000,
            &["a", "b", "c"],
        ))
        .await
        .unwrap();
    let mut claimed = s.claim_notifications(1000, 60_000, 10).await.unwrap();
    claimed.sort_by_key(|c| c.id);
    assert_eq!(claimed.len(), 3);
    assert!(
        claimed
            .iter()
            .all(|c| Some(c.alert_id) == fired.alert_id && c.created_at_ms == 1000),
        "each names its alert and its sample's time: {claimed:?}"
    );
    s.notifications_delivered(&[claimed[0].id, claimed[2].id], 2000)
        .await
        .unwrap();
    s.notifications_delivered(&[], 2000).await.unwrap();
    assert_eq!(s.undelivered_notifications().await.unwrap(), 1);
    // Only the one left undelivered comes back once the lease ends.
    let again = s.claim_notifications(70_000, 60_000, 10).await.unwrap();
    assert_eq!(
        again.iter().map(|c| c.channel.as_str()).collect::<Vec<_>>(),
        ["b"]
    );
}

async fn silences_match_until_they_expire(store: Arc<dyn Store>) {
    let s = &*store;
    let silence = NewSilence {
        matchers: [("node".to_owned(), "n1".to_owned())].into(),
        comment: "maintenance".into(),
        created_by: "bob".into(),
        ends_at_ms: 10_000,
    };
    let id = s.create_silence(&silence, 1000).await.unwrap();
    let active = s.silences(5000).await.unwrap();
    assert_eq!(active.len(), 1);
    let labels = serde_json::json!({"node": "n1", "gpu": "3"});
    assert!(active[0].matches(labels.as_object().unwrap()));
    let other = serde_json::json!({"node": "n2"});
    assert!(!active[0].matches(other.as_object().unwrap()));
    assert!(
        s.silences(10_000).await.unwrap().is_empty(),
        "expired at ends_at_ms"
    );
    assert!(s.expire_silence(id, 6000).await.unwrap());
    assert!(s.silences(6000).await.unwrap().is_empty());
    assert!(!s.expire_silence(id, 7000).await.unwrap());
}

/// Long enough ago for every sample the cases below write.
const PROCESS_START_MS: i64 = 1_000_000_000_000;

/// Validates `batch` as a collector whose clock reads `now` would: history
/// generated for a simulated past.
fn rows_at(session: &NodeSession, batch: &pb::Batch, now: i64) -> StoreBatch {
    validate::batch(batch.clone(), session, now, &Limits::default()).unwrap()
}

/// A batch of GPU0 alone, used = `used` GiB (min one below, max one above),
/// and its one process, started at a fixed time (the same process throughout).
fn gpu0_batch(seq: u64, ts: i64, used_gib: u64) -> pb::Batch {
    let mut b = fixtures::batch(seq, ts);
    b.gpu_samples = vec![fixtures::gpu_sample(GPU0, ts, used_gib * GIB)];
    b.process_samples[0] = fixtures::process_sample(GPU0, ts, 777, used_gib * GIB);
    b.process_samples[0].start_time_ms = PROCESS_START_MS;
    b
}

/// Two hours of samples every 30 s, 10 GiB used, and one 20 s spike to
/// 70 GiB: through the 1 min and the 1 h rollups the spike stays, the
/// average stays, and the last value is the last sample's.
async fn rollups_keep_min_max_avg_and_last(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let base = rollup::bucket_start(now - 3 * HOUR_MS, HOUR_MS);
    let spike_at = base + 37 * MINUTE_MS + 30_000;
    let batches: Vec<StoreBatch> = (0..240u64)
        .map(|i| {
            let ts = base + i as i64 * 30_000;
            let used = if ts == spike_at { 70 } else { 10 };
            rows_at(&session, &gpu0_batch(i + 1, ts, used), now)
        })
        .collect();
    for group in batches.chunks(40) {
        let outcomes = store.write_batches(group).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == WriteOutcome::Committed));
    }
    let report = settle(&*store, now).await.unwrap();
    assert!(report.leader, "a lone collector leads");
    assert!(report.hours_rolled_up >= 2);
    let marks = store.watermarks().await.unwrap();
    assert!(marks.hour_ms >= base + 2 * HOUR_MS, "{marks:?}");

    // Width 1 h: both points come from the hour table.
    let hours = store
        .device_series(GPU0, base, base + 2 * HOUR_MS - 1, 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hours.len(), 2);
    assert_eq!(
        hours.iter().map(|p| p.samples).collect::<Vec<_>>(),
        vec![120, 120]
    );
    assert_eq!(
        hours[0].memory_used_max_bytes,
        (71 * GIB) as i64,
        "the spike"
    );
    assert_eq!(hours[1].memory_used_max_bytes, (11 * GIB) as i64);
    assert_eq!(hours[0].memory_used_min_bytes, (9 * GIB) as i64);
    // 119 samples of 10 GiB and one of 70: the mean is 10.5 GiB.
    assert_eq!(hours[0].memory_used_bytes, (10 * GIB + GIB / 2) as i64);
    assert_eq!(hours[1].memory_used_bytes, (10 * GIB) as i64);
    assert_eq!(hours[0].utilization_pct, Some(70.0));
    assert_eq!(hours[1].pcie_rx_bytes_per_s, Some(2_000_000));

    // Width 1 min: the minute holding the spike keeps it, its neighbours do not.
    let minutes = store
        .device_series(GPU0, base, base + HOUR_MS - 1, 60)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(minutes.len(), 60);
    assert!(minutes.iter().all(|p| p.samples == 2));
    assert_eq!(minutes[37].memory_used_max_bytes, (71 * GIB) as i64);
    assert_eq!(minutes[37].memory_used_bytes, (40 * GIB) as i64);
    assert_eq!(minutes[36].memory_used_max_bytes, (11 * GIB) as i64);

    // The process rollups keep the peak too.
    let procs = store
        .process_series(GPU0, base, base + 2 * HOUR_MS - 1, 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(procs.len(), 1);
    let peaks: Vec<i64> = procs[0].points.iter().map(|(_, v)| *v).collect();
    assert_eq!(
        peaks,
        vec![(70 * GIB + GIB / 4) as i64, (10 * GIB + GIB / 4) as i64]
    );

    // A second pass finds nothing left to do.
    let again = settle(&*store, now).await.unwrap();
    assert_eq!((again.minutes_rolled_up, again.hours_rolled_up), (0, 0));
}

/// A sample that arrives after its minute was rolled up (an agent's spool
/// replayed) is rolled up again on the next pass.
async fn late_samples_are_rolled_up_again(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let minute = rollup::bucket_start(now - 30 * MINUTE_MS, MINUTE_MS);
    let first = rows_at(&session, &gpu0_batch(1, minute + 10_000, 10), now);
    store.write_batch(&first).await.unwrap();
    settle(&*store, now).await.unwrap();
    let read = || store.device_series(GPU0, minute, minute + MINUTE_MS - 1, 1);
    let before = read().await.unwrap().unwrap();
    assert_eq!(before[0].memory_used_max_bytes, (11 * GIB) as i64);

    let late = rows_at(&session, &gpu0_batch(2, minute + 20_000, 50), now + 1000);
    store.write_batch(&late).await.unwrap();
    settle(&*store, now + 1000).await.unwrap();
    let after = read().await.unwrap().unwrap();
    assert_eq!(after[0].samples, 2);
    assert_eq!(after[0].memory_used_max_bytes, (51 * GIB) as i64);
    assert_eq!(after[0].memory_used_bytes, (30 * GIB) as i64);
}

/// An hour is rolled up once it has ended, not redone each pass while it
/// runs: charts read the running hour from its minutes, and redoing it for
/// the whole fleet every pass read every series' minutes of it so far.
/// (The passes are given a clock two hours ahead, so that the hour runs
/// for as long as the test needs.)
async fn an_hour_is_rolled_up_once_it_has_ended(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let hour = rollup::bucket_start(now_ms(), HOUR_MS) + 2 * HOUR_MS;
    let during = hour + 30 * MINUTE_MS;
    settle(&*store, during).await.unwrap();
    let sample = rows_at(&session, &gpu0_batch(1, hour + 10 * MINUTE_MS, 10), during);
    store.write_batch(&sample).await.unwrap();
    let running = settle(&*store, during + MINUTE_MS).await.unwrap();
    assert_eq!(running.hours_rolled_up, 0, "the hour runs: {running:?}");
    let chart = || store.device_series(GPU0, hour, hour + HOUR_MS - 1, 1);
    let from_minutes = chart().await.unwrap().unwrap();
    assert_eq!(
        from_minutes.len(),
        1,
        "read from its minutes: {from_minutes:?}"
    );
    assert_eq!(from_minutes[0].memory_used_max_bytes, (11 * GIB) as i64);

    let ended = settle(&*store, hour + HOUR_MS + 5 * MINUTE_MS)
        .await
        .unwrap();
    assert_eq!(ended.hours_rolled_up, 1, "the hour ended: {ended:?}");
    assert!(store.watermarks().await.unwrap().hour_ms > hour);
    assert_eq!(
        chart().await.unwrap().unwrap(),
        from_minutes,
        "read from the hour"
    );
}

/// A batch of GPU samples only, `(uuid, used GiB)` each: GPUs of 80 GiB, MIG
/// instances of 40 GiB, every one with max = used + 1 GiB and 0.5 GiB
/// reserved.
fn fleet_batch(seq: u64, ts: i64, used_gib: &[(&str, u64)]) -> pb::Batch {
    let mut b = fixtures::batch(seq, ts);
    b.process_samples.clear();
    b.gpu_samples = used_gib
        .iter()
        .map(|(uuid, used)| {
            let mut sample = fixtures::gpu_sample(uuid, ts, used * GIB);
            if uuid.starts_with("MIG-") {
                sample.memory_total_bytes = 40 * GIB;
            }
            sample
        })
        .collect();
    b
}

/// The fleet's history sums the physical GPUs' rollups per minute and per
/// hour, counts a GPU low on headroom through its MIG instance, follows a
/// late sample into both rollups, and counts the alerts fired per bucket.
async fn fleet_history_sums_the_rollups_and_counts_alerts(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let base = rollup::bucket_start(now - 3 * HOUR_MS, HOUR_MS);
    let g = |gib: u64| (gib * GIB) as i64;
    // Minute 0: GPU1 peaks at 73.5 of 80 GiB, MIG_A (on GPU2) at 39.5 of 40:
    // two GPUs below 10 % headroom. Minute 2: GPU2 sends nothing.
    let batches = [
        fleet_batch(
            1,
            base + 10_000,
            &[(GPU0, 40), (GPU1, 72), (GPU2, 20), (MIG_A, 38), (MIG_B, 1)],
        ),
        fleet_batch(
            2,
            base + 70_000,
            &[(GPU0, 40), (GPU1, 12), (GPU2, 20), (MIG_A, 10)],
        ),
        fleet_batch(3, base + 130_000, &[(GPU0, 40), (GPU1, 12)]),
    ];
    for b in &batches {
        store.write_batch(&rows_at(&session, b, now)).await.unwrap();
    }
    // Two alerts fire (minutes 0 and 2); one stays pending and counts not.
    for (fingerprint, kind, at) in [
        (
            "fp-a",
            UpdateKind::Firing { escalated: false },
            base + 30_000,
        ),
        (
            "fp-b",
            UpdateKind::Firing { escalated: false },
            base + 150_000,
        ),
        ("fp-c", UpdateKind::Pending, base + 90_000),
        (
            "fp-d",
            UpdateKind::Firing { escalated: false },
            now - 30_000,
        ),
    ] {
        let mut u = update(kind, at, &[]);
        u.fingerprint = fingerprint.into();
        store.apply_alert(&u).await.unwrap();
    }
    settle(&*store, now).await.unwrap();

    let minutes = || store.fleet_history(base, base + 3 * MINUTE_MS - 1, 3);
    let before = minutes().await.unwrap();
    let figures = |p: &FleetHistoryPoint| {
        (
            p.used_bytes,
            p.used_max_bytes,
            p.capacity_bytes,
            p.devices,
            p.devices_below_10pct,
            p.alerts_fired,
        )
    };
    assert_eq!(
        before.iter().map(|p| p.timestamp_ms).collect::<Vec<_>>(),
        vec![base + 59_999, base + 119_999, base + 179_999],
        "each point carries its bucket's end"
    );
    assert_eq!(
        before.iter().map(figures).collect::<Vec<_>>(),
        vec![
            (g(132), g(135), g(240), 3, 2, 1),
            (g(72), g(75), g(240), 3, 0, 0),
            (g(52), g(54), g(160), 2, 0, 1),
        ],
        "MIG instances add nothing to the sums"
    );

    // GPU0 spikes to 76 GiB in minute 0, after that minute was rolled up.
    let late = fleet_batch(4, base + 20_000, &[(GPU0, 76)]);
    store
        .write_batch(&rows_at(&session, &late, now + 1000))
        .await
        .unwrap();
    settle(&*store, now + 1000).await.unwrap();
    let after = minutes().await.unwrap();
    assert_eq!(
        figures(&after[0]),
        (g(58 + 72 + 20), g(77 + 73 + 21), g(240), 3, 3, 1),
        "GPU0's mean is (40 + 76) / 2 and its peak is low on headroom"
    );
    assert_eq!(figures(&after[1]), figures(&before[1]));

    // One bucket of three minute rows: their mean, their highest.
    let folded = store
        .fleet_history(base, base + 3 * MINUTE_MS - 1, 1)
        .await
        .unwrap();
    assert_eq!(folded.len(), 1);
    let mean = ((150 + 72 + 52) as f64 * GIB as f64 / 3.0).round() as i64;
    assert_eq!(figures(&folded[0]), (mean, g(171), g(240), 3, 3, 2));

    // An hour-wide bucket reads the hour rollup, redone for the late sample:
    // GPU0 (40, 76, 40, 40) / 4, GPU1 (72, 12, 12) / 3, GPU2 20.
    let hour = store
        .fleet_history(base, base + HOUR_MS - 1, 1)
        .await
        .unwrap();
    assert_eq!(hour.len(), 1);
    assert_eq!(hour[0].timestamp_ms, base + HOUR_MS - 1);
    assert_eq!(
        figures(&hour[0]),
        (g(49 + 32 + 20), g(77 + 73 + 21), g(240), 3, 3, 2)
    );

    // Newer than the rollup watermark: the alert, and no memory figures.
    let recent = store.fleet_history(now - MINUTE_MS, now, 1).await.unwrap();
    assert_eq!(recent.len(), 1);
    assert_eq!(figures(&recent[0]), (0, 0, 0, 0, 0, 1));
}

/// Raw samples of a day long past are packed into chunks on Postgres
/// (SQLite keeps them as rows): a chart fine enough for raw samples reads
/// exactly the same after maintenance, and a sample that arrives for a
/// packed day is charted and rolled up like any late sample.
async fn cold_days_chart_the_same_once_packed(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let start = rollup::bucket_start(now - 3 * DAY_MS, DAY_MS) + HOUR_MS;
    let sample = |seq: u64, ts: i64, used_gib: u64| {
        let mut b = gpu0_batch(seq, ts, used_gib);
        let g = &mut b.gpu_samples[0];
        // Optional figures missing now and then (a bucket of five samples
        // misses one PCIe tx rate), and for whole buckets at times (rx).
        g.pcie_tx_bytes_per_s = (!seq.is_multiple_of(5)).then_some(seq * 4096);
        g.pcie_rx_bytes_per_s = (seq % 50 >= 10).then_some(seq * 1024);
        g.utilization_pct = (!seq.is_multiple_of(7)).then_some((seq % 101) as u32);
        rows_at(&session, &b, now)
    };
    let batches: Vec<StoreBatch> = (0..720u64)
        .map(|i| sample(i + 1, start + i as i64 * 10_000, 10 + i % 7))
        .collect();
    for group in batches.chunks(120) {
        store.write_batches(group).await.unwrap();
    }
    let raw = || store.device_series(GPU0, start, start + 2 * HOUR_MS - 1, 2000);
    let processes = || store.process_series(GPU0, start, start + 2 * HOUR_MS - 1, 2000);
    // Still raw, but five samples a point: some with a PCIe rate, some not.
    let folded = || store.device_series(GPU0, start, start + 2 * HOUR_MS - 1, 144);
    let before = raw().await.unwrap().unwrap();
    let processes_before = processes().await.unwrap().unwrap();
    let folded_before = folded().await.unwrap().unwrap();
    assert_eq!(before.len(), 720, "one point per sample");
    assert_eq!(processes_before[0].points.len(), 720);
    assert_eq!(folded_before.len(), 144);
    assert!(folded_before.iter().all(|p| p.samples == 5));
    let report = settle(&*store, now).await.unwrap();
    assert!(
        [0, 2 * 720].contains(&report.samples_packed),
        "all GPU and process samples or (SQLite) none: {report:?}"
    );
    assert_eq!(raw().await.unwrap().unwrap(), before);
    assert_eq!(processes().await.unwrap().unwrap(), processes_before);
    assert_eq!(folded().await.unwrap().unwrap(), folded_before);

    let minute = start + 30 * MINUTE_MS;
    let late = sample(721, minute + 5_000, 70);
    store.write_batch(&late).await.unwrap();
    // Until the next pass, the late sample is a raw row beside the chunk
    // that holds the rest of its bucket.
    let folded_late = folded().await.unwrap().unwrap();
    assert_eq!(folded_late.iter().map(|p| p.samples).sum::<i64>(), 721);
    settle(&*store, now + 1000).await.unwrap();
    let rolled = store
        .device_series(GPU0, minute, minute + MINUTE_MS - 1, 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rolled[0].samples, 7, "six packed samples and the late one");
    assert_eq!(rolled[0].memory_used_max_bytes, (71 * GIB) as i64);
    assert_eq!(rolled[0].memory_used_min_bytes, (9 * GIB) as i64);
    let after = raw().await.unwrap().unwrap();
    assert_eq!(after.len(), 721);
    assert!(
        after
            .iter()
            .any(|p| p.timestamp_ms == minute + 5_000 && p.memory_used_bytes == (70 * GIB) as i64)
    );
    let processes_after = processes().await.unwrap().unwrap();
    assert_eq!(processes_after[0].points.len(), 721);
    assert_eq!(
        processes_after[0].points.iter().map(|p| p.1).max(),
        Some((70 * GIB + GIB / 4) as i64),
        "the late process sample is charted"
    );
    let process_minute = store
        .process_series(GPU0, minute, minute + MINUTE_MS - 1, 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        process_minute[0].points,
        vec![(minute + MINUTE_MS - 1, (70 * GIB + GIB / 4) as i64)],
        "its minute rollup holds its peak"
    );
    // The next pass packs the late samples and their hour again.
    settle(&*store, now + 2000).await.unwrap();
    assert_eq!(raw().await.unwrap().unwrap(), after);
    assert_eq!(folded().await.unwrap().unwrap(), folded_late);
    assert_eq!(processes().await.unwrap().unwrap(), processes_after);
}

/// Samples older than raw retention go (by whole partitions on Postgres);
/// a chart of that time still shows the spike, from the rollups.
async fn retention_drops_raw_samples_and_rollups_keep_the_peak(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let old = rollup::bucket_start(now - 8 * DAY_MS, MINUTE_MS);
    let mut batches = Vec::new();
    for i in 0..10u64 {
        let ts = old + i as i64 * 6_000;
        let used = if i == 4 { 60 } else { 20 };
        batches.push(rows_at(&session, &gpu0_batch(i + 1, ts, used), ts + 1000));
    }
    store.write_batches(&batches).await.unwrap();
    let report = settle(&*store, now).await.unwrap();
    assert!(
        report.rows_expired + report.partitions_dropped > 0,
        "raw samples past 7 days expired: {report:?}"
    );
    // A chart fine enough for raw samples falls back to the minute rollup
    // for a range raw retention no longer covers.
    let chart = store
        .device_series(GPU0, old - HOUR_MS, old + HOUR_MS, 2000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(chart.len(), 1, "one minute of data: {chart:?}");
    assert_eq!(chart[0].samples, 10);
    assert_eq!(chart[0].memory_used_max_bytes, (61 * GIB) as i64);
    assert_eq!(chart[0].memory_used_min_bytes, (19 * GIB) as i64);
}

/// A process whose memory holds still is stored every second but listed
/// with a last-seen time at most 10 s old; a change shows at once.
async fn steady_processes_are_stored_every_second_and_changes_show_at_once(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let start = now - 60_000;
    for i in 0..30u64 {
        let ts = start + i as i64 * 1000;
        store
            .write_batch(&rows_at(&session, &gpu0_batch(i + 1, ts, 10), now))
            .await
            .unwrap();
    }
    let newest = start + 29_000;
    let listed = store
        .processes(newest - 30_000, ProcessesOn::Fleet)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].last_seen_ms >= newest - 10_000, "{listed:?}");
    assert_eq!(listed[0].memory_used_bytes, (10 * GIB) as i64);
    // Seen in the last second, though its row may say seconds ago: found
    // by its owner too, and not by another's.
    let owned_by = |user| {
        ProcessesOn::Owners(OwnerMatch {
            user,
            ..OwnerMatch::default()
        })
    };
    for (on, found) in [
        (ProcessesOn::Fleet, 1),
        (owned_by("alice"), 1),
        (owned_by("bob"), 0),
    ] {
        let listed = store.processes(newest - 500, on).await.unwrap();
        assert_eq!(listed.len(), found, "{on:?}: {listed:?}");
    }

    let changed = start + 30_000;
    store
        .write_batch(&rows_at(&session, &gpu0_batch(31, changed, 12), now))
        .await
        .unwrap();
    let listed = store
        .processes(newest - 30_000, ProcessesOn::Fleet)
        .await
        .unwrap();
    assert_eq!(listed[0].memory_used_bytes, (12 * GIB) as i64);
    assert_eq!(listed[0].memory_peak_bytes, (12 * GIB + GIB / 4) as i64);
    assert_eq!(listed[0].last_seen_ms, changed);
    assert_eq!(listed[0].first_seen_ms, start);

    let series = store
        .process_series(GPU0, start, changed, 1000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(series[0].points.len(), 31, "every sample stored");
}

/// One transaction for several agents' batches: each gets its own outcome,
/// a replay inside the group is left out, and nothing is stored twice.
async fn a_group_of_batches_gets_one_outcome_each(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let other = register(&*store, &fixtures::register_other_node()).await;
    let now = now_ms();
    let ts = now - 20_000;
    let group = vec![
        rows_at(&session, &fixtures::batch(1, ts), now),
        rows_at(&other, &fixtures::other_node_batch(1, ts), now),
        rows_at(&session, &fixtures::batch(1, ts), now),
        rows_at(&session, &fixtures::batch(2, ts + 1000), now),
    ];
    let outcomes = store.write_batches(&group).await.unwrap();
    assert_eq!(
        outcomes[..2],
        [WriteOutcome::Committed, WriteOutcome::Committed]
    );
    assert!(
        matches!(outcomes[2], WriteOutcome::Duplicate { .. }),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[3], WriteOutcome::Committed);
    store.flush(true).await.unwrap();
    let again = store.write_batches(&group[..2]).await.unwrap();
    assert_eq!(
        again,
        vec![
            WriteOutcome::Duplicate { committed_seq: 2 },
            WriteOutcome::Duplicate { committed_seq: 1 },
        ]
    );
    let series = store
        .device_series(GPU0, ts - 1, ts + 2000, 1000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        series.iter().map(|p| p.samples).collect::<Vec<_>>(),
        vec![1, 1]
    );
    let devices = store.latest_devices().await.unwrap().to_vec();
    assert_eq!(devices.iter().filter(|d| d.latest.is_some()).count(), 4);
    assert_eq!(store.write_batches(&[]).await.unwrap(), vec![]);
}

async fn tokens_are_enrolled_listed_and_revoked(store: Arc<dyn Store>) {
    let token = |role, node, name, hash| NewToken {
        role,
        node,
        name,
        token_sha256: hash,
        hint: "hra_0123abcd",
    };
    let one = store
        .create_token(
            &token(TokenRole::Agent, Some("node-a"), None, "hash-a"),
            1_000,
        )
        .await
        .unwrap();
    let any = store
        .create_token(&token(TokenRole::Agent, None, None, "hash-any"), 2_000)
        .await
        .unwrap();
    let admin = store
        .create_token(
            &token(TokenRole::Admin, None, Some("alice"), "hash-alice"),
            2_500,
        )
        .await
        .unwrap();
    assert!(one != any && any != admin);
    let duplicate = store
        .create_token(
            &token(TokenRole::Agent, Some("node-b"), None, "hash-a"),
            3_000,
        )
        .await;
    assert!(duplicate.is_err(), "a token hash is unique");

    let active = store.active_tokens().await.unwrap();
    assert_eq!(active.len(), 3);
    assert!(
        active
            .iter()
            .any(|t| t.token_sha256 == "hash-any" && t.node.is_none() && t.role == "agent")
    );
    assert!(active.iter().any(|t| t.token_sha256 == "hash-alice"
        && t.role == "admin"
        && t.name.as_deref() == Some("alice")));

    assert!(store.revoke_token(one, 5_000).await.unwrap());
    assert!(
        !store.revoke_token(one, 6_000).await.unwrap(),
        "already revoked"
    );
    assert!(
        !store.revoke_token(9_999, 6_000).await.unwrap(),
        "no such token"
    );
    let active = store.active_tokens().await.unwrap();
    assert_eq!(active.len(), 2);
    assert!(active.iter().all(|t| t.token_sha256 != "hash-a"));

    let listed = store.tokens().await.unwrap();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0].node.as_deref(), Some("node-a"));
    assert_eq!(listed[0].role, "agent");
    assert_eq!(listed[0].hint, "hra_0123abcd");
    assert_eq!(listed[0].revoked_at_ms, Some(5_000));
    assert_eq!(listed[1].revoked_at_ms, None);
    assert_eq!(listed[2].role, "admin");
    assert_eq!(listed[2].name.as_deref(), Some("alice"));
}

/// A device another node still lists is not taken; once that node drops it,
/// or the operator releases it, it moves.
async fn a_device_moves_only_when_its_node_lets_go(store: Arc<dyn Store>) {
    register(&*store, &fixtures::register(NODE, BOOT)).await;
    let mut claim = fixtures::register_other_node();
    claim.gpus[0].uuid = GPU0.into();
    let reg = validate::registration(&claim, &Limits::default()).unwrap();
    match store.register(&reg, now_ms()).await {
        Err(StoreError::DeviceOwned { uuid, owner }) => {
            assert_eq!((uuid.as_str(), owner.as_str()), (GPU0, NODE));
        }
        other => panic!("expected DeviceOwned, got {other:?}"),
    }
    // Refused as a whole: the claimant did not even become a node.
    assert_eq!(store.nodes().await.unwrap().len(), 1);
    assert_eq!(
        store
            .release_device("GPU-nonexistent", now_ms())
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .release_device(GPU0, now_ms())
            .await
            .unwrap()
            .as_deref(),
        Some(NODE)
    );
    let moved = store.register(&reg, now_ms()).await.unwrap();
    assert!(moved.device_ids.contains_key(GPU0));
    let devices = store.latest_devices().await.unwrap().to_vec();
    let gpu0 = devices.iter().find(|d| &*d.uuid == GPU0).unwrap();
    assert_eq!(&*gpu0.node, fixtures::OTHER_NODE);
}

/// A node's devices on record (present, or absent for less than the
/// horizon) stay within the budget; devices absent for longer stop counting.
async fn a_node_cannot_grow_its_devices_past_the_budget(store: Arc<dyn Store>) {
    let budget = DeviceBudget {
        max_per_node: 8,
        forget_absent_after_ms: HOUR_MS,
    };
    let inventory = |round: usize| {
        let mut req = fixtures::register(NODE, &format!("boot-{round}"));
        req.gpus.truncate(2);
        for (i, gpu) in req.gpus.iter_mut().enumerate() {
            gpu.uuid = format!("GPU-round-{round}-{i}");
        }
        let mut reg = validate::registration(&req, &Limits::default()).unwrap();
        reg.budget = budget;
        reg
    };
    let start = now_ms();
    for round in 0..4 {
        store.register(&inventory(round), start).await.unwrap();
    }
    match store.register(&inventory(4), start).await {
        Err(StoreError::TooManyDevices { count, limit, .. }) => assert_eq!((count, limit), (10, 8)),
        other => panic!("expected TooManyDevices, got {other:?}"),
    }
    // The same inventory again is no growth.
    store.register(&inventory(3), start).await.unwrap();
    // An hour later the devices absent since the start no longer count.
    store
        .register(&inventory(4), start + HOUR_MS + 1)
        .await
        .unwrap();
}

/// An hour written by a flush a minute, as a collector writes it: once the
/// hour is closed, maintenance folds its chunks into one per series, and
/// every chart of it reads the same. A sample that arrives after that
/// (a spool replayed) is folded in by the next pass.
async fn closed_hours_are_compacted_and_chart_the_same(store: Arc<dyn Store>) {
    let session = register(&*store, &fixtures::register(NODE, BOOT)).await;
    let now = now_ms();
    let hour = rollup::bucket_start(now - 3 * HOUR_MS, HOUR_MS);
    let mut seq = 0u64;
    // The process's allocator reports ride along, a report per sample.
    let reporting = |seq: u64, ts: i64, used_gib: u64| {
        let mut b = gpu0_batch(seq, ts, used_gib);
        b.process_samples[0].allocator = Some(pb::AllocatorStats {
            timestamp_ms: ts - 50,
            allocated_bytes: used_gib * GIB - GIB,
            reserved_bytes: used_gib * GIB,
            active_bytes: used_gib * GIB - GIB,
            inactive_split_bytes: seq % 3 * GIB,
            peak_allocated_bytes: used_gib * GIB,
            alloc_retries: seq / 100,
            ooms: 0,
            composition: None,
        });
        b
    };
    for minute in 0..60i64 {
        let batches: Vec<StoreBatch> = (0..6i64)
            .map(|i| {
                seq += 1;
                let ts = hour + minute * MINUTE_MS + i * 10_000;
                rows_at(&session, &reporting(seq, ts, 10 + (seq % 5)), now)
            })
            .collect();
        store.write_batches(&batches).await.unwrap();
        store.flush(true).await.unwrap();
    }
    let full = || store.device_series(GPU0, hour, hour + HOUR_MS - 1, 1000);
    let folded = || store.device_series(GPU0, hour, hour + HOUR_MS - 1, 7);
    let processes = || store.process_series(GPU0, hour, hour + HOUR_MS - 1, 1000);
    let allocator = async |max_points: u32| {
        store
            .allocator_series(&AllocatorSeriesQuery {
                device_uuid: GPU0,
                pid: 777,
                start_time_ms: None,
                // The first report was taken 50 ms before the hour.
                from_ms: hour - MINUTE_MS,
                to_ms: hour + HOUR_MS - 1,
                max_points,
            })
            .await
    };
    let before = (
        full().await.unwrap().unwrap(),
        folded().await.unwrap().unwrap(),
        processes().await.unwrap().unwrap(),
        allocator(1000).await.unwrap().unwrap(),
        allocator(7).await.unwrap().unwrap(),
    );
    assert_eq!(before.0.len(), 360, "one point per sample");
    assert_eq!(before.3.points.len(), 360, "one point per report");
    assert_eq!(before.4.points.iter().map(|p| p.reports).sum::<i64>(), 360);
    let report = settle(&*store, now).await.unwrap();
    // 60 chunks of GPU0, of its process and of its allocator reports become
    // one each, and the other GPU and the MIG instances, absent from these
    // batches, have none.
    assert_eq!(report.chunks_compacted, 3 * 59, "{report:?}");
    let after = (
        full().await.unwrap().unwrap(),
        folded().await.unwrap().unwrap(),
        processes().await.unwrap().unwrap(),
        allocator(1000).await.unwrap().unwrap(),
        allocator(7).await.unwrap().unwrap(),
    );
    assert_eq!(after, before);

    let late_ts = hour + 30 * MINUTE_MS + 5_000;
    store
        .write_batch(&rows_at(&session, &reporting(seq + 1, late_ts, 70), now))
        .await
        .unwrap();
    let report = settle(&*store, now + 1000).await.unwrap();
    assert_eq!(report.chunks_compacted, 3, "the late chunks folded in");
    let late = full().await.unwrap().unwrap();
    assert_eq!(late.len(), 361);
    let point = late.iter().find(|p| p.timestamp_ms == late_ts).unwrap();
    assert_eq!(point.memory_used_bytes, (70 * GIB) as i64);
    let reports = allocator(1000).await.unwrap().unwrap().points;
    assert_eq!(reports.len(), 361);
    let late_report = reports
        .iter()
        .find(|p| p.timestamp_ms == late_ts - 50)
        .unwrap();
    assert_eq!(late_report.reserved_bytes, (70 * GIB) as i64);
    assert_eq!(
        settle(&*store, now + 2000).await.unwrap().chunks_compacted,
        0,
        "nothing left to fold"
    );
}

async fn job_reports_are_kept_per_node_and_replaced_on_the_same_start(store: Arc<dyn Store>) {
    use headroom_store::JobReportRow;
    let row = |node: &str, started: i64, report: &str| JobReportRow {
        kind: "slurm".into(),
        job_id: "4242".into(),
        node: node.into(),
        started_at_ms: started,
        ended_at_ms: started + 60_000,
        report: report.into(),
    };
    store
        .save_job_report(&row("n2", 1_000, "{\"a\":1}"), &[])
        .await
        .unwrap();
    store
        .save_job_report(&row("n1", 1_000, "{\"a\":2}"), &[])
        .await
        .unwrap();
    // The same collector writing again (a later end) replaces its row.
    store
        .save_job_report(&row("n1", 1_000, "{\"a\":3}"), &[])
        .await
        .unwrap();
    // Another collector that took the stream over writes its own.
    store
        .save_job_report(&row("n1", 5_000, "{\"a\":4}"), &[])
        .await
        .unwrap();
    let rows = store.job_reports("4242").await.unwrap();
    let seen: Vec<(&str, i64, &str)> = rows
        .iter()
        .map(|r| (r.node.as_str(), r.started_at_ms, r.report.as_str()))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("n1", 1_000, "{\"a\":3}"),
            ("n2", 1_000, "{\"a\":1}"),
            ("n1", 5_000, "{\"a\":4}")
        ]
    );
    assert!(store.job_reports("42").await.unwrap().is_empty());

    // A report's notification is queued with it, once, however often the
    // save is retried.
    let note = headroom_store::alerts::NewNotification {
        channel: "owner-hook".into(),
        idempotency_key: "job_report:slurm:4243:n1:1000:61000:owner-hook".into(),
        payload: "{\"kind\":\"job_report\"}".into(),
        group_key: String::new(),
        deliver_at_ms: 70_000,
    };
    let report = JobReportRow {
        job_id: "4243".into(),
        ..row("n1", 1_000, "{\"a\":5}")
    };
    for _ in 0..2 {
        store
            .save_job_report(&report, std::slice::from_ref(&note))
            .await
            .unwrap();
    }
    assert!(
        store
            .claim_notifications(69_999, 60_000, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let due = store.claim_notifications(70_000, 60_000, 10).await.unwrap();
    assert_eq!(due.len(), 1, "{due:?}");
    assert_eq!(
        (due[0].channel.as_str(), due[0].payload.as_str()),
        ("owner-hook", note.payload.as_str())
    );
}

async fn sqlite_store() -> (Arc<dyn Store>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("conformance.db").display());
    (headroom_store::connect(&url).await.unwrap(), dir)
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod on_sqlite {
            $(
                #[tokio::test]
                async fn $case() {
                    let (store, _dir) = super::sqlite_store().await;
                    super::$case(store).await;
                }
            )*
        }
        mod on_postgres {
            $(
                #[tokio::test]
                async fn $case() {
                    let Some(db) = super::postgres::fresh_database().await else { return };
                    let store = headroom_store::connect(&db.url).await.unwrap();
                    super::$case(store).await;
                    db.drop_database().await;
                }
            )*
        }
    };
}

conformance!(
    registration_assigns_ids_and_keeps_them,
    mig_reconfiguration_hides_removed_instances,
    batch_shows_up_in_latest_series_and_processes,
    replayed_batch_is_stored_once,
    latest_never_goes_back_in_time,
    series_folds_buckets_keeping_extremes,
    process_keeps_its_peak_and_latest,
    processes_are_found_by_their_owner,
    allocator_reports_are_stored_once_per_report,
    memory_composition_is_stored_split_and_checked,
    gpu_page_reads_process_series_and_events,
    alert_lifecycle_notifies_once_per_change,
    outbox_leases_retries_and_delivers,
    notifications_are_claimed_with_their_alert_and_marked_together,
    silences_match_until_they_expire,
    rollups_keep_min_max_avg_and_last,
    late_samples_are_rolled_up_again,
    an_hour_is_rolled_up_once_it_has_ended,
    fleet_history_sums_the_rollups_and_counts_alerts,
    cold_days_chart_the_same_once_packed,
    closed_hours_are_compacted_and_chart_the_same,
    retention_drops_raw_samples_and_rollups_keep_the_peak,
    a_group_of_batches_gets_one_outcome_each,
    steady_processes_are_stored_every_second_and_changes_show_at_once,
    tokens_are_enrolled_listed_and_revoked,
    job_reports_are_kept_per_node_and_replaced_on_the_same_start,
    a_device_moves_only_when_its_node_lets_go,
    a_node_cannot_grow_its_devices_past_the_budget,
);
