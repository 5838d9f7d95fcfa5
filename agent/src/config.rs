//! Agent configuration, in layers: built-in defaults, then a TOML file, then
//! `HEADROOM_*` environment variables, then command-line flags (clap reads the
//! environment and the flags; this module owns the defaults, the file and the
//! checks).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::outbox::SpoolConfig;
use crate::tls::ClientTlsFiles;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// The GPUs of this host, through NVIDIA's management library.
    #[default]
    Nvml,
    /// Simulated GPUs driven by a scenario file.
    Sim,
}

/// The most pod label keys forwarded: each is a label on every alert about
/// the pod's processes.
pub const MAX_POD_LABELS: usize = 8;

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// gRPC address of the collector, `http://host:port` (or `https://`).
    pub collector_url: String,
    /// Name of this node in the fleet; defaults to the host name (for the
    /// simulated source: the scenario node it serves).
    pub node_name: Option<String>,
    /// Where readings come from: the real GPUs unless told otherwise. When
    /// NVML cannot be loaded the agent stops with an error; it never falls
    /// back to simulated data on its own.
    pub source: SourceKind,
    /// libnvidia-ml to load; the driver's `libnvidia-ml.so.1` from the
    /// loader's search path when absent.
    pub nvml_library: Option<PathBuf>,
    /// The host's `/proc`, for attributing processes to users, containers,
    /// pods and Slurm jobs (in a container: the host's, mounted).
    pub procfs_root: PathBuf,
    /// The kubelet's pod log directories (`<namespace>_<pod>_<uid>`), for
    /// the namespace of a pod's processes (in a container: the host's,
    /// mounted).
    pub pod_log_dir: PathBuf,
    /// Pod label keys (`team`, `app.kubernetes.io/part-of`) read from the
    /// Kubernetes API server and sent with each pod's processes, for owner
    /// routes; empty (the default) asks the API server nothing.
    pub pod_labels: Vec<String>,
    /// The API server; default: the in-cluster service, in a pod.
    pub kubernetes_api_url: Option<String>,
    /// The service account's `token` and `ca.crt`.
    pub kubernetes_service_account_dir: PathBuf,
    /// An NVML call running longer than this is reported as hung and its
    /// GPU as stalled.
    pub nvml_call_timeout_ms: u64,
    /// How often each GPU's MIG layout is re-read.
    pub mig_check_interval_ms: u64,
    /// Cadence of the PCIe throughput fallback on GPUs without byte counters.
    pub pcie_fallback_interval_ms: u64,
    /// Scenario for `source = "sim"`; the built-in demo fleet when absent.
    pub scenario: Option<PathBuf>,
    /// Which node of the scenario to serve; defaults to `node_name`, else the first.
    pub sim_node: Option<String>,
    pub poll_interval_ms: u64,
    pub sample_interval_ms: u64,
    /// File holding the token this agent presents to the collector (mode
    /// 0600; `headroom-collector token create` makes one). The environment's
    /// `HEADROOM_AGENT_TOKEN` wins over it. None: send no token.
    pub token_file: Option<PathBuf>,
    /// PEM CA bundle to trust for an `https://` collector_url (default: the
    /// system's trust store).
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate chain and key (PEM) for a collector that requires
    /// mutual TLS.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// Name the collector's certificate must carry (default: the URL's host).
    pub tls_server_name: Option<String>,
    /// Directory of the disk spool, where intervals wait until the collector
    /// acknowledges them: through collector outages, agent restarts and host
    /// reboots. Empty keeps them in memory only (lost with the process).
    pub spool_dir: PathBuf,
    /// Size cap of the spool; past it the oldest segment is dropped and its
    /// batches counted.
    pub spool_max_mib: u64,
    /// Size of one spool segment file (deleted whole once acknowledged).
    pub spool_segment_mib: u64,
    /// Longest a queued interval stays unsynced to disk (0: fsync each one).
    /// Only a host crash can lose this much; a killed agent loses nothing.
    pub spool_fsync_interval_ms: u64,
    /// Intervals kept in memory without a spool (1 h at 1 s).
    pub max_pending_batches: usize,
    /// Ship a short interval at once when a device's used + reserved memory
    /// crosses this fraction of its total (match the collector's watermark).
    pub flush_above: f64,
    /// Prometheus `/metrics`, `/healthz` and `/readyz`.
    pub metrics_listen: SocketAddr,
    /// Also expose memory, PCIe, XID, temperature, power and SM clock under
    /// dcgm-exporter 4.8's names and labels (`DCGM_FI_DEV_FB_USED`, ...),
    /// beside Headroom's; temperature, power and clock are then read from
    /// NVML once a second.
    pub dcgm_metric_names: bool,
    /// Unix socket on which training processes report their allocator's
    /// statistics (`clients/python`); open to every local user, each report
    /// tied to its sender's pid by the kernel. Empty turns it off.
    pub allocator_socket: PathBuf,
    /// Processes that may report at once; more are refused and counted.
    pub allocator_max_clients: usize,
    /// Of those, how many one user may hold.
    pub allocator_max_clients_per_user: usize,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            collector_url: "http://127.0.0.1:50051".into(),
            node_name: None,
            source: SourceKind::Nvml,
            nvml_library: None,
            procfs_root: PathBuf::from("/proc"),
            pod_log_dir: PathBuf::from(crate::attribution::DEFAULT_POD_LOG_DIR),
            pod_labels: Vec::new(),
            kubernetes_api_url: None,
            kubernetes_service_account_dir: PathBuf::from(crate::kubernetes::SERVICE_ACCOUNT_DIR),
            nvml_call_timeout_ms: 5_000,
            mig_check_interval_ms: 10_000,
            pcie_fallback_interval_ms: 1_000,
            scenario: None,
            sim_node: None,
            poll_interval_ms: 100,
            sample_interval_ms: 1000,
            token_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_server_name: None,
            spool_dir: PathBuf::from("/var/lib/headroom-agent/spool"),
            spool_max_mib: 1024,
            spool_segment_mib: 16,
            spool_fsync_interval_ms: 1000,
            max_pending_batches: 3600,
            flush_above: 0.90,
            metrics_listen: SocketAddr::from(([0, 0, 0, 0], 9401)),
            dcgm_metric_names: false,
            allocator_socket: PathBuf::from("/run/headroom/allocator.sock"),
            allocator_max_clients: 256,
            allocator_max_clients_per_user: 64,
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
    pub nvml_library: Option<PathBuf>,
    pub procfs_root: Option<PathBuf>,
    pub pod_log_dir: Option<PathBuf>,
    pub pod_labels: Option<Vec<String>>,
    pub kubernetes_api_url: Option<String>,
    pub nvml_call_timeout_ms: Option<u64>,
    pub mig_check_interval_ms: Option<u64>,
    pub scenario: Option<PathBuf>,
    pub sim_node: Option<String>,
    pub poll_interval_ms: Option<u64>,
    pub sample_interval_ms: Option<u64>,
    pub metrics_listen: Option<SocketAddr>,
    pub dcgm_metric_names: Option<bool>,
    pub allocator_socket: Option<PathBuf>,
    pub spool_dir: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
}

