//! Storage at scale, on Postgres, with samples written as chunks at a
//! flush: what ingest costs in CPU per GPU-second stored, bytes on disk per
//! GPU-second and process-second beside Prometheus' TSDB and
//! VictoriaMetrics, and dashboard query latency with a day of data loaded.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!   cargo run --release -p headroom-tests --example storage_bench -- [AGENTS] [SECONDS] [HISTORY_NODES] [ROUNDS] [PHASES]
//! ```
//!
//! PHASES (default `ingest,storage`; queries need the storage phase's data)
//! picks what runs: `ingest` alone is the quick A/B of a write-path change;
//! `fleet` (alone, ROUNDS = calls per range, default 200) times the fleet
//! history on SQLite and on Postgres.
//! `BENCH_WRITERS=N` sets the collector's `[ingest] writers` (default 0: 2
//! on Postgres); `BENCH_FLUSH_S` its `chunk_flush_s` (default 10), and how
//! often the storage and SQLite phases write their open chunks (default
//! every simulated minute).
//!
//! 1. Ingest: AGENTS (default 200) simulated 8-GPU agents register over real
//!    gRPC on loopback with a collector on Postgres and stream pre-encoded
//!    batches, one per simulated second (8 GPU samples, 16 process samples
//!    whose memory moves in steps every few minutes, as the CUDA caching
//!    allocator's does) as fast as the acks come back, for SECONDS (default
//!    20), ROUNDS (default 3) times. Beside the rate, the CPU per 1,000
//!    GPU-seconds taken in: the Postgres server's (when it runs on this
//!    machine), the collector's (this process but the agents' threads) and
//!    the simulated agents'; and the share of the samples the flushes wrote
//!    in the window (about 1 when they keep up).
//! 2. Storage: HISTORY_NODES (default 8) nodes of 8 GPUs, each GPU with two
//!    processes, write one whole UTC day (the last that ended more than a
//!    day ago) at one sample per second through the store's own write path,
//!    the open chunks written every simulated minute, as a collector with
//!    the default `chunk_flush_s` writes them. Bytes per GPU-second and
//!    process-second are the tables' size on disk, indexes included: as
//!    written, then once maintenance has rolled up the hours, compacted the
//!    closed hours' chunks into one per series and hour and packed their
//!    minute rollups into one row per series and hour (after `VACUUM FULL`,
//!    the space later rows would reuse given back). The first node's 8 GPUs go to Prometheus
//!    too (`promtool tsdb create-blocks-from openmetrics`, Debian's
//!    `prometheus` package) and to VictoriaMetrics (Debian's
//!    `victoria-metrics`, its Prometheus import API, then flushed and
//!    merged) as 8 series per GPU, the same figures, with the CPU
//!    VictoriaMetrics spent taking them.
//! 3. Queries: the fleet grows to 1,000 GPUs (the rest with a current sample
//!    only), a collector serves it, and one client times the fleet overview
//!    (`GET /api/v1/gpus`), a 24 h chart of one GPU
//!    (`GET /api/v1/gpus/{uuid}/series`, 1,000 points) and a 1 h chart of
//!    the day at one point per sample (from its chunks), 300 of each.
//! 5. SQLite (`sqlite`, alone): the same day of HISTORY_NODES nodes on the
//!    embedded store, written as rows and as chunks side by side through
//!    the store's write path, then rolled up and compacted: load time, CPU
//!    per 1,000 GPU-seconds, and bytes per GPU-second and process-second
//!    from SQLite's own page accounting (`dbstat`), indexes included.
//! 4. Fleet history (`fleet`): 1,000 GPUs × 7 days of minute and hour
//!    rollups loaded straight into their tables, on SQLite and on Postgres;
//!    the fleet rows are filled as the rollup pass fills them (timed per
//!    minute and per hour: what a pass adds), then `Store::fleet_history`
//!    is timed over 7 d, 24 h and 1 h at 1,000 points, beside the same sums
//!    computed at query time from the device rollups.
//! 6. Reads across collectors (`peers`, alone): two collectors on one
//!    database, each advertising its HTTP address. AGENTS nodes of 8 GPUs
//!    register with the first and SECONDS of their batches go through its
//!    store's write path, held in open chunks (`chunk_flush_s = 60`); then
//!    one client times a GPU chart and a process chart of the last node's
//!    first GPU over those seconds, ROUNDS times each (default 200) on the
//!    collector holding the samples and on the other, which asks it for
//!    them, with the CPU per chart (both collectors are this process,
//!    Postgres beside it).
//! 7. Fleet overview (`overview`, alone): AGENTS nodes of 8 GPUs put
//!    straight into the tables with a current sample each (no ingest, so
//!    no flush runs meanwhile), a fifth of their `gpu_latest` rows
//!    rewritten each second as a steady fleet's checkpoints rewrite them.
//!    Then ROUNDS reads (default 30), one a second as the live stream
//!    reads: the store's query, and side by side the rows fetched as
//!    before (joined and sorted each read; every `gpu_latest` row each
//!    read); then `GET /api/v1/gpus` in a loop. It checks at the end that
//!    the overview holds every row as the table does. `overview-own` is
//!    the same with one collector for the fleet: the nodes register with
//!    the store and send their batches through its write path, each node
//!    one every 5 s, so that the rows rewritten are the reading store's own
//!    checkpoints; it checks that the overview holds each node's last
//!    batch. Each phase then follows the live stream for 10 s after its
//!    snapshot, one client at a time: by node (the default limit), every
//!    device (a collector with no limit) and one node's devices, with the
//!    bytes of the snapshot and of the updates a second.
//! 8. A late hour in a packed day (`late-hour`, alone): see
//!    [`late_hour`].
//! 9. Allocator charts over days (`allocator-chart`, alone): see
//!    [`allocator_chart`].
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: fail loudly

#[path = "storage_bench/allocator_chart.rs"]
mod allocator_chart;
#[path = "storage_bench/late_hour.rs"]
mod late_hour;

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_collector::ingest::WriterConfig;
use headroom_collector::ingest::validate::{self, Limits};
use headroom_collector::server::Collector;
use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_client::IngestClient;
use headroom_store::ProcessesOn;
use headroom_store::alerts::{AlertUpdate, UpdateKind};
use headroom_store::model::{NodeSession, StoreBatch};
use headroom_store::rollup::{
    DAY_MS, HOUR_MS, MINUTE_MS, SampleWrites, StorageConfig, bucket_start,
};
use headroom_store::{PostgresStore, SqliteStore, Store};
use headroom_tests::fixtures::now_ms;
use headroom_tests::harness::RunningCollector;
use headroom_tests::postgres;
use prost::Message as _;
use prost::bytes::BufMut as _;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio_stream::StreamExt;
use tonic::codegen::http::uri::PathAndQuery;

/// The collector binary's allocator, so that the collector measured here
/// allocates as the one deployed does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const GPUS_PER_NODE: usize = 8;
const PROCESSES_PER_GPU: usize = 2;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const FLEET_GPUS: usize = 1000;

/// A pure function of its inputs, so that Postgres and Prometheus are given
/// exactly the same figures (splitmix64).
fn noise(a: u64, b: u64, c: u64) -> u64 {
    let mut z = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(c);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One GPU's figures at one second, as a training job's memory looks: a
/// plateau per GPU, a slow swing of a couple of GiB, allocator jitter within
/// the interval, 2 MiB granularity.
#[derive(Debug, Clone, Copy)]
struct Figures {
    used: u64,
    used_min: u64,
    used_max: u64,
    reserved: u64,
    total: u64,
    utilization: u32,
    pcie_tx: u64,
    pcie_rx: u64,
}

fn figures(gpu: u64, second: i64) -> Figures {
    let s = second as u64;
    let plateau = 20 * GIB + (noise(gpu, 0, 1) % 40) * GIB;
    let phase = ((second + gpu as i64 * 97) % 1200) as f64 / 1200.0 * std::f64::consts::TAU;
    let swing = ((phase.sin() + 1.0) * GIB as f64) as u64;
    let round = |v: u64| v / (2 * MIB) * (2 * MIB);
    let used = round(plateau + swing + noise(gpu, s, 2) % (64 * MIB));
    Figures {
        used,
        used_min: round(used - noise(gpu, s, 3) % (256 * MIB)),
        used_max: round(used + noise(gpu, s, 4) % (512 * MIB)),
        reserved: 512 * MIB,
        total: 80 * GIB,
        utilization: 60 + (noise(gpu, s, 5) % 41) as u32,
        pcie_tx: (noise(gpu, s, 6) % 16_000_000) * 1024,
        pcie_rx: (noise(gpu, s, 7) % 16_000_000) * 1024,
    }
}

/// A process's memory as NVML reports it: what the CUDA caching allocator
/// holds, steady for minutes, growing in steps as the job warms up and
/// shrinking back.
fn process_used(gpu: u64, process: u64, second: i64) -> u64 {
    let share = if process == 0 { 7 } else { 3 };
    let plateau = (20 + noise(gpu, 0, 1) % 40) * GIB / 10 * share;
    let step = (second.rem_euclid(1200) / 300) as u64 * 256 * MIB;
    (plateau + step) / (2 * MIB) * (2 * MIB)
}

fn node_name(node: usize) -> String {
    format!("bench-node-{node:04}")
}

fn gpu_uuid(node: usize, gpu: usize) -> String {
    format!("GPU-{node:08x}-{gpu:04x}-4000-8000-000000000000")
}

fn register_request(node: usize, boot: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: node_name(node),
        boot_id: boot.into(),
        agent_version: "bench".into(),
        driver_version: "550.54.15".into(),
        gpus: (0..GPUS_PER_NODE)
            .map(|g| pb::Gpu {
                uuid: gpu_uuid(node, g),
                index: g as u32,
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total_bytes: 80 * GIB,
                pcie_generation: 5,
                pcie_width: 16,
                mig_instances: vec![],
            })
            .collect(),
        sample_interval_ms: 1000,
    }
}

/// One node's batch for one second: every GPU's sample and its processes'.
fn batch(node: usize, boot: &str, seq: u64, ts_ms: i64) -> pb::Batch {
    let mut gpu_samples = Vec::with_capacity(GPUS_PER_NODE);
    let mut process_samples = Vec::with_capacity(GPUS_PER_NODE * PROCESSES_PER_GPU);
    for g in 0..GPUS_PER_NODE {
        let uuid = gpu_uuid(node, g);
        gpu_samples.push(pb::GpuSample {
            uuid: uuid.clone(),
            interval_ms: 1000,
            poll_count: 10,
            ..pb::GpuSample::default()
        });
        for p in 0..PROCESSES_PER_GPU {
            process_samples.push(pb::ProcessSample {
                uuid: uuid.clone(),
                pid: (10_000 + g * 10 + p) as u32,
                start_time_ms: 1_700_000_000_000,
                name: "python train.py".into(),
                uid: 1000 + g as u32,
                user: format!("user{g}"),
                slurm_job_id: format!("{}", 4000 + node),
                ..pb::ProcessSample::default()
            });
        }
    }
    let mut batch = pb::Batch {
        node: node_name(node),
        boot_id: boot.into(),
        seq,
        gpu_samples,
        process_samples,
        events: vec![],
    };
    move_to(&mut batch, node, seq, ts_ms);
    batch
}

