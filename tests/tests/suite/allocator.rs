//! PyTorch allocator statistics end to end: a real Python process with
//! `clients/python` enabled reports over the agent's Unix socket; the agent
//! (on the fake libnvidia-ml, which shows that very pid on a GPU) joins the
//! reports to the process's NVML samples; the collector stores them, shows
//! them in its API and raises fragmentation, retry and OOM alerts with their
//! remedies. A second process that claims the first one's pid is refused.
//! A process that also counts its weights, gradients and optimizer state
//! has its memory split in the API and on its GPU's page in Chromium, and
//! the time-to-OOM forecast on its GPU names its largest share.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use headroom_collector::Collector;
use headroom_rules::config::RulesConfig;
use headroom_sim::Scenario;
use headroom_store::Store;
use headroom_tests::harness::{
    KillOnDrop, RunningCollector, built, eventually, sim_agent_settings,
};

const NODE: &str = "alloc-node-01";
const GIB: u64 = 1 << 30;

fn python_client_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/python")
}

/// A training process as the package sees it: 30 GiB in tensors out of
/// 50 GiB reserved, one more allocation retry per report, and an OOM once
/// the test creates the flag file. The GPU's UUID comes without its `GPU-`
/// prefix, as PyTorch gives it.
const REPORTER: &str = r#"
import os, sys, time
import headroom_client

uuid = os.environ["TEST_GPU_UUID"]
calls = [0]

def provider():
    calls[0] += 1
    n = calls[0]
    return [{"index": 0, "uuid": uuid, "allocated_bytes": 30 << 30, "reserved_bytes": 50 << 30,
             "active_bytes": 31 << 30, "inactive_split_bytes": 12 << 30,
             "peak_allocated_bytes": 33 << 30, "alloc_retries": n, "ooms": 1 if os.path.exists(os.environ["TEST_OOM_FLAG"]) else 0}]

headroom_client.enable(stats_provider=provider, interval_s=0.2)
print("ready", flush=True)
time.sleep(600)
"#;

/// Claims to be the reporter (pid in argv) and says it holds almost nothing.
const IMPOSTOR: &str = r#"
import json, os, socket, sys, time
claimed = int(sys.argv[1])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
for _ in range(100):
    try:
        s.connect(os.environ["HEADROOM_ALLOCATOR_SOCKET"])
        break
    except OSError:
        time.sleep(0.1)
while True:
    report = {"v": 1, "pid": claimed, "ts_ms": int(time.time() * 1000), "devices": [
        {"index": 0, "allocated_bytes": 1, "reserved_bytes": 2, "active_bytes": 1,
         "inactive_split_bytes": 0, "peak_allocated_bytes": 1, "alloc_retries": 0, "ooms": 0}]}
    s.sendall((json.dumps(report) + "\n").encode())
    time.sleep(0.2)
"#;

fn python(script: &str, socket: &Path, env: &[(&str, &str)], args: &[String]) -> Child {
    Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .env("PYTHONPATH", python_client_dir())
        .env("HEADROOM_ALLOCATOR_SOCKET", socket)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 is needed for the allocator tests")
}

fn wait_ready(stdout: ChildStdout) {
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
}

/// One H100 with the training process (pid filled in, holding `level`)
/// and a neighbour that does not report (`neighbour`: its process table's
/// lines).
fn one_gpu(pid: u32, level: &str, neighbour: &str) -> String {
    format!(
        r#"
[[node]]
name = "{NODE}"
driver_version = "550.90.07"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
reserved = "512MiB"

[[node.gpu.process]]
pid = {pid}
name = "python train.py"
memory = {{ shape = "steady", level = "{level}" }}

[[node.gpu.process]]
{neighbour}
"#
    )
}

/// The reporter holds 52 GiB beside a 4 GiB evaluation.
fn scenario(pid: u32) -> String {
    one_gpu(
        pid,
        "52GiB",
        r#"pid = 4999999
name = "python eval.py"
memory = { shape = "steady", level = "4GiB" }"#,
    )
}

/// The UUID the fake NVML gives the scenario's first GPU: it does not
/// depend on the pids, so a probe with a stand-in pid learns it before the
/// real process is started.
fn first_gpu_uuid(dir: &Path, scenario: &str) -> String {
    let probe = dir.join("probe.toml");
    std::fs::write(&probe, scenario).unwrap();
    Scenario::load(&probe)
        .unwrap()
        .node(NODE)
        .unwrap()
        .inventory()[0]
        .uuid
        .clone()
}

