//! The agent keeps polling while the collector is slow to answer. A
//! collector whose database is down holds an agent's registration until the
//! database is back; the agent must go on sampling meanwhile, or every spike
//! of that time is lost. Here a collector of the test's own answers the
//! registration after 4 s, then acknowledges every batch.
//!
//! A collector slow to make batches durable (it holds samples in memory
//! until a flush) must not slow the agent down, nor lose what it held when
//! it restarts: another collector of the test's own accepts every batch at
//! once, makes only the first few durable, and restarts.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use headroom_agent::AgentSettings;
use headroom_agent::source::SimSource;
use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_server::{Ingest, IngestServer};
use headroom_sim::Scenario;
use headroom_tests::harness::{eventually, sim_agent_settings};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

const REGISTER_DELAY: Duration = Duration::from_secs(4);
const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, Default, Clone)]
struct SlowCollector {
    batches: Arc<Mutex<Vec<pb::Batch>>>,
}

type AckStream = Pin<Box<dyn Stream<Item = Result<pb::Ack, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Ingest for SlowCollector {
    async fn register(
        &self,
        _request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        tokio::time::sleep(REGISTER_DELAY).await;
        Ok(Response::new(pb::RegisterResponse { committed_seq: 0 }))
    }

    type StreamStream = AckStream;

    async fn stream(
        &self,
        request: Request<Streaming<pb::Batch>>,
    ) -> Result<Response<AckStream>, Status> {
        let mut batches = request.into_inner();
        let (acks, acks_rx) = mpsc::channel(4);
        let received = self.batches.clone();
        tokio::spawn(async move {
            while let Some(Ok(batch)) = batches.next().await {
                let seq = batch.seq;
                received.lock().unwrap().push(batch);
                let ack = pb::Ack {
                    committed_seq: seq,
                    accepted_seq: seq,
                };
                if acks.send(Ok(ack)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(acks_rx))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_goes_on_while_the_collector_holds_the_registration() {
    let collector = SlowCollector::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IngestServer::new(collector.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let agent = headroom_agent::start(
        AgentSettings {
            poll_interval: Duration::from_millis(20),
            sample_interval: SAMPLE_INTERVAL,
            ..sim_agent_settings(format!("http://{addr}"), "gpu-node-01")
        },
        Box::new(SimSource::new(&Scenario::demo(), "gpu-node-01").unwrap()),
    )
    .unwrap();

    // Past the registration by a second's worth of intervals.
    let wanted =
        (REGISTER_DELAY + Duration::from_secs(1)).as_millis() / SAMPLE_INTERVAL.as_millis();
    let batches = eventually(
        "batches past the registration",
        Duration::from_secs(60),
        || {
            let batches = collector.batches.clone();
            async move {
                let batches = batches.lock().unwrap().clone();
                (batches.len() as u128 >= wanted).then_some(batches)
            }
        },
    )
    .await;
    agent.stop().await;
    server.abort();

    let gpu0: Vec<&pb::GpuSample> = batches
        .iter()
        .filter_map(|b| b.gpu_samples.first())
        .collect();
    let longest = gpu0.iter().map(|s| s.interval_ms).max().unwrap();
    assert!(
        longest < 1000,
        "an interval of {longest} ms: the sampler stalled while the registration waited"
    );
    let seqs: Vec<u64> = batches.iter().map(|b| b.seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "every interval of the wait was kept and sent in order: {seqs:?}"
    );
}

/// Batches the chunking collector makes durable; the rest it only accepts.
const DURABLE: u64 = 3;
/// More than the agent's 32 batches in flight: an agent that waited for the
/// durable mark would stop at `DURABLE + 32`.
const ACCEPTED_BEFORE_RESTART: usize = 45;

/// Accepts every batch at once, makes only the first [`DURABLE`] of them
/// durable, and restarts (ends the stream, losing what it held) after
/// [`ACCEPTED_BEFORE_RESTART`] batches.
#[derive(Debug, Default, Clone)]
struct ChunkingCollector {
    /// The seqs each stream took in, in order.
    streams: Arc<Mutex<Vec<Vec<u64>>>>,
}

#[tonic::async_trait]
impl Ingest for ChunkingCollector {
    async fn register(
        &self,
        _request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let restarted = !self.streams.lock().unwrap().is_empty();
        Ok(Response::new(pb::RegisterResponse {
            committed_seq: if restarted { DURABLE } else { 0 },
        }))
    }

    type StreamStream = AckStream;

    async fn stream(
        &self,
        request: Request<Streaming<pb::Batch>>,
    ) -> Result<Response<AckStream>, Status> {
        let mut batches = request.into_inner();
        let (acks, acks_rx) = mpsc::channel(4);
        let streams = self.streams.clone();
        let this = {
            let mut streams = streams.lock().unwrap();
            streams.push(Vec::new());
            streams.len() - 1
        };
        tokio::spawn(async move {
            while let Some(Ok(batch)) = batches.next().await {
                let seq = batch.seq;
                let taken = {
                    let mut streams = streams.lock().unwrap();
                    streams[this].push(seq);
                    streams[this].len()
                };
                let ack = pb::Ack {
                    committed_seq: seq.min(DURABLE),
                    accepted_seq: seq,
                };
                if acks.send(Ok(ack)).await.is_err()
                    || (this == 0 && taken == ACCEPTED_BEFORE_RESTART)
                {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(acks_rx))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_batches_are_not_in_flight_and_are_replayed_past_the_durable_mark() {
    let collector = ChunkingCollector::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IngestServer::new(collector.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let agent = headroom_agent::start(
        AgentSettings {
            poll_interval: Duration::from_millis(20),
            sample_interval: SAMPLE_INTERVAL,
            ..sim_agent_settings(format!("http://{addr}"), "gpu-node-01")
        },
        Box::new(SimSource::new(&Scenario::demo(), "gpu-node-01").unwrap()),
    )
    .unwrap();

    let streams = eventually(
        "a second stream past the first one",
        Duration::from_secs(60),
        || {
            let streams = collector.streams.clone();
            async move {
                let streams = streams.lock().unwrap().clone();
                (streams.len() >= 2 && streams[1].len() >= ACCEPTED_BEFORE_RESTART)
                    .then_some(streams)
            }
        },
    )
    .await;
    agent.stop().await;
    server.abort();

    let counted = |from: u64, n: usize| (from..).take(n).collect::<Vec<u64>>();
    assert_eq!(
        streams[0],
        counted(1, ACCEPTED_BEFORE_RESTART),
        "the durable mark held at {DURABLE} did not hold the agent back"
    );
    assert_eq!(
        &streams[1][..ACCEPTED_BEFORE_RESTART],
        counted(DURABLE + 1, ACCEPTED_BEFORE_RESTART).as_slice(),
        "after the restart the agent replays from the durable mark on"
    );
}
