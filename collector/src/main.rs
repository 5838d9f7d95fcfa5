mod backtest;
#[cfg(feature = "demo")]
mod demo;
mod job_report_cli;
mod route_check;
mod status;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use headroom_collector::Collector;
use headroom_collector::alerts::Alerting;
use headroom_collector::config::{CollectorConfig, Overrides};
use headroom_collector::http::auth::HttpAuthMode;
use headroom_collector::token_admin::{self, TokenAction};
use headroom_common::Clock;
use headroom_rules::config::RulesConfig;
use headroom_store::redact_url;
use tokio::net::TcpListener;

/// glibc's malloc walks and merges its small free chunks each time a large
/// buffer is freed, and ingest frees large buffers (a write's `COPY` rows)
/// many times a second among thousands of small ones (decoded strings).
/// mimalloc does not: 17 % more samples a second on the ingest benchmark
/// (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        /// Dashboard sign-in: none, tokens or proxy (`[http_auth] mode`).
        #[arg(long, env = "HEADROOM_HTTP_AUTH", value_parser = parse_http_auth_mode)]
        http_auth: Option<HttpAuthMode>,
        /// postgres://… or sqlite://… (prefer the environment: flags show in `ps`).
        #[arg(long, env = "HEADROOM_DATABASE_URL", hide_env_values = true)]
        database_url: Option<String>,
        /// Rules file (TOML); built-in defaults without one. Reloaded on SIGHUP.
        #[arg(long, env = "HEADROOM_RULES")]
        rules: Option<PathBuf>,
        /// Where other collectors sharing the database reach this one's HTTP
        /// port (`[cluster] advertise_url`).
        #[arg(long, env = "HEADROOM_ADVERTISE_URL")]
        advertise_url: Option<String>,
        /// Start even when a notification channel's host does not answer
        /// (its notifications wait in the outbox); refused otherwise.
        #[arg(long, env = "HEADROOM_ALLOW_UNREACHABLE_NOTIFIERS")]
        allow_unreachable_notifiers: bool,
    },
    /// Replay a memory trace (CSV) through the rules and print the alerts
    /// they would raise, one JSON object per line; or score the rules on a
    /// directory of labelled traces; or write the built-in labelled corpus.
    Backtest(backtest::BacktestArgs),
    /// Print the fleet's headroom (fullest GPU first) and the firing alerts,
    /// from a running collector's API.
    Status {
        /// The collector's HTTP address.
        #[arg(long, env = "HEADROOM_URL", default_value = "http://127.0.0.1:8080")]
        url: String,
        /// A dashboard token (viewer is enough) when the collector asks for
        /// one (prefer the environment: flags show in `ps`).
        #[arg(long, env = "HEADROOM_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// How many of the fullest GPUs and MIG instances to list (1-1000).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=1000))]
        fullest: u16,
    },
    /// Run the whole system on this machine: the collector on SQLite and one
    /// simulated agent per node of a scenario, streaming over gRPC on loopback.
    #[cfg(feature = "demo")]
    Demo(demo::DemoArgs),
    /// Production builds leave the simulated agents out; say so rather than
    /// answer "unrecognized subcommand".
    #[cfg(not(feature = "demo"))]
    #[command(hide = true, disable_help_flag = true)]
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Say which notification channels an alert with these labels reaches
    /// under a rules file, and by which route; sends nothing.
    Route {
        /// Rules file (TOML), with its owners file if it names one.
        #[arg(long, env = "HEADROOM_RULES")]
        rules: PathBuf,
        /// The alert's labels as label=value: severity is required; rule,
        /// node, user and the rest as routes match them.
        #[arg(required = true)]
        labels: Vec<String>,
    },
    /// Print the memory report of a Slurm job or pod that has ended (its
    /// peak per GPU, what held it, its alerts, a right-sizing suggestion),
    /// from a running collector's API.
    JobReport {
        /// The Slurm job id or the pod's UID.
        id: String,
        /// The collector's HTTP address.
        #[arg(long, env = "HEADROOM_URL", default_value = "http://127.0.0.1:8080")]
        url: String,
        /// A dashboard token (viewer is enough) when the collector asks for
        /// one (prefer the environment: flags show in `ps`).
        #[arg(long, env = "HEADROOM_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Print the built-in defaults of `serve` as a configuration file.
    PrintDefaultConfig,
    /// Enrol, list and revoke the tokens agents present (`[agents]
    /// require_token`) and dashboard users sign in with (`[http_auth]`), in
    /// the database `serve` uses.
    Token {
        /// TOML configuration file (for its database_url).
        #[arg(long, env = "HEADROOM_CONFIG", global = true)]
        config: Option<PathBuf>,
        /// postgres://… or sqlite://… (prefer the environment: flags show in `ps`).
        #[arg(
            long,
            env = "HEADROOM_DATABASE_URL",
            hide_env_values = true,
            global = true
        )]
        database_url: Option<String>,
        #[command(subcommand)]
        action: TokenAction,
    },
    /// Let another node register a GPU (or MIG instance) that its old node
    /// still lists: for a GPU moved between hosts while the old host is
    /// down. Until then the collector refuses the new host's registration.
    ReleaseDevice {
        /// The device's UUID, as the refusal names it.
        uuid: String,
        /// TOML configuration file (for its database_url).
        #[arg(long, env = "HEADROOM_CONFIG")]
        config: Option<PathBuf>,
        /// postgres://… or sqlite://… (prefer the environment: flags show in `ps`).
        #[arg(long, env = "HEADROOM_DATABASE_URL", hide_env_values = true)]
        database_url: Option<String>,
    },
}

