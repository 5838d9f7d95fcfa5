//! Generated code for Headroom's wire protocol, package `headroom.v1`.
//!
//! The generated types stay at the edge: the agent and the collector convert
//! them into their own domain types once, where they cross the wire.

#[allow(
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    rust_2018_idioms
)]
pub mod v1 {
    tonic::include_proto!("headroom.v1");
}

/// Path of the `.proto` source, for tools such as `grpcurl` that read it.
pub const PROTO_PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/proto/headroom/v1/headroom.proto"
);