impl AgentConfig {
    /// The built-in defaults as a configuration file (keys that have no
    /// default, like `node_name`, are left out).
    pub fn default_toml() -> String {
        let body = toml::to_string(&Self::default())
            .unwrap_or_else(|e| format!("# cannot render the defaults: {e}\n"));
        format!(
            "# headroom-agent built-in defaults (headroom-agent --print-default-config).\n\
             # Every key is explained in deploy/agent.toml.\n{body}"
        )
    }

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
        if let Some(v) = o.source {
            self.source = v;
        }
        if o.nvml_library.is_some() {
            self.nvml_library = o.nvml_library;
        }
        if let Some(v) = o.procfs_root {
            self.procfs_root = v;
        }
        if let Some(v) = o.pod_log_dir {
            self.pod_log_dir = v;
        }
        if let Some(v) = o.pod_labels {
            self.pod_labels = v.into_iter().filter(|k| !k.trim().is_empty()).collect();
        }
        if o.kubernetes_api_url.is_some() {
            self.kubernetes_api_url = o.kubernetes_api_url;
        }
        if let Some(v) = o.nvml_call_timeout_ms {
            self.nvml_call_timeout_ms = v;
        }
        if let Some(v) = o.mig_check_interval_ms {
            self.mig_check_interval_ms = v;
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
        if let Some(v) = o.dcgm_metric_names {
            self.dcgm_metric_names = v;
        }
        if let Some(v) = o.allocator_socket {
            self.allocator_socket = v;
        }
        if let Some(v) = o.spool_dir {
            self.spool_dir = v;
        }
        if o.token_file.is_some() {
            self.token_file = o.token_file;
        }
    }

    /// Where the TLS material is.
    pub fn tls_files(&self) -> ClientTlsFiles {
        ClientTlsFiles {
            ca: self.tls_ca_file.clone(),
            cert: self.tls_cert_file.clone(),
            key: self.tls_key_file.clone(),
            server_name: self.tls_server_name.clone(),
        }
    }

