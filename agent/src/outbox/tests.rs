use std::io::Write;
use std::time::Duration;

use headroom_proto::v1 as pb;

use super::*;

fn registration(driver: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: "node-a".into(),
        driver_version: driver.into(),
        ..pb::RegisterRequest::default()
    }
}

/// A batch that says which interval it was by its one sample's timestamp.
fn batch(interval: i64) -> pb::Batch {
    pb::Batch {
        node: "node-a".into(),
        gpu_samples: vec![pb::GpuSample {
            uuid: "GPU-1".into(),
            timestamp_ms: interval,
            memory_used_last_bytes: 7 << 30,
            ..pb::GpuSample::default()
        }],
        ..pb::Batch::default()
    }
}

fn memory(max: usize) -> Outbox {
    Outbox::new(Box::new(MemoryLog::new("run-1".into(), max)))
}

fn spool_config(dir: &std::path::Path) -> SpoolConfig {
    SpoolConfig {
        dir: dir.to_owned(),
        max_bytes: 1 << 20,
        segment_bytes: 4096,
        fsync_interval: Duration::from_secs(1),
    }
}

fn spool(config: &SpoolConfig) -> Outbox {
    Outbox::new(Box::new(Spool::open(config.clone()).unwrap()))
}

/// Drains what a session would send, as (interval, seq) of each batch and
/// the driver version of each registration.
fn drain(outbox: &mut Outbox) -> (Vec<(i64, u64)>, Vec<String>) {
    let mut batches = Vec::new();
    let mut registrations = Vec::new();
    while let Some(record) = outbox.next_unsent().unwrap() {
        match record {
            Record::Batch(b) => batches.push((b.gpu_samples[0].timestamp_ms, b.seq)),
            Record::Register(r) => registrations.push(r.driver_version),
        }
    }
    (batches, registrations)
}

fn intervals(sent: &[(i64, u64)]) -> Vec<i64> {
    sent.iter().map(|(i, _)| *i).collect()
}

#[test]
fn a_session_resends_exactly_what_was_not_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    for mut outbox in [memory(100), spool(&spool_config(dir.path()))] {
        outbox.push_register(registration("550")).unwrap();
        for i in 1..=5 {
            outbox.push_batch(batch(i)).unwrap();
        }
        let stream = outbox.stream_id().to_owned();
        let first = outbox.start_session().unwrap().unwrap();
        assert_eq!(first.boot_id, stream, "registrations carry the stream id");
        let (sent, _) = drain(&mut outbox);
        assert_eq!(intervals(&sent), [1, 2, 3, 4, 5]);
        let seqs: Vec<u64> = sent.iter().map(|(_, s)| *s).collect();
        assert!(seqs.windows(2).all(|w| w[1] > w[0]), "{seqs:?}");
        assert_eq!(outbox.in_flight_batches(), 5);

        outbox.ack(&stream, sent[2].1).unwrap();
        assert_eq!(outbox.in_flight_batches(), 2);
        assert_eq!(outbox.pending_batches(), 2);
        outbox.start_session().unwrap();
        assert_eq!(intervals(&drain(&mut outbox).0), [4, 5]);
        outbox.ack("another-stream", u64::MAX).unwrap();
        assert_eq!(
            outbox.pending_batches(),
            2,
            "an ack for another stream moves nothing"
        );
    }
}

#[test]
fn batches_the_collector_already_holds_are_skipped_without_sending() {
    let mut outbox = memory(100);
    outbox.push_register(registration("550")).unwrap();
    let seqs: Vec<u64> = (1..=6)
        .map(|i| outbox.push_batch(batch(i)).unwrap())
        .collect();
    let stream = outbox.stream_id().to_owned();
    outbox.start_session().unwrap();
    outbox.ack(&stream, seqs[3]).unwrap();
    assert_eq!(intervals(&drain(&mut outbox).0), [5, 6]);
}

