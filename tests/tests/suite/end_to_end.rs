//! The whole pipeline: a simulated agent streams over real gRPC to a
//! collector on Postgres (SQLite where noted), and the API returns the
//! scenario's values.

use std::time::Duration;

use headroom_agent::AgentSettings;
use headroom_agent::source::SimSource;
use headroom_sim::Scenario;
use headroom_tests::fixtures::{GIB, now_ms};
use headroom_tests::harness::{RunningCollector, eventually};
use headroom_tests::postgres;
use serde_json::Value;

/// Exact values: no jitter anywhere, so the API must report them to the byte.
const SCENARIO: &str = r#"
[[node]]
name = "e2e-node"
driver_version = "550.54.15"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
reserved = "512MiB"
unattributed = "1GiB"
utilization = 90
pcie_tx = "1GB/s"

[[node.gpu.process]]
pid = 4242
name = "python train.py"
user = "alice"
uid = 1001
slurm_job_id = "99"
memory = { shape = "steady", level = "12GiB" }

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu]]
model = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[node.gpu.mig]]
profile = "3g.40gb"
memory_total = "40GiB"

[[node.gpu.mig.process]]
pid = 5150
name = "python infer.py"
user = "bob"
uid = 1002
pod_uid = "0f0e0d0c-1111-2222-3333-444455556666"
container_id = "3b1f0c2d9e8a"
memory = { shape = "steady", level = "5GiB" }
"#;

fn settings_with_metrics(collector_url: String) -> AgentSettings {
    AgentSettings {
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        allocator_socket: None,
        dcgm_metric_names: true,
        ..settings(collector_url)
    }
}

/// Runs `promtool check metrics` on an exposition. Under CI promtool must be
/// there (`.ci/run` installs it); elsewhere its absence skips the check.
fn promtool_check(exposition: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => {
            headroom_tests::skip_or_fail_under_ci(
                "the promtool check",
                format!("promtool is missing: {e}"),
            );
            return;
        }
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // dcgm-exporter's label names (`UUID`, `modelName`) are camelCase, and
    // must stay so for its dashboards: that one lint, on its families only,
    // is expected. Anything else (a parse error included) fails.
    let unexpected: Vec<&str> = report
        .lines()
        .filter(|l| {
            !(l.starts_with("DCGM_")
                && l.ends_with("label names should be written in 'snake_case' not 'camelCase'"))
        })
        .collect();
    assert!(
        out.status.success() || (!report.trim().is_empty() && unexpected.is_empty()),
        "promtool check metrics failed:\n{}",
        unexpected.join("\n")
    );
}

fn settings(collector_url: String) -> AgentSettings {
    AgentSettings {
        spool: None,
        tls: None,
        token: None,
        collector_url,
        node: "e2e-node".into(),
        boot_id: "e2e-boot".into(),
        poll_interval: Duration::from_millis(20),
        sample_interval: Duration::from_millis(200),
        max_pending_batches: 1000,
        flush_above: 0.90,
        metrics_listen: None,
        allocator_socket: None,
        dcgm_metric_names: false,
    }
}

fn device(gpus: &Value, pred: impl Fn(&Value) -> bool) -> &Value {
    gpus.as_array().unwrap().iter().find(|d| pred(d)).unwrap()
}

