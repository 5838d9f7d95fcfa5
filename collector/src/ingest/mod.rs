//! gRPC ingest: `Register` and the batch `Stream`.

mod service;
pub mod validate;

pub use service::IngestService;