/// Moves `batch` (of `node`, from [`batch`]) to `seq` and the figures of
/// second `ts_ms`, keeping its strings.
fn move_to(batch: &mut pb::Batch, node: usize, seq: u64, ts_ms: i64) {
    let second = ts_ms / 1000;
    batch.seq = seq;
    for (g, s) in batch.gpu_samples.iter_mut().enumerate() {
        let f = figures((node * GPUS_PER_NODE + g) as u64, second);
        s.timestamp_ms = ts_ms;
        s.memory_used_last_bytes = f.used;
        s.memory_used_min_bytes = f.used_min;
        s.memory_used_max_bytes = f.used_max;
        s.memory_reserved_bytes = f.reserved;
        s.memory_total_bytes = f.total;
        s.utilization_pct = Some(f.utilization);
        s.pcie_tx_bytes_per_s = Some(f.pcie_tx);
        s.pcie_rx_bytes_per_s = Some(f.pcie_rx);
    }
    for (i, p) in batch.process_samples.iter_mut().enumerate() {
        let gpu = (node * GPUS_PER_NODE + i / PROCESSES_PER_GPU) as u64;
        let used = process_used(gpu, (i % PROCESSES_PER_GPU) as u64, second);
        p.timestamp_ms = ts_ms;
        p.memory_used_last_bytes = used;
        p.memory_used_max_bytes = used + 64 * MIB;
    }
}

/// Sends batches that are protobuf bytes already: the load generator
/// shares this machine's two cores with the collector, which agents on
/// their own hosts do not, so it does as little as it can. The bytes are
/// the ones a real agent sends.
#[derive(Debug, Clone, Copy, Default)]
struct PreEncoded;

impl tonic::codec::Codec for PreEncoded {
    type Encode = Vec<u8>;
    type Decode = pb::Ack;
    type Encoder = PreEncoded;
    type Decoder = tonic_prost::ProstDecoder<pb::Ack>;