    /// The spool's settings; `None` when `spool_dir` is empty.
    pub fn spool(&self) -> Option<SpoolConfig> {
        (!self.spool_dir.as_os_str().is_empty()).then(|| SpoolConfig {
            dir: self.spool_dir.clone(),
            max_bytes: self.spool_max_mib << 20,
            segment_bytes: self.spool_segment_mib << 20,
            fsync_interval: Duration::from_millis(self.spool_fsync_interval_ms),
        })
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
        if self.collector_url.starts_with("http://") && !self.tls_files().is_empty() {
            return invalid(format!(
                "tls_* settings are given but collector_url {:?} is plain http:// (use https://)",
                self.collector_url
            ));
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return invalid("tls_cert_file and tls_key_file go together (mutual TLS)".into());
        }
        if self.pod_labels.len() > MAX_POD_LABELS {
            return invalid(format!(
                "pod_labels names {} keys; at most {MAX_POD_LABELS} are forwarded",
                self.pod_labels.len()
            ));
        }
        if let Some(url) = &self.kubernetes_api_url
            && !(url.starts_with("https://") || url.starts_with("http://"))
        {
            return invalid(format!(
                "kubernetes_api_url {url:?} must start with https:// (or http:// for a local proxy)"
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
        if !(100..=600_000).contains(&self.nvml_call_timeout_ms) {
            return invalid(format!(
                "nvml_call_timeout_ms = {} is outside 100..=600000",
                self.nvml_call_timeout_ms
            ));
        }
        if !(100..=3_600_000).contains(&self.mig_check_interval_ms) {
            return invalid(format!(
                "mig_check_interval_ms = {} is outside 100..=3600000",
                self.mig_check_interval_ms
            ));
        }
        if !(100..=60_000).contains(&self.pcie_fallback_interval_ms) {
            return invalid(format!(
                "pcie_fallback_interval_ms = {} is outside 100..=60000",
                self.pcie_fallback_interval_ms
            ));
        }
        if !(1..=4096).contains(&self.allocator_max_clients) {
            return invalid(format!(
                "allocator_max_clients = {} is outside 1..=4096",
                self.allocator_max_clients
            ));
        }
        if !(1..=self.allocator_max_clients).contains(&self.allocator_max_clients_per_user) {
            return invalid(format!(
                "allocator_max_clients_per_user = {} must be between 1 and allocator_max_clients ({})",
                self.allocator_max_clients_per_user, self.allocator_max_clients
            ));
        }
        if self.allocator_socket.as_os_str().len() > 107 {
            return invalid(format!(
                "allocator_socket {} is longer than a Unix socket path may be (107 bytes)",
                self.allocator_socket.display()
            ));
        }
        if !(1..=1024).contains(&self.spool_segment_mib) {
            return invalid(format!(
                "spool_segment_mib = {} is outside 1..=1024",
                self.spool_segment_mib
            ));
        }
        if self.spool_max_mib < 2 * self.spool_segment_mib {
            return invalid(format!(
                "spool_max_mib = {} must hold at least two segments of spool_segment_mib = {}",
                self.spool_max_mib, self.spool_segment_mib
            ));
        }
        if self.spool_max_mib > 1 << 30 {
            return invalid(format!(
                "spool_max_mib = {} is more than 1 PiB",
                self.spool_max_mib
            ));
        }
        if self.spool_fsync_interval_ms > 60_000 {
            return invalid(format!(
                "spool_fsync_interval_ms = {} is above 60000",
                self.spool_fsync_interval_ms
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
        assert_eq!(config.source, SourceKind::Sim);
        assert_eq!(config.sample_interval_ms, 1000);
    }

    #[test]
    fn the_spool_is_on_by_default_and_an_empty_dir_turns_it_off() {
        let config = AgentConfig::load(None, Overrides::default()).unwrap();
        let spool = config.spool().unwrap();
        assert_eq!(spool.dir, PathBuf::from("/var/lib/headroom-agent/spool"));
        assert_eq!(spool.max_bytes, 1 << 30);
        let config = AgentConfig::load(
            None,
            Overrides {
                spool_dir: Some(PathBuf::new()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(config.spool(), None);
    }

    #[test]
    fn a_spool_cap_below_two_segments_is_rejected() {
        let err = AgentConfig::from_toml("spool_max_mib = 16\n", Path::new("a.toml"))
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("spool_max_mib = 16"), "{err}");
    }

    mod properties {
        use super::*;

        proptest::proptest! {
            #[test]
            fn any_file_text_loads_or_names_the_file(text in proptest::prelude::any::<String>()) {
                if let Err(error) = AgentConfig::from_toml(&text, Path::new("/etc/headroom/agent.toml"))
                    .and_then(|config| config.validate().map(|()| config))
                {
                    let message = error.to_string();
                    proptest::prop_assert!(
                        message.contains("agent.toml") || message.starts_with("invalid configuration"),
                        "{}", message
                    );
                }
            }
        }
    }

    #[test]
    fn real_gpus_are_the_default_source() {
        let config = AgentConfig::load(None, Overrides::default()).unwrap();
        assert_eq!(config.source, SourceKind::Nvml);
        assert_eq!(config.procfs_root, PathBuf::from("/proc"));
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
