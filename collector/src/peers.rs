//! The client side of reads across collectors: asks the collector holding a
//! device's stream for the samples it holds open (its endpoint is
//! `http::peers`), presenting the secret the collectors share through their
//! database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rand::Rng;

use crate::metrics::{CollectorMetrics, PeerReadOutcome};
use headroom_store::peers::{OpenSamples, OpenSamplesQuery, PeerError, PeerReader};

/// Where a collector serves its open samples to the others.
pub const OPEN_SAMPLES_PATH: &str = "/internal/v1/open-samples";

/// A chart waits at most this long for another collector; a peer on the
/// same network answers in milliseconds.
const PEER_TIMEOUT: Duration = Duration::from_secs(1);
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_millis(300);

/// After a failure, a peer is not asked again for this long, so that a
/// dead collector (its agents not yet moved elsewhere) costs charts one
/// timeout, not one each.
const REST_AFTER_FAILURE: Duration = Duration::from_secs(10);

/// A new secret for the collectors sharing a database (256 bits), kept by
/// the store unless another collector made one first.
pub fn fresh_secret() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Debug)]
pub struct HttpPeerReader {
    client: reqwest::Client,
    secret: String,
    /// Peers that failed, and until when they are left alone.
    resting: Mutex<HashMap<String, Instant>>,
    metrics: Arc<CollectorMetrics>,
}

impl HttpPeerReader {
    pub fn new(secret: String, metrics: Arc<CollectorMetrics>) -> Result<Self, reqwest::Error> {
        Ok(Self {
            client: reqwest::Client::builder()
                .timeout(PEER_TIMEOUT)
                .connect_timeout(PEER_CONNECT_TIMEOUT)
                .build()?,
            secret,
            resting: Mutex::default(),
            metrics,
        })
    }

    fn resting(&self, url: &str) -> bool {
        let mut resting = self.resting.lock().unwrap_or_else(|p| p.into_inner());
        match resting.get(url) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                resting.remove(url);
                false
            }
            None => false,
        }
    }

    fn rest(&self, url: &str) {
        self.resting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(url.to_owned(), Instant::now() + REST_AFTER_FAILURE);
    }

    async fn ask(&self, url: &str, query: &OpenSamplesQuery) -> Result<OpenSamples, String> {
        let endpoint = format!("{}{OPEN_SAMPLES_PATH}", url.trim_end_matches('/'));
        let response = self
            .client
            .post(endpoint)
            .bearer_auth(&self.secret)
            .json(query)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("answered {status}"));
        }
        response
            .json::<OpenSamples>()
            .await
            .map_err(|e| format!("unreadable answer: {e}"))
    }
}

#[async_trait]
impl PeerReader for HttpPeerReader {
    async fn open_samples(
        &self,
        url: &str,
        query: &OpenSamplesQuery,
    ) -> Result<OpenSamples, PeerError> {
        if self.resting(url) {
            self.metrics.peer_read(PeerReadOutcome::Skipped);
            return Ok(OpenSamples::default());
        }
        match self.ask(url, query).await {
            Ok(samples) => {
                self.metrics.peer_read(PeerReadOutcome::Answered);
                Ok(samples)
            }
            Err(reason) => {
                self.metrics.peer_read(PeerReadOutcome::Failed);
                self.rest(url);
                Err(PeerError {
                    url: url.to_owned(),
                    reason: format!(
                        "{reason}; not asked again for {} s",
                        REST_AFTER_FAILURE.as_secs()
                    ),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_random_and_long() {
        let (a, b) = (fresh_secret(), fresh_secret());
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
    }

    #[tokio::test]
    async fn a_peer_that_failed_rests_before_it_is_asked_again() {
        let metrics = Arc::new(CollectorMetrics::default());
        let reader = HttpPeerReader::new("s".into(), metrics.clone()).unwrap();
        // Nothing listens on port 9 of loopback (discard, never served).
        let url = "http://127.0.0.1:9";
        let query = OpenSamplesQuery {
            device_id: 1,
            process_ids: vec![],
            from_ms: 0,
            to_ms: 1,
            allocator: false,
        };
        let error = reader.open_samples(url, &query).await.unwrap_err();
        assert!(error.to_string().contains(url), "{error}");
        assert_eq!(
            reader.open_samples(url, &query).await.unwrap(),
            OpenSamples::default()
        );
        let scraped = metrics.render(crate::metrics::StoreFigures::default());
        assert!(scraped.contains("headroom_collector_peer_reads_total{result=\"failed\"} 1"));
        assert!(scraped.contains("headroom_collector_peer_reads_total{result=\"skipped\"} 1"));
    }
}