    fn encoder(&mut self) -> Self::Encoder {
        PreEncoded
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

impl tonic::codec::Encoder for PreEncoded {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct IngestFigures {
    gpu_rows: u64,
    process_rows: u64,
    seconds: f64,
    batches_per_write: f64,
    /// Samples the flushes wrote in the window over those taken in: about
    /// 1 once flushes keep up.
    written_share: f64,
    cpu: CpuSpent,
}

/// CPU seconds over a timed window, by who spent them.
#[derive(Debug, Clone, Copy)]
struct CpuSpent {
    /// The Postgres server, every process of it; `None` when it is not on
    /// this machine.
    postgres: Option<f64>,
    /// This process's threads but the simulated agents': the collector, or
    /// the `COPY` client that formats the rows.
    client: f64,
    /// The simulated agents' threads.
    agents: f64,
}

/// Reads the CPU counters at the start of a window; `spent` at its end.
#[derive(Debug, Clone, Copy)]
struct CpuMark {
    postmaster: Option<u32>,
    at: CpuSpent,
}

impl CpuMark {
    fn now(postmaster: Option<u32>) -> Self {
        let (agents, client) = headroom_tests::cpu::own_seconds_split(AGENT_THREAD);
        Self {
            postmaster,
            at: CpuSpent {
                postgres: postmaster.and_then(headroom_tests::cpu::postgres_seconds),
                client,
                agents,
            },
        }
    }

    fn spent(&self) -> CpuSpent {
        let end = Self::now(self.postmaster).at;
        CpuSpent {
            postgres: end.postgres.zip(self.at.postgres).map(|(b, a)| b - a),
            client: end.client - self.at.client,
            agents: end.agents - self.at.agents,
        }
    }
}

/// The postmaster of the server `conn` talks to, when it runs here.
async fn postmaster_of(conn: &mut PgConnection) -> Option<u32> {
    let (backend, database): (i32, String) =
        sqlx::query_as("SELECT pg_backend_pid(), current_database()")
            .fetch_one(conn)
            .await
            .ok()?;
    headroom_tests::cpu::postmaster_of_backend(u32::try_from(backend).ok()?, &database)
}

const AGENT_THREAD: &str = "bench-agents";

/// Connects and registers `node` as an agent does, again after a short
/// pause when it fails: 1,250 agents connecting at once overflow the
/// collector's accept queue, and a few connections are reset.
async fn connect_and_register(url: &str, node: usize) -> tonic::transport::Channel {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let registered = async {
            let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
                .connect()
                .await?;
            IngestClient::new(channel.clone())
                .register(register_request(node, "bench"))
                .await?;
            anyhow::Ok(channel)
        };
        match registered.await {
            Ok(channel) => return channel,
            Err(error) if attempt < 20 => {
                eprintln!("agent {node}: {error:#}; trying again");
                tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
            }
            Err(error) => panic!("agent {node} could not register: {error:#}"),
        }
    }
}

/// Phase 1a: agents over gRPC into a collector on Postgres.
/// `BENCH_FLUSH_S`: how often the ingest phase's collector writes its open
/// chunks (default 10, so that a 20 s window holds two flushes; production
/// writes them every 60 s, which makes fewer, larger chunks).
fn bench_flush_s() -> u32 {
    std::env::var("BENCH_FLUSH_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10)
}

async fn ingest_over_grpc(agents: usize, seconds: u64) -> IngestFigures {
    let db = postgres::fresh_database().await.expect("Postgres");
    let storage = StorageConfig {
        chunk_flush_s: bench_flush_s(),
        ..StorageConfig::default()
    };
    let store = headroom_store::connect_with(&db.url, storage)
        .await
        .unwrap();
    let postmaster = postmaster_of(&mut PgConnection::connect(&db.url).await.unwrap()).await;
    let mut writers = WriterConfig::default();
    if let Some(count) = std::env::var("BENCH_WRITERS")
        .ok()
        .and_then(|w| w.parse().ok())
    {
        writers.writers = count;
    }
    let config = Collector::builder(store.clone())
        .writers(writers)
        .build()
        .await
        .unwrap();
    let collector = RunningCollector::start_collector(config).await;
    // Simulated time runs at one batch per second, as fast as the collector
    // acknowledges (about 70 simulated seconds a second), from far enough
    // back that it never reaches the present, which would end it: two hours
    // or 100 simulated seconds per second of the run, well inside the 7-day
    // acceptance window.
    let history_ms = (seconds as i64 * 100_000).clamp(2 * 3_600_000, 5 * DAY_MS);
    let start_ms = (now_ms() - history_ms) / 1000 * 1000;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The agents run on threads of their own, as agents on other hosts
    // would: in the collector's runtime their hundreds of tasks would queue
    // ahead of its writers.
    let agent_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(AGENT_THREAD)
        .enable_all()
        .build()
        .unwrap();
    let mut tasks = Vec::new();
    for node in 0..agents {
        let url = collector.grpc_url();
        let stop = stop.clone();
        tasks.push(agent_runtime.spawn(async move {
            let channel = connect_and_register(&url, node).await;
            let (tx, rx) = tokio::sync::mpsc::channel(8);
            let producer = tokio::spawn(async move {
                let mut next = batch(node, "bench", 1, start_ms + 1000);
                let mut seq = 1u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    move_to(&mut next, node, seq, start_ms + seq as i64 * 1000);
                    if tx.send(next.encode_to_vec()).await.is_err() {
                        break;
                    }
                    seq += 1;
                }
            });
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await.unwrap();
            let mut acks = grpc
                .streaming(
                    tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
                    PathAndQuery::from_static("/headroom.v1.Ingest/Stream"),
                    PreEncoded,
                )
                .await
                .unwrap()
                .into_inner();
            while let Some(ack) = acks.next().await {
                if ack.is_err() {
                    break;
                }
            }
            producer.abort();
        }));
    }
    // Let every agent connect and the writers settle, then count commits.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let gpu0 = collector
        .metric("headroom_collector_samples_total{kind=\"gpu\"}")
        .await;
    let proc0 = collector
        .metric("headroom_collector_samples_total{kind=\"process\"}")
        .await;
    let writes0 = collector
        .metric("headroom_collector_write_groups_total")
        .await;
    let batches0 = collector
        .metric("headroom_collector_write_group_batches_total")
        .await;
    let written0 = collector
        .metric("headroom_collector_chunk_samples_written_total")
        .await;
    let cpu = CpuMark::now(postmaster);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let cpu = cpu.spent();
    let gpu1 = collector
        .metric("headroom_collector_samples_total{kind=\"gpu\"}")
        .await;
    let proc1 = collector
        .metric("headroom_collector_samples_total{kind=\"process\"}")
        .await;
    let writes1 = collector
        .metric("headroom_collector_write_groups_total")
        .await;
    let batches1 = collector
        .metric("headroom_collector_write_group_batches_total")
        .await;
    let written1 = collector
        .metric("headroom_collector_chunk_samples_written_total")
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    collector.stop().await;
    for task in tasks {
        task.abort();
    }
    agent_runtime.shutdown_background();
    store.close().await;
    db.drop_database().await;
    IngestFigures {
        gpu_rows: (gpu1 - gpu0) as u64,
        process_rows: (proc1 - proc0) as u64,
        seconds: elapsed,
        batches_per_write: (batches1 - batches0) / (writes1 - writes0).max(1.0),
        written_share: (written1 - written0) / (gpu1 - gpu0 + proc1 - proc0).max(1.0),
        cpu,
    }
}

/// Phase 2: a day of history through the store's write path; returns how
/// long it took.
/// How often, in simulated seconds, the storage and SQLite phases write
/// the open chunks: `BENCH_FLUSH_S`, else every minute, as the default
/// `chunk_flush_s` does at one sample per second.
fn history_flush_s() -> i64 {
    std::env::var("BENCH_FLUSH_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|s| (1..=60).contains(s))
        .unwrap_or(60)
}

async fn load_history(store: &dyn Store, nodes: usize, end_ms: i64) -> f64 {
    let sessions: Vec<NodeSession> = {
        let mut s = Vec::new();
        for node in 0..nodes {
            let reg = validate::registration(&register_request(node, "bench"), &Limits::default())
                .unwrap();
            s.push(store.register(&reg, now_ms()).await.unwrap());
        }
        s
    };
    let start_ms = end_ms - DAY_MS;
    let started = Instant::now();
    let limits = Limits::default();
    // One writer's worth of batches per call, as the coalescer would send,
    // in seconds that divide the flush interval: the open chunks are written
    // every `flush_s` simulated seconds, as a collector at one sample per
    // second with that `chunk_flush_s` writes them.
    let flush_s = history_flush_s();
    let per_write = (1..=flush_s)
        .rev()
        .find(|d| flush_s % d == 0 && *d <= 256 / nodes.max(1) as i64)
        .unwrap_or(1);
    let mut group: Vec<StoreBatch> = Vec::with_capacity(256);
    let mut second = 0i64;
    while second < DAY_MS / 1000 {
        for _ in 0..per_write {
            if second >= DAY_MS / 1000 {
                break;
            }
            let ts = start_ms + second * 1000;
            for (node, session) in sessions.iter().enumerate() {
                let b = batch(node, "bench", second as u64 + 1, ts);
                group.push(validate::batch(b, session, ts + 1000, &limits).unwrap());
            }
            second += 1;
        }
        store.write_batches(&group).await.unwrap();
        group.clear();
        if second % flush_s == 0 {
            store.flush(true).await.unwrap();
        }
    }
    store.flush(true).await.unwrap();
    started.elapsed().as_secs_f64()
}

/// Maintenance passes until the rollups and the compaction of closed hours
/// have nothing left; returns how long they took and the chunks folded.
async fn maintain_until_done(store: &dyn Store) -> (f64, u64) {
    let started = Instant::now();
    let mut compacted = 0;
    loop {
        let report = store.maintain(now_ms()).await.unwrap();
        compacted += report.chunks_compacted;
        if report.minutes_rolled_up
            + report.hours_rolled_up
            + report.chunks_compacted
            + report.minute_rows_packed
            + report.hour_rows_packed
            == 0
        {
            break;
        }
    }
    (started.elapsed().as_secs_f64(), compacted)
}

/// Prints each table's bytes on disk and per second of `per`; returns
/// their sum.
async fn print_table_bytes(store: &PostgresStore, tables: &[(&str, f64)]) -> i64 {
    println!("| table (indexes included) | bytes on disk | per GPU-second (process-second) |");
    println!("|---|---|---|");
    let mut sum = 0;
    for (table, per) in tables {
        let bytes = table_bytes(store, table).await;
        sum += bytes;
        println!("| {table} | {bytes} | {:.2} |", bytes as f64 / per);
    }
    sum
}

/// The chunks' own bytes per sample, beside what Postgres' pages add to
/// them (tuple, TOAST, index).
async fn print_chunk_payload(store: &PostgresStore) {
    let mut figures = Vec::new();
    for table in ["gpu_samples_packed", "process_samples_packed"] {
        let per_sample: f64 = sqlx::query_scalar(&format!(
            "SELECT COALESCE(sum(octet_length(data))::float8 / NULLIF(sum(samples), 0), 0) FROM {table}"
        ))
        .fetch_one(store.pool())
        .await
        .unwrap();
        figures.push(format!("{table} {per_sample:.2}"));
    }
    println!(
        "the chunks' data alone, bytes per sample: {}",
        figures.join(", ")
    );
}

/// Each kind of rollup's rows alone (`pg_column_size`: tuple header and
/// data, without the page's line pointer or index entries): as a row per
/// bucket (the packed ones unpacked, as the loose table holds them) and
/// packed. At fleet scale these are what grows; a day of 64 GPUs is too
/// few rows for the tables' sizes to show them past their fixed pages.
async fn print_rollup_rows(store: &PostgresStore, gpu_seconds: f64, process_seconds: f64) {
    println!(
        "| rollup rows alone, bytes per GPU-second (process-second) | a row per bucket | packed | ratio |"
    );
    println!("|---|---|---|---|");
    for (kind, read, packed, per) in [
        (
            "GPU minutes",
            "gpu_minutes",
            "gpu_samples_1m_packed",
            gpu_seconds,
        ),
        (
            "process minutes",
            "process_minutes",
            "process_samples_1m_packed",
            process_seconds,
        ),
        (
            "GPU hours",
            "gpu_hours",
            "gpu_samples_1h_packed",
            gpu_seconds,
        ),
        (
            "process hours",
            "process_hours",
            "process_samples_1h_packed",
            process_seconds,
        ),
    ] {
        let (as_rows, as_packed): (f64, f64) = sqlx::query_as(&format!(
            "SELECT (SELECT COALESCE(sum(pg_column_size(r.*)), 0) FROM {read}(0, 9000000000000000000) r)::float8,
                    (SELECT COALESCE(sum(pg_column_size(p.*)), 0) FROM {packed} p)::float8"
        ))
        .fetch_one(store.pool())
        .await
        .unwrap();
        println!(
            "| {kind} | {:.3} | {:.3} | {:.2} |",
            as_rows / per,
            as_packed / per,
            as_packed / as_rows.max(1.0)
        );
    }
}

async fn table_bytes(store: &PostgresStore, parent: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COALESCE(sum(pg_total_relation_size(i.inhrelid)), 0)::int8
         FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = $1",
    )
    .bind(parent)
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// The first node's GPUs as OpenMetrics, 8 series per GPU, then a TSDB.
fn prometheus_bytes(dir: &std::path::Path, end_ms: i64) -> Option<(u64, f64)> {
    use std::io::Write as _;
    let om = dir.join("fleet.om");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&om).unwrap());
    let start_s = (end_ms - DAY_MS) / 1000;
    type Pick = fn(&Figures) -> f64;
    let series: [(&str, Pick); 8] = [
        ("gpu_memory_used_bytes", |f| f.used as f64),
        ("gpu_memory_used_min_bytes", |f| f.used_min as f64),
        ("gpu_memory_used_max_bytes", |f| f.used_max as f64),
        ("gpu_memory_reserved_bytes", |f| f.reserved as f64),
        ("gpu_memory_total_bytes", |f| f.total as f64),
        ("gpu_utilization_ratio", |f| {
            f64::from(f.utilization) / 100.0
        }),
        ("gpu_pcie_tx_bytes_per_second", |f| f.pcie_tx as f64),
        ("gpu_pcie_rx_bytes_per_second", |f| f.pcie_rx as f64),
    ];
    for (name, pick) in series {
        writeln!(out, "# TYPE {name} gauge").unwrap();
        for g in 0..GPUS_PER_NODE {
            let uuid = gpu_uuid(0, g);
            for s in 0..DAY_MS / 1000 {
                let second = start_s + s;
                let f = figures(g as u64, second);
                writeln!(
                    out,
                    "{name}{{node=\"{}\",gpu=\"{g}\",uuid=\"{uuid}\"}} {} {second}",
                    node_name(0),
                    pick(&f)
                )
                .unwrap();
            }
        }
    }
    writeln!(out, "# EOF").unwrap();
    out.flush().unwrap();
    drop(out);
    let blocks = dir.join("tsdb");
    let started = Instant::now();
    let status = std::process::Command::new("promtool")
        .args(["tsdb", "create-blocks-from", "openmetrics"])
        .arg(&om)
        .arg(&blocks)
        .stdout(std::process::Stdio::null())
        .status();
    let took = started.elapsed().as_secs_f64();
    match status {
        Ok(s) if s.success() => {}
        other => {
            eprintln!("promtool failed or is missing ({other:?}): no Prometheus figure");
            return None;
        }
    }
    let _ = std::fs::remove_file(&om);
    Some((dir_bytes(&blocks), took))
}

struct VictoriaFigures {
    bytes: u64,
    samples: u64,
    cpu_s: f64,
}

/// The same series as [`prometheus_bytes`] imported into VictoriaMetrics
/// (Debian's `victoria-metrics`) through its Prometheus import API, then
/// flushed and merged: its bytes on disk (data and index, not its caches)
/// and the CPU its server spent taking them. `None` when it is missing.
async fn victoria_metrics(dir: &std::path::Path, end_ms: i64) -> Option<VictoriaFigures> {
    let addr = headroom_tests::harness::free_loopback_addr();
    let data = dir.join("victoria");
    let mut server = match std::process::Command::new("victoria-metrics")
        .arg(format!("-storageDataPath={}", data.display()))
        .arg(format!("-httpListenAddr={addr}"))
        .args(["-retentionPeriod=100y", "-loggerLevel=ERROR"])
        .stdout(std::process::Stdio::null())
        .spawn()
    {
        Ok(server) => server,
        Err(error) => {
            eprintln!("victoria-metrics is missing ({error}): no VictoriaMetrics figure");
            return None;
        }
    };
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let mut ready = false;
    for _ in 0..100 {
        if client.get(format!("{base}/health")).send().await.is_ok() {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cpu = || headroom_tests::cpu::process_seconds(server.id()).unwrap_or(0.0);
    let before = cpu();
    let start_s = (end_ms - DAY_MS) / 1000;
    let mut samples = 0u64;
    let mut body = String::new();
    for g in 0..GPUS_PER_NODE {
        let uuid = gpu_uuid(0, g);
        let labels = format!("node=\"{}\",gpu=\"{g}\",uuid=\"{uuid}\"", node_name(0));
        for s in 0..DAY_MS / 1000 {
            let second = start_s + s;
            let f = figures(g as u64, second);
            let ms = second * 1000;
            for (name, value) in [
                ("gpu_memory_used_bytes", f.used as f64),
                ("gpu_memory_used_min_bytes", f.used_min as f64),
                ("gpu_memory_used_max_bytes", f.used_max as f64),
                ("gpu_memory_reserved_bytes", f.reserved as f64),
                ("gpu_memory_total_bytes", f.total as f64),
                ("gpu_utilization_ratio", f64::from(f.utilization) / 100.0),
                ("gpu_pcie_tx_bytes_per_second", f.pcie_tx as f64),
                ("gpu_pcie_rx_bytes_per_second", f.pcie_rx as f64),
            ] {
                let _ = writeln!(body, "{name}{{{labels}}} {value} {ms}");
                samples += 1;
            }
            if body.len() > 8 << 20 {
                import_into_victoria(&client, &base, std::mem::take(&mut body)).await;
            }
        }
    }
    import_into_victoria(&client, &base, body).await;
    let _ = client
        .get(format!("{base}/internal/force_flush"))
        .send()
        .await;
    let cpu_s = cpu() - before;
    // VictoriaMetrics names a month's partition YYYY_MM.
    let day = postgres::day_suffix(end_ms - DAY_MS);
    let month = format!("{}_{}", &day[..4], &day[4..6]);
    let _ = client
        .get(format!(
            "{base}/internal/force_merge?partition_prefix={month}"
        ))
        .send()
        .await;
    // The merge runs in the background: wait for the size to settle.
    let on_disk = || dir_bytes(&data.join("data")) + dir_bytes(&data.join("indexdb"));
    let mut last = on_disk();
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = on_disk();
        if now == last {
            break;
        }
        last = now;
    }
    let _ = server.kill();
    let _ = server.wait();
    ready.then_some(VictoriaFigures {
        bytes: last,
        samples,
        cpu_s,
    })
}

async fn import_into_victoria(client: &reqwest::Client, base: &str, body: String) {
    let response = client
        .post(format!("{base}/api/v1/import/prometheus"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "{:?}",
        response.text().await
    );
}

fn dir_bytes(path: &std::path::Path) -> u64 {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_bytes(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Phase 3: the rest of a 1,000-GPU fleet, current samples only.
async fn fill_fleet(store: &PostgresStore, from_node: usize) {
    let limits = Limits::default();
    let now = now_ms();
    let mut group = Vec::new();
    for node in from_node..FLEET_GPUS / GPUS_PER_NODE {
        let reg = validate::registration(&register_request(node, "bench"), &limits).unwrap();
        let session = store.register(&reg, now).await.unwrap();
        let b = batch(node, "bench", 1, now - 5_000);
        group.push(validate::batch(b, &session, now, &limits).unwrap());
    }
    store.write_batches(&group).await.unwrap();
}

async fn time_get(url: &str, client: &reqwest::Client, runs: usize) -> (f64, f64, usize) {
    let mut ms = Vec::with_capacity(runs);
    let mut bytes = 0;
    for _ in 0..runs {
        let started = Instant::now();
        let body = client
            .get(url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap()
            .bytes()
            .await
            .unwrap();
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
        bytes = body.len();
    }
    ms.sort_by(f64::total_cmp);
    (percentile(&ms, 0.5), percentile(&ms, 0.99), bytes)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg =
        |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let agents = arg(0, 200);
    let seconds = arg(1, 20) as u64;
    let history_nodes = arg(2, 8).clamp(1, FLEET_GPUS / GPUS_PER_NODE);
    let rounds = arg(3, 3).max(1);
    let phases = args.get(4).map_or("ingest,storage", String::as_str);
    let asked = |phase: &str| phases.split(',').any(|p| p == phase);
    let ingest_phase = asked("ingest");
    let storage_phase = asked("storage");
    let fleet_phase = asked("fleet");
    let sqlite_phase = asked("sqlite");
    let peers_phase = asked("peers");
    let overview_phase = asked("overview");
    let own_overview_phase = asked("overview-own");
    let late_hour_phase = asked("late-hour");
    let allocator_chart_phase = asked("allocator-chart");
    if ![
        ingest_phase,
        storage_phase,
        fleet_phase,
        sqlite_phase,
        peers_phase,
        overview_phase,
        own_overview_phase,
        late_hour_phase,
        allocator_chart_phase,
    ]
    .contains(&true)
    {
        eprintln!(
            "PHASES is a comma-separated list of `ingest`, `storage`, `fleet`, `sqlite`, `peers`, `overview`, `overview-own`, `late-hour` and `allocator-chart`, not {phases:?}"
        );
        std::process::exit(2);
    }
    if ingest_phase {
        ingest_rounds(agents, seconds, rounds).await;
    }
    if storage_phase {
        storage_and_queries(history_nodes).await;
    }
    if sqlite_phase {
        sqlite_rows_and_chunks(history_nodes).await;
    }
    if fleet_phase {
        // ROUNDS doubles as the calls per range here: 200 unless told.
        fleet_history_phase(arg(3, 200)).await;
    }
    if peers_phase {
        reads_across_collectors(agents, seconds, arg(3, 200)).await;
    }
    if overview_phase {
        fleet_overview_at_scale(agents, arg(3, 30), Rewrites::ByOthers).await;
    }
    if own_overview_phase {
        fleet_overview_at_scale(agents, arg(3, 30), Rewrites::ByItself).await;
    }
    if late_hour_phase {
        late_hour::late_hour_in_packed_day(agents).await;
    }
    if allocator_chart_phase {
        // SECONDS is the days loaded here, ROUNDS the reads of each chart.
        allocator_chart::allocator_charts_over_days(seconds as i64, arg(3, 100)).await;
    }
}

/// Who rewrites the `gpu_latest` rows while the overview phase reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rewrites {
    /// Other collectors on the same database (SQL straight to the table).
    ByOthers,
    /// The collector reading, its agents' batches through its store's
    /// write path: one collector for the whole fleet.
    ByItself,
}

/// Phase 7: the fleet overview of `nodes` nodes of 8 GPUs, each with a
/// current sample, read `runs` times.
async fn fleet_overview_at_scale(nodes: usize, runs: usize, rewrites: Rewrites) {
    let gpus = nodes * GPUS_PER_NODE;
    println!(
        "## 7. Fleet overview: {nodes} nodes × {GPUS_PER_NODE} GPUs, {runs} reads each, rows rewritten {}",
        match rewrites {
            Rewrites::ByOthers => "by other collectors",
            Rewrites::ByItself => "by the collector reading (its agents' batches)",
        }
    );
    let db = postgres::fresh_database().await.expect("Postgres");
    let store = headroom_store::connect_with(&db.url, StorageConfig::default())
        .await
        .unwrap();
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let own_fleet = match rewrites {
        Rewrites::ByOthers => {
            put_fleet_in_tables(&mut conn, nodes).await;
            None
        }
        Rewrites::ByItself => Some(Arc::new(register_fleet(store.clone(), nodes).await)),
    };
    let started = Instant::now();
    assert_eq!(store.latest_devices().await.unwrap().len(), gpus);
    let layout_ms = started.elapsed().as_secs_f64() * 1000.0;
    let started = Instant::now();
    assert_eq!(store.nodes().await.unwrap().len(), nodes);
    let first_nodes_ms = started.elapsed().as_secs_f64() * 1000.0;
    // The reads are timed while the rows change as in a live fleet.
    let writer = match &own_fleet {
        None => CheckpointWriter::start(&db.url).await,
        Some(sessions) => CheckpointWriter::through_store(store.clone(), sessions.clone()),
    };
    let mut kept_ms = Vec::new();
    let mut views_ms = Vec::new();
    let mut nodes_ms = Vec::new();
    let mut joined_ms = Vec::new();
    let mut every_row_ms = Vec::new();
    // A read a second, as the live stream reads the fleet: each finds the
    // rows of the second before rewritten.
    let mut pace = tokio::time::interval(Duration::from_secs(1));
    for _ in 0..runs {
        pace.tick().await;
        let started = Instant::now();
        let devices = store.latest_devices().await.unwrap();
        kept_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(devices.len(), gpus);
        // What a caller that wants every device (a new client's snapshot,
        // the JSON) pays on top: the views the read no longer makes.
        let started = Instant::now();
        let views = devices.to_vec();
        views_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        drop(views);
        drop(devices);
        // The live stream's other read of the fleet each second.
        let started = Instant::now();
        assert_eq!(store.nodes().await.unwrap().len(), nodes);
        nodes_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        // Side by side, the reads as they were (their rows fetched, not made
        // into views: a lower bound of their cost): every device joined
        // with its node and parent and sorted each time, before the layout
        // was kept; every `gpu_latest` row, before the figures were kept.
        joined_ms.push(time_fetch(&mut conn, JOINED_OVERVIEW, gpus).await);
        every_row_ms.push(time_fetch(&mut conn, EVERY_LATEST_ROW, gpus).await);
    }
    kept_ms.sort_by(f64::total_cmp);
    views_ms.sort_by(f64::total_cmp);
    nodes_ms.sort_by(f64::total_cmp);
    joined_ms.sort_by(f64::total_cmp);
    every_row_ms.sort_by(f64::total_cmp);
    let collector = RunningCollector::start(store.clone()).await;
    let client = reqwest::Client::new();
    // The first call finds no read to share and waits for one.
    let (first_ms, _, _) = time_get(&collector.api("/api/v1/gpus"), &client, 1).await;
    let (http50, http99, bytes) = time_get(&collector.api("/api/v1/gpus"), &client, runs).await;
    let (summary50, summary99, summary_bytes) =
        time_get(&collector.api("/api/v1/fleet"), &client, runs).await;
    // The live stream's read of who holds each device, every 5 s: every
    // current process in the fleet where clients are sent every device,
    // those of the devices sent where the fleet is sent by node (the
    // devices at risk and the nodes followed, a few hundred; 213 here,
    // spread over the fleet).
    let sent_by_node: Vec<String> = store
        .latest_devices()
        .await
        .unwrap()
        .stamps()
        .step_by((gpus / 212).max(1))
        .map(|(uuid, _)| uuid.to_string())
        .collect();
    let mut owners_ms = Vec::new();
    let mut owners_sent_ms = Vec::new();
    let (mut processes_listed, mut processes_sent) = (0, 0);
    for _ in 0..5 {
        let started = Instant::now();
        processes_listed = store
            .processes(now_ms() - 30_000, ProcessesOn::Fleet)
            .await
            .unwrap()
            .len();
        owners_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        let started = Instant::now();
        processes_sent = store
            .processes(now_ms() - 30_000, ProcessesOn::Devices(&sent_by_node))
            .await
            .unwrap()
            .len();
        owners_sent_ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    owners_ms.sort_by(f64::total_cmp);
    owners_sent_ms.sort_by(f64::total_cmp);
    // The dashboard's user, job and pod filters and its processes view:
    // every process sent to the browser to be matched or summed there
    // (before), or only the matching ones, or the collector's sums.
    let filter_reads = [
        (
            "every process, for the filters and the processes view (before)",
            "/api/v1/processes",
        ),
        (
            "a Slurm job's, for the filters (two nodes' jobs match)",
            "/api/v1/processes?slurm_job_id=4017",
        ),
        (
            "a user's, for the filters (one process in eight)",
            "/api/v1/processes?user=user3",
        ),
        (
            "the processes view's sums by owner and largest processes",
            "/api/v1/processes/summary",
        ),
    ];
    let mut filter_rows = Vec::new();
    for (what, path) in filter_reads {
        filter_rows.push((
            (what, path),
            time_get(&collector.api(path), &client, 5).await,
        ));
    }
    // What a dashboard's live stream sends at this size: a row per node
    // (the default limit), every device (a limit above the fleet), one
    // node's devices; one stream at a time, while the rows change.
    let every_device = RunningCollector::start_collector(
        Collector::builder(store.clone())
            .http_server(headroom_collector::http::HttpServerConfig {
                stream_devices_max: u32::MAX,
                ..Default::default()
            })
            .build()
            .await
            .unwrap(),
    )
    .await;
    // A fleet this size has alerts: 200 devices spread over it fire a
    // watermark alert, so that the rows' stream sends as many devices at
    // risk as it ever does (the 12 fullest and 200 alerted).
    let alerted = store.latest_devices().await.unwrap();
    for (uuid, _) in alerted.stamps().step_by((gpus / 200).max(1)).take(200) {
        store
            .apply_alert(&AlertUpdate {
                fingerprint: format!("bench-watermark-{uuid}"),
                rule: "watermark".into(),
                severity: "warning".into(),
                kind: UpdateKind::Firing { escalated: false },
                at_ms: now_ms(),
                labels: serde_json::json!({ "device_uuid": &**uuid }).to_string(),
                summary: "above the watermark".into(),
                details: "{}".into(),
                remedy: String::new(),
                notifications: Vec::new(),
            })
            .await
            .unwrap();
    }
    let stream_seconds = 10;
    let some_node = store.nodes().await.unwrap()[0].name.clone();
    let streams = [
        (
            "a row per node and the devices at risk (the default, `stream_devices_max` = 5,000)",
            collector.api("/api/v1/stream"),
        ),
        (
            "every device (a limit above the fleet)",
            every_device.api("/api/v1/stream"),
        ),
        (
            "one node's devices (`?node=`)",
            collector.api(&format!("/api/v1/stream?node={some_node}")),
        ),
    ];
    let mut stream_rows = Vec::new();
    for (what, url) in streams {
        stream_rows.push((what, follow_stream(&client, &url, stream_seconds).await));
    }
    every_device.stop().await;
    let rewritten = writer.stop().await;
    assert_kept_figures_are_current(store.as_ref(), &mut conn, &rewritten).await;
    println!(
        "The store's reads one a second, all timed while {:.0} `gpu_latest` rows a second were rewritten {} (each row every {CHECKPOINT_S} s, as collectors checkpoint a steady GPU).",
        rewritten.per_s,
        match rewrites {
            Rewrites::ByOthers => "by other collectors",
            Rewrites::ByItself => "by this store, its agents' batches written through it",
        }
    );
    println!();
    println!("| read of {gpus} GPUs | p50 | p99 |");
    println!("|---|---|---|");
    println!(
        "| the store's query, layout and figures kept (first read, laying it out: {layout_ms:.1} ms) | {:.1} ms | {:.1} ms |",
        percentile(&kept_ms, 0.5),
        percentile(&kept_ms, 0.99)
    );
    println!(
        "| every device's view made from a read (a new client's snapshot; not part of the query) | {:.1} ms | {:.1} ms |",
        percentile(&views_ms, 0.5),
        percentile(&views_ms, 0.99)
    );
    println!(
        "| the nodes with their GPU and MIG counts (the live stream's other read each second; the first: {first_nodes_ms:.1} ms) | {:.1} ms | {:.1} ms |",
        percentile(&nodes_ms, 0.5),
        percentile(&nodes_ms, 0.99)
    );
    println!(
        "| the rows joined and sorted on each read (before), fetched only | {:.1} ms | {:.1} ms |",
        percentile(&joined_ms, 0.5),
        percentile(&joined_ms, 0.99)
    );
    println!(
        "| every `gpu_latest` row fetched on each read (before), fetched only | {:.1} ms | {:.1} ms |",
        percentile(&every_row_ms, 0.5),
        percentile(&every_row_ms, 0.99)
    );
    println!(
        "| `GET /api/v1/gpus` ({bytes} B; the first, with no read to share: {first_ms:.1} ms) | {http50:.1} ms | {http99:.1} ms |"
    );
    println!(
        "| `GET /api/v1/fleet`, by node and the 100 fullest ({summary_bytes} B) | {summary50:.1} ms | {summary99:.1} ms |"
    );
    println!(
        "| the current processes ({processes_listed}), as the live stream reads owners every 5 s, 5 reads | {:.1} ms | {:.1} ms (slowest) |",
        percentile(&owners_ms, 0.5),
        percentile(&owners_ms, 1.0)
    );
    println!(
        "| the current processes of {} devices ({processes_sent}), as the stream of a fleet sent by node reads owners every 5 s, 5 reads | {:.1} ms | {:.1} ms (slowest) |",
        sent_by_node.len(),
        percentile(&owners_sent_ms, 0.5),
        percentile(&owners_sent_ms, 1.0)
    );
    for ((what, path), (p50, slowest, bytes)) in filter_rows {
        println!(
            "| `GET {path}`, {what} ({bytes} B), 5 reads | {p50:.1} ms | {slowest:.1} ms (slowest) |"
        );
    }
    println!();
    println!(
        "The live stream at {gpus} GPUs, one client at a time, each followed for {stream_seconds} s:"
    );
    println!();
    println!(
        "| stream | snapshot | first event after | updates, per second | devices sent: in the snapshot · an update (mean) |"
    );
    println!("|---|---|---|---|---|");
    for (what, followed) in &stream_rows {
        let devices = followed
            .devices_sent
            .map_or("—".to_owned(), |(snapshot, update)| {
                format!("{snapshot} · {update:.1}")
            });
        println!(
            "| {what} | {} B | {:.0} ms | {:.0} B | {devices} |",
            followed.snapshot_bytes, followed.snapshot_ms, followed.update_bytes_per_s
        );
    }
    collector.stop().await;
    store.close().await;
    db.drop_database().await;
}

/// What following a live stream cost its client.
struct Followed {
    snapshot_bytes: usize,
    snapshot_ms: f64,
    update_bytes_per_s: f64,
    /// Devices in the snapshot's `gpus` and, on average, in an update's:
    /// counted only where events are small enough to parse on the way
    /// (under 8 MB), so as not to slow the reading of the others.
    devices_sent: Option<(usize, f64)>,
}

/// How many devices an event's `gpus` holds; `None` for an event too
/// large to parse while following.
fn devices_in(event: &[u8]) -> Option<usize> {
    if event.len() > 8 << 20 {
        return None;
    }
    let text = std::str::from_utf8(event).ok()?;
    let data = text.lines().find_map(|l| l.strip_prefix("data: "))?;
    let message: serde_json::Value = serde_json::from_str(data).ok()?;
    message["gpus"].as_array().map(Vec::len)
}

/// Follows the server-sent events at `url` for `seconds` after the first
/// (the snapshot), counting each event's bytes.
async fn follow_stream(client: &reqwest::Client, url: &str, seconds: u64) -> Followed {
    let started = Instant::now();
    let mut response = client
        .get(url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .unwrap();
    let mut pending: Vec<u8> = Vec::new();
    let mut snapshot: Option<(usize, f64, Instant)> = None;
    let mut update_bytes = 0;
    let (mut snapshot_devices, mut update_devices) = (None, Some((0, 0)));
    loop {
        if let Some((_, _, at)) = snapshot
            && at.elapsed() >= Duration::from_secs(seconds)
        {
            break;
        }
        let Ok(Ok(Some(chunk))) =
            tokio::time::timeout(Duration::from_secs(seconds), response.chunk()).await
        else {
            panic!("the stream at {url} ended or stalled");
        };
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            if event.starts_with(b":") {
                continue; // a keep-alive
            }
            match snapshot {
                None => {
                    assert!(
                        event.starts_with(b"event: snapshot"),
                        "{url}: the first event is a snapshot"
                    );
                    snapshot = Some((
                        event.len(),
                        started.elapsed().as_secs_f64() * 1000.0,
                        Instant::now(),
                    ));
                    snapshot_devices = devices_in(&event);
                }
                Some(_) => {
                    update_bytes += event.len();
                    update_devices = update_devices
                        .zip(devices_in(&event))
                        .map(|((sum, n), devices)| (sum + devices, n + 1));
                }
            }
        }
    }
    let (snapshot_bytes, snapshot_ms, at) = snapshot.unwrap();
    Followed {
        snapshot_bytes,
        snapshot_ms,
        update_bytes_per_s: update_bytes as f64 / at.elapsed().as_secs_f64(),
        devices_sent: snapshot_devices.zip(
            update_devices
                .filter(|&(_, n)| n > 0)
                .map(|(sum, n)| sum as f64 / f64::from(n)),
        ),
    }
}

/// `nodes` nodes of 8 GPUs straight into the tables, each GPU with a
/// current sample: no agent registers, no batch is written.
async fn put_fleet_in_tables(conn: &mut PgConnection, nodes: usize) {
    let now = now_ms();
    for statement in [
        format!(
            "INSERT INTO nodes (name, boot_id, agent_version, driver_version, sample_interval_ms, registered_at_ms, last_seen_ms)
             SELECT 'node-' || lpad(g::text, 6, '0'), 'boot', 'bench', '550.54.15', 1000, {now}, {now}
             FROM generate_series(1, {nodes}) g"
        ),
        format!(
            "INSERT INTO devices (uuid, node_id, gpu_index, name, memory_total, pcie_generation, pcie_width)
             SELECT 'GPU-' || md5(n.id::text || '-' || i), n.id, i, 'NVIDIA H100 80GB HBM3', 85899345920, 5, 16
             FROM nodes n, generate_series(0, {}) i",
            GPUS_PER_NODE - 1
        ),
        format!(
            "INSERT INTO gpu_latest (device_id, ts_ms, used_last, used_min, used_max, reserved, total, utilization, pcie_tx, pcie_rx)
             SELECT id, {now}, (id % 80) * 1073741824::int8, (id % 80) * 1073741824::int8, (id % 80 + 1) * 1073741824::int8, 536870912,
                 85899345920, id % 100, id * 1000::int8, id * 2000::int8
             FROM devices"
        ),
        "ANALYZE".to_owned(),
    ] {
        sqlx::query(&statement).execute(&mut *conn).await.unwrap();
    }
}

/// `nodes` agents of 8 GPUs registered with `store`; their sessions.
async fn register_nodes(store: Arc<dyn Store>, nodes: usize) -> Vec<NodeSession> {
    let limits = Limits::default();
    let mut sessions: Vec<Option<NodeSession>> = vec![None; nodes];
    let mut registering = tokio::task::JoinSet::new();
    for node in 0..nodes {
        let store = store.clone();
        let registration =
            validate::registration(&register_request(node, "bench"), &limits).unwrap();
        registering
            .spawn(async move { (node, store.register(&registration, now_ms()).await.unwrap()) });
        // A few at a time: the pool has 16 connections.
        while registering.len() >= 12 {
            let (node, session) = registering.join_next().await.unwrap().unwrap();
            sessions[node] = Some(session);
        }
    }
    while let Some(joined) = registering.join_next().await {
        let (node, session) = joined.unwrap();
        sessions[node] = Some(session);
    }
    sessions.into_iter().map(Option::unwrap).collect()
}

/// `nodes` agents of 8 GPUs registered with `store`, each with a first
/// batch written through its write path; their sessions.
async fn register_fleet(store: Arc<dyn Store>, nodes: usize) -> Vec<NodeSession> {
    let sessions = register_nodes(store.clone(), nodes).await;
    write_node_batches(store.as_ref(), &sessions, 0..nodes, 1, now_ms()).await;
    sessions
}

/// Writes the batches at `seq` and `ts_ms` of `nodes` (their places in
/// `sessions`) through `store`, validated as the collector validates them
/// and in groups of 256, as a writer takes them.
async fn write_node_batches(
    store: &dyn Store,
    sessions: &[NodeSession],
    nodes: impl Iterator<Item = usize>,
    seq: u64,
    ts_ms: i64,
) {
    let limits = Limits::default();
    let batches: Vec<StoreBatch> = nodes
        .map(|node| {
            validate::batch(
                batch(node, "bench", seq, ts_ms),
                &sessions[node],
                now_ms(),
                &limits,
            )
            .unwrap()
        })
        .collect();
    for group in batches.chunks(256) {
        store.write_batches(group).await.unwrap();
    }
}

/// Milliseconds to fetch the rows of `sql`, which are `rows`.
async fn time_fetch(conn: &mut PgConnection, sql: &str, rows: usize) -> f64 {
    let started = Instant::now();
    let fetched = sqlx::query(sql).fetch_all(conn).await.unwrap();
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(fetched.len(), rows);
    ms
}

/// How often a steady GPU's `gpu_latest` row is rewritten (the collectors'
/// checkpoint pace).
const CHECKPOINT_S: i64 = 5;
/// How many statements a second share the rewrites.
const CHECKPOINT_SLICES: i64 = 10;

/// Rewrites `gpu_latest` as collectors checkpoint a steady fleet: each row
/// every [`CHECKPOINT_S`] seconds, spread over the second in
/// [`CHECKPOINT_SLICES`] statements, as batches arrive through it.
struct CheckpointWriter {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Rewritten>,
}

/// What a [`CheckpointWriter`] did.
struct Rewritten {
    /// Rows (or, through a store, GPU samples, each a checkpoint due) a
    /// second.
    per_s: f64,
    /// Through a store: the time of each node's last batch.
    last_ts_by_node: Vec<Option<i64>>,
}

impl CheckpointWriter {
    async fn start(url: &str) -> Self {
        let mut conn = PgConnection::connect(url).await.unwrap();
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut ticks =
                tokio::time::interval(Duration::from_millis(1000 / CHECKPOINT_SLICES as u64));
            let mut rewritten = 0;
            for turn in 0.. {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = ticks.tick() => {}
                }
                rewritten += sqlx::query(
                    "UPDATE gpu_latest SET ts_ms = $1, used_last = used_last + 1048576,
                         used_max = GREATEST(used_max, used_last + 1048576)
                     WHERE device_id % $2 = $3",
                )
                .bind(now_ms())
                .bind(CHECKPOINT_S * CHECKPOINT_SLICES)
                .bind(turn % (CHECKPOINT_S * CHECKPOINT_SLICES))
                .execute(&mut conn)
                .await
                .unwrap()
                .rows_affected();
            }
            Rewritten {
                per_s: rewritten as f64 / started.elapsed().as_secs_f64(),
                last_ts_by_node: Vec::new(),
            }
        });
        Self { stop, task }
    }

    /// The same pace through `store`'s write path: each node of `sessions`
    /// sends a batch every [`CHECKPOINT_S`] seconds (its GPUs' rows are
    /// due then), a slice of the nodes every tenth of a second.
    fn through_store(store: Arc<dyn Store>, sessions: Arc<Vec<NodeSession>>) -> Self {
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut ticks =
                tokio::time::interval(Duration::from_millis(1000 / CHECKPOINT_SLICES as u64));
            let slices = (CHECKPOINT_S * CHECKPOINT_SLICES) as usize;
            let mut last_ts_by_node = vec![None; sessions.len()];
            let mut written = 0;
            for turn in 0usize.. {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = ticks.tick() => {}
                }
                let ts_ms = now_ms();
                // Seq 1 was each node's first batch.
                let seq = 2 + (turn / slices) as u64;
                let slice = (turn % slices..sessions.len()).step_by(slices);
                for node in slice.clone() {
                    last_ts_by_node[node] = Some(ts_ms);
                }
                written += slice.len() * GPUS_PER_NODE;
                write_node_batches(store.as_ref(), &sessions, slice, seq, ts_ms).await;
                // As the collector checks, once a second.
                if turn % CHECKPOINT_SLICES as usize == 0 {
                    store.flush(false).await.unwrap();
                }
            }
            Rewritten {
                per_s: written as f64 / started.elapsed().as_secs_f64(),
                last_ts_by_node,
            }
        });
        Self { stop, task }
    }

