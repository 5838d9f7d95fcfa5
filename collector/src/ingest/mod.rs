//! gRPC ingest: `Register` and the batch `Stream`, and the writers that
//! store many streams' batches together.

pub mod auth;
pub mod coalesce;
mod connection;
mod service;
pub mod validate;

pub use auth::AgentAuth;
pub use coalesce::{Coalescer, WriterConfig};
pub use connection::IdleTimeout;
pub use service::IngestService;
