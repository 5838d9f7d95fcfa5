//! `deploy/release.sh`, in a copy of the repository (its committed files in
//! a fresh git repository): it sets the version everywhere the workspace
//! keeps it, dates the changelog's Unreleased notes as the release and opens
//! a new section, commits and tags; and it refuses what would make a bad
//! release. Packages and images are left out (`--no-build`): deb-check.sh
//! and the container image test build those.

use std::path::Path;
use std::process::{Command, Output};

fn git(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new("git")
        .args([
            "-c",
            "user.name=Release Test",
            "-c",
            "user.email=release@example.invalid",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn release(dir: &Path, args: &[&str]) -> Output {
    Command::new("bash")
        .arg("deploy/release.sh")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "Release Test")
        .env("GIT_AUTHOR_EMAIL", "release@example.invalid")
        .env("GIT_COMMITTER_NAME", "Release Test")
        .env("GIT_COMMITTER_EMAIL", "release@example.invalid")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The repository's tracked files, copied into a new git repository with
/// one commit.
fn copy_of_the_repository() -> tempfile::TempDir {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = git(&root, &["ls-files", "-z"]).stdout;
    let copy = tempfile::tempdir().unwrap();
    for file in files.split(|b| *b == 0).filter(|f| !f.is_empty()) {
        let file = std::str::from_utf8(file).unwrap();
        let from = root.join(file);
        if !from.is_file() {
            continue;
        }
        let to = copy.path().join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&from, &to).unwrap();
    }
    git(copy.path(), &["init", "-q"]);
    git(copy.path(), &["add", "-A"]);
    git(copy.path(), &["commit", "-q", "-m", "before the release"]);
    copy
}

#[test]
fn a_release_sets_the_version_dates_the_changelog_commits_and_tags() {
    let repo = copy_of_the_repository();
    let dir = repo.path();
    let changelog_before = std::fs::read_to_string(dir.join("CHANGELOG.md")).unwrap();
    let unreleased_notes: Vec<&str> = changelog_before
        .split("## [Unreleased]")
        .nth(1)
        .and_then(|rest| rest.split("\n## [").next())
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("- "))
        .collect();
    assert!(
        !unreleased_notes.is_empty(),
        "the changelog has unreleased notes"
    );

    for (args, refusal) in [
        (vec!["1.2"], "not a semantic version"),
        (vec![], "usage"),
        (vec!["9.9.9", "--sign"], "usage"),
    ] {
        let out = release(dir, &args);
        assert!(!out.status.success(), "{args:?} is refused");
        assert!(stderr(&out).contains(refusal), "{args:?}: {}", stderr(&out));
    }

    let out = release(dir, &["9.9.9", "--no-build"]);
    assert!(out.status.success(), "{}", stderr(&out));

    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
    assert!(
        manifest.contains("\nversion = \"9.9.9\"\n"),
        "the workspace version"
    );
    let lock = std::fs::read_to_string(dir.join("Cargo.lock")).unwrap();
    for member in ["headroom-agent", "headroom-collector", "headroom-store"] {
        assert!(
            lock.contains(&format!("name = \"{member}\"\nversion = \"9.9.9\"")),
            "{member} in Cargo.lock"
        );
    }
    let changelog = std::fs::read_to_string(dir.join("CHANGELOG.md")).unwrap();
    let today = String::from_utf8(
        Command::new("date")
            .args(["-u", "+%Y-%m-%d"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let heading = format!("## [9.9.9] - {}", today.trim());
    let (unreleased, released) = changelog
        .split_once(&heading)
        .unwrap_or_else(|| panic!("{heading} in\n{changelog}"));
    assert!(
        !unreleased
            .split("## [Unreleased]")
            .nth(1)
            .unwrap()
            .contains("- "),
        "a new, empty Unreleased section"
    );
    for note in &unreleased_notes {
        assert!(released.contains(note), "{note} is in the release's notes");
    }
    assert!(changelog.contains("[Unreleased]: https://"));
    assert!(changelog.contains("...v9.9.9"));

    let tags = String::from_utf8(git(dir, &["tag", "--list"]).stdout).unwrap();
    assert_eq!(tags.trim(), "v9.9.9");
    let subject = String::from_utf8(git(dir, &["log", "-1", "--format=%s"]).stdout).unwrap();
    assert_eq!(subject.trim(), "release 9.9.9");
    let status = String::from_utf8(git(dir, &["status", "--porcelain"]).stdout).unwrap();
    assert!(
        status.is_empty(),
        "everything the release changed is committed: {status}"
    );

    // Nothing new to say, or the same version again: no release.
    let out = release(dir, &["9.9.10", "--no-build"]);
    assert!(stderr(&out).contains("lists nothing"), "{}", stderr(&out));
    let out = release(dir, &["9.9.9", "--no-build"]);
    assert!(
        stderr(&out).contains("already at 9.9.9"),
        "{}",
        stderr(&out)
    );
    // Uncommitted changes are not released by accident.
    std::fs::write(dir.join("stray.txt"), "work in progress").unwrap();
    let out = release(dir, &["9.10.0", "--no-build"]);
    assert!(
        stderr(&out).contains("uncommitted changes"),
        "{}",
        stderr(&out)
    );
}
