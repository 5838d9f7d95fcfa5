//! Evaluating scenarios through the public API.
#![allow(clippy::unwrap_used)]

use headroom_sim::{GpuState, NodeSpec, ProcessState, Scenario};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn scenario(text: &str) -> Scenario {
    Scenario::from_toml_str(text).unwrap_or_else(|err| panic!("{err}"))
}

fn only_node(scenario: &Scenario) -> &NodeSpec {
    assert_eq!(scenario.nodes().len(), 1);
    &scenario.nodes()[0]
}

fn gpu_at(node: &NodeSpec, index: usize, t: f64) -> GpuState {
    node.state_at(t).swap_remove(index)
}

fn process(gpu: &GpuState, pid: u32) -> Option<&ProcessState> {
    gpu.processes.iter().find(|p| p.pid == pid)
}

const ONE_GPU: &str = r#"
seed = 7
[[node]]
name = "n1"
[[node.gpu]]
model = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
reserved = "1GiB"
unattributed = "2GiB"
pcie_tx = "2GB/s"
[[node.gpu.process]]
pid = 100
name = "python leak.py"
user = "alice"
uid = 1001
container_id = "abc"
pod_uid = "pod-1"
slurm_job_id = "42"
start_s = 60
end_s = 600
memory = { shape = "linear_leak", base = "10GiB", rate_per_min = "64MiB" }
[[node.gpu.process]]
pid = 200
name = "python steady.py"
memory = { shape = "steady", level = "5GiB" }
"#;

#[test]
fn same_instant_gives_same_readings() {
    let demo = Scenario::demo();
    for node in demo.nodes() {
        for t in [0.0, 0.05, 1.234, 59.9, 3_600.0, 86_400.5] {
            assert_eq!(node.state_at(t), node.state_at(t), "{} at {t}", node.name);
        }
    }
    // A separately parsed copy agrees too: nothing depends on process state.
    let again = Scenario::demo();
    assert_eq!(
        demo.nodes()[1].state_at(777.7),
        again.nodes()[1].state_at(777.7)
    );
}

#[test]
fn gpu_memory_adds_processes_and_unattributed_but_not_reserved() {
    let s = scenario(ONE_GPU);
    let node = only_node(&s);
    let gpu = gpu_at(node, 0, 120.0);
    let leak = process(&gpu, 100).unwrap();
    assert_eq!(
        leak.memory_used,
        10 * GIB + 64 * MIB,
        "one minute after its start"
    );
    assert_eq!(process(&gpu, 200).unwrap().memory_used, 5 * GIB);
    assert_eq!(gpu.memory_used, 10 * GIB + 64 * MIB + 5 * GIB + 2 * GIB);
    assert_eq!(gpu.memory_reserved, GIB);
    assert_eq!(gpu.memory_total, 80 * GIB);
}

#[test]
fn process_metadata_and_lifetime() {
    let s = scenario(ONE_GPU);
    let node = only_node(&s);
    let before = gpu_at(node, 0, 59.9);
    assert!(process(&before, 100).is_none(), "not started yet");
    assert_eq!(before.memory_used, 7 * GIB);

    let during = gpu_at(node, 0, 60.0);
    assert_eq!(
        process(&during, 100).unwrap(),
        &ProcessState {
            pid: 100,
            start_time_ms: 60_000,
            name: "python leak.py".into(),
            user: "alice".into(),
            uid: 1001,
            container_id: "abc".into(),
            pod_uid: "pod-1".into(),
            pod_namespace: "".into(),
            slurm_job_id: "42".into(),
            slurm_account: "".into(),
            process_group: 100,
            pod_labels: std::sync::Arc::from([]),
            memory_used: 10 * GIB,
            allocator: None,
        }
    );
    let defaults = process(&during, 200).unwrap();
    assert_eq!(
        (&*defaults.user, defaults.uid, defaults.start_time_ms),
        ("root", 0, 0)
    );
    assert!(defaults.container_id.is_empty() && defaults.slurm_job_id.is_empty());

    assert!(process(&gpu_at(node, 0, 599.9), 100).is_some());
    assert!(
        process(&gpu_at(node, 0, 600.0), 100).is_none(),
        "exited at end_s"
    );
    assert!(
        node.state_at(-1.0)[0].processes.is_empty(),
        "nothing before t = 0"
    );
}

