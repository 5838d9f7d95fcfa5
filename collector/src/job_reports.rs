//! A memory report for each Slurm job, pod or process group once it ends:
//! per GPU, the
//! job's peak, when it peaked, the headroom it left, what its memory held at
//! the peak (where its ranks report allocator statistics), the alerts it had
//! and a right-sizing suggestion. Kept in the store past sample retention.
//!
//! The tracker folds committed batches as they arrive, one entry per job and
//! node. A job has ended on a node once that node has gone on reporting for
//! `job_report.end_after` of sample time without any of the job's processes (so an
//! agent outage, whose samples arrive late, ends nothing), or, when the node
//! itself went silent, an hour after the job was last seen. What a collector
//! did not see (before it started, or while another collector held the
//! node's stream) is not in its report; `observed_from_ms` says where its
//! view begins.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use headroom_common::{ApproxBytes, Breakdown};
use headroom_rules::remedy;
use headroom_store::alerts::AlertView;
use headroom_store::model::{NodeSession, ProcessSampleRow, StoreBatch};
use serde::Serialize;
use serde_json::{Value, json};

/// Wall time after which a job on a node that stopped reporting ends.
pub const SILENT_NODE_END_MS: i64 = 60 * 60_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    Slurm,
    Pod,
    /// Processes of one process group on one node, in neither a Slurm job
    /// nor a pod: what `torchrun` or a shell started together. Its id is
    /// `<pgid>@<node>`.
    ProcessGroup,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Slurm => "slurm",
            Self::Pod => "pod",
            Self::ProcessGroup => "process_group",
        }
    }
}

/// One GPU (or MIG instance) a job held memory on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuPeak {
    pub gpu: u32,
    pub device_uuid: String,
    pub mig_profile: Option<String>,
    pub total_bytes: u64,
    /// The job's processes on it together, at their highest.
    pub peak_bytes: u64,
    pub peak_at_ms: i64,
    /// What the reporting ranks' memory held at that moment.
    pub composition: Option<Breakdown>,
}

/// A job as one collector watched it on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobOnNode {
    pub kind: JobKind,
    pub job_id: String,
    pub node: String,
    pub users: BTreeSet<String>,
    /// Its processes' pids on the node, for the alerts that named them.
    pub pids: BTreeSet<u32>,
    /// Slurm accounts and pod namespaces its processes ran under.
    pub accounts: BTreeSet<String>,
    pub namespaces: BTreeSet<String>,
    pub observed_from_ms: i64,
    pub last_seen_ms: i64,
    pub gpus: BTreeMap<String, GpuPeak>,
}

/// A job's processes on one device at one sample time: (kind, job id,
/// device id, timestamp).
type Moment = (JobKind, String, i64, i64);

#[derive(Debug, Default)]
pub struct JobTracker {
    jobs: HashMap<(JobKind, String, String), JobOnNode>,
    /// The newest sample time each node has reported.
    node_latest_ms: HashMap<String, i64>,
}

/// The job a process belongs to: its Slurm job where it has one, else its
/// pod (as `/api/v1/jobs` groups them), else its process group on `node`.
fn job_of(p: &ProcessSampleRow, node: &str) -> Option<(JobKind, String)> {
    if !p.slurm_job_id.is_empty() {
        Some((JobKind::Slurm, p.slurm_job_id.clone()))
    } else if !p.pod_uid.is_empty() {
        Some((JobKind::Pod, p.pod_uid.clone()))
    } else if p.process_group > 0 {
        Some((JobKind::ProcessGroup, format!("{}@{node}", p.process_group)))
    } else {
        None
    }
}

