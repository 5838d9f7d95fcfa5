//! The live stream's fleet by node: what a dashboard is sent when the fleet
//! has more devices than `[http] stream_devices_max` and the client did not
//! name a node. At 100,000 GPUs a snapshot of every device is some 64 MB
//! and a steady second's update some 13 MB, per client; a row per node and
//! the devices at risk are what a screen can show of that fleet anyway.
//!
//! A row holds what its cell shows, rounded as shown (whole percents, a
//! level word), so that a client is sent the rows whose cell would change,
//! not every node whose memory moved by a byte.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::Serialize;

use super::device_summary::DeviceAlerts;
use headroom_store::{DeviceView, FleetDevices, LatestSample, NodeView};

/// The devices with the least headroom sent beside the rows, for the
/// at-risk list (which shows six).
pub const FULLEST_SENT: usize = 12;
/// Devices with an active alert sent beside the rows, at most, those the
/// at-risk list ranks first; the rows' counts stay exact past it.
pub const ALERTED_SENT: usize = 200;
/// A node silent for longer than this says so on its cell.
const SILENT_AFTER_MS: i64 = 10_000;

/// One node's cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeRow {
    pub node: Arc<str>,
    pub gpus: u32,
    pub mig_instances: u32,
    /// Memory used, with what is reserved, of its GPUs' total, in whole %
    /// (an instance's memory is its GPU's); `None` until one reports.
    pub used_pct: Option<u32>,
    /// The least free memory now among its GPUs and instances, in whole %
    /// of each one's total; `None` until one reports.
    pub headroom_pct: Option<i64>,
    /// The worst of its devices' levels as their tiles show them: `crit`,
    /// `warn`, `ok`, or `none` (no sample yet); a firing alert raises it.
    pub level: &'static str,
    /// Devices with a firing alert.
    pub firing: u32,
    /// Devices with an alert pending or an OOM forecast, none firing.
    pub pending: u32,
    /// Devices below 10 % headroom now.
    pub low: u32,
    /// Devices the at-risk list counts: an alert firing or pending, an OOM
    /// forecast, or below 10 % headroom.
    pub at_risk: u32,
    /// The node's last sample, while it has been silent for over 10 s.
    pub silent_since_ms: Option<i64>,
}

impl NodeRow {
    fn new(node: Arc<str>) -> Self {
        Self {
            node,
            gpus: 0,
            mig_instances: 0,
            used_pct: None,
            headroom_pct: None,
            level: "none",
            firing: 0,
            pending: 0,
            low: 0,
            at_risk: 0,
            silent_since_ms: None,
        }
    }
}

/// One read of the fleet by node, shared by every client in that scope.
#[derive(Debug)]
pub struct FleetByNode {
    /// In the node list's order, then nodes known only from their devices.
    pub rows: Vec<NodeRow>,
    /// GPUs and MIG instances in the fleet.
    pub devices: usize,
    /// The [`FULLEST_SENT`] devices with the least headroom and up to
    /// [`ALERTED_SENT`] with an active alert (ranked as the at-risk list
    /// ranks them), each once, in the overview's order.
    pub at_risk: Vec<DeviceView>,
}

/// How full a device is, as its tile says: the larger of its use now and
/// at the interval's peak, with what is reserved, over its total.
fn memory_level(latest: &LatestSample) -> &'static str {
    if latest.memory_total_bytes <= 0 {
        return "ok";
    }
    let total = latest.memory_total_bytes as f64;
    let reserved = latest.memory_reserved_bytes;
    let used = latest
        .memory_used_bytes
        .max(latest.memory_used_max_bytes)
        .saturating_add(reserved) as f64;
    let fraction = used / total;
    if fraction >= 0.95 {
        "crit"
    } else if fraction >= 0.9 {
        "warn"
    } else {
        "ok"
    }
}

fn level_rank(level: &str) -> u8 {
    match level {
        "crit" => 3,
        "warn" => 2,
        "ok" => 1,
        _ => 0,
    }
}

fn worse(a: &'static str, b: &'static str) -> &'static str {
    if level_rank(b) > level_rank(a) { b } else { a }
}

