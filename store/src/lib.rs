//! Storage behind one trait, with a Postgres implementation for production and
//! a SQLite one for a single machine and the demo. Both pass one conformance
//! suite (`tests/tests/suite/store_conformance.rs`). The schema history of each
//! lives beside it, in `migrations/`.

pub mod alerts;
mod chart_fold;
mod chunk_columns;
mod chunk_format;
mod connection;
mod error;
mod fleet_devices;
mod flush_encoding;
pub mod job_reports;
pub mod model;
pub mod open_chunks;
pub mod peers;
mod postgres;
pub mod rollup;
mod rows;
mod sqlite;
mod store;
pub mod tokens;
pub mod views;

pub use alerts::AlertStore;
pub use connection::{connect, connect_with, redact_url};
pub use error::StoreError;
pub use fleet_devices::FleetDevices;
pub use job_reports::{JobReportRow, JobReportStore};
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
pub use store::Store;
pub use tokens::TokenStore;
pub use views::{
    AllocatorLatest, AllocatorPoint, AllocatorSeries, AllocatorSeriesQuery, DeviceView, EventView,
    FleetHistoryPoint, LatestSample, MAX_PROCESSES_PER_SERIES, NodeView, OwnerMatch, ProcessSeries,
    ProcessView, ProcessesOn, SeriesPoint,
};
