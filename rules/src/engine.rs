//! Evaluates every rule on every sample as it arrives, one state machine per
//! series (GPU, MIG instance, process, node), so an alert costs one sample
//! interval, not a scrape plus an evaluation cycle. No I/O: the caller feeds
//! observations and persists the changes this returns.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

use crate::allocator::{AllocatorObservation, AllocatorWatch};
use crate::config::{RulesConfig, Severity};
use crate::leak::LeakDetector;
use crate::lifecycle::{Lifecycle, Phase, Transition};
use crate::oom::OomPredictor;
use crate::remedy;
use headroom_common::HumanBytes;

/// A process not seen for this long has exited; its state is dropped and its
/// alerts resolve.
const PROCESS_GONE_MS: i64 = 5 * 60_000;
/// Alerts restored after a restart whose series never reappears resolve
/// after this long.
const RESTORED_GRACE_MS: i64 = 10 * 60_000;

/// One interval of one GPU or MIG instance.
#[derive(Debug, Clone)]
pub struct DeviceObservation<'a> {
    pub node: &'a str,
    pub device_uuid: &'a str,
    pub gpu_index: u32,
    pub mig_profile: Option<&'a str>,
    pub timestamp_ms: i64,
    pub used_last: u64,
    pub used_max: u64,
    pub reserved: u64,
    pub total: u64,
    /// Memory held by the processes the agent could see on this device, when
    /// the agent reports processes for it.
    pub attributed: Option<u64>,
}

/// One interval of one process on one device.
#[derive(Debug, Clone)]
pub struct ProcessObservation<'a> {
    pub node: &'a str,
    pub device_uuid: &'a str,
    pub gpu_index: u32,
    pub pid: u32,
    pub start_time_ms: i64,
    pub name: &'a str,
    pub user: &'a str,
    pub slurm_job_id: &'a str,
    pub pod_uid: &'a str,
    pub container_id: &'a str,
    pub timestamp_ms: i64,
    pub used_last: u64,
    pub used_max: u64,
    /// The newest report of the process's own allocator, when it reports.
    pub allocator: Option<AllocatorObservation>,
}

/// An event the agent reported (XID, lost GPU, hung NVML call, …).
#[derive(Debug, Clone)]
pub struct EventObservation<'a> {
    pub node: &'a str,
    pub device_uuid: Option<&'a str>,
    pub gpu_index: Option<u32>,
    /// The event kind as stored: `xid`, `gpu_lost`, `nvml_hung`, …
    pub kind: &'a str,
    pub code: i64,
    pub detail: &'a str,
    pub timestamp_ms: i64,
}

/// A transition of one alert, with everything a notification needs.
#[derive(Debug, Clone, PartialEq)]
pub struct AlertChange {
    /// Stable across restarts and collectors: rule plus the series identity.
    pub fingerprint: String,
    pub rule: &'static str,
    pub transition: Transition,
    pub severity: Severity,
    pub at_ms: i64,
    pub labels: BTreeMap<String, String>,
    pub summary: String,
    pub details: serde_json::Value,
    /// What the job's owner can do about it; empty when the rule has none.
    pub remedy: String,
}

/// An alert the store holds as active, handed back after a restart so the
/// engine neither forgets it nor fires it twice.
#[derive(Debug, Clone)]
pub struct RestoredAlert {
    pub fingerprint: String,
    pub rule: String,
    pub severity: Severity,
    pub firing: bool,
    pub since_ms: i64,
    pub labels: BTreeMap<String, String>,
}

pub fn fingerprint(rule: &str, identity: &[(&str, &str)]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(rule.as_bytes());
    for (k, v) in identity {
        hasher.update(b"\n");
        hasher.update(k.as_bytes());
        hasher.update(b"=");
        hasher.update(v.as_bytes());
    }
    hasher.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[derive(Debug)]
struct Tracked {
    fingerprint: String,
    lifecycle: Lifecycle,
}

impl Tracked {
    fn new(fingerprint: String, restored: &mut HashMap<String, RestoredAlert>) -> Self {
        let lifecycle = match restored.remove(&fingerprint) {
            Some(r) if r.firing => Lifecycle {
                phase: Phase::Firing {
                    since_ms: r.since_ms,
                    severity: r.severity,
                },
            },
            Some(r) => Lifecycle {
                phase: Phase::Pending {
                    since_ms: r.since_ms,
                    severity: r.severity,
                },
            },
            None => Lifecycle::default(),
        };
        Self {
            fingerprint,
            lifecycle,
        }
    }
}

#[derive(Debug)]
struct DeviceState {
    labels: BTreeMap<String, String>,
    watermark: Tracked,
    oom: Tracked,
    unattributed: Tracked,
    predictor: OomPredictor,
}

#[derive(Debug)]
struct ProcessState {
    labels: BTreeMap<String, String>,
    leak: Tracked,
    watermark: Tracked,
    fragmentation: Tracked,
    alloc_retries: Tracked,
    allocator_oom: Tracked,
    detector: LeakDetector,
    allocator: AllocatorWatch,
    last_seen_ms: i64,
}

/// Allocator reports older than this no longer hold an allocator alert up.
const ALLOCATOR_STALE_MS: i64 = 60_000;

/// Advice goes with a pending or firing alert, not with its resolution.
fn with_remedy(
    change: Option<AlertChange>,
    remedy: impl FnOnce() -> String,
) -> Option<AlertChange> {
    change.map(|mut c| {
        if matches!(
            c.transition,
            Transition::Pending { .. } | Transition::Firing { .. }
        ) {
            c.remedy = remedy();
        }
        c
    })
}

/// One event-driven alert: an XID code on a GPU, or a GPU lost or stalled.
#[derive(Debug)]
struct EventState {
    rule: &'static str,
    tracked: Tracked,
    labels: BTreeMap<String, String>,
    last_event_ms: i64,
}

type EventKey = (String, String, &'static str, i64);

#[derive(Debug)]
struct NodeState {
    silent: Tracked,
    last_seen_ms: i64,
    interval_ms: i64,
}

#[derive(Debug)]
pub struct Engine {
    config: RulesConfig,
    devices: HashMap<String, DeviceState>,
    processes: HashMap<(String, u32, i64), ProcessState>,
    nodes: HashMap<String, NodeState>,
    events: HashMap<EventKey, EventState>,
    restored: HashMap<String, RestoredAlert>,
    restored_at_ms: i64,
}

fn gib_pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        (part as f64 * 1000.0 / total as f64).round() / 10.0
    }
}