#[test]
fn a_new_inventory_is_registered_between_the_batches_it_separates() {
    let mut outbox = memory(100);
    outbox.push_register(registration("550")).unwrap();
    let s1 = outbox.push_batch(batch(1)).unwrap();
    outbox.push_register(registration("560")).unwrap();
    outbox.push_batch(batch(2)).unwrap();
    let stream = outbox.stream_id().to_owned();
    assert_eq!(
        outbox.start_session().unwrap().unwrap().driver_version,
        "550"
    );
    let (sent, registrations) = drain(&mut outbox);
    assert_eq!(intervals(&sent), [1, 2]);
    assert_eq!(registrations, ["560"]);
    // Lost session after batch 1 was acknowledged: the next one starts
    // under the new inventory.
    outbox.ack(&stream, s1).unwrap();
    assert_eq!(
        outbox.start_session().unwrap().unwrap().driver_version,
        "560"
    );
    assert_eq!(intervals(&drain(&mut outbox).0), [2]);
}

#[test]
fn accepted_batches_leave_the_window_but_stay_until_durable() {
    let dir = tempfile::tempdir().unwrap();
    for mut outbox in [memory(100), spool(&spool_config(dir.path()))] {
        outbox.push_register(registration("550")).unwrap();
        let seqs: Vec<u64> = (1..=5)
            .map(|i| outbox.push_batch(batch(i)).unwrap())
            .collect();
        let stream = outbox.stream_id().to_owned();
        outbox.start_session().unwrap();
        drain(&mut outbox);

        outbox.accept(&stream, seqs[3]);
        assert_eq!(outbox.in_flight_batches(), 1);
        assert_eq!(outbox.accepted_batches(), 4);
        assert_eq!(outbox.pending_batches(), 5, "accepted is not durable");

        outbox.ack(&stream, seqs[1]).unwrap();
        assert_eq!(outbox.in_flight_batches(), 1);
        assert_eq!(outbox.accepted_batches(), 2);
        assert_eq!(
            outbox.pending_batches(),
            3,
            "released up to the durable mark"
        );

        // The collector restarted and lost what it held in memory.
        outbox.start_session().unwrap();
        assert_eq!(outbox.accepted_batches(), 0);
        assert_eq!(intervals(&drain(&mut outbox).0), [3, 4, 5]);
        assert_eq!(outbox.in_flight_batches(), 3);
    }
}

#[test]
fn only_durable_batches_leave_the_spool() {
    let dir = tempfile::tempdir().unwrap();
    let mut outbox = spool(&spool_config(dir.path()));
    outbox.push_register(registration("550")).unwrap();
    let seqs: Vec<u64> = (1..=400)
        .map(|i| outbox.push_batch(batch(i)).unwrap())
        .collect();
    let segments = outbox.stats().segments;
    let stream = outbox.stream_id().to_owned();
    outbox.start_session().unwrap();
    drain(&mut outbox);
    outbox.accept(&stream, seqs[399]);
    assert_eq!(outbox.in_flight_batches(), 0);
    assert_eq!(outbox.pending_batches(), 400);
    assert_eq!(
        outbox.stats().segments,
        segments,
        "no segment goes on accept"
    );

    outbox.ack(&stream, seqs[199]).unwrap();
    assert_eq!(outbox.pending_batches(), 200);
    let left = outbox.stats().segments;
    assert!(1 < left && left < segments, "{left} of {segments}");
    outbox.start_session().unwrap();
    assert_eq!(
        intervals(&drain(&mut outbox).0),
        (201..=400).collect::<Vec<_>>()
    );
}

#[test]
fn an_ack_without_an_accepted_mark_releases_as_it_always_did() {
    let mut outbox = memory(100);
    outbox.push_register(registration("550")).unwrap();
    let seqs: Vec<u64> = (1..=5)
        .map(|i| outbox.push_batch(batch(i)).unwrap())
        .collect();
    let stream = outbox.stream_id().to_owned();
    outbox.start_session().unwrap();
    drain(&mut outbox);
    // An old collector: accepted_seq 0, committed_seq the batch it stored.
    outbox.accept(&stream, 0);
    outbox.ack(&stream, seqs[2]).unwrap();
    assert_eq!(outbox.in_flight_batches(), 2);
    assert_eq!(outbox.accepted_batches(), 0);
    assert_eq!(outbox.pending_batches(), 2);
    // A mark below what is already durable moves nothing back.
    outbox.accept(&stream, seqs[0]);
    outbox.ack(&stream, seqs[1]).unwrap();
    assert_eq!(outbox.in_flight_batches(), 2);
    assert_eq!(outbox.pending_batches(), 2);
    outbox.start_session().unwrap();
    assert_eq!(intervals(&drain(&mut outbox).0), [4, 5]);
}

