//! Property tests of what the collector reads from outside: ingest
//! validation, backtest traces and configuration files. Whatever comes in,
//! the answer is a value or an error, never a panic, and what validation
//! accepts is what the store may trust.
//!
//! CI runs proptest's default 256 cases per property; for a longer hunt:
//! `PROPTEST_CASES=100000 cargo test -p headroom-collector --test properties`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests fail loudly by design

use std::collections::HashMap;
use std::io::Cursor;

use headroom_collector::config::{CollectorConfig, Overrides};
use headroom_collector::ingest::validate::{self, Limits};
use headroom_proto::v1 as pb;
use headroom_rules::backtest;
use headroom_rules::config::RulesConfig;
use headroom_store::model::{DeviceMeta, NodeSession};
use proptest::prelude::*;

const NOW: i64 = 1_800_000_000_000;
const GPU: &str = "GPU-00000000-0000-0000-0000-000000000000";

fn session() -> NodeSession {
    NodeSession {
        node_id: 1,
        node: "node-a".into(),
        boot_id: "boot-a".into(),
        committed_seq: 0,
        durable_seq: 0,
        device_ids: HashMap::from([(GPU.to_owned(), 7)]),
        devices: HashMap::from([(
            7,
            DeviceMeta {
                uuid: GPU.into(),
                gpu_index: 0,
                mig_profile: None,
                parent_id: None,
                memory_total: 80 << 30,
            },
        )]),
    }
}

/// Byte counts near the edges that matter: 0, small, around a GPU's size,
/// around i64::MAX.
fn byte_count() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        0u64..(200u64 << 30),
        (i64::MAX as u64 - 2)..=(i64::MAX as u64 + 2),
        any::<u64>(),
    ]
}

fn timestamp() -> impl Strategy<Value = i64> {
    prop_oneof![(NOW - 8 * 86_400_000)..(NOW + 600_000), any::<i64>(),]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9 ._-]{0,40}",
        any::<String>(),
        Just("x".repeat(5000)),
    ]
}

prop_compose! {
    fn gpu_sample()(
        uuid in prop_oneof![Just(GPU.to_owned()), text()],
        timestamp_ms in timestamp(),
        last in byte_count(), min in byte_count(), max in byte_count(),
        reserved in byte_count(), total in byte_count(),
        utilization in proptest::option::of(0u32..200),
        tx in proptest::option::of(byte_count()),
    ) -> pb::GpuSample {
        pb::GpuSample {
            uuid, timestamp_ms, interval_ms: 1000, poll_count: 10,
            memory_used_last_bytes: last, memory_used_min_bytes: min,
            memory_used_max_bytes: max, memory_reserved_bytes: reserved,
            memory_total_bytes: total, utilization_pct: utilization,
            pcie_tx_bytes_per_s: tx, pcie_rx_bytes_per_s: None,
        }
    }
}

prop_compose! {
    fn process_sample()(
        uuid in prop_oneof![Just(GPU.to_owned()), text()],
        timestamp_ms in timestamp(),
        pid in prop_oneof![Just(0u32), any::<u32>()],
        last in byte_count(), max in byte_count(),
        name in text(), user in text(), container_id in text(),
    ) -> pb::ProcessSample {
        pb::ProcessSample {
            uuid, timestamp_ms, pid, start_time_ms: NOW - 1000,
            memory_used_last_bytes: last, memory_used_max_bytes: max,
            name, user, container_id, ..pb::ProcessSample::default()
        }
    }
}

prop_compose! {
    fn batch()(
        seq in prop_oneof![Just(0u64), 1u64..1000],
        gpu_samples in proptest::collection::vec(gpu_sample(), 0..4),
        process_samples in proptest::collection::vec(process_sample(), 0..4),
    ) -> pb::Batch {
        pb::Batch {
            node: "node-a".into(), boot_id: "boot-a".into(), seq,
            gpu_samples, process_samples, events: vec![],
        }
    }
}