    /// Stops the writes.
    async fn stop(self) -> Rewritten {
        let _ = self.stop.send(());
        self.task.await.unwrap()
    }
}

/// The store's overview, read after the writes stopped, holds every row
/// as `gpu_latest` does, or (where the store wrote the batches itself) the
/// sample of each node's last batch: the kept figures missed no write.
async fn assert_kept_figures_are_current(
    store: &dyn Store,
    conn: &mut PgConnection,
    rewritten: &Rewritten,
) {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT d.uuid, l.ts_ms, l.used_last FROM gpu_latest l JOIN devices d ON d.id = l.device_id",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let expected: std::collections::HashMap<String, (i64, i64)> = rows
        .into_iter()
        .map(|(uuid, ts, used)| (uuid, (ts, used)))
        .collect();
    let devices = store.latest_devices().await.unwrap().to_vec();
    assert_eq!(devices.len(), expected.len());
    let last_batch_ts: std::collections::HashMap<String, i64> = rewritten
        .last_ts_by_node
        .iter()
        .enumerate()
        .filter_map(|(node, ts)| Some((node, (*ts)?)))
        .flat_map(|(node, ts)| (0..GPUS_PER_NODE).map(move |g| (gpu_uuid(node, g), ts)))
        .collect();
    for device in devices {
        let latest = device.latest.expect("every GPU has a sample");
        let (row_ts, row_used) = expected[&*device.uuid];
        match last_batch_ts.get(&*device.uuid) {
            Some(&ts) => {
                assert_eq!(latest.timestamp_ms, ts, "{}: its last batch", device.uuid);
                assert!(
                    row_ts <= ts,
                    "{}: a row newer than its last batch",
                    device.uuid
                );
            }
            None => assert_eq!(
                (latest.timestamp_ms, latest.memory_used_bytes),
                (row_ts, row_used),
                "{} in the overview as gpu_latest holds it",
                device.uuid
            ),
        }
    }
}

