//! Agent configuration, in layers: built-in defaults, then a TOML file, then
//! `HEADROOM_*` environment variables, then command-line flags (clap reads the
//! environment and the flags; this module owns the defaults, the file and the
//! checks).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// Simulated GPUs driven by a scenario file.
    Sim,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// gRPC address of the collector, `http://host:port` (or `https://`).
    pub collector_url: String,
    /// Name of this node in the fleet; defaults to the host name (for the
    /// simulated source: the scenario node it serves).
    pub node_name: Option<String>,
    /// Where readings come from. There is deliberately no default: an agent
    /// must never report simulated data unless told to.
    pub source: Option<SourceKind>,
    /// Scenario for `source = "sim"`; the built-in demo fleet when absent.
    pub scenario: Option<PathBuf>,
    /// Which node of the scenario to serve; defaults to `node_name`, else the first.
    pub sim_node: Option<String>,
    pub poll_interval_ms: u64,
    pub sample_interval_ms: u64,
    /// Intervals kept while the collector is unreachable (1 h at 1 s).
    pub max_pending_batches: usize,
    /// Ship a short interval at once when a device's used + reserved memory
    /// crosses this fraction of its total (match the collector's watermark).
    pub flush_above: f64,
    /// Prometheus `/metrics` and `/healthz`.
    pub metrics_listen: SocketAddr,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            collector_url: "http://127.0.0.1:50051".into(),
            node_name: None,
            source: None,
            scenario: None,
            sim_node: None,
            poll_interval_ms: 100,
            sample_interval_ms: 1000,
            max_pending_batches: 3600,
            flush_above: 0.90,
            metrics_listen: SocketAddr::from(([0, 0, 0, 0], 9401)),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Values given on the command line or in the environment; each one that is
/// set wins over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub collector_url: Option<String>,
    pub node_name: Option<String>,
    pub source: Option<SourceKind>,
    pub scenario: Option<PathBuf>,
    pub sim_node: Option<String>,
    pub poll_interval_ms: Option<u64>,
    pub sample_interval_ms: Option<u64>,
    pub metrics_listen: Option<SocketAddr>,
}

impl AgentConfig {
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Defaults, then the file when one is given, then `overrides`; validated.
    pub fn load(file: Option<&Path>, overrides: Overrides) -> Result<Self, ConfigError> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                Self::from_toml(&text, path)?
            }
            None => Self::default(),
        };
        config.apply(overrides);
        config.validate()?;
        Ok(config)
    }

    fn apply(&mut self, o: Overrides) {
        if let Some(v) = o.collector_url {
            self.collector_url = v;
        }
        if o.node_name.is_some() {
            self.node_name = o.node_name;
        }
        if o.source.is_some() {
            self.source = o.source;
        }
        if o.scenario.is_some() {
            self.scenario = o.scenario;
        }
        if o.sim_node.is_some() {
            self.sim_node = o.sim_node;
        }
        if let Some(v) = o.poll_interval_ms {
            self.poll_interval_ms = v;
        }
        if let Some(v) = o.sample_interval_ms {
            self.sample_interval_ms = v;
        }
        if let Some(v) = o.metrics_listen {
            self.metrics_listen = v;
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if !(self.collector_url.starts_with("http://")
            || self.collector_url.starts_with("https://"))
        {
            return invalid(format!(
                "collector_url {:?} must start with http:// or https://",
                self.collector_url
            ));
        }
        if !(10..=10_000).contains(&self.poll_interval_ms) {
            return invalid(format!(
                "poll_interval_ms = {} is outside 10..=10000",
                self.poll_interval_ms
            ));
        }
        if self.sample_interval_ms < self.poll_interval_ms || self.sample_interval_ms > 60_000 {
            return invalid(format!(
                "sample_interval_ms = {} must be at least poll_interval_ms ({}) and at most 60000",
                self.sample_interval_ms, self.poll_interval_ms
            ));
        }
        if !(self.flush_above > 0.0 && self.flush_above <= 1.5) {
            return invalid(format!(
                "flush_above = {} must be a fraction of total memory in (0, 1.5] (above 1 turns it off)",
                self.flush_above
            ));
        }
        if self.max_pending_batches == 0 {
            return invalid("max_pending_batches must be at least 1".into());
        }
        if let Some(name) = &self.node_name
            && (name.is_empty() || name.len() > 253)
        {
            return invalid(format!("node_name {name:?} must be 1..=253 bytes"));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_environment_win_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(
            &path,
            "collector_url = \"http://collector:50051\"\npoll_interval_ms = 50\nsource = \"sim\"\n",
        )
        .unwrap();
        let config = AgentConfig::load(
            Some(&path),
            Overrides {
                poll_interval_ms: Some(200),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(config.collector_url, "http://collector:50051");
        assert_eq!(config.poll_interval_ms, 200);
        assert_eq!(config.source, Some(SourceKind::Sim));
        assert_eq!(config.sample_interval_ms, 1000);
    }

    #[test]
    fn unknown_field_is_named_with_its_file() {
        let err = AgentConfig::from_toml("poll_intervall_ms = 5\n", Path::new("/etc/x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/etc/x.toml"), "{err}");
        assert!(err.contains("poll_intervall_ms"), "{err}");
    }

    #[test]
    fn sample_interval_shorter_than_poll_interval_is_rejected() {
        let err = AgentConfig::load(
            None,
            Overrides {
                poll_interval_ms: Some(500),
                sample_interval_ms: Some(100),
                ..Overrides::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("sample_interval_ms = 100"), "{err}");
    }

    #[test]
    fn collector_url_without_scheme_is_rejected() {
        let err = AgentConfig::load(
            None,
            Overrides {
                collector_url: Some("collector:50051".into()),
                ..Overrides::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("collector:50051"), "{err}");
    }
}