/// An in-process collector on SQLite in `dir` with `rules`.
async fn collector_with(dir: &Path, rules: &str) -> RunningCollector {
    let rules = RulesConfig::parse(rules, Path::new("test-rules.toml")).unwrap();
    let url = format!("sqlite://{}", dir.join("headroom.db").display());
    let store: Arc<dyn Store> = headroom_store::connect(&url).await.unwrap();
    RunningCollector::start_collector(
        Collector::builder(store)
            .rules(rules)
            .build()
            .await
            .unwrap(),
    )
    .await
}

/// The agent binary on the fake libnvidia-ml showing `scenario_path`,
/// listening for allocator reports on `socket`, logging to `log_path`.
fn start_nvml_agent(
    dir: &Path,
    socket: &Path,
    scenario_path: &Path,
    collector: &RunningCollector,
    log_path: &Path,
) -> KillOnDrop {
    let log = std::fs::File::create(log_path).unwrap();
    KillOnDrop(
        Command::new(built("headroom-agent"))
            .args(["--source", "nvml", "--node-name", NODE])
            .arg("--nvml-library")
            .arg(headroom_tests::fake_nvml::library())
            .arg("--allocator-socket")
            .arg(socket)
            .arg("--spool-dir")
            .arg(dir.join("spool"))
            .args(["--collector-url", &collector.grpc_url()])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(["--poll-interval-ms", "50", "--sample-interval-ms", "250"])
            .env("HEADROOM_FAKE_NVML_SCENARIO", scenario_path)
            .env("HEADROOM_FAKE_NVML_NODE", NODE)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pytorch_allocator_reports_reach_the_api_and_raise_alerts_with_remedies() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("allocator.sock");

    let gpu_uuid = first_gpu_uuid(dir.path(), &scenario(1));
    let bare_uuid = gpu_uuid.trim_start_matches("GPU-").to_owned();

    let oom_flag = dir.path().join("oom-now");
    let mut reporter = python(
        REPORTER,
        &socket,
        &[
            ("TEST_GPU_UUID", &bare_uuid),
            ("TEST_OOM_FLAG", oom_flag.to_str().unwrap()),
        ],
        &[],
    );
    wait_ready(reporter.stdout.take().unwrap());
    let reporter_pid = reporter.id();
    let reporter = KillOnDrop(reporter);
    let scenario_path = dir.path().join("scenario.toml");
    std::fs::write(&scenario_path, scenario(reporter_pid)).unwrap();
    assert_eq!(
        Scenario::load(&scenario_path)
            .unwrap()
            .node(NODE)
            .unwrap()
            .inventory()[0]
            .uuid,
        gpu_uuid
    );

    let collector = collector_with(
        dir.path(),
        "[fragmentation]\nfor = \"0s\"\n\n[alloc_retries]\nwindow = \"1m\"\nmin_retries = 3\n",
    )
    .await;

    let log_path = dir.path().join("agent.log");
    let agent = start_nvml_agent(dir.path(), &socket, &scenario_path, &collector, &log_path);
    let agent_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let mut impostor = python(IMPOSTOR, &socket, &[], &[reporter_pid.to_string()]);
    drop(impostor.stdout.take());
    let impostor = KillOnDrop(impostor);

    // The process list shows the reporter's allocator beside its NVML memory.
    let training = eventually(
        "the reporter's allocator stats in /api/v1/processes",
        Duration::from_secs(40),
        || async {
            let procs = collector.get_json("/api/v1/processes").await;
            procs
                .as_array()?
                .iter()
                .find(|p| p["pid"] == reporter_pid && !p["allocator"].is_null())
                .cloned()
        },
    )
    .await;
    let allocator = &training["allocator"];
    assert_eq!(training["device_uuid"], gpu_uuid.as_str(), "{training}");
    assert_eq!(training["memory_used_bytes"], 52 * GIB);
    assert_eq!(allocator["allocated_bytes"], 30 * GIB, "{training}");
    assert_eq!(
        allocator["reserved_bytes"],
        50 * GIB,
        "reports count for the sender's pid as the kernel gives it, never the pid claimed"
    );
    assert_eq!(allocator["fragmentation_bytes"], 20 * GIB);
    assert_eq!(allocator["inactive_split_bytes"], 12 * GIB);
    let procs = collector.get_json("/api/v1/processes").await;
    let neighbour = procs
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == 4_999_999)
        .unwrap();
    assert!(neighbour["allocator"].is_null(), "{neighbour}");

    // Over time: one point per report, the retry counter climbing.
    let series = eventually("allocator points", Duration::from_secs(20), || async {
        let s = collector
            .get_json(&format!(
                "/api/v1/gpus/{gpu_uuid}/processes/{reporter_pid}/allocator"
            ))
            .await;
        (s["points"].as_array()?.len() >= 4).then_some(s)
    })
    .await;
    let points = series["points"].as_array().unwrap();
    let retries: Vec<u64> = points
        .iter()
        .map(|p| p["alloc_retries"].as_u64().unwrap())
        .collect();
    assert!(retries.windows(2).all(|w| w[0] < w[1]), "{retries:?}");
    assert!(points.iter().all(|p| p["fragmentation_bytes"] == 20 * GIB));

    // The job now hits an out-of-memory error. Alerts follow, each with
    // advice for the job's owner.
    std::fs::write(&oom_flag, "").unwrap();
    let alerts = eventually(
        "fragmentation, retry and OOM alerts",
        Duration::from_secs(30),
        || async {
            let alerts = collector.get_json("/api/v1/alerts").await;
            let list = alerts.as_array()?.clone();
            let firing = |rule: &str| {
                list.iter()
                    .find(|a| a["rule"] == rule && a["state"] == "firing")
                    .cloned()
            };
            let found = (
                firing("fragmentation"),
                firing("alloc_retries"),
                firing("allocator_oom"),
            );
            match found {
                (Some(f), Some(r), Some(o)) => Some((f, r, o)),
                _ => {
                    let rules: Vec<String> = list
                        .iter()
                        .map(|a| format!("{}:{}", a["rule"], a["state"]))
                        .collect();
                    eprintln!("alerts so far: {rules:?}");
                    None
                }
            }
        },
    )
    .await;
    let (fragmentation, retries_alert, oom) = alerts;
    assert_eq!(fragmentation["labels"]["pid"], reporter_pid.to_string());
    assert!(
        fragmentation["remedy"]
            .as_str()
            .unwrap()
            .contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        "{fragmentation}"
    );
    assert!(
        retries_alert["remedy"]
            .as_str()
            .unwrap()
            .contains("activation checkpointing"),
        "{retries_alert}"
    );
    assert_eq!(oom["severity"], "critical");
    assert!(
        oom["remedy"]
            .as_str()
            .unwrap()
            .contains("gradient accumulation"),
        "{oom}"
    );

    // The impostor was refused by name.
    let log = agent_log();
    assert!(
        log.contains(&format!("claims pid {reporter_pid} but the kernel says")),
        "{log}"
    );

    drop(impostor);
    drop(agent);
    drop(reporter);
    collector.stop().await;
}

