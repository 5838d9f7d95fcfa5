//! One line a training process sends: its allocator's counters per device,
//! as `clients/python` writes them, and from version 2 what its weights,
//! gradients and optimizer state hold. Parsing rejects anything a
//! well-behaved client would not send, with a reason an operator can act
//! on; a composition that does not fit the counters it came with is dropped
//! and named, and the counters kept.

use std::collections::BTreeMap;

use headroom_common::composition::{AllocatorFigures, Composition, Part};
use serde::Deserialize;

/// A line longer than this is refused before it is parsed (64 devices with
/// a composition each take about 50 KiB; without, about 20 KiB).
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Dtypes one part may list (the client merges past 8 into `other`).
const MAX_DTYPES_PER_PART: usize = 16;
const MAX_DTYPE_NAME_BYTES: usize = 32;
/// Devices one process can report (a DGX node has 8; MIG can make 56).
pub const MAX_DEVICES: usize = 64;
const MAX_UUID_BYTES: usize = 96;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReportError {
    #[error("not a report: {0}")]
    Malformed(String),
    #[error("unsupported report version {0} (this agent reads versions 1 and 2)")]
    Version(u32),
    #[error("{0} devices in one report; at most {MAX_DEVICES}")]
    TooManyDevices(usize),
    #[error("device {index}: {problem}")]
    Device { index: u32, problem: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireReport {
    v: u32,
    pid: u32,
    /// The sender's clock; the agent stamps reports with its own receive
    /// time instead, so a wrong clock cannot get a batch refused.
    #[serde(rename = "ts_ms")]
    _sender_ts_ms: i64,
    devices: Vec<WireDevice>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireDevice {
    index: u32,
    #[serde(default)]
    uuid: Option<String>,
    allocated_bytes: u64,
    reserved_bytes: u64,
    active_bytes: u64,
    inactive_split_bytes: u64,
    peak_allocated_bytes: u64,
    alloc_retries: u64,
    ooms: u64,
    #[serde(default)]
    composition: Option<WireComposition>,
}

/// Bytes per dtype name for each part the client counted.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireComposition {
    #[serde(default)]
    params: Option<BTreeMap<String, u64>>,
    #[serde(default)]
    grads: Option<BTreeMap<String, u64>>,
    #[serde(default)]
    optimizer: Option<BTreeMap<String, u64>>,
}

/// A parsed report. `claimed_pid` is what the sender says it is; the
/// listener checks it against the kernel's word before trusting it.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub claimed_pid: u32,
    pub devices: Vec<DeviceReport>,
    /// Compositions (or parts of them) dropped because they cannot be
    /// true of the counters they came with; the counters were kept.
    pub dropped: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeviceReport {
    /// The framework's device ordinal (after CUDA_VISIBLE_DEVICES).
    pub index: u32,
    /// Hex UUID without the `GPU-`/`MIG-` prefix, lower case; `None` when
    /// the framework did not say.
    pub uuid_key: Option<String>,
    pub stats: AllocatorStats,
}

/// The counters the collector stores for one process on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllocatorStats {
    pub timestamp_ms: i64,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub active_bytes: u64,
    pub inactive_split_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub alloc_retries: u64,
    pub ooms: u64,
    /// What the process counted in its own tensors, when it was asked to.
    pub composition: Option<Composition>,
}

/// The part of a GPU or MIG UUID both NVML and CUDA agree on: NVML says
/// `GPU-3f…`, PyTorch may say `3f…`.
pub fn uuid_key(uuid: &str) -> String {
    let bare = uuid
        .strip_prefix("GPU-")
        .or_else(|| uuid.strip_prefix("MIG-"))
        .unwrap_or(uuid);
    bare.to_ascii_lowercase()
}

/// Parses one line received at `received_ms` (the agent's clock).
pub fn parse(line: &[u8], received_ms: i64) -> Result<Report, ReportError> {
    let wire: WireReport =
        serde_json::from_slice(line).map_err(|e| ReportError::Malformed(e.to_string()))?;
    // Version 2 adds the composition; nothing else changed, so a version 1
    // line that carries one is read the same.
    if !matches!(wire.v, 1 | 2) {
        return Err(ReportError::Version(wire.v));
    }
    if wire.devices.len() > MAX_DEVICES {
        return Err(ReportError::TooManyDevices(wire.devices.len()));
    }
    let mut dropped = Vec::new();
    let devices = wire
        .devices
        .into_iter()
        .map(|d| device(d, received_ms, &mut dropped))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Report {
        claimed_pid: wire.pid,
        devices,
        dropped,
    })
}

