//! Headroom's cross-crate tests, one binary with a module per area: built and
//! linked once against the whole stack, and sharing one throwaway Postgres
//! cluster and one build of the fake libnvidia-ml between areas.
//!
//! A test that needs something this machine lacks (Postgres, Chromium,
//! promtool, ...) skips with a SKIPPING line, and fails instead under
//! `CI=true` (`headroom_tests::skip_or_fail_under_ci`).

// Tests fail loudly by design: an unwrap names the line that broke.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod agent_auth;
mod agent_tls;
mod alerting;
mod allocator;
mod allocator_minutes;
mod architecture;
mod chaos;
mod coalesced_writes;
mod container_image;
mod dashboard_auth;
mod dashboard_browser;
mod dcgm_dashboard;
mod doc_links;
mod end_to_end;
mod hostile_grpc;
mod hostile_http;
mod http_hardening;
mod ingest_grpc;
mod job_reports;
mod kubernetes;
mod notifiers;
mod nvml_agent;
mod nvml_source;
mod postgres_cluster;
mod postgres_failover;
mod postgres_packing;
mod postgres_rollup_packing;
mod prometheus_rules;
mod python_client;
mod release;
mod sqlite_chunks;
mod store_conformance;
mod systemd;
mod uplink_refusals;
mod uplink_slow_collector;
