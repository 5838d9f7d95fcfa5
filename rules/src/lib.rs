//! Memory rules, evaluated on ingest as small per-series state machines.

pub mod allocator;
pub mod backtest;
pub mod config;
pub mod engine;
pub mod leak;
pub mod lifecycle;
pub mod oom;
pub mod remedy;
#[cfg(test)]
mod trace_fixtures;
pub mod trend;
pub mod xid;
