//! `/api/v1/jobs`: each Slurm job or Kubernetes pod among the current
//! processes, its memory summed over its ranks, where that memory goes for
//! the ranks that count their tensors, and the remedy that fits its largest
//! share.

use std::collections::{BTreeMap, BTreeSet};

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use headroom_common::{Breakdown, Share};
use headroom_rules::remedy;
use headroom_store::{JobReportRow, ProcessView};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::api::{ApiError, OwnerQuery, PROCESS_WINDOW_MS, fleet_or_owners};
use crate::job_reports::JobKind;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobView {
    /// `slurm` or `pod`.
    pub kind: &'static str,
    pub id: String,
    pub users: Vec<String>,
    pub nodes: Vec<String>,
    /// Processes (ranks, one per device they hold memory on).
    pub processes: usize,
    /// Of those, the ones whose client counts their tensors.
    pub reporting: usize,
    /// What the driver says all of them hold.
    pub memory_used_bytes: u64,
    /// Summed over the reporting ranks; `None` when none reports.
    pub breakdown: Option<Breakdown>,
    pub advice: Option<Advice>,
}

/// The largest share of a job's memory and what its owner can do about it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Advice {
    pub share: Share,
    pub bytes: u64,
    pub fraction: f64,
    pub text: String,
}

/// Refuses another filter by name rather than answering every job.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobsQuery {
    /// The Slurm jobs whose id contains this. Only the job id: a job's
    /// ranks all carry it, so every rank of a job found is summed, where a
    /// user or a pod could pick some of its ranks and not the others.
    slurm_job_id: Option<String>,
}

/// The jobs among the current processes; with `slurm_job_id`, the Slurm
/// jobs whose id contains it, read without the rest of the fleet's.
pub async fn list(
    State(state): State<AppState>,
    query: Result<Query<JobsQuery>, QueryRejection>,
) -> Result<Json<Vec<JobView>>, ApiError> {
    let Query(query) = query?;
    let owner_query = OwnerQuery::of_slurm_job(query.slurm_job_id);
    let since = state.clock.now_ms() - PROCESS_WINDOW_MS;
    let on = fleet_or_owners(owner_query.owner_match()?);
    Ok(Json(jobs(&state.store.processes(since, on).await?)))
}

/// A job as its processes are gathered: the view, and who and where.
struct Gathered<'a> {
    view: JobView,
    users: BTreeSet<&'a str>,
    nodes: BTreeSet<&'a str>,
}

