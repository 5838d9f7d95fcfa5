//! A deterministic model of a fleet of GPU nodes.
//!
//! A [`Scenario`] (a TOML file, see `sim/README.md`) describes nodes, their
//! GPUs and MIG instances, and processes whose memory follows a shape over
//! time: steady, warming up, leaking, cycling, spiking or ramping into an
//! out-of-memory crash. [`NodeSpec::state_at`] evaluates a node at any time
//! `t` (seconds since the scenario started); the same `t` always gives the
//! same readings, so simulated agents, the demo fleet and tests agree without
//! sharing state.
//!
//! ```
//! let demo = headroom_sim::Scenario::demo();
//! let node = &demo.nodes()[0];
//! let now = node.state_at(90.0);
//! assert_eq!(now.len(), node.inventory().len());
//! assert_eq!(now, node.state_at(90.0));
//! ```

mod fleet;
mod ids;
mod model;
mod scenario;
mod shape;
mod spec;
mod state;
mod validate;

pub use headroom_common::bytes::{ByteSize, HumanBytes};
pub use model::NodeSpec;
pub use scenario::{Scenario, ScenarioError};
pub use state::{AllocatorSnapshot, GpuInfo, GpuState, MigInfo, MigState, ProcessState};
