//! Runs the collector's two servers, gRPC ingest and HTTP, on listeners the
//! caller has already bound (port 0 in tests), until a shutdown signal.

use std::future::Future;
use std::sync::Arc;

use headroom_proto::v1::ingest_server::IngestServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;

use crate::alerts::{Alerting, AlertingError};
use crate::clock::Clock;
use crate::http::{self, AppState};
use crate::ingest::IngestService;
use crate::ingest::validate::Limits;
use crate::metrics::CollectorMetrics;
use crate::rules::config::RulesConfig;
use crate::store::Store;

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
}

impl Collector {
    /// A collector that stores samples and runs no rules.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            limits: Limits::default(),
            clock: Clock::System,
            alerting: None,
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
        let ingest = IngestService::new(
            self.store.clone(),
            self.limits.clone(),
            self.clock.clone(),
            self.alerting.clone(),
            metrics.clone(),
        );
        let grpc_server = tonic::transport::Server::builder()
            .add_service(
                IngestServer::new(ingest).max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(TcpListenerStream::new(grpc), wait(stopped.clone()));
        let router = http::router(AppState {
            store: self.store,
            clock: self.clock,
            metrics,
            shutdown: stopped.clone(),
        });
        let http_server = axum::serve(http, router).with_graceful_shutdown(wait(stopped));
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