fn main() -> ExitCode {
    // Logs on stderr: stdout is the data of `token`, `status`, `backtest`.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
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
                http_auth,
                database_url,
                rules,
                advertise_url,
                allow_unreachable_notifiers,
            } => {
                let config = CollectorConfig::load(
                    config.as_deref(),
                    Overrides {
                        grpc_listen,
                        http_listen,
                        http_auth,
                        database_url,
                        advertise_url,
                    },
                )?;
                serve(config, rules, allow_unreachable_notifiers).await
            }
            Command::Backtest(args) => backtest::run(args),
            Command::JobReport { id, url, token } => {
                job_report_cli::run(&url, token.as_deref(), &id).await
            }
            Command::Route { rules, labels } => {
                print!(
                    "{}",
                    route_check::explain(&read_rules_file(&rules)?, &labels)?
                );
                Ok(())
            }
            Command::Status {
                url,
                token,
                fullest,
            } => status::run(&url, token.as_deref(), fullest).await,
            #[cfg(feature = "demo")]
            Command::Demo(args) => demo::run(args).await,
            #[cfg(not(feature = "demo"))]
            Command::Demo { .. } => anyhow::bail!(
                "this collector was built without the simulated fleet (cargo feature `demo`); \
                 run `cargo run --release -- demo` from the source tree"
            ),
            Command::Token {
                config,
                database_url,
                action,
            } => {
                let config = CollectorConfig::load(
                    config.as_deref(),
                    Overrides {
                        database_url,
                        ..Overrides::default()
                    },
                )?;
                let store = headroom_store::connect(&config.database_url)
                    .await
                    .with_context(|| format!("opening {}", redact_url(&config.database_url)))?;
                let result = token_admin::run(
                    store.as_ref(),
                    action,
                    Clock::System.now_ms(),
                    &mut std::io::stdout().lock(),
                )
                .await;
                store.close().await;
                Ok(result?)
            }
            Command::ReleaseDevice {
                uuid,
                config,
                database_url,
            } => {
                let config = CollectorConfig::load(
                    config.as_deref(),
                    Overrides {
                        database_url,
                        ..Overrides::default()
                    },
                )?;
                let store = headroom_store::connect(&config.database_url)
                    .await
                    .with_context(|| format!("opening {}", redact_url(&config.database_url)))?;
                let released = store.release_device(&uuid, Clock::System.now_ms()).await;
                store.close().await;
                match released? {
                    Some(node) => {
                        println!("released {uuid} from node {node}: another node may register it");
                        Ok(())
                    }
                    None => anyhow::bail!("no device has UUID {uuid:?}"),
                }
            }
            Command::PrintDefaultConfig => {
                print!("{}", CollectorConfig::default_toml());
                Ok(())
            }
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

fn parse_http_auth_mode(text: &str) -> Result<HttpAuthMode, String> {
    match text {
        "none" => Ok(HttpAuthMode::None),
        "tokens" => Ok(HttpAuthMode::Tokens),
        "proxy" => Ok(HttpAuthMode::Proxy),
        other => Err(format!("{other:?} is not one of none, tokens, proxy")),
    }
}