#[test]
fn a_new_inventory_waits_for_the_batches_before_it_to_be_accepted() {
    let mut outbox = memory(100);
    outbox.push_register(registration("550")).unwrap();
    let s1 = outbox.push_batch(batch(1)).unwrap();
    outbox.push_register(registration("560")).unwrap();
    outbox.push_batch(batch(2)).unwrap();
    let stream = outbox.stream_id().to_owned();
    outbox.start_session().unwrap();
    assert!(matches!(
        outbox.next_unsent().unwrap(),
        Some(Record::Batch(_))
    ));
    assert!(
        matches!(outbox.next_unsent().unwrap(), Some(Record::Register(r)) if r.driver_version == "560")
    );
    // The uplink registers it once nothing before it is in flight.
    assert_eq!(outbox.in_flight_batches(), 1);
    outbox.accept(&stream, s1);
    assert_eq!(outbox.in_flight_batches(), 0);
    assert_eq!(intervals(&drain(&mut outbox).0), [2]);

    // Batch 1 was accepted but never made durable: the next session
    // starts under the inventory it was sampled under.
    assert_eq!(
        outbox.start_session().unwrap().unwrap().driver_version,
        "550"
    );
    let (sent, registrations) = drain(&mut outbox);
    assert_eq!(intervals(&sent), [1, 2]);
    assert_eq!(registrations, ["560"]);
}

#[test]
fn a_batch_refused_behind_accepted_ones_is_dropped_and_they_are_kept() {
    let mut outbox = memory(10);
    outbox.push_register(registration("550")).unwrap();
    let seqs: Vec<u64> = (1..=4)
        .map(|i| outbox.push_batch(batch(i)).unwrap())
        .collect();
    let stream = outbox.stream_id().to_owned();
    outbox.start_session().unwrap();
    drain(&mut outbox);
    outbox.accept(&stream, seqs[1]);
    assert_eq!(outbox.reject_oldest().unwrap(), Some(seqs[2]));
    assert_eq!(outbox.dropped_batches(), 1);
    outbox.start_session().unwrap();
    assert_eq!(intervals(&drain(&mut outbox).0), [1, 2, 4]);
    outbox.ack(&stream, seqs[3]).unwrap();
    assert_eq!(
        outbox.pending_batches(),
        0,
        "it went with the batches after it"
    );
}

#[test]
fn memory_cap_drops_the_oldest_batches_and_counts_them() {
    let mut outbox = memory(3);
    outbox.push_register(registration("550")).unwrap();
    for i in 1..=5 {
        outbox.push_batch(batch(i)).unwrap();
    }
    assert_eq!(outbox.dropped_batches(), 2);
    assert_eq!(outbox.pending_batches(), 3);
    assert_eq!(
        outbox.start_session().unwrap().unwrap().driver_version,
        "550"
    );
    assert_eq!(intervals(&drain(&mut outbox).0), [3, 4, 5]);
}

#[test]
fn a_rejected_batch_is_dropped_and_counted() {
    let mut outbox = memory(10);
    outbox.push_register(registration("550")).unwrap();
    let bad = outbox.push_batch(batch(1)).unwrap();
    outbox.push_batch(batch(2)).unwrap();
    outbox.start_session().unwrap();
    drain(&mut outbox);
    assert_eq!(outbox.reject_oldest().unwrap(), Some(bad));
    assert_eq!(outbox.dropped_batches(), 1);
    outbox.start_session().unwrap();
    assert_eq!(intervals(&drain(&mut outbox).0), [2]);
}