/// The fleet overview's figures before only the rows written since the
/// last read were fetched (2026-12-04).
const EVERY_LATEST_ROW: &str =
    "SELECT device_id::int8 AS device_id, ts_ms, used_last, used_min, used_max, reserved, total,
        utilization::int8 AS utilization, pcie_tx, pcie_rx
    FROM gpu_latest";

/// The fleet overview's query before the layout was kept (2026-12-03).
const JOINED_OVERVIEW: &str = "SELECT d.id::int8 AS device_id, d.uuid, n.name AS node, p.uuid AS parent_uuid,
        d.gpu_index::int8 AS gpu_index, d.name, d.mig_profile, d.mig_gpu_instance_id::int8 AS mig_gpu_instance_id,
        d.mig_compute_instance_id::int8 AS mig_compute_instance_id, d.memory_total,
        l.ts_ms, l.used_last, l.used_min, l.used_max, l.reserved, l.total, l.utilization::int8 AS utilization,
        l.pcie_tx, l.pcie_rx
    FROM devices d JOIN nodes n ON n.id = d.node_id
    LEFT JOIN devices p ON p.id = d.parent_id
    LEFT JOIN gpu_latest l ON l.device_id = d.id
    WHERE d.present
    ORDER BY n.name, d.gpu_index, d.parent_id NULLS FIRST, d.mig_gpu_instance_id, d.mig_compute_instance_id";