fn device_name(labels: &BTreeMap<String, String>) -> String {
    let node = labels.get("node").map_or("", String::as_str);
    let gpu = labels.get("gpu").map_or("", String::as_str);
    match labels.get("mig_profile") {
        Some(profile) => format!("GPU {gpu} (MIG {profile}) on {node}"),
        None => format!("GPU {gpu} on {node}"),
    }
}

fn process_name(labels: &BTreeMap<String, String>) -> String {
    let mut who = format!(
        "pid {} ({})",
        labels.get("pid").map_or("", String::as_str),
        labels.get("process").map_or("", String::as_str)
    );
    if let Some(user) = labels.get("user") {
        who.push_str(&format!(" of {user}"));
    }
    if let Some(job) = labels.get("job") {
        who.push_str(&format!(", Slurm job {job}"));
    }
    if let Some(pod) = labels.get("pod") {
        who.push_str(&format!(", pod {pod}"));
    }
    who
}

fn minutes(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    if s < 120 {
        format!("{s} s")
    } else if s < 7200 {
        format!("{} min", s / 60)
    } else {
        format!("{:.1} h", s as f64 / 3600.0)
    }
}

impl Engine {
    pub fn new(config: RulesConfig) -> Self {
        Self {
            config,
            devices: HashMap::new(),
            processes: HashMap::new(),
            nodes: HashMap::new(),
            events: HashMap::new(),
            restored: HashMap::new(),
            restored_at_ms: 0,
        }
    }

    /// Replaces the rules (a reload) while keeping every series' state.
    pub fn set_config(&mut self, config: RulesConfig) {
        self.config = config;
    }

    pub fn config(&self) -> &RulesConfig {
        &self.config
    }

    /// Hands over the alerts the store holds as active (after a restart).
    pub fn restore(&mut self, alerts: Vec<RestoredAlert>, now_ms: i64) {
        self.restored_at_ms = now_ms;
        for a in alerts {
            self.restored.insert(a.fingerprint.clone(), a);
        }
    }

    fn change(
        tracked: &mut Tracked,
        rule: &'static str,
        at_ms: i64,
        condition: Option<Severity>,
        for_ms: i64,
        labels: &BTreeMap<String, String>,
        summary: impl FnOnce() -> (String, serde_json::Value),
    ) -> Option<AlertChange> {
        let before = tracked.lifecycle.phase;
        let transition = tracked.lifecycle.step(at_ms, condition, for_ms)?;
        // A resolution carries the severity it fired with, so it reaches
        // the same channels the firing did.
        let severity = match (tracked.lifecycle.phase, before) {
            (Phase::Pending { severity, .. } | Phase::Firing { severity, .. }, _)
            | (Phase::Inactive, Phase::Pending { severity, .. } | Phase::Firing { severity, .. }) => {
                severity
            }
            (Phase::Inactive, Phase::Inactive) => condition.unwrap_or(Severity::Info),
        };
        let (summary, details) = summary();
        Some(AlertChange {
            fingerprint: tracked.fingerprint.clone(),
            rule,
            transition,
            severity,
            at_ms,
            labels: labels.clone(),
            summary,
            details,
            remedy: String::new(),
        })
    }

