//! The NVML source against the fake libnvidia-ml (`fake-nvml/`), loaded
//! through nvml-wrapper exactly as a real driver would be: what the agent
//! reads must be what the scenario says the hardware holds, and faults
//! (a lost GPU, a hung call, an XID, a MIG reconfiguration, missing PCIe
//! counters) must be reported while the other GPUs go on being read.
//!
//! NVML state, and the fake library's configuration, are per process, so
//! each case runs in a child process of this test binary.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use headroom_agent::source::{
    EventKind, GpuSource, MigDevice, NvmlOptions, NvmlSource, Poll, ProcessReading, SourceEvent,
};
use headroom_sim::{NodeSpec, Scenario};

const CASE_ENV: &str = "HEADROOM_NVML_TEST_CASE";
const PROCFS_ENV: &str = "HEADROOM_NVML_TEST_PROCFS";
const NODE: &str = "fake-node-01";
const BOOT_TIME_S: u64 = 1_700_000_000;

const POD_UID: &str = "1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d";
const POD_CONTAINER: &str = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899";
const DOCKER_CONTAINER: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const PODMAN_CONTAINER: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

fn scenario_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvml-node.toml")
}

fn node() -> NodeSpec {
    Scenario::load(&scenario_path())
        .unwrap()
        .node(NODE)
        .cloned()
        .unwrap()
}

/// A procfs tree for the scenario's processes: pid 4202 has no entry, as if
/// it exited between the NVML call and the read.
fn write_procfs(root: &Path) {
    std::fs::write(
        root.join("stat"),
        format!("cpu  1 2 3 4\nintr 5\nctxt 6\nbtime {BOOT_TIME_S}\nprocesses 7\n"),
    )
    .unwrap();
    let processes: [(u32, &str, u32, String); 5] = [
        (
            4101,
            "python\0train.py\0--config\x0070b.yaml\0",
            0,
            "0::/system.slice/slurmstepd.scope/job_777/step_0/user/task_0\n".into(),
        ),
        (
            4102,
            "python\0eval.py\0",
            0,
            "0::/user.slice/user-0.slice/session-3.scope\n".into(),
        ),
        (
            4201,
            "python\0serve.py\0",
            0,
            format!("0::/machine.slice/libpod-{PODMAN_CONTAINER}.scope/container\n"),
        ),
        (
            4301,
            "vllm\0serve\0",
            0,
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{POD_CONTAINER}.scope\n",
                POD_UID.replace('-', "_")
            ),
        ),
        (
            4401,
            "tritonserver\0",
            0,
            format!("0::/system.slice/docker-{DOCKER_CONTAINER}.scope\n"),
        ),
    ];
    for (pid, cmdline, uid, cgroup) in processes {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let comm = cmdline.split('\0').next().unwrap();
        let start_ticks = u64::from(pid) * 100;
        std::fs::write(
            dir.join("stat"),
            format!(
                "{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 5 5 0 0 20 0 8 0 {start_ticks} 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("status"),
            format!(
                "Name:\t{comm}\nState:\tS (sleeping)\nTgid:\t{pid}\nNSpid:\t{pid}\t1\nPid:\t{pid}\nPPid:\t1\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n"
            ),
        )
        .unwrap();
        std::fs::write(dir.join("cmdline"), cmdline).unwrap();
        std::fs::write(dir.join("cgroup"), cgroup).unwrap();
        std::fs::write(
            dir.join("environ"),
            "HOME=/root\0SLURM_JOB_ID=777\0SLURM_JOB_ACCOUNT=llm-pretrain\0",
        )
        .unwrap();
    }
    // The kubelet's log directory of the vLLM pod, and of one long gone.
    let pods = root.join(POD_LOGS);
    std::fs::create_dir_all(pods.join(format!("serving_vllm-0_{POD_UID}"))).unwrap();
    std::fs::create_dir_all(pods.join("old_job-1_00000000-0000-0000-0000-000000000000")).unwrap();
}

/// Where, under the procfs fixture's directory, the pods' log directories are.
const POD_LOGS: &str = "pod-logs";

