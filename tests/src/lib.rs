//! Helpers shared by the cross-crate tests: real databases, an in-process
//! collector, and fixtures.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers of tests: they fail loudly by design

pub mod balancer;
pub mod browser;
pub mod ci;
pub mod cpu;
pub mod fake_nvml;
pub mod fixtures;
pub mod harness;
pub mod postgres;
pub mod processes;

pub use ci::skip_or_fail_under_ci;
pub mod receiver;