#[test]
fn used_memory_is_clamped_below_total_minus_reserved() {
    let s = scenario(
        &ONE_GPU
            .replace("end_s = 600\n", "")
            .replace("64MiB", "1GiB"),
    );
    let node = only_node(&s);
    let gpu = gpu_at(node, 0, 100_000.0);
    assert!(
        process(&gpu, 100).unwrap().memory_used > 80 * GIB,
        "the leak itself is unbounded"
    );
    assert_eq!(
        gpu.memory_used,
        79 * GIB,
        "80 GiB total minus 1 GiB reserved"
    );
}

#[test]
fn utilization_follows_activity() {
    let s = scenario(ONE_GPU);
    let node = only_node(&s);
    let s_idle = scenario(&ONE_GPU.replace(
        "[[node.gpu.process]]\npid = 200\nname = \"python steady.py\"\nmemory = { shape = \"steady\", level = \"5GiB\" }\n",
        "",
    ));
    for tick in 0..200 {
        let t = f64::from(tick) * 0.1;
        let busy = gpu_at(node, 0, t).utilization_pct;
        assert!(
            (55..=65).contains(&busy),
            "default 60 ± 5, got {busy} at {t}"
        );
        assert_eq!(
            gpu_at(only_node(&s_idle), 0, t).utilization_pct,
            0,
            "idle at {t}"
        );
    }

    let pinned = scenario(&ONE_GPU.replace("pcie_tx", "utilization = 98\npcie_tx"));
    for tick in 0..200 {
        let busy = gpu_at(only_node(&pinned), 0, f64::from(tick)).utilization_pct;
        assert!((93..=100).contains(&busy), "98 ± 5 clamped, got {busy}");
    }
}

#[test]
fn pcie_rates_swing_around_their_mean() {
    let s = scenario(ONE_GPU);
    let node = only_node(&s);
    let mean = 2_000_000_000.0;
    let samples: Vec<u64> = (0..600)
        .map(|tick| gpu_at(node, 0, f64::from(tick) * 0.1).pcie_tx_bytes_per_s)
        .collect();
    assert!(
        samples
            .iter()
            .all(|&r| (r as f64) >= 0.7 * mean - 1.0 && (r as f64) <= 1.3 * mean + 1.0)
    );
    let average = samples.iter().sum::<u64>() as f64 / samples.len() as f64;
    assert!((average - mean).abs() < 0.02 * mean, "average {average}");
    assert!(samples.iter().max() > samples.iter().min());
    assert!(samples.iter().all(|&r| r > 0));
    assert_eq!(
        gpu_at(node, 0, 5.0).pcie_rx_bytes_per_s,
        0,
        "no mean, no traffic"
    );
}

#[test]
fn jitter_is_bounded_and_deterministic() {
    let s = scenario(
        r#"
        [[node]]
        name = "n"
        [[node.gpu]]
        model = "L40S"
        memory_total = "48GiB"
        [[node.gpu.process]]
        pid = 1
        name = "p"
        memory = { shape = "steady", level = "10GiB", jitter = "1GiB" }
        "#,
    );
    let node = only_node(&s);
    let values: Vec<u64> = (0..500)
        .map(|tick| gpu_at(node, 0, f64::from(tick) * 0.1).processes[0].memory_used)
        .collect();
    assert!(values.iter().all(|v| (9 * GIB..=11 * GIB).contains(v)));
    assert!(values.iter().any(|&v| v != values[0]), "it does wobble");
    // Within one 100 ms tick the value holds still.
    assert_eq!(
        gpu_at(node, 0, 3.01).processes[0].memory_used,
        gpu_at(node, 0, 3.09).processes[0].memory_used
    );
}

const OOM: &str = r#"
[[node]]
name = "oom-node"
[[node.gpu]]
model = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
reserved = "2GiB"
unattributed = "2GiB"
[[node.gpu.process]]
pid = 10
name = "python finetune.py"
start_s = 30
memory = { shape = "ramp_to_oom", start = "60GiB", rate_per_min = "4GiB", restart_after_s = 60 }
[[node.gpu.process]]
pid = 11
name = "python sidecar.py"
memory = { shape = "steady", level = "4GiB" }
"#;

