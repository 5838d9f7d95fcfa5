//! Every way a scenario can be wrong yields an error naming what is wrong.
#![allow(clippy::unwrap_used)]

use headroom_sim::{Scenario, ScenarioError};

/// A valid one-node scenario whose parts the tests below break one at a time.
const BASE: &str = r#"
[[node]]
name = "node-a"
[[node.gpu]]
model = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
[[node.gpu.process]]
pid = 4242
name = "python train.py"
memory = { shape = "steady", level = "10GiB" }
"#;

fn with(old: &str, new: &str) -> String {
    assert!(BASE.contains(old), "test bug: {old:?} is not in BASE");
    BASE.replacen(old, new, 1)
}

fn error_of(text: &str) -> ScenarioError {
    match Scenario::from_toml_str(text) {
        Ok(_) => panic!("expected an error for:\n{text}"),
        Err(err) => err,
    }
}

#[track_caller]
fn assert_invalid(text: &str, mentions: &[&str]) {
    let err = error_of(text);
    assert!(
        matches!(err, ScenarioError::Invalid(_)),
        "expected Invalid, got {err:?}"
    );
    assert_mentions(&err, mentions);
}

#[track_caller]
fn assert_parse_error(text: &str, mentions: &[&str]) {
    let err = error_of(text);
    assert!(
        matches!(err, ScenarioError::Parse(_)),
        "expected Parse, got {err:?}"
    );
    assert_mentions(&err, mentions);
}

#[track_caller]
fn assert_mentions(err: &ScenarioError, mentions: &[&str]) {
    let message = err.to_string();
    for needle in mentions {
        assert!(
            message.contains(needle),
            "{needle:?} missing from:\n{message}"
        );
    }
}

#[test]
fn the_base_scenario_is_valid() {
    Scenario::from_toml_str(BASE).unwrap();
}

#[test]
fn empty_fleet() {
    assert_invalid("seed = 3", &["no nodes"]);
    assert_invalid("", &["no nodes"]);
}

#[test]
fn node_names() {
    let twice = format!("{BASE}{}", BASE.replace("4242", "4243"));
    assert_invalid(&twice, &["\"node-a\"", "twice"]);
    assert_invalid(&with("node-a", ""), &["empty name"]);
    assert_invalid(&with("node-a", "node a"), &["\"node a\"", "' '"]);
    assert_invalid(
        &with("node-a", &"n".repeat(254)),
        &["254 characters", "253"],
    );
    Scenario::from_toml_str(&with("node-a", &"n".repeat(253))).unwrap();
    assert_invalid(
        &with(
            "name = \"node-a\"",
            "name = \"node-a\"\ndriver_version = \" \"",
        ),
        &["node-a", "driver_version"],
    );
}

#[test]
fn nodes_need_gpus() {
    assert_invalid("[[node]]\nname = \"bare\"\n", &["\"bare\"", "no GPUs"]);
}

#[test]
fn gpu_fields() {
    assert_invalid(
        &with("model = \"NVIDIA A100-SXM4-80GB\"", "model = \"\""),
        &["gpu 0", "model"],
    );
    assert_invalid(
        &with("\"80GiB\"", "0"),
        &["node-a", "gpu 0", "memory_total"],
    );
    assert_invalid(
        &with("\"80GiB\"", "\"80GiB\"\ncount = 0"),
        &["gpu 0", "count", "got 0"],
    );
    assert_invalid(
        &with("\"80GiB\"", "\"80GiB\"\nutilization = 150"),
        &["gpu 0", "utilization", "150"],
    );
    assert_invalid(
        &with(
            "\"80GiB\"",
            "\"80GiB\"\nreserved = \"50GiB\"\nunattributed = \"40GiB\"",
        ),
        &["gpu 0", "reserved", "unattributed", "memory_total"],
    );
}

#[test]
fn process_fields() {
    assert_invalid(
        &with("pid = 4242", "pid = 0"),
        &["node-a", "gpu 0", "pid 0", "pid must be"],
    );
    assert_invalid(&with("pid = 4242", "pid = -7"), &["pid -7", "pid must be"]);
    assert_invalid(&with("pid = 4242", "pid = 5000000000"), &["pid must be"]);
    assert_invalid(
        &with("name = \"python train.py\"", "name = \"\""),
        &["pid 4242", "name"],
    );
    assert_invalid(
        &with("pid = 4242", "pid = 4242\nuid = -1"),
        &["pid 4242", "uid", "-1"],
    );
    assert_invalid(
        &with("pid = 4242", "pid = 4242\nuser = \"\""),
        &["pid 4242", "user"],
    );
    assert_invalid(
        &with("pid = 4242", "pid = 4242\nstart_s = -5"),
        &["pid 4242", "start_s"],
    );
    assert_invalid(
        &with("pid = 4242", "pid = 4242\nstart_s = 100\nend_s = 100"),
        &["pid 4242", "end_s"],
    );
    assert_invalid(
        &with("pid = 4242", "pid = 4242\nstart_s = nan"),
        &["pid 4242", "start_s"],
    );
}

