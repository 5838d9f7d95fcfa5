//! `headroom-collector backtest --write-corpus` and `--score`, as an
//! operator scoring a rules file against labelled traces runs them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests fail loudly by design

use std::process::Command;

fn collector() -> Command {
    Command::new(env!("CARGO_BIN_EXE_headroom-collector"))
}

#[test]
fn the_written_corpus_scores_as_json_with_every_trace() {
    let dir = tempfile::tempdir().unwrap();
    let written = collector()
        .args(["backtest", "--write-corpus"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(written.status.success(), "{written:?}");
    let labels: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("labels.json")).unwrap()).unwrap();
    let names = labels.as_object().unwrap().len();
    assert!(names >= 25, "{names} traces");

    let scored = collector()
        .args(["backtest", "--json", "--score"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(scored.status.success(), "{scored:?}");
    let card: serde_json::Value = serde_json::from_slice(&scored.stdout).unwrap();
    assert_eq!(card["traces"].as_array().unwrap().len(), names);
    assert_eq!(card["rules"]["leak"]["recall"], 1.0);
    assert!(card["rules"]["leak"]["precision"].as_f64().unwrap() > 0.8);
    assert!(card["predict_linear"]["leak"].is_null());
}

#[test]
fn a_broken_labels_file_is_named_and_nothing_is_scored() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("labels.json"),
        "{\"a.csv\": {\"kind\": \"leak\"}}",
    )
    .unwrap();
    let scored = collector()
        .args(["backtest", "--score"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!scored.status.success());
    assert!(scored.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&scored.stderr);
    assert!(stderr.contains("labels.json"), "{stderr}");
    assert!(stderr.contains("leak_found_by_ms"), "{stderr}");
}

#[test]
fn one_mode_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let both = collector()
        .args(["backtest", "--trace", "t.csv", "--score"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!both.status.success());
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
}
