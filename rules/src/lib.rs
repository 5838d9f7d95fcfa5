//! Memory rules, evaluated on ingest as small per-series state machines: samples
//! in, alert decisions out, no I/O. `backtest` replays a recorded trace
//! through the same engine; `score` measures it on labelled traces (the
//! built-in `corpus`, or a directory of them: the only file access here)
//! beside the `predict_linear` baseline.
//!
//! Each rule is one file under `rules/`, named in the catalogue there
//! ([`RuleId`]); the engine keeps the series, the alert lifecycle and the
//! dispatch. Imports run one way: `observation` and `alert` (the types both
//! sides share) at the bottom, `rule` (the traits) and the rules on them,
//! the engine on top. The other modules are the machinery rules share: statistics
//! (`trend`, `leak`, `oom`), the XID catalogue, allocator reports, wording.

pub mod alert;
pub mod allocator;
pub mod backtest;
pub mod config;
pub mod corpus;
#[cfg(test)]
mod corpus_scorecard;
mod describe;
pub mod engine;
#[cfg(test)]
mod engine_fixtures;
pub mod evaluate;
pub mod families;
pub mod generator;
pub mod leak;
pub mod lifecycle;
pub mod observation;
pub mod oom;
pub mod predict_linear;
pub mod remedy;
pub mod routing;
mod rule;
mod rules;
pub mod score;
mod trace_fixtures;
pub mod trend;
pub mod xid;

pub use rules::{RuleId, UnknownRule};
