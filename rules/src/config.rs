//! The rules file (TOML): which rules run, their thresholds, and where alerts
//! go. Every value is checked when the file is read, and a mistake is
//! reported with the key that holds it.

use std::fmt;
use std::path::{Path, PathBuf};

use headroom_common::ByteSize;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

use crate::leak::LeakConfig;
use crate::oom::OomConfig;

/// A duration written as `"30s"`, `"5m"`, `"2h"`, `"1d"` or `"250ms"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Span(pub i64);

impl Span {
    pub fn ms(self) -> i64 {
        self.0
    }
}

pub fn parse_span(text: &str) -> Result<Span, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: i64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as \"30s\", \"5m\" or \"2h\""))?;
    let unit_ms = match unit.trim() {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => {
            return Err(format!(
                "{text:?} has unknown unit {other:?} (use ms, s, m, h or d)"
            ));
        }
    };
    value
        .checked_mul(unit_ms)
        .map(Span)
        .ok_or_else(|| format!("{text:?} is too long"))
}

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SpanVisitor;
        impl Visitor<'_> for SpanVisitor {
            type Value = Span;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as \"30s\", \"5m\" or \"2h\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Span, E> {
                parse_span(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_str(SpanVisitor)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Info,
    Warning,
    Critical,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::Warning => "warning",
            Self::Critical => "critical",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WatermarkRule {
    pub enabled: bool,
    /// Fractions of total memory (used + reserved over total).
    pub warning: f64,
    pub critical: f64,
    /// An alert clears only below this fraction, so memory hovering at the
    /// threshold does not flap.
    pub clear_below: f64,
    /// How long the level must hold before the alert fires.
    #[serde(rename = "for")]
    pub for_: Span,
    /// Optional per-process limit in bytes (warning severity).
    pub process_bytes: Option<ByteSize>,
}

impl Default for WatermarkRule {
    fn default() -> Self {
        Self {
            enabled: true,
            warning: 0.90,
            critical: 0.95,
            clear_below: 0.85,
            for_: Span(0),
            process_bytes: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeToOomRule {
    pub enabled: bool,
    pub window: Span,
    pub min_history: Span,
    pub horizon: Span,
    pub lookback: Span,
    /// A forecast reaches at most this many times its climb's window.
    pub reach: f64,
    /// How long a forecast must hold before it warns.
    #[serde(rename = "for")]
    pub for_: Span,
}

impl Default for TimeToOomRule {
    fn default() -> Self {
        let d = OomConfig::default();
        Self {
            enabled: true,
            window: Span(d.window_ms),
            min_history: Span(d.min_history_ms),
            horizon: Span(d.horizon_ms),
            lookback: Span(d.lookback_ms),
            reach: d.reach,
            for_: Span(30_000),
        }
    }
}

impl TimeToOomRule {
    pub fn oom_config(&self) -> OomConfig {
        OomConfig {
            window_ms: self.window.ms(),
            min_history_ms: self.min_history.ms(),
            horizon_ms: self.horizon.ms(),
            lookback_ms: self.lookback.ms(),
            reach: self.reach,
            ..OomConfig::default()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeakRule {
    pub enabled: bool,
    /// The shortest stretch of sustained growth that is a leak.
    pub window: Span,
    /// The longest window a slow leak is judged over.
    pub max_window: Span,
    pub warmup: Span,
    pub min_rate_per_min: ByteSize,
    /// The least growth over a window that is evidence of a leak.
    pub min_rise: ByteSize,
    pub max_p_value: f64,
    /// A floor held within this before the window is not new memory.
    pub lookback: Span,
}

impl Default for LeakRule {
    fn default() -> Self {
        let d = LeakConfig::default();
        Self {
            enabled: true,
            window: Span(d.window_ms),
            max_window: Span(d.max_window_ms),
            warmup: Span(d.warmup_ms),
            min_rate_per_min: ByteSize(d.min_rate_bytes_per_min as u64),
            min_rise: ByteSize(d.min_rise_bytes as u64),
            max_p_value: d.max_p_value,
            lookback: Span(d.lookback_ms),
        }
    }
}

impl LeakRule {
    pub fn leak_config(&self) -> LeakConfig {
        LeakConfig {
            window_ms: self.window.ms(),
            max_window_ms: self.max_window.ms(),
            warmup_ms: self.warmup.ms(),
            min_rate_bytes_per_min: self.min_rate_per_min.0 as f64,
            min_rise_bytes: self.min_rise.0 as f64,
            max_p_value: self.max_p_value,
            lookback_ms: self.lookback.ms(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UnattributedRule {
    pub enabled: bool,
    pub threshold: ByteSize,
    #[serde(rename = "for")]
    pub for_: Span,
}

impl Default for UnattributedRule {
    fn default() -> Self {
        Self {
            enabled: true,
            threshold: ByteSize(2 << 30),
            for_: Span(120_000),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentSilentRule {
    pub enabled: bool,
    /// Sample intervals without a batch before the node counts as silent.
    pub intervals: u32,
}

impl Default for AgentSilentRule {
    fn default() -> Self {
        Self {
            enabled: true,
            intervals: 10,
        }
    }
}

/// Memory a process's allocator holds in no live tensor (reserved −
/// allocated), from allocator reports.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FragmentationRule {
    pub enabled: bool,
    /// At least this much held in no tensor…
    pub min_waste: ByteSize,
    /// …and at least this share of what the allocator reserved.
    pub min_ratio: f64,
    #[serde(rename = "for")]
    pub for_: Span,
}

impl Default for FragmentationRule {
    fn default() -> Self {
        Self {
            enabled: true,
            min_waste: ByteSize(4 << 30),
            min_ratio: 0.30,
            for_: Span(5 * 60_000),
        }
    }
}

/// The allocator freeing its cache and retrying `cudaMalloc`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AllocRetriesRule {
    pub enabled: bool,
    /// Fires on `min_retries` new retries within `window`; resolves after a
    /// `window` without one.
    pub window: Span,
    pub min_retries: u32,
}

impl Default for AllocRetriesRule {
    fn default() -> Self {
        Self {
            enabled: true,
            window: Span(10 * 60_000),
            min_retries: 3,
        }
    }
}

/// Out-of-memory errors the allocator raised (a job that catches them and
/// carries on still counts).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AllocatorOomRule {
    pub enabled: bool,
    /// Resolves once no new OOM came for this long.
    pub resolve_after: Span,
}

impl Default for AllocatorOomRule {
    fn default() -> Self {
        Self {
            enabled: true,
            resolve_after: Span(30 * 60_000),
        }
    }
}

/// Events the agent reports: XID errors, lost GPUs, hung NVML calls.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsRule {
    pub enabled: bool,
    /// An XID alert resolves once its code has not recurred on that GPU for this long.
    pub xid_resolve_after: Span,
}

impl Default for EventsRule {
    fn default() -> Self {
        Self {
            enabled: true,
            xid_resolve_after: Span(30 * 60_000),
        }
    }
}

/// When a job's memory report is written (`docs/job-reports.md`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobReportRule {
    pub enabled: bool,
    /// A job has ended on a node once the node has reported this long of
    /// sample time without any of its processes.
    pub end_after: Span,
}

impl Default for JobReportRule {
    fn default() -> Self {
        Self {
            enabled: true,
            end_after: Span(2 * 60_000),
        }
    }
}

/// A generic JSON webhook, signed with HMAC-SHA256.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookChannel {
    pub name: String,
    pub url: String,
    /// Shared secret for the signature; prefer `secret_file`.
    pub secret: Option<String>,
    pub secret_file: Option<PathBuf>,
    #[serde(default = "default_min_severity")]
    pub min_severity: Severity,
}

/// A Slack incoming webhook.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlackChannel {
    pub name: String,
    /// The incoming-webhook URL is itself the secret; prefer `webhook_url_file`.
    pub webhook_url: Option<String>,
    pub webhook_url_file: Option<PathBuf>,
    #[serde(default = "default_min_severity")]
    pub min_severity: Severity,
}

// Secrets never reach logs or the API through Debug.
impl fmt::Debug for WebhookChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookChannel")
            .field("name", &self.name)
            .field("url", &"<redacted>")
            .field("min_severity", &self.min_severity)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for SlackChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlackChannel")
            .field("name", &self.name)
            .field("min_severity", &self.min_severity)
            .finish_non_exhaustive()
    }
}

/// Alertmanager instances (API v2) that Headroom keeps informed of its
/// firing alerts; Alertmanager then routes, groups, silences and inhibits.
/// List every instance of an HA cluster: each gets every alert, as
/// Prometheus does it, and the cluster deduplicates.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertmanagerChannel {
    pub name: String,
    /// Base URLs, e.g. `http://alertmanager-0:9093`.
    pub urls: Vec<String>,
    /// Alertmanager does its own routing, so by default it sees everything.
    #[serde(default = "default_alertmanager_min_severity")]
    pub min_severity: Severity,
    /// How often firing alerts are sent again; each is valid for four of
    /// these, so Alertmanager resolves it by itself if Headroom goes away.
    #[serde(default = "default_resend_interval")]
    pub resend_interval: Span,
}

/// PagerDuty Events API v2: an incident per alert, triggered and resolved
/// with the alert's fingerprint as its dedup key.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PagerDutyChannel {
    pub name: String,
    /// The service integration's routing key; prefer `routing_key_file`.
    pub routing_key: Option<String>,
    pub routing_key_file: Option<PathBuf>,
    /// The events endpoint; `https://events.eu.pagerduty.com/v2/enqueue`
    /// for an EU account.
    #[serde(default = "default_pagerduty_url")]
    pub url: String,
    #[serde(default = "default_min_severity")]
    pub min_severity: Severity,
}

// A URL may carry basic-auth credentials.
impl fmt::Debug for AlertmanagerChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlertmanagerChannel")
            .field("name", &self.name)
            .field("urls", &self.urls.len())
            .field("min_severity", &self.min_severity)
            .field("resend_interval", &self.resend_interval)
            .finish()
    }
}

impl fmt::Debug for PagerDutyChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagerDutyChannel")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("min_severity", &self.min_severity)
            .finish_non_exhaustive()
    }
}

