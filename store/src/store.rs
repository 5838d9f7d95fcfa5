//! The one trait both backends implement; the conformance suite holds them to it.

use async_trait::async_trait;

use crate::alerts::AlertStore;
use crate::job_reports::JobReportStore;
use crate::model::{FlushReport, NodeSession, Registration, StoreBatch, WriteOutcome};
use crate::peers::{OpenSamples, OpenSamplesQuery, PeerLink};
use crate::rollup::{MaintenanceReport, Watermarks};
use crate::tokens::TokenStore;
use crate::views::{
    AllocatorSeries, AllocatorSeriesQuery, EventView, FleetHistoryPoint, NodeView, ProcessSeries,
    ProcessView, ProcessesOn, SeriesPoint,
};
use crate::{FleetDevices, StoreError};

/// Says in the log what writing the open chunks on close did: the agents
/// hold what could not be written, and send it again.
pub(crate) fn log_flush_on_close(flushed: Result<FlushReport, StoreError>) {
    match flushed {
        Ok(report) if report.samples > 0 => tracing::info!(
            samples = report.samples,
            chunks = report.chunks,
            "wrote the open chunks on close"
        ),
        Ok(_) => {}
        Err(error) => tracing::warn!(%error,
            "could not write the open chunks on close; the agents still hold those samples and send them again"),
    }
}