/// Groups processes by job: a Slurm job id where there is one, else the
/// pod. Processes in neither are no job's. Largest jobs first.
pub fn jobs(processes: &[ProcessView]) -> Vec<JobView> {
    let mut by_job: BTreeMap<(&'static str, &str), Gathered<'_>> = BTreeMap::new();
    for p in processes {
        let (kind, id) = if !p.slurm_job_id.is_empty() {
            ("slurm", p.slurm_job_id.as_str())
        } else if !p.pod_uid.is_empty() {
            ("pod", p.pod_uid.as_str())
        } else {
            continue;
        };
        let job = by_job.entry((kind, id)).or_insert_with(|| Gathered {
            view: JobView {
                kind,
                id: id.to_owned(),
                users: Vec::new(),
                nodes: Vec::new(),
                processes: 0,
                reporting: 0,
                memory_used_bytes: 0,
                breakdown: None,
                advice: None,
            },
            users: BTreeSet::new(),
            nodes: BTreeSet::new(),
        });
        job.users.insert(p.user.as_str());
        job.nodes.insert(p.node.as_str());
        let view = &mut job.view;
        view.processes += 1;
        view.memory_used_bytes = view
            .memory_used_bytes
            .saturating_add(u64::try_from(p.memory_used_bytes).unwrap_or(0));
        if let Some(b) = p.allocator.as_ref().and_then(|a| a.breakdown) {
            view.reporting += 1;
            match &mut view.breakdown {
                Some(sum) => sum.add(&b),
                None => view.breakdown = Some(b),
            }
        }
    }
    let mut jobs: Vec<JobView> = by_job
        .into_values()
        .map(|job| {
            let mut view = job.view;
            view.users = job.users.into_iter().map(str::to_owned).collect();
            view.nodes = job.nodes.into_iter().map(str::to_owned).collect();
            view.advice = view.breakdown.as_ref().and_then(|b| {
                let (share, bytes, fraction) = b.largest()?;
                Some(Advice {
                    share,
                    bytes,
                    fraction,
                    text: remedy::for_largest_share(b)?,
                })
            });
            view
        })
        .collect();
    jobs.sort_by(|a, b| {
        b.memory_used_bytes
            .cmp(&a.memory_used_bytes)
            .then_with(|| a.id.cmp(&b.id))
    });
    jobs
}

/// `GET /api/v1/jobs/{id}/report`: the memory report of a Slurm job or pod
/// that has ended, merged over the nodes and collectors that watched it.
pub async fn report(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let rows = state.store.job_reports(&id).await?;
    let bodies: Vec<serde_json::Value> = latest_run(&rows)
        .filter_map(|r| serde_json::from_str(&r.report).ok())
        .collect();
    crate::job_reports::merge(&bodies).map(Json).ok_or_else(|| {
        ApiError::NotFound(format!(
            "no report for job {id:?}: a report is written once the job has ended \
             (its node reported `job_report.end_after` without it)"
        ))
    })
}

/// The rows of the job's newest run. A Slurm job id or a pod uid names one
/// run, but a process group's `<pgid>@<node>` comes back once the kernel
/// reuses the pgid: of those, only the rows that overlap the newest (one
/// per collector that held the node meanwhile).
fn latest_run(rows: &[JobReportRow]) -> impl Iterator<Item = &JobReportRow> {
    let newest_start = rows
        .iter()
        .filter(|r| r.kind == JobKind::ProcessGroup.as_str())
        .map(|r| r.started_at_ms)
        .max();
    rows.iter()
        .filter(move |r| newest_start.is_none_or(|start| r.ended_at_ms >= start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_common::composition::AllocatorFigures;
    use headroom_common::{Composition, Dtype, Part};
    use headroom_store::AllocatorLatest;

    const GIB: u64 = 1 << 30;

    fn rank(node: &str, job: &str, pod: &str, counted: bool) -> ProcessView {
        let part = |bytes: u64, dtype| Some(Part { bytes, dtype });
        let breakdown = counted.then(|| {
            Breakdown::of(
                &Composition {
                    weights: part(4 * GIB, Dtype::Bfloat16),
                    gradients: part(4 * GIB, Dtype::Bfloat16),
                    optimizer_state: part(16 * GIB, Dtype::Float32),
                },
                AllocatorFigures {
                    allocated: 30 * GIB,
                    reserved: 31 * GIB,
                    peak_allocated: 30 * GIB,
                },
                Some(32 * GIB),
            )
        });
        ProcessView {
            node: node.to_owned(),
            device_uuid: "GPU-1".to_owned(),
            gpu_index: 0,
            pid: 1,
            start_time_ms: 0,
            name: "python train.py".to_owned(),
            uid: 1000,
            user: "alice".to_owned(),
            container_id: String::new(),
            container_runtime: String::new(),
            pod_uid: pod.to_owned(),
            pod_qos_class: String::new(),
            slurm_job_id: job.to_owned(),
            memory_used_bytes: (32 * GIB) as i64,
            memory_peak_bytes: (32 * GIB) as i64,
            first_seen_ms: 0,
            last_seen_ms: 0,
            allocator: Some(AllocatorLatest {
                timestamp_ms: 0,
                allocated_bytes: (30 * GIB) as i64,
                reserved_bytes: (31 * GIB) as i64,
                fragmentation_bytes: GIB as i64,
                fragmentation_ratio: 1.0 / 31.0,
                inactive_split_bytes: 0,
                peak_allocated_bytes: (30 * GIB) as i64,
                alloc_retries: 0,
                ooms: 0,
                breakdown,
            }),
        }
    }

    #[test]
    fn a_job_sums_its_ranks_and_is_advised_by_its_largest_share() {
        let procs = [
            rank("n1", "42", "", true),
            rank("n2", "42", "", true),
            rank("n2", "42", "", false),
            rank("n3", "", "pod-a", false),
            rank("n3", "", "", true),
        ];
        let jobs = jobs(&procs);
        assert_eq!(jobs.len(), 2, "a process in no job or pod is no job's");
        let slurm = &jobs[0];
        assert_eq!((slurm.kind, slurm.id.as_str()), ("slurm", "42"));
        assert_eq!((slurm.processes, slurm.reporting), (3, 2));
        assert_eq!(slurm.nodes, ["n1", "n2"]);
        assert_eq!(slurm.memory_used_bytes, 96 * GIB);
        let b = slurm.breakdown.unwrap();
        assert_eq!(b.optimizer_state_bytes, Some(32 * GIB));
        let advice = slurm.advice.as_ref().unwrap();
        assert_eq!(advice.share, Share::OptimizerState);
        assert!(
            advice.text.starts_with("Optimizer state is 32 GiB, 50 %"),
            "{}",
            advice.text
        );
        let pod = &jobs[1];
        assert_eq!(
            (pod.kind, pod.breakdown, pod.advice.as_ref()),
            ("pod", None, None)
        );
    }

    #[test]
    fn a_reused_process_group_id_reports_its_newest_run_only() {
        let row = |kind: &str, node: &str, started: i64, ended: i64| JobReportRow {
            kind: kind.into(),
            job_id: "500@n1".into(),
            node: node.into(),
            started_at_ms: started,
            ended_at_ms: ended,
            report: String::new(),
        };
        let rows = [
            row("process_group", "n1", 1_000, 2_000),
            // Another collector's row of the newest run, and the newest.
            row("process_group", "n1", 9_500, 12_000),
            row("process_group", "n1", 10_000, 11_000),
        ];
        let kept: Vec<i64> = latest_run(&rows).map(|r| r.started_at_ms).collect();
        assert_eq!(kept, vec![9_500, 10_000]);
        let slurm = [
            row("slurm", "n1", 1_000, 2_000),
            row("slurm", "n2", 10_000, 11_000),
        ];
        assert_eq!(
            latest_run(&slurm).count(),
            2,
            "a Slurm job's rows are all one run"
        );
    }
}
