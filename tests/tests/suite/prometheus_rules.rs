//! The Prometheus-side rules in `deploy/prometheus/` for sites that only
//! scrape the agents: valid and unit-tested by promtool, kept equal to the
//! Kubernetes PrometheusRule, and reading only metrics a running agent
//! exports (a rule keyed on a name nobody exports never fires, silently).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use headroom_agent::source::SimSource;
use headroom_sim::Scenario;
use headroom_tests::harness::{eventually, sim_agent_settings};
use headroom_tests::skip_or_fail_under_ci;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(deploy(path)).unwrap()
}

/// Runs promtool with `args` in deploy/prometheus; false when it is missing.
fn promtool(args: &[&str]) -> bool {
    match Command::new("promtool")
        .args(args)
        .current_dir(deploy("prometheus"))
        .output()
    {
        Ok(out) => {
            assert!(
                out.status.success(),
                "promtool {args:?} failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            true
        }
        Err(e) => {
            skip_or_fail_under_ci(
                "the Prometheus rules check",
                format!("promtool (Debian's prometheus) is missing: {e}"),
            );
            false
        }
    }
}

#[test]
fn the_rules_are_valid_and_their_unit_tests_pass() {
    if promtool(&["check", "rules", "headroom.rules.yml"]) {
        promtool(&["test", "rules", "headroom.rules.test.yml"]);
    }
}

#[test]
fn the_prometheus_rule_holds_the_same_groups() {
    let rules = read("prometheus/headroom.rules.yml");
    let groups = &rules[rules.find("groups:").unwrap()..];
    let indented: String = groups
        .lines()
        .map(|l| {
            if l.is_empty() {
                "\n".to_owned()
            } else {
                format!("  {l}\n")
            }
        })
        .collect();
    let manifest = read("kubernetes/prometheusrule.optional.yaml");
    let spec = &manifest[manifest.find("\nspec:\n").unwrap() + "\nspec:\n".len()..];
    assert_eq!(
        spec, indented,
        "prometheusrule.optional.yaml's spec is not headroom.rules.yml's groups"
    );
}

/// Every `headroom_…` name in the rules' expressions.
fn metrics_read(rules: &str) -> Vec<String> {
    let mut names: Vec<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .flat_map(|expr| {
            expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("headroom_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

#[tokio::test]
async fn every_metric_the_rules_read_is_one_a_running_agent_exports() {
    let names = metrics_read(&read("prometheus/headroom.rules.yml"));
    assert!(names.len() >= 5, "{names:?}");
    let scenario = Scenario::from_toml_str(
        "[[node]]\nname = \"n1\"\n[[node.gpu]]\nmodel = \"NVIDIA H100 80GB HBM3\"\nmemory_total = \"80GiB\"\n\
         [[node.gpu.process]]\npid = 7\nname = \"python train.py\"\nuser = \"carol\"\n\
         memory = { shape = \"steady\", level = \"10GiB\" }\n",
    )
    .unwrap();
    // No collector: the agent reads and exports all the same.
    let agent = headroom_agent::start(
        headroom_agent::AgentSettings {
            metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
            ..sim_agent_settings("http://127.0.0.1:9".into(), "n1")
        },
        Box::new(SimSource::new(&scenario, "n1").unwrap()),
    )
    .unwrap();
    let url = format!("http://{}/metrics", agent.metrics_addr().unwrap());
    let exposition = eventually(
        "a GPU in the agent's metrics",
        Duration::from_secs(20),
        || async {
            let text = reqwest::get(&url).await.ok()?.text().await.ok()?;
            text.contains("headroom_gpu_memory_used_bytes{")
                .then_some(text)
        },
    )
    .await;
    for name in &names {
        assert!(
            exposition.contains(&format!("# TYPE {name} ")),
            "the rules read {name}, which the agent does not export"
        );
    }
    agent.stop().await;
}
