//! Reads across collectors. Several collectors may share one Postgres
//! database, each holding the streams of the agents connected to it and
//! their newest samples in open chunks, in memory until a flush. A chart
//! drawn by another collector asks the one holding the device's stream for
//! those samples, so it shows the last second wherever the agent is
//! connected. The store records which collector holds each node's stream;
//! the collector supplies the transport ([`PeerReader`]).

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::model::{AllocatorReport, GpuSampleRow, ProcessPoint};

/// What a chart asks the holder of a device's stream for: that device's
/// open samples and those of its processes, by their ids in the shared
/// database, in `[from_ms, to_ms]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenSamplesQuery {
    pub device_id: i64,
    #[serde(default)]
    pub process_ids: Vec<i64>,
    pub from_ms: i64,
    pub to_ms: i64,
    /// The allocator reports of `process_ids` rather than their samples.
    #[serde(default)]
    pub allocator: bool,
}

/// Samples a collector holds in open chunks (not yet in the database).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenSamples {
    pub gpu: Vec<GpuSampleRow>,
    pub processes: Vec<ProcessPoint>,
    /// Absent from an answer of a collector older than allocator chunks.
    #[serde(default)]
    pub allocator: Vec<AllocatorReport>,
}

#[derive(Debug, thiserror::Error)]
#[error("open samples from the collector at {url}: {reason}")]
pub struct PeerError {
    pub url: String,
    pub reason: String,
}

/// Asks the collector at `url` for the samples it holds open.
#[async_trait]
pub trait PeerReader: Send + Sync + std::fmt::Debug {
    async fn open_samples(
        &self,
        url: &str,
        query: &OpenSamplesQuery,
    ) -> Result<OpenSamples, PeerError>;
}

/// How this collector takes part in reads across collectors.
#[derive(Debug, Clone)]
pub struct PeerLink {
    /// Where other collectors reach this one (`[cluster] advertise_url`),
    /// recorded as the holder of every stream registered here; `None`
    /// records no holder, so nobody asks this collector.
    pub own_url: Option<String>,
    pub reader: Arc<dyn PeerReader>,
}

impl PeerLink {
    /// The collector to ask for the open samples of a node whose stream
    /// `holder` holds: none where nobody is recorded or it is this one.
    pub fn peer<'a>(&self, holder: Option<&'a str>) -> Option<&'a str> {
        holder.filter(|url| Some(*url) != self.own_url.as_deref())
    }

    /// The peer's open samples, or none when it cannot answer: the chart
    /// then shows what the database holds, and the reason is logged.
    pub async fn read(&self, url: &str, query: &OpenSamplesQuery) -> OpenSamples {
        match self.reader.open_samples(url, query).await {
            Ok(samples) => samples,
            Err(error) => {
                tracing::warn!(%error, device_id = query.device_id,
                    "charting without the samples another collector holds open");
                OpenSamples::default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Nobody;

    #[async_trait]
    impl PeerReader for Nobody {
        async fn open_samples(
            &self,
            url: &str,
            _query: &OpenSamplesQuery,
        ) -> Result<OpenSamples, PeerError> {
            Err(PeerError {
                url: url.to_owned(),
                reason: "connection refused".into(),
            })
        }
    }

    #[test]
    fn only_another_recorded_collector_is_asked() {
        let link = PeerLink {
            own_url: Some("http://a:8080".into()),
            reader: Arc::new(Nobody),
        };
        assert_eq!(link.peer(Some("http://b:8080")), Some("http://b:8080"));
        assert_eq!(link.peer(Some("http://a:8080")), None);
        assert_eq!(link.peer(None), None);
        let silent = PeerLink {
            own_url: None,
            reader: Arc::new(Nobody),
        };
        assert_eq!(silent.peer(Some("http://a:8080")), Some("http://a:8080"));
    }

    /// A collector older than allocator chunks sends and reads neither
    /// field.
    #[test]
    fn a_query_and_an_answer_without_allocator_reports_still_read() {
        let query: OpenSamplesQuery =
            serde_json::from_str(r#"{"device_id": 1, "from_ms": 0, "to_ms": 1}"#).unwrap();
        assert!(!query.allocator);
        let answer: OpenSamples = serde_json::from_str(r#"{"gpu": [], "processes": []}"#).unwrap();
        assert!(answer.allocator.is_empty());
    }

    #[tokio::test]
    async fn a_peer_that_cannot_answer_adds_nothing() {
        let link = PeerLink {
            own_url: None,
            reader: Arc::new(Nobody),
        };
        let query = OpenSamplesQuery {
            device_id: 1,
            process_ids: vec![],
            from_ms: 0,
            to_ms: 1,
            allocator: false,
        };
        assert_eq!(link.read("http://b", &query).await, OpenSamples::default());
    }
}
