//! dcgm-exporter's Grafana dashboard (12239) on Headroom's agent: the agent
//! binary reads the fake libnvidia-ml through nvml-wrapper with
//! `--dcgm-metric-names`, a real Prometheus (Debian's package) scrapes it,
//! and every query of the dashboard, with its `instance` and `gpu`
//! variables filled the way Grafana fills them, answers for every GPU.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom_tests::harness::{KillOnDrop, built, eventually, free_loopback_addr};
use serde_json::Value;

const NODE: &str = "fake-node-01";

/// The dashboard's variables and panels, as `grafana/dcgm-exporter-dashboard.json`
/// at dcgm-exporter's tag `4.5.3-4.8.2` writes them. Both variables are
/// `label_values` over the temperature, so a source without it leaves every
/// panel empty.
const VARIABLE_SOURCE: &str = "DCGM_FI_DEV_GPU_TEMP";
const PANELS: &[&str] = &[
    "DCGM_FI_DEV_GPU_TEMP{instance=~\"$instance\", gpu=~\"$gpu\"}",
    "avg(DCGM_FI_DEV_GPU_TEMP{instance=~\"$instance\", gpu=~\"$gpu\"})",
    "DCGM_FI_DEV_POWER_USAGE{instance=~\"$instance\", gpu=~\"$gpu\"}",
    "sum(DCGM_FI_DEV_POWER_USAGE{instance=~\"$instance\", gpu=~\"$gpu\"})",
    "DCGM_FI_DEV_SM_CLOCK{instance=~\"$instance\", gpu=~\"$gpu\"} * 1000000",
    "DCGM_FI_DEV_GPU_UTIL{instance=~\"$instance\", gpu=~\"$gpu\"}",
    "DCGM_FI_DEV_FB_USED{instance=~\"$instance\", gpu=~\"$gpu\"}",
];
/// DCGM's profiling module measures it; NVML has no call for it, so its
/// panel stays empty (docs/metrics.md says so).
const NOT_GIVEN: &str = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~\"$instance\", gpu=~\"$gpu\"}";

fn scenario_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvml-node.toml")
}

fn start_prometheus(dir: &Path, target: std::net::SocketAddr) -> Option<(KillOnDrop, String)> {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: gpu\n    \
             static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let addr = free_loopback_addr();
    let prometheus = KillOnDrop::tool(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}")),
        "the dcgm-exporter dashboard test",
        "prometheus",
    )?;
    Some((prometheus, format!("http://{addr}")))
}

async fn get(url: &str, query: &[(&str, &str)]) -> Option<Value> {
    let body: Value = reqwest::Client::new()
        .get(url)
        .query(query)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    (body["status"] == "success").then(|| body["data"].clone())
}

/// What Grafana sends for a multi-value variable set to All: the values as
/// one regex alternation.
fn all_of(values: &Value) -> String {
    let values: Vec<&str> = values
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    values.join("|")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_12239_charts_every_gpu_from_the_agent_with_dcgm_names() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = free_loopback_addr();
    let procfs = dir.path().join("proc");
    std::fs::create_dir_all(&procfs).unwrap();
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    // No collector: the agent polls and exports all the same.
    let _agent = KillOnDrop(
        Command::new(built("headroom-agent"))
            .args(["--source", "nvml", "--node-name", NODE])
            .args(["--dcgm-metric-names", "true"])
            .arg("--nvml-library")
            .arg(headroom_tests::fake_nvml::library())
            .arg("--procfs-root")
            .arg(&procfs)
            .arg("--no-allocator-socket")
            .args(["--collector-url", "http://127.0.0.1:9"])
            .args(["--metrics-listen", &metrics.to_string()])
            .env("HEADROOM_FAKE_NVML_SCENARIO", scenario_path())
            .env("HEADROOM_FAKE_NVML_NODE", NODE)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let Some((_prometheus, prometheus)) = start_prometheus(dir.path(), metrics) else {
        return;
    };
    let scenario =
        headroom_sim::Scenario::from_toml_str(&std::fs::read_to_string(scenario_path()).unwrap())
            .unwrap();
    let gpus = scenario.node(NODE).unwrap().inventory().len();

    // The variables, as Grafana's label_values asks Prometheus for them.
    let label_values = |label: &'static str| {
        let url = format!("{prometheus}/api/v1/label/{label}/values");
        async move {
            let values = get(&url, &[("match[]", VARIABLE_SOURCE)]).await?;
            (!values.as_array()?.is_empty()).then_some(values)
        }
    };
    let instances = eventually(
        "the dashboard's instance variable",
        Duration::from_secs(60),
        || label_values("instance"),
    )
    .await;
    assert_eq!(all_of(&instances), metrics.to_string());
    let gpu_values = eventually(
        "the dashboard's gpu variable, one value per GPU",
        Duration::from_secs(30),
        || async {
            let values = label_values("gpu").await?;
            (values.as_array()?.len() == gpus).then_some(values)
        },
    )
    .await;
    let fill = |expr: &str| {
        expr.replace("$instance", &all_of(&instances))
            .replace("$gpu", &all_of(&gpu_values))
    };

    let query = format!("{prometheus}/api/v1/query");
    for panel in PANELS {
        let expr = fill(panel);
        let result = get(&query, &[("query", &expr)])
            .await
            .unwrap_or_else(|| panic!("Prometheus refused {expr}"));
        let series = result["result"].as_array().unwrap();
        let per_gpu = !panel.starts_with("avg(") && !panel.starts_with("sum(");
        let expected = if per_gpu { gpus } else { 1 };
        // FB_USED also has a series per MIG instance, under its parent's gpu.
        assert!(
            series.len() >= expected,
            "{panel}: {} series, expected {expected}: {result}",
            series.len()
        );
        for s in series {
            let value: f64 = s["value"][1].as_str().unwrap().parse().unwrap();
            assert!(value.is_finite() && value >= 0.0, "{panel}: {s}");
        }
    }
    // Memory in MiB, as dcgm-exporter gives it: GPU 0 holds its two
    // processes' 40 GiB.
    let used = get(
        &query,
        &[("query", "DCGM_FI_DEV_FB_USED{gpu=\"0\",GPU_I_PROFILE=\"\"}")],
    )
    .await
    .unwrap();
    let mib: f64 = used["result"][0]["value"][1]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(mib, 40.0 * 1024.0, "{used}");

    let tensor = get(&query, &[("query", &fill(NOT_GIVEN))]).await.unwrap();
    assert_eq!(tensor["result"], Value::Array(vec![]), "{tensor}");
}
