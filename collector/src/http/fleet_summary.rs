//! `GET /api/v1/fleet`: the fleet overview that grows with the nodes, not
//! the devices. At 100,000 GPUs the list of every device (`/api/v1/gpus`)
//! is 64 MB; what an operator reads first is the fleet's totals, each
//! node's headroom and the devices closest to running out.
//! Made once per fleet read, from the read the live stream shares, and
//! shared by every caller.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use axum::body::Bytes;
use serde::Serialize;

use headroom_store::alerts::ActiveAlertCounts;
use headroom_store::{DeviceView, FleetDevices, NodeView};

/// The fullest devices listed unless the caller asks for another number.
pub const FULLEST_DEFAULT: usize = 100;
/// The fullest devices a caller may ask for.
pub const FULLEST_MAX: usize = 1_000;

/// The fleet summed, by node, and its fullest devices.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetSummary {
    pub nodes: usize,
    /// Physical GPUs; MIG instances are counted apart.
    pub gpus: usize,
    pub mig_instances: usize,
    /// Physical GPUs that have not reported a sample yet.
    pub gpus_without_data: usize,
    /// GPUs and MIG instances with a sample: those `fullest` can list.
    pub devices_with_data: usize,
    /// Summed over physical GPUs (an instance's memory is its GPU's); the
    /// total counts every GPU, reporting or not.
    pub memory_used_bytes: i64,
    pub memory_total_bytes: i64,
    /// Physical GPUs whose peak, with what is reserved, reached 90 % of the
    /// total, themselves or through a MIG instance, each once: as the
    /// fleet history counts them.
    pub gpus_low_headroom: usize,
    /// Nodes, the one with the least headroom first.
    pub by_node: Vec<NodeSummary>,
    /// Devices with a sample, the least headroom first: at most
    /// [`FULLEST_MAX`].
    #[serde(skip)]
    fullest: Vec<DeviceView>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeSummary {
    pub node: Arc<str>,
    /// `None` for a node known only from its devices (registered after
    /// the read of the node list).
    pub last_seen_ms: Option<i64>,
    pub gpus: usize,
    pub mig_instances: usize,
    pub memory_used_bytes: i64,
    pub memory_total_bytes: i64,
    /// The least free memory now among its GPUs and instances, in % of
    /// each one's total; `None` until one reports.
    pub lowest_headroom_pct: Option<f64>,
    pub gpus_low_headroom: usize,
}

impl NodeSummary {
    fn new(node: Arc<str>, last_seen_ms: Option<i64>) -> Self {
        Self {
            node,
            last_seen_ms,
            gpus: 0,
            mig_instances: 0,
            memory_used_bytes: 0,
            memory_total_bytes: 0,
            lowest_headroom_pct: None,
            gpus_low_headroom: 0,
        }
    }
}

/// A read's summary and its answer with [`FULLEST_DEFAULT`] devices, the
/// one most callers ask for, made once.
#[derive(Debug)]
pub struct SummaryMade {
    pub summary: FleetSummary,
    pub default_json: Bytes,
}

/// The answer's shape: the summary, the read's alert counts and as many
/// of the fullest devices as asked for.
#[derive(Serialize)]
struct Answer<'a> {
    #[serde(flatten)]
    summary: &'a FleetSummary,
    alerts: Option<&'a ActiveAlertCounts>,
    fullest: &'a [DeviceView],
}

impl FleetSummary {
    pub fn of(nodes: &[NodeView], devices: &FleetDevices) -> Self {
        let mut by_node: BTreeMap<Arc<str>, NodeSummary> = nodes
            .iter()
            .map(|n| {
                let name: Arc<str> = n.name.as_str().into();
                (name.clone(), NodeSummary::new(name, Some(n.last_seen_ms)))
            })
            .collect();
        let mut summary = Self {
            nodes: 0,
            gpus: 0,
            mig_instances: 0,
            gpus_without_data: 0,
            devices_with_data: 0,
            memory_used_bytes: 0,
            memory_total_bytes: 0,
            gpus_low_headroom: 0,
            by_node: Vec::new(),
            fullest: Vec::new(),
        };
        // (node, physical GPU) pairs below 10 %, each once.
        let mut low: BTreeSet<(Arc<str>, Arc<str>)> = BTreeSet::new();
        let mut with_data: Vec<(f64, DeviceView)> = Vec::with_capacity(devices.len());
        for device in devices.views() {
            let node = by_node
                .entry(device.node.clone())
                .or_insert_with(|| NodeSummary::new(device.node.clone(), None));
            let physical = device.parent_uuid.is_none();
            if physical {
                node.gpus += 1;
                summary.gpus += 1;
                node.memory_total_bytes += device.memory_total_bytes;
                summary.memory_total_bytes += device.memory_total_bytes;
            } else {
                node.mig_instances += 1;
                summary.mig_instances += 1;
            }
            let Some(latest) = &device.latest else {
                summary.gpus_without_data += usize::from(physical);
                continue;
            };
            if physical {
                node.memory_used_bytes += latest.memory_used_bytes;
                summary.memory_used_bytes += latest.memory_used_bytes;
            }
            node.lowest_headroom_pct = Some(
                node.lowest_headroom_pct
                    .map_or(latest.headroom_pct, |pct| pct.min(latest.headroom_pct)),
            );
            if latest.low_headroom_at_peak() {
                let gpu = device.parent_uuid.clone().unwrap_or(device.uuid.clone());
                low.insert((device.node.clone(), gpu));
            }
            with_data.push((latest.headroom_pct, device));
        }
        for (node, _) in &low {
            if let Some(summary) = by_node.get_mut(node) {
                summary.gpus_low_headroom += 1;
            }
        }
        summary.gpus_low_headroom = low.len();
        summary.devices_with_data = with_data.len();
        summary.nodes = by_node.len();
        summary.by_node = by_node.into_values().collect();
        summary.by_node.sort_by(|a, b| {
            let pct = |n: &NodeSummary| n.lowest_headroom_pct.unwrap_or(f64::INFINITY);
            pct(a).total_cmp(&pct(b)).then_with(|| a.node.cmp(&b.node))
        });
        let by_headroom = |a: &(f64, DeviceView), b: &(f64, DeviceView)| {
            a.0.total_cmp(&b.0).then_with(|| a.1.uuid.cmp(&b.1.uuid))
        };
        if with_data.len() > FULLEST_MAX {
            with_data.select_nth_unstable_by(FULLEST_MAX, by_headroom);
            with_data.truncate(FULLEST_MAX);
        }
        with_data.sort_unstable_by(by_headroom);
        summary.fullest = with_data.into_iter().map(|(_, device)| device).collect();
        summary
    }

