//! Fleets for the unit tests of the fleet's summaries: nodes and devices
//! with the figures a test names, the rest fixed.

use std::sync::Arc;

use headroom_store::{DeviceView, LatestSample, NodeView};

pub const GIB: i64 = 1 << 30;

pub fn node(name: &str, last_seen_ms: i64) -> NodeView {
    NodeView {
        name: name.into(),
        boot_id: "boot".into(),
        agent_version: "test".into(),
        driver_version: "550".into(),
        sample_interval_ms: 1000,
        registered_at_ms: 0,
        last_seen_ms,
        gpu_count: 0,
        mig_instance_count: 0,
    }
}

/// A device of `total` GiB using `used` GiB now and `peak` GiB at the
/// interval's peak, half a GiB reserved.
pub fn device(
    node: &str,
    uuid: &str,
    parent: Option<&str>,
    total: i64,
    used_and_peak: Option<(i64, i64)>,
) -> DeviceView {
    let (total, reserved) = (total * GIB, GIB / 2);
    DeviceView {
        uuid: uuid.into(),
        node: node.into(),
        kind: if parent.is_some() { "mig" } else { "gpu" },
        parent_uuid: parent.map(Arc::from),
        index: 0,
        name: "NVIDIA H100 80GB HBM3".into(),
        mig_profile: parent.map(|_| Arc::from("3g.40gb")),
        mig_gpu_instance_id: None,
        mig_compute_instance_id: None,
        memory_total_bytes: total,
        latest: used_and_peak.map(|(used, peak)| {
            let (used, peak) = (used * GIB, peak * GIB);
            let headroom = total - used - reserved;
            LatestSample {
                timestamp_ms: 1_000,
                memory_used_bytes: used,
                memory_used_min_bytes: used,
                memory_used_max_bytes: peak,
                memory_reserved_bytes: reserved,
                memory_total_bytes: total,
                headroom_bytes: headroom,
                headroom_pct: (headroom as f64 * 1000.0 / total as f64).round() / 10.0,
                peak_headroom_bytes: total - peak - reserved,
                utilization_pct: None,
                pcie_tx_bytes_per_s: None,
                pcie_rx_bytes_per_s: None,
            }
        }),
    }
}