fn load_rules(path: Option<&std::path::Path>) -> anyhow::Result<RulesConfig> {
    match path {
        Some(path) => read_rules_file(path),
        None => Ok(RulesConfig::default()),
    }
}

/// The rules file, with the owners file it names taken in.
fn read_rules_file(path: &std::path::Path) -> anyhow::Result<RulesConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read rules file {}", path.display()))?;
    let mut rules = RulesConfig::parse(&text, path)?;
    if let Some(owners) = rules.notify.owners.file.clone() {
        let text = std::fs::read_to_string(&owners).with_context(|| {
            format!(
                "cannot read the owners file {} named by {}",
                owners.display(),
                path.display()
            )
        })?;
        let map = headroom_rules::routing::OwnerMap::parse(&text, &owners)?;
        rules.notify.owners.extend_missing(map);
    }
    Ok(rules)
}

/// Refuses rules whose notification channels nobody answers for, unless
/// `allow`; warns of each one down either way.
async fn check_notifiers(rules: &RulesConfig, allow: bool) -> anyhow::Result<()> {
    use headroom_collector::alerts::{channels, reachability};
    let targets = channels::from_config(&rules.notify)?;
    let warnings =
        match reachability::check(&rules.notify, &targets, reachability::CONNECT_TIMEOUT).await {
            Ok(warnings) => warnings,
            Err(unreachable) if allow => vec![unreachable],
            Err(unreachable) => return Err(unreachable.into()),
        };
    for warning in warnings {
        tracing::warn!(key = %warning.key, endpoint = %warning.endpoint, reason = %warning.reason,
            "notification channel not answering; its notifications wait until it does");
    }
    Ok(())
}

async fn serve(
    config: CollectorConfig,
    rules_path: Option<PathBuf>,
    allow_unreachable_notifiers: bool,
) -> anyhow::Result<()> {
    let rules = load_rules(rules_path.as_deref())?;
    check_notifiers(&rules, allow_unreachable_notifiers).await?;
    let store = headroom_store::connect_with(&config.database_url, config.storage.clone())
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
    let collector = Collector::builder(store.clone())
        .config(&config)?
        .rules(rules)
        .build()
        .await?;
    if !collector.serves_tls() && !config.grpc_listen.ip().is_loopback() {
        tracing::warn!(grpc = %config.grpc_listen,
            "gRPC is plaintext ([tls] cert_file unset): samples and agent tokens cross the network in the clear");
    }
    if !config.agents.require_token && !config.grpc_listen.ip().is_loopback() {
        tracing::warn!(grpc = %config.grpc_listen,
            "agents need no token ([agents] require_token = false): anyone who reaches this port can send samples");
    }
    if config.http_auth.mode == HttpAuthMode::None && !config.http_listen.ip().is_loopback() {
        tracing::warn!(http = %config.http_listen,
            "the dashboard needs no sign-in ([http_auth] mode = \"none\"): anyone who reaches this port can read and acknowledge or silence alerts");
    }
    if let (Some(alerting), Some(path)) = (collector.alerting().cloned(), rules_path) {
        tokio::spawn(reload_on_sighup(
            alerting,
            path,
            allow_unreachable_notifiers,
        ));
    }
    headroom_common::service::ready("serving");
    // Progress is the runtime scheduling the watchdog's own task: a wedged
    // runtime stops pinging.
    let ticks = std::sync::atomic::AtomicU64::new(0);
    let watchdog = headroom_common::service::spawn_watchdog(move || {
        ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    });
    let served = collector
        .serve(grpc, http, async {
            shutdown_signal().await;
            headroom_common::service::stopping();
        })
        .await;
    if let Some(watchdog) = watchdog {
        watchdog.abort();
    }
    // Hands the maintenance lock to another collector at once.
    store.close().await;
    served?;
    Ok(())
}

/// Re-reads the rules file on SIGHUP; a bad file is reported and the running
/// rules stay in force.
async fn reload_on_sighup(
    alerting: std::sync::Arc<Alerting>,
    path: PathBuf,
    allow_unreachable_notifiers: bool,
) {
    let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        let result = match read_rules_file(&path) {
            Ok(rules) => check_notifiers(&rules, allow_unreachable_notifiers)
                .await
                .and_then(|()| alerting.reload(rules).map_err(anyhow::Error::from)),
            Err(error) => Err(error),
        };
        if let Err(error) = result {
            tracing::error!(error = %format!("{error:#}"), "rules reload failed; keeping the running rules");
        }
    }
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