/// Runs `case` in a fresh process of this test binary with the fake
/// library configured by `faults` (a faults TOML, or none).
fn run_case(case: &str, faults: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let procfs = dir.path().join("proc");
    std::fs::create_dir_all(&procfs).unwrap();
    write_procfs(&procfs);
    // The test's name in this binary: its module path without the crate's.
    let entry = module_path!()
        .split_once("::")
        .map_or("child_process_entry".to_owned(), |(_, module)| {
            format!("{module}::child_process_entry")
        });
    let mut child = Command::new(std::env::current_exe().unwrap());
    child
        .args([entry.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE_ENV, case)
        .env(PROCFS_ENV, &procfs)
        .env("HEADROOM_FAKE_NVML_SCENARIO", scenario_path())
        .env("HEADROOM_FAKE_NVML_NODE", NODE)
        .env_remove("HEADROOM_FAKE_NVML_FAULTS");
    if let Some(faults) = faults {
        let path = dir.path().join("faults.toml");
        std::fs::write(&path, faults).unwrap();
        child.env("HEADROOM_FAKE_NVML_FAULTS", path);
    }
    let out = child.output().unwrap();
    assert!(
        out.status.success(),
        "case {case} failed:\n--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("case {case} passed")),
        "case {case} did not run:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The entry point of the child processes; in the parent run it has no
/// case to run and returns.
#[test]
fn child_process_entry() {
    let Ok(case) = std::env::var(CASE_ENV) else {
        return;
    };
    match case.as_str() {
        "readings" => readings_case(),
        "faults" => faults_case(),
        other => panic!("unknown case {other}"),
    }
    println!("case {case} passed");
}

#[test]
fn readings_equal_the_scenario() {
    // Counters start near u64::MAX, so the rates must survive a wrap.
    run_case("readings", Some("pcie_counters_start_near_wrap = true\n"));
}

#[test]
fn faults_are_reported_and_the_other_gpus_still_read() {
    run_case(
        "faults",
        Some(
            r#"
[[xid]]
gpu = 0
xid = 79
at_s = 0.5

[[pcie_counters_unsupported]]
gpu = 0

[[mig_reconfigure]]
gpu = 1
at_s = 1.0
profiles = ["7g.80gb"]

[[hang]]
gpu = 2
function = "nvmlDeviceGetMemoryInfo_v2"
after_s = 1.0

[[gpu_lost]]
gpu = 3
after_s = 1.0

[[bogus_process]]
gpu = 0
pid = 0
memory = 1024

[[bogus_process]]
gpu = 0
pid = 4999
memory = 1099511627776
"#,
        ),
    );
}

fn source(call_timeout: Duration) -> NvmlSource {
    NvmlSource::new(NvmlOptions {
        library: Some(headroom_tests::fake_nvml::library()),
        procfs_root: PathBuf::from(std::env::var(PROCFS_ENV).unwrap()),
        pod_log_dir: PathBuf::from(std::env::var(PROCFS_ENV).unwrap()).join(POD_LOGS),
        pod_labels: Some(std::sync::Arc::new({
            let labels = headroom_agent::kubernetes::PodLabels::default();
            labels.replace(std::collections::HashMap::from([(
                POD_UID.to_owned(),
                std::sync::Arc::from([("team".to_owned(), "inference".to_owned())]),
            )]));
            labels
        })),
        call_timeout,
        poll_wait: Duration::from_millis(80),
        handoff_after: Duration::from_millis(40),
        layout_check: Duration::from_millis(300),
        pcie_fallback_interval: Duration::from_millis(200),
        attribution_refresh: Duration::from_secs(5),
        slow_every: 10,
        read_health: true,
    })
    .unwrap()
}

/// Polls at 10 Hz for `run`, handing every poll to `each`.
fn poll_for(source: &mut NvmlSource, run: Duration, mut each: impl FnMut(&Poll)) -> Poll {
    let end = Instant::now() + run;
    let mut last = Poll::default();
    while Instant::now() < end {
        let poll = source.poll().unwrap();
        each(&poll);
        last = poll;
        std::thread::sleep(Duration::from_millis(100));
    }
    last
}

/// The PCIe rate range the scenario gives GPU `index` over the first
/// `seconds`, widened by 5 % for timing between the library and us.
fn pcie_bounds(node: &NodeSpec, index: usize, seconds: f64) -> ((u64, u64), (u64, u64)) {
    let (mut tx, mut rx) = ((u64::MAX, 0), (u64::MAX, 0));
    let mut t = 0.0;
    while t <= seconds {
        let g = &node.state_at(t)[index];
        tx = (
            tx.0.min(g.pcie_tx_bytes_per_s),
            tx.1.max(g.pcie_tx_bytes_per_s),
        );
        rx = (
            rx.0.min(g.pcie_rx_bytes_per_s),
            rx.1.max(g.pcie_rx_bytes_per_s),
        );
        t += 0.01;
    }
    let widen = |(lo, hi): (u64, u64)| (lo / 100 * 95, hi / 100 * 105);
    (widen(tx), widen(rx))
}

fn process(poll: &Poll, pid: u32) -> &ProcessReading {
    poll.processes
        .iter()
        .find(|p| p.pid == pid)
        .unwrap_or_else(|| panic!("pid {pid} missing from {:?}", poll.processes))
}

fn readings_case() {
    let node = node();
    let mut source = source(Duration::from_secs(5));
    let inventory = source.inventory().unwrap();
    assert_eq!(inventory.driver_version, "550.90.07");
    let want = node.inventory();
    assert_eq!(inventory.gpus.len(), want.len());
    for (got, want) in inventory.gpus.iter().zip(&want) {
        assert_eq!(
            (got.index, &got.uuid, &got.name, got.memory_total),
            (want.index, &want.uuid, &want.name, want.memory_total)
        );
        assert_eq!(
            (got.pcie_generation, got.pcie_width, &got.pci_bus_id),
            (want.pcie_generation, want.pcie_width, &want.pci_bus_id)
        );
        let want_mig: Vec<MigDevice> = want
            .mig
            .iter()
            .map(|m| MigDevice {
                uuid: m.uuid.clone(),
                gpu_instance_id: m.gpu_instance_id,
                compute_instance_id: m.compute_instance_id,
                profile: m.profile.clone(),
                memory_total: m.memory_total,
            })
            .collect();
        assert_eq!(
            got.mig_instances, want_mig,
            "MIG layout of GPU {}",
            got.index
        );
    }

    let ((tx_lo, tx_hi), (rx_lo, rx_hi)) = pcie_bounds(&node, 0, 5.0);
    let gpu0 = want[0].uuid.clone();
    let mut rates = Vec::new();
    // 3.5 s: past the counters' wrap about 2 s after init.
    let last = poll_for(&mut source, Duration::from_millis(3500), |poll| {
        if let Some(d) = poll.devices.iter().find(|d| d.uuid == gpu0)
            && let (Some(tx), Some(rx)) = (d.pcie_tx_bytes_per_s, d.pcie_rx_bytes_per_s)
        {
            rates.push((tx, rx));
        }
    });
    assert!(rates.len() >= 20, "PCIe rates on most polls: {rates:?}");
    for (tx, rx) in &rates {
        assert!(
            (tx_lo..=tx_hi).contains(tx),
            "tx {tx} outside {tx_lo}..={tx_hi}"
        );
        assert!(
            (rx_lo..=rx_hi).contains(rx),
            "rx {rx} outside {rx_lo}..={rx_hi}"
        );
    }

    let state = node.state_at(1.0);
    for gpu in &state {
        let d = last.devices.iter().find(|d| d.uuid == gpu.uuid).unwrap();
        // Temperature and power follow utilization, which wobbles; the
        // clock does not.
        let health = d
            .health
            .unwrap_or_else(|| panic!("no health for {}", gpu.uuid));
        assert_eq!(health.sm_clock_mhz, Some(gpu.sm_clock_mhz), "{}", gpu.uuid);
        assert!(
            health.temperature_c.is_some_and(|t| (32..=72).contains(&t))
                && health
                    .power_mw
                    .is_some_and(|p| (70_000..=700_000).contains(&p)),
            "{health:?}"
        );
        assert_eq!(
            (d.memory_used, d.memory_reserved, d.memory_total),
            (gpu.memory_used, gpu.memory_reserved, gpu.memory_total),
            "memory of {}",
            gpu.uuid
        );
        for p in &gpu.processes {
            let got = process(&last, p.pid);
            assert_eq!(
                (&*got.device_uuid, got.memory_used),
                (gpu.uuid.as_str(), p.memory_used)
            );
        }
        for mig in &gpu.mig {
            let d = last.devices.iter().find(|d| d.uuid == mig.uuid).unwrap();
            assert_eq!(
                (d.memory_used, d.memory_total),
                (mig.memory_used, mig.memory_total)
            );
            assert_eq!(d.utilization_pct, None, "MIG instances have no utilisation");
            for p in &mig.processes {
                let got = process(&last, p.pid);
                assert_eq!(
                    (&*got.device_uuid, got.memory_used),
                    (mig.uuid.as_str(), p.memory_used)
                );
            }
        }
    }
    assert_eq!(
        last.devices.len(),
        6,
        "4 GPUs and 2 MIG instances: {:?}",
        last.devices
    );
    assert_eq!(last.processes.len(), 6);

    // Owners, from the procfs tree.
    let train = process(&last, 4101);
    assert_eq!(train.owner.name, "python train.py --config 70b.yaml");
    assert_eq!((train.owner.uid, train.owner.user.as_str()), (0, "root"));
    assert_eq!(train.owner.slurm_job_id, "777");
    assert_eq!(train.owner.slurm_account, "llm-pretrain");
    assert_eq!(train.owner.process_group, 4101, "it leads its own group");
    // The same environment outside a Slurm job names no account.
    assert_eq!(process(&last, 4102).owner.slurm_account, "");
    // 4101 s of 100 Hz ticks after boot.
    assert_eq!(train.start_time_ms, ((BOOT_TIME_S + 4101) * 1000) as i64);
    let serve = process(&last, 4201);
    assert_eq!(serve.owner.container_id, PODMAN_CONTAINER);
    assert_eq!(serve.owner.container_runtime, "podman");
    let pod = process(&last, 4301);
    assert_eq!(
        (
            pod.owner.pod_uid.as_str(),
            pod.owner.container_id.as_str(),
            pod.owner.pod_namespace.as_str()
        ),
        (POD_UID, POD_CONTAINER, "serving")
    );
    assert_eq!(
        pod.owner.pod_labels,
        vec![("team".to_owned(), "inference".to_owned())]
    );
    assert!(train.owner.pod_labels.is_empty(), "not in a pod");
    assert_eq!(
        (
            pod.owner.container_runtime.as_str(),
            pod.owner.pod_qos_class.as_str()
        ),
        ("containerd", "burstable")
    );
    let docker = process(&last, 4401);
    assert_eq!(docker.owner.container_id, DOCKER_CONTAINER);
    assert_eq!(docker.owner.container_runtime, "docker");
    // Gone from /proc: still reported with its memory, without an owner.
    let gone = process(&last, 4202);
    assert_eq!((gone.owner.name.as_str(), gone.start_time_ms), ("", 0));
    assert_eq!(gone.memory_used, 5 << 30);

    assert!(last.stalled.is_empty());
}

fn faults_case() {
    let node = node();
    let want = node.inventory();
    let (gpu0, gpu1, gpu2, gpu3) = (
        want[0].uuid.clone(),
        want[1].uuid.clone(),
        want[2].uuid.clone(),
        want[3].uuid.clone(),
    );
    let mut source = source(Duration::from_millis(500));
    let mut events: Vec<SourceEvent> = Vec::new();
    let mut new_inventory = None;
    let mut fallback_rates = Vec::new();
    let mut polls_without_gpu0 = 0;
    let last = poll_for(&mut source, Duration::from_millis(3500), |poll| {
        events.extend(poll.events.iter().cloned());
        if !poll.devices.iter().any(|d| d.uuid == gpu0) {
            polls_without_gpu0 += 1;
        }
        if let Some(inventory) = &poll.inventory {
            new_inventory = Some(inventory.clone());
        }
        if let Some(d) = poll.devices.iter().find(|d| d.uuid == gpu0)
            && let Some(tx) = d.pcie_tx_bytes_per_s
        {
            fallback_rates.push(tx);
        }
    });

    let of = |kind: EventKind| -> Vec<&SourceEvent> {
        events.iter().filter(|e| e.kind == kind).collect()
    };
    let xid = of(EventKind::Xid);
    assert_eq!(xid.len(), 1, "{events:?}");
    assert_eq!(
        (xid[0].device_uuid.as_str(), xid[0].code),
        (gpu0.as_str(), 79)
    );

    let lost = of(EventKind::GpuLost);
    assert_eq!(lost.len(), 1, "reported once: {events:?}");
    assert_eq!(lost[0].device_uuid, gpu3);

    let hung = of(EventKind::NvmlHung);
    assert_eq!(hung.len(), 1, "reported once: {events:?}");
    assert_eq!(hung[0].device_uuid, gpu2);
    assert!(
        hung[0].detail.contains("nvmlDeviceGetMemoryInfo_v2"),
        "{}",
        hung[0].detail
    );
    assert_eq!(last.stalled, vec![gpu2.clone()]);

    let reconfigured = of(EventKind::MigReconfigured);
    assert_eq!(reconfigured.len(), 1, "{events:?}");
    assert_eq!(reconfigured[0].device_uuid, gpu1);
    let inventory = new_inventory.expect("the new layout is handed out");
    let layout = &inventory
        .gpus
        .iter()
        .find(|g| g.uuid == gpu1)
        .unwrap()
        .mig_instances;
    assert_eq!(layout.len(), 1);
    assert_eq!(layout[0].profile, "7g.80gb");
    assert!(
        want[1].mig.iter().all(|old| old.uuid != layout[0].uuid),
        "a fresh UUID"
    );

    // Impossible process entries are reported once each, never stored.
    let invalid = of(EventKind::NvmlInvalidData);
    let mut invalid_pids: Vec<u32> = invalid.iter().map(|e| e.pid).collect();
    invalid_pids.sort_unstable();
    assert_eq!(invalid_pids, vec![0, 4999], "{events:?}");
    assert!(invalid.iter().all(|e| e.device_uuid == gpu0));
    assert!(
        last.processes.iter().all(|p| p.pid != 0 && p.pid != 4999),
        "{:?}",
        last.processes
    );
    assert!(
        last.processes.iter().any(|p| p.pid == 4101),
        "the real ones stay"
    );

    // GPU 2 hangs on the thread that read all four: the others move to a
    // thread of their own by the next poll, so GPU 0 misses one poll at most
    // (the one whose answer GPU 2 held up).
    assert!(
        polls_without_gpu0 <= 2,
        "GPU 0 missing from {polls_without_gpu0} polls"
    );

    // The healthy GPUs are still read, the lost and stalled ones are not.
    let uuids: Vec<&str> = last.devices.iter().map(|d| d.uuid.as_str()).collect();
    assert!(
        uuids.contains(&gpu0.as_str()) && uuids.contains(&gpu1.as_str()),
        "{uuids:?}"
    );
    assert!(
        uuids.contains(&layout[0].uuid.as_str()),
        "the new instance is read: {uuids:?}"
    );
    assert!(
        !uuids.contains(&gpu2.as_str()) && !uuids.contains(&gpu3.as_str()),
        "{uuids:?}"
    );

    // GPU 0 has no PCIe counters: its rates come from the throughput fallback.
    let ((tx_lo, tx_hi), _) = pcie_bounds(&node, 0, 5.0);
    assert!(fallback_rates.len() >= 10, "{fallback_rates:?}");
    for tx in &fallback_rates {
        // KB/s resolution.
        assert!(
            (tx_lo - 1024..=tx_hi + 1024).contains(tx),
            "tx {tx} outside {tx_lo}..={tx_hi}"
        );
    }
}
