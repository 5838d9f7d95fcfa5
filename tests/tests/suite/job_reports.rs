//! A job's memory report end to end: a simulated Slurm job holds memory,
//! trips the watermark and ends; the collector writes its report, which the
//! API and the CLI give back with the peak, the alert and a suggestion, and
//! which its owner's route delivers, once.

use std::path::Path;
use std::time::Duration;

use headroom_rules::config::RulesConfig;
use headroom_tests::harness::{RunningCollector, built, eventually, start_sim_agent};
use headroom_tests::receiver::Receiver;
use serde_json::Value;

/// Job 777 holds 74 GiB of an 80 GiB GPU (92.5 %) for 8 s and ends; so do
/// two workers of process group 4000, in no Slurm job or pod; a process of
/// its own group keeps the node busy.
const SCENARIO: &str = r#"
[[node]]
name = "report-node"

[[node.gpu]]
model = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[node.gpu.process]]
pid = 777
name = "python train.py"
user = "carol"
slurm_job_id = "777"
end_s = 8
memory = { shape = "steady", level = "74GiB" }

[[node.gpu.process]]
pid = 9
name = "python notebook.py"
user = "dave"
memory = { shape = "steady", level = "1GiB" }

[[node.gpu.process]]
pid = 4001
name = "python worker.py --rank 0"
user = "dave"
process_group = 4000
end_s = 8
memory = { shape = "steady", level = "1GiB" }

[[node.gpu.process]]
pid = 4002
name = "python worker.py --rank 1"
user = "dave"
process_group = 4000
end_s = 8
memory = { shape = "steady", level = "1GiB" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_job_has_a_report_with_its_peak_its_alerts_and_a_suggestion() {
    let dir = tempfile::tempdir().unwrap();
    let vision = Receiver::start().await;
    let ops = Receiver::start().await;
    // carol's team gets her jobs' reports; ops, every alert and no report.
    let rules = RulesConfig::parse(
        &format!(
            "[watermark]\nfor = \"1s\"\n[job_report]\nend_after = \"2s\"\n\
             [notify]\ndefault_channels = [\"ops\"]\n\
             [notify.owners]\nusers = {{ carol = \"vision\" }}\n\
             [[notify.webhook]]\nname = \"vision\"\nurl = \"{}\"\nsecret = \"s\"\nmin_severity = \"critical\"\n\
             [[notify.webhook]]\nname = \"ops\"\nurl = \"{}\"\nsecret = \"s\"\n\
             [[notify.route]]\nmatchers = {{ rule = \"job_report\", team = \"vision\" }}\nchannels = [\"vision\"]\n",
            vision.url(),
            ops.url()
        ),
        Path::new("test-rules.toml"),
    )
    .unwrap();
    let collector = RunningCollector::start_sqlite_with_rules(dir.path(), rules).await;
    let agent = start_sim_agent(&collector, SCENARIO, "report-node");

    // While it runs there is no report, and the API says why.
    let early = reqwest::get(collector.api("/api/v1/jobs/777/report"))
        .await
        .unwrap();
    assert_eq!(early.status(), reqwest::StatusCode::NOT_FOUND);
    assert!(
        early
            .text()
            .await
            .unwrap()
            .contains("once the job has ended")
    );

    let report = eventually("job 777's report", Duration::from_secs(60), || async {
        let r = reqwest::get(collector.api("/api/v1/jobs/777/report"))
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.json::<serde_json::Value>().await.ok()
    })
    .await;
    assert_eq!(report["kind"], "slurm");
    assert_eq!(report["users"], serde_json::json!(["carol"]));
    assert_eq!(report["nodes"], serde_json::json!(["report-node"]));
    assert!(report["ended_at_ms"].is_i64(), "{report}");
    let gpu = &report["gpus"][0];
    assert_eq!(
        gpu["peak_bytes"],
        74u64 << 30,
        "the job's own memory, not the neighbour's"
    );
    assert_eq!(gpu["total_bytes"], 80u64 << 30);
    assert_eq!(gpu["headroom_bytes"], 6u64 << 30);
    assert!(
        gpu["suggestion"]
            .as_str()
            .unwrap()
            .starts_with("peaked at 74 GiB of 80 GiB: 6 GiB of headroom"),
        "{gpu}"
    );
    let alerts = report["alerts"].as_array().unwrap();
    assert!(
        alerts.iter().any(|a| a["rule"] == "watermark"),
        "the GPU crossed the watermark while the job ran: {report}"
    );
    // The neighbour without a job has no report; the process group that
    // ended has one, its two workers summed.
    let none = reqwest::get(collector.api("/api/v1/jobs/9/report"))
        .await
        .unwrap();
    assert_eq!(none.status(), reqwest::StatusCode::NOT_FOUND);
    let group: serde_json::Value = eventually(
        "process group 4000's report",
        Duration::from_secs(20),
        || async {
            let r = reqwest::get(collector.api("/api/v1/jobs/4000@report-node/report"))
                .await
                .ok()?;
            r.status().is_success().then_some(r.json().await.ok()?)
        },
    )
    .await;
    assert_eq!(group["kind"], "process_group", "{group}");
    assert_eq!(group["users"], serde_json::json!(["dave"]));
    assert_eq!(group["gpus"][0]["peak_bytes"], 2u64 << 30, "{group}");

    // The CLI prints it for the job's owner.
    let out = tokio::process::Command::new(built("headroom-collector"))
        .args(["job-report", "777", "--url", &collector.api("")])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with("Slurm job 777: users carol; nodes report-node\n"),
        "{text}"
    );
    assert!(
        text.contains("report-node GPU 0: peak 74 GiB of 80 GiB"),
        "{text}"
    );
    assert!(text.contains("watermark"), "{text}");

    // The owner's route delivers it, whatever the channel's min_severity.
    let bodies = |r: &Receiver| -> Vec<Value> {
        r.accepted()
            .iter()
            .filter_map(|r| serde_json::from_str(&r.body).ok())
            .collect()
    };
    let sent = eventually(
        "the report on vision's hook",
        Duration::from_secs(20),
        || async {
            bodies(&vision)
                .into_iter()
                .find(|b| b["kind"] == "job_report")
        },
    )
    .await;
    assert_eq!(sent["report"]["job_id"], "777", "{sent}");
    assert_eq!(sent["report"]["gpus"][0]["peak_bytes"], 74u64 << 30);
    assert_eq!(
        (
            &sent["labels"]["team"],
            &sent["labels"]["job"],
            &sent["labels"]["user"]
        ),
        (
            &Value::from("vision"),
            &Value::from("777"),
            &Value::from("carol")
        ),
        "{sent}"
    );
    // A few more passes of the report writer: still one delivery, and none
    // to the catch-all channel.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let reports = |r: &Receiver| {
        bodies(r)
            .iter()
            .filter(|b| b["kind"] == "job_report")
            .count()
    };
    assert_eq!(reports(&vision), 1);
    assert_eq!(reports(&ops), 0, "a report went to the catch-all channel");
    agent.stop().await;
    collector.stop().await;
}
