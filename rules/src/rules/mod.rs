//! The catalogue: every rule Headroom runs, by name. A rule is one file in
//! this folder (its condition, its per-series state, the text of its alert
//! and its remedy), its `mod` line and its entry in the list below, and its
//! section of the rules file in `config.rs`. Nothing else names it: the
//! engine takes its rules from this list, and knows series, not rules.
//!
//! The names are what alerts are stored, shown and fingerprinted under, so a
//! name, once shipped, never changes: renaming one would orphan every alert
//! the store holds under the old name and fire them all again.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::rule::Rule;

mod agent_silent;
mod alloc_retries;
mod allocator_oom;
mod fragmentation;
mod gpu_lost;
mod leak;
mod nvml_hung;
mod process_watermark;
mod time_to_oom;
mod unattributed;
mod watermark;
mod xid;

/// Declares [`RuleId`] from one list, so that the enum, its names and
/// [`RuleId::ALL`] cannot disagree: a variant missing from `ALL` would be a
/// rule the engine silently never runs.
macro_rules! catalogue {
    ($($(#[$doc:meta])* $variant:ident = $name:literal => $rule:expr,)+) => {
        /// A rule, by the name its alerts carry.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum RuleId {
            $($(#[$doc])* #[serde(rename = $name)] $variant,)+
        }

        impl RuleId {
            /// Every rule, in the order the engine runs them on a series
            /// (and so the order their changes come out in).
            pub const ALL: &[RuleId] = &[$(Self::$variant,)+];

            /// The name alerts are stored, shown and fingerprinted under.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }

            /// How the rule plugs into the engine.
            pub(crate) fn rule(self) -> Rule {
                match self {
                    $(Self::$variant => $rule,)+
                }
            }
        }
    };
}

catalogue! {
    /// A GPU or MIG instance's memory over a share of its total.
    Watermark = "watermark" => Rule::device::<watermark::Watermark>(),
    /// A GPU's memory trending towards full within the horizon.
    TimeToOom = "time_to_oom" => Rule::device::<time_to_oom::TimeToOom>(),
    /// Memory in use on a GPU that no visible process holds.
    Unattributed = "unattributed" => Rule::device::<unattributed::Unattributed>(),
    /// A process whose memory floor keeps rising.
    Leak = "leak" => Rule::process::<leak::Leak>(),
    /// A process holding more than the configured limit.
    ProcessWatermark = "process_watermark" => Rule::process::<process_watermark::ProcessWatermark>(),
    /// A process's allocator holding cache even its peak leaves unused.
    Fragmentation = "fragmentation" => Rule::process::<fragmentation::Fragmentation>(),
    /// A process's allocator flushing its cache to retry `cudaMalloc`.
    AllocRetries = "alloc_retries" => Rule::process::<alloc_retries::AllocRetries>(),
    /// A process's allocator raising out-of-memory errors.
    AllocatorOom = "allocator_oom" => Rule::process::<allocator_oom::AllocatorOom>(),
    /// A node whose agent stopped sending.
    AgentSilent = "agent_silent" => Rule::node::<agent_silent::AgentSilent>(),
    /// An XID error the driver logged for a GPU.
    Xid = "xid" => Rule::event::<xid::Xid>(),
    /// A GPU NVML reports as lost.
    GpuLost = "gpu_lost" => Rule::event::<gpu_lost::GpuLost>(),
    /// NVML calls on a GPU that stopped returning.
    NvmlHung = "nvml_hung" => Rule::event::<nvml_hung::NvmlHung>(),
}

impl fmt::Display for RuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name no rule of this build carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown rule {0:?}")]
pub struct UnknownRule(pub String);

impl FromStr for RuleId {
    type Err = UnknownRule;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .iter()
            .copied()
            .find(|id| id.as_str() == name)
            .ok_or_else(|| UnknownRule(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// The names alerts in existing stores carry. Written out rather than
    /// derived, so that renaming or dropping one fails here; a new rule
    /// need not be added.
    const SHIPPED: [&str; 12] = [
        "watermark",
        "time_to_oom",
        "unattributed",
        "leak",
        "process_watermark",
        "fragmentation",
        "alloc_retries",
        "allocator_oom",
        "agent_silent",
        "xid",
        "gpu_lost",
        "nvml_hung",
    ];

    #[test]
    fn every_rule_round_trips_through_its_name() {
        for &id in RuleId::ALL {
            assert_eq!(id.as_str().parse::<RuleId>(), Ok(id));
            assert_eq!(id.to_string(), id.as_str());
            let json = serde_json::to_string(&id).unwrap();
            assert_eq!(json, format!("\"{}\"", id.as_str()));
            assert_eq!(serde_json::from_str::<RuleId>(&json).unwrap(), id);
        }
        let names: HashSet<&str> = RuleId::ALL.iter().map(|id| id.as_str()).collect();
        assert_eq!(names.len(), RuleId::ALL.len(), "two rules share a name");
    }

    #[test]
    fn every_shipped_name_still_names_its_rule() {
        for name in SHIPPED {
            assert_eq!(name.parse::<RuleId>().map(RuleId::as_str), Ok(name));
        }
    }

    #[test]
    fn an_unknown_name_is_refused_by_name() {
        let e = "watermarks".parse::<RuleId>().unwrap_err();
        assert_eq!(e, UnknownRule("watermarks".into()));
        assert_eq!(e.to_string(), "unknown rule \"watermarks\"");
        assert!(serde_json::from_str::<RuleId>("\"Watermark\"").is_err());
    }
}