#[test]
fn duplicate_pids_on_a_node() {
    let twice = format!(
        "{BASE}[[node.gpu]]\nmodel = \"L40S\"\nmemory_total = \"48GiB\"\n\
         [[node.gpu.process]]\npid = 4242\nname = \"other\"\n\
         memory = {{ shape = \"steady\", level = \"1GiB\" }}\n"
    );
    assert_invalid(&twice, &["node-a", "duplicate pid 4242", "gpu 0", "gpu 1"]);

    // The same pid on different nodes is fine.
    let other_node = format!("{BASE}{}", BASE.replace("node-a", "node-b"));
    Scenario::from_toml_str(&other_node).unwrap();

    // Replication makes copy 1 of pid 3242 collide with pid 4242.
    let replicated = format!(
        "{BASE}[[node.gpu]]\nmodel = \"L40S\"\nmemory_total = \"48GiB\"\ncount = 2\n\
         [[node.gpu.process]]\npid = 3242\nname = \"rank\"\n\
         memory = {{ shape = \"steady\", level = \"1GiB\" }}\n"
    );
    assert_invalid(
        &replicated,
        &["duplicate pid 4242", "copy 1 of pid 3242", "count"],
    );

    assert_invalid(
        &with("\"80GiB\"", "\"80GiB\"\ncount = 2").replace("4242", "4294967000"),
        &["pid 4294967000", "too large", "count = 2"],
    );
}

#[test]
fn shape_fields() {
    let memory = "memory = { shape = \"steady\", level = \"10GiB\" }";
    let cases: &[(&str, &[&str])] = &[
        (
            r#"memory = { shape = "step_leak", base = "1GiB", step = "1GiB", every_s = 0 }"#,
            &["pid 4242", "memory.every_s"],
        ),
        (
            r#"memory = { shape = "spike", base = "1GiB", peak = "2GiB", every_s = -5, duration_s = 1 }"#,
            &["pid 4242", "memory.every_s"],
        ),
        (
            r#"memory = { shape = "sawtooth", low = "9GiB", high = "1GiB", period_s = 60 }"#,
            &["pid 4242", "memory.low", "memory.high"],
        ),
        (
            r#"memory = { shape = "sawtooth", low = "1GiB", high = "9GiB", period_s = 0 }"#,
            &["pid 4242", "memory.period_s"],
        ),
        (
            r#"memory = { shape = "warmup_plateau", start = "9GiB", plateau = "1GiB", warmup_s = 60 }"#,
            &["pid 4242", "memory.plateau", "memory.start"],
        ),
        (
            r#"memory = { shape = "warmup_plateau", plateau = "1GiB", warmup_s = -1 }"#,
            &["pid 4242", "memory.warmup_s"],
        ),
        (
            r#"memory = { shape = "ramp_to_oom", start = "1GiB", rate_per_min = 0 }"#,
            &["pid 4242", "memory.rate_per_min"],
        ),
        (
            r#"memory = { shape = "spike", base = "1GiB", peak = "2GiB", every_s = 60, duration_s = 0 }"#,
            &["pid 4242", "memory.duration_s"],
        ),
    ];
    for (replacement, mentions) in cases {
        assert_invalid(&with(memory, replacement), mentions);
    }
}

#[test]
fn negative_leak_rates_are_rejected_at_their_line() {
    let memory = "memory = { shape = \"steady\", level = \"10GiB\" }";
    assert_parse_error(
        &with(
            memory,
            r#"memory = { shape = "linear_leak", base = "1GiB", rate_per_min = -64 }"#,
        ),
        &["line 10", "rate_per_min", "negative"],
    );
    assert_parse_error(
        &with(
            memory,
            r#"memory = { shape = "linear_leak", base = "1GiB", rate_per_min = "-64MiB" }"#,
        ),
        &["line 10", "negative"],
    );
}

#[test]
fn processes_must_fit_their_device() {
    assert_invalid(
        &with("level = \"10GiB\"", "level = \"90GiB\""),
        &["node-a", "gpu 0", "pid 4242", "level", "90 GiB", "80 GiB"],
    );
    // Reserved and unattributed memory are not available to processes.
    assert_invalid(
        &with(
            "\"80GiB\"",
            "\"80GiB\"\nreserved = \"60GiB\"\nunattributed = \"15GiB\"",
        ),
        &["pid 4242", "5 GiB"],
    );
    assert_invalid(
        &with(
            "level = \"10GiB\" }",
            "level = \"78GiB\", jitter = \"4GiB\" }",
        ),
        &["pid 4242", "level + jitter"],
    );
    assert_invalid(
        &with(
            "memory = { shape = \"steady\", level = \"10GiB\" }",
            "memory = { shape = \"ramp_to_oom\", start = \"80GiB\", rate_per_min = \"1GiB\" }",
        ),
        &["pid 4242", "start"],
    );
    // A leak may outgrow its device; only where it starts must fit.
    Scenario::from_toml_str(&with(
        "memory = { shape = \"steady\", level = \"10GiB\" }",
        "memory = { shape = \"linear_leak\", base = \"79GiB\", rate_per_min = \"1GiB\" }",
    ))
    .unwrap();
}

