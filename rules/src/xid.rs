//! What an XID code means, and how bad it is, from NVIDIA's public XID
//! catalogue. Codes not listed are reported by number with a warning.

use crate::config::Severity;

/// (code, meaning, severity) for the codes operators meet most.
const KNOWN: &[(i64, &str, Severity)] = &[
    (
        13,
        "graphics engine exception (often an application fault)",
        Severity::Warning,
    ),
    (
        31,
        "GPU memory page fault (MMU fault; often an application bug)",
        Severity::Warning,
    ),
    (
        32,
        "invalid or corrupted push buffer stream",
        Severity::Warning,
    ),
    (
        43,
        "GPU stopped processing (channel reset)",
        Severity::Warning,
    ),
    (
        45,
        "preemptive cleanup after earlier errors",
        Severity::Warning,
    ),
    (48, "double-bit ECC error", Severity::Critical),
    (
        61,
        "internal micro-controller breakpoint",
        Severity::Warning,
    ),
    (62, "internal micro-controller halt", Severity::Critical),
    (
        63,
        "ECC page retirement or row remapping recorded",
        Severity::Warning,
    ),
    (
        64,
        "ECC page retirement or row remapping failed",
        Severity::Critical,
    ),
    (68, "video decoder (NVDEC) exception", Severity::Warning),
    (69, "graphics engine class error", Severity::Warning),
    (74, "NVLink error", Severity::Critical),
    (79, "GPU has fallen off the bus", Severity::Critical),
    (92, "high single-bit ECC error rate", Severity::Warning),
    (94, "contained ECC error", Severity::Warning),
    (95, "uncontained ECC error", Severity::Critical),
    (119, "GSP RPC timeout", Severity::Critical),
    (120, "GSP error", Severity::Critical),
];

pub fn meaning(code: i64) -> &'static str {
    KNOWN.iter().find(|(c, _, _)| *c == code).map_or(
        "not in Headroom's XID table; see NVIDIA's XID catalogue",
        |(_, m, _)| m,
    )
}

pub fn severity(code: i64) -> Severity {
    KNOWN
        .iter()
        .find(|(c, _, _)| *c == code)
        .map_or(Severity::Warning, |(_, _, s)| *s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_have_meanings_and_severities() {
        assert_eq!(meaning(79), "GPU has fallen off the bus");
        assert_eq!(severity(79), Severity::Critical);
        assert_eq!(severity(31), Severity::Warning);
        assert!(meaning(4242).contains("catalogue"));
        assert_eq!(severity(4242), Severity::Warning);
    }
}