#[test]
fn ramp_to_oom_disappears_when_the_device_fills_and_restarts_later() {
    let s = scenario(OOM);
    let node = only_node(&s);
    // Room for it: 80 - 2 reserved - 2 unattributed - 4 sidecar = 72 GiB, so
    // it lives 12 GiB / 4 GiB/min = 180 s, then is dead for 60 s.
    let first = gpu_at(node, 0, 30.0);
    let p = process(&first, 10).unwrap();
    assert_eq!((p.memory_used, p.start_time_ms), (60 * GIB, 30_000));

    let nearly_full = gpu_at(node, 0, 30.0 + 179.0);
    let p = process(&nearly_full, 10).unwrap();
    assert!(p.memory_used > 71 * GIB && p.memory_used < 72 * GIB);
    assert!(nearly_full.memory_used <= 78 * GIB);

    for t in [30.0 + 180.0, 30.0 + 200.0, 30.0 + 239.9] {
        let dead = gpu_at(node, 0, t);
        assert!(process(&dead, 10).is_none(), "dead at {t}");
        assert_eq!(
            dead.memory_used,
            4 * GIB + 2 * GIB,
            "its memory is freed at {t}"
        );
    }

    let reborn = gpu_at(node, 0, 30.0 + 240.0);
    let p = process(&reborn, 10).unwrap();
    assert_eq!(p.memory_used, 60 * GIB);
    assert_eq!(p.start_time_ms, 270_000, "a new incarnation");
    let later = gpu_at(node, 0, 30.0 + 240.0 + 90.0);
    assert_eq!(process(&later, 10).unwrap().start_time_ms, 270_000);
    assert_eq!(process(&later, 10).unwrap().memory_used, 66 * GIB);

    let third = gpu_at(node, 0, 30.0 + 480.0 + 1.0);
    assert_eq!(process(&third, 10).unwrap().start_time_ms, 510_000);
}

#[test]
fn mig_instances_hold_their_processes() {
    let s = scenario(
        r#"
        [[node]]
        name = "mig-node"
        [[node.gpu]]
        model = "NVIDIA A100-SXM4-80GB"
        memory_total = "80GiB"
        reserved = "512MiB"
        unattributed = "1GiB"
        [[node.gpu.mig]]
        profile = "3g.40gb"
        memory_total = "40GiB"
        [[node.gpu.mig.process]]
        pid = 1
        name = "jupyter"
        memory = { shape = "steady", level = "20GiB" }
        [[node.gpu.mig.process]]
        pid = 2
        name = "notebook"
        memory = { shape = "steady", level = "5GiB" }
        [[node.gpu.mig]]
        profile = "2g.20gb"
        memory_total = "20GiB"
        compute_instance_id = 1
        [[node.gpu.mig.process]]
        pid = 3
        name = "bert"
        memory = { shape = "sawtooth", low = "2GiB", high = "10GiB", period_s = 100 }
        [[node.gpu.mig]]
        profile = "2g.20gb"
        memory_total = "20GiB"
        gpu_instance_id = 9
        "#,
    );
    let node = only_node(&s);
    let info = &node.inventory()[0];
    let ids: Vec<(u32, u32, &str)> = info
        .mig
        .iter()
        .map(|m| (m.gpu_instance_id, m.compute_instance_id, m.profile.as_str()))
        .collect();
    assert_eq!(
        ids,
        [(1, 0, "3g.40gb"), (2, 1, "2g.20gb"), (9, 0, "2g.20gb")]
    );
    assert!(info.mig.iter().all(|m| m.uuid.starts_with("MIG-")));
    assert_eq!(info.mig[1].memory_total, 20 * GIB);

    let gpu = gpu_at(node, 0, 50.0);
    assert!(
        gpu.processes.is_empty(),
        "MIG processes are listed under their instance"
    );
    assert_eq!(gpu.mig.len(), 3);
    assert_eq!(gpu.mig[0].memory_used, 25 * GIB);
    assert_eq!(gpu.mig[0].processes.len(), 2);
    assert_eq!(gpu.mig[1].memory_used, 6 * GIB);
    assert_eq!(gpu.mig[2].memory_used, 0);
    assert!(gpu.mig[2].processes.is_empty());
    assert_eq!(gpu.memory_used, 25 * GIB + 6 * GIB + GIB);
    let uuids: Vec<&str> = gpu.mig.iter().map(|m| m.uuid.as_str()).collect();
    let info_uuids: Vec<&str> = info.mig.iter().map(|m| m.uuid.as_str()).collect();
    assert_eq!(uuids, info_uuids);
    assert!(gpu.utilization_pct > 0);
}

