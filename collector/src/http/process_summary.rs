//! `/api/v1/processes/summary`: what the dashboard's processes view shows
//! of the current processes (memory by user, Slurm job, pod and
//! container, the largest consumers, the largest that report their
//! allocator, the largest jobs that count their tensors), summed here from
//! one read so that a page on 100,000 GPUs is sent tens of kB rather than
//! every process (85 MB) and every job.

use std::collections::{HashMap, HashSet};

use axum::Json;
use axum::extract::State;
use headroom_store::{ProcessView, ProcessesOn};
use serde::Serialize;

use super::AppState;
use super::api::{ApiError, PROCESS_WINDOW_MS};
use super::jobs::{JobView, jobs};

/// Groups listed per owner kind, largest first.
const GROUPS_LISTED: usize = 20;
/// The largest processes listed.
const LARGEST_LISTED: usize = 25;
/// The largest reporting processes listed, whose allocators the view charts.
const REPORTING_LISTED: usize = 6;
/// The largest jobs that count their tensors, each drawn as its bar.
const COUNTING_JOBS_LISTED: usize = 20;
/// A container is named by the first characters of its id, as `docker ps` does.
const CONTAINER_ID_SHOWN: usize = 12;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OwnerGroup {
    /// The user name, Slurm job id, pod uid or short container id.
    pub key: String,
    pub memory_used_bytes: i64,
    pub processes: usize,
    pub devices: usize,
    pub nodes: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OwnerGroups {
    /// How many there are; `largest` lists at most 20 of them.
    pub groups: usize,
    pub largest: Vec<OwnerGroup>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessSummary {
    /// Current processes summed.
    pub processes: usize,
    pub by_user: OwnerGroups,
    pub by_slurm_job: OwnerGroups,
    pub by_pod: OwnerGroups,
    pub by_container: OwnerGroups,
    /// The 25 largest by memory used now.
    pub largest: Vec<ProcessView>,
    /// The 6 largest whose own allocator reports.
    pub largest_reporting: Vec<ProcessView>,
    /// Jobs (as `/api/v1/jobs` gathers them) with a rank that counts its
    /// tensors, and those with none.
    pub jobs_counting: usize,
    pub jobs_silent: usize,
    /// The 20 largest of the counting jobs.
    pub largest_counting_jobs: Vec<JobView>,
}

pub async fn summary(State(state): State<AppState>) -> Result<Json<ProcessSummary>, ApiError> {
    let since = state.clock.now_ms() - PROCESS_WINDOW_MS;
    let processes = state.store.processes(since, ProcessesOn::Fleet).await?;
    Ok(Json(summarize(&processes)))
}

/// `processes` as the store lists them, largest first.
pub fn summarize(processes: &[ProcessView]) -> ProcessSummary {
    let (counting, silent): (Vec<JobView>, Vec<JobView>) = jobs(processes)
        .into_iter()
        .partition(|j| j.breakdown.is_some());
    ProcessSummary {
        processes: processes.len(),
        by_user: group_by(processes, |p| &p.user),
        by_slurm_job: group_by(processes, |p| &p.slurm_job_id),
        by_pod: group_by(processes, |p| &p.pod_uid),
        by_container: group_by(processes, |p| short_container_id(&p.container_id)),
        largest: processes.iter().take(LARGEST_LISTED).cloned().collect(),
        largest_reporting: processes
            .iter()
            .filter(|p| p.allocator.is_some())
            .take(REPORTING_LISTED)
            .cloned()
            .collect(),
        jobs_counting: counting.len(),
        jobs_silent: silent.len(),
        largest_counting_jobs: counting.into_iter().take(COUNTING_JOBS_LISTED).collect(),
    }
}

fn short_container_id(id: &str) -> &str {
    id.char_indices()
        .nth(CONTAINER_ID_SHOWN)
        .map_or(id, |(end, _)| &id[..end])
}

/// Sums processes by `key`, leaving out those with none (no job, no pod);
/// the largest memory first, then by key.
fn group_by<'a>(
    processes: &'a [ProcessView],
    key: impl Fn(&'a ProcessView) -> &'a str,
) -> OwnerGroups {
    struct Sum<'a> {
        memory: i64,
        processes: usize,
        devices: HashSet<&'a str>,
        nodes: HashSet<&'a str>,
    }
    let mut sums: HashMap<&str, Sum<'_>> = HashMap::new();
    for p in processes {
        let k = key(p);
        if k.is_empty() {
            continue;
        }
        let sum = sums.entry(k).or_insert_with(|| Sum {
            memory: 0,
            processes: 0,
            devices: HashSet::new(),
            nodes: HashSet::new(),
        });
        sum.memory = sum.memory.saturating_add(p.memory_used_bytes);
        sum.processes += 1;
        sum.devices.insert(&p.device_uuid);
        sum.nodes.insert(&p.node);
    }
    let groups = sums.len();
    let mut largest: Vec<OwnerGroup> = sums
        .into_iter()
        .map(|(key, sum)| OwnerGroup {
            key: key.to_owned(),
            memory_used_bytes: sum.memory,
            processes: sum.processes,
            devices: sum.devices.len(),
            nodes: sum.nodes.len(),
        })
        .collect();
    largest.sort_by(|a, b| {
        b.memory_used_bytes
            .cmp(&a.memory_used_bytes)
            .then_with(|| a.key.cmp(&b.key))
    });
    largest.truncate(GROUPS_LISTED);
    OwnerGroups { groups, largest }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: i64 = 1 << 30;

    fn process(node: &str, device: &str, user: &str, job: &str, gib: i64) -> ProcessView {
        ProcessView {
            node: node.to_owned(),
            device_uuid: device.to_owned(),
            gpu_index: 0,
            pid: gib,
            start_time_ms: 0,
            name: "python train.py".to_owned(),
            uid: 1000,
            user: user.to_owned(),
            container_id: "0123456789abcdef0123".to_owned(),
            container_runtime: "docker".to_owned(),
            pod_uid: String::new(),
            pod_qos_class: String::new(),
            slurm_job_id: job.to_owned(),
            memory_used_bytes: gib * GIB,
            memory_peak_bytes: gib * GIB,
            first_seen_ms: 0,
            last_seen_ms: 0,
            allocator: None,
        }
    }

    #[test]
    fn owners_sum_their_processes_devices_and_nodes() {
        let processes = [
            process("n1", "GPU-a", "alice", "7", 30),
            process("n1", "GPU-a", "alice", "7", 20),
            process("n2", "GPU-b", "bob", "", 25),
            process("n2", "GPU-c", "alice", "8", 10),
        ];
        let summary = summarize(&processes);
        assert_eq!(summary.processes, 4);
        assert_eq!(summary.by_user.groups, 2);
        assert_eq!(
            summary.by_user.largest[0],
            OwnerGroup {
                key: "alice".to_owned(),
                memory_used_bytes: 60 * GIB,
                processes: 3,
                devices: 2,
                nodes: 2,
            }
        );
        assert_eq!(summary.by_user.largest[1].key, "bob");
        let jobs: Vec<_> = summary
            .by_slurm_job
            .largest
            .iter()
            .map(|g| g.key.as_str())
            .collect();
        assert_eq!(jobs, ["7", "8"], "bob's process is in no job");
        assert_eq!(summary.by_pod.groups, 0, "no process is in a pod");
        assert_eq!(summary.by_container.largest[0].key, "0123456789ab");
        assert_eq!(
            (summary.jobs_counting, summary.jobs_silent),
            (0, 2),
            "jobs 7 and 8; no rank counts its tensors"
        );
    }

    #[test]
    fn lists_are_capped_and_ordered_and_reporting_ones_picked() {
        let mut processes: Vec<_> = (0..30)
            .map(|i| {
                process(
                    "n1",
                    &format!("GPU-{i}"),
                    &format!("user{i:02}"),
                    "",
                    40 - i,
                )
            })
            .collect();
        processes[27].allocator = Some(headroom_store::AllocatorLatest {
            timestamp_ms: 0,
            allocated_bytes: 0,
            reserved_bytes: 0,
            fragmentation_bytes: 0,
            fragmentation_ratio: 0.0,
            inactive_split_bytes: 0,
            peak_allocated_bytes: 0,
            alloc_retries: 0,
            ooms: 0,
            breakdown: None,
        });
        // Two users of equal memory: by name.
        processes.push(process("n1", "GPU-x", "user00b", "", 40));
        let summary = summarize(&processes);
        assert_eq!(summary.by_user.groups, 31);
        assert_eq!(summary.by_user.largest.len(), GROUPS_LISTED);
        let first: Vec<_> = summary.by_user.largest[..3]
            .iter()
            .map(|g| g.key.as_str())
            .collect();
        assert_eq!(first, ["user00", "user00b", "user01"]);
        assert_eq!(summary.largest.len(), LARGEST_LISTED);
        assert_eq!(summary.largest[0].user, "user00");
        let reporting: Vec<_> = summary
            .largest_reporting
            .iter()
            .map(|p| p.user.as_str())
            .collect();
        assert_eq!(
            reporting,
            ["user27"],
            "only processes whose allocator reports"
        );
    }
}