/// Phase 6: a chart of samples held open by another collector, against
/// the same chart on the collector holding them.
async fn reads_across_collectors(nodes: usize, seconds: u64, runs: usize) {
    println!(
        "## 6. Reads across collectors: {nodes} nodes × {GPUS_PER_NODE} GPUs ({PROCESSES_PER_GPU} processes each), {seconds} s held open, {runs} charts each"
    );
    let db = postgres::fresh_database().await.expect("Postgres");
    let postmaster = postmaster_of(&mut PgConnection::connect(&db.url).await.unwrap()).await;
    let storage = StorageConfig {
        chunk_flush_s: 60,
        chunk_memory_mib: 16 * 1024,
        ..StorageConfig::default()
    };
    let holding_store = headroom_store::connect_with(&db.url, storage.clone())
        .await
        .unwrap();
    let other_store = headroom_store::connect_with(&db.url, storage)
        .await
        .unwrap();
    let holding = RunningCollector::start_advertised(holding_store.clone()).await;
    let other = RunningCollector::start_advertised(other_store.clone()).await;
    let loading = Instant::now();
    let sessions = register_nodes(holding_store.clone(), nodes).await;
    let end_ms = now_ms() / 1000 * 1000;
    let start_ms = end_ms - seconds as i64 * 1000;
    for second in 1..=seconds {
        let ts_ms = start_ms + second as i64 * 1000;
        write_node_batches(holding_store.as_ref(), &sessions, 0..nodes, second, ts_ms).await;
    }
    // Planner statistics for the tables just filled, as autovacuum takes
    // them within a minute of such a load.
    sqlx::query("ANALYZE")
        .execute(&mut PgConnection::connect(&db.url).await.unwrap())
        .await
        .unwrap();
    let flushed = holding
        .metric("headroom_collector_chunk_samples_written_total")
        .await;
    println!(
        "loaded in {:.1} s: {} GPU samples and {} process samples held open ({flushed} written by a flush meanwhile)",
        loading.elapsed().as_secs_f64(),
        nodes * GPUS_PER_NODE * seconds as usize,
        nodes * GPUS_PER_NODE * PROCESSES_PER_GPU * seconds as usize,
    );
    let uuid = gpu_uuid(nodes - 1, 0);
    let client = reqwest::Client::new();
    println!(
        "| chart | on the holder p50 / p99 ms | on the other p50 / p99 ms | CPU per chart, holder / other (ms, collectors + Postgres) | bytes |"
    );
    println!("|---|---|---|---|---|");
    for (name, path) in [
        (
            "GPU",
            format!("/api/v1/gpus/{uuid}/series?from={start_ms}&to={end_ms}"),
        ),
        (
            "processes",
            format!("/api/v1/gpus/{uuid}/processes/series?from={start_ms}&to={end_ms}"),
        ),
    ] {
        let cpu = CpuMark::now(postmaster);
        let (own50, own99, own_bytes) = time_get(&holding.api(&path), &client, runs).await;
        let own_cpu = cpu.spent();
        let cpu = CpuMark::now(postmaster);
        let (peer50, peer99, peer_bytes) = time_get(&other.api(&path), &client, runs).await;
        let peer_cpu = cpu.spent();
        assert_eq!(
            own_bytes, peer_bytes,
            "both collectors draw the same {name} chart"
        );
        let per_chart =
            |c: CpuSpent| (c.client + c.agents + c.postgres.unwrap_or(0.0)) * 1000.0 / runs as f64;
        println!(
            "| {name} | {own50:.2} / {own99:.2} | {peer50:.2} / {peer99:.2} | {:.2} / {:.2} | {own_bytes} |",
            per_chart(own_cpu),
            per_chart(peer_cpu),
        );
    }
    let asked = other
        .metric("headroom_collector_peer_reads_total{result=\"ok\"}")
        .await;
    println!("reads answered by the holder: {asked}");
    holding.stop().await;
    other.stop().await;
    holding_store.close().await;
    other_store.close().await;
    db.drop_database().await;
}

/// Phase 1, `rounds` times: the collector over gRPC, then `COPY`.
async fn ingest_rounds(agents: usize, seconds: u64, rounds: usize) {
    println!(
        "## 1. Ingest: {agents} agents × {GPUS_PER_NODE} GPUs ({PROCESSES_PER_GPU} processes each) over gRPC, {seconds} s, {rounds} rounds"
    );
    println!(
        "Open chunks written every {} s (BENCH_FLUSH_S); a GPU-second is one GPU sample and its {PROCESSES_PER_GPU} process samples.",
        bench_flush_s()
    );
    println!(
        "| round | GPU samples/s (GPUs at 1 Hz) | process samples/s | batches per write | written by flushes | CPU per 1,000 GPU-s: collector | Postgres | both | simulated agents |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut both = Vec::new();
    let mut rates = Vec::new();
    for round in 1..=rounds {
        let ingest = ingest_over_grpc(agents, seconds).await;
        let per_k = |cpu: f64| cpu * 1e6 / ingest.gpu_rows.max(1) as f64;
        let postgres = ingest.cpu.postgres.map(per_k);
        let together = postgres.map(|p| p + per_k(ingest.cpu.client));
        if let Some(t) = together {
            both.push(t);
        }
        let rate = ingest.gpu_rows as f64 / ingest.seconds;
        rates.push(rate);
        let ms = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.2} ms"));
        println!(
            "| {round} | {rate:.0} | {:.0} | {:.0} | {:.0} % | {:.2} ms | {} | {} | {:.2} ms |",
            ingest.process_rows as f64 / ingest.seconds,
            ingest.batches_per_write,
            ingest.written_share * 100.0,
            per_k(ingest.cpu.client),
            ms(postgres),
            ms(together),
            per_k(ingest.cpu.agents),
        );
    }
    rates.sort_by(f64::total_cmp);
    println!("median: {:.0} GPU samples/s", percentile(&rates, 0.5));
    if !both.is_empty() {
        both.sort_by(f64::total_cmp);
        let median = percentile(&both, 0.5);
        println!(
            "median CPU per 1,000 GPU-seconds stored, collector and Postgres: {median:.2} ms (target 15 ms); 100,000 GPUs at 1 Hz would take {:.2} cores",
            median * 100.0 / 1000.0
        );
    }
    println!();
}