impl JobTracker {
    /// Folds a committed batch: each job's memory per GPU, summed over its
    /// processes at each sample time, and the node's progress.
    pub fn observe(&mut self, session: &NodeSession, batch: &StoreBatch) {
        let node = session.node.as_str();
        if let Some(newest) = batch.newest_timestamp_ms() {
            let latest = self.node_latest_ms.entry(node.to_owned()).or_insert(newest);
            *latest = (*latest).max(newest);
        }
        // (job, device, time) → memory and composition of its processes.
        let mut moments: BTreeMap<Moment, (u64, Option<Breakdown>)> = BTreeMap::new();
        for p in &batch.process_samples {
            let Some((kind, id)) = job_of(p, node) else {
                continue;
            };
            // The interval's highest: a spike within a second is what
            // brings a job to out of memory.
            let used = u64::try_from(p.used_max.max(p.used_last)).unwrap_or(0);
            let breakdown = p
                .allocator
                .map(crate::alerts::allocator_observation)
                .and_then(|a| a.breakdown(used));
            let slot = moments
                .entry((kind, id.clone(), p.device_id, p.timestamp_ms))
                .or_default();
            slot.0 += used;
            match (&mut slot.1, breakdown) {
                (Some(sum), Some(b)) => sum.add(&b),
                (slot @ None, Some(b)) => *slot = Some(b),
                (_, None) => {}
            }
            let job = self
                .jobs
                .entry((kind, id.clone(), node.to_owned()))
                .or_insert_with(|| JobOnNode {
                    kind,
                    job_id: id,
                    node: node.to_owned(),
                    users: BTreeSet::new(),
                    pids: BTreeSet::new(),
                    accounts: BTreeSet::new(),
                    namespaces: BTreeSet::new(),
                    observed_from_ms: p.timestamp_ms,
                    last_seen_ms: p.timestamp_ms,
                    gpus: BTreeMap::new(),
                });
            for (set, value) in [
                (&mut job.users, &p.user),
                (&mut job.accounts, &p.slurm_account),
                (&mut job.namespaces, &p.pod_namespace),
            ] {
                if !value.is_empty() && !set.contains(value) {
                    set.insert(value.clone());
                }
            }
            if let Ok(pid) = u32::try_from(p.pid) {
                job.pids.insert(pid);
            }
            job.observed_from_ms = job.observed_from_ms.min(p.timestamp_ms);
            job.last_seen_ms = job.last_seen_ms.max(p.timestamp_ms);
        }
        for ((kind, id, device_id, at_ms), (bytes, composition)) in moments {
            let Some(meta) = session.devices.get(&device_id) else {
                continue;
            };
            let Some(job) = self.jobs.get_mut(&(kind, id, node.to_owned())) else {
                continue;
            };
            let peak = job
                .gpus
                .entry(meta.uuid.clone())
                .or_insert_with(|| GpuPeak {
                    gpu: meta.gpu_index,
                    device_uuid: meta.uuid.clone(),
                    mig_profile: meta.mig_profile.clone(),
                    total_bytes: u64::try_from(meta.memory_total).unwrap_or(0),
                    peak_bytes: 0,
                    peak_at_ms: at_ms,
                    composition: None,
                });
            if bytes > peak.peak_bytes {
                peak.peak_bytes = bytes;
                peak.peak_at_ms = at_ms;
                peak.composition = composition;
            }
        }
    }

    /// Takes out the jobs that have ended by `now_ms`: their node reported
    /// `end_after_ms` of sample time without them, or went silent.
    pub fn take_ended(&mut self, now_ms: i64, end_after_ms: i64) -> Vec<JobOnNode> {
        let latest = &self.node_latest_ms;
        let ended: Vec<(JobKind, String, String)> = self
            .jobs
            .iter()
            .filter(|(_, job)| {
                let node_moved_on = latest
                    .get(&job.node)
                    .is_some_and(|&l| l - job.last_seen_ms >= end_after_ms);
                node_moved_on || now_ms - job.last_seen_ms >= SILENT_NODE_END_MS
            })
            .map(|(key, _)| key.clone())
            .collect();
        let mut out: Vec<JobOnNode> = ended
            .iter()
            .filter_map(|key| self.jobs.remove(key))
            .collect();
        out.sort_by(|a, b| (a.kind, &a.job_id, &a.node).cmp(&(b.kind, &b.job_id, &b.node)));
        out
    }

    /// Returns ended jobs whose reports could not be written yet.
    pub fn put_back(&mut self, ended: Vec<JobOnNode>) {
        for job in ended {
            let key = (job.kind, job.job_id.clone(), job.node.clone());
            self.jobs.entry(key).or_insert(job);
        }
    }