proptest! {
    #[test]
    fn validation_accepts_only_what_the_store_may_trust(b in batch()) {
        let limits = Limits::default();
        if let Ok(rows) = validate::batch(b.clone(), &session(), NOW, &limits) {
            prop_assert!(b.seq >= 1);
            for g in &rows.gpu_samples {
                prop_assert_eq!(g.device_id, 7);
                prop_assert!(0 <= g.used_min && g.used_min <= g.used_last);
                prop_assert!(g.used_last <= g.used_max && g.used_max <= g.total);
                prop_assert!(g.total > 0 && g.reserved <= g.total);
                prop_assert!(g.utilization_pct.is_none_or(|u| (0..=100).contains(&u)));
                prop_assert!(g.timestamp_ms <= NOW + limits.max_future_skew_ms);
                prop_assert!(g.timestamp_ms >= NOW - limits.max_age_ms);
            }
            for p in &rows.process_samples {
                prop_assert!(p.pid > 0);
                prop_assert!(p.name.len() <= limits.max_name_len);
                prop_assert!(!p.name.chars().any(char::is_control));
                prop_assert!(p.user.len() <= limits.max_id_len);
            }
        }
    }

    #[test]
    fn a_well_formed_batch_is_accepted_whole(
        seq in 1u64..1_000_000,
        samples in proptest::collection::vec(
            (0i64..86_400_000, 1u64..(200u64 << 30), 0u64..=1000, 0u64..=1000, 0u64..=1000, proptest::option::of(0u32..=100)),
            1..8,
        ),
        name in "[ -~]{0,100}",
    ) {
        let gpu_samples: Vec<pb::GpuSample> = samples
            .iter()
            .enumerate()
            .map(|(i, (age, total, a, b, c, utilization))| {
                let mut fractions = [*a, *b, *c];
                fractions.sort_unstable();
                let at = |f: u64| total / 1000 * f;
                pb::GpuSample {
                    uuid: GPU.into(),
                    // Distinct timestamps: a device has one sample per instant.
                    timestamp_ms: NOW - age - i as i64 * 86_400_000 / 8 - 1,
                    interval_ms: 1000,
                    poll_count: 10,
                    memory_used_min_bytes: at(fractions[0]),
                    memory_used_last_bytes: at(fractions[1]),
                    memory_used_max_bytes: at(fractions[2]),
                    memory_reserved_bytes: total / 100,
                    memory_total_bytes: *total,
                    utilization_pct: *utilization,
                    pcie_tx_bytes_per_s: None,
                    pcie_rx_bytes_per_s: None,
                }
            })
            .collect();
        let process = pb::ProcessSample {
            uuid: GPU.into(), timestamp_ms: NOW - 5, pid: 4242, start_time_ms: NOW - 60_000,
            memory_used_last_bytes: 1 << 30, memory_used_max_bytes: 2 << 30, name,
            ..pb::ProcessSample::default()
        };
        let b = pb::Batch {
            node: "node-a".into(), boot_id: "boot-a".into(), seq,
            gpu_samples, process_samples: vec![process], events: vec![],
        };
        let rows = validate::batch(b.clone(), &session(), NOW, &Limits::default());
        prop_assert!(rows.is_ok(), "{:?}", rows.err());
        let rows = rows.unwrap();
        prop_assert_eq!(rows.gpu_samples.len(), b.gpu_samples.len());
        prop_assert_eq!(rows.process_samples.len(), 1);
    }

    #[test]
    fn a_trace_of_any_text_gives_alerts_or_numbered_errors(lines in proptest::collection::vec(
        prop_oneof![
            "[0-9]{1,13},node-[a-c],[0-3],[0-9]{1,5},[0-9]{1,12},[0-9]{1,12}",
            any::<String>(),
        ],
        0..40,
    )) {
        let mut trace = String::from("timestamp_ms,node,gpu,pid,used_bytes,total_bytes\n");
        for line in &lines {
            trace.push_str(&line.replace('\n', " "));
            trace.push('\n');
        }
        let (_, errors) = backtest::run(RulesConfig::default(), Cursor::new(trace));
        for error in &errors {
            prop_assert!(error.line >= 2 && error.line <= lines.len() + 1, "{}", error.line);
        }
    }

    #[test]
    fn a_config_file_of_any_text_loads_or_says_why(text in prop_oneof![
        any::<String>(),
        "\\[(ingest|storage|agents|tls)\\]\n[a-z_]{1,20} = [0-9a-z\"]{1,10}\n",
    ]) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("collector.toml");
        std::fs::write(&path, &text).unwrap();
        if let Err(error) = CollectorConfig::load(Some(&path), Overrides::default()) {
            prop_assert!(error.to_string().contains("collector.toml"), "{}", error);
        }
    }
}