impl FleetByNode {
    pub fn of(
        nodes: &[NodeView],
        devices: &FleetDevices,
        alerts: &BTreeMap<String, DeviceAlerts>,
        now_ms: i64,
    ) -> Self {
        let mut slot_of: HashMap<Arc<str>, usize> = HashMap::with_capacity(nodes.len());
        let mut rows: Vec<NodeRow> = Vec::with_capacity(nodes.len());
        for node in nodes {
            let name: Arc<str> = node.name.as_str().into();
            slot_of.insert(name.clone(), rows.len());
            let mut row = NodeRow::new(name);
            row.silent_since_ms =
                (now_ms - node.last_seen_ms > SILENT_AFTER_MS).then_some(node.last_seen_ms);
            rows.push(row);
        }
        // Per row: used with reserved, and the total, of its physical GPUs.
        let mut sums: Vec<(i64, i64, bool)> = vec![(0, 0, false); rows.len()];
        let mut fullest: Vec<(f64, usize)> = Vec::new();
        // (tier, soonest OOM, headroom, slot), as the at-risk list ranks.
        let mut alerted: Vec<(u8, i64, f64, usize)> = Vec::new();
        for (slot, device) in devices.views().enumerate() {
            let index = *slot_of.entry(device.node.clone()).or_insert_with(|| {
                rows.push(NodeRow::new(device.node.clone()));
                sums.push((0, 0, false));
                rows.len() - 1
            });
            let row = &mut rows[index];
            let physical = device.parent_uuid.is_none();
            if physical {
                row.gpus += 1;
                sums[index].1 += device.memory_total_bytes;
            } else {
                row.mig_instances += 1;
            }
            let device_alerts = alerts.get(&*device.uuid);
            let firing = device_alerts.is_some_and(|a| !a.rules.is_empty());
            let pending =
                device_alerts.is_some_and(|a| !a.pending.is_empty() || a.oom_at_ms.is_some());
            if let Some(a) = device_alerts.filter(|_| firing || pending) {
                let tier = match a.severity {
                    Some("critical") if firing => 0,
                    _ if firing => 1,
                    _ => 2,
                };
                let headroom = device
                    .latest
                    .as_ref()
                    .map_or(f64::INFINITY, |l| l.headroom_pct);
                alerted.push((tier, a.oom_at_ms.unwrap_or(i64::MAX), headroom, slot));
            }
            row.firing += u32::from(firing);
            row.pending += u32::from(pending && !firing);
            let alert_level = match device_alerts.and_then(|a| a.severity) {
                Some("critical") => "crit",
                Some(_) => "warn",
                None => "none",
            };
            let mut low = false;
            match &device.latest {
                Some(latest) => {
                    if physical {
                        sums[index].0 += latest.memory_used_bytes + latest.memory_reserved_bytes;
                        sums[index].2 = true;
                    }
                    let headroom = latest.headroom_pct.round() as i64;
                    row.headroom_pct = Some(row.headroom_pct.map_or(headroom, |h| h.min(headroom)));
                    low = latest.headroom_pct < 10.0;
                    row.level = worse(row.level, worse(memory_level(latest), alert_level));
                    fullest.push((latest.headroom_pct, slot));
                }
                None => row.level = worse(row.level, alert_level),
            }
            row.low += u32::from(low);
            row.at_risk += u32::from(firing || pending || low);
        }
        for (row, (used, total, reported)) in rows.iter_mut().zip(&sums) {
            row.used_pct = (*reported && *total > 0)
                .then(|| (*used as f64 * 100.0 / *total as f64).round() as u32);
        }
        let by_headroom =
            |a: &(f64, usize), b: &(f64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
        if fullest.len() > FULLEST_SENT {
            fullest.select_nth_unstable_by(FULLEST_SENT, by_headroom);
            fullest.truncate(FULLEST_SENT);
        }
        let by_rank = |a: &(u8, i64, f64, usize), b: &(u8, i64, f64, usize)| {
            (a.0, a.1)
                .cmp(&(b.0, b.1))
                .then(a.2.total_cmp(&b.2))
                .then(a.3.cmp(&b.3))
        };
        if alerted.len() > ALERTED_SENT {
            alerted.select_nth_unstable_by(ALERTED_SENT, by_rank);
            alerted.truncate(ALERTED_SENT);
        }
        let mut sent: Vec<usize> = fullest.into_iter().map(|(_, slot)| slot).collect();
        sent.extend(alerted.into_iter().map(|(.., slot)| slot));
        sent.sort_unstable();
        sent.dedup();
        Self {
            rows,
            devices: devices.len(),
            at_risk: sent.into_iter().filter_map(|s| devices.view(s)).collect(),
        }
    }

    /// The rows that differ from those a client was `sent` (every row when
    /// it was sent none), and the names of the nodes that went.
    pub fn changed_since<'a>(
        &'a self,
        sent: Option<&'a FleetByNode>,
    ) -> (Vec<&'a NodeRow>, Vec<&'a str>) {
        let Some(sent) = sent else {
            return (self.rows.iter().collect(), Vec::new());
        };
        if std::ptr::eq(sent, self) {
            return (Vec::new(), Vec::new());
        }
        let same_nodes = sent.rows.len() == self.rows.len()
            && sent
                .rows
                .iter()
                .zip(&self.rows)
                .all(|(a, b)| a.node == b.node);
        if same_nodes {
            let changed = self
                .rows
                .iter()
                .zip(&sent.rows)
                .filter(|(now, before)| now != before)
                .map(|(now, _)| now)
                .collect();
            return (changed, Vec::new());
        }
        let before: HashMap<&str, &NodeRow> =
            sent.rows.iter().map(|row| (&*row.node, row)).collect();
        let changed = self
            .rows
            .iter()
            .filter(|row| before.get(&*row.node) != Some(row))
            .collect();
        let now: std::collections::HashSet<&str> = self.rows.iter().map(|row| &*row.node).collect();
        let removed = sent
            .rows
            .iter()
            .map(|row| &*row.node)
            .filter(|node| !now.contains(node))
            .collect();
        (changed, removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_fleet::{self, GIB, node};

    /// A device of 80 GiB using `used` GiB now and `peak` at the peak,
    /// half a GiB reserved.
    fn device(
        node: &str,
        uuid: &str,
        parent: Option<&str>,
        used_and_peak: Option<(i64, i64)>,
    ) -> DeviceView {
        test_fleet::device(node, uuid, parent, 80, used_and_peak)
    }

    fn firing(severity: &'static str) -> DeviceAlerts {
        DeviceAlerts {
            severity: Some(severity),
            rules: vec!["watermark".into()],
            ..DeviceAlerts::default()
        }
    }

    #[test]
    fn a_row_says_what_its_worst_device_would_say() {
        let nodes = [
            node("calm", 100_000),
            node("peaky", 100_000),
            node("quiet", 50_000),
        ];
        let devices = FleetDevices::from_views(vec![
            device("calm", "c0", None, Some((10, 10))),
            device("calm", "c1", None, Some((30, 30))),
            // Fine now, 95 % at the interval's peak: the tile says CRITICAL.
            device("peaky", "p0", None, Some((20, 76))),
            device("peaky", "p0-mig", Some("p0"), Some((5, 5))),
            device("quiet", "q0", None, None),
        ]);
        let by_node = FleetByNode::of(&nodes, &devices, &BTreeMap::new(), 100_500);
        let calm = &by_node.rows[0];
        assert_eq!(calm.level, "ok");
        assert_eq!(calm.used_pct, Some(26), "(10.5 + 30.5) of 160 GiB");
        assert_eq!(
            calm.headroom_pct,
            Some(62),
            "c1's 61.9 %, as its tile rounds it"
        );
        assert_eq!((calm.low, calm.at_risk, calm.silent_since_ms), (0, 0, None));
        let peaky = &by_node.rows[1];
        assert_eq!((peaky.gpus, peaky.mig_instances), (1, 1));
        assert_eq!(peaky.level, "crit");
        assert_eq!(
            peaky.used_pct,
            Some(26),
            "the instance's memory is its GPU's"
        );
        let quiet = &by_node.rows[2];
        assert_eq!(
            (quiet.level, quiet.used_pct, quiet.headroom_pct),
            ("none", None, None)
        );
        assert_eq!(quiet.silent_since_ms, Some(50_000));
        assert_eq!(by_node.devices, 5);
    }

    #[test]
    fn alerts_raise_the_level_and_are_counted_and_sent() {
        let nodes = [node("a", 0), node("b", 0)];
        let devices = FleetDevices::from_views(vec![
            device("a", "a0", None, Some((10, 10))),
            device("a", "a1", None, Some((73, 73))),
            device("b", "b0", None, Some((10, 10))),
            device("b", "b1", None, Some((10, 10))),
        ]);
        let alerts = BTreeMap::from([
            ("a0".to_owned(), firing("warning")),
            (
                "b1".to_owned(),
                DeviceAlerts {
                    oom_at_ms: Some(5_000),
                    pending: vec!["time_to_oom".into()],
                    ..DeviceAlerts::default()
                },
            ),
        ]);
        let by_node = FleetByNode::of(&nodes, &devices, &alerts, 0);
        let (a, b) = (&by_node.rows[0], &by_node.rows[1]);
        assert_eq!(
            (a.level, a.firing, a.pending, a.low, a.at_risk),
            ("warn", 1, 0, 1, 2)
        );
        assert_eq!(
            (b.level, b.firing, b.pending, b.low, b.at_risk),
            ("ok", 0, 1, 0, 1)
        );
        let sent: Vec<&str> = by_node.at_risk.iter().map(|d| &*d.uuid).collect();
        assert_eq!(
            sent,
            ["a0", "a1", "b0", "b1"],
            "few devices: all of them, once each"
        );
    }

    #[test]
    fn a_large_fleet_sends_its_fullest_and_alerted_devices_only() {
        let devices: Vec<DeviceView> = (0..1_000_i64)
            .map(|i| {
                device(
                    &format!("n{:03}", i / 8),
                    &format!("g{i:04}"),
                    None,
                    Some((i % 70, i % 70)),
                )
            })
            .collect();
        let alerts = BTreeMap::from([("g0001".to_owned(), firing("critical"))]);
        let by_node = FleetByNode::of(&[], &FleetDevices::from_views(devices), &alerts, 0);
        assert_eq!(
            by_node.rows.len(),
            125,
            "nodes known only from their devices"
        );
        assert_eq!(by_node.at_risk.len(), FULLEST_SENT + 1);
        assert!(by_node.at_risk.iter().any(|d| &*d.uuid == "g0001"));
        let least = by_node
            .at_risk
            .iter()
            .filter_map(|d| d.latest.as_ref())
            .map(|l| l.memory_used_bytes)
            .max();
        assert_eq!(least, Some(69 * GIB));
    }

    #[test]
    fn past_the_cap_the_alerted_devices_sent_are_those_ranked_first() {
        let count = ALERTED_SENT + 50;
        let devices: Vec<DeviceView> = (0..count)
            .map(|i| {
                device(
                    &format!("n{:03}", i / 8),
                    &format!("g{i:04}"),
                    None,
                    Some((10, 10)),
                )
            })
            .collect();
        // Warnings everywhere; one critical alert on the last device of the
        // overview's order.
        let mut alerts: BTreeMap<String, DeviceAlerts> = (0..count)
            .map(|i| (format!("g{i:04}"), firing("warning")))
            .collect();
        let last = format!("g{:04}", count - 1);
        alerts.insert(last.clone(), firing("critical"));
        let by_node = FleetByNode::of(&[], &FleetDevices::from_views(devices), &alerts, 0);
        assert!(
            by_node.at_risk.iter().any(|d| *d.uuid == *last),
            "the critical one is sent"
        );
        let firing_total: u32 = by_node.rows.iter().map(|r| r.firing).sum();
        assert_eq!(firing_total as usize, count, "the counts stay exact");
        assert!(by_node.at_risk.len() <= ALERTED_SENT + FULLEST_SENT);
    }

    #[test]
    fn a_client_is_sent_the_rows_whose_cell_changed_and_the_nodes_that_went() {
        let nodes = [node("a", 0), node("b", 0)];
        let read = |a_used: i64, with_b: bool| {
            let mut views = vec![device("a", "a0", None, Some((a_used, a_used)))];
            if with_b {
                views.push(device("b", "b0", None, Some((10, 10))));
            }
            FleetByNode::of(
                &nodes[..1 + usize::from(with_b)],
                &FleetDevices::from_views(views),
                &BTreeMap::new(),
                0,
            )
        };
        let first = read(10, true);
        assert_eq!(first.changed_since(None).0.len(), 2);
        assert!(first.changed_since(Some(&first)).0.is_empty());
        let same_cells = read(10, true);
        assert!(
            same_cells.changed_since(Some(&first)).0.is_empty(),
            "equal rows are not sent"
        );
        let fuller = read(40, true);
        let (changed, removed) = fuller.changed_since(Some(&first));
        assert_eq!(changed.iter().map(|r| &*r.node).collect::<Vec<_>>(), ["a"]);
        assert!(removed.is_empty());
        let without_b = read(40, false);
        let (changed, removed) = without_b.changed_since(Some(&fuller));
        assert!(changed.is_empty());
        assert_eq!(removed, ["b"]);
    }
}
