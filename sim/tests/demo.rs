//! The shipped demo fleet shows everything Headroom is meant to catch.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;

use headroom_sim::{GpuState, ProcessState, Scenario};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn all_processes(gpu: &GpuState) -> impl Iterator<Item = &ProcessState> {
    gpu.processes
        .iter()
        .chain(gpu.mig.iter().flat_map(|m| m.processes.iter()))
}

fn find_process(demo: &Scenario, pid: u32, t: f64) -> Option<ProcessState> {
    demo.nodes().iter().find_map(|node| {
        node.state_at(t)
            .iter()
            .flat_map(|gpu| all_processes(gpu).cloned().collect::<Vec<_>>())
            .find(|p| p.pid == pid)
    })
}

#[test]
fn demo_is_a_realistic_fleet() {
    let demo = Scenario::demo();
    assert!(demo.nodes().len() >= 4);
    let inventory: Vec<_> = demo.nodes().iter().flat_map(|n| n.inventory()).collect();
    assert!(inventory.len() >= 32, "{} GPUs", inventory.len());
    assert!(demo.nodes().iter().all(|n| n.gpu_count() >= 8));
    for model in ["H100", "A100", "L40S"] {
        assert!(
            inventory.iter().any(|g| g.name.contains(model)),
            "no {model}"
        );
    }
    assert_eq!(
        inventory.iter().filter(|g| !g.mig.is_empty()).count(),
        1,
        "one MIG GPU"
    );
    let uuids: HashSet<&str> = inventory.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(
        uuids.len(),
        inventory.len(),
        "UUIDs are unique across the fleet"
    );
}

#[test]
fn demo_has_idle_gpus_and_stays_within_limits() {
    let demo = Scenario::demo();
    let mut idle_everywhere: Option<HashSet<String>> = None;
    for t in [0.0, 300.0, 600.0, 1_800.0, 3_600.0, 7_200.0] {
        let states: Vec<GpuState> = demo.nodes().iter().flat_map(|n| n.state_at(t)).collect();
        for gpu in &states {
            assert!(gpu.memory_used <= gpu.memory_total - gpu.memory_reserved);
            for mig in &gpu.mig {
                assert!(mig.memory_used <= mig.memory_total);
            }
        }
        let idle: HashSet<String> = states
            .iter()
            .filter(|g| all_processes(g).next().is_none())
            .map(|g| g.uuid.clone())
            .collect();
        idle_everywhere = Some(match idle_everywhere {
            None => idle,
            Some(before) => before.intersection(&idle).cloned().collect(),
        });
    }
    let idle = idle_everywhere.unwrap();
    assert!(idle.len() >= 4, "{} GPUs are idle throughout", idle.len());
}

#[test]
fn demo_covers_kubernetes_slurm_unattributed_memory_and_pcie() {
    let demo = Scenario::demo();
    let states: Vec<GpuState> = demo
        .nodes()
        .iter()
        .flat_map(|n| n.state_at(400.0))
        .collect();
    let processes: Vec<&ProcessState> = states.iter().flat_map(all_processes).collect();
    assert!(
        processes
            .iter()
            .any(|p| !p.pod_uid.is_empty() && !p.container_id.is_empty())
    );
    assert!(processes.iter().any(|p| !p.slurm_job_id.is_empty()));
    assert!(processes.iter().any(|p| &*p.user != "root" && p.uid != 0));
    assert!(
        states.iter().any(|g| {
            let attributed: u64 = all_processes(g).map(|p| p.memory_used).sum();
            g.memory_used >= attributed + GIB
        }),
        "some GPU holds memory no process accounts for"
    );
    assert!(
        states
            .iter()
            .any(|g| g.pcie_tx_bytes_per_s > 0 && g.pcie_rx_bytes_per_s > 0)
    );
}

#[test]
fn demo_multi_gpu_job_spans_a_whole_node() {
    let demo = Scenario::demo();
    let node = demo.node("gpu-node-01").unwrap();
    let states = node.state_at(600.0);
    assert_eq!(states.len(), 8);
    let jobs: HashSet<&str> = states
        .iter()
        .map(|g| &*g.processes[0].slurm_job_id)
        .collect();
    assert_eq!(jobs.len(), 1, "one Slurm job on all eight GPUs");
}

#[test]
fn demo_mig_gpu_has_processes_in_two_instances() {
    let demo = Scenario::demo();
    let (node, index) = demo
        .nodes()
        .iter()
        .find_map(|n| {
            n.inventory()
                .iter()
                .position(|g| !g.mig.is_empty())
                .map(|i| (n, i))
        })
        .unwrap();
    let gpu = &node.state_at(120.0)[index];
    assert!(gpu.processes.is_empty());
    assert_eq!(gpu.mig.len(), 3);
    assert_eq!(
        gpu.mig.iter().filter(|m| !m.processes.is_empty()).count(),
        2
    );
    let in_instances: u64 = gpu.mig.iter().map(|m| m.memory_used).sum();
    assert!(gpu.memory_used >= in_instances && in_instances > 0);
}

#[test]
fn demo_leak_is_noticeable_within_an_hour() {
    let demo = Scenario::demo();
    let start = find_process(&demo, 73410, 0.0).unwrap().memory_used;
    let hour = find_process(&demo, 73410, 3_600.0).unwrap().memory_used;
    assert_eq!(start, 50 * GIB);
    assert_eq!(hour - start, 60 * 64 * MIB);

    let step_start = find_process(&demo, 73522, 0.0).unwrap().memory_used;
    let step_hour = find_process(&demo, 73522, 3_600.0).unwrap().memory_used;
    assert_eq!(step_hour - step_start, 6 * GIB);
}

#[test]
fn demo_oom_job_dies_within_minutes_and_restarts() {
    let demo = Scenario::demo();
    let pid = 73688;
    let timeline: Vec<Option<ProcessState>> = (0..=600)
        .map(|s| find_process(&demo, pid, f64::from(s)))
        .collect();
    let death = timeline.iter().position(Option::is_none).unwrap();
    assert!((120..=420).contains(&death), "OOM after {death} s");
    let rebirth = death + timeline[death..].iter().position(Option::is_some).unwrap();
    assert!(
        rebirth - death >= 55 && rebirth - death <= 65,
        "restart_after_s = 60"
    );
    let first = timeline[0].as_ref().unwrap();
    let second = timeline[rebirth].as_ref().unwrap();
    assert_eq!(first.start_time_ms, 0);
    assert!(second.start_time_ms >= 1_000 * (rebirth as u64 - 1));
    let restarted_at = second.start_time_ms as f64 / 1000.0;
    let fresh = find_process(&demo, pid, restarted_at).unwrap();
    assert_eq!(
        fresh.memory_used,
        60 * GIB,
        "starts over from its initial footprint"
    );
}

#[test]
fn demo_jobs_come_and_go() {
    let demo = Scenario::demo();
    assert!(find_process(&demo, 88391, 599.0).is_none());
    assert_eq!(
        find_process(&demo, 88391, 600.0).unwrap().start_time_ms,
        600_000
    );
    assert!(find_process(&demo, 88230, 1_799.0).is_some());
    assert!(find_process(&demo, 88230, 1_800.0).is_none());
    assert!(
        find_process(&demo, 89120, 200.0).is_some(),
        "second rank of the 2-GPU job"
    );
}
