//! The agent binary on (fake) NVML, end to end: `headroom-agent --source
//! nvml` loads the fake libnvidia-ml through nvml-wrapper, streams over real
//! gRPC to a collector, and the collector's API shows the scenario's GPUs,
//! MIG instances and processes, an XID alert, and a MIG reconfiguration
//! (the agent registers the new layout before it ships samples of it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom_sim::Scenario;
use headroom_tests::harness::{KillOnDrop, RunningCollector, built, eventually};
use serde_json::Value;

const NODE: &str = "fake-node-01";

fn scenario_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvml-node.toml")
}

fn device<'a>(gpus: &'a Value, uuid: &str) -> Option<&'a Value> {
    gpus.as_array()?.iter().find(|d| d["uuid"] == uuid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_on_nvml_reports_memory_mig_layout_changes_and_xid() {
    let dir = tempfile::tempdir().unwrap();
    let collector = RunningCollector::start_sqlite_with_default_rules(dir.path()).await;
    let faults = dir.path().join("faults.toml");
    std::fs::write(
        &faults,
        "[[xid]]\ngpu = 0\nxid = 79\nat_s = 1.0\n\n[[mig_reconfigure]]\ngpu = 1\nat_s = 3.0\nprofiles = [\"7g.80gb\"]\n",
    )
    .unwrap();
    // No owners to find: every process is reported without attribution.
    let procfs = dir.path().join("proc");
    std::fs::create_dir_all(&procfs).unwrap();
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let child = Command::new(built("headroom-agent"))
        .args(["--source", "nvml", "--node-name", NODE])
        .arg("--allocator-socket")
        .arg(dir.path().join("allocator.sock"))
        .arg("--nvml-library")
        .arg(headroom_tests::fake_nvml::library())
        .arg("--procfs-root")
        .arg(&procfs)
        .arg("--spool-dir")
        .arg(dir.path().join("spool"))
        .args(["--collector-url", &collector.grpc_url()])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .args(["--poll-interval-ms", "50", "--sample-interval-ms", "250"])
        .env("HEADROOM_MIG_CHECK_INTERVAL_MS", "500")
        .env("HEADROOM_FAKE_NVML_SCENARIO", scenario_path())
        .env("HEADROOM_FAKE_NVML_NODE", NODE)
        .env("HEADROOM_FAKE_NVML_FAULTS", &faults)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let agent = KillOnDrop(child);
    let agent_log = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();

    let node = Scenario::load(&scenario_path())
        .unwrap()
        .node(NODE)
        .cloned()
        .unwrap();
    let inventory = node.inventory();
    let state = node.state_at(1.0);

    // Every GPU and MIG instance, with the scenario's memory.
    let gpus = eventually("all devices sampled", Duration::from_secs(30), || async {
        let gpus = collector.get_json("/api/v1/gpus").await;
        let sampled = gpus
            .as_array()?
            .iter()
            .filter(|d| !d["latest"].is_null())
            .count();
        (sampled == 6).then_some(gpus)
    })
    .await;
    for gpu in &state {
        let d = device(&gpus, &gpu.uuid)
            .unwrap_or_else(|| panic!("{} missing\n{}", gpu.uuid, agent_log()));
        assert_eq!(d["latest"]["memory_used_bytes"], gpu.memory_used);
        assert_eq!(d["latest"]["memory_reserved_bytes"], gpu.memory_reserved);
        for mig in &gpu.mig {
            let m = device(&gpus, &mig.uuid).unwrap();
            assert_eq!(m["kind"], "mig");
            assert_eq!(m["latest"]["memory_used_bytes"], mig.memory_used);
            assert_eq!(m["parent_uuid"], gpu.uuid.as_str());
        }
    }
    let procs = collector.get_json("/api/v1/processes").await;
    let train = procs
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == 4101)
        .unwrap();
    assert_eq!(train["memory_used_bytes"], 30u64 << 30);
    assert_eq!(train["device_uuid"], inventory[0].uuid.as_str());

    // XID 79 on GPU 0 fires the XID rule.
    let alerts = eventually("an XID alert", Duration::from_secs(30), || async {
        let alerts = collector.get_json("/api/v1/alerts").await;
        let list = alerts
            .as_array()
            .or_else(|| alerts["alerts"].as_array())?
            .clone();
        list.into_iter().find(|a| a["rule"] == "xid")
    })
    .await;
    assert_eq!(alerts["labels"]["xid"], "79", "{alerts}");

    // GPU 1 is reconfigured to one 7g.80gb instance: the collector learns
    // the new layout and samples of the new instance arrive.
    let old_instances: Vec<&str> = inventory[1].mig.iter().map(|m| m.uuid.as_str()).collect();
    let gpu1 = inventory[1].uuid.clone();
    let new_instance = eventually("the new MIG layout", Duration::from_secs(30), || async {
        let gpus = collector.get_json("/api/v1/gpus").await;
        let migs: Vec<Value> = gpus
            .as_array()?
            .iter()
            .filter(|d| d["parent_uuid"] == gpu1.as_str())
            .cloned()
            .collect();
        (migs.len() == 1 && migs[0]["mig_profile"] == "7g.80gb" && !migs[0]["latest"].is_null())
            .then(|| migs[0].clone())
    })
    .await;
    assert!(!old_instances.contains(&new_instance["uuid"].as_str().unwrap()));
    assert_eq!(new_instance["memory_total_bytes"], 80u64 << 30);
    // The agent first: a graceful collector stop waits for open streams.
    drop(agent);
    collector.stop().await;
}
