//! The Kubernetes manifests in `deploy/kubernetes/` are valid against the
//! Kubernetes API schemas (`kubernetes-validate --strict`, from PyPI: unknown
//! fields fail), and every `HEADROOM_*` variable they set is one the binary
//! they run actually reads.

use headroom_tests::harness::built;
use std::path::{Path, PathBuf};
use std::process::Command;

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    files
}

#[test]
fn manifests_validate_against_the_kubernetes_schemas() {
    let out = match Command::new("kubernetes-validate")
        .arg("--strict")
        .args(manifests())
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            headroom_tests::skip_or_fail_under_ci(
                "the Kubernetes manifest check",
                format!("kubernetes-validate not available (pip install kubernetes-validate): {e}"),
            );
            return;
        }
    };
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{report}");
    assert!(!report.contains("ERROR"), "{report}");
}

#[test]
fn every_variable_the_manifests_set_is_one_the_binary_reads() {
    for (manifest, binary, help_args) in [
        ("agent-daemonset.yaml", "headroom-agent", vec!["--help"]),
        (
            "collector.yaml",
            "headroom-collector",
            vec!["serve", "--help"],
        ),
    ] {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy/kubernetes")
                .join(manifest),
        )
        .unwrap();
        let help = Command::new(built(binary))
            .args(&help_args)
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        let names: Vec<&str> = text
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("HEADROOM_"))
            .collect();
        assert!(!names.is_empty(), "{manifest}");
        for name in names {
            assert!(
                help.contains(&format!("env: {name}")),
                "{manifest} sets {name}, which {binary} does not read:\n{help}"
            );
        }
    }
}
