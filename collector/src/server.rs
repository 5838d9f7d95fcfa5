//! Runs the collector's two servers, gRPC ingest and HTTP, on listeners the
//! caller has already bound (port 0 in tests), until a shutdown signal.

use std::future::Future;
use std::sync::Arc;

use headroom_proto::v1::ingest_server::IngestServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::ServerTlsConfig;

use crate::alerts::{Alerting, AlertingError};
use crate::auth::cache::TokenCache;
use crate::clock::Clock;
use crate::http::auth::{HttpAuth, HttpAuthConfig};
use crate::http::{self, AppState};
use crate::ingest::validate::Limits;
use crate::ingest::{AgentAuth, Coalescer, IngestService, WriterConfig};
use crate::metrics::CollectorMetrics;
use crate::rules::config::RulesConfig;
use crate::store::Store;
use crate::store::rollup::StorageConfig;

/// Largest gRPC message accepted: a batch of a 16-GPU node with hundreds of
/// processes is well under 1 MiB.
pub const MAX_GRPC_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("HTTP server failed: {0}")]
    Http(#[from] std::io::Error),
}

#[derive(Debug, Clone)]
pub struct Collector {
    pub store: Arc<dyn Store>,
    pub limits: Limits,
    pub clock: Clock,
    /// Rules and notifications; `None` stores samples without judging them.
    pub alerting: Option<Arc<Alerting>>,
    /// How the batches of many agents are written together.
    pub writers: WriterConfig,
    /// How often maintenance runs (the store holds the retention it applies).
    pub storage: StorageConfig,
    /// Refuse agents without an enrolled token.
    pub require_agent_tokens: bool,
    /// Who may read the dashboard and API, and who may act.
    pub http_auth: HttpAuthConfig,
    /// Serve gRPC over TLS (mutual when it names a client CA).
    pub tls: Option<ServerTlsConfig>,
}

impl Collector {
    /// A collector that stores samples and runs no rules.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            limits: Limits::default(),
            clock: Clock::System,
            alerting: None,
            writers: WriterConfig::default(),
            storage: StorageConfig::default(),
            require_agent_tokens: false,
            http_auth: HttpAuthConfig::default(),
            tls: None,
        }
    }

    /// A collector that runs `rules` on every batch it stores.
    pub async fn with_rules(
        store: Arc<dyn Store>,
        rules: RulesConfig,
        clock: Clock,
    ) -> Result<Self, AlertingError> {
        let alerting = Alerting::new(store.clone(), rules, clock.clone()).await?;
        Ok(Self {
            store,
            limits: Limits::default(),
            clock,
            alerting: Some(alerting),
            writers: WriterConfig::default(),
            storage: StorageConfig::default(),
            require_agent_tokens: false,
            http_auth: HttpAuthConfig::default(),
            tls: None,
        })
    }

    /// Serves until `shutdown` resolves, then drains both servers.
    pub async fn serve(
        self,
        grpc: TcpListener,
        http: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let (stop, stopped) = watch::channel(false);
        let wait = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        if let Some(alerting) = &self.alerting {
            alerting.spawn_background(stopped.clone());
        }
        let metrics = Arc::new(CollectorMetrics::default());
        tokio::spawn(maintain_storage(
            self.store.clone(),
            self.clock.clone(),
            self.storage.maintenance_interval_s,
            metrics.clone(),
            stopped.clone(),
        ));
        let writers = Coalescer::start(self.store.clone(), &self.writers, metrics.clone());
        // One list of active tokens for both sides, so a revocation reaches
        // agents and browsers alike and the store is asked once per refresh.
        let tokens = Arc::new(TokenCache::new(self.store.clone()));
        let agent_auth = Arc::new(AgentAuth::new(
            self.require_agent_tokens.then(|| tokens.clone()),
            metrics.clone(),
        ));
        let http_auth = Arc::new(HttpAuth::new(self.http_auth, tokens, metrics.clone()));
        let ingest = IngestService::new(
            self.store.clone(),
            agent_auth,
            writers,
            self.limits.clone(),
            self.clock.clone(),
            self.alerting.clone(),
            metrics.clone(),
        );
        let mut grpc_server = tonic::transport::Server::builder();
        if let Some(tls) = self.tls {
            grpc_server = grpc_server.tls_config(tls)?;
        }
        let grpc_server = grpc_server
            .add_service(
                IngestServer::new(ingest).max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(TcpListenerStream::new(grpc), wait(stopped.clone()));
        let router = http::router(AppState {
            store: self.store,
            clock: self.clock,
            metrics,
            auth: http_auth,
            shutdown: stopped.clone(),
        });
        // The peer address feeds the sign-in lockout and the proxy check.
        let http_server = axum::serve(
            http,
            router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .with_graceful_shutdown(wait(stopped));
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop.send(true);
        });
        // If either server fails, stop serving altogether rather than run half a collector.
        tokio::try_join!(
            async { grpc_server.await.map_err(ServeError::from) },
            async { http_server.await.map_err(ServeError::from) },
        )?;
        Ok(())
    }
}

/// Runs a maintenance pass every `interval_s` until shutdown. Every
/// collector runs it; the store lets one per database do the work.
async fn maintain_storage(
    store: Arc<dyn Store>,
    clock: Clock,
    interval_s: u32,
    metrics: Arc<CollectorMetrics>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut tick =
        tokio::time::interval(std::time::Duration::from_secs(u64::from(interval_s.max(1))));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_leader = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
        let now_ms = clock.now_ms();
        match store.maintain(now_ms).await {
            Ok(report) => {
                metrics.maintenance(&report, now_ms);
                if report.leader != was_leader {
                    tracing::info!(
                        leader = report.leader,
                        "storage maintenance leadership changed"
                    );
                    was_leader = report.leader;
                }
                if report.minutes_rolled_up
                    + report.partitions_created
                    + report.partitions_dropped
                    + report.samples_packed
                    > 0
                {
                    tracing::debug!(?report, "storage maintenance pass");
                }
            }
            Err(error) => {
                metrics.maintenance_failed();
                tracing::warn!(%error, "storage maintenance failed; retrying next pass");
            }
        }
    }
}