    /// The jobs being watched now, for the tests to look into.
    #[cfg(test)]
    fn running(&self, job_id: &str) -> Vec<JobOnNode> {
        let mut out: Vec<JobOnNode> = self
            .jobs
            .values()
            .filter(|j| j.job_id == job_id)
            .cloned()
            .collect();
        out.sort_by(|a, b| a.node.cmp(&b.node));
        out
    }
}

/// What to change, from how close to the GPU's memory the job came and,
/// where its ranks report, what held most of it at the peak.
pub fn suggestion(peak: &GpuPeak) -> String {
    if peak.total_bytes == 0 {
        return "the GPU's size is unknown".to_owned();
    }
    let fraction = peak.peak_bytes as f64 / peak.total_bytes as f64;
    let figure = format!(
        "peaked at {} of {}",
        ApproxBytes(peak.peak_bytes),
        ApproxBytes(peak.total_bytes)
    );
    if fraction >= 0.95 {
        let remedy = peak
            .composition
            .as_ref()
            .and_then(remedy::for_largest_share)
            .unwrap_or_else(|| {
                "activation checkpointing or a smaller micro-batch cuts the peak".to_owned()
            });
        format!("{figure}, within 5 % of out of memory: {remedy}")
    } else if fraction <= 0.45 {
        format!(
            "{figure}: room for a 2× batch, or the job fits a GPU (or MIG slice) half this size"
        )
    } else {
        format!(
            "{figure}: {} of headroom at the peak",
            ApproxBytes(peak.total_bytes - peak.peak_bytes)
        )
    }
}

/// Whether `alert` concerns `job`: it names the job, or it is about a GPU
/// the job held and was active while the job was seen.
fn concerns(alert: &AlertView, job: &JobOnNode) -> bool {
    let label = |k: &str| alert.labels.get(k).and_then(Value::as_str);
    if label("node") != Some(job.node.as_str()) {
        return false;
    }
    let overlaps = alert.started_at_ms <= job.last_seen_ms
        && alert
            .resolved_at_ms
            .is_none_or(|end| end >= job.observed_from_ms);
    let named = match job.kind {
        JobKind::Slurm => label("job") == Some(job.job_id.as_str()),
        JobKind::Pod => label("pod") == Some(job.job_id.as_str()),
        // A pid is reused: one of the group's, while the group ran.
        JobKind::ProcessGroup => {
            overlaps
                && label("job").is_none()
                && label("pod").is_none()
                && label("pid")
                    .and_then(|p| p.parse::<u32>().ok())
                    .is_some_and(|pid| job.pids.contains(&pid))
        }
    };
    let on_its_gpu =
        label("device_uuid").is_some_and(|u| job.gpus.contains_key(u)) && label("pid").is_none();
    named || (on_its_gpu && overlaps)
}

/// The labels a job report's routes match (before `rule`, `severity` and
/// `team`): its node, its id as `job` or `pod`, and its user, account and
/// namespace where it had exactly one of each, as an alert about one of its
/// processes would carry them.
pub fn owner_labels(job: &JobOnNode) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    labels.insert("node".to_owned(), job.node.clone());
    match job.kind {
        JobKind::Slurm => {
            labels.insert("job".to_owned(), job.job_id.clone());
        }
        JobKind::Pod => {
            labels.insert("pod".to_owned(), job.job_id.clone());
        }
        // Its id is no alert's label; its user and node route it.
        JobKind::ProcessGroup => {}
    }
    for (label, set) in [
        ("user", &job.users),
        ("account", &job.accounts),
        ("namespace", &job.namespaces),
    ] {
        if let (1, Some(only)) = (set.len(), set.first()) {
            labels.insert(label.to_owned(), only.clone());
        }
    }
    labels
}

