//! Helpers shared by the cross-crate tests: real databases, an in-process
//! collector, and fixtures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod cpu;
pub mod fake_nvml;
pub mod fixtures;
pub mod harness;
pub mod postgres;
pub mod receiver;
