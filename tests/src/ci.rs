//! A test that needs what this machine lacks (a Postgres server, Chromium,
//! promtool, ...) skips here, loudly, and fails under `CI=true`, where
//! `.ci/run` installs everything and a skip would hide a missing step.

use std::fmt::Display;

/// Whether this is CI's run (`CI=true` or `CI=1`).
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Says why `what` is skipped, or panics with the reason under CI. The
/// caller returns right after.
pub fn skip_or_fail_under_ci(what: &str, why: impl Display) {
    assert!(!under_ci(), "CI=true and {what} cannot run: {why}");
    eprintln!("SKIPPING {what}: {why}");
}