#[test]
fn the_spool_survives_a_restart_and_continues_its_stream() {
    let dir = tempfile::tempdir().unwrap();
    let config = spool_config(dir.path());
    let (stream, last_seq) = {
        let mut outbox = spool(&config);
        outbox.push_register(registration("550")).unwrap();
        let seqs: Vec<u64> = (1..=40)
            .map(|i| outbox.push_batch(batch(i)).unwrap())
            .collect();
        let stream = outbox.stream_id().to_owned();
        outbox.start_session().unwrap();
        drain(&mut outbox);
        outbox.ack(&stream, seqs[9]).unwrap();
        (stream, seqs[39])
    };
    let mut outbox = spool(&config);
    assert_eq!(outbox.stream_id(), stream);
    assert!(
        outbox.pending_batches() >= 30,
        "{}",
        outbox.pending_batches()
    );
    outbox.push_register(registration("560")).unwrap();
    let next = outbox.push_batch(batch(41)).unwrap();
    assert!(
        next > last_seq,
        "a restarted agent never reuses a number ({next} <= {last_seq})"
    );

    // The collector says what it holds; the rest replays in order, then the
    // new run's registration and batches.
    assert_eq!(
        outbox.start_session().unwrap().unwrap().driver_version,
        "550"
    );
    outbox.ack(&stream, last_seq - 30).unwrap();
    let (sent, registrations) = drain(&mut outbox);
    assert_eq!(intervals(&sent), (11..=41).collect::<Vec<_>>());
    assert_eq!(registrations.last().map(String::as_str), Some("560"));
}

#[test]
fn acknowledged_segments_are_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let mut outbox = spool(&spool_config(dir.path()));
    outbox.push_register(registration("550")).unwrap();
    let seqs: Vec<u64> = (1..=400)
        .map(|i| outbox.push_batch(batch(i)).unwrap())
        .collect();
    let before = outbox.stats();
    assert!(before.segments >= 3, "{before:?}");
    let stream = outbox.stream_id().to_owned();
    outbox.start_session().unwrap();
    drain(&mut outbox);
    outbox.ack(&stream, seqs[399]).unwrap();
    let after = outbox.stats();
    assert_eq!(
        after.segments, 1,
        "only the segment being appended to stays"
    );
    assert_eq!(outbox.pending_batches(), 0);
    let files = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "seg")
        })
        .count();
    assert_eq!(files, 1);
}

#[test]
fn at_the_size_cap_the_oldest_segment_goes_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let config = SpoolConfig {
        max_bytes: 16 * 1024,
        ..spool_config(dir.path())
    };
    let mut outbox = spool(&config);
    outbox.push_register(registration("550")).unwrap();
    for i in 1..=500 {
        outbox.push_batch(batch(i)).unwrap();
    }
    let stats = outbox.stats();
    assert!(stats.bytes <= config.max_bytes, "{stats:?}");
    let dropped = outbox.dropped_batches();
    assert!(dropped > 0);
    assert_eq!(
        dropped + outbox.pending_batches(),
        500,
        "every batch is either kept or counted"
    );
    outbox.start_session().unwrap();
    let (sent, _) = drain(&mut outbox);
    assert_eq!(*intervals(&sent).last().unwrap(), 500);
    assert_eq!(
        intervals(&sent)[0],
        dropped as i64 + 1,
        "the oldest went first"
    );
}

fn segment_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    files.sort();
    files
}

#[test]
fn a_corrupt_segment_is_cut_at_its_last_good_record_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let config = spool_config(dir.path());
    {
        let mut outbox = spool(&config);
        outbox.push_register(registration("550")).unwrap();
        for i in 1..=150 {
            outbox.push_batch(batch(i)).unwrap();
        }
    }
    let files = segment_files(dir.path());
    assert!(files.len() >= 3);
    let mut bytes = std::fs::read(&files[1]).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&files[1], bytes).unwrap();

    let mut outbox = spool(&config);
    assert_eq!(outbox.stats().corrupt_segments, 1);
    outbox.start_session().unwrap();
    let sent = intervals(&drain(&mut outbox).0);
    assert!((100..150).contains(&sent.len()), "{}", sent.len());
    assert!(sent.windows(2).all(|w| w[1] > w[0]), "order kept: {sent:?}");
    assert_eq!(*sent.last().unwrap(), 150, "later segments are unharmed");
}