#[test]
fn count_replicates_gpus_with_distinct_uuids_and_pids() {
    let s = scenario(
        r#"
        [[node]]
        name = "trainer"
        driver_version = "535.104.05"
        [[node.gpu]]
        model = "NVIDIA L40S"
        memory_total = "48GiB"
        [[node.gpu]]
        model = "NVIDIA H100 80GB HBM3"
        memory_total = "80GiB"
        count = 3
        [[node.gpu.process]]
        pid = 500
        name = "torchrun"
        memory = { shape = "steady", level = "70GiB" }
        "#,
    );
    let node = only_node(&s);
    assert_eq!(node.driver_version, "535.104.05");
    assert_eq!(node.gpu_count(), 4);
    let inventory = node.inventory();
    let indices: Vec<u32> = inventory.iter().map(|g| g.index).collect();
    assert_eq!(indices, [0, 1, 2, 3]);
    let uuids: Vec<&str> = inventory.iter().map(|g| g.uuid.as_str()).collect();
    let distinct: std::collections::HashSet<&str> = uuids.iter().copied().collect();
    assert_eq!(distinct.len(), 4);
    assert_eq!(inventory[0].pcie_generation, 4);
    assert_eq!(inventory[1].pcie_generation, 5);
    assert!(
        inventory
            .iter()
            .all(|g| g.pcie_width == 16 && g.mig.is_empty())
    );
    assert_eq!(inventory[3].name, "NVIDIA H100 80GB HBM3");

    let states = node.state_at(10.0);
    assert!(states[0].processes.is_empty());
    let pids: Vec<u32> = states[1..].iter().map(|g| g.processes[0].pid).collect();
    assert_eq!(pids, [500, 1500, 2500]);
    assert!(states[1..].iter().all(|g| g.memory_used == 70 * GIB));
    let state_uuids: Vec<&str> = states.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(state_uuids, uuids);
}

#[test]
fn uuids_depend_only_on_node_and_index() {
    let a = scenario(ONE_GPU);
    let b = scenario(
        &ONE_GPU
            .replace("seed = 7", "seed = 8")
            .replace("80GiB", "81GiB"),
    );
    assert_eq!(
        only_node(&a).inventory()[0].uuid,
        only_node(&b).inventory()[0].uuid
    );
    let c = scenario(&ONE_GPU.replace("name = \"n1\"", "name = \"n2\""));
    assert_ne!(
        only_node(&a).inventory()[0].uuid,
        only_node(&c).inventory()[0].uuid
    );
}

#[test]
fn a_reporting_process_splits_its_memory_into_context_tensors_and_cache() {
    let s = scenario(
        r#"
[[node]]
name = "n"
[[node.gpu]]
model = "H100"
memory_total = "80GiB"
[[node.gpu.process]]
pid = 7
name = "python train.py"
start_s = 60
memory = { shape = "steady", level = "40.5GiB" }
allocator = { fragmentation = 0.25, retries_per_min = 2.0, oom_at_s = 300 }
"#,
    );
    let node = only_node(&s);
    let a = process(&gpu_at(node, 0, 240.0), 7)
        .unwrap()
        .allocator
        .unwrap();
    assert_eq!(a.reserved, 40 * GIB, "40.5 GiB minus the 512 MiB context");
    assert_eq!(a.allocated, 30 * GIB);
    assert_eq!(a.inactive_split, 5 * GIB, "half of the 10 GiB cache");
    assert_eq!(a.alloc_retries, 6, "3 minutes old at 2 a minute");
    assert_eq!(a.ooms, 0);
    let later = process(&gpu_at(node, 0, 300.0), 7)
        .unwrap()
        .allocator
        .unwrap();
    assert_eq!(later.ooms, 1);

    let err = Scenario::from_toml_str(&SINGLE_PROCESS_WITH_ALLOCATOR.replace("0.25", "1.5"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("allocator.fragmentation must be in [0, 1), got 1.5"),
        "{err}"
    );
}

const SINGLE_PROCESS_WITH_ALLOCATOR: &str = r#"
[[node]]
name = "n"
[[node.gpu]]
model = "H100"
memory_total = "80GiB"
[[node.gpu.process]]
pid = 7
name = "python train.py"
memory = { shape = "steady", level = "40GiB" }
allocator = { fragmentation = 0.25 }
"#;

#[test]
fn nodes_are_found_by_name() {
    let demo = Scenario::demo();
    let node = demo.node("gpu-node-02").unwrap();
    assert_eq!(node.name, "gpu-node-02");
    assert!(demo.node("no-such-node").is_none());
}

#[test]
fn absurd_times_do_not_panic() {
    let demo = Scenario::demo();
    for t in [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -1e300,
        1e300,
        1e12,
    ] {
        for node in demo.nodes() {
            for gpu in node.state_at(t) {
                assert!(gpu.memory_used <= gpu.memory_total - gpu.memory_reserved);
                assert!(gpu.utilization_pct <= 100);
            }
        }
    }
}