fn composition(wire: WireComposition, index: u32) -> Result<Composition, ReportError> {
    let part =
        |name: &str, map: Option<BTreeMap<String, u64>>| -> Result<Option<Part>, ReportError> {
            let Some(map) = map else {
                return Ok(None);
            };
            let bad = |problem: String| ReportError::Device { index, problem };
            if map.len() > MAX_DTYPES_PER_PART {
                return Err(bad(format!(
                    "composition.{name} lists {} dtypes; at most {MAX_DTYPES_PER_PART}",
                    map.len()
                )));
            }
            if let Some(dtype) = map.keys().find(|k| {
                k.is_empty()
                    || k.len() > MAX_DTYPE_NAME_BYTES
                    || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            }) {
                return Err(bad(format!(
                    "composition.{name}: {:?} is not a dtype name",
                    dtype.chars().take(40).collect::<String>()
                )));
            }
            Ok(Some(Part::from_dtype_bytes(
                map.iter().map(|(k, v)| (k.as_str(), clamp(*v))),
            )))
        };
    Ok(Composition {
        weights: part("params", wire.params)?,
        gradients: part("grads", wire.grads)?,
        optimizer_state: part("optimizer", wire.optimizer)?,
    })
}

fn device(
    d: WireDevice,
    timestamp_ms: i64,
    dropped: &mut Vec<String>,
) -> Result<DeviceReport, ReportError> {
    let bad = |problem: String| ReportError::Device {
        index: d.index,
        problem,
    };
    // A caching allocator hands out memory it reserved: live tensors and
    // split blocks fit inside the reservation.
    for (name, value) in [
        ("allocated_bytes", d.allocated_bytes),
        ("active_bytes", d.active_bytes),
        ("inactive_split_bytes", d.inactive_split_bytes),
    ] {
        if value > d.reserved_bytes {
            return Err(bad(format!(
                "{name} = {value} exceeds reserved_bytes = {}",
                d.reserved_bytes
            )));
        }
    }
    let uuid_key = match d.uuid.as_deref() {
        None | Some("") => None,
        Some(u)
            if u.len() <= MAX_UUID_BYTES
                && u.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') =>
        {
            Some(uuid_key(u))
        }
        Some(u) => {
            return Err(bad(format!(
                "uuid {:?} is not a device UUID",
                u.chars().take(40).collect::<String>()
            )));
        }
    };
    let figures = AllocatorFigures {
        allocated: clamp(d.allocated_bytes),
        reserved: clamp(d.reserved_bytes),
        peak_allocated: clamp(d.peak_allocated_bytes),
    };
    let composition = match d.composition {
        None => None,
        Some(wire) => {
            let (kept, problems) = composition(wire, d.index)?.checked(figures.peak_tensors());
            dropped.extend(
                problems
                    .into_iter()
                    .map(|p| format!("device {}: composition dropped: {p}", d.index)),
            );
            (!kept.is_empty()).then_some(kept)
        }
    };
    Ok(DeviceReport {
        index: d.index,
        uuid_key,
        // The collector stores signed 64-bit values; clamping here keeps an
        // absurd counter from getting the whole batch refused there.
        stats: AllocatorStats {
            timestamp_ms,
            allocated_bytes: clamp(d.allocated_bytes),
            reserved_bytes: clamp(d.reserved_bytes),
            active_bytes: clamp(d.active_bytes),
            inactive_split_bytes: clamp(d.inactive_split_bytes),
            peak_allocated_bytes: clamp(d.peak_allocated_bytes),
            alloc_retries: clamp(d.alloc_retries),
            ooms: clamp(d.ooms),
            composition,
        },
    })
}

