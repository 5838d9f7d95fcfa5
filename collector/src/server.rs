//! Runs the collector's two servers, gRPC ingest and HTTP, on listeners the
//! caller has already bound (port 0 in tests), until a shutdown signal.

use std::future::Future;
use std::sync::Arc;

use headroom_proto::v1::ingest_server::IngestServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::ServerTlsConfig;

use crate::alerts::{Alerting, AlertingError};
use crate::auth::cache::TokenCache;
use crate::config::CollectorConfig;
use crate::http::auth::{HttpAuth, HttpAuthConfig};
use crate::http::{self, AppState};
use crate::ingest::validate::Limits;
use crate::ingest::{AgentAuth, Coalescer, IdleTimeout, IngestService, WriterConfig};
use crate::metrics::CollectorMetrics;
use headroom_common::Clock;
use headroom_common::tls::TlsError;
use headroom_rules::config::RulesConfig;
use headroom_store::Store;
use headroom_store::peers::PeerLink;
use headroom_store::rollup::StorageConfig;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("HTTP server failed: {0}")]
    Http(#[from] std::io::Error),
    #[error("cannot set up reads across collectors: {0}")]
    Peers(String),
}

/// A configured collector, ready to [`serve`](Collector::serve). Built with
/// [`Collector::builder`], from the configuration file or piece by piece.
#[derive(Debug, Clone)]
pub struct Collector {
    store: Arc<dyn Store>,
    limits: Limits,
    clock: Clock,
    /// Rules and notifications; `None` stores samples without judging them.
    alerting: Option<Arc<Alerting>>,
    writers: WriterConfig,
    /// How often maintenance runs (the store holds the retention it applies).
    storage: StorageConfig,
    require_agent_tokens: bool,
    http_auth: HttpAuthConfig,
    http: http::HttpServerConfig,
    tls: Option<ServerTlsConfig>,
    /// `[cluster] advertise_url`.
    advertise_url: Option<String>,
    metrics: Arc<CollectorMetrics>,
}

/// Collects a collector's settings; every one has the default `serve` uses
/// when the configuration file leaves it out.
#[derive(Debug)]
pub struct CollectorBuilder {
    store: Arc<dyn Store>,
    rules: Option<RulesConfig>,
    clock: Clock,
    limits: Limits,
    writers: WriterConfig,
    storage: StorageConfig,
    require_agent_tokens: bool,
    http_auth: HttpAuthConfig,
    http: http::HttpServerConfig,
    tls: Option<ServerTlsConfig>,
    advertise_url: Option<String>,
}

impl Collector {
    /// A collector on `store` that stores samples and, until told otherwise,
    /// runs no rules, asks agents for no token and serves plaintext gRPC.
    pub fn builder(store: Arc<dyn Store>) -> CollectorBuilder {
        CollectorBuilder {
            store,
            rules: None,
            clock: Clock::System,
            limits: Limits::default(),
            writers: WriterConfig::default(),
            storage: StorageConfig::default(),
            require_agent_tokens: false,
            http_auth: HttpAuthConfig::default(),
            http: http::HttpServerConfig::default(),
            tls: None,
            advertise_url: None,
        }
    }

    /// The rules and notifications, for a reload of the rules file.
    pub fn alerting(&self) -> Option<&Arc<Alerting>> {
        self.alerting.as_ref()
    }