/// A training process that counts its tensors, as `enable(model=,
/// optimizer=)` does with PyTorch: duck-typed CUDA tensors with storages
/// (torch is not needed), 8 GiB of bf16 weights (one of them tied, so
/// listed twice and counted once), 8 GiB of bf16 gradients and 32 GiB of
/// Adam moments in fp32, under an allocator that peaked at 58 GiB of its
/// 59 GiB reservation.
const COUNTING_TRAINER: &str = r#"
import os, time
import headroom_client

GIB = 1 << 30

class Device:
    type = "cuda"
    index = 0

class DType:
    def __init__(self, name):
        self.name = name
    def __str__(self):
        return "torch." + self.name

class Storage:
    def __init__(self, nbytes):
        self._nbytes = nbytes
    def nbytes(self):
        return self._nbytes
    def data_ptr(self):
        return id(self)

class Tensor:
    def __init__(self, nbytes, dtype):
        self.device = Device()
        self.dtype = dtype
        self.grad = None
        self._storage = Storage(nbytes)
    def untyped_storage(self):
        return self._storage

BF16, FP32 = DType("bfloat16"), DType("float32")

class Model:
    def __init__(self):
        self.embed = Tensor(4 * GIB, BF16)
        self.body = Tensor(4 * GIB, BF16)
    def parameters(self):
        # The output layer shares the embedding's weight.
        return iter([self.embed, self.body, self.embed])

class Adam:
    def __init__(self, params):
        self.state = {p: {"step": 3, "exp_avg": Tensor(8 * GIB, FP32), "exp_avg_sq": Tensor(8 * GIB, FP32)}
                      for p in params}

model = Model()
for p in (model.embed, model.body):
    p.grad = Tensor(4 * GIB, BF16)
optimizer = Adam([model.embed, model.body])

uuid = os.environ["TEST_GPU_UUID"]

def provider():
    return [{"index": 0, "uuid": uuid, "allocated_bytes": 56 * GIB, "reserved_bytes": 59 * GIB,
             "active_bytes": 56 * GIB, "inactive_split_bytes": GIB, "peak_allocated_bytes": 58 * GIB,
             "alloc_retries": 0, "ooms": 0}]

headroom_client.enable(stats_provider=provider, interval_s=0.2, model=model, optimizer=optimizer,
                       composition_interval_s=0.2)