    pub fn observe_device(&mut self, o: &DeviceObservation<'_>) -> Vec<AlertChange> {
        let mut out = Vec::new();
        self.note_node(o.node, o.timestamp_ms, &mut out);
        self.device_reports_again(o.node, o.device_uuid, o.timestamp_ms, &mut out);
        let restored = &mut self.restored;
        let oom_config = self.config.time_to_oom.oom_config();
        let state = self
            .devices
            .entry(o.device_uuid.to_owned())
            .or_insert_with(|| {
                let mut labels = BTreeMap::new();
                labels.insert("node".to_owned(), o.node.to_owned());
                labels.insert("gpu".to_owned(), o.gpu_index.to_string());
                labels.insert("device_uuid".to_owned(), o.device_uuid.to_owned());
                if let Some(p) = o.mig_profile {
                    labels.insert("mig_profile".to_owned(), p.to_owned());
                }
                let id = [("node", o.node), ("device", o.device_uuid)];
                DeviceState {
                    watermark: Tracked::new(fingerprint("watermark", &id), restored),
                    oom: Tracked::new(fingerprint("time_to_oom", &id), restored),
                    unattributed: Tracked::new(fingerprint("unattributed", &id), restored),
                    // Sized for the configured window; a reload to a longer
                    // window takes effect for series seen after it.
                    predictor: OomPredictor::with_config(&oom_config),
                    labels,
                }
            });
        let total = o.total;
        let used = o.used_last.saturating_add(o.reserved);
        let peak = o.used_max.saturating_add(o.reserved);
        let frac = if total == 0 {
            0.0
        } else {
            peak as f64 / total as f64
        };
        let labels = &state.labels;

        let w = &self.config.watermark;
        if w.enabled {
            let held = state.watermark.lifecycle.is_active();
            let condition = if frac >= w.critical {
                Some(Severity::Critical)
            } else if frac >= w.warning || (held && frac >= w.clear_below) {
                Some(Severity::Warning)
            } else {
                None
            };
            out.extend(Self::change(
                &mut state.watermark,
                "watermark",
                o.timestamp_ms,
                condition,
                w.for_.ms(),
                labels,
                || {
                    (
                        format!(
                            "{} at {:.1} % of {} (peak {:.1} %, {} free)",
                            device_name(labels),
                            gib_pct(used, total),
                            HumanBytes(total),
                            gib_pct(peak, total),
                            HumanBytes(total.saturating_sub(used))
                        ),
                        serde_json::json!({
                            "used_bytes": o.used_last, "peak_bytes": o.used_max, "reserved_bytes": o.reserved,
                            "total_bytes": total, "used_fraction": frac,
                        }),
                    )
                },
            ));
        }

        state.predictor.observe(o.timestamp_ms, o.used_max);
        let t = &self.config.time_to_oom;
        if t.enabled {
            let limit = total.saturating_sub(o.reserved);
            let prediction = state
                .predictor
                .evaluate(&t.oom_config(), limit, o.timestamp_ms);
            let condition = prediction.as_ref().map(|p| {
                if p.predicted_oom_at_ms - o.timestamp_ms <= t.horizon.ms() / 3 {
                    Severity::Critical
                } else {
                    Severity::Warning
                }
            });
            out.extend(with_remedy(Self::change(
                &mut state.oom,
                "time_to_oom",
                o.timestamp_ms,
                condition,
                0,
                labels,
                || match &prediction {
                    Some(p) => (
                        format!(
                            "{} will run out of memory in about {} (between {} and {}), growing {}/min; {} used of {}",
                            device_name(labels),
                            minutes(p.predicted_oom_at_ms - o.timestamp_ms),
                            minutes(p.earliest_ms - o.timestamp_ms),
                            if p.latest_ms == i64::MAX { "never".to_owned() } else { minutes(p.latest_ms - o.timestamp_ms) },
                            HumanBytes((p.growth_bytes_per_s * 60.0).max(0.0) as u64),
                            HumanBytes(used),
                            HumanBytes(total),
                        ),
                        serde_json::json!({
                            "predicted_oom_at_ms": p.predicted_oom_at_ms, "earliest_ms": p.earliest_ms,
                            "latest_ms": if p.latest_ms == i64::MAX { serde_json::Value::Null } else { p.latest_ms.into() },
                            "growth_bytes_per_s": p.growth_bytes_per_s, "confidence": p.confidence,
                            "used_bytes": o.used_last, "total_bytes": total,
                        }),
                    ),
                    None => (
                        format!("{} no longer trends towards OOM", device_name(labels)),
                        serde_json::json!({ "used_bytes": o.used_last, "total_bytes": total }),
                    ),
                },
            ), remedy::time_to_oom));
        }

        let u = &self.config.unattributed;
        if u.enabled
            && let Some(attributed) = o.attributed
        {
            let unexplained = o.used_last.saturating_sub(attributed);
            let held = state.unattributed.lifecycle.is_active();
            let threshold = u.threshold.0;
            let condition = (unexplained >= threshold || (held && unexplained >= threshold / 2))
                .then_some(Severity::Warning);
            out.extend(Self::change(
                &mut state.unattributed,
                "unattributed",
                o.timestamp_ms,
                condition,
                u.for_.ms(),
                labels,
                || {
                    (
                        format!(
                            "{}: {} in use by no visible process (zombie context, or a process in another PID namespace)",
                            device_name(labels),
                            HumanBytes(unexplained)
                        ),
                        serde_json::json!({ "unattributed_bytes": unexplained, "used_bytes": o.used_last }),
                    )
                },
            ));
        }
        out
    }

    pub fn observe_process(&mut self, o: &ProcessObservation<'_>) -> Vec<AlertChange> {
        let mut out = Vec::new();
        let key = (o.device_uuid.to_owned(), o.pid, o.start_time_ms);
        let restored = &mut self.restored;
        let restored_at_ms = self.restored_at_ms;
        let leak_config = self.config.leak.leak_config();
        let state = self.processes.entry(key).or_insert_with(|| {
            let mut labels = BTreeMap::new();
            labels.insert("node".to_owned(), o.node.to_owned());
            labels.insert("gpu".to_owned(), o.gpu_index.to_string());
            labels.insert("device_uuid".to_owned(), o.device_uuid.to_owned());
            labels.insert("pid".to_owned(), o.pid.to_string());
            labels.insert("process".to_owned(), o.name.chars().take(120).collect());
            for (k, v) in [
                ("user", o.user),
                ("job", o.slurm_job_id),
                ("pod", o.pod_uid),
                ("container", o.container_id),
            ] {
                if !v.is_empty() {
                    labels.insert(k.to_owned(), v.to_owned());
                }
            }
            let start = o.start_time_ms.to_string();
            let pid = o.pid.to_string();
            let id = [
                ("node", o.node),
                ("device", o.device_uuid),
                ("pid", pid.as_str()),
                ("start", start.as_str()),
            ];
            let alloc_retries = Tracked::new(fingerprint("alloc_retries", &id), restored);
            let allocator_oom = Tracked::new(fingerprint("allocator_oom", &id), restored);
            let held_since = |t: &Tracked| t.lifecycle.is_active().then_some(restored_at_ms);
            ProcessState {
                leak: Tracked::new(fingerprint("leak", &id), restored),
                watermark: Tracked::new(fingerprint("process_watermark", &id), restored),
                fragmentation: Tracked::new(fingerprint("fragmentation", &id), restored),
                allocator: AllocatorWatch::restored(
                    held_since(&alloc_retries),
                    held_since(&allocator_oom),
                ),
                alloc_retries,
                allocator_oom,
                detector: LeakDetector::with_config(o.start_time_ms, &leak_config),
                last_seen_ms: o.timestamp_ms,
                labels,
            }
        });
        state.last_seen_ms = state.last_seen_ms.max(o.timestamp_ms);
        state.detector.observe(o.timestamp_ms, o.used_last);
        if let Some(a) = o.allocator {
            state
                .allocator
                .observe(a, self.config.alloc_retries.window.ms());
        }
        let fresh_report = state
            .allocator
            .last()
            .filter(|a| o.timestamp_ms - a.timestamp_ms <= ALLOCATOR_STALE_MS)
            .copied();
        let fragmented =
            fresh_report.is_some_and(|a| a.waste_ratio() >= self.config.fragmentation.min_ratio);
        let labels = &state.labels;

        let l = &self.config.leak;
        if l.enabled {
            let finding = state.detector.evaluate(&l.leak_config());
            out.extend(with_remedy(Self::change(
                &mut state.leak,
                "leak",
                o.timestamp_ms,
                finding.as_ref().map(|_| Severity::Warning),
                0,
                labels,
                || match &finding {
                    Some(f) => (
                        format!(
                            "{} on {} leaks: +{}/min for {} (p = {:.1e}); now {}",
                            process_name(labels),
                            device_name(labels),
                            HumanBytes(f.rate_bytes_per_min.max(0.0) as u64),
                            minutes(o.timestamp_ms - f.since_ms),
                            f.p_value,
                            HumanBytes(o.used_last),
                        ),
                        serde_json::json!({
                            "growth_bytes_per_min": f.rate_bytes_per_min, "since_ms": f.since_ms,
                            "p_value": f.p_value, "used_bytes": o.used_last, "peak_bytes": o.used_max,
                        }),
                    ),
                    None => (
                        format!("{} stopped growing", process_name(labels)),
                        serde_json::json!({ "used_bytes": o.used_last }),
                    ),
                },
            ), || remedy::leak(fragmented)));
        }

        let w = &self.config.watermark;
        if w.enabled
            && let Some(limit) = w.process_bytes
        {
            let held = state.watermark.lifecycle.is_active();
            let clear = (limit.0 as f64 * w.clear_below / w.warning) as u64;
            let condition = (o.used_max >= limit.0 || (held && o.used_max >= clear))
                .then_some(Severity::Warning);
            out.extend(Self::change(
                &mut state.watermark,
                "process_watermark",
                o.timestamp_ms,
                condition,
                w.for_.ms(),
                labels,
                || {
                    (
                        format!(
                            "{} on {} holds {} (limit {})",
                            process_name(labels),
                            device_name(labels),
                            HumanBytes(o.used_max),
                            HumanBytes(limit.0)
                        ),
                        serde_json::json!({ "used_bytes": o.used_last, "peak_bytes": o.used_max, "limit_bytes": limit.0 }),
                    )
                },
            ));
        }
        Self::observe_allocator(state, &self.config, o, fresh_report, fragmented, &mut out);
        out
    }

