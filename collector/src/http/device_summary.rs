//! What the fleet view says about each device beyond its latest sample:
//! the alerts on it (firing, pending, and the soonest predicted OOM) and
//! who holds its memory. Computed once a period for every stream client
//! together, from the store's active alerts and current processes.

use std::collections::BTreeMap;

use serde::Serialize;

use headroom_store::alerts::AlertView;
use headroom_store::{FleetDevices, ProcessView};

/// The owners a device lists, at most: the tile and the cell's tooltip
/// have room for a few, the GPU page lists them all.
pub const MAX_OWNERS_PER_DEVICE: usize = 3;

/// The active alerts on one device. A tile never says "OK" under a firing
/// alert, and the at-risk list ranks devices by these.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeviceAlerts {
    /// Of the firing alerts: "critical" when any is, else "warning";
    /// `None` when alerts are only pending.
    pub severity: Option<&'static str>,
    /// The rules firing, sorted, each once.
    pub rules: Vec<String>,
    /// The rules pending (their condition holds, their `for` has not
    /// passed), sorted, each once, none that also fires.
    pub pending: Vec<String>,
    /// The soonest OOM its time-to-OOM alert (pending or firing) predicts.
    pub oom_at_ms: Option<i64>,
}

/// Active alerts by the device they are on; alerts on a node, not a device,
/// are left out.
pub fn alerts_by_device(alerts: &[AlertView]) -> BTreeMap<String, DeviceAlerts> {
    let mut map: BTreeMap<String, DeviceAlerts> = BTreeMap::new();
    for alert in alerts {
        let Some(uuid) = alert.labels.get("device_uuid").and_then(|u| u.as_str()) else {
            continue;
        };
        let entry = map.entry(uuid.to_owned()).or_default();
        if alert.state == "firing" {
            entry.severity = Some(match (alert.severity.as_str(), entry.severity) {
                ("critical", _) | (_, Some("critical")) => "critical",
                _ => "warning",
            });
            insert_sorted(&mut entry.rules, &alert.rule);
            entry.pending.retain(|r| r != &alert.rule);
        } else if !entry.rules.contains(&alert.rule) {
            insert_sorted(&mut entry.pending, &alert.rule);
        }
        let predicted = alert
            .details
            .get("predicted_oom_at_ms")
            .and_then(serde_json::Value::as_i64);
        if alert.rule == "time_to_oom"
            && let Some(at) = predicted
        {
            entry.oom_at_ms = Some(entry.oom_at_ms.map_or(at, |seen| seen.min(at)));
        }
    }
    map
}

fn insert_sorted(list: &mut Vec<String>, rule: &str) {
    if let Err(at) = list.binary_search_by(|r| r.as_str().cmp(rule)) {
        list.insert(at, rule.to_owned());
    }
}

/// Who holds a device's memory: a user with the Slurm job or pod the
/// memory belongs to, summed over that owner's processes on the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Owner {
    pub user: String,
    /// Empty when the processes are in no Slurm job.
    pub slurm_job_id: String,
    /// Empty when the processes are in no Kubernetes pod.
    pub pod_uid: String,
    pub memory_bytes: i64,
}