print("ready", flush=True)
time.sleep(600)
"#;

/// The counting trainer (pid filled in) holds 60 GiB of an 80 GiB GPU; at
/// 20 s a neighbour takes every byte left.
fn crowded_scenario(pid: u32) -> String {
    one_gpu(
        pid,
        "60GiB",
        r#"pid = 4999998
name = "python find_batch_size.py"
user = "bob"
start_s = 20
memory = { shape = "steady", level = "19968MiB" }"#,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_counts_its_tensors_shows_where_its_memory_goes_and_gets_the_remedy_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("allocator.sock");
    let gpu_uuid = first_gpu_uuid(dir.path(), &crowded_scenario(1));
    let bare_uuid = gpu_uuid.trim_start_matches("GPU-").to_owned();

    let mut trainer = python(
        COUNTING_TRAINER,
        &socket,
        &[("TEST_GPU_UUID", &bare_uuid)],
        &[],
    );
    wait_ready(trainer.stdout.take().unwrap());
    let trainer_pid = trainer.id();
    let trainer = KillOnDrop(trainer);
    let scenario_path = dir.path().join("scenario.toml");
    std::fs::write(&scenario_path, crowded_scenario(trainer_pid)).unwrap();

    // Time to OOM warns as soon as the GPU is full; the watermark is quiet
    // so that the one alert read here is the forecast.
    let collector = collector_with(
        dir.path(),
        "[time_to_oom]\nfor = \"0s\"\n\n[watermark]\nenabled = false\n",
    )
    .await;
    let agent = start_nvml_agent(
        dir.path(),
        &socket,
        &scenario_path,
        &collector,
        &dir.path().join("agent.log"),
    );

    // The process list splits the trainer's 60 GiB as the driver sees it.
    let training = eventually(
        "the trainer's composition in /api/v1/processes",
        Duration::from_secs(40),
        || async {
            let procs = collector.get_json("/api/v1/processes").await;
            procs
                .as_array()?
                .iter()
                .find(|p| p["pid"] == trainer_pid && !p["allocator"]["breakdown"].is_null())
                .cloned()
        },
    )
    .await;
    let gpu_uuid_for_browser = gpu_uuid.clone();
    let b = &training["allocator"]["breakdown"];
    assert_eq!(b["weights_bytes"], 8 * GIB, "the tied weight once: {b}");
    assert_eq!(b["weights_dtype"], "bfloat16");
    assert_eq!(b["gradients_bytes"], 8 * GIB);
    assert_eq!(
        b["optimizer_state_bytes"],
        32 * GIB,
        "the step counters are no tensors"
    );
    assert_eq!(b["optimizer_state_dtype"], "float32");
    assert_eq!(
        b["activations_bytes"],
        10 * GIB,
        "the 58 GiB peak less 48 counted"
    );
    assert_eq!(b["cache_bytes"], GIB);
    assert_eq!(
        b["outside_allocator_bytes"], GIB,
        "60 GiB seen by NVML, 59 reserved"
    );
    assert_eq!(b["total_bytes"], 60 * GIB);

    // The GPU's page in Chromium shows the same shares and charts them.
    if headroom_tests::browser::available("the composition's browser check") {
        let base = collector.api("");
        let pid = trainer_pid.to_string();
        let artifacts = headroom_tests::browser::artifacts_dir();
        // The script blocks, on a thread of its own: the collector keeps
        // serving meanwhile.
        tokio::task::spawn_blocking(move || {
            let _turn = headroom_tests::browser::turn();
            headroom_tests::browser::run_script(
                "composition.mjs",
                &[
                    base.trim_end_matches('/'),
                    &gpu_uuid_for_browser,
                    &pid,
                    &artifacts.to_string_lossy(),
                ],
            );
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    }

    // Over time, each report carries the count.
    let series = collector
        .get_json(&format!(
            "/api/v1/gpus/{gpu_uuid}/processes/{trainer_pid}/allocator"
        ))
        .await;
    let points = series["points"].as_array().unwrap();
    assert!(
        points
            .iter()
            .rev()
            .take(2)
            .all(|p| p["optimizer_state_bytes"] == 32 * GIB),
        "{series}"
    );

    // The neighbour fills the GPU: the forecast names the trainer's largest
    // share and the remedy for it, with PyTorch's names.
    let forecast = eventually("a time-to-OOM alert", Duration::from_secs(60), || async {
        let alerts = collector.get_json("/api/v1/alerts").await;
        alerts
            .as_array()?
            .iter()
            .find(|a| a["rule"] == "time_to_oom")
            .cloned()
    })
    .await;
    let remedy = forecast["remedy"].as_str().unwrap();
    assert!(
        remedy.contains("Optimizer state is 32 GiB")
            && remedy.contains("torch.distributed.optim.ZeroRedundancyOptimizer"),
        "{forecast}"
    );

    drop(agent);
    drop(trainer);
    collector.stop().await;
}

/// A Slurm job of two ranks that count their tensors (as the simulator's
/// allocator model says) and a pod that does not.
const JOBS: &str = r#"
[[node]]
name = "jobs-node"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
count = 2

[[node.gpu.process]]
pid = 5100
name = "python pretrain.py"
user = "hana"
slurm_job_id = "900"
memory = { shape = "steady", level = "40GiB" }
allocator = { fragmentation = 0.0, composition = { weights = 0.32, gradients = 0.32, optimizer_state = 0.08, dtype = "float32" } }

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu.process]]
pid = 5200
name = "python serve.py"
user = "svc"
pod_uid = "0f1e2d3c-aaaa-bbbb-cccc-111122223333"
memory = { shape = "steady", level = "10GiB" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_sum_their_ranks_and_carry_the_remedy_for_their_largest_share() {
    let dir = tempfile::tempdir().unwrap();
    let collector = collector_with(dir.path(), "").await;
    let scenario = Scenario::from_toml_str(JOBS).unwrap();
    let agent = headroom_agent::start(
        sim_agent_settings(collector.grpc_url(), "jobs-node"),
        Box::new(headroom_agent::source::SimSource::new(&scenario, "jobs-node").unwrap()),
    )
    .unwrap();

    let jobs = eventually(
        "both jobs in /api/v1/jobs",
        Duration::from_secs(30),
        || async {
            let jobs = collector.get_json("/api/v1/jobs").await;
            let list = jobs.as_array()?;
            (list.len() == 2 && list[0]["reporting"] == 2).then(|| list.clone())
        },
    )
    .await;
    let training = &jobs[0];
    assert_eq!(
        (&training["kind"], &training["id"]),
        (&serde_json::json!("slurm"), &serde_json::json!("900")),
        "the largest job first: {training}"
    );
    assert_eq!(training["processes"], 2);
    assert_eq!(training["users"], serde_json::json!(["hana"]));
    assert_eq!(training["memory_used_bytes"], 80 * GIB);
    let b = &training["breakdown"];
    let weights = b["weights_bytes"].as_u64().unwrap();
    // Each rank: 40 GiB less 512 MiB of CUDA context reserved, 32 % of it
    // in fp32 weights.
    assert_eq!(
        weights,
        2 * (((40 * GIB - (512 << 20)) as f64 * 0.32) as u64),
        "{b}"
    );
    assert_eq!(b["weights_dtype"], "float32");
    assert_eq!(
        b["total_bytes"],
        80 * GIB,
        "the shares add up to what NVML sees"
    );
    assert_eq!(training["advice"]["share"], "weights");
    let advice = training["advice"]["text"].as_str().unwrap();
    assert!(
        advice.contains("in float32") && advice.contains("model.to(torch.bfloat16)"),
        "{advice}"
    );
    let pod = &jobs[1];
    assert_eq!(pod["kind"], "pod");
    // The processes view's summary draws the jobs that count their tensors.
    let summary = collector.get_json("/api/v1/processes/summary").await;
    assert_eq!(
        (&summary["jobs_counting"], &summary["jobs_silent"]),
        (&serde_json::json!(1), &serde_json::json!(1)),
        "{summary}"
    );
    assert_eq!(summary["largest_counting_jobs"][0], *training);
    // The dashboard's job filter reads only the Slurm jobs whose id
    // contains what was typed, every rank of each.
    for (query, expected) in [
        ("slurm_job_id=90", vec!["900"]),
        ("slurm_job_id=9000", vec![]),
    ] {
        let found = collector.get_json(&format!("/api/v1/jobs?{query}")).await;
        let ids: Vec<_> = found
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids, expected, "{query}");
    }
    let filtered = collector.get_json("/api/v1/jobs?slurm_job_id=90").await;
    assert_eq!(filtered[0], *training, "the job whole, both ranks");
    let refused = reqwest::get(collector.api("/api/v1/jobs?user=hana"))
        .await
        .unwrap();
    assert_eq!(refused.status(), reqwest::StatusCode::BAD_REQUEST);
    let error = refused.text().await.unwrap();
    assert!(error.contains("`user`"), "{error}");
    assert!(
        pod["breakdown"].is_null() && pod["advice"].is_null(),
        "{pod}"
    );

    agent.stop().await;
    collector.stop().await;
}