    /// Fragmentation, allocation retries and allocator OOMs of one process.
    fn observe_allocator(
        state: &mut ProcessState,
        config: &RulesConfig,
        o: &ProcessObservation<'_>,
        report: Option<AllocatorObservation>,
        fragmented: bool,
        out: &mut Vec<AlertChange>,
    ) {
        let labels = &state.labels;
        let now = o.timestamp_ms;

        let f = &config.fragmentation;
        if f.enabled {
            let held = state.fragmentation.lifecycle.is_active();
            // Hysteresis: once firing, it holds down to three quarters of
            // both thresholds.
            let scale = if held { 0.75 } else { 1.0 };
            let condition = report
                .filter(|a| {
                    a.waste() as f64 >= f.min_waste.0 as f64 * scale
                        && a.waste_ratio() >= f.min_ratio * scale
                })
                .map(|_| Severity::Warning);
            let (waste, ratio) = report.map_or((0, 0.0), |a| (a.waste(), a.waste_ratio()));
            out.extend(with_remedy(
                Self::change(
                    &mut state.fragmentation,
                    "fragmentation",
                    now,
                    condition,
                    f.for_.ms(),
                    labels,
                    || match report.filter(|_| condition.is_some()) {
                        Some(a) => (
                            format!(
                                "{} on {}: the allocator holds {} but its tensors never needed more than {} (now {}); {} ({:.0} %) is cache even the peak leaves unused",
                                process_name(labels),
                                device_name(labels),
                                HumanBytes(a.reserved),
                                HumanBytes(a.peak_allocated.max(a.allocated)),
                                HumanBytes(a.allocated),
                                HumanBytes(a.waste()),
                                a.waste_ratio() * 100.0,
                            ),
                            serde_json::json!({
                                "allocated_bytes": a.allocated, "reserved_bytes": a.reserved,
                                "peak_allocated_bytes": a.peak_allocated,
                                "waste_bytes": a.waste(), "waste_ratio": a.waste_ratio(),
                                "fragmentation_bytes": a.fragmentation(),
                                "inactive_split_bytes": a.inactive_split,
                            }),
                        ),
                        None => (
                            format!("{} no longer holds fragmented cache", process_name(labels)),
                            serde_json::json!({}),
                        ),
                    },
                ),
                || remedy::fragmentation(waste, ratio),
            ));
        }

        let r = &config.alloc_retries;
        if r.enabled {
            let held = state.alloc_retries.lifecycle.is_active();
            // Counts from a report that stopped coming say nothing about now.
            let recent = if report.is_some() {
                state.allocator.retries_in_window()
            } else {
                0
            };
            let condition = (recent >= u64::from(r.min_retries)
                || (held && state.allocator.retried_within(r.window.ms(), now)))
            .then_some(Severity::Warning);
            let total = state.allocator.last().map_or(0, |a| a.alloc_retries);
            out.extend(with_remedy(
                Self::change(
                    &mut state.alloc_retries,
                    "alloc_retries",
                    now,
                    condition,
                    0,
                    labels,
                    || match condition {
                        Some(_) => (
                            format!(
                                "{} on {}: the allocator flushed its cache and retried cudaMalloc {recent} times in the last {} ({total} since the process started); it is at the edge of OOM",
                                process_name(labels),
                                device_name(labels),
                                minutes(r.window.ms()),
                            ),
                            serde_json::json!({ "retries_in_window": recent, "window_ms": r.window.ms(), "alloc_retries": total }),
                        ),
                        None => (
                            format!(
                                "{} has not retried an allocation for {}",
                                process_name(labels),
                                minutes(r.window.ms())
                            ),
                            serde_json::json!({ "alloc_retries": total }),
                        ),
                    },
                ),
                || remedy::alloc_retries(fragmented),
            ));
        }

        let m = &config.allocator_oom;
        if m.enabled {
            let last_oom = state.allocator.oom_within(m.resolve_after.ms(), now);
            let seen = state.allocator.ooms_seen();
            let last = state.allocator.last().copied();
            out.extend(with_remedy(
                Self::change(
                    &mut state.allocator_oom,
                    "allocator_oom",
                    now,
                    last_oom.map(|_| Severity::Critical),
                    0,
                    labels,
                    || match (last_oom, last) {
                        (Some(at), Some(a)) => (
                            format!(
                                "{} on {} ran out of GPU memory: {seen} CUDA out-of-memory error(s) from its allocator, the latest {} ago; {} allocated, {} reserved",
                                process_name(labels),
                                device_name(labels),
                                minutes(now - at),
                                HumanBytes(a.allocated),
                                HumanBytes(a.reserved),
                            ),
                            serde_json::json!({
                                "ooms_seen": seen, "ooms": a.ooms, "last_oom_ms": at,
                                "allocated_bytes": a.allocated, "reserved_bytes": a.reserved,
                            }),
                        ),
                        _ => (
                            format!(
                                "{} had no out-of-memory error for {}",
                                process_name(labels),
                                minutes(m.resolve_after.ms())
                            ),
                            serde_json::json!({ "ooms_seen": seen }),
                        ),
                    },
                ),
                || remedy::allocator_oom(fragmented),
            ));
        }
    }

