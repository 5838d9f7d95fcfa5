//! What the library serves, decided once at the first `nvmlInit*`: the
//! scenario and node named by the environment, and the optional faults file.
//!
//! The environment is injected (`var`), so tests never touch the real one.
//! Every error is one line naming the variable or file and what was wrong.

use std::path::Path;
use std::time::Duration;

use headroom_sim::{NodeSpec, Scenario};
use serde::Deserialize;

use crate::call::DEVICE_FUNCTIONS;
use crate::layout;

pub(crate) const SCENARIO_VAR: &str = "HEADROOM_FAKE_NVML_SCENARIO";
pub(crate) const NODE_VAR: &str = "HEADROOM_FAKE_NVML_NODE";
pub(crate) const FAULTS_VAR: &str = "HEADROOM_FAKE_NVML_FAULTS";

/// The most MIG reconfigurations one GPU may have: handles carry the layout
/// generation in 16 bits.
const MAX_RECONFIGURATIONS_PER_GPU: usize = u16::MAX as usize - 1;

#[derive(Debug)]
pub(crate) struct Config {
    pub node: NodeSpec,
    pub faults: Faults,
}

/// The faults file, validated. Every table is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Faults {
    /// Cumulative PCIe byte counters start `rate × 2 s` below `u64::MAX`, so
    /// they wrap about two seconds after init.
    #[serde(default)]
    pub pcie_counters_start_near_wrap: bool,
    #[serde(default)]
    pub gpu_lost: Vec<GpuLost>,
    #[serde(default)]
    pub hang: Vec<Hang>,
    #[serde(default)]
    pub pcie_counters_unsupported: Vec<PcieCountersUnsupported>,
    #[serde(default)]
    pub xid: Vec<Xid>,
    #[serde(default)]
    pub mig_reconfigure: Vec<MigReconfigure>,
    #[serde(default)]
    pub bogus_process: Vec<BogusProcess>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GpuLost {
    pub gpu: u32,
    #[serde(default)]
    pub after_s: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Hang {
    pub gpu: u32,
    /// An exported function that takes a device handle (or
    /// `nvmlDeviceGetHandleByIndex*`, which takes the GPU's index).
    pub function: String,
    #[serde(default)]
    pub after_s: f64,
    /// How long each affected call sleeps; absent means forever.
    pub duration_s: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PcieCountersUnsupported {
    pub gpu: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Xid {
    pub gpu: u32,
    pub xid: u64,
    pub at_s: f64,
    /// Which MIG instance the error is attributed to; NVML uses 0xFFFFFFFF
    /// (the default) for "the whole GPU".
    #[serde(default = "no_instance")]
    pub gpu_instance_id: u32,
    #[serde(default = "no_instance")]
    pub compute_instance_id: u32,
}

fn no_instance() -> u32 {
    u32::MAX
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MigReconfigure {
    pub gpu: u32,
    pub at_s: f64,
    /// The layout from `at_s` on; empty turns MIG mode off.
    pub profiles: Vec<String>,
}

/// An impossible entry in a GPU's compute process list (pid 0, or more
/// memory than the GPU has), as a confused driver might report.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BogusProcess {
    pub gpu: u32,
    pub pid: u32,
    /// Bytes the entry claims.
    pub memory: u64,
    #[serde(default)]
    pub after_s: f64,
}

impl Faults {
    /// The bogus process-list entries of `gpu` at `t`.
    pub(crate) fn bogus_processes(
        &self,
        gpu: usize,
        t: f64,
    ) -> impl Iterator<Item = &BogusProcess> {
        self.bogus_process
            .iter()
            .filter(move |b| b.gpu as usize == gpu && t >= b.after_s)
    }

    pub(crate) fn is_lost(&self, gpu: usize, t: f64) -> bool {
        self.lost_since(gpu).is_some_and(|since| t >= since)
    }

    /// When the GPU is lost, if ever (the earliest entry for it).
    pub(crate) fn lost_since(&self, gpu: usize) -> Option<f64> {
        self.gpu_lost
            .iter()
            .filter(|lost| lost.gpu as usize == gpu)
            .map(|lost| lost.after_s)
            .reduce(f64::min)
    }

    /// The hang that applies to `function` on `gpu` at `t`, if any.
    pub(crate) fn hang(&self, gpu: usize, function: &str, t: f64) -> Option<&Hang> {
        self.hang
            .iter()
            .find(|hang| hang.gpu as usize == gpu && hang.function == function && t >= hang.after_s)
    }

    pub(crate) fn pcie_counters_unsupported(&self, gpu: usize) -> bool {
        self.pcie_counters_unsupported
            .iter()
            .any(|entry| entry.gpu as usize == gpu)
    }

    fn problems(&self, gpu_count: usize) -> Vec<String> {
        let mut problems = Vec::new();
        let mut gpu = |table: &str, i: usize, gpu: u32| {
            if gpu as usize >= gpu_count {
                problems.push(format!(
                    "{table}[{i}]: gpu = {gpu}, but the node has {gpu_count} GPUs (0..={})",
                    gpu_count.saturating_sub(1)
                ));
            }
        };
        for (i, entry) in self.gpu_lost.iter().enumerate() {
            gpu("gpu_lost", i, entry.gpu);
        }
        for (i, entry) in self.hang.iter().enumerate() {
            gpu("hang", i, entry.gpu);
        }
        for (i, entry) in self.pcie_counters_unsupported.iter().enumerate() {
            gpu("pcie_counters_unsupported", i, entry.gpu);
        }
        for (i, entry) in self.xid.iter().enumerate() {
            gpu("xid", i, entry.gpu);
        }
        for (i, entry) in self.mig_reconfigure.iter().enumerate() {
            gpu("mig_reconfigure", i, entry.gpu);
        }
        for (i, entry) in self.bogus_process.iter().enumerate() {
            gpu("bogus_process", i, entry.gpu);
        }

        let mut time = |table: &str, i: usize, key: &str, value: f64| {
            if !(value.is_finite() && value >= 0.0) {
                problems.push(format!(
                    "{table}[{i}]: {key} = {value} must be a finite number of seconds >= 0"
                ));
            }
        };
        for (i, entry) in self.gpu_lost.iter().enumerate() {
            time("gpu_lost", i, "after_s", entry.after_s);
        }
        for (i, entry) in self.hang.iter().enumerate() {
            time("hang", i, "after_s", entry.after_s);
        }
        for (i, entry) in self.xid.iter().enumerate() {
            time("xid", i, "at_s", entry.at_s);
        }
        for (i, entry) in self.mig_reconfigure.iter().enumerate() {
            time("mig_reconfigure", i, "at_s", entry.at_s);
        }
        for (i, entry) in self.bogus_process.iter().enumerate() {
            time("bogus_process", i, "after_s", entry.after_s);
        }

        for (i, hang) in self.hang.iter().enumerate() {
            if let Some(duration) = hang.duration_s
                && Duration::try_from_secs_f64(duration).is_err()
            {
                problems.push(format!(
                    "hang[{i}]: duration_s = {duration} must be a finite number of seconds >= 0"
                ));
            }
            if !DEVICE_FUNCTIONS.contains(&hang.function.as_str()) {
                problems.push(format!(
                    "hang[{i}]: function = {:?} is not an exported function that takes a GPU \
                     (e.g. \"nvmlDeviceGetMemoryInfo_v2\")",
                    hang.function
                ));
            }
        }

        for (i, entry) in self.mig_reconfigure.iter().enumerate() {
            if entry.profiles.len() > layout::MAX_INSTANCES {
                problems.push(format!(
                    "mig_reconfigure[{i}]: {} profiles, but a GPU has at most {} MIG instances",
                    entry.profiles.len(),
                    layout::MAX_INSTANCES
                ));
            }
            for profile in &entry.profiles {
                if layout::profile_memory(profile).is_none() {
                    problems.push(format!(
                        "mig_reconfigure[{i}]: profile {profile:?} is not of the form \
                         \"<N>g.<M>gb\" (e.g. \"3g.40gb\")"
                    ));
                }
            }
        }
        for gpu in 0..gpu_count {
            let changes = self
                .mig_reconfigure
                .iter()
                .filter(|entry| entry.gpu as usize == gpu)
                .count();
            if changes > MAX_RECONFIGURATIONS_PER_GPU {
                problems.push(format!(
                    "mig_reconfigure: {changes} entries for gpu {gpu}, at most \
                     {MAX_RECONFIGURATIONS_PER_GPU} are supported"
                ));
            }
        }
        problems
    }
}

/// Reads the scenario, node and faults named by the environment.
pub(crate) fn load(var: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
    let set = |name: &str| var(name).filter(|value| !value.trim().is_empty());

    let scenario = match set(SCENARIO_VAR) {
        None => Scenario::demo(),
        Some(value) if value.trim() == "demo" => Scenario::demo(),
        Some(path) => {
            Scenario::load(Path::new(&path)).map_err(|err| format!("{SCENARIO_VAR}: {err}"))?
        }
    };

    let node = match set(NODE_VAR) {
        None => scenario
            .nodes()
            .first()
            .ok_or_else(|| format!("{SCENARIO_VAR}: the scenario has no nodes"))?,
        Some(name) => scenario.node(name.trim()).ok_or_else(|| {
            let known: Vec<&str> = scenario.nodes().iter().map(|n| n.name.as_str()).collect();
            format!(
                "{NODE_VAR}: no node {:?} in the scenario (it has: {})",
                name.trim(),
                known.join(", ")
            )
        })?,
    }
    .clone();

    let faults = match set(FAULTS_VAR) {
        None => Faults::default(),
        Some(path) => load_faults(Path::new(&path), node.gpu_count())
            .map_err(|err| format!("{FAULTS_VAR}: faults file {path}: {err}"))?,
    };
    if let Some(instances) = node
        .inventory()
        .iter()
        .find(|gpu| gpu.mig.len() > layout::MAX_INSTANCES)
    {
        return Err(format!(
            "{SCENARIO_VAR}: GPU {} has {} MIG instances, at most {} are supported",
            instances.index,
            instances.mig.len(),
            layout::MAX_INSTANCES
        ));
    }
    Ok(Config { node, faults })
}

fn load_faults(path: &Path, gpu_count: usize) -> Result<Faults, String> {
    let text = std::fs::read_to_string(path).map_err(|err| format!("cannot read it: {err}"))?;
    parse_faults(&text, gpu_count)
}

pub(crate) fn parse_faults(text: &str, gpu_count: usize) -> Result<Faults, String> {
    let faults: Faults = toml::from_str(text).map_err(|err| err.to_string())?;
    let problems = faults.problems(gpu_count);
    if problems.is_empty() {
        Ok(faults)
    } else {
        Err(problems.join("; "))
    }
}

/// Makes a multi-line message fit the one stderr line init failures get.
/// The source excerpt TOML parse errors quote (`3 | key = 1`, `  | ^^^`)
/// is dropped: the message already names the line and column.
pub(crate) fn one_line(message: &str) -> String {
    let is_excerpt = |line: &str| {
        let digits = line.trim_start_matches(|c: char| c.is_ascii_digit());
        line.starts_with('|') || (digits.len() < line.len() && digits.starts_with(" |"))
    };
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !is_excerpt(line))
        .collect::<Vec<_>>()
        .join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn defaults_to_the_demo_fleets_first_node() {
        let config = load(env(&[])).unwrap();
        assert_eq!(config.node.name, Scenario::demo().nodes()[0].name);
        assert!(config.faults.gpu_lost.is_empty());
        let config = load(env(&[(SCENARIO_VAR, "demo"), (NODE_VAR, "gpu-node-02")])).unwrap();
        assert_eq!(config.node.name, "gpu-node-02");
    }

    #[test]
    fn unknown_node_lists_the_known_ones() {
        let err = load(env(&[(NODE_VAR, "nope")])).unwrap_err();
        assert!(err.contains(NODE_VAR) && err.contains("\"nope\""), "{err}");
        assert!(err.contains("gpu-node-01"), "{err}");
    }

    #[test]
    fn missing_scenario_file_is_named() {
        let err = load(env(&[(SCENARIO_VAR, "/no/such/scenario.toml")])).unwrap_err();
        assert!(err.contains("/no/such/scenario.toml"), "{err}");
    }

    #[test]
    fn faults_parse_with_every_table() {
        let faults = parse_faults(
            r#"
            pcie_counters_start_near_wrap = true
            [[gpu_lost]]
            gpu = 3
            after_s = 2.0
            [[hang]]
            gpu = 1
            function = "nvmlDeviceGetMemoryInfo_v2"
            after_s = 1.0
            duration_s = 5
            [[pcie_counters_unsupported]]
            gpu = 0
            [[xid]]
            gpu = 2
            xid = 79
            at_s = 1.5
            [[mig_reconfigure]]
            gpu = 3
            at_s = 3.0
            profiles = ["7g.80gb"]
            "#,
            8,
        )
        .unwrap();
        assert!(faults.pcie_counters_start_near_wrap);
        assert!(!faults.is_lost(3, 1.9) && faults.is_lost(3, 2.0) && !faults.is_lost(2, 9.0));
        assert!(faults.hang(1, "nvmlDeviceGetMemoryInfo_v2", 0.5).is_none());
        assert!(faults.hang(1, "nvmlDeviceGetMemoryInfo_v2", 1.0).is_some());
        assert!(faults.hang(1, "nvmlDeviceGetName", 1.0).is_none());
        assert!(faults.pcie_counters_unsupported(0) && !faults.pcie_counters_unsupported(1));
        assert_eq!(faults.xid[0].gpu_instance_id, u32::MAX);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = parse_faults("[[gpu_lost]]\ngpu = 1\nafter = 2\n", 8).unwrap_err();
        assert!(err.contains("after"), "{err}");
        let err = parse_faults("gpu_lots = []\n", 8).unwrap_err();
        assert!(err.contains("gpu_lots"), "{err}");
    }

    #[test]
    fn every_problem_is_listed() {
        let err = parse_faults(
            r#"
            [[gpu_lost]]
            gpu = 8
            [[hang]]
            gpu = 0
            function = "nvmlDeviceGetMemoryInfo_v3"
            duration_s = -1
            [[xid]]
            gpu = 0
            xid = 79
            at_s = nan
            [[mig_reconfigure]]
            gpu = 0
            at_s = 1
            profiles = ["big"]
            "#,
            8,
        )
        .unwrap_err();
        for needle in [
            "gpu_lost[0]: gpu = 8",
            "nvmlDeviceGetMemoryInfo_v3",
            "duration_s = -1",
            "xid[0]: at_s = NaN",
            "\"big\"",
        ] {
            assert!(err.contains(needle), "{needle} in {err}");
        }
    }

    #[test]
    fn the_shipped_examples_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let faults = dir.join("faults-example.toml");
        let config = load(env(&[(FAULTS_VAR, faults.to_str().unwrap())])).unwrap();
        assert_eq!(config.faults.gpu_lost.len(), 1);
        assert_eq!(config.faults.mig_reconfigure[0].profiles, ["7g.80gb"]);

        let bench = dir.join("bench-8x50.toml");
        let config = load(env(&[
            (SCENARIO_VAR, bench.to_str().unwrap()),
            (NODE_VAR, "bench-node"),
        ]))
        .unwrap();
        let state = config.node.state_at(30.0);
        assert_eq!(state.len(), 8);
        assert!(state.iter().all(|gpu| gpu.processes.len() == 50));
    }

    #[test]
    fn one_line_joins_lines_and_drops_source_excerpts() {
        assert_eq!(
            one_line("2 problems:\n  - a\n  - b\n"),
            "2 problems: | - a | - b"
        );
        let err = parse_faults("[[gpu_lost]]\ngpu = 1\nafter = 2\n", 8).unwrap_err();
        let line = one_line(&err);
        assert!(
            line.starts_with("TOML parse error at line 3, column 1 | unknown field `after`"),
            "{line}"
        );
    }
}
