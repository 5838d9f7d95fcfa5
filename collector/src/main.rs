mod demo;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use headroom_collector::Collector;
use headroom_collector::config::{CollectorConfig, Overrides};
use headroom_collector::store::{self, redact_url};
use tokio::net::TcpListener;

/// Headroom's collector: stores GPU memory samples from agents, serves the
/// dashboard and the JSON API.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the collector. Settings: defaults, then --config, then HEADROOM_*
    /// environment variables, then flags.
    Serve {
        /// TOML configuration file.
        #[arg(long, env = "HEADROOM_CONFIG")]
        config: Option<PathBuf>,
        /// gRPC address agents connect to.
        #[arg(long, env = "HEADROOM_GRPC_LISTEN")]
        grpc_listen: Option<SocketAddr>,
        /// Dashboard and JSON API address.
        #[arg(long, env = "HEADROOM_HTTP_LISTEN")]
        http_listen: Option<SocketAddr>,
        /// postgres://… or sqlite://… (prefer the environment: flags show in `ps`).
        #[arg(long, env = "HEADROOM_DATABASE_URL", hide_env_values = true)]
        database_url: Option<String>,
    },
    /// Run the whole system on this machine: the collector on SQLite and one
    /// simulated agent per node of a scenario, streaming over gRPC on loopback.
    Demo(demo::DemoArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn")),
        )
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("headroom-collector: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve {
                config,
                grpc_listen,
                http_listen,
                database_url,
            } => {
                let config = CollectorConfig::load(
                    config.as_deref(),
                    Overrides {
                        grpc_listen,
                        http_listen,
                        database_url,
                    },
                )?;
                serve(config).await
            }
            Command::Demo(args) => demo::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("headroom-collector: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: CollectorConfig) -> anyhow::Result<()> {
    let store = store::connect(&config.database_url)
        .await
        .with_context(|| format!("opening {}", redact_url(&config.database_url)))?;
    let grpc = TcpListener::bind(config.grpc_listen)
        .await
        .with_context(|| format!("binding gRPC to {}", config.grpc_listen))?;
    let http = TcpListener::bind(config.http_listen)
        .await
        .with_context(|| format!("binding HTTP to {}", config.http_listen))?;
    tracing::info!(grpc = %config.grpc_listen, http = %config.http_listen,
        database = %redact_url(&config.database_url), "collector listening");
    Collector::new(store)
        .serve(grpc, http, shutdown_signal())
        .await?;
    Ok(())
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
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
    tracing::info!("shutting down");
}