    /// A lost or stalled GPU whose memory is read again has recovered.
    fn device_reports_again(
        &mut self,
        node: &str,
        uuid: &str,
        ts_ms: i64,
        out: &mut Vec<AlertChange>,
    ) {
        for rule in ["gpu_lost", "nvml_hung"] {
            let key = (node.to_owned(), uuid.to_owned(), rule, 0);
            let Some(state) = self.events.get_mut(&key) else {
                continue;
            };
            if ts_ms <= state.last_event_ms {
                continue;
            }
            let labels = &state.labels;
            out.extend(Self::change(
                &mut state.tracked,
                state.rule,
                ts_ms,
                None,
                0,
                labels,
                || {
                    (
                        format!("{} reports again", device_name(labels)),
                        serde_json::json!({}),
                    )
                },
            ));
            self.events.remove(&key);
        }
    }

    pub fn observe_event(&mut self, e: &EventObservation<'_>) -> Vec<AlertChange> {
        if !self.config.events.enabled {
            return Vec::new();
        }
        let (rule, code, severity): (&'static str, i64, Severity) = match e.kind {
            "xid" => ("xid", e.code, super::xid::severity(e.code)),
            "gpu_lost" => ("gpu_lost", 0, Severity::Critical),
            "nvml_hung" => ("nvml_hung", 0, Severity::Warning),
            _ => return Vec::new(),
        };
        let device = e.device_uuid.unwrap_or("");
        let key = (e.node.to_owned(), device.to_owned(), rule, code);
        let restored = &mut self.restored;
        let state = self.events.entry(key).or_insert_with(|| {
            let mut labels = BTreeMap::new();
            labels.insert("node".to_owned(), e.node.to_owned());
            if let Some(index) = e.gpu_index {
                labels.insert("gpu".to_owned(), index.to_string());
            }
            if !device.is_empty() {
                labels.insert("device_uuid".to_owned(), device.to_owned());
            }
            if rule == "xid" {
                labels.insert("xid".to_owned(), code.to_string());
            }
            let code_text = code.to_string();
            let id = [
                ("node", e.node),
                ("device", device),
                ("code", code_text.as_str()),
            ];
            EventState {
                rule,
                tracked: Tracked::new(fingerprint(rule, &id), restored),
                labels,
                last_event_ms: e.timestamp_ms,
            }
        });
        state.last_event_ms = state.last_event_ms.max(e.timestamp_ms);
        let labels = &state.labels;
        let place = if labels.contains_key("gpu") {
            device_name(labels)
        } else {
            format!("node {}", e.node)
        };
        let detail = if e.detail.is_empty() {
            String::new()
        } else {
            format!(" ({})", e.detail.chars().take(300).collect::<String>())
        };
        Self::change(
            &mut state.tracked,
            rule,
            e.timestamp_ms,
            Some(severity),
            0,
            labels,
            || {
                let summary = match rule {
                    "xid" => format!(
                        "XID {code} on {place}: {}{detail}",
                        super::xid::meaning(code)
                    ),
                    "gpu_lost" => format!("{place} is lost: NVML answers GPU_IS_LOST{detail}"),
                    _ => format!("NVML calls hang on {place}; its readings are stale{detail}"),
                };
                (
                    summary,
                    serde_json::json!({ "code": code, "detail": e.detail }),
                )
            },
        )
        .into_iter()
        .collect()
    }

    /// Records a node's sample interval (from its registration).
    pub fn node_registered(&mut self, node: &str, interval_ms: i64, now_ms: i64) {
        let restored = &mut self.restored;
        let state = self
            .nodes
            .entry(node.to_owned())
            .or_insert_with(|| NodeState {
                silent: Tracked::new(fingerprint("agent_silent", &[("node", node)]), restored),
                last_seen_ms: now_ms,
                interval_ms,
            });
        state.interval_ms = interval_ms.max(1);
        state.last_seen_ms = state.last_seen_ms.max(now_ms);
    }

    fn note_node(&mut self, node: &str, ts_ms: i64, out: &mut Vec<AlertChange>) {
        let restored = &mut self.restored;
        let state = self
            .nodes
            .entry(node.to_owned())
            .or_insert_with(|| NodeState {
                silent: Tracked::new(fingerprint("agent_silent", &[("node", node)]), restored),
                last_seen_ms: ts_ms,
                interval_ms: 1000,
            });
        state.last_seen_ms = state.last_seen_ms.max(ts_ms);
        if state.silent.lifecycle.is_active() {
            let labels = BTreeMap::from([("node".to_owned(), node.to_owned())]);
            out.extend(Self::change(
                &mut state.silent,
                "agent_silent",
                ts_ms,
                None,
                0,
                &labels,
                || (format!("{node} reports again"), serde_json::json!({})),
            ));
        }
    }