    /// The answer with the `fullest` devices that fit in the count asked
    /// for, as JSON.
    pub fn to_json(
        &self,
        alerts: Option<&ActiveAlertCounts>,
        fullest: usize,
    ) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec(&Answer {
            summary: self,
            alerts,
            fullest: &self.fullest[..fullest.min(self.fullest.len())],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_fleet::{GIB, device, node};

    fn fleet() -> (Vec<NodeView>, FleetDevices) {
        let nodes = vec![node("a", 10), node("b", 20), node("idle", 30)];
        let devices = vec![
            device("a", "a0", None, 80, Some((10, 10))),
            // Low at its peak, not now.
            device("a", "a1", None, 80, Some((20, 75))),
            device("b", "b0", None, 80, Some((40, 40))),
            // A MIG instance near full: its GPU counts once, as low.
            device("b", "b0-mig", Some("b0"), 40, Some((38, 38))),
            device("b", "b1", None, 80, None),
            // Registered after the node list was read.
            device("c", "c0", None, 80, Some((79, 79))),
        ];
        (nodes, FleetDevices::from_views(devices))
    }

    #[test]
    fn sums_physical_gpus_and_counts_each_low_one_once() {
        let (nodes, devices) = fleet();
        let s = FleetSummary::of(&nodes, &devices);
        assert_eq!((s.nodes, s.gpus, s.mig_instances), (4, 5, 1));
        assert_eq!(s.gpus_without_data, 1);
        assert_eq!(s.devices_with_data, 5, "b1 has no sample yet");
        assert_eq!(s.memory_total_bytes, 5 * 80 * GIB);
        assert_eq!(
            s.memory_used_bytes,
            (10 + 20 + 40 + 79) * GIB,
            "an instance's memory is its GPU's"
        );
        assert_eq!(
            s.gpus_low_headroom, 3,
            "a1 at its peak, b0 through its instance, c0"
        );
        let names: Vec<&str> = s.by_node.iter().map(|n| &*n.node).collect();
        assert_eq!(names, ["c", "b", "a", "idle"], "least headroom first");
        let b = &s.by_node[1];
        assert_eq!((b.gpus, b.mig_instances, b.gpus_low_headroom), (2, 1, 1));
        assert_eq!(b.lowest_headroom_pct, Some(3.8), "the instance's");
        assert_eq!(b.last_seen_ms, Some(20));
        assert_eq!(s.by_node[0].last_seen_ms, None);
        assert_eq!(s.by_node[3].lowest_headroom_pct, None);
    }

    #[test]
    fn lists_the_fullest_devices_first_as_many_as_asked() {
        let (nodes, devices) = fleet();
        let s = FleetSummary::of(&nodes, &devices);
        let json: serde_json::Value = serde_json::from_slice(&s.to_json(None, 2).unwrap()).unwrap();
        let fullest: Vec<&str> = json["fullest"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["uuid"].as_str().unwrap())
            .collect();
        assert_eq!(fullest, ["c0", "b0-mig"]);
        assert_eq!(json["gpus"], 5);
        assert_eq!(json["by_node"][0]["node"], "c");
        assert!(json["alerts"].is_null());
        let all: serde_json::Value =
            serde_json::from_slice(&s.to_json(None, FULLEST_MAX).unwrap()).unwrap();
        assert_eq!(
            all["fullest"].as_array().map(Vec::len),
            Some(5),
            "every device with a sample"
        );
    }

    #[test]
    fn keeps_only_the_fullest_of_a_large_fleet() {
        let devices: Vec<DeviceView> = (0..FULLEST_MAX as i64 + 500)
            .map(|i| device("n", &format!("g{i:05}"), None, 80, Some((i % 79, i % 79))))
            .collect();
        let s = FleetSummary::of(&[], &FleetDevices::from_views(devices));
        assert_eq!(s.fullest.len(), FULLEST_MAX);
        assert!(s.fullest.windows(2).all(|w| {
            w[0].latest.as_ref().map(|l| l.headroom_pct)
                <= w[1].latest.as_ref().map(|l| l.headroom_pct)
        }));
        assert_eq!(
            s.fullest[0].latest.as_ref().map(|l| l.memory_used_bytes),
            Some(78 * GIB)
        );
    }
}