/// `http://` or `https://`, a host, and no white space: a URL a request can
/// be sent to (whether anything answers is for the notifier to find out).
fn is_http_url(url: &str) -> bool {
    let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
    else {
        return false;
    };
    let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = host.rsplit('@').next().unwrap_or_default();
    !host.is_empty() && !host.starts_with(':') && !url.chars().any(char::is_whitespace)
}

fn default_min_severity() -> Severity {
    Severity::Warning
}

fn default_alertmanager_min_severity() -> Severity {
    Severity::Info
}

fn default_resend_interval() -> Span {
    Span(60_000)
}

fn default_pagerduty_url() -> String {
    "https://events.pagerduty.com/v2/enqueue".to_owned()
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NotifyConfig {
    /// Base URL of the dashboard, for links in notifications.
    pub dashboard_url: Option<String>,
    pub webhook: Vec<WebhookChannel>,
    pub slack: Vec<SlackChannel>,
    pub alertmanager: Vec<AlertmanagerChannel>,
    pub pagerduty: Vec<PagerDutyChannel>,
    /// Who owns what, for a `team` label routes can match.
    pub owners: crate::routing::OwnersConfig,
    /// Tried in order; see `routing.rs`.
    pub route: Vec<crate::routing::Route>,
    /// Where an alert no route takes goes; every channel when absent.
    pub default_channels: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RulesConfig {
    pub watermark: WatermarkRule,
    pub time_to_oom: TimeToOomRule,
    pub leak: LeakRule,
    pub unattributed: UnattributedRule,
    pub agent_silent: AgentSilentRule,
    pub events: EventsRule,
    pub fragmentation: FragmentationRule,
    pub alloc_retries: AllocRetriesRule,
    pub allocator_oom: AllocatorOomRule,
    pub job_report: JobReportRule,
    pub notify: NotifyConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    #[error("rules file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("rules file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl RulesConfig {
    /// Parses and checks a rules file's text; `path` only names it in errors.
    /// Reading the file is the caller's: the rules do no I/O.
    pub fn parse(text: &str, path: &Path) -> Result<Self, RulesError> {
        let config: Self = toml::from_str(text).map_err(|e| RulesError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        config.validate().map_err(|message| RulesError::Invalid {
            path: path.to_owned(),
            message,
        })?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), String> {
        let w = &self.watermark;
        for (key, v) in [
            ("watermark.warning", w.warning),
            ("watermark.critical", w.critical),
            ("watermark.clear_below", w.clear_below),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(format!(
                    "{key} = {v} is outside (0, 1]: it is a fraction of total memory"
                ));
            }
        }
        if w.critical < w.warning {
            return Err(format!(
                "watermark.critical ({}) is below watermark.warning ({})",
                w.critical, w.warning
            ));
        }
        if w.clear_below > w.warning {
            return Err(format!(
                "watermark.clear_below ({}) is above watermark.warning ({}): alerts could never clear",
                w.clear_below, w.warning
            ));
        }
        let spans = [
            ("watermark.for", w.for_),
            ("time_to_oom.window", self.time_to_oom.window),
            ("time_to_oom.min_history", self.time_to_oom.min_history),
            ("time_to_oom.horizon", self.time_to_oom.horizon),
            ("time_to_oom.lookback", self.time_to_oom.lookback),
            ("time_to_oom.for", self.time_to_oom.for_),
            ("leak.window", self.leak.window),
            ("leak.warmup", self.leak.warmup),
            ("leak.max_window", self.leak.max_window),
            ("leak.lookback", self.leak.lookback),
            ("unattributed.for", self.unattributed.for_),
            ("events.xid_resolve_after", self.events.xid_resolve_after),
            ("fragmentation.for", self.fragmentation.for_),
            ("alloc_retries.window", self.alloc_retries.window),
            (
                "allocator_oom.resolve_after",
                self.allocator_oom.resolve_after,
            ),
        ];
        for (key, span) in spans {
            if span.ms() < 0 || span.ms() > 30 * 86_400_000 {
                return Err(format!("{key} = {} ms is outside 0..30 days", span.ms()));
            }
        }
        if self.time_to_oom.window.ms() < 60_000 {
            return Err("time_to_oom.window must be at least 1m".into());
        }
        if self.time_to_oom.min_history > self.time_to_oom.window {
            return Err("time_to_oom.min_history is longer than time_to_oom.window".into());
        }
        let reach = self.time_to_oom.reach;
        if !(reach.is_finite() && (0.5..=10.0).contains(&reach)) {
            return Err(format!(
                "time_to_oom.reach = {reach} is outside 0.5..10: it is how many windows ahead a climb may be extrapolated"
            ));
        }
        if self.leak.window.ms() < 10 * 60_000 {
            return Err(
                "leak.window must be at least 10m: shorter windows mistake noise for leaks".into(),
            );
        }
        if self.leak.max_window < self.leak.window {
            return Err("leak.max_window is shorter than leak.window".into());
        }
        if self.leak.max_window.ms() > 24 * 3_600_000 || self.leak.lookback.ms() > 24 * 3_600_000 {
            return Err(
                "leak.max_window and leak.lookback are at most 24h: a process keeps a minute of \
                 history for each minute of them"
                    .into(),
            );
        }
        if !(self.leak.max_p_value > 0.0 && self.leak.max_p_value < 0.5) {
            return Err(format!(
                "leak.max_p_value = {} is outside (0, 0.5)",
                self.leak.max_p_value
            ));
        }
        if !(self.fragmentation.min_ratio > 0.0 && self.fragmentation.min_ratio < 1.0) {
            return Err(format!(
                "fragmentation.min_ratio = {} is outside (0, 1): it is a share of reserved memory",
                self.fragmentation.min_ratio
            ));
        }
        if self.alloc_retries.min_retries == 0 {
            return Err("alloc_retries.min_retries must be at least 1".into());
        }
        if self.alloc_retries.window.ms() < 1000 || self.allocator_oom.resolve_after.ms() < 1000 {
            return Err(
                "alloc_retries.window and allocator_oom.resolve_after must be at least 1s".into(),
            );
        }
        if !(1_000..=86_400_000).contains(&self.job_report.end_after.0) {
            return Err("job_report.end_after must be between 1s and 1d".into());
        }
        if self.agent_silent.intervals == 0 {
            return Err("agent_silent.intervals must be at least 1".into());
        }
        let mut names = std::collections::HashSet::new();
        if let Some(name) = self
            .notify
            .channel_names()
            .into_iter()
            .find(|n| !names.insert(*n))
        {
            return Err(format!("notify channel name {name:?} is used twice"));
        }
        for w in &self.notify.webhook {
            if !is_http_url(&w.url) {
                return Err(format!(
                    "notify.webhook {:?}: url must be an http:// or https:// URL with a host",
                    w.name
                ));
            }
            if w.secret.is_some() == w.secret_file.is_some() {
                return Err(format!(
                    "notify.webhook {:?}: set exactly one of secret and secret_file",
                    w.name
                ));
            }
        }
        for s in &self.notify.slack {
            if s.webhook_url.is_some() == s.webhook_url_file.is_some() {
                return Err(format!(
                    "notify.slack {:?}: set exactly one of webhook_url and webhook_url_file",
                    s.name
                ));
            }
        }
        let is_http = is_http_url;
        for a in &self.notify.alertmanager {
            if a.urls.is_empty() {
                return Err(format!(
                    "notify.alertmanager {:?}: urls is empty: name at least one Alertmanager",
                    a.name
                ));
            }
            // The index, not the URL: a URL may carry credentials.
            if let Some(index) = a.urls.iter().position(|u| !is_http(u)) {
                return Err(format!(
                    "notify.alertmanager {:?}: urls[{index}] must be an http:// or https:// URL with a host",
                    a.name
                ));
            }
            if !(5_000..=3_600_000).contains(&a.resend_interval.0) {
                return Err(format!(
                    "notify.alertmanager {:?}: resend_interval must be between 5s and 1h",
                    a.name
                ));
            }
        }
        for p in &self.notify.pagerduty {
            if !is_http(&p.url) {
                return Err(format!(
                    "notify.pagerduty {:?}: url must be an http:// or https:// URL with a host",
                    p.name
                ));
            }
            if p.routing_key.is_some() == p.routing_key_file.is_some() {
                return Err(format!(
                    "notify.pagerduty {:?}: set exactly one of routing_key and routing_key_file",
                    p.name
                ));
            }
        }
        self.notify.validate_routes()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RulesConfig, String> {
        RulesConfig::parse(text, Path::new("rules.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn empty_file_gives_the_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.watermark.warning, 0.90);
        assert_eq!(c.watermark.critical, 0.95);
        assert!(c.leak.enabled && c.time_to_oom.enabled);
    }

    #[test]
    fn example_rules_file_in_deploy_parses() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/rules.toml"));
        let c = RulesConfig::parse(&std::fs::read_to_string(path).unwrap(), path).unwrap();
        assert_eq!(c.watermark.for_, Span(30_000));
        assert_eq!(c.notify.webhook.len(), 1);
    }

    #[test]
    fn mistakes_are_named() {
        let e = parse("[watermark]\nwarnng = 0.5\n").unwrap_err();
        assert!(e.contains("warnng") && e.contains("rules.toml"), "{e}");
        let e = parse("[watermark]\nwarning = 1.5\n").unwrap_err();
        assert!(e.contains("watermark.warning = 1.5"), "{e}");
        let e = parse("[watermark]\nfor = \"5 parsecs\"\n").unwrap_err();
        assert!(e.contains("parsecs"), "{e}");
        let e = parse("[watermark]\nclear_below = 0.97\n").unwrap_err();
        assert!(e.contains("could never clear"), "{e}");
        let e = parse("[[notify.webhook]]\nname = \"a\"\nurl = \"https://x\"\n").unwrap_err();
        assert!(e.contains("exactly one of secret"), "{e}");
        let e = parse("[time_to_oom]\nreach = 0\n").unwrap_err();
        assert!(e.contains("time_to_oom.reach = 0"), "{e}");
    }

    #[test]
    fn spans_parse_every_unit() {
        assert_eq!(parse_span("250ms"), Ok(Span(250)));
        assert_eq!(parse_span("30s"), Ok(Span(30_000)));
        assert_eq!(parse_span("5m"), Ok(Span(300_000)));
        assert_eq!(parse_span("2h"), Ok(Span(7_200_000)));
        assert_eq!(parse_span("1d"), Ok(Span(86_400_000)));
        assert!(parse_span("5").is_err());
        assert!(parse_span("-5s").is_err());
    }

    #[test]
    fn alertmanager_and_pagerduty_take_their_documented_defaults() {
        let c = parse(
            "[[notify.alertmanager]]\nname = \"am\"\nurls = [\"http://am-0:9093\", \"http://am-1:9093\"]\n\
             [[notify.pagerduty]]\nname = \"pd\"\nrouting_key = \"R0UTING\"\n",
        )
        .unwrap();
        let am = &c.notify.alertmanager[0];
        assert_eq!(am.urls.len(), 2);
        assert_eq!(am.min_severity, Severity::Info);
        assert_eq!(am.resend_interval, Span(60_000));
        let pd = &c.notify.pagerduty[0];
        assert_eq!(pd.url, "https://events.pagerduty.com/v2/enqueue");
        assert_eq!(pd.min_severity, Severity::Warning);
        let debug = format!("{c:?}");
        assert!(
            !debug.contains("R0UTING") && !debug.contains("am-0"),
            "{debug}"
        );
    }

    #[test]
    fn notifier_mistakes_name_the_channel_and_the_key() {
        for (text, expected) in [
            (
                "[[notify.alertmanager]]\nname = \"am\"\nurls = []\n",
                "notify.alertmanager \"am\": urls is empty",
            ),
            (
                "[[notify.alertmanager]]\nname = \"am\"\nurls = [\"am-0:9093\"]\n",
                "urls[0] must be an http:// or https:// URL with a host",
            ),
            (
                "[[notify.alertmanager]]\nname = \"am\"\nurls = [\"http://a\"]\nresend_interval = \"1s\"\n",
                "resend_interval must be between 5s and 1h",
            ),
            (
                "[[notify.alertmanager]]\nname = \"am\"\nurls = [\"http:///api\"]\n",
                "\"am\": urls[0] must be an http:// or https:// URL with a host",
            ),
            (
                "[[notify.pagerduty]]\nname = \"pd\"\nrouting_key = \"k\"\nurl = \"https://events pagerduty\"\n",
                "notify.pagerduty \"pd\": url must be an http:// or https:// URL with a host",
            ),
            (
                "[[notify.pagerduty]]\nname = \"pd\"\n",
                "notify.pagerduty \"pd\": set exactly one of routing_key and routing_key_file",
            ),
            (
                "[[notify.pagerduty]]\nname = \"x\"\nrouting_key = \"k\"\n\
                 [[notify.alertmanager]]\nname = \"x\"\nurls = [\"http://a\"]\n",
                "notify channel name \"x\" is used twice",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(expected), "{text}: {e}");
        }
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let c = parse("[[notify.webhook]]\nname = \"ops\"\nurl = \"https://hooks.example/abc\"\nsecret = \"hunter2\"\n").unwrap();
        let debug = format!("{c:?}");
        assert!(
            !debug.contains("hunter2") && !debug.contains("hooks.example/abc"),
            "{debug}"
        );
    }
}
