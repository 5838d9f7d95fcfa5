//! The Prometheus text exposition format, as both daemons' `/metrics` write it.

use std::fmt::Write as _;

/// Appends one metric family in the Prometheus text format: HELP, TYPE,
/// then one line per (labels, value); empty labels print the bare name.
/// Both daemons' `/metrics` endpoints write through it, so their exposition
/// is checked by one `promtool` test.
pub fn write_family<L, V>(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, V)>,
) where
    L: AsRef<str>,
    V: std::fmt::Display,
{
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in rows {
        let labels = labels.as_ref();
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}