fn clamp(value: u64) -> u64 {
    value.min(i64::MAX as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"v":1,"pid":4242,"ts_ms":1700000000000,"devices":[{"index":0,"uuid":"GPU-AB12-cd","allocated_bytes":10,"reserved_bytes":30,"active_bytes":12,"inactive_split_bytes":5,"peak_allocated_bytes":20,"alloc_retries":2,"ooms":1}]}"#;

    #[test]
    fn reads_what_the_python_client_writes() {
        let report = parse(GOOD.as_bytes(), 5).unwrap();
        assert_eq!(report.claimed_pid, 4242);
        let d = &report.devices[0];
        assert_eq!(d.uuid_key.as_deref(), Some("ab12-cd"));
        assert_eq!(d.stats.reserved_bytes, 30);
        assert_eq!(d.stats.alloc_retries, 2);
        assert_eq!(
            d.stats.timestamp_ms, 5,
            "the agent's clock, not the sender's"
        );
    }

    #[test]
    fn uuid_is_optional_and_prefixes_do_not_matter() {
        let line = GOOD.replace(r#""uuid":"GPU-AB12-cd","#, "");
        assert_eq!(parse(line.as_bytes(), 1).unwrap().devices[0].uuid_key, None);
        assert_eq!(uuid_key("MIG-Ab"), uuid_key("ab"));
        assert_eq!(uuid_key("GPU-ab"), "ab");
    }

    #[test]
    fn refuses_impossible_or_foreign_input_with_a_reason() {
        let cases = [
            (GOOD.replace("\"v\":1", "\"v\":3"), "version 3"),
            (
                GOOD.replace("\"allocated_bytes\":10", "\"allocated_bytes\":31"),
                "allocated_bytes = 31 exceeds",
            ),
            (GOOD.replace("\"ooms\":1", "\"ooms\":-1"), "not a report"),
            (GOOD.replace("\"ooms\":1", "\"ooms\":1.5"), "not a report"),
            (
                GOOD.replace("\"pid\":4242", "\"pid\":\"4242\""),
                "not a report",
            ),
            (
                GOOD.replace("\"index\":0", "\"index\":0,\"extra\":1"),
                "unknown field",
            ),
            (
                GOOD.replace("GPU-AB12-cd", "GPU-\\n; rm -rf"),
                "is not a device UUID",
            ),
            ("not json".to_owned(), "not a report"),
        ];
        for (line, expected) in cases {
            let err = parse(line.as_bytes(), 1).unwrap_err().to_string();
            assert!(err.contains(expected), "{line}: {err}");
        }
        let many = format!(
            r#"{{"v":1,"pid":1,"ts_ms":1,"devices":[{}]}}"#,
            vec![r#"{"index":0,"allocated_bytes":0,"reserved_bytes":0,"active_bytes":0,"inactive_split_bytes":0,"peak_allocated_bytes":0,"alloc_retries":0,"ooms":0}"#; 65].join(",")
        );
        assert_eq!(
            parse(many.as_bytes(), 1),
            Err(ReportError::TooManyDevices(65))
        );
    }

    #[test]
    fn counters_past_what_the_collector_stores_are_clamped() {
        let line = GOOD
            .replace(
                "\"reserved_bytes\":30",
                "\"reserved_bytes\":18446744073709551615",
            )
            .replace("\"ooms\":1", "\"ooms\":18446744073709551615");
        let stats = parse(line.as_bytes(), 1).unwrap().devices[0].stats;
        assert_eq!(stats.reserved_bytes, i64::MAX as u64);
        assert_eq!(stats.ooms, i64::MAX as u64);
    }

    const WITH_COMPOSITION: &str = r#"{"v":2,"pid":7,"ts_ms":1,"devices":[{"index":1,"allocated_bytes":100,"reserved_bytes":200,"active_bytes":100,"inactive_split_bytes":0,"peak_allocated_bytes":150,"alloc_retries":0,"ooms":0,"composition":{"params":{"float32":30,"bfloat16":10},"grads":{},"optimizer":{"float32":60}}}]}"#;

    #[test]
    fn version_2_carries_what_weights_gradients_and_optimizer_state_hold() {
        let report = parse(WITH_COMPOSITION.as_bytes(), 9).unwrap();
        assert!(report.dropped.is_empty());
        let c = report.devices[0].stats.composition.unwrap();
        let weights = c.weights.unwrap();
        assert_eq!((weights.bytes, weights.dtype.as_str()), (40, "float32"));
        assert_eq!(
            c.gradients.unwrap().bytes,
            0,
            "an empty part is known to be zero"
        );
        assert_eq!(c.optimizer_state.unwrap().bytes, 60);
        let no_optimizer = WITH_COMPOSITION.replace(r#","optimizer":{"float32":60}"#, "");
        let c = parse(no_optimizer.as_bytes(), 9).unwrap().devices[0]
            .stats
            .composition
            .unwrap();
        assert_eq!(c.optimizer_state, None, "not counted, not zero");
    }

    #[test]
    fn a_composition_past_the_counters_is_dropped_and_named_and_the_counters_kept() {
        let line = WITH_COMPOSITION.replace(r#"{"float32":60}"#, r#"{"float32":600}"#);
        let report = parse(line.as_bytes(), 9).unwrap();
        let d = &report.devices[0];
        assert_eq!(d.stats.reserved_bytes, 200, "the allocator's figures stay");
        let c = d.stats.composition.unwrap();
        assert_eq!(c.optimizer_state, None);
        assert_eq!(c.weights.unwrap().bytes, 40, "the parts that fit stay");
        assert_eq!(report.dropped.len(), 1);
        assert!(
            report.dropped[0].contains("optimizer_state = 600 bytes exceeds"),
            "{:?}",
            report.dropped
        );
    }

    #[test]
    fn a_composition_that_is_not_one_is_refused_with_a_reason() {
        for (from, to, expected) in [
            (
                r#""grads":{}"#,
                r#""grads":{"x y":1}"#,
                "is not a dtype name",
            ),
            (r#""grads":{}"#, r#""grads":{"float32":-1}"#, "not a report"),
            (
                r#""grads":{}"#,
                r#""grads":{},"activations":{}"#,
                "unknown field",
            ),
        ] {
            let line = WITH_COMPOSITION.replace(from, to);
            let err = parse(line.as_bytes(), 1).unwrap_err().to_string();
            assert!(err.contains(expected), "{line}: {err}");
        }
    }
}