/// Phases 2 and 3: a day of history, its size on disk, then the queries.
async fn storage_and_queries(history_nodes: usize) {
    let gpus = history_nodes * GPUS_PER_NODE;
    println!(
        "## 2. Storage: 24 h of {gpus} GPUs ({} processes), 1 sample/s",
        gpus * PROCESSES_PER_GPU
    );
    let db = postgres::fresh_database().await.expect("Postgres");
    let store = PostgresStore::connect(&db.url, StorageConfig::default())
        .await
        .unwrap();
    let postmaster = postmaster_of(&mut PgConnection::connect(&db.url).await.unwrap()).await;
    // One whole UTC day, ended more than a day ago.
    let end_ms = bucket_start(now_ms() - DAY_MS, DAY_MS);
    let cpu = CpuMark::now(postmaster);
    let write_s = load_history(&store, history_nodes, end_ms).await;
    let cpu = cpu.spent();
    sqlx::query("VACUUM ANALYZE")
        .execute(store.pool())
        .await
        .unwrap();
    let gpu_seconds = (gpus as i64 * DAY_MS / 1000) as f64;
    let process_seconds = gpu_seconds * PROCESSES_PER_GPU as f64;
    println!(
        "loaded in {write_s:.0} s through the store's write path, chunks written every {} simulated s ({:.0} GPU samples/s)",
        history_flush_s(),
        gpu_seconds / write_s
    );
    let per_thousand = |seconds: f64| seconds * 1e3 / gpu_seconds * 1e3;
    println!(
        "CPU per 1,000 GPU-seconds (each with {PROCESSES_PER_GPU} processes) while loading: collector {:.1} ms, Postgres {} (load generator included in the collector's share)",
        per_thousand(cpu.client),
        cpu.postgres
            .map_or("not on this machine".into(), |p| format!(
                "{:.1} ms",
                per_thousand(p)
            ))
    );
    let chunk_tables = [
        ("gpu_samples_packed", gpu_seconds),
        ("process_samples_packed", process_seconds),
        ("gpu_samples_1m", gpu_seconds),
        ("process_samples_1m", process_seconds),
    ];
    println!(
        "As written (the open chunks written every {} simulated s):",
        history_flush_s()
    );
    print_table_bytes(&store, &chunk_tables).await;
    print_chunk_payload(&store).await;
    let (rollup_s, compacted) = maintain_until_done(&store).await;
    // Compaction frees the minute chunks' and loose minute rollups' space
    // for later ones to reuse; VACUUM FULL gives it back, which is what the
    // steady state holds.
    sqlx::query(
        "VACUUM FULL gpu_samples_packed, process_samples_packed, gpu_samples_1m, process_samples_1m,
             gpu_samples_1h, process_samples_1h",
    )
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query("VACUUM ANALYZE")
        .execute(store.pool())
        .await
        .unwrap();
    println!(
        "Once maintenance rolled up the hours and compacted {compacted} chunks of closed hours ({rollup_s:.1} s), after VACUUM FULL:"
    );
    let kept = print_table_bytes(
        &store,
        &[
            ("gpu_samples_packed", gpu_seconds),
            ("process_samples_packed", process_seconds),
            ("gpu_samples", gpu_seconds),
            ("process_samples", process_seconds),
            ("gpu_samples_1m", gpu_seconds),
            ("gpu_samples_1m_packed", gpu_seconds),
            ("gpu_samples_1h", gpu_seconds),
            ("gpu_samples_1h_packed", gpu_seconds),
            ("process_samples_1m", process_seconds),
            ("process_samples_1m_packed", process_seconds),
            ("process_samples_1h", process_seconds),
            ("process_samples_1h_packed", process_seconds),
        ],
    )
    .await;
    print_chunk_payload(&store).await;
    print_rollup_rows(&store, gpu_seconds, process_seconds).await;
    println!(
        "| everything above (samples, rollups) | {kept} | {:.2} per GPU-second |",
        kept as f64 / gpu_seconds
    );
    let dir = tempfile::tempdir().unwrap();
    let peer_seconds = (GPUS_PER_NODE as i64 * DAY_MS / 1000) as f64;
    if let Some((bytes, took)) = prometheus_bytes(dir.path(), end_ms) {
        println!(
            "| Prometheus TSDB, 8 GPUs × 8 series (promtool, {took:.0} s) | {bytes} | {:.2} |",
            bytes as f64 / peer_seconds
        );
    }
    if let Some(vm) = victoria_metrics(dir.path(), end_ms).await {
        println!(
            "| VictoriaMetrics, 8 GPUs × 8 series (import API, merged) | {} | {:.2} |",
            vm.bytes,
            vm.bytes as f64 / peer_seconds
        );
        println!(
            "VictoriaMetrics took {} samples with {:.2} CPU-s of its server: {:.0} samples per CPU-second, {:.1} ms per 1,000 GPU-seconds of 8 series",
            vm.samples,
            vm.cpu_s,
            vm.samples as f64 / vm.cpu_s,
            vm.cpu_s * 1e3 / peer_seconds * 1e3
        );
    }

    println!();
    println!(
        "## 3. Queries: fleet of {FLEET_GPUS} GPUs, 24 h chart of one of the {gpus} with history"
    );
    fill_fleet(&store, history_nodes).await;
    let shared: Arc<dyn Store> = Arc::new(store);
    let collector = RunningCollector::start(shared.clone()).await;
    let client = reqwest::Client::new();
    let overview = collector.api("/api/v1/gpus");
    let chart = collector.api(&format!(
        "/api/v1/gpus/{}/series?from={}&to={}",
        gpu_uuid(history_nodes / 2, 3),
        end_ms - DAY_MS,
        end_ms
    ));
    // An hour at one point per sample: raw resolution, out of the chunks.
    let zoom = collector.api(&format!(
        "/api/v1/gpus/{}/series?from={}&to={}&max_points=3600",
        gpu_uuid(history_nodes / 2, 3),
        end_ms - 12 * HOUR_MS,
        end_ms - 11 * HOUR_MS - 1
    ));
    // The widest range the dashboard (600 points) still draws from raw
    // samples, and the API's most points over the whole packed day: each
    // bucket folds several packed samples.
    let wide = |hours: i64, points: u32| {
        collector.api(&format!(
            "/api/v1/gpus/{}/series?from={}&to={}&max_points={points}",
            gpu_uuid(history_nodes / 2, 3),
            end_ms - hours * HOUR_MS,
            end_ms - 1
        ))
    };
    let (dashboard_wide, api_wide) = (wide(9, 600), wide(24, 10_000));
    // A point an hour: read from the day's packed hour rollups.
    let day_by_hour = wide(24, 24);
    let processes_by_hour = collector.api(&format!(
        "/api/v1/gpus/{}/processes/series?from={}&to={}&max_points=24",
        gpu_uuid(history_nodes / 2, 3),
        end_ms - DAY_MS,
        end_ms - 1
    ));
    // Warm the connection and the caches, as a dashboard in use would.
    for url in [
        &overview,
        &chart,
        &zoom,
        &dashboard_wide,
        &api_wide,
        &day_by_hour,
        &processes_by_hour,
    ] {
        time_get(url, &client, 20).await;
    }
    let (o50, o99, obytes) = time_get(&overview, &client, 300).await;
    let (c50, c99, cbytes) = time_get(&chart, &client, 300).await;
    let (z50, z99, zbytes) = time_get(&zoom, &client, 300).await;
    let (d50, d99, dbytes) = time_get(&dashboard_wide, &client, 100).await;
    let (a50, a99, abytes) = time_get(&api_wide, &client, 100).await;
    let (h50, h99, hbytes) = time_get(&day_by_hour, &client, 300).await;
    let (p50, p99, pbytes) = time_get(&processes_by_hour, &client, 300).await;
    println!("| query | p50 | p99 | response |");
    println!("|---|---|---|---|");
    println!("| fleet overview, {FLEET_GPUS} GPUs | {o50:.1} ms | {o99:.1} ms | {obytes} B |");
    println!("| 24 h chart, 1,000 points | {c50:.1} ms | {c99:.1} ms | {cbytes} B |");
    println!(
        "| 1 h chart at one point per sample (chunks), 3,600 points | {z50:.1} ms | {z99:.1} ms | {zbytes} B |"
    );
    println!(
        "| 9 h chart, 600 points (54 samples each, from chunks) | {d50:.1} ms | {d99:.1} ms | {dbytes} B |"
    );
    println!(
        "| 24 h chart, 10,000 points (9 samples each, from chunks) | {a50:.1} ms | {a99:.1} ms | {abytes} B |"
    );
    println!(
        "| 24 h chart, 24 points (hour rollups, packed) | {h50:.1} ms | {h99:.1} ms | {hbytes} B |"
    );
    println!(
        "| 24 h chart of its processes, 24 points (hour rollups, packed) | {p50:.1} ms | {p99:.1} ms | {pbytes} B |"
    );
    collector.stop().await;
    shared.close().await;
    db.drop_database().await;
}

/// Phase 5: a day on SQLite, as rows and as chunks, side by side.
async fn sqlite_rows_and_chunks(nodes: usize) {
    let gpus = nodes * GPUS_PER_NODE;
    let gpu_seconds = (gpus as i64 * DAY_MS / 1000) as f64;
    let process_seconds = gpu_seconds * PROCESSES_PER_GPU as f64;
    println!(
        "## 5. SQLite: 24 h of {gpus} GPUs ({} processes), 1 sample/s, through the store's write path",
        gpus * PROCESSES_PER_GPU
    );
    println!(
        "| samples written as | load | GPU samples/s | CPU per 1,000 GPU-s | GPU tables per GPU-s | process tables per process-s | file per GPU-s |"
    );
    println!("|---|---|---|---|---|---|---|");
    let end_ms = bucket_start(now_ms() - DAY_MS, DAY_MS);
    for writes in [SampleWrites::Rows, SampleWrites::Chunks] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("day.db");
        let url = format!("sqlite://{}", path.display());
        let storage = StorageConfig {
            sample_writes: writes,
            ..StorageConfig::default()
        };
        let store = SqliteStore::connect(&url, storage).await.unwrap();
        let cpu = CpuMark::now(None);
        let load_s = load_history(&store, nodes, end_ms).await;
        maintain_until_done(&store).await;
        let cpu = cpu.spent();
        store.close().await;
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        sqlx::query("VACUUM").execute(&pool).await.unwrap();
        // Each table with its indexes, from SQLite's page accounting.
        let tables: Vec<(String, i64)> = sqlx::query_as(
            "SELECT m.tbl_name, SUM(s.pgsize) FROM dbstat s JOIN sqlite_master m ON m.name = s.name
             GROUP BY m.tbl_name",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let bytes_of = |prefix: &str| -> i64 {
            tables
                .iter()
                .filter(|(t, _)| t.starts_with(prefix))
                .map(|(_, b)| b)
                .sum()
        };
        let file: i64 = sqlx::query_scalar(
            "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        pool.close().await;
        println!(
            "| {writes:?} | {load_s:.0} s | {:.0} | {:.1} ms | {:.2} | {:.2} | {:.2} |",
            gpu_seconds / load_s,
            cpu.client * 1e6 / gpu_seconds,
            bytes_of("gpu_samples") as f64 / gpu_seconds,
            bytes_of("process_samples") as f64 / process_seconds,
            file as f64 / gpu_seconds,
        );
    }
    println!(
        "(GPU tables: raw rows, chunks, minute and hour rollups; CPU: this process, the load generator included.)"
    );
    println!();
}