/// The biggest owners of each device, biggest first. A process on a MIG
/// instance counts for the instance and for its GPU, whose tile stands for
/// the whole card.
pub fn owners_by_device(
    processes: &[ProcessView],
    devices: &FleetDevices,
) -> BTreeMap<String, Vec<Owner>> {
    let parents: BTreeMap<&str, &str> = devices.mig_parents().collect();
    let mut map: BTreeMap<String, Vec<Owner>> = BTreeMap::new();
    for p in processes {
        let uuid = p.device_uuid.as_str();
        for device in std::iter::once(uuid).chain(parents.get(uuid).copied()) {
            let owners = map.entry(device.to_owned()).or_default();
            match owners.iter_mut().find(|o| {
                o.user == p.user && o.slurm_job_id == p.slurm_job_id && o.pod_uid == p.pod_uid
            }) {
                Some(owner) => owner.memory_bytes += p.memory_used_bytes,
                None => owners.push(Owner {
                    user: p.user.clone(),
                    slurm_job_id: p.slurm_job_id.clone(),
                    pod_uid: p.pod_uid.clone(),
                    memory_bytes: p.memory_used_bytes,
                }),
            }
        }
    }
    for owners in map.values_mut() {
        owners.sort_by(|a, b| {
            b.memory_bytes
                .cmp(&a.memory_bytes)
                .then_with(|| a.user.cmp(&b.user))
        });
        owners.truncate(MAX_OWNERS_PER_DEVICE);
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alert(rule: &str, state: &str, severity: &str, labels: serde_json::Value) -> AlertView {
        AlertView {
            id: 1,
            fingerprint: String::new(),
            rule: rule.to_owned(),
            severity: severity.to_owned(),
            state: state.to_owned(),
            labels,
            summary: String::new(),
            details: serde_json::Value::Null,
            started_at_ms: 0,
            fired_at_ms: Some(0),
            resolved_at_ms: None,
            updated_at_ms: 0,
            acknowledged_by: None,
            acknowledged_at_ms: None,
            remedy: String::new(),
        }
    }

    #[test]
    fn a_device_shows_its_worst_firing_severity_and_each_rule_once() {
        let a = serde_json::json!({ "node": "n1", "device_uuid": "GPU-a" });
        let map = alerts_by_device(&[
            alert("watermark", "firing", "warning", a.clone()),
            alert("time_to_oom", "firing", "critical", a.clone()),
            alert("watermark", "firing", "warning", a),
            alert(
                "leak",
                "firing",
                "warning",
                serde_json::json!({ "device_uuid": "GPU-b", "pid": "7" }),
            ),
            // A node's alert is on no device.
            alert(
                "agent_silent",
                "firing",
                "critical",
                serde_json::json!({ "node": "n1" }),
            ),
        ]);
        assert_eq!(map.len(), 2);
        assert_eq!(map["GPU-a"].severity, Some("critical"));
        assert_eq!(map["GPU-a"].rules, ["time_to_oom", "watermark"]);
        assert_eq!(map["GPU-b"].severity, Some("warning"));
        assert_eq!(map["GPU-b"].rules, ["leak"]);
    }

    #[test]
    fn pending_alerts_are_listed_apart_and_the_soonest_oom_is_kept() {
        let a = serde_json::json!({ "device_uuid": "GPU-a" });
        let mut soon = alert("time_to_oom", "pending", "warning", a.clone());
        soon.details = serde_json::json!({ "predicted_oom_at_ms": 5_000 });
        let mut later = alert("time_to_oom", "pending", "warning", a.clone());
        later.details = serde_json::json!({ "predicted_oom_at_ms": 9_000 });
        let map = alerts_by_device(&[
            later,
            soon,
            alert("leak", "pending", "warning", a.clone()),
            // A rule that fires on the device is not also pending there.
            alert("leak", "firing", "warning", a),
        ]);
        let entry = &map["GPU-a"];
        assert_eq!(entry.severity, Some("warning"));
        assert_eq!(entry.rules, ["leak"]);
        assert_eq!(entry.pending, ["time_to_oom"]);
        assert_eq!(entry.oom_at_ms, Some(5_000));

        let only_pending = alerts_by_device(&[alert(
            "watermark",
            "pending",
            "critical",
            serde_json::json!({ "device_uuid": "GPU-c" }),
        )]);
        assert_eq!(only_pending["GPU-c"].severity, None);
        assert!(only_pending["GPU-c"].rules.is_empty());
    }

    fn device(uuid: &str, parent: Option<&str>) -> headroom_store::DeviceView {
        headroom_store::DeviceView {
            uuid: uuid.into(),
            node: "n1".into(),
            kind: if parent.is_some() { "mig" } else { "gpu" },
            parent_uuid: parent.map(Into::into),
            index: 0,
            name: "".into(),
            mig_profile: None,
            mig_gpu_instance_id: None,
            mig_compute_instance_id: None,
            memory_total_bytes: 0,
            latest: None,
        }
    }

    fn process(uuid: &str, user: &str, job: &str, memory: i64) -> ProcessView {
        ProcessView {
            node: "n1".to_owned(),
            device_uuid: uuid.to_owned(),
            gpu_index: 0,
            pid: memory,
            start_time_ms: 0,
            name: "python".to_owned(),
            uid: 1000,
            user: user.to_owned(),
            container_id: String::new(),
            container_runtime: String::new(),
            pod_uid: String::new(),
            pod_qos_class: String::new(),
            slurm_job_id: job.to_owned(),
            memory_used_bytes: memory,
            memory_peak_bytes: memory,
            first_seen_ms: 0,
            last_seen_ms: 0,
            allocator: None,
        }
    }

    #[test]
    fn owners_are_summed_per_user_and_job_biggest_first_and_a_mig_instance_counts_for_its_gpu() {
        let devices =
            FleetDevices::from_views(vec![device("GPU-a", None), device("MIG-a1", Some("GPU-a"))]);
        let map = owners_by_device(
            &[
                process("GPU-a", "alice", "11", 10),
                process("GPU-a", "alice", "11", 15),
                process("MIG-a1", "bob", "22", 20),
                process("GPU-a", "carol", "", 5),
                process("GPU-a", "dave", "", 1),
            ],
            &devices,
        );
        let names = |uuid: &str| -> Vec<(String, i64)> {
            map[uuid]
                .iter()
                .map(|o| (o.user.clone(), o.memory_bytes))
                .collect()
        };
        assert_eq!(
            names("GPU-a"),
            [
                ("alice".into(), 25),
                ("bob".into(), 20),
                ("carol".into(), 5)
            ]
        );
        assert_eq!(names("MIG-a1"), [("bob".into(), 20)]);
        assert_eq!(map["GPU-a"][0].slurm_job_id, "11");
    }
}