/// The stored body of one job's report on one node (`docs/job-reports.md`).
pub fn report_body(job: &JobOnNode, alerts: &[AlertView], ended_at_ms: Option<i64>) -> Value {
    let gpus: Vec<Value> = job
        .gpus
        .values()
        .map(|g| {
            json!({
                "node": job.node,
                "gpu": g.gpu,
                "device_uuid": g.device_uuid,
                "mig_profile": g.mig_profile,
                "total_bytes": g.total_bytes,
                "peak_bytes": g.peak_bytes,
                "peak_at_ms": g.peak_at_ms,
                "headroom_bytes": g.total_bytes.saturating_sub(g.peak_bytes),
                "peak_fraction": if g.total_bytes > 0 { g.peak_bytes as f64 / g.total_bytes as f64 } else { 0.0 },
                "composition": g.composition,
                "suggestion": suggestion(g),
            })
        })
        .collect();
    let alerts: Vec<Value> = alerts
        .iter()
        .filter(|a| concerns(a, job))
        .map(|a| {
            json!({
                "fingerprint": a.fingerprint,
                "rule": a.rule,
                "severity": a.severity,
                "state": a.state,
                "summary": a.summary,
                "fired_at_ms": a.fired_at_ms,
                "resolved_at_ms": a.resolved_at_ms,
            })
        })
        .collect();
    json!({
        "kind": job.kind,
        "job_id": job.job_id,
        "users": job.users,
        "accounts": job.accounts,
        "namespaces": job.namespaces,
        "nodes": [job.node],
        "observed_from_ms": job.observed_from_ms,
        "last_seen_ms": job.last_seen_ms,
        "ended_at_ms": ended_at_ms,
        "gpus": gpus,
        "alerts": alerts,
    })
}