    /// Whether gRPC is served over TLS.
    pub fn serves_tls(&self) -> bool {
        self.tls.is_some()
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
        let metrics = self.metrics.clone();
        tokio::spawn(maintain_storage(
            self.store.clone(),
            self.clock.clone(),
            self.storage.maintenance_interval_s,
            metrics.clone(),
            stopped.clone(),
        ));
        tokio::spawn(flush_chunks(
            self.store.clone(),
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
        let max_message_bytes = self.limits.max_message_bytes;
        let streams_per_connection = self.limits.max_streams_per_connection;
        let idle = std::time::Duration::from_secs(self.limits.grpc_idle_timeout_s);
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
        let connections = TcpListenerStream::new(grpc)
            .map(move |accepted| accepted.map(|tcp| IdleTimeout::new(tcp, idle)));
        let grpc_server = grpc_server
            .max_concurrent_streams(streams_per_connection)
            .add_service(IngestServer::new(ingest).max_decoding_message_size(max_message_bytes))
            .serve_with_incoming_shutdown(connections, wait(stopped.clone()));
        let mut router = http::router(AppState::new(
            self.store.clone(),
            self.clock,
            metrics.clone(),
            http_auth,
            stopped.clone(),
            &self.http,
        ));
        if let Some(peers) =
            link_peers(self.store.as_ref(), self.advertise_url, metrics.clone()).await?
        {
            router = router.merge(http::peers::router(self.store, &peers));
        }
        // With the `[http]` limits; the peer address feeds the sign-in
        // lockout and the proxy check.
        let http_server = http::serve_http(http, router, &self.http, metrics, wait(stopped));
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

impl CollectorBuilder {
    /// Everything `serve` takes from the configuration file: ingest writers,
    /// storage, agent tokens, dashboard sign-in, limits and TLS. Fails on a
    /// TLS file that cannot be read, naming it.
    pub fn config(self, config: &CollectorConfig) -> Result<Self, TlsError> {
        Ok(Self {
            writers: config.ingest.clone(),
            storage: config.storage.clone(),
            require_agent_tokens: config.agents.require_token,
            http_auth: config.http_auth.clone(),
            http: config.http.clone(),
            limits: config.limits.clone(),
            tls: config.tls.server_config()?,
            advertise_url: config.cluster.advertise_url.clone(),
            ..self
        })
    }

    /// Runs `rules` on every batch stored, and delivers their alerts.
    pub fn rules(self, rules: RulesConfig) -> Self {
        Self {
            rules: Some(rules),
            ..self
        }
    }

    pub fn clock(self, clock: Clock) -> Self {
        Self { clock, ..self }
    }

    /// What a batch may hold before it is refused.
    pub fn limits(self, limits: Limits) -> Self {
        Self { limits, ..self }
    }

    /// How the batches of many agents are written together.
    pub fn writers(self, writers: WriterConfig) -> Self {
        Self { writers, ..self }
    }

    /// Refuse agents without an enrolled token.
    pub fn require_agent_tokens(self, require: bool) -> Self {
        Self {
            require_agent_tokens: require,
            ..self
        }
    }

    /// Who may read the dashboard and API, and who may act.
    pub fn http_auth(self, http_auth: HttpAuthConfig) -> Self {
        Self { http_auth, ..self }
    }

    /// What the HTTP server accepts (`[http]`): host names, connections,
    /// live-stream clients, timeouts.
    pub fn http_server(self, http: http::HttpServerConfig) -> Self {
        Self { http, ..self }
    }

    /// Serve gRPC over TLS (mutual when it names a client CA).
    pub fn tls(self, tls: ServerTlsConfig) -> Self {
        Self {
            tls: Some(tls),
            ..self
        }
    }

    /// Where the other collectors sharing the database reach this one
    /// (`[cluster] advertise_url`).
    pub fn advertise_url(self, url: impl Into<String>) -> Self {
        Self {
            advertise_url: Some(url.into()),
            ..self
        }
    }

    /// Restores the rules' open alerts from the store when rules are set.
    pub async fn build(self) -> Result<Collector, AlertingError> {
        let metrics = Arc::new(CollectorMetrics::default());
        let alerting = match self.rules {
            Some(rules) => Some(
                Alerting::new(
                    self.store.clone(),
                    rules,
                    self.clock.clone(),
                    metrics.clone(),
                )
                .await?,
            ),
            None => None,
        };
        Ok(Collector {
            store: self.store,
            limits: self.limits,
            clock: self.clock,
            alerting,
            writers: self.writers,
            storage: self.storage,
            require_agent_tokens: self.require_agent_tokens,
            http_auth: self.http_auth,
            http: self.http,
            tls: self.tls,
            advertise_url: self.advertise_url,
            metrics,
        })
    }
}

/// Writes the store's open chunks whenever a flush is due, checking every
/// second, until shutdown (closing the store writes what is left).
async fn flush_chunks(
    store: Arc<dyn Store>,
    metrics: Arc<CollectorMetrics>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
        match store.flush(false).await {
            Ok(report) if report.samples > 0 => {
                metrics.chunks_flushed(&report);
                tracing::debug!(?report, "wrote open chunks");
            }
            Ok(_) => {}
            Err(error) => {
                metrics.chunk_flush_failed();
                tracing::warn!(%error, "writing open chunks failed; retrying (the agents hold those batches)");
            }
        }
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

/// Where collectors share the store, links this one to the others: charts
/// ask the holder of a device's stream for its open samples, and streams
/// registered here are recorded as held at `advertise_url`. The secret the
/// others present, for the endpoint that answers them; `None` for a store
/// only this collector uses.
async fn link_peers(
    store: &dyn Store,
    advertise_url: Option<String>,
    metrics: Arc<CollectorMetrics>,
) -> Result<Option<String>, ServeError> {
    let secret = store
        .peer_secret(&crate::peers::fresh_secret())
        .await
        .map_err(|e| ServeError::Peers(e.to_string()))?;
    let Some(secret) = secret else {
        if let Some(url) = advertise_url {
            tracing::warn!(%url, "[cluster] advertise_url is for collectors sharing a Postgres database; this store has one collector");
        }
        return Ok(None);
    };
    let reader = crate::peers::HttpPeerReader::new(secret.clone(), metrics)
        .map_err(|e| ServeError::Peers(e.to_string()))?;
    store.link_peers(PeerLink {
        own_url: advertise_url,
        reader: Arc::new(reader),
    });
    Ok(Some(secret))
}
