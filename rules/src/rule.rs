//! What a rule is to the engine. A rule watches one kind of series (a GPU or
//! MIG instance, a process, a node, the events of a GPU), keeps whatever it
//! needs to remember about one series in itself (the engine starts one
//! instance per series), and judges its one alert on that series through an
//! [`Alert`]: whether its condition holds now, for how long it must hold, and
//! what to tell people. The engine owns everything else: which series exist,
//! their labels and identity, the lifecycle, fingerprints, restoring alerts
//! after a restart, and ending the alerts of a series that goes away.
//!
//! One trait per kind of series rather than one trait for all: each kind is
//! fed by a different call with different facts, and a rule implements only
//! the one its series is, so no rule carries empty methods for the others.
//!
//! Every rule is called whether or not it is on, and checks its own
//! `enabled`: a rule that keeps history (a trend, a counter) keeps it while
//! off, so that a reload turning it on judges at once with full evidence.

use std::collections::BTreeMap;
use std::fmt::Debug;

use headroom_common::Breakdown;

use crate::alert::{Alert, Message};
use crate::allocator::AllocatorObservation;
use crate::config::RulesConfig;
use crate::observation::{DeviceObservation, EventObservation, ProcessObservation};

/// What a rule is given when the engine first sees one of its series.
#[derive(Debug)]
pub(crate) struct Start<'a, O> {
    pub config: &'a RulesConfig,
    /// The observation that opened the series.
    pub observation: &'a O,
    /// Set when this rule's alert on the series was handed back active after
    /// a collector restart: when it was handed back. A rule whose condition
    /// depends on history it lost in the restart can hold the alert as if
    /// its signal was last seen then, instead of resolving it at once.
    pub restored_at_ms: Option<i64>,
}

/// A rule on a GPU or MIG instance, fed every interval of it.
pub(crate) trait DeviceRule: Debug + Send + Sync {
    fn start(start: &Start<'_, DeviceObservation<'_>>) -> Self
    where
        Self: Sized;

    fn observe(&mut self, config: &RulesConfig, o: &DeviceObservation<'_>, alert: &mut Alert<'_>);

    /// A process on the device reported an interval. A rule that forecasts
    /// the device from its processes' own trends folds it in here; it judges
    /// in [`DeviceRule::observe`], on the device's next interval.
    fn observe_process(&mut self, _o: &ProcessObservation<'_>) {}
}

/// What the engine keeps about a process beyond the interval at hand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ProcessFacts {
    /// The newest report of the process's allocator, however old.
    pub last_report: Option<AllocatorObservation>,
    /// The same report while it is recent enough to speak for now.
    pub report: Option<AllocatorObservation>,
}

impl ProcessFacts {
    /// Where the process's memory goes, from a recent report that counts
    /// its parts and what the driver says it holds now.
    pub fn breakdown(&self, o: &ProcessObservation<'_>) -> Option<Breakdown> {
        self.report.and_then(|r| r.breakdown(o.used_last))
    }
}

/// A rule on one process on one device, fed every interval of it.
pub(crate) trait ProcessRule: Debug + Send + Sync {
    fn start(start: &Start<'_, ProcessObservation<'_>>) -> Self
    where
        Self: Sized;

    fn observe(
        &mut self,
        config: &RulesConfig,
        o: &ProcessObservation<'_>,
        facts: &ProcessFacts,
        alert: &mut Alert<'_>,
    );
}

/// What the engine keeps about a node: when it was last heard from, and how
/// often it said it would report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NodeFacts<'a> {
    pub node: &'a str,
    pub last_seen_ms: i64,
    pub interval_ms: i64,
}

/// A rule on a node as a whole: judged as time passes, since what it watches
/// for may be the absence of data.
pub(crate) trait NodeRule: Debug + Send + Sync {
    fn start() -> Self
    where
        Self: Sized;

    /// Called about once a second.
    fn tick(
        &mut self,
        config: &RulesConfig,
        node: &NodeFacts<'_>,
        now_ms: i64,
        alert: &mut Alert<'_>,
    );

