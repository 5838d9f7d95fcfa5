//! From rule transitions to people: persists each alert's lifecycle, applies
//! silences and acknowledgements, and hands notifications to a durable outbox
//! that a background task delivers with retries.

mod alertmanager;
pub mod channels;
mod outbox;
pub mod reachability;
pub mod render;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use channels::{Channel, Sender};
use headroom_common::{Breakdown, Clock};
use headroom_rules::alert::{AlertChange, RestoredAlert};
use headroom_rules::allocator::AllocatorObservation;
use headroom_rules::config::{NotifyConfig, RulesConfig, Severity};
use headroom_rules::engine::Engine;
use headroom_rules::lifecycle::Transition;
use headroom_rules::observation::{DeviceObservation, EventObservation, ProcessObservation};
use headroom_store::JobReportRow;
use headroom_store::alerts::{AlertFilter, AlertUpdate, NewNotification, SilenceView, UpdateKind};
use headroom_store::model::{AllocatorRow, NodeSession, StoreBatch};

use crate::job_reports::JobTracker;
use crate::metrics::{AlertStage, CollectorMetrics};
use headroom_store::{Store, StoreError};

/// How long a Slack notification waits for companions from the same node.
const SLACK_GROUP_WAIT_MS: i64 = 2_000;
/// Ended jobs are looked for every this many seconds.
const JOB_REPORT_EVERY_TICKS: u64 = 5;
/// Reports kept for another try while the store refuses them.
const MAX_UNSAVED_REPORTS: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum AlertingError {
    #[error(transparent)]
    Secret(#[from] channels::SecretError),
    #[error("restoring alerts: {0}")]
    Store(#[from] StoreError),
}

#[derive(Debug)]
pub struct Alerting {
    store: Arc<dyn Store>,
    engine: Mutex<Engine>,
    channels: RwLock<Vec<Channel>>,
    sender: RwLock<Sender>,
    alertmanagers: RwLock<Vec<alertmanager::Target>>,
    /// Owners and the route table, as the rules file gives them.
    routing: RwLock<Arc<NotifyConfig>>,
    clock: Clock,
    /// Where each notification got to, and how soon.
    metrics: Arc<CollectorMetrics>,
    wake_outbox: Notify,
    /// An alert fired or resolved: Alertmanager hears of it now, not at the
    /// next resend.
    wake_alertmanager: Notify,
    /// The jobs running on the nodes this collector holds, for their reports.
    jobs: Mutex<JobTracker>,
    /// Reports the store refused, with their notifications, tried again at
    /// the next pass.
    unsaved_reports: Mutex<Vec<(JobReportRow, Vec<NewNotification>)>>,
}

/// A silence may name the rule as well as labels.
fn is_silenced(silences: &[SilenceView], rule: &str, labels: &serde_json::Value) -> bool {
    if silences.is_empty() {
        return false;
    }
    let mut matchable = labels.as_object().cloned().unwrap_or_default();
    matchable.insert("rule".to_owned(), rule.into());
    silences.iter().any(|s| s.matches(&matchable))
}

fn parse_severity(s: &str) -> Severity {
    match s {
        "critical" => Severity::Critical,
        "info" => Severity::Info,
        _ => Severity::Warning,
    }
}

impl Alerting {
    /// Builds the engine and restores the alerts the store holds as active,
    /// so a restart neither forgets a firing alert nor announces it again.
    pub async fn new(
        store: Arc<dyn Store>,
        config: RulesConfig,
        clock: Clock,
        metrics: Arc<CollectorMetrics>,
    ) -> Result<Arc<Self>, AlertingError> {
        let channels = channels::from_config(&config.notify)?;
        let active = store.alerts(AlertFilter::Active, 100_000).await?;
        let restored: Vec<RestoredAlert> = active
            .into_iter()
            .map(|a| RestoredAlert {
                fingerprint: a.fingerprint,
                rule: a.rule,
                severity: parse_severity(&a.severity),
                firing: a.state == "firing",
                since_ms: a.fired_at_ms.unwrap_or(a.started_at_ms),
                labels: serde_json::from_value(a.labels).unwrap_or_default(),
            })
            .collect();
        if !restored.is_empty() {
            tracing::info!(alerts = restored.len(), "restored active alerts");
        }
        let config_notify = config.notify.clone();
        let mut engine = Engine::new(config);
        engine.restore(restored, clock.now_ms());
        Ok(Arc::new(Self {
            store,
            engine: Mutex::new(engine),
            sender: RwLock::new(Sender::new(channels.clone())),
            channels: RwLock::new(channels),
            alertmanagers: RwLock::new(alertmanager::targets(&config_notify)),
            routing: RwLock::new(Arc::new(config_notify)),
            clock,
            metrics,
            wake_outbox: Notify::new(),
            wake_alertmanager: Notify::new(),
            jobs: Mutex::new(JobTracker::default()),
            unsaved_reports: Mutex::new(Vec::new()),
        }))
    }

    /// Swaps in new rules and channels; alert state carries over.
    pub fn reload(&self, config: RulesConfig) -> Result<(), AlertingError> {
        let channels = channels::from_config(&config.notify)?;
        if let Ok(mut sender) = self.sender.write() {
            *sender = Sender::new(channels.clone());
        }
        if let Ok(mut c) = self.channels.write() {
            *c = channels;
        }
        if let Ok(mut a) = self.alertmanagers.write() {
            *a = alertmanager::targets(&config.notify);
        }
        if let Ok(mut r) = self.routing.write() {
            *r = Arc::new(config.notify.clone());
        }
        if let Ok(mut engine) = self.engine.lock() {
            engine.set_config(config);
        }
        tracing::info!("rules reloaded");
        Ok(())
    }

    /// Runs the clock-driven rules and the outbox until `stop` flips.
    pub fn spawn_background(self: &Arc<Self>, stop: watch::Receiver<bool>) {
        let ticker = self.clone();
        let mut tick_stop = stop.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(Duration::from_secs(1));
            let mut ticks: u64 = 0;
            loop {
                tokio::select! {
                    _ = interval.tick() => {
                        let now = ticker.clock.now_ms();
                        let changes = ticker.engine.lock().map(|mut e| e.tick(now)).unwrap_or_default();
                        ticker.apply(changes).await;
                        ticks += 1;
                        if ticks.is_multiple_of(JOB_REPORT_EVERY_TICKS) {
                            ticker.report_ended_jobs(now).await;
                        }
                    }
                    _ = stopped(&mut tick_stop) => return,
                }
            }
        });
        tokio::spawn(alertmanager::sync(self.clone(), stop.clone()));
        tokio::spawn(outbox::deliver(self.clone(), stop));
    }

    pub fn node_registered(&self, node: &str, sample_interval_ms: u32) {
        if let Ok(mut engine) = self.engine.lock() {
            engine.node_registered(node, i64::from(sample_interval_ms), self.clock.now_ms());
        }
    }

    /// Writes the reports of the jobs that have ended, with the alerts that
    /// concerned them; a report the store refuses is tried again next time.
    async fn report_ended_jobs(&self, now_ms: i64) {
        let rule = self
            .engine
            .lock()
            .map(|e| e.config().job_report.clone())
            .unwrap_or_default();
        if !rule.enabled {
            return;
        }
        let ended = self
            .jobs
            .lock()
            .map(|mut j| j.take_ended(now_ms, rule.end_after.ms()))
            .unwrap_or_default();
        let mut rows: Vec<(JobReportRow, Vec<NewNotification>)> = self
            .unsaved_reports
            .lock()
            .map(|mut u| std::mem::take(&mut *u))
            .unwrap_or_default();
        if !ended.is_empty() {
            let read = async {
                let mut alerts = self.store.alerts(AlertFilter::Active, 10_000).await?;
                alerts.extend(self.store.alerts(AlertFilter::Resolved, 10_000).await?);
                Ok::<_, StoreError>(alerts)
            };
            let alerts = match read.await {
                Ok(alerts) => alerts,
                Err(error) => {
                    // Not written without its alerts: tried again next pass.
                    tracing::warn!(%error, "reading alerts for job reports failed; trying again");
                    if let Ok(mut jobs) = self.jobs.lock() {
                        jobs.put_back(ended);
                    }
                    return;
                }
            };
            let routing = self.routing();
            for job in &ended {
                let body = crate::job_reports::report_body(job, &alerts, Some(job.last_seen_ms));
                let notifications = self.report_notifications(job, &body, &routing, now_ms);
                tracing::info!(kind = job.kind.as_str(), job = %job.job_id, node = %job.node,
                    gpus = job.gpus.len(), channels = notifications.len(),
                    "job ended; memory report written");
                rows.push((
                    JobReportRow {
                        kind: job.kind.as_str().to_owned(),
                        job_id: job.job_id.clone(),
                        node: job.node.clone(),
                        started_at_ms: job.observed_from_ms,
                        ended_at_ms: job.last_seen_ms,
                        report: body.to_string(),
                    },
                    notifications,
                ));
            }
        }
        let mut failed = Vec::new();
        let mut queued = false;
        for (row, notifications) in rows {
            match self.store.save_job_report(&row, &notifications).await {
                Ok(()) => queued |= !notifications.is_empty(),
                Err(error) => {
                    tracing::warn!(%error, job = %row.job_id, "saving a job report failed; trying again");
                    failed.push((row, notifications));
                }
            }
        }
        if queued {
            self.wake_outbox.notify_one();
        }
        if !failed.is_empty()
            && let Ok(mut unsaved) = self.unsaved_reports.lock()
        {
            unsaved.extend(failed);
            // A database away for long must not make the collector grow.
            let excess = unsaved.len().saturating_sub(MAX_UNSAVED_REPORTS);
            if excess > 0 {
                tracing::error!(
                    dropped = excess,
                    "job reports dropped: the store refused them too long"
                );
                unsaved.drain(..excess);
            }
        }
    }

    /// Runs the rules over a committed batch and persists what changed.
    pub async fn observe_batch(&self, session: &NodeSession, batch: &StoreBatch) {
        let reports_on = self
            .engine
            .lock()
            .is_ok_and(|e| e.config().job_report.enabled);
        if reports_on && let Ok(mut jobs) = self.jobs.lock() {
            jobs.observe(session, batch);
        }
        // Memory the agent attributes to processes, per device; a GPU in MIG
        // mode counts the processes of its instances.
        let mut attributed: HashMap<(i64, i64), u64> = HashMap::new();
        // The biggest process per device that says what its memory holds,
        // for a device alert's remedy.
        let mut largest: HashMap<(i64, i64), (u64, Breakdown)> = HashMap::new();
        for p in &batch.process_samples {
            let used = u64::try_from(p.used_last).unwrap_or(0);
            let parent = session.devices.get(&p.device_id).and_then(|d| d.parent_id);
            *attributed.entry((p.device_id, p.timestamp_ms)).or_default() += used;
            if let Some(parent) = parent {
                *attributed.entry((parent, p.timestamp_ms)).or_default() += used;
            }
            let Some(breakdown) = p
                .allocator
                .map(allocator_observation)
                .and_then(|a| a.breakdown(used))
            else {
                continue;
            };
            for device in std::iter::once(p.device_id).chain(parent) {
                let slot = largest
                    .entry((device, p.timestamp_ms))
                    .or_insert((used, breakdown));
                if used > slot.0 {
                    *slot = (used, breakdown);
                }
            }
        }
        let reports_processes = !batch.process_samples.is_empty();
        let mut changes = Vec::new();
        {
            let Ok(mut engine) = self.engine.lock() else {
                return;
            };
            for s in &batch.gpu_samples {
                let Some(meta) = session.devices.get(&s.device_id) else {
                    continue;
                };
                let as_u64 = |v: i64| u64::try_from(v).unwrap_or(0);
                changes.extend(engine.observe_device(&DeviceObservation {
                    node: &session.node,
                    device_uuid: &meta.uuid,
                    gpu_index: meta.gpu_index,
                    mig_profile: meta.mig_profile.as_deref(),
                    timestamp_ms: s.timestamp_ms,
                    used_last: as_u64(s.used_last),
                    used_max: as_u64(s.used_max),
                    reserved: as_u64(s.reserved),
                    total: as_u64(s.total),
                    attributed: reports_processes.then(|| {
                        attributed
                            .get(&(s.device_id, s.timestamp_ms))
                            .copied()
                            .unwrap_or(0)
                    }),
                    largest_process: largest.get(&(s.device_id, s.timestamp_ms)).map(|(_, b)| *b),
                }));
            }
            for p in &batch.process_samples {
                let Some(meta) = session.devices.get(&p.device_id) else {
                    continue;
                };
                changes.extend(engine.observe_process(&ProcessObservation {
                    node: &session.node,
                    device_uuid: &meta.uuid,
                    gpu_index: meta.gpu_index,
                    pid: u32::try_from(p.pid).unwrap_or(0),
                    start_time_ms: p.start_time_ms,
                    name: &p.name,
                    user: &p.user,
                    slurm_job_id: &p.slurm_job_id,
                    slurm_account: &p.slurm_account,
                    pod_uid: &p.pod_uid,
                    pod_namespace: &p.pod_namespace,
                    pod_labels: &p.pod_labels,
                    container_id: &p.container_id,
                    timestamp_ms: p.timestamp_ms,
                    used_last: u64::try_from(p.used_last).unwrap_or(0),
                    used_max: u64::try_from(p.used_max).unwrap_or(0),
                    allocator: p.allocator.map(allocator_observation),
                }));
            }
            for e in &batch.events {
                let meta = e.device_id.and_then(|id| session.devices.get(&id));
                changes.extend(engine.observe_event(&EventObservation {
                    node: &session.node,
                    device_uuid: meta.map(|m| m.uuid.as_str()),
                    gpu_index: meta.map(|m| m.gpu_index),
                    kind: e.kind,
                    code: e.code,
                    detail: &e.detail,
                    timestamp_ms: e.timestamp_ms,
                }));
            }
        }
        self.apply(changes).await;
    }

    async fn apply(&self, changes: Vec<AlertChange>) {
        if changes.is_empty() {
            return;
        }
        let silences = if changes.iter().any(|c| {
            matches!(
                c.transition,
                Transition::Firing { .. } | Transition::Resolved
            )
        }) {
            self.store
                .silences(self.clock.now_ms())
                .await
                .unwrap_or_else(|error| {
                    tracing::error!(%error, "reading silences failed; notifying anyway");
                    Vec::new()
                })
        } else {
            Vec::new()
        };
        let dashboard = self
            .engine
            .lock()
            .ok()
            .and_then(|e| e.config().notify.dashboard_url.clone());
        let routing = self.routing();
        for mut change in changes {
            // The owning team is a label like any other: routes, silences,
            // Alertmanager and receivers all see it.
            if let Some(team) = routing.owners.team(&change.labels) {
                let team = team.to_owned();
                change.labels.entry("team".to_owned()).or_insert(team);
            }
            let labels = serde_json::to_value(&change.labels).unwrap_or_default();
            let silenced = is_silenced(&silences, change.rule, &labels);
            let kind = match change.transition {
                Transition::Pending { .. } => UpdateKind::Pending,
                Transition::Firing { escalated, .. } => UpdateKind::Firing { escalated },
                Transition::Withdrawn => UpdateKind::Withdrawn,
                Transition::Resolved => UpdateKind::Resolved,
            };
            // A silence keeps news of an alert from people, but the end of
            // one they were told of still goes out: a PagerDuty incident or
            // a ticket opened by its firing is closed by it.
            let suppressed = matches!(kind, UpdateKind::Pending | UpdateKind::Withdrawn)
                || (silenced && !matches!(kind, UpdateKind::Resolved));
            let notifications = if suppressed {
                Vec::new()
            } else {
                self.notifications(&change, &routing, dashboard.as_deref())
            };
            let update = AlertUpdate {
                fingerprint: change.fingerprint.clone(),
                rule: change.rule.to_owned(),
                severity: change.severity.as_str().to_owned(),
                kind,
                at_ms: change.at_ms,
                labels: labels.to_string(),
                summary: change.summary.clone(),
                details: change.details.to_string(),
                remedy: change.remedy.clone(),
                notifications,
            };
            match self.store.apply_alert(&update).await {
                Ok(outcome) => {
                    tracing::info!(rule = change.rule, severity = change.severity.as_str(),
                        transition = ?change.transition, silenced, notified = outcome.notified,
                        summary = %change.summary, "alert");
                    if outcome.notified {
                        self.metrics.alert_reached(
                            AlertStage::Committed,
                            self.clock.now_ms() - update.at_ms,
                        );
                        self.wake_outbox.notify_one();
                    }
                    if matches!(kind, UpdateKind::Firing { .. } | UpdateKind::Resolved) {
                        self.wake_alertmanager.notify_one();
                    }
                }
                Err(error) => {
                    tracing::error!(%error, fingerprint = %change.fingerprint, "storing an alert change failed");
                }
            }
        }
    }

    /// Owners and routes in force now.
    fn routing(&self) -> Arc<NotifyConfig> {
        self.routing
            .read()
            .map(|r| Arc::clone(&r))
            .unwrap_or_default()
    }

    /// A job report for each webhook and Slack channel its routes name
    /// (`rule = "job_report"`). PagerDuty and Alertmanager take incidents,
    /// not reports, and are skipped.
    fn report_notifications(
        &self,
        job: &crate::job_reports::JobOnNode,
        body: &serde_json::Value,
        routing: &NotifyConfig,
        now_ms: i64,
    ) -> Vec<NewNotification> {
        let labels = routing.job_report_labels(&crate::job_reports::owner_labels(job));
        let routed = routing.job_report_channels(&labels);
        let Ok(channels) = self.channels.read() else {
            return Vec::new();
        };
        channels
            .iter()
            .filter(|c| routed.contains(&c.name.as_str()))
            .filter_map(|c| {
                // One report version, one delivery per channel: a job seen
                // again and ended later is a new version.
                let key = format!(
                    "job_report:{}:{}:{}:{}:{}:{}",
                    job.kind.as_str(),
                    job.job_id,
                    job.node,
                    job.observed_from_ms,
                    job.last_seen_ms,
                    c.name
                );
                let payload = match c.target {
                    channels::Target::Webhook { .. } => render::job_report_webhook(
                        body,
                        &labels,
                        &key,
                        routing.dashboard_url.as_deref(),
                    ),
                    channels::Target::Slack { .. } => render::job_report_slack(body),
                    channels::Target::PagerDuty { .. } => return None,
                };
                Some(NewNotification {
                    channel: c.name.clone(),
                    idempotency_key: key,
                    payload,
                    group_key: String::new(),
                    deliver_at_ms: now_ms,
                })
            })
            .collect()
    }

    fn notifications(
        &self,
        change: &AlertChange,
        routing: &NotifyConfig,
        dashboard: Option<&str>,
    ) -> Vec<NewNotification> {
        let Ok(channels) = self.channels.read() else {
            return Vec::new();
        };
        let routed = routing.route(&routing.routing_labels(
            &change.labels,
            change.rule,
            change.severity.as_str(),
        ));
        channels
            .iter()
            .filter(|c| change.severity >= c.min_severity)
            .filter(|c| routed.iter().any(|(name, _)| *name == c.name))
            .map(|c| {
                let key = format!(
                    "{}:{}:{}:{}:{}",
                    change.fingerprint,
                    render::status(change),
                    change.severity.as_str(),
                    change.at_ms,
                    c.name
                );
                let now = self.clock.now_ms();
                // People read Slack: alerts of one node that fire together
                // arrive as one message. Machines read webhooks: one each.
                let (payload, group_key, deliver_at_ms) = match c.target {
                    channels::Target::Webhook { .. } => {
                        (render::webhook(change, &key, dashboard), String::new(), now)
                    }
                    channels::Target::Slack { .. } => (
                        render::slack(change, dashboard),
                        change.labels.get("node").cloned().unwrap_or_default(),
                        now + SLACK_GROUP_WAIT_MS,
                    ),
                    channels::Target::PagerDuty { .. } => {
                        (render::pagerduty(change, dashboard), String::new(), now)
                    }
                };
                NewNotification {
                    channel: c.name.clone(),
                    idempotency_key: key,
                    payload,
                    group_key,
                    deliver_at_ms,
                }
            })
            .collect()
    }
}

/// Resolves once `stop` is set (or its sender is gone).
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A stored allocator report as the rules read it.
pub(crate) fn allocator_observation(a: AllocatorRow) -> AllocatorObservation {
    let as_u64 = |v: i64| u64::try_from(v).unwrap_or(0);
    AllocatorObservation {
        timestamp_ms: a.timestamp_ms,
        allocated: as_u64(a.allocated),
        reserved: as_u64(a.reserved),
        inactive_split: as_u64(a.inactive_split),
        peak_allocated: as_u64(a.peak_allocated),
        alloc_retries: as_u64(a.alloc_retries),
        ooms: as_u64(a.ooms),
        composition: a.composition,
    }
}
