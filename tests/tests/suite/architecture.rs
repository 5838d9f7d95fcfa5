//! The crate table of `docs/architecture.md` is what `cargo metadata` says:
//! one row per workspace package, and its "depends on" cell names exactly
//! the workspace crates that package links (optional ones included, dev
//! ones not). A crate added, renamed or given a new workspace dependency
//! without the page following fails here, naming the row.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

type DependsOn = BTreeMap<String, BTreeSet<String>>;

#[test]
fn the_crate_table_matches_cargo_metadata() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace root");
    let page = std::fs::read_to_string(root.join("docs/architecture.md"))
        .expect("docs/architecture.md is readable");
    let documented = documented_dependencies(&page);
    let actual = workspace_dependencies(root);
    let mut problems = Vec::new();
    for (package, links) in &actual {
        match documented.get(package) {
            None => problems.push(format!("{package}: no row in the crate table")),
            Some(named) if named != links => problems.push(format!(
                "{package}: the page says it depends on {named:?}, cargo metadata says {links:?}"
            )),
            Some(_) => {}
        }
    }
    for package in documented.keys().filter(|p| !actual.contains_key(*p)) {
        problems.push(format!(
            "{package}: a row for a package the workspace does not have"
        ));
    }
    assert!(
        problems.is_empty(),
        "docs/architecture.md's crate table is out of date:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_table_parser_reads_packages_and_their_dependencies() {
    let page = "intro\n\n| folder | package | owns | depends on |\n|---|---|---|---|\n\
                | [`a/`](../a) | `headroom-a` | things | none |\n\
                | [`b/`](../b) | `headroom-b` | more | `headroom-a`; with `x` also `headroom-c` |\n\n\
                | other | table |\n|---|---|\n| `headroom-z` | `headroom-y` |\n";
    let parsed = documented_dependencies(page);
    assert_eq!(parsed.len(), 2, "{parsed:?}");
    assert!(parsed["headroom-a"].is_empty());
    assert_eq!(
        parsed["headroom-b"],
        BTreeSet::from(["headroom-a".to_owned(), "headroom-c".to_owned()])
    );
}

/// Rows of the first table whose header has a "package" and a "depends on"
/// column: package → the `headroom-*` names in its "depends on" cell.
fn documented_dependencies(page: &str) -> DependsOn {
    let mut table = BTreeMap::new();
    let mut columns: Option<(usize, usize)> = None;
    for line in page.lines() {
        let line = line.trim();
        if !line.starts_with('|') {
            if !table.is_empty() {
                break;
            }
            columns = None;
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        match columns {
            None => {
                let package = cells.iter().position(|c| *c == "package");
                let depends = cells.iter().position(|c| c.starts_with("depends on"));
                if let (Some(package), Some(depends)) = (package, depends) {
                    columns = Some((package, depends));
                }
            }
            Some((package, depends)) => {
                let (Some(name), Some(deps)) = (cells.get(package), cells.get(depends)) else {
                    continue;
                };
                let name = name.trim_matches('`');
                if name.starts_with("headroom-") {
                    table.insert(name.to_owned(), crate_names(deps));
                }
            }
        }
    }
    table
}

fn crate_names(cell: &str) -> BTreeSet<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|name| name.starts_with("headroom-"))
        .map(str::to_owned)
        .collect()
}

/// Each workspace package → the workspace packages it depends on, not
/// counting dev- and build-dependencies.
fn workspace_dependencies(root: &Path) -> DependsOn {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let packages = metadata["packages"]
        .as_array()
        .expect("cargo metadata lists packages");
    let members: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    packages
        .iter()
        .filter_map(|package| {
            let name = package["name"].as_str()?;
            let links = package["dependencies"]
                .as_array()?
                .iter()
                .filter(|dep| dep["kind"].is_null())
                .filter_map(|dep| dep["name"].as_str())
                .filter(|dep| members.contains(dep))
                .map(str::to_owned)
                .collect();
            Some((name.to_owned(), links))
        })
        .collect()
}