#[async_trait]
pub trait Store:
    AlertStore + TokenStore + JobReportStore + Send + Sync + std::fmt::Debug + 'static
{
    /// One round trip to the database: whether it answers now (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Records a node's (re)registration and its current inventory; devices the
    /// node no longer reports are marked absent, not deleted.
    async fn register(
        &self,
        registration: &Registration,
        now_ms: i64,
    ) -> Result<NodeSession, StoreError>;

    /// Marks a device absent from its node's inventory, so that another node
    /// may register it: the operator's word that a GPU moved while its old
    /// node still lists it. The node it belonged to, or `None` when no device
    /// has that UUID.
    async fn release_device(&self, uuid: &str, now_ms: i64) -> Result<Option<String>, StoreError>;

    /// The session of an agent boot that registered earlier, if any.
    async fn session(&self, node: &str, boot_id: &str) -> Result<Option<NodeSession>, StoreError>;

    /// Writes batches, from any agents, in one transaction, leaving out each
    /// batch whose (node, boot) already committed the same or a higher `seq`:
    /// one outcome per batch, in order. Either all the new batches are
    /// stored or, on error, none.
    async fn write_batches(&self, batches: &[StoreBatch]) -> Result<Vec<WriteOutcome>, StoreError>;

    /// [`Store::write_batches`] for a single batch.
    async fn write_batch(&self, batch: &StoreBatch) -> Result<WriteOutcome, StoreError> {
        let outcomes = self.write_batches(std::slice::from_ref(batch)).await?;
        Ok(outcomes
            .into_iter()
            .next()
            .unwrap_or(WriteOutcome::Duplicate { committed_seq: 0 }))
    }

    /// Writes the samples held in open chunks, when a flush is due (the
    /// oldest waited its time, or they fill their memory) or `force`d; a
    /// store that writes every sample as it takes it has none.
    async fn flush(&self, force: bool) -> Result<FlushReport, StoreError> {
        let _ = force;
        Ok(FlushReport::default())
    }

    /// The highest seq of the stream `(node_id, boot_id)` whose samples are
    /// durable, where that trails the batches accepted (samples wait in
    /// open chunks); `None` where every accepted batch is durable.
    fn durable_seq(&self, node_id: i64, boot_id: &str) -> Option<u64> {
        let _ = (node_id, boot_id);
        None
    }

    /// The secret collectors sharing this database present to each other
    /// (`fresh` is kept where none is yet), or `None` for a store only one
    /// collector uses (SQLite).
    async fn peer_secret(&self, fresh: &str) -> Result<Option<String>, StoreError> {
        let _ = fresh;
        Ok(None)
    }

    /// From now on, records this collector as the holder of the streams
    /// registered here and, in charts, asks the collector holding a
    /// device's stream for the samples it holds open. Where only one
    /// collector uses the store this does nothing.
    fn link_peers(&self, link: PeerLink) {
        let _ = link;
    }

    /// The samples this collector holds in open chunks, for another
    /// collector's chart.
    fn open_samples(&self, query: &OpenSamplesQuery) -> OpenSamples {
        let _ = query;
        OpenSamples::default()
    }

    /// One maintenance pass: partitions ahead of time, rollups of finished
    /// minutes and hours (and of late samples), retention. Where several
    /// collectors share a database only one of them does the work; the
    /// report says whether it was this one.
    async fn maintain(&self, now_ms: i64) -> Result<MaintenanceReport, StoreError>;

    /// How far the rollups are complete.
    async fn watermarks(&self) -> Result<Watermarks, StoreError>;

    /// Whether concurrent writes make progress together (Postgres) rather
    /// than queue for one lock (SQLite).
    fn parallel_writes(&self) -> bool;

    /// Releases the store's connections (and the maintenance lock, so that
    /// another collector takes over without waiting for a timeout).
    async fn close(&self);

    async fn nodes(&self) -> Result<Vec<NodeView>, StoreError>;

    /// The latest sample of every present GPU and MIG instance, in the
    /// overview's order (by node, then index, each GPU before its MIG
    /// instances).
    async fn latest_devices(&self) -> Result<FleetDevices, StoreError>;

    /// Samples of one device in `[from_ms, to_ms]`, folded into at most
    /// `max_points` buckets. `None` when the device is unknown.
    async fn device_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<SeriesPoint>>, StoreError>;

    /// The whole fleet's memory, low-headroom GPUs and fired alerts in
    /// `[from_ms, to_ms]`, folded into at most `max_points` buckets (the
    /// same buckets as [`Store::device_series`]), in time order. Read from
    /// the fleet rollups only, the minute or hour ones as a device series
    /// picks its resolution, never from raw samples: the minutes after the
    /// rollup watermark (the last two to three) have no memory figures yet,
    /// and a bucket there holds only its alerts. See [`FleetHistoryPoint`]
    /// for what each figure sums.
    async fn fleet_history(
        &self,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Vec<FleetHistoryPoint>, StoreError>;

    /// Processes seen since `since_ms` on the fleet, a node or some
    /// devices, or whose owner matches, with their latest and peak memory.
    async fn processes(
        &self,
        since_ms: i64,
        on: ProcessesOn<'_>,
    ) -> Result<Vec<ProcessView>, StoreError>;

    /// What the allocator of process `pid` on device `uuid` reported in
    /// `[from_ms, to_ms]`, folded into at most `max_points` buckets that keep
    /// each bucket's highest values. The newest incarnation of the pid
    /// unless `start_time_ms` names one. `None` when no such process.
    async fn allocator_series(
        &self,
        query: &AllocatorSeriesQuery<'_>,
    ) -> Result<Option<AllocatorSeries>, StoreError>;

    /// The memory of each process on device `uuid` in `[from_ms, to_ms]`,
    /// folded into the same buckets as [`Store::device_series`] (each
    /// bucket's highest value), the `MAX_PROCESSES_PER_SERIES` biggest
    /// first. Every process's points carry their bucket's end, so they stack;
    /// a device series point carries its newest sample, at most one sample
    /// interval earlier. `None` when the device is unknown.
    async fn process_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<ProcessSeries>>, StoreError>;

    /// Events the agent reported for device `uuid` in `[from_ms, to_ms]`,
    /// newest first, at most `limit`. `None` when the device is unknown.
    async fn device_events(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        limit: i64,
    ) -> Result<Option<Vec<EventView>>, StoreError>;
}
