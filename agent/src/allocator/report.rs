//! One line a training process sends: its allocator's counters per device,
//! as `clients/python` writes them. Parsing rejects anything a well-behaved
//! client would not send, with a reason an operator can act on.

use serde::Deserialize;

/// A line longer than this is refused before it is parsed (64 devices take
/// about 20 KiB).
pub const MAX_LINE_BYTES: usize = 32 * 1024;
/// Devices one process can report (a DGX node has 8; MIG can make 56).
pub const MAX_DEVICES: usize = 64;
const MAX_UUID_BYTES: usize = 96;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReportError {
    #[error("not a report: {0}")]
    Malformed(String),
    #[error("unsupported report version {0} (this agent reads version 1)")]
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
}

/// A parsed report. `claimed_pid` is what the sender says it is; the
/// listener checks it against the kernel's word before trusting it.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub claimed_pid: u32,
    pub devices: Vec<DeviceReport>,
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
    if wire.v != 1 {
        return Err(ReportError::Version(wire.v));
    }
    if wire.devices.len() > MAX_DEVICES {
        return Err(ReportError::TooManyDevices(wire.devices.len()));
    }
    let devices = wire
        .devices
        .into_iter()
        .map(|d| device(d, received_ms))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Report {
        claimed_pid: wire.pid,
        devices,
    })
}

fn device(d: WireDevice, timestamp_ms: i64) -> Result<DeviceReport, ReportError> {
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
            (GOOD.replace("\"v\":1", "\"v\":2"), "version 2"),
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
}