#[test]
fn damage_in_the_newest_segment_starts_a_new_stream() {
    let dir = tempfile::tempdir().unwrap();
    let config = spool_config(dir.path());
    let (stream, last) = {
        let mut outbox = spool(&config);
        outbox.push_register(registration("550")).unwrap();
        let last = (1..=20)
            .map(|i| outbox.push_batch(batch(i)).unwrap())
            .last();
        (outbox.stream_id().to_owned(), last.unwrap())
    };
    let newest = segment_files(dir.path()).pop().unwrap();
    let mut bytes = std::fs::read(&newest).unwrap();
    let at = bytes.len() - 30;
    bytes[at] ^= 0x5a;
    std::fs::write(&newest, bytes).unwrap();

    let mut outbox = spool(&config);
    assert_ne!(
        outbox.stream_id(),
        stream,
        "its reservation cannot be trusted"
    );
    outbox.push_register(registration("550")).unwrap();
    assert_eq!(
        outbox.push_batch(batch(21)).unwrap(),
        1,
        "a new stream counts from 1"
    );
    // What survived of the old stream still goes out, under its own id.
    outbox.start_session().unwrap();
    let mut streams = Vec::new();
    while let Some(record) = outbox.next_unsent().unwrap() {
        if let Record::Batch(b) = record {
            streams.push((b.boot_id, b.seq));
        }
    }
    assert!(streams.iter().any(|(s, seq)| *s == stream && *seq < last));
    assert_eq!(streams.last().unwrap().1, 1);
}

#[test]
fn a_torn_last_write_is_cut_quietly_and_appending_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let config = spool_config(dir.path());
    {
        let mut outbox = spool(&config);
        outbox.push_register(registration("550")).unwrap();
        for i in 1..=3 {
            outbox.push_batch(batch(i)).unwrap();
        }
    }
    let last = segment_files(dir.path()).pop().unwrap();
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&last)
        .unwrap();
    file.write_all(&[40, 0, 0, 0, 1, 2]).unwrap();
    drop(file);

    let mut outbox = spool(&config);
    assert_eq!(outbox.stats().corrupt_segments, 0);
    outbox.push_register(registration("550")).unwrap();
    outbox.push_batch(batch(4)).unwrap();
    outbox.start_session().unwrap();
    assert_eq!(intervals(&drain(&mut outbox).0), [1, 2, 3, 4]);
}

#[test]
fn a_file_that_is_not_a_segment_is_dropped_and_a_new_stream_starts() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("00000000000000000001.seg"),
        b"garbage, not a spool",
    )
    .unwrap();
    let mut outbox = spool(&spool_config(dir.path()));
    assert_eq!(outbox.stats().corrupt_segments, 1);
    assert_eq!(outbox.pending_batches(), 0);
    outbox.push_register(registration("550")).unwrap();
    assert_eq!(outbox.push_batch(batch(1)).unwrap(), 1);
}

#[test]
fn two_agents_cannot_share_a_spool() {
    let dir = tempfile::tempdir().unwrap();
    let config = spool_config(dir.path());
    let _first = Spool::open(config.clone()).unwrap();
    let err = Spool::open(config).unwrap_err();
    assert!(matches!(err, OutboxError::Locked(_)), "{err}");
}

mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Whatever a segment file holds, the spool opens, replays what it
        /// can read in order, and goes on appending.
        #[test]
        fn the_spool_opens_over_any_segment_bytes(
            good in 0usize..20,
            cut in any::<prop::sample::Index>(),
            garbage in proptest::collection::vec(any::<u8>(), 0..256),
            flip in proptest::option::of((any::<prop::sample::Index>(), 1u8..=255)),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let config = spool_config(dir.path());
            {
                let mut outbox = spool(&config);
                outbox.push_register(registration("550")).unwrap();
                for i in 0..good {
                    outbox.push_batch(batch(i as i64)).unwrap();
                }
            }
            for path in segment_files(dir.path()) {
                let mut bytes = std::fs::read(&path).unwrap();
                bytes.truncate(cut.index(bytes.len() + 1));
                if let Some((at, mask)) = flip && !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    bytes[i] ^= mask;
                }
                bytes.extend_from_slice(&garbage);
                std::fs::write(&path, bytes).unwrap();
            }
            let mut outbox = spool(&config);
            outbox.push_register(registration("560")).unwrap();
            outbox.push_batch(batch(1000)).unwrap();
            outbox.start_session().unwrap();
            let sent = intervals(&drain(&mut outbox).0);
            prop_assert_eq!(sent.last().copied(), Some(1000));
            prop_assert!(sent.windows(2).all(|w| w[0] < w[1]), "{:?}", sent);
            prop_assert!(sent.len() <= good + 1);
        }
    }
}
