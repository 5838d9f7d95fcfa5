//! The notifiers operators already run, end to end: a real Alertmanager
//! (Debian's `prometheus-alertmanager`) that receives Headroom's alerts over
//! API v2 and pages through its own webhook receiver, and a local receiver
//! that checks PagerDuty's documented Events v2 body.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom_agent::AgentHandle;
use headroom_rules::config::RulesConfig;
use headroom_tests::harness::{
    KillOnDrop, RunningCollector, eventually, free_loopback_addr, start_sim_agent,
};
use headroom_tests::receiver::Receiver;
use serde_json::Value;

/// A collector on SQLite running `rules`, and an agent on the ramp to OOM
/// of the alerting tests.
async fn start(rules: &str) -> (RunningCollector, AgentHandle, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let rules = RulesConfig::parse(rules, Path::new("test-rules.toml")).unwrap();
    let collector = RunningCollector::start_sqlite_with_rules(dir.path(), rules).await;
    let agent = start_sim_agent(&collector, super::alerting::SCENARIO, "oom-node");
    (collector, agent, dir)
}

/// Alertmanager on a free loopback port, clustering off, routing every
/// alert at once to `receiver` and announcing resolutions.
fn start_alertmanager(dir: &Path, receiver: &Receiver) -> Option<(KillOnDrop, String)> {
    let config = dir.join("alertmanager.yml");
    std::fs::write(
        &config,
        format!(
            "route:\n  receiver: hook\n  group_by: [alertname]\n  group_wait: 0s\n  \
             group_interval: 1s\n  repeat_interval: 1h\n\
             receivers:\n  - name: hook\n    webhook_configs:\n      - url: {}\n        send_resolved: true\n",
            receiver.url()
        ),
    )
    .unwrap();
    let addr = free_loopback_addr();
    let alertmanager = KillOnDrop::tool(
        Command::new("prometheus-alertmanager")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.path={}", dir.join("am-data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--cluster.listen-address="),
        "the Alertmanager test",
        "prometheus-alertmanager",
    )?;
    Some((alertmanager, format!("http://{addr}")))
}