    /// A device sample from the node arrived, timed `ts_ms`.
    fn heard(
        &mut self,
        config: &RulesConfig,
        node: &NodeFacts<'_>,
        ts_ms: i64,
        alert: &mut Alert<'_>,
    );
}

/// Whether an event series lives on after a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Keep,
    /// The alert has ended and the series goes: the next event of its kind
    /// opens a new one.
    Close,
}

/// A rule on the events an agent reports. Its series is one (node, device,
/// code): every distinct code the rule files an event under is an alert of
/// its own.
pub(crate) trait EventRule: Debug + Send + Sync {
    /// The code this rule files `e` under, or `None` when the event is not
    /// this rule's or the rule is off. Checked before any series exists, so
    /// that an event the rule ignores leaves no state behind.
    fn accepts(config: &RulesConfig, e: &EventObservation<'_>) -> Option<i64>
    where
        Self: Sized;

    fn start(code: i64) -> Self
    where
        Self: Sized;

    /// Labels the rule adds to its series' alert beyond node and device.
    fn label(&self, _labels: &mut BTreeMap<String, String>) {}

    fn observe(&mut self, config: &RulesConfig, e: &EventObservation<'_>, alert: &mut Alert<'_>);

    /// Called about once a second; `last_event_ms` is the newest event of
    /// the series.
    fn tick(
        &mut self,
        _config: &RulesConfig,
        _now_ms: i64,
        _last_event_ms: i64,
        _alert: &mut Alert<'_>,
    ) -> Outcome {
        Outcome::Keep
    }

    /// The series' device was read again, at `ts_ms`. Only series filed
    /// under code 0 hear of it: those are the one-per-device alerts.
    fn device_reports(
        &mut self,
        _ts_ms: i64,
        _last_event_ms: i64,
        _alert: &mut Alert<'_>,
    ) -> Outcome {
        Outcome::Keep
    }
}

pub(crate) type StartDevice = fn(&Start<'_, DeviceObservation<'_>>) -> Box<dyn DeviceRule>;
pub(crate) type StartProcess = fn(&Start<'_, ProcessObservation<'_>>) -> Box<dyn ProcessRule>;
pub(crate) type StartNode = fn() -> Box<dyn NodeRule>;
pub(crate) type AcceptsEvent = fn(&RulesConfig, &EventObservation<'_>) -> Option<i64>;
pub(crate) type StartEvent = fn(i64) -> Box<dyn EventRule>;

/// How a rule plugs into the engine: the kind of series it watches and how
/// to start it on one. Built from the rule's type, so that registering a
/// rule is naming it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rule {
    Device(StartDevice),
    Process(StartProcess),
    Node(StartNode),
    Event {
        accepts: AcceptsEvent,
        start: StartEvent,
    },
}

impl Rule {
    pub(crate) fn device<R: DeviceRule + 'static>() -> Self {
        Self::Device(|start| Box::new(R::start(start)))
    }

    pub(crate) fn process<R: ProcessRule + 'static>() -> Self {
        Self::Process(|start| Box::new(R::start(start)))
    }

    pub(crate) fn node<R: NodeRule + 'static>() -> Self {
        Self::Node(|| Box::new(R::start()))
    }

    pub(crate) fn event<R: EventRule + 'static>() -> Self {
        Self::Event {
            accepts: R::accepts,
            start: |code| Box::new(R::start(code)),
        }
    }
}

/// For an event that leaves no "recovered" event behind (a lost GPU, hung
/// NVML calls): the alert resolves when the device is read again, by a
/// sample taken after the event, since one already in flight says nothing
/// about recovery.
pub(crate) fn resolve_when_read_after(
    ts_ms: i64,
    last_event_ms: i64,
    alert: &mut Alert<'_>,
) -> Outcome {
    if ts_ms <= last_event_ms {
        return Outcome::Keep;
    }
    let labels = alert.labels();
    alert.step(ts_ms, None, 0, || {
        Message::new(
            format!("{} reports again", crate::describe::device_name(labels)),
            serde_json::json!({}),
        )
    });
    Outcome::Close
}