const MIG: &str = r#"
[[node]]
name = "mig-node"
[[node.gpu]]
model = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
[[node.gpu.mig]]
profile = "3g.40gb"
memory_total = "40GiB"
[[node.gpu.mig.process]]
pid = 7
name = "jupyter"
memory = { shape = "steady", level = "10GiB" }
[[node.gpu.mig]]
profile = "2g.20gb"
memory_total = "20GiB"
"#;

#[test]
fn mig_layout() {
    Scenario::from_toml_str(MIG).unwrap();
    assert_invalid(
        &MIG.replacen("\"40GiB\"", "\"70GiB\"", 1),
        &["mig-node", "gpu 0", "MIG", "90 GiB", "80 GiB"],
    );
    assert_invalid(
        &MIG.replacen("level = \"10GiB\"", "level = \"30GiB\"", 1)
            .replacen("\"40GiB\"", "\"20GiB\"", 1),
        &["mig-node", "pid 7", "30 GiB", "MIG instance 3g.40gb"],
    );
    assert_invalid(
        &format!("{MIG}gpu_instance_id = 1\n"),
        &["mig 1 (2g.20gb)", "gpu_instance_id 1", "mig 0"],
    );
    assert_invalid(
        &format!("{MIG}gpu_instance_id = -1\n"),
        &["mig 1 (2g.20gb)", "gpu_instance_id", "-1"],
    );
    assert_invalid(&MIG.replace("\"2g.20gb\"", "\"\""), &["mig 1", "profile"]);
    assert_invalid(&MIG.replace("\"20GiB\"", "0"), &["mig 1", "memory_total"]);
}

#[test]
fn processes_on_a_mig_gpu_belong_in_an_instance() {
    let text = MIG.replacen(
        "[[node.gpu.mig]]",
        "[[node.gpu.process]]\npid = 99\nname = \"stray\"\n\
         memory = { shape = \"steady\", level = \"1GiB\" }\n[[node.gpu.mig]]",
        1,
    );
    assert_invalid(
        &text,
        &[
            "mig-node",
            "gpu 0",
            "MIG mode",
            "pid 99",
            "[[node.gpu.mig.process]]",
        ],
    );
}

#[test]
fn unknown_fields_name_the_field_and_line() {
    assert_parse_error(&format!("sede = 1\n{BASE}"), &["sede", "line 1"]);
    assert_parse_error(
        &with("name = \"node-a\"", "name = \"node-a\"\ngpus = 8"),
        &["gpus", "line 4"],
    );
    assert_parse_error(
        &with("\"80GiB\"", "\"80GiB\"\nmemroy = 1"),
        &["memroy", "line 7"],
    );
    assert_parse_error(
        &with("pid = 4242", "pid = 4242\nusr = \"x\""),
        &["usr", "line 9"],
    );
    assert_parse_error(
        &with(
            "level = \"10GiB\" }",
            "level = \"10GiB\", jiter = \"1GiB\" }",
        ),
        &["jiter", "line 10"],
    );
    assert_parse_error(&format!("{MIG}profiel = \"x\"\n"), &["profiel"]);
}

#[test]
fn bad_byte_strings_name_the_value_and_line() {
    assert_parse_error(
        &with("\"80GiB\"", "\"12 parsecs\""),
        &[
            "line 6",
            "memory_total",
            "12 parsecs",
            "unknown unit",
            "GiB",
        ],
    );
    assert_parse_error(&with("\"80GiB\"", "\"80gb\""), &["80gb", "unknown unit"]);
    assert_parse_error(
        &with("\"80GiB\"", "\"80GiB\"\npcie_tx = \"2GB\""),
        &["line 7", "pcie_tx", "/s"],
    );
    assert_parse_error(&with("\"80GiB\"", "80.5"), &["line 6", "float"]);
}

#[test]
fn unknown_shapes_are_rejected() {
    assert_parse_error(
        &with("shape = \"steady\"", "shape = \"wobbly\""),
        &["line 10", "wobbly", "linear_leak", "ramp_to_oom"],
    );
}

#[test]
fn missing_and_mistyped_fields() {
    assert_parse_error(
        &with("memory = { shape = \"steady\", level = \"10GiB\" }\n", ""),
        &["memory"],
    );
    assert_parse_error(&with("model = \"NVIDIA A100-SXM4-80GB\"\n", ""), &["model"]);
    assert_parse_error(&with("pid = 4242", "pid = \"4242\""), &["line 8", "pid"]);
}

#[test]
fn syntax_errors_name_the_line() {
    assert_parse_error("[[node]]\nname = \"a\"\n[[node.gpu]\n", &["line 3"]);
}

#[test]
fn all_problems_are_reported_at_once() {
    let text = with("pid = 4242", "pid = 0").replace("\"80GiB\"", "\"80GiB\"\nutilization = 101");
    assert_invalid(&text, &["2 problems", "pid must be", "utilization"]);
}