async fn all_devices_sampled(c: &RunningCollector) -> Option<Value> {
    let gpus = c.get_json("/api/v1/gpus").await;
    let list = gpus.as_array()?;
    (list.len() == 4 && list.iter().all(|d| !d["latest"].is_null())).then_some(gpus)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_agent_to_postgres_collector_api_returns_scenario_values() {
    let Some(db) = postgres::fresh_database().await else {
        return;
    };
    let collector = RunningCollector::start(headroom_store::connect(&db.url).await.unwrap()).await;
    let scenario = Scenario::from_toml_str(SCENARIO).unwrap();
    let source = SimSource::new(&scenario, "e2e-node").unwrap();
    let agent = headroom_agent::start(
        settings_with_metrics(collector.grpc_url()),
        Box::new(source),
    )
    .unwrap();

    let gpus = eventually("every device to report", Duration::from_secs(30), || {
        all_devices_sampled(&collector)
    })
    .await;
    let gpu0 = device(&gpus, |d| d["index"] == 0 && d["kind"] == "gpu");
    let latest = &gpu0["latest"];
    assert_eq!(
        latest["memory_used_bytes"],
        13 * GIB,
        "12 GiB process + 1 GiB unattributed"
    );
    assert_eq!(latest["memory_used_max_bytes"], 13 * GIB);
    assert_eq!(latest["memory_reserved_bytes"], GIB / 2);
    assert_eq!(latest["memory_total_bytes"], 80 * GIB);
    assert_eq!(latest["headroom_bytes"], 80 * GIB - 13 * GIB - GIB / 2);
    assert_eq!(gpu0["name"], "NVIDIA H100 80GB HBM3");
    let idle = device(&gpus, |d| d["index"] == 1);
    assert_eq!(idle["latest"]["memory_used_bytes"], 0);
    let mig = device(&gpus, |d| d["kind"] == "mig");
    assert_eq!(mig["mig_profile"], "3g.40gb");
    assert_eq!(mig["memory_total_bytes"], 40 * GIB);
    assert_eq!(mig["latest"]["memory_used_bytes"], 5 * GIB);
    let mig_parent = device(&gpus, |d| d["index"] == 2 && d["kind"] == "gpu");
    assert_eq!(mig["parent_uuid"], mig_parent["uuid"]);
    assert_eq!(mig_parent["latest"]["memory_used_bytes"], 5 * GIB);

    let nodes = collector.get_json("/api/v1/nodes").await;
    assert_eq!(nodes[0]["name"], "e2e-node");
    assert_eq!(nodes[0]["gpu_count"], 3);
    assert_eq!(nodes[0]["mig_instance_count"], 1);
    assert_eq!(nodes[0]["driver_version"], "550.54.15");

    // The overview that stays small at any fleet size: the same read summed.
    let fleet = collector.get_json("/api/v1/fleet?fullest=2").await;
    assert_eq!(
        (fleet["nodes"].clone(), fleet["gpus"].clone()),
        (1.into(), 3.into())
    );
    assert_eq!(fleet["mig_instances"], 1);
    let physical_total: i64 = gpus
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["kind"] == "gpu")
        .map(|d| d["memory_total_bytes"].as_i64().unwrap())
        .sum();
    assert_eq!(fleet["memory_total_bytes"], physical_total);
    assert_eq!(
        fleet["memory_used_bytes"],
        (13 + 5) * GIB,
        "GPU 0 and the MIG instance's GPU; the instance is part of it"
    );
    assert_eq!(fleet["by_node"][0]["node"], "e2e-node");
    assert_eq!(fleet["by_node"][0]["gpus"], 3);
    let fullest = fleet["fullest"].as_array().unwrap();
    assert_eq!(fullest.len(), 2, "as many as asked for");
    assert_eq!(fullest[0]["uuid"], gpu0["uuid"], "the least headroom first");
    let refused = reqwest::get(collector.api("/api/v1/fleet?fullest=0"))
        .await
        .unwrap();
    assert_eq!(refused.status(), reqwest::StatusCode::BAD_REQUEST);
    let error = refused.text().await.unwrap();
    assert!(error.contains("`fullest`"), "{error}");

    let procs = collector.get_json("/api/v1/processes").await;
    let alice = device(&procs, |p| p["pid"] == 4242);
    assert_eq!(alice["user"], "alice");
    assert_eq!(alice["slurm_job_id"], "99");
    assert_eq!(alice["memory_used_bytes"], 12 * GIB);
    assert_eq!(alice["device_uuid"], gpu0["uuid"]);
    let bob = device(&procs, |p| p["pid"] == 5150);
    assert_eq!(bob["device_uuid"], mig["uuid"]);
    assert_eq!(bob["pod_uid"], "0f0e0d0c-1111-2222-3333-444455556666");
    // The dashboard's filters, answered by the collector.
    let pids = |procs: serde_json::Value| {
        procs
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pid"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    for (query, expected) in [
        ("user=bo", vec![5150]),
        ("slurm_job_id=99", vec![4242]),
        ("pod_uid=0f0e0d0c", vec![5150]),
        ("user=alice&pod_uid=0f0e0d0c", vec![]),
        ("node=e2e-node&user=alic", vec![4242]),
        ("node=another-node&user=alice", vec![]),
    ] {
        let found = collector
            .get_json(&format!("/api/v1/processes?{query}"))
            .await;
        assert_eq!(pids(found), expected, "{query}");
    }
    // What the processes view shows, summed by the collector.
    let summary = collector.get_json("/api/v1/processes/summary").await;
    assert_eq!(summary["processes"], procs.as_array().unwrap().len());
    let alice_sum = &summary["by_user"]["largest"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["key"] == "alice")
        .unwrap_or_else(|| panic!("no alice in {summary}"))
        .clone();
    assert_eq!(
        (
            &alice_sum["processes"],
            &alice_sum["devices"],
            &alice_sum["nodes"]
        ),
        (
            &serde_json::json!(1),
            &serde_json::json!(1),
            &serde_json::json!(1)
        )
    );
    assert_eq!(alice_sum["memory_used_bytes"], 12 * GIB);
    assert_eq!(summary["by_slurm_job"]["largest"][0]["key"], "99");
    assert_eq!(
        summary["by_pod"]["largest"][0]["key"],
        "0f0e0d0c-1111-2222-3333-444455556666"
    );
    let mut summed: Vec<_> = pids(summary["largest"].clone());
    let mut listed = pids(procs.clone());
    summed.sort_unstable();
    listed.sort_unstable();
    assert_eq!(summed, listed, "every process among the largest of so few");
    let refused = reqwest::get(collector.api("/api/v1/processes?user=a%00b"))
        .await
        .unwrap();
    assert_eq!(refused.status(), reqwest::StatusCode::BAD_REQUEST);
    let error = refused.text().await.unwrap();
    assert!(error.contains("`user`"), "{error}");

    // The agent's own Prometheus endpoint shows the same GPU, valid by promtool.
    let metrics_url = format!("http://{}/metrics", agent.metrics_addr().unwrap());
    let exposition = reqwest::get(&metrics_url)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let gpu0_uuid = gpu0["uuid"].as_str().unwrap();
    assert!(
        exposition.contains(&format!(
            "headroom_gpu_memory_used_bytes{{node=\"e2e-node\",gpu=\"0\",uuid=\"{gpu0_uuid}\",model=\"NVIDIA H100 80GB HBM3\",mig_profile=\"\"}} {}",
            13 * GIB
        )),
        "{exposition}"
    );
    assert!(
        exposition.contains("pid=\"4242\",process=\"python train.py\",user=\"alice\",job=\"99\"")
    );
    // dcgm-exporter's names too (dcgm_metric_names), in MiB, with its labels;
    // a MIG instance under its parent GPU's index and UUID.
    assert!(
        exposition.contains(&format!(
            "DCGM_FI_DEV_FB_USED{{gpu=\"0\",UUID=\"{gpu0_uuid}\",pci_bus_id=\"00000000:01:00.0\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"e2e-node\",DCGM_FI_DRIVER_VERSION=\"550.54.15\"}} {}",
            13 * 1024
        )),
        "{exposition}"
    );
    assert!(
        exposition.contains("GPU_I_PROFILE=\"3g.40gb\",GPU_I_ID=\""),
        "{exposition}"
    );
    assert!(exposition.contains("# TYPE DCGM_FI_DEV_XID_ERRORS gauge"));
    promtool_check(&exposition);
    // It has read its GPUs, so it says it is ready; so does the collector,
    // whose database answers.
    for url in [
        format!("http://{}/readyz", agent.metrics_addr().unwrap()),
        collector.api("/readyz"),
    ] {
        let ready = reqwest::get(&url).await.unwrap();
        assert_eq!(ready.status(), reqwest::StatusCode::OK, "{url}");
        assert_eq!(ready.text().await.unwrap(), "ready\n");
    }

    // Samples keep arriving, one per interval, each stored once.
    let uuid = gpu0["uuid"].as_str().unwrap().to_owned();
    let series = eventually(
        "five intervals of GPU 0",
        Duration::from_secs(30),
        || async {
            let s = collector
                .get_json(&format!(
                    "/api/v1/gpus/{uuid}/series?from={}",
                    now_ms() - 60_000
                ))
                .await;
            (s["points"].as_array()?.len() >= 5).then_some(s)
        },
    )
    .await;
    for p in series["points"].as_array().unwrap() {
        assert_eq!(p["samples"], 1);
        assert_eq!(p["memory_used_bytes"], 13 * GIB);
    }

    // The collector's own /metrics: what it stored, valid by promtool.
    let exposition = reqwest::get(collector.api("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |series: &str| -> f64 {
        exposition
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} missing:\n{exposition}"))
    };
    assert!(value("headroom_collector_batches_total{outcome=\"committed\"}") >= 5.0);
    assert_eq!(
        value("headroom_collector_batches_total{outcome=\"rejected\"}"),
        0.0
    );
    assert!(value("headroom_collector_samples_total{kind=\"gpu\"}") >= 20.0);
    assert_eq!(value("headroom_collector_agent_streams"), 1.0);
    assert_eq!(value("headroom_collector_registrations_total"), 1.0);
    assert!(value("headroom_collector_batch_write_seconds_count") >= 5.0);
    assert_eq!(value("headroom_collector_alerts{state=\"firing\"}"), 0.0);
    promtool_check(&exposition);

    agent.stop().await;
    collector.stop().await;
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_keeps_intervals_while_the_collector_is_down_and_delivers_them_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("late.db").display());
    // Reserve a port, then let it go: the agent dials a collector that is not there yet.
    let grpc = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = grpc.local_addr().unwrap();
    drop(grpc);
    let scenario = Scenario::from_toml_str(SCENARIO).unwrap();
    let source = SimSource::new(&scenario, "e2e-node").unwrap();
    let agent_started = now_ms();
    let agent =
        headroom_agent::start(settings(format!("http://{addr}")), Box::new(source)).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let store = headroom_store::connect(&url).await.unwrap();
    let collector = RunningCollector::start_on(store, listener).await;
    let gpus = eventually("the agent to connect", Duration::from_secs(30), || {
        all_devices_sampled(&collector)
    })
    .await;
    let uuid = device(&gpus, |d| d["index"] == 0)["uuid"]
        .as_str()
        .unwrap()
        .to_owned();
    let points = eventually("the backlog to arrive", Duration::from_secs(30), || async {
        let s = collector
            .get_json(&format!(
                "/api/v1/gpus/{uuid}/series?from={}",
                agent_started - 1000
            ))
            .await;
        let points = s["points"].as_array()?.clone();
        (points.len() >= 10).then_some(points)
    })
    .await;
    let first = points[0]["timestamp_ms"].as_i64().unwrap();
    assert!(
        first < agent_started + 1000,
        "the first interval ({first}) was sampled while the collector was down (agent start {agent_started})"
    );
    let stamps: Vec<i64> = points
        .iter()
        .map(|p| p["timestamp_ms"].as_i64().unwrap())
        .collect();
    // A doubled interval shows as a gap of 0. A short one is not a double:
    // after a stall the sampler keeps its schedule, so the interval after a
    // late one ends early (CI saw 386 ms, then 21 ms).
    for pair in stamps.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            (1..=1500).contains(&gap),
            "no interval lost or doubled: gaps {stamps:?}"
        );
    }
    assert!(points.iter().all(|p| p["samples"] == 1));
    agent.stop().await;
    collector.stop().await;
}
