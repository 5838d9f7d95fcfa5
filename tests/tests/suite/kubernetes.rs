//! The Kubernetes manifests in `deploy/kubernetes/` are valid against the
//! Kubernetes API schemas (`kubernetes-validate --strict`, from PyPI: unknown
//! fields fail), every `HEADROOM_*` variable they set is one the binary
//! they run actually reads, the kustomization applies every manifest and
//! names every image, and the optional ServiceMonitor (a CRD, which the
//! schemas do not cover) scrapes a port the collector's Service has.

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

fn manifest_text(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/kubernetes")
            .join(name),
    )
    .unwrap()
}

/// The `- item` lines of a top-level YAML list `key:`, or the values of
/// `field:` within its items.
fn list_values(text: &str, key: &str, field: Option<&str>) -> Vec<String> {
    let mut inside = false;
    let mut values = Vec::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        if !line.starts_with(' ') && !line.starts_with('-') {
            inside = line.trim_end() == format!("{key}:");
            continue;
        }
        if !inside {
            continue;
        }
        let item = line.trim_start().trim_start_matches("- ").trim();
        match field {
            None => values.push(item.to_owned()),
            Some(field) => {
                if let Some(value) = item.strip_prefix(&format!("{field}:")) {
                    values.push(value.trim().trim_matches('"').to_owned());
                }
            }
        }
    }
    values
}

#[test]
fn the_kustomization_applies_every_manifest_and_names_every_image() {
    let kustomization = manifest_text("kustomization.yaml");
    let resources = list_values(&kustomization, "resources", None);
    let expected: Vec<String> = manifests()
        .iter()
        .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
        .filter(|name| {
            name != "kustomization.yaml"
                && !name.ends_with(".example.yaml")
                && !name.ends_with(".optional.yaml")
        })
        .collect();
    let mut sorted = resources.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "resources in kustomization.yaml");

    let named = list_values(&kustomization, "images", Some("name"));
    let used: Vec<String> = resources
        .iter()
        .flat_map(|file| {
            manifest_text(file)
                .lines()
                .filter_map(|l| l.trim().strip_prefix("image:").map(|i| i.trim().to_owned()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!used.is_empty());
    for image in &used {
        assert!(
            named.contains(image),
            "{image} is not in kustomization.yaml's images"
        );
    }
    for image in &named {
        assert!(
            used.contains(image),
            "kustomization.yaml names {image}, which nothing runs"
        );
    }
    let tags = list_values(&kustomization, "images", Some("newTag"));
    assert_eq!(tags.len(), named.len(), "every image gets a tag");
}

#[test]
fn the_service_monitor_scrapes_a_port_of_the_collector_service() {
    let monitor = manifest_text("servicemonitor.optional.yaml");
    let collector = manifest_text("collector.yaml");
    let service = collector
        .split("\n---\n")
        .find(|doc| doc.contains("kind: Service\n"))
        .expect("collector.yaml has a Service");
    assert!(
        monitor.contains("app.kubernetes.io/name: headroom-collector")
            && service.contains("app.kubernetes.io/name: headroom-collector"),
        "the ServiceMonitor selects the Service by its label"
    );
    let port = monitor
        .lines()
        .find_map(|l| l.trim().strip_prefix("- port:"))
        .expect("an endpoint port")
        .trim();
    assert!(
        service.contains(&format!("- name: {port}\n")),
        "the Service has no port named {port}"
    );
    assert!(monitor.contains("path: /metrics"));
}