    /// Time-driven rules: silent agents, exited processes, restored alerts
    /// whose series never came back. Call about once a second.
    pub fn tick(&mut self, now_ms: i64) -> Vec<AlertChange> {
        let mut out = Vec::new();
        let s = &self.config.agent_silent;
        if s.enabled {
            for (node, state) in &mut self.nodes {
                let quiet_ms = now_ms - state.last_seen_ms;
                let limit = state.interval_ms * i64::from(s.intervals);
                let condition = (quiet_ms > limit).then_some(Severity::Critical);
                let labels = BTreeMap::from([("node".to_owned(), node.clone())]);
                out.extend(Self::change(
                    &mut state.silent,
                    "agent_silent",
                    now_ms,
                    condition,
                    0,
                    &labels,
                    || {
                        (
                            format!("{node} has sent nothing for {}", minutes(quiet_ms)),
                            serde_json::json!({ "last_seen_ms": state.last_seen_ms }),
                        )
                    },
                ));
            }
        }
        let gone: Vec<_> = self
            .processes
            .iter()
            .filter(|(_, p)| now_ms - p.last_seen_ms > PROCESS_GONE_MS)
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(mut p) = self.processes.remove(&key) {
                for (tracked, rule) in [
                    (&mut p.leak, "leak"),
                    (&mut p.watermark, "process_watermark"),
                    (&mut p.fragmentation, "fragmentation"),
                    (&mut p.alloc_retries, "alloc_retries"),
                    (&mut p.allocator_oom, "allocator_oom"),
                ] {
                    let labels = &p.labels;
                    out.extend(Self::change(tracked, rule, now_ms, None, 0, labels, || {
                        (
                            format!("{} exited", process_name(labels)),
                            serde_json::json!({}),
                        )
                    }));
                }
            }
        }
        let quiet_after = self.config.events.xid_resolve_after.ms();
        let quiet: Vec<EventKey> = self
            .events
            .iter()
            .filter(|(_, e)| e.rule == "xid" && now_ms - e.last_event_ms > quiet_after)
            .map(|(k, _)| k.clone())
            .collect();
        for key in quiet {
            if let Some(mut e) = self.events.remove(&key) {
                let labels = &e.labels;
                out.extend(Self::change(
                    &mut e.tracked,
                    "xid",
                    now_ms,
                    None,
                    0,
                    labels,
                    || {
                        (
                            format!(
                                "XID {} has not recurred for {}",
                                key.3,
                                minutes(quiet_after)
                            ),
                            serde_json::json!({}),
                        )
                    },
                ));
            }
        }
        if !self.restored.is_empty() && now_ms - self.restored_at_ms > RESTORED_GRACE_MS {
            for (_, r) in self.restored.drain() {
                let rule: &'static str = match r.rule.as_str() {
                    "watermark" => "watermark",
                    "time_to_oom" => "time_to_oom",
                    "unattributed" => "unattributed",
                    "leak" => "leak",
                    "process_watermark" => "process_watermark",
                    "fragmentation" => "fragmentation",
                    "alloc_retries" => "alloc_retries",
                    "allocator_oom" => "allocator_oom",
                    "agent_silent" => "agent_silent",
                    "xid" => "xid",
                    "gpu_lost" => "gpu_lost",
                    "nvml_hung" => "nvml_hung",
                    _ => "unknown",
                };
                out.push(AlertChange {
                    fingerprint: r.fingerprint,
                    rule,
                    transition: if r.firing {
                        Transition::Resolved
                    } else {
                        Transition::Withdrawn
                    },
                    severity: r.severity,
                    at_ms: now_ms,
                    labels: r.labels,
                    summary: "no data for this series since the collector restarted".into(),
                    details: serde_json::json!({}),
                    remedy: String::new(),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn device(ts: i64, used: u64, attributed: Option<u64>) -> DeviceObservation<'static> {
        DeviceObservation {
            node: "n1",
            device_uuid: "GPU-1",
            gpu_index: 1,
            mig_profile: None,
            timestamp_ms: ts,
            used_last: used,
            used_max: used,
            reserved: 0,
            total: 100 * GIB,
            attributed,
        }
    }

    fn rules(text: &str) -> RulesConfig {
        RulesConfig::parse(text, std::path::Path::new("t.toml")).unwrap()
    }

    fn transitions(changes: &[AlertChange], rule: &str) -> Vec<Transition> {
        changes
            .iter()
            .filter(|c| c.rule == rule)
            .map(|c| c.transition)
            .collect()
    }

    #[test]
    fn watermark_uses_hysteresis_and_escalates() {
        let mut e = Engine::new(rules(""));
        let mut all = Vec::new();
        for (i, used) in [80, 91, 88, 86, 96, 89, 84, 91].iter().enumerate() {
            all.extend(e.observe_device(&device(i as i64 * 1000, used * GIB, None)));
        }
        assert_eq!(
            transitions(&all, "watermark"),
            vec![
                Transition::Firing {
                    severity: Severity::Warning,
                    escalated: false
                },
                Transition::Firing {
                    severity: Severity::Critical,
                    escalated: true
                },
                Transition::Resolved,
                Transition::Firing {
                    severity: Severity::Warning,
                    escalated: false
                },
            ],
            "88 % and 86 % stay firing (above clear_below 85 %); 84 % resolves"
        );
        let fired = all.iter().find(|c| c.rule == "watermark").unwrap();
        assert_eq!(fired.labels["node"], "n1");
        assert_eq!(fired.labels["gpu"], "1");
        assert!(
            fired.summary.contains("GPU 1 on n1 at 91.0 %"),
            "{}",
            fired.summary
        );
    }

    #[test]
    fn unattributed_memory_needs_its_for_and_names_the_amount() {
        let mut e = Engine::new(rules(
            "[unattributed]\nthreshold = \"2GiB\"\nfor = \"10s\"\n",
        ));
        let mut all = Vec::new();
        for s in 0..15 {
            all.extend(e.observe_device(&device(s * 1000, 20 * GIB, Some(17 * GIB))));
        }
        assert_eq!(
            transitions(&all, "unattributed"),
            vec![
                Transition::Pending {
                    severity: Severity::Warning
                },
                Transition::Firing {
                    severity: Severity::Warning,
                    escalated: false
                },
            ]
        );
        assert!(
            all.iter()
                .any(|c| c.summary.contains("3 GiB in use by no visible process"))
        );
        // Without process reports the rule cannot judge, and stays quiet.
        let mut e = Engine::new(rules(""));
        let quiet: Vec<_> = (0..300)
            .flat_map(|s| e.observe_device(&device(s * 1000, 20 * GIB, None)))
            .collect();
        assert!(transitions(&quiet, "unattributed").is_empty());
    }

    #[test]
    fn silent_agent_fires_then_resolves_when_it_reports() {
        let mut e = Engine::new(rules("[agent_silent]\nintervals = 5\n"));
        e.node_registered("n1", 1000, 0);
        e.observe_device(&device(1000, GIB, None));
        assert!(e.tick(5000).is_empty());
        let fired = e.tick(7000);
        assert_eq!(
            transitions(&fired, "agent_silent"),
            vec![Transition::Firing {
                severity: Severity::Critical,
                escalated: false
            }]
        );
        assert!(
            fired[0].summary.contains("n1 has sent nothing for 6 s"),
            "{}",
            fired[0].summary
        );
        let back = e.observe_device(&device(8000, GIB, None));
        assert_eq!(
            transitions(&back, "agent_silent"),
            vec![Transition::Resolved]
        );
    }

    #[test]
    fn restored_firing_alert_is_not_announced_again_and_resolves_later() {
        let id = [("node", "n1"), ("device", "GPU-1")];
        let mut e = Engine::new(rules(""));
        e.restore(
            vec![RestoredAlert {
                fingerprint: fingerprint("watermark", &id),
                rule: "watermark".into(),
                severity: Severity::Warning,
                firing: true,
                since_ms: 0,
                labels: BTreeMap::new(),
            }],
            0,
        );
        let still = e.observe_device(&device(1000, 92 * GIB, None));
        assert!(transitions(&still, "watermark").is_empty(), "{still:?}");
        let cleared = e.observe_device(&device(2000, 50 * GIB, None));
        assert_eq!(
            transitions(&cleared, "watermark"),
            vec![Transition::Resolved]
        );
    }

    #[test]
    fn reloading_rules_keeps_alert_state() {
        let mut e = Engine::new(rules(""));
        let fired = e.observe_device(&device(0, 92 * GIB, None));
        assert_eq!(transitions(&fired, "watermark").len(), 1);
        e.set_config(rules(
            "[watermark]\nwarning = 0.8\ncritical = 0.97\nclear_below = 0.7\n",
        ));
        let after = e.observe_device(&device(1000, 92 * GIB, None));
        assert!(
            transitions(&after, "watermark").is_empty(),
            "not announced again: {after:?}"
        );
        // The new hysteresis applies: 75 % no longer clears.
        assert!(e.observe_device(&device(2000, 75 * GIB, None)).is_empty());
        let cleared = e.observe_device(&device(3000, 60 * GIB, None));
        assert_eq!(
            transitions(&cleared, "watermark"),
            vec![Transition::Resolved]
        );
        assert_eq!(
            cleared[0].severity,
            Severity::Warning,
            "resolved with the severity it fired at, so it reaches the same channels"
        );
    }

    fn event(kind: &'static str, code: i64, ts: i64) -> EventObservation<'static> {
        EventObservation {
            node: "n1",
            device_uuid: Some("GPU-1"),
            gpu_index: Some(1),
            kind,
            code,
            detail: "",
            timestamp_ms: ts,
        }
    }

    #[test]
    fn xid_fires_with_its_meaning_and_resolves_when_it_stops_recurring() {
        let mut e = Engine::new(rules("[events]\nxid_resolve_after = \"10m\"\n"));
        let fired = e.observe_event(&event("xid", 79, 1000));
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].severity, Severity::Critical);
        assert_eq!(fired[0].labels["xid"], "79");
        assert!(
            fired[0]
                .summary
                .contains("XID 79 on GPU 1 on n1: GPU has fallen off the bus"),
            "{}",
            fired[0].summary
        );
        assert!(
            e.observe_event(&event("xid", 79, 60_000)).is_empty(),
            "a recurrence is not news"
        );
        assert_eq!(
            e.observe_event(&event("xid", 31, 61_000)).len(),
            1,
            "another code is its own alert"
        );
        assert!(
            transitions(&e.tick(600_000), "xid").is_empty(),
            "79 recurred at 60 s"
        );
        let resolved = e.tick(662_000);
        assert_eq!(
            transitions(&resolved, "xid"),
            vec![Transition::Resolved, Transition::Resolved]
        );
    }

    #[test]
    fn lost_gpu_resolves_when_its_memory_is_read_again() {
        let mut e = Engine::new(rules(""));
        let lost = e.observe_event(&event("gpu_lost", 0, 5000));
        assert_eq!(
            transitions(&lost, "gpu_lost"),
            vec![Transition::Firing {
                severity: Severity::Critical,
                escalated: false
            }]
        );
        assert!(
            transitions(&e.observe_device(&device(4000, GIB, None)), "gpu_lost").is_empty(),
            "a sample from before the loss"
        );
        let back = e.observe_device(&device(9000, GIB, None));
        assert_eq!(transitions(&back, "gpu_lost"), vec![Transition::Resolved]);
        assert!(
            e.observe_event(&event("process_started", 0, 9500))
                .is_empty()
        );
    }

    fn training(ts: i64, report: Option<AllocatorObservation>) -> ProcessObservation<'static> {
        ProcessObservation {
            node: "n1",
            device_uuid: "GPU-1",
            gpu_index: 1,
            pid: 4242,
            start_time_ms: 0,
            name: "python train.py",
            user: "alice",
            slurm_job_id: "77",
            pod_uid: "",
            container_id: "",
            timestamp_ms: ts,
            used_last: 60 * GIB,
            used_max: 60 * GIB,
            allocator: report,
        }
    }