/// What the fleet phase needs of a backend: raw SQL for the load and for
/// the query-time alternative, the store's own calls for the rest.
enum FleetDb {
    Postgres(PostgresStore),
    Sqlite(SqliteStore, sqlx::SqlitePool),
}

impl FleetDb {
    fn store(&self) -> &dyn Store {
        match self {
            Self::Postgres(s) => s,
            Self::Sqlite(s, _) => s,
        }
    }

    async fn execute(&self, sql: &str) {
        match self {
            Self::Postgres(s) => {
                sqlx::query(sql).execute(s.pool()).await.unwrap();
            }
            Self::Sqlite(_, pool) => {
                sqlx::query(sql).execute(pool).await.unwrap();
            }
        }
    }

    async fn refresh(&self, step_ms: i64, from_ms: i64, to_ms: i64) {
        match self {
            Self::Postgres(s) => s.refresh_fleet_rollups(step_ms, from_ms, to_ms).await,
            Self::Sqlite(s, _) => s.refresh_fleet_rollups(step_ms, from_ms, to_ms).await,
        }
        .unwrap();
    }

    /// The fleet's buckets summed from every GPU's rollup rows at query
    /// time: what `fleet_history` would cost without the fleet tables.
    async fn aggregate_at_query_time(&self, table: &str, from_ms: i64, to_ms: i64, width: i64) {
        let sql = format!(
            "SELECT b, AVG(used), MAX(peak), MAX(cap), MAX(n), MAX(low) FROM (
                 SELECT r.ts_ms, (r.ts_ms - {from_ms}) / {width} AS b, SUM(r.used_avg) AS used,
                     SUM(r.used_max) AS peak, SUM(r.total) AS cap, COUNT(*) AS n,
                     SUM(CASE WHEN (r.used_max + r.reserved) * 10 >= r.total * 9 THEN 1 ELSE 0 END) AS low
                 FROM {table} r JOIN devices d ON d.id = r.device_id
                 WHERE d.parent_id IS NULL AND r.ts_ms >= {from_ms} AND r.ts_ms <= {to_ms}
                 GROUP BY r.ts_ms) m GROUP BY b"
        );
        match self {
            Self::Postgres(s) => {
                sqlx::query(&sql).fetch_all(s.pool()).await.unwrap();
            }
            Self::Sqlite(_, pool) => {
                sqlx::query(&sql).fetch_all(pool).await.unwrap();
            }
        }
    }
}

/// The figures of one GPU's rollup rows, as SQL over `d` (device id) and
/// `ts` (bucket start): a plateau per GPU, a slow swing, and one bucket in
/// 25 peaking within 10 % of the total, so that every bucket has GPUs low
/// on headroom (at 79 GiB: 84,825,604,096 bytes, a literal Postgres reads
/// as 64-bit). Figures: used_avg, used_max, reserved, total.
const FLEET_ROLLUP_FIGURES: &str = "(20 + d % 40) * 1073741824 + ((ts / 60000 + d * 97) % 1200) * 1048576,
    (20 + d % 40) * 1073741824 + ((ts / 60000 + d * 97) % 1200) * 1048576
        + CASE WHEN (ts / 60000 + d) % 25 = 0 THEN 84825604096 - ((20 + d % 40) * 1073741824 + ((ts / 60000 + d * 97) % 1200) * 1048576)
          ELSE 536870912 END,
    536870912, 85899345920";

/// Phase 4: the fleet history, on both backends. 1,000 GPUs with a week of
/// minute and hour rollups, loaded directly into the rollup tables; then the
/// fleet tables are filled the way the rollup pass fills them, and
/// `fleet_history` is timed over 7 days, 24 h and 1 h.
async fn fleet_history_phase(runs: usize) {
    println!("## 4. Fleet history: {FLEET_GPUS} GPUs, 7 days of rollups, {runs} calls per range");
    let dir = tempfile::tempdir().unwrap();
    let sqlite_path = dir.path().join("fleet.db");
    let sqlite_url = format!("sqlite://{}", sqlite_path.display());
    let store = SqliteStore::connect(&sqlite_url, StorageConfig::default())
        .await
        .unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&sqlite_path)
        .busy_timeout(Duration::from_secs(60));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    fleet_history_on("SQLite", FleetDb::Sqlite(store, pool), runs).await;
    match postgres::fresh_database().await {
        Some(db) => {
            let store = PostgresStore::connect(&db.url, StorageConfig::default())
                .await
                .unwrap();
            fleet_history_on("Postgres", FleetDb::Postgres(store), runs).await;
            db.drop_database().await;
        }
        None => println!("(no Postgres: DATABASE_URL unset and no initdb)"),
    }
}

async fn fleet_history_on(backend: &str, db: FleetDb, runs: usize) {
    let store = db.store();
    let limits = Limits::default();
    let now = now_ms();
    for node in 0..FLEET_GPUS / GPUS_PER_NODE {
        let reg = validate::registration(&register_request(node, "bench"), &limits).unwrap();
        store.register(&reg, now).await.unwrap();
    }
    let end = bucket_start(now - 3 * MINUTE_MS, HOUR_MS);
    let start = end - 7 * DAY_MS;
    let postgres = matches!(db, FleetDb::Postgres(_));
    if postgres {
        for (table, width) in [("gpu_samples_1m", DAY_MS), ("gpu_samples_1h", 7 * DAY_MS)] {
            db.execute(&format!(
                "SELECT headroom_create_partitions('{table}', {width}, {start}, {end})"
            ))
            .await;
        }
    }
    let started = Instant::now();
    for (table, step) in [("gpu_samples_1m", MINUTE_MS), ("gpu_samples_1h", HOUR_MS)] {
        // A day at a time, so no one statement holds the whole week.
        for day in 0..7 {
            let (from, to) = (start + day * DAY_MS, start + (day + 1) * DAY_MS - step);
            let series = if postgres {
                format!(
                    "(SELECT id::int8 AS d FROM devices) dev CROSS JOIN generate_series({from}::int8, {to}::int8, {step}::int8) AS ts"
                )
            } else {
                format!(
                    "(SELECT id AS d FROM devices) dev CROSS JOIN (WITH RECURSIVE t(ts) AS (SELECT {from} UNION ALL SELECT ts + {step} FROM t WHERE ts < {to}) SELECT ts FROM t)"
                )
            };
            db.execute(&format!(
                "INSERT INTO {table} (device_id, ts_ms, last_ts_ms, samples, used_avg, used_max, reserved, total,
                     used_min, used_last, utilization, pcie_tx, pcie_rx)
                 SELECT d, ts, ts + {step} - 1000, {samples}, {FLEET_ROLLUP_FIGURES},
                     (20 + d % 40) * 1073741824, (20 + d % 40) * 1073741824, 80, 1000000, 2000000
                 FROM {series} ORDER BY d, ts",
                samples = step / 1000,
            ))
            .await;
        }
    }
    let load_s = started.elapsed().as_secs_f64();
    db.execute(&format!(
        "UPDATE rollup_progress SET done_until_ms = {end} WHERE step_ms IN ({MINUTE_MS}, {HOUR_MS})"
    ))
    .await;
    db.execute(if postgres {
        "VACUUM ANALYZE"
    } else {
        "ANALYZE"
    })
    .await;

    // What the rollup passes add: one minute's (and one hour's) fleet row
    // from 1,000 device rows, and the whole week, as the migration does.
    let mut minute_ms = Vec::new();
    for i in 0..60 {
        let m = end - (i + 1) * MINUTE_MS;
        let t = Instant::now();
        db.refresh(MINUTE_MS, m, m + MINUTE_MS).await;
        minute_ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let mut hour_ms = Vec::new();
    for i in 0..24 {
        let h = end - (i + 1) * HOUR_MS;
        let t = Instant::now();
        db.refresh(HOUR_MS, h, h + HOUR_MS).await;
        hour_ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let t = Instant::now();
    db.refresh(MINUTE_MS, start, end).await;
    db.refresh(HOUR_MS, start, end).await;
    let week_s = t.elapsed().as_secs_f64();
    minute_ms.sort_by(f64::total_cmp);
    hour_ms.sort_by(f64::total_cmp);
    println!(
        "### {backend}\n\nloaded {} minute and {} hour rows in {load_s:.0} s",
        FLEET_GPUS as i64 * 7 * DAY_MS / MINUTE_MS,
        FLEET_GPUS as i64 * 7 * DAY_MS / HOUR_MS,
    );
    println!(
        "fleet rows per rollup pass: a minute {:.1} / {:.1} ms, an hour {:.1} / {:.1} ms (p50 / p99); the week's backfill {week_s:.1} s",
        percentile(&minute_ms, 0.5),
        percentile(&minute_ms, 0.99),
        percentile(&hour_ms, 0.5),
        percentile(&hour_ms, 0.99),
    );
    println!(
        "\n| range, 1,000 points | points | p50 | p99 | query-time sum of device rollups (p50, 5 runs) |"
    );
    println!("|---|---|---|---|---|");
    for (label, span) in [("7 d", 7 * DAY_MS), ("24 h", DAY_MS), ("1 h", HOUR_MS)] {
        let (from, to) = (end - span, end - 1);
        let mut points = 0;
        for _ in 0..20 {
            points = store.fleet_history(from, to, 1000).await.unwrap().len();
        }
        let mut ms = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            store.fleet_history(from, to, 1000).await.unwrap();
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        ms.sort_by(f64::total_cmp);
        // The minute rows, as `fleet_history` picks for 1,000 points.
        let width = (span + 999) / 1000;
        let mut alt = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            db.aggregate_at_query_time("gpu_samples_1m", from, to, width)
                .await;
            alt.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        alt.sort_by(f64::total_cmp);
        println!(
            "| {label} | {points} | {:.2} ms | {:.2} ms | {:.0} ms |",
            percentile(&ms, 0.5),
            percentile(&ms, 0.99),
            percentile(&alt, 0.5),
        );
    }
    // The hour rows summed at query time, the cheapest week without fleet
    // tables (168 points).
    let mut alt = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        db.aggregate_at_query_time("gpu_samples_1h", end - 7 * DAY_MS, end - 1, HOUR_MS)
            .await;
        alt.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    alt.sort_by(f64::total_cmp);
    println!(
        "\nquery-time sum of the hour rollups, 7 d at 168 points: {:.0} ms (p50, 5 runs)\n",
        percentile(&alt, 0.5)
    );
    store.close().await;
}
