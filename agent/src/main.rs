use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use headroom_agent::allocator::listener::ListenerConfig;
use headroom_agent::config::{AgentConfig, Overrides, SourceKind};
use headroom_agent::source::{GpuSource, NvmlOptions, NvmlSource, SimSource};
use headroom_agent::{AgentSettings, AgentToken, identity, kubernetes};
use headroom_common::service;
use headroom_sim::Scenario;

/// Headroom's per-node agent: polls GPU memory and streams it to a collector.
///
/// Settings come from defaults, then the TOML file given by --config, then
/// HEADROOM_* environment variables, then these flags.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Print the built-in defaults as a configuration file and exit.
    #[arg(long)]
    print_default_config: bool,
    /// TOML configuration file.
    #[arg(long, env = "HEADROOM_CONFIG")]
    config: Option<PathBuf>,
    /// Collector gRPC address, e.g. http://collector:50051.
    #[arg(long, env = "HEADROOM_COLLECTOR_URL")]
    collector_url: Option<String>,
    /// Name of this node in the fleet (default: host name).
    #[arg(long, env = "HEADROOM_NODE_NAME")]
    node_name: Option<String>,
    /// Where readings come from (default: nvml, the real GPUs).
    #[arg(long, env = "HEADROOM_SOURCE", value_enum)]
    source: Option<SourceKind>,
    /// Path of libnvidia-ml (default: libnvidia-ml.so.1 from the loader's search path).
    #[arg(long, env = "HEADROOM_NVML_LIBRARY")]
    nvml_library: Option<PathBuf>,
    /// The host's /proc, for attributing processes to users, containers, pods and jobs.
    #[arg(long, env = "HEADROOM_PROCFS_ROOT")]
    procfs_root: Option<PathBuf>,
    /// The kubelet's pod log directories, for pods' namespaces.
    #[arg(long, env = "HEADROOM_POD_LOG_DIR")]
    pod_log_dir: Option<PathBuf>,
    /// Pod label keys to read from the API server and send with each pod's
    /// processes, comma-separated (`team,app`); none by default.
    #[arg(long, env = "HEADROOM_POD_LABELS", value_delimiter = ',')]
    pod_labels: Option<Vec<String>>,
    /// The Kubernetes API server; in a pod, the in-cluster service.
    #[arg(long, env = "HEADROOM_KUBERNETES_API_URL")]
    kubernetes_api_url: Option<String>,
    /// Report an NVML call as hung (and its GPU as stalled) after this many milliseconds.
    #[arg(long, env = "HEADROOM_NVML_CALL_TIMEOUT_MS")]
    nvml_call_timeout_ms: Option<u64>,
    /// Re-read MIG layouts this often, in milliseconds.
    #[arg(long, env = "HEADROOM_MIG_CHECK_INTERVAL_MS")]
    mig_check_interval_ms: Option<u64>,
    /// Scenario file for --source sim (default: the built-in demo fleet).
    #[arg(long, env = "HEADROOM_SCENARIO")]
    scenario: Option<PathBuf>,
    /// Scenario node to serve with --source sim (default: the node name, else the first node).
    #[arg(long, env = "HEADROOM_SIM_NODE")]
    sim_node: Option<String>,
    /// Fast poll period in milliseconds.
    #[arg(long, env = "HEADROOM_POLL_INTERVAL_MS")]
    poll_interval_ms: Option<u64>,
    /// Interval one shipped sample covers, in milliseconds.
    #[arg(long, env = "HEADROOM_SAMPLE_INTERVAL_MS")]
    sample_interval_ms: Option<u64>,
    /// Address for Prometheus /metrics and /healthz (default 0.0.0.0:9401).
    #[arg(long, env = "HEADROOM_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Also expose memory, PCIe, XID, temperature, power and SM clock under
    /// dcgm-exporter 4.8's names and labels, beside Headroom's
    /// (`dcgm_metric_names`).
    #[arg(long, env = "HEADROOM_DCGM_METRIC_NAMES")]
    dcgm_metric_names: Option<bool>,
    /// Unix socket for allocator reports from training processes (default
    /// /run/headroom/allocator.sock).
    #[arg(long, env = "HEADROOM_ALLOCATOR_SOCKET")]
    allocator_socket: Option<PathBuf>,
    /// Do not open the allocator socket (wins over --allocator-socket).
    #[arg(long)]
    no_allocator_socket: bool,
    /// Directory of the disk spool (default /var/lib/headroom-agent/spool;
    /// empty: keep unacknowledged batches in memory only).
    #[arg(long, env = "HEADROOM_SPOOL_DIR")]
    spool_dir: Option<PathBuf>,
    /// File holding the token to present to the collector.
    #[arg(long, env = "HEADROOM_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// The token itself (wins over --token-file; prefer an EnvironmentFile
    /// of mode 0600 to a flag, which shows in `ps`).
    #[arg(long, env = "HEADROOM_AGENT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("headroom-agent: {error:#}");
            // EX_CONFIG-style: a bad setup, not a crash.
            ExitCode::from(78)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    if cli.print_default_config {
        print!("{}", AgentConfig::default_toml());
        return Ok(());
    }
    let cli_token = cli.token;
    let config = AgentConfig::load(
        cli.config.as_deref(),
        Overrides {
            collector_url: cli.collector_url,
            node_name: cli.node_name,
            source: cli.source,
            nvml_library: cli.nvml_library,
            procfs_root: cli.procfs_root,
            pod_log_dir: cli.pod_log_dir,
            pod_labels: cli.pod_labels,
            kubernetes_api_url: cli.kubernetes_api_url,
            nvml_call_timeout_ms: cli.nvml_call_timeout_ms,
            mig_check_interval_ms: cli.mig_check_interval_ms,
            scenario: cli.scenario,
            sim_node: cli.sim_node,
            poll_interval_ms: cli.poll_interval_ms,
            sample_interval_ms: cli.sample_interval_ms,
            metrics_listen: cli.metrics_listen,
            dcgm_metric_names: cli.dcgm_metric_names,
            allocator_socket: if cli.no_allocator_socket {
                Some(PathBuf::new())
            } else {
                cli.allocator_socket
            },
            spool_dir: cli.spool_dir,
            token_file: cli.token_file,
        },
    )?;
    let mut pod_label_reader = None;
    let (source, node): (Box<dyn GpuSource>, String) = match config.source {
        SourceKind::Nvml => {
            let node = match &config.node_name {
                Some(name) => name.clone(),
                None => identity::hostname()
                    .context("cannot read this host's name; set node_name (HEADROOM_NODE_NAME)")?,
            };
            let pod_labels = if config.pod_labels.is_empty() {
                None
            } else {
                let url = config
                    .kubernetes_api_url
                    .clone()
                    .or_else(kubernetes::ApiServer::in_cluster_url)
                    .context(
                        "pod_labels is set, but this agent runs in no pod and kubernetes_api_url is not set: name the API server",
                    )?;
                let labels = Arc::new(kubernetes::PodLabels::default());
                pod_label_reader = Some((
                    kubernetes::ApiServer {
                        url,
                        service_account_dir: config.kubernetes_service_account_dir.clone(),
                        node: node.clone(),
                        keys: config.pod_labels.clone(),
                    },
                    labels.clone(),
                ));
                Some(labels)
            };
            let source = NvmlSource::new(NvmlOptions {
                library: config.nvml_library.clone(),
                procfs_root: config.procfs_root.clone(),
                pod_log_dir: config.pod_log_dir.clone(),
                pod_labels,
                call_timeout: Duration::from_millis(config.nvml_call_timeout_ms),
                poll_wait: Duration::from_millis(config.poll_interval_ms * 4 / 5),
                // Half the wait: a call that slow is not NVML's usual
                // microseconds, and the other GPUs should not miss a poll.
                handoff_after: Duration::from_millis(config.poll_interval_ms * 2 / 5),
                layout_check: Duration::from_millis(config.mig_check_interval_ms),
                pcie_fallback_interval: Duration::from_millis(config.pcie_fallback_interval_ms),
                // Slow-moving values once a second, whatever the poll rate.
                slow_every: (1000 / config.poll_interval_ms).max(1),
                read_health: config.dcgm_metric_names,
                ..NvmlOptions::default()
            })?;
            (Box::new(source), node)
        }
        SourceKind::Sim => {
            let scenario = match &config.scenario {
                Some(path) => Scenario::load(path)?,
                None => Scenario::demo(),
            };
            let sim_node = config
                .sim_node
                .clone()
                .or_else(|| config.node_name.clone())
                .or_else(|| scenario.nodes().first().map(|n| n.name.clone()))
                .context("the scenario has no nodes")?;
            let source = SimSource::new(&scenario, &sim_node)?;
            tracing::warn!(
                sim_node,
                "serving SIMULATED GPUs from a scenario, not real hardware"
            );
            let node = config.node_name.clone().unwrap_or(sim_node);
            (Box::new(source), node)
        }
    };
    let token = match (&cli_token, &config.token_file) {
        (Some(token), _) => Some(token.clone()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read token_file {}", path.display()))?,
        ),
        (None, None) => None,
    };
    let token = token
        .map(|t| AgentToken::new(&t))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let tls = if config.collector_url.starts_with("https://") {
        Some(config.tls_files().load()?)
    } else {
        None
    };
    let settings = AgentSettings {
        collector_url: config.collector_url.clone(),
        node,
        token,
        tls,
        spool: config.spool(),
        boot_id: identity::random_run_id(),
        poll_interval: Duration::from_millis(config.poll_interval_ms),
        sample_interval: Duration::from_millis(config.sample_interval_ms),
        max_pending_batches: config.max_pending_batches,
        flush_above: config.flush_above,
        metrics_listen: Some(config.metrics_listen),
        dcgm_metric_names: config.dcgm_metric_names,
        allocator_socket: (!config.allocator_socket.as_os_str().is_empty()).then(|| {
            ListenerConfig {
                path: config.allocator_socket.clone(),
                procfs_root: config.procfs_root.clone(),
                max_clients: config.allocator_max_clients,
                max_clients_per_user: config.allocator_max_clients_per_user,
            }
        }),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let node = settings.node.clone();
        let agent = headroom_agent::start(settings, source)?;
        let (stop_pod_labels, stopped) = tokio::sync::watch::channel(false);
        if let Some((api, labels)) = pod_label_reader {
            tokio::spawn(kubernetes::keep_pod_labels(api, labels, stopped));
        }
        service::ready(&format!("polling the GPUs of {node}"));
        let watchdog = service::spawn_watchdog(agent.sampler_progress());
        shutdown_signal().await;
        tracing::info!("shutting down");
        service::stopping();
        if let Some(watchdog) = watchdog {
            watchdog.abort();
        }
        let _ = stop_pod_labels.send(true);
        agent.stop().await;
        Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
