//! `headroom-collector`: receives samples from agents over gRPC, stores them
//! (Postgres, or SQLite on one machine) and serves the JSON API and dashboard.

pub mod alerts;
pub mod auth;
pub mod config;
pub mod http;
pub mod ingest;
pub mod job_report_text;
pub mod job_reports;
pub mod metrics;
pub mod peers;
pub mod server;
pub mod token_admin;

pub use server::{Collector, CollectorBuilder};
