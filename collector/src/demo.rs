//! `headroom-collector demo`: the whole system on one machine.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use headroom_agent::AgentSettings;
use headroom_agent::source::SimSource;
use headroom_collector::Collector;
use headroom_sim::Scenario;
use tokio::net::TcpListener;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Scenario to simulate (default: the built-in fleet, 4 nodes × 8 GPUs).
    #[arg(long)]
    scenario: Option<PathBuf>,
    /// Folder for the SQLite database; created if missing.
    #[arg(long, default_value = "headroom-data")]
    data_dir: PathBuf,
    /// Dashboard and JSON API address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http_listen: SocketAddr,
    /// gRPC address for the simulated agents (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    grpc_listen: SocketAddr,
    /// Rules file (TOML) to try on the demo fleet; built-in defaults
    /// without one.
    #[arg(long)]
    rules: Option<PathBuf>,
    /// Above this many devices the dashboard shows a cell per node
    /// (`[http] stream_devices_max`): to see a large fleet's view on a
    /// small demo.
    #[arg(long, default_value_t = headroom_collector::http::HttpServerConfig::default().stream_devices_max)]
    stream_devices_max: u32,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let scenario = match &args.scenario {
        Some(path) => Scenario::load(path)?,
        None => Scenario::demo(),
    };
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating data folder {}", args.data_dir.display()))?;
    let db = args.data_dir.join("headroom.db");
    let url = format!("sqlite://{}", db.display());
    let store = headroom_store::connect(&url)
        .await
        .with_context(|| format!("opening {url}"))?;

    let grpc = TcpListener::bind(args.grpc_listen)
        .await
        .with_context(|| format!("binding gRPC to {}", args.grpc_listen))?;
    let grpc_addr = grpc.local_addr()?;
    let http = TcpListener::bind(args.http_listen).await.with_context(|| {
        format!(
            "binding the dashboard to {} (try --http-listen 127.0.0.1:0)",
            args.http_listen
        )
    })?;
    let http_addr = http.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let collector = Collector::builder(store.clone())
        .rules(crate::load_rules(args.rules.as_deref())?)
        .http_server(headroom_collector::http::HttpServerConfig {
            stream_devices_max: args.stream_devices_max,
            ..Default::default()
        })
        .build()
        .await?;
    let collector = tokio::spawn(collector.serve(grpc, http, async move {
        let _ = stopped.await;
    }));

    let boot_id = headroom_agent::identity::random_run_id();
    let mut agents = Vec::new();
    for node in scenario.nodes() {
        let source = SimSource::new(&scenario, &node.name)?;
        let settings = AgentSettings {
            spool: None,
            tls: None,
            token: None,
            collector_url: format!("http://{grpc_addr}"),
            node: node.name.clone(),
            boot_id: boot_id.clone(),
            poll_interval: Duration::from_millis(100),
            sample_interval: Duration::from_secs(1),
            max_pending_batches: 3600,
            flush_above: 0.90,
            metrics_listen: None,
            allocator_socket: None,
            dcgm_metric_names: false,
        };
        agents.push(headroom_agent::start(settings, Box::new(source))?);
    }
    let gpus: usize = scenario.nodes().iter().map(|n| n.gpu_count()).sum();
    println!();
    println!(
        "Headroom demo: {} simulated nodes, {gpus} GPUs, data in {}",
        agents.len(),
        db.display()
    );
    println!("  dashboard: http://{http_addr}/");
    println!("  API:       http://{http_addr}/api/v1/gpus");
    println!("  agents → collector gRPC on {grpc_addr}");
    println!("Press Ctrl-C to stop.");
    println!();

    crate::shutdown_signal().await;
    for agent in agents {
        agent.stop().await;
    }
    let _ = stop.send(());
    collector.await??;
    store.close().await;
    Ok(())
}