/// The webhook bodies Alertmanager sent for `alertname` with `status`.
fn paged(receiver: &Receiver, alertname: &str, status: &str) -> Vec<Value> {
    receiver
        .accepted()
        .iter()
        .filter_map(|r| serde_json::from_str::<Value>(&r.body).ok())
        .flat_map(|b| b["alerts"].as_array().cloned().unwrap_or_default())
        .filter(|a| a["labels"]["alertname"] == alertname && a["status"] == status)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_alertmanager_shows_the_alert_pages_through_its_route_and_resolves_it() {
    let am_dir = tempfile::tempdir().unwrap();
    let pager = Receiver::start().await;
    let Some((_alertmanager, am_url)) = start_alertmanager(am_dir.path(), &pager) else {
        return;
    };
    let http = reqwest::Client::new();
    let am_alerts = format!("{am_url}/api/v2/alerts");
    eventually(
        "Alertmanager to answer",
        Duration::from_secs(30),
        || async {
            let r = http.get(format!("{am_url}/-/ready")).send().await.ok()?;
            r.status().is_success().then_some(())
        },
    )
    .await;

    // An HA pair where one instance is down: the other still gets every alert.
    // Alerts are sent valid for 2 h (4 × 30 min), so within this test only
    // Headroom's explicit ends can take them off Alertmanager's list.
    let down = format!("http://{}", free_loopback_addr());
    let (collector, agent, _db) = start(&format!(
        "[notify]\ndashboard_url = \"http://headroom.test/\"\n\
         [[notify.alertmanager]]\nname = \"am\"\nurls = [\"{down}\", \"{am_url}\"]\nresend_interval = \"30m\"\n"
    ))
    .await;

    let shown = eventually(
        "the watermark alert in Alertmanager",
        Duration::from_secs(30),
        || async {
            let alerts: Value = http.get(&am_alerts).send().await.ok()?.json().await.ok()?;
            alerts
                .as_array()?
                .iter()
                .find(|a| a["labels"]["alertname"] == "watermark")
                .cloned()
        },
    )
    .await;
    let labels = &shown["labels"];
    assert_eq!(labels["rule"], "watermark");
    assert_eq!(labels["node"], "oom-node");
    assert_eq!(labels["gpu"], "0");
    assert!(
        labels["device_uuid"].as_str().unwrap().starts_with("GPU-"),
        "{shown}"
    );
    assert!(["warning", "critical"].contains(&labels["severity"].as_str().unwrap()));
    assert!(
        shown["annotations"]["summary"]
            .as_str()
            .unwrap()
            .contains("GPU 0 on oom-node"),
        "{shown}"
    );
    assert!(
        shown["generatorURL"]
            .as_str()
            .unwrap()
            .starts_with("http://headroom.test/?gpu=GPU-"),
        "{shown}"
    );
    assert_eq!(shown["status"]["state"], "active", "{shown}");

    // Alertmanager's own route pages, with Headroom's labels.
    let page = eventually("Alertmanager's page", Duration::from_secs(30), || async {
        paged(&pager, "watermark", "firing").into_iter().next()
    })
    .await;
    assert_eq!(page["labels"]["node"], "oom-node");

    // The job dies, memory falls, the alert resolves: Alertmanager no longer
    // lists it as active, and every label set it paged for (an escalation
    // from warning to critical is a second one) is announced as resolved.
    eventually(
        "the watermark alert to leave Alertmanager's active list",
        Duration::from_secs(60),
        || async {
            let alerts: Value = http.get(&am_alerts).send().await.ok()?.json().await.ok()?;
            (!alerts
                .as_array()?
                .iter()
                .any(|a| a["labels"]["alertname"] == "watermark"))
            .then_some(())
        },
    )
    .await;
    eventually(
        "Alertmanager's resolved notifications",
        Duration::from_secs(30),
        || async {
            let resolved: Vec<Value> = paged(&pager, "watermark", "resolved")
                .iter()
                .map(|a| a["labels"].clone())
                .collect();
            paged(&pager, "watermark", "firing")
                .iter()
                .all(|a| resolved.contains(&a["labels"]))
                .then_some(())
        },
    )
    .await;
    agent.stop().await;
    collector.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pagerduty_gets_a_trigger_and_a_resolve_with_one_dedup_key() {
    let pagerduty = Receiver::start().await;
    let (collector, agent, _db) = start(&format!(
        "[notify]\ndashboard_url = \"http://headroom.test/\"\n\
         [[notify.pagerduty]]\nname = \"pd\"\nrouting_key = \"R0UTINGKEY0123456789abcdef0123456\"\n\
         url = \"{}\"\nmin_severity = \"warning\"\n",
        pagerduty.url()
    ))
    .await;
    let events = || {
        pagerduty
            .accepted()
            .iter()
            .map(|r| serde_json::from_str::<Value>(&r.body).unwrap())
            .collect::<Vec<_>>()
    };
    let trigger = eventually("a PagerDuty trigger", Duration::from_secs(30), || async {
        events()
            .into_iter()
            .find(|e| e["event_action"] == "trigger" && e["payload"]["class"] == "watermark")
    })
    .await;
    assert_eq!(trigger["routing_key"], "R0UTINGKEY0123456789abcdef0123456");
    let dedup_key = trigger["dedup_key"].as_str().unwrap().to_owned();
    assert_eq!(dedup_key.len(), 24, "{trigger}");
    let payload = &trigger["payload"];
    assert_eq!(payload["source"], "oom-node");
    assert_eq!(payload["component"], "GPU 0");
    assert!(["warning", "critical"].contains(&payload["severity"].as_str().unwrap()));
    assert!(
        payload["summary"]
            .as_str()
            .unwrap()
            .contains("GPU 0 on oom-node")
    );
    let timestamp = payload["timestamp"].as_str().unwrap();
    assert!(
        timestamp.len() >= 20 && timestamp.ends_with('Z') && timestamp.contains('T'),
        "{timestamp}"
    );
    assert!(
        trigger["links"][0]["href"]
            .as_str()
            .unwrap()
            .starts_with("http://headroom.test/?gpu=GPU-")
    );

    let resolve = eventually("a PagerDuty resolve", Duration::from_secs(60), || async {
        events()
            .into_iter()
            .find(|e| e["event_action"] == "resolve" && e["dedup_key"] == dedup_key.as_str())
    })
    .await;
    assert_eq!(resolve["routing_key"], "R0UTINGKEY0123456789abcdef0123456");
    assert!(resolve.get("payload").is_none(), "{resolve}");
    let triggers = events()
        .iter()
        .filter(|e| e["event_action"] == "trigger" && e["dedup_key"] == dedup_key.as_str())
        .count();
    assert!(
        triggers <= 2,
        "one trigger, and one more only for an escalation"
    );
    agent.stop().await;
    collector.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_send_each_alert_to_its_owners_channels_only() {
    let vision = Receiver::start().await;
    let ops = Receiver::start().await;
    // The node belongs to team vision; its GPU alerts go to vision's hook and
    // nowhere else, the leak-free rest of the fleet to ops by default.
    let (collector, agent, _db) = start(&format!(
        "[notify]\ndefault_channels = [\"ops\"]\n\
         [notify.owners]\nnodes = {{ oom-node = \"vision\" }}\n\
         [[notify.webhook]]\nname = \"vision\"\nurl = \"{}\"\nsecret = \"s\"\n\
         [[notify.webhook]]\nname = \"ops\"\nurl = \"{}\"\nsecret = \"s\"\n\
         [[notify.route]]\nmatchers = {{ team = \"vision\" }}\nchannels = [\"vision\"]\n",
        vision.url(),
        ops.url()
    ))
    .await;
    let bodies = |r: &Receiver| {
        r.accepted()
            .iter()
            .map(|r| serde_json::from_str::<Value>(&r.body).unwrap())
            .collect::<Vec<_>>()
    };
    let resolved = eventually(
        "the watermark's resolution on vision's hook",
        Duration::from_secs(60),
        || async {
            bodies(&vision)
                .into_iter()
                .find(|b| b["alert"]["rule"] == "watermark" && b["status"] == "resolved")
        },
    )
    .await;
    assert_eq!(resolved["alert"]["labels"]["team"], "vision", "{resolved}");
    // Exactly once per notifier: one firing per severity the alert reached,
    // each with its own idempotency key.
    let firings: Vec<Value> = bodies(&vision)
        .into_iter()
        .filter(|b| b["alert"]["rule"] == "watermark" && b["status"] == "firing")
        .collect();
    assert!((1..=2).contains(&firings.len()), "{firings:?}");
    let mut keys: Vec<&str> = firings
        .iter()
        .map(|b| b["idempotency_key"].as_str().unwrap())
        .collect();
    keys.dedup();
    assert_eq!(keys.len(), firings.len());
    assert!(
        bodies(&ops)
            .iter()
            .all(|b| b["alert"]["labels"]["team"] != "vision"),
        "ops got vision's alerts"
    );
    agent.stop().await;
    collector.stop().await;
}

/// Three jobs whose allocators hit an OOM at once: a Slurm job under
/// account `speech`, a pod in namespace `serving`, and a pod in that
/// namespace labelled with its own team.
const OWNED_JOBS: &str = r#"
[[node]]
name = "shared-node"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu.process]]
pid = 2001
name = "python asr_train.py"
user = "erin"
slurm_job_id = "9001"
slurm_account = "speech"
memory = { shape = "steady", level = "40GiB" }
allocator = { oom_at_s = 1 }

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu.process]]
pid = 2002
name = "vllm serve"
user = "erin"
pod_uid = "5f1c2d3e-4a5b-4c6d-8e7f-9a0b1c2d3e4f"
pod_namespace = "serving"
memory = { shape = "steady", level = "40GiB" }
allocator = { oom_at_s = 1 }

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu.process]]
pid = 2003
name = "python embed.py"
user = "erin"
pod_uid = "6a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
pod_namespace = "serving"
pod_labels = { team = "vision", app = "embedder" }
memory = { shape = "steady", level = "40GiB" }
allocator = { oom_at_s = 1 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_slurm_account_and_a_pods_namespace_route_to_their_teams() {
    let audio = Receiver::start().await;
    let inference = Receiver::start().await;
    let vision = Receiver::start().await;
    let ops = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    // erin's own team would be ops: the account and the namespace win.
    let rules = RulesConfig::parse(
        &format!(
            "[notify]\ndefault_channels = [\"ops\"]\n\
             [notify.owners]\nusers = {{ erin = \"research\" }}\nteam_pod_label = \"team\"\n\
             accounts = {{ speech = \"audio\" }}\nnamespaces = {{ serving = \"inference\" }}\n\
             [[notify.webhook]]\nname = \"audio\"\nurl = \"{}\"\nsecret = \"s\"\n\
             [[notify.webhook]]\nname = \"inference\"\nurl = \"{}\"\nsecret = \"s\"\n\
             [[notify.webhook]]\nname = \"vision\"\nurl = \"{}\"\nsecret = \"s\"\n\
             [[notify.webhook]]\nname = \"ops\"\nurl = \"{}\"\nsecret = \"s\"\n\
             [[notify.route]]\nmatchers = {{ team = \"audio\" }}\nchannels = [\"audio\"]\n\
             [[notify.route]]\nmatchers = {{ team = \"inference\" }}\nchannels = [\"inference\"]\n\
             [[notify.route]]\nmatchers = {{ team = \"vision\" }}\nchannels = [\"vision\"]\n",
            audio.url(),
            inference.url(),
            vision.url(),
            ops.url()
        ),
        Path::new("test-rules.toml"),
    )
    .unwrap();
    let collector = RunningCollector::start_sqlite_with_rules(dir.path(), rules).await;
    let agent = start_sim_agent(&collector, OWNED_JOBS, "shared-node");
    let oom_on = |r: &Receiver| {
        r.accepted()
            .iter()
            .filter_map(|r| serde_json::from_str::<Value>(&r.body).ok())
            .find(|b| b["alert"]["rule"] == "allocator_oom" && b["status"] == "firing")
    };
    let speech = eventually(
        "the Slurm job's OOM on audio's hook",
        Duration::from_secs(30),
        || async { oom_on(&audio) },
    )
    .await;
    let labels = &speech["alert"]["labels"];
    assert_eq!(
        (&labels["account"], &labels["job"], &labels["team"]),
        (
            &Value::from("speech"),
            &Value::from("9001"),
            &Value::from("audio")
        ),
        "{speech}"
    );
    let serving = eventually(
        "the pod's OOM on inference's hook",
        Duration::from_secs(30),
        || async { oom_on(&inference) },
    )
    .await;
    let labels = &serving["alert"]["labels"];
    assert_eq!(
        (&labels["namespace"], &labels["team"]),
        (&Value::from("serving"), &Value::from("inference")),
        "{serving}"
    );
    let labelled = eventually(
        "the labelled pod's OOM on vision's hook",
        Duration::from_secs(30),
        || async { oom_on(&vision) },
    )
    .await;
    let labels = &labelled["alert"]["labels"];
    assert_eq!(
        (
            &labels["pod_label.team"],
            &labels["pod_label.app"],
            &labels["team"]
        ),
        (
            &Value::from("vision"),
            &Value::from("embedder"),
            &Value::from("vision")
        ),
        "{labelled}"
    );
    // The labelled pod's OOM went to its own team, not its namespace's.
    let inference_ooms = inference
        .accepted()
        .iter()
        .filter_map(|r| serde_json::from_str::<Value>(&r.body).ok())
        .filter(|b| b["alert"]["rule"] == "allocator_oom" && b["status"] == "firing")
        .count();
    assert_eq!(inference_ooms, 1);
    assert!(oom_on(&ops).is_none(), "ops got an owned job's OOM");
    agent.stop().await;
    collector.stop().await;
}

/// `serve` with a rules file whose webhook nobody answers: refused, naming
/// the key; with `--allow-unreachable-notifiers` it starts.
#[test]
fn a_collector_refuses_to_start_with_a_notifier_nobody_answers() {
    let dir = tempfile::tempdir().unwrap();
    let closed = free_loopback_addr();
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        format!(
            "[[notify.webhook]]\nname = \"ops\"\nurl = \"http://{closed}/hook?token=s3cret\"\nsecret = \"x\"\n"
        ),
    )
    .unwrap();
    let serve = |allow: bool| {
        let mut command = Command::new(headroom_tests::harness::built("headroom-collector"));
        command
            .args(["serve", "--grpc-listen", "127.0.0.1:0", "--http-listen"])
            .arg(free_loopback_addr().to_string())
            .arg("--rules")
            .arg(&rules)
            .env(
                "HEADROOM_DATABASE_URL",
                format!("sqlite://{}", dir.path().join("h.db").display()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if allow {
            command.arg("--allow-unreachable-notifiers");
        }
        command
    };
    let refused = serve(false).output().unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "notify.webhook \"ops\": url: cannot reach {closed}"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("s3cret"), "{stderr}");

    let mut started = KillOnDrop(serve(true).spawn().unwrap());
    std::thread::sleep(Duration::from_secs(3));
    assert!(started.is_running(), "allowed, it serves");
}
