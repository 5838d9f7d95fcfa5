//! Shared by the rule tests: observations to feed the engine, and a way to
//! pick one rule's transitions out of what it returns.

use crate::alert::AlertChange;
use crate::allocator::AllocatorObservation;
use crate::config::RulesConfig;
use crate::lifecycle::Transition;
use crate::observation::{DeviceObservation, EventObservation, ProcessObservation};

pub const GIB: u64 = 1 << 30;

/// GPU 1 of node n1 (100 GiB) at `ts`, nothing reserved.
pub fn device(ts: i64, used: u64, attributed: Option<u64>) -> DeviceObservation<'static> {
    DeviceObservation {
        node: "n1",
        device_uuid: "GPU-1",
        gpu_index: 1,
        mig_profile: None,
        timestamp_ms: ts,
        used_last: used,
        used_max: used,
        reserved: 0,
        total: 100 * GIB,
        attributed,
        largest_process: None,
    }
}

/// An allocator report at `ts` with the given counters: 40 reserved of which
/// 10 allocated, a peak of 25.
pub fn report(ts: i64, retries: u64, ooms: u64) -> AllocatorObservation {
    AllocatorObservation {
        timestamp_ms: ts,
        allocated: 10,
        reserved: 40,
        inactive_split: 5,
        peak_allocated: 25,
        alloc_retries: retries,
        ooms,
        composition: None,
    }
}

pub fn rules(text: &str) -> RulesConfig {
    RulesConfig::parse(text, std::path::Path::new("t.toml")).unwrap()
}

pub fn transitions(changes: &[AlertChange], rule: &str) -> Vec<Transition> {
    changes
        .iter()
        .filter(|c| c.rule == rule)
        .map(|c| c.transition)
        .collect()
}

/// An event on GPU 1 of node n1.
pub fn event(kind: &'static str, code: i64, ts: i64) -> EventObservation<'static> {
    EventObservation {
        node: "n1",
        device_uuid: Some("GPU-1"),
        gpu_index: Some(1),
        kind,
        code,
        detail: "",
        timestamp_ms: ts,
    }
}

/// Alice's training job (Slurm job 77) on GPU 1 of node n1, holding 60 GiB.
pub fn training(ts: i64, report: Option<AllocatorObservation>) -> ProcessObservation<'static> {
    ProcessObservation {
        node: "n1",
        device_uuid: "GPU-1",
        gpu_index: 1,
        pid: 4242,
        start_time_ms: 0,
        name: "python train.py",
        user: "alice",
        slurm_job_id: "77",
        slurm_account: "",
        pod_uid: "",
        pod_namespace: "",
        pod_labels: &[],
        container_id: "",
        timestamp_ms: ts,
        used_last: 60 * GIB,
        used_max: 60 * GIB,
        allocator: report,
    }
}

/// An allocator report whose peak is what is allocated now.
pub fn stats(
    ts: i64,
    allocated: u64,
    reserved: u64,
    retries: u64,
    ooms: u64,
) -> Option<AllocatorObservation> {
    Some(AllocatorObservation {
        timestamp_ms: ts,
        allocated,
        reserved,
        inactive_split: reserved - allocated,
        peak_allocated: allocated,
        alloc_retries: retries,
        ooms,
        composition: None,
    })
}

/// What a job training with Adam counts: 4 GiB of bf16 weights and
/// gradients each, 16 GiB of fp32 optimizer state.
pub fn adam_composition() -> headroom_common::Composition {
    use headroom_common::{Composition, Dtype, Part};
    let part = |bytes: u64, dtype| Some(Part { bytes, dtype });
    Composition {
        weights: part(4 * GIB, Dtype::Bfloat16),
        gradients: part(4 * GIB, Dtype::Bfloat16),
        optimizer_state: part(16 * GIB, Dtype::Float32),
    }
}

/// A 30 GiB peak of which optimizer state is the largest share.
pub fn breakdown_led_by_optimizer_state() -> headroom_common::Breakdown {
    headroom_common::Breakdown::of(
        &adam_composition(),
        headroom_common::composition::AllocatorFigures {
            allocated: 30 * GIB,
            reserved: 31 * GIB,
            peak_allocated: 30 * GIB,
        },
        Some(32 * GIB),
    )
}