    fn stats(
        ts: i64,
        allocated: u64,
        reserved: u64,
        retries: u64,
        ooms: u64,
    ) -> Option<AllocatorObservation> {
        Some(AllocatorObservation {
            timestamp_ms: ts,
            allocated,
            reserved,
            inactive_split: reserved - allocated,
            peak_allocated: allocated,
            alloc_retries: retries,
            ooms,
        })
    }

    #[test]
    fn fragmentation_fires_after_its_duration_with_the_expandable_segments_remedy() {
        let mut e = Engine::new(rules("[fragmentation]\nfor = \"2m\"\n"));
        let mut all = Vec::new();
        // 40 GiB allocated of 50 reserved: 20 %, under the 30 % threshold.
        all.extend(e.observe_process(&training(0, stats(0, 40 * GIB, 50 * GIB, 0, 0))));
        assert!(transitions(&all, "fragmentation").is_empty());
        // 30 of 50: 20 GiB (40 %) held in no tensor, for 2 minutes.
        for t in [60_000, 120_000, 180_000] {
            all.extend(e.observe_process(&training(t, stats(t, 30 * GIB, 50 * GIB, 0, 0))));
        }
        let fired: Vec<&AlertChange> = all
            .iter()
            .filter(|c| {
                c.rule == "fragmentation" && matches!(c.transition, Transition::Firing { .. })
            })
            .collect();
        assert_eq!(fired.len(), 1, "{all:?}");
        assert!(
            fired[0]
                .summary
                .contains("20 GiB (40 %) is cache even the peak leaves unused"),
            "{}",
            fired[0].summary
        );
        assert!(
            fired[0]
                .remedy
                .contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        );
        assert_eq!(fired[0].details["fragmentation_bytes"], 20 * GIB);
        // 35 % still holds it (hysteresis); 10 % resolves it.
        let held = e.observe_process(&training(240_000, stats(240_000, 32 * GIB, 50 * GIB, 0, 0)));
        assert!(transitions(&held, "fragmentation").is_empty());
        let done = e.observe_process(&training(300_000, stats(300_000, 45 * GIB, 50 * GIB, 0, 0)));
        let resolved: Vec<&AlertChange> =
            done.iter().filter(|c| c.rule == "fragmentation").collect();
        assert_eq!(resolved.len(), 1);
        assert_eq!(resolved[0].transition, Transition::Resolved);
        assert!(resolved[0].remedy.is_empty(), "no advice on resolution");

        // Between steps a healthy job's live tensors drop while the cache
        // stays for the next step: not fragmentation when the peak used it.
        let mut healthy = Engine::new(rules("[fragmentation]\nfor = \"0s\"\n"));
        let mut between_steps = stats(0, 20 * GIB, 50 * GIB, 0, 0);
        if let Some(s) = between_steps.as_mut() {
            s.peak_allocated = 48 * GIB;
        }
        let quiet = healthy.observe_process(&training(0, between_steps));
        assert!(transitions(&quiet, "fragmentation").is_empty(), "{quiet:?}");
    }