/// One report from a job's rows (one per node and collector): GPUs side by
/// side, each GPU once at its highest peak, alerts once each.
pub fn merge(bodies: &[Value]) -> Option<Value> {
    let first = bodies.first()?;
    let mut users = BTreeSet::new();
    let mut accounts = BTreeSet::new();
    let mut namespaces = BTreeSet::new();
    let mut nodes = BTreeSet::new();
    let mut gpus: BTreeMap<(String, String), Value> = BTreeMap::new();
    let mut alerts: BTreeMap<String, Value> = BTreeMap::new();
    let mut observed_from = i64::MAX;
    let mut last_seen = i64::MIN;
    let mut ended: Option<i64> = Some(i64::MIN);
    for body in bodies {
        let strings = |k: &str| -> Vec<String> {
            body[k]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        users.extend(strings("users"));
        accounts.extend(strings("accounts"));
        namespaces.extend(strings("namespaces"));
        nodes.extend(strings("nodes"));
        observed_from = observed_from.min(body["observed_from_ms"].as_i64().unwrap_or(i64::MAX));
        last_seen = last_seen.max(body["last_seen_ms"].as_i64().unwrap_or(i64::MIN));
        // Still running on one node: the job has not ended.
        ended = match (ended, body["ended_at_ms"].as_i64()) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
        for gpu in body["gpus"].as_array().into_iter().flatten() {
            let key = (
                gpu["node"].as_str().unwrap_or_default().to_owned(),
                gpu["device_uuid"].as_str().unwrap_or_default().to_owned(),
            );
            let higher = gpus
                .get(&key)
                .is_none_or(|kept| gpu["peak_bytes"].as_u64() > kept["peak_bytes"].as_u64());
            if higher {
                gpus.insert(key, gpu.clone());
            }
        }
        for alert in body["alerts"].as_array().into_iter().flatten() {
            let key = alert["fingerprint"].as_str().unwrap_or_default().to_owned();
            alerts.entry(key).or_insert_with(|| alert.clone());
        }
    }
    let mut gpus: Vec<Value> = gpus.into_values().collect();
    gpus.sort_by(|a, b| {
        (a["node"].as_str(), a["gpu"].as_u64()).cmp(&(b["node"].as_str(), b["gpu"].as_u64()))
    });
    Some(json!({
        "kind": first["kind"],
        "job_id": first["job_id"],
        "users": users,
        "accounts": accounts,
        "namespaces": namespaces,
        "nodes": nodes,
        "observed_from_ms": observed_from,
        "last_seen_ms": last_seen,
        "ended_at_ms": ended,
        "gpus": gpus,
        "alerts": alerts.into_values().collect::<Vec<_>>(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_store::model::{DeviceMeta, GpuSampleRow};

    const GIB: i64 = 1 << 30;
    const T0: i64 = 1_800_000_000_000;
    const END_AFTER_MS: i64 = 2 * 60_000;

    fn session(node: &str) -> NodeSession {
        let meta = |uuid: &str, gpu_index: u32| DeviceMeta {
            uuid: uuid.into(),
            gpu_index,
            mig_profile: None,
            parent_id: None,
            memory_total: 80 * GIB,
        };
        NodeSession {
            node_id: 1,
            node: node.into(),
            boot_id: "b".into(),
            committed_seq: 0,
            durable_seq: 0,
            device_ids: HashMap::new(),
            devices: HashMap::from([(10, meta("GPU-a", 0)), (11, meta("GPU-b", 1))]),
        }
    }

    fn process(device_id: i64, at_ms: i64, pid: i64, job: &str, gib: i64) -> ProcessSampleRow {
        ProcessSampleRow {
            device_id,
            timestamp_ms: at_ms,
            pid,
            used_last: gib * GIB,
            used_max: gib * GIB,
            user: "carol".into(),
            slurm_job_id: job.into(),
            ..ProcessSampleRow::default()
        }
    }

    /// A batch at `at_ms`: the GPUs report, and these processes with them.
    fn batch(at_ms: i64, processes: Vec<ProcessSampleRow>) -> StoreBatch {
        StoreBatch {
            gpu_samples: vec![GpuSampleRow {
                device_id: 10,
                timestamp_ms: at_ms,
                ..GpuSampleRow::default()
            }],
            process_samples: processes,
            ..StoreBatch::default()
        }
    }

    #[test]
    fn ranks_on_one_gpu_add_up_and_the_highest_moment_is_kept() {
        let s = session("n1");
        let mut t = JobTracker::default();
        t.observe(
            &s,
            &batch(
                T0,
                vec![process(10, T0, 1, "42", 30), process(10, T0, 2, "42", 20)],
            ),
        );
        t.observe(
            &s,
            &batch(
                T0 + 1000,
                vec![
                    process(10, T0 + 1000, 1, "42", 60),
                    process(10, T0 + 1000, 2, "42", 10),
                ],
            ),
        );
        t.observe(
            &s,
            &batch(
                T0 + 2000,
                vec![
                    process(10, T0 + 2000, 1, "42", 40),
                    process(11, T0 + 2000, 3, "42", 5),
                ],
            ),
        );
        let running = t.running("42");
        let gpus = &running[0].gpus;
        assert_eq!(
            gpus["GPU-a"].peak_bytes,
            70 * GIB as u64,
            "60 + 10 at one moment"
        );
        assert_eq!(gpus["GPU-a"].peak_at_ms, T0 + 1000);
        assert_eq!(gpus["GPU-b"].peak_bytes, 5 * GIB as u64);
        assert_eq!(running[0].observed_from_ms, T0);
        assert_eq!(running[0].last_seen_ms, T0 + 2000);
        assert_eq!(running[0].users.iter().collect::<Vec<_>>(), vec!["carol"]);
    }

    #[test]
    fn a_job_ends_when_its_node_goes_on_without_it_not_when_the_node_is_late() {
        let s = session("n1");
        let mut t = JobTracker::default();
        t.observe(&s, &batch(T0, vec![process(10, T0, 1, "42", 30)]));
        // The agent is away for ten minutes of wall time: nothing ends.
        assert!(t.take_ended(T0 + 10 * 60_000, END_AFTER_MS).is_empty());
        // Its samples arrive: the node reported a minute without the job.
        t.observe(&s, &batch(T0 + 60_000, vec![]));
        assert!(t.take_ended(T0 + 10 * 60_000, END_AFTER_MS).is_empty());
        // Two minutes without it: ended, once.
        t.observe(&s, &batch(T0 + END_AFTER_MS, vec![]));
        let ended = t.take_ended(T0 + 10 * 60_000, END_AFTER_MS);
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].job_id, "42");
        assert!(t.take_ended(T0 + 10 * 60_000, END_AFTER_MS).is_empty());
        // A node that never reports again ends its jobs after an hour.
        let mut t = JobTracker::default();
        t.observe(&s, &batch(T0, vec![process(10, T0, 1, "43", 30)]));
        assert!(
            t.take_ended(T0 + SILENT_NODE_END_MS - 1, END_AFTER_MS)
                .is_empty()
        );
        assert_eq!(t.take_ended(T0 + SILENT_NODE_END_MS, END_AFTER_MS).len(), 1);
    }

    #[test]
    fn processes_of_no_job_are_not_reported_and_pods_are_jobs() {
        let s = session("n1");
        let mut t = JobTracker::default();
        let mut pod = process(10, T0, 1, "", 3);
        pod.pod_uid = "0f0e-pod".into();
        t.observe(&s, &batch(T0, vec![process(10, T0, 2, "", 9), pod]));
        assert_eq!(t.jobs.len(), 1);
        assert_eq!(t.running("0f0e-pod")[0].kind, JobKind::Pod);
    }

    #[test]
    fn outside_slurm_and_pods_a_process_group_is_the_job() {
        let s = session("n1");
        let mut t = JobTracker::default();
        // torchrun's two workers share its group; a Slurm rank's group does
        // not make it a second job.
        let worker = |pid, gib| ProcessSampleRow {
            process_group: 500,
            ..process(10, T0, pid, "", gib)
        };
        let rank = ProcessSampleRow {
            process_group: 600,
            ..process(10, T0, 7, "77", 5)
        };
        t.observe(&s, &batch(T0, vec![worker(501, 10), worker(502, 12), rank]));
        let group = t.running("500@n1");
        assert_eq!(group.len(), 1);
        assert_eq!(group[0].kind, JobKind::ProcessGroup);
        assert_eq!(group[0].pids, BTreeSet::from([501, 502]));
        assert_eq!(group[0].gpus["GPU-a"].peak_bytes, 22 * GIB as u64);
        assert!(t.running("600@n1").is_empty());
        // Its report's routes match its node and user, not a job label.
        let labels = owner_labels(&group[0]);
        assert_eq!(labels.get("user").map(String::as_str), Some("carol"));
        assert!(!labels.contains_key("job") && !labels.contains_key("pod"));
    }

    fn peak(peak_gib: f64) -> GpuPeak {
        GpuPeak {
            gpu: 0,
            device_uuid: "GPU-a".into(),
            mig_profile: None,
            total_bytes: 80 * GIB as u64,
            peak_bytes: (peak_gib * GIB as f64) as u64,
            peak_at_ms: T0,
            composition: None,
        }
    }

    #[test]
    fn the_suggestion_follows_how_close_the_peak_came() {
        let near = suggestion(&peak(79.5));
        assert!(
            near.starts_with("peaked at 79.5 GiB of 80 GiB, within 5 % of out of memory"),
            "{near}"
        );
        assert!(
            near.contains("activation checkpointing or a smaller micro-batch"),
            "{near}"
        );
        let small = suggestion(&peak(31.0));
        assert!(small.contains("room for a 2× batch"), "{small}");
        let fits = suggestion(&peak(60.0));
        assert!(fits.contains("20 GiB of headroom"), "{fits}");
    }

    #[test]
    fn a_report_merges_nodes_and_keeps_each_gpu_at_its_highest() {
        let s = session("n1");
        let mut a = JobTracker::default();
        a.observe(&s, &batch(T0, vec![process(10, T0, 1, "42", 30)]));
        let mut b = JobTracker::default();
        b.observe(
            &session("n2"),
            &batch(T0, vec![process(10, T0, 1, "42", 50)]),
        );
        let mut later = JobTracker::default();
        later.observe(
            &s,
            &batch(T0 + 5000, vec![process(10, T0 + 5000, 1, "42", 40)]),
        );
        let bodies: Vec<Value> = [&a, &b, &later]
            .iter()
            .map(|t| report_body(&t.running("42")[0], &[], Some(T0 + 9000)))
            .collect();
        let merged = merge(&bodies).unwrap();
        assert_eq!(merged["nodes"], json!(["n1", "n2"]));
        let peaks: Vec<(String, u64)> = merged["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["node"].as_str().unwrap().to_owned(),
                    g["peak_bytes"].as_u64().unwrap() / GIB as u64,
                )
            })
            .collect();
        assert_eq!(peaks, vec![("n1".to_owned(), 40), ("n2".to_owned(), 50)]);
        assert_eq!(merged["ended_at_ms"], T0 + 9000);
        assert!(merge(&[]).is_none());
    }
}