    #[test]
    fn rising_retries_fire_and_resolve_after_a_quiet_window() {
        let mut e = Engine::new(rules("[alloc_retries]\nwindow = \"5m\"\nmin_retries = 3\n"));
        // Retries from before we watched do not count.
        let first = e.observe_process(&training(0, stats(0, 70 * GIB, 75 * GIB, 40, 0)));
        assert!(transitions(&first, "alloc_retries").is_empty());
        let mut all = Vec::new();
        for (i, retries) in [41, 42, 43].iter().enumerate() {
            let t = (i as i64 + 1) * 30_000;
            all.extend(e.observe_process(&training(t, stats(t, 70 * GIB, 75 * GIB, *retries, 0))));
        }
        let fired: Vec<&AlertChange> = all.iter().filter(|c| c.rule == "alloc_retries").collect();
        assert_eq!(fired.len(), 1);
        assert!(
            fired[0].summary.contains("retried cudaMalloc 3 times"),
            "{}",
            fired[0].summary
        );
        assert!(fired[0].remedy.contains("activation checkpointing"));
        assert!(
            !fired[0].remedy.contains("expandable_segments"),
            "not fragmented"
        );
        // No new retry: still firing within the window, resolved after it.
        let quiet = e.observe_process(&training(
            300_000,
            stats(300_000, 70 * GIB, 75 * GIB, 43, 0),
        ));
        assert!(transitions(&quiet, "alloc_retries").is_empty());
        let resolved = e.observe_process(&training(
            400_000,
            stats(400_000, 70 * GIB, 75 * GIB, 43, 0),
        ));
        assert_eq!(
            transitions(&resolved, "alloc_retries"),
            vec![Transition::Resolved]
        );

        // A process that stops reporting while retrying: the alert resolves
        // a window after the last retry, not when the process exits.
        let mut e = Engine::new(rules("[alloc_retries]\nwindow = \"5m\"\nmin_retries = 3\n"));
        e.observe_process(&training(0, stats(0, 70 * GIB, 75 * GIB, 0, 0)));
        let fired = e.observe_process(&training(30_000, stats(30_000, 70 * GIB, 75 * GIB, 5, 0)));
        assert_eq!(transitions(&fired, "alloc_retries").len(), 1);
        let mut later = Vec::new();
        for t in (60_000..=400_000).step_by(20_000) {
            later.extend(e.observe_process(&training(t, None)));
        }
        assert_eq!(
            transitions(&later, "alloc_retries"),
            vec![Transition::Resolved]
        );
    }

    #[test]
    fn an_allocator_oom_fires_at_once_as_critical() {
        let mut e = Engine::new(rules(""));
        e.observe_process(&training(0, stats(0, 70 * GIB, 78 * GIB, 0, 0)));
        let oom = e.observe_process(&training(1_000, stats(1_000, 70 * GIB, 78 * GIB, 1, 1)));
        let fired: Vec<&AlertChange> = oom.iter().filter(|c| c.rule == "allocator_oom").collect();
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].severity, Severity::Critical);
        assert!(
            fired[0].summary.contains("1 CUDA out-of-memory error"),
            "{}",
            fired[0].summary
        );
        assert!(fired[0].remedy.contains("gradient accumulation"));
        // The process exits: its OOM alert resolves with it.
        let gone = e.tick(1_000 + PROCESS_GONE_MS + 1);
        assert_eq!(
            transitions(&gone, "allocator_oom"),
            vec![Transition::Resolved]
        );
        // A process that does not report raises nothing.
        let mut quiet = Engine::new(rules(""));
        let none = quiet.observe_process(&training(0, None));
        assert!(none.iter().all(|c| !c.rule.starts_with("alloc")));
    }

    #[test]
    fn fingerprints_are_stable_and_distinct() {
        let a = fingerprint("leak", &[("node", "n1"), ("pid", "5")]);
        assert_eq!(a, fingerprint("leak", &[("node", "n1"), ("pid", "5")]));
        assert_ne!(a, fingerprint("leak", &[("node", "n1"), ("pid", "6")]));
        assert_ne!(a, fingerprint("watermark", &[("node", "n1"), ("pid", "5")]));
        assert_eq!(a.len(), 24);
    }
}
