//! The fleet overview's read. Which devices exist, on which node and named
//! what (the layout) changes when an agent registers or a device is
//! released; the newest figures of every device change every few seconds.
//! Joining and sorting the layout on every read is most of the overview's
//! cost at fleet scale (a row per GPU, hundreds of milliseconds at 100,000),
//! so the layout is read in full only when the nodes' mark says it changed.
//!
//! The mark is read in the same snapshot as the figures: a change that
//! commits after it is seen by the next read, never lost. Every change to a
//! node's devices raises that node's `layout_version` in its own
//! transaction; a node added raises the highest id, one removed lowers the
//! count. The mark reads them from `node_layouts` (migration 0022), a
//! narrow copy that triggers keep, not from `nodes`, which every node's
//! batches rewrite each second.
//!
//! The figures (`gpu_latest`) are kept too, with the snapshot they were
//! read in, and a read fetches only the rows written since: each steady
//! row is rewritten every few seconds, so a second's read fetches a fifth
//! of them, not all. Postgres says which without an index: a row version
//! that the kept snapshot could not see was written by a transaction at
//! least as new as that snapshot's oldest running one (its `xmin`). The
//! test compares transaction ages, `age(xmin)`, which Postgres computes
//! from the row's own 32-bit id; a read whose kept snapshot is too far
//! back for those ages to be exact, or whose layout changed, fetches every
//! row again. Rows that the kept snapshot saw may come again; no row
//! written since is missed.
//!
//! Nor does a read fetch the rows this collector wrote itself
//! (`gpu_latest.writer`, indexed so that Postgres need not scan them to
//! leave them out): it lays its own newest committed samples over the kept
//! figures, and those are at least as new as any row it wrote. The kept
//! figures hold them as of their read, so a read lays over them only the
//! samples of the devices that reported since (the checkpoints' change
//! log). With one collector for the fleet that leaves nothing to fetch and
//! a fifth of the devices to touch. Its checkpoints forget a device ten
//! minutes after its last sample, so figures kept for longer than a minute
//! are read again in full rather than brought up to date.
//!
//! The node list (`nodes()`, the live stream's other read each second) is
//! kept the same way: every field of a node but its last sample time
//! changes only at a registration, which raises its `layout_version`. A
//! read with the same mark fetches each node's `last_seen_ms` alone, not
//! the nodes joined with their devices, counted and sorted (75 ms at
//! 12,500 nodes).
//!
//! A read answers the kept layout's views with its own figures
//! ([`FleetDevices`]): a view is made only where one is asked for, and the
//! figures' buffer is the one the read before last gave back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::{Postgres, Transaction};

use crate::fleet_devices::{FigureRows, SpareFigures};
use crate::model::GpuSampleRow;
use crate::rows::DeviceRow;
use crate::{DeviceView, FleetDevices, NodeView, StoreError};

use super::checkpoints::{FORGET_AFTER_MS, LatestCache, NodeCache};

/// How far back, in transactions, a kept snapshot may be for a read to
/// fetch only what was written since. `age()` is exact within 2^31
/// transactions of now; this leaves room for the transactions that start
/// while the read runs.
const DELTA_REACH_XIDS: i64 = 1 << 30;

/// How long kept figures may go unread and still be brought up to date.
/// They hold this collector's own newest samples only as of their read,
/// and the rows it wrote since are not fetched, so they must be read again
/// well before its checkpoints forget a quiet device.
const KEPT_FIGURES_FOR: Duration = Duration::from_secs(60);
const _: () = assert!(KEPT_FIGURES_FOR.as_millis() * 5 < FORGET_AFTER_MS as u128);

/// What the nodes say of the layout (equal marks, equal layouts), and the
/// snapshot it was read in.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
struct Mark {
    nodes: i64,
    versions: i64,
    highest_id: i64,
    /// The snapshot's oldest running transaction (64-bit, with its epoch).
    snapshot_xmin: i64,
}

impl Mark {
    fn same_layout(&self, other: &Mark) -> bool {
        (self.nodes, self.versions, self.highest_id)
            == (other.nodes, other.versions, other.highest_id)
    }
}

/// The layout as last read: the devices' views with no figures, in the
/// overview's order.
#[derive(Debug)]
struct Layout {
    mark: Mark,
    /// Shared with every read of this layout.
    devices: Arc<[DeviceView]>,
    /// The id of each of `devices`.
    device_ids: Vec<i64>,
    /// Each device's place in `devices`.
    slot_of: HashMap<i64, usize>,
}

/// `gpu_latest` as a snapshot saw it, with this collector's newest samples
/// laid over it, in the layout's order.
#[derive(Debug)]
struct Figures {
    mark: Mark,
    /// Shared with the reads that answered them.
    rows: Arc<FigureRows>,
    /// When the read that made them started.
    read_at: Instant,
    /// Where the checkpoints' change log stood when this collector's
    /// newest samples were laid over them.
    laid_through: Option<u64>,
}

/// One device's newest figures, as `gpu_latest` holds them.
#[derive(Debug, sqlx::FromRow)]
struct LatestRow {
    device_id: i64,
    ts_ms: i64,
    used_last: i64,
    used_min: i64,
    used_max: i64,
    reserved: i64,
    total: i64,
    utilization: Option<i16>,
    pcie_tx: Option<i64>,
    pcie_rx: Option<i64>,
}

impl From<LatestRow> for GpuSampleRow {
    fn from(row: LatestRow) -> Self {
        GpuSampleRow {
            device_id: row.device_id,
            timestamp_ms: row.ts_ms,
            used_last: row.used_last,
            used_min: row.used_min,
            used_max: row.used_max,
            reserved: row.reserved,
            total: row.total,
            utilization_pct: row.utilization,
            pcie_tx_bytes_per_s: row.pcie_tx,
            pcie_rx_bytes_per_s: row.pcie_rx,
            ..GpuSampleRow::default()
        }
    }
}

/// The layout and figures shared by the store's clones.
#[derive(Debug, Default)]
pub(super) struct LayoutCache {
    layout: Mutex<Option<Arc<Layout>>>,
    figures: Mutex<Option<Arc<Figures>>>,
    spare: Arc<SpareFigures>,
    nodes: Mutex<Option<Arc<KeptNodes>>>,
}

/// The node list as last read in full, in name order, with each node's id.
#[derive(Debug)]
struct KeptNodes {
    mark: Mark,
    nodes: Vec<(i64, NodeView)>,
}

/// A node as the store reads it, with the id its checkpoint is kept by.
#[derive(sqlx::FromRow)]
struct NodeRow {
    id: i64,
    #[sqlx(flatten)]
    view: NodeView,
}

impl LayoutCache {
    fn nodes(&self, mark: &Mark) -> Option<Arc<KeptNodes>> {
        let cached = self.nodes.lock().ok()?;
        cached
            .as_ref()
            .filter(|kept| kept.mark.same_layout(mark))
            .cloned()
    }

    fn put_nodes(&self, kept: Arc<KeptNodes>) {
        if let Ok(mut cached) = self.nodes.lock() {
            *cached = Some(kept);
        }
    }

    fn layout(&self, mark: &Mark) -> Option<Arc<Layout>> {
        let cached = self.layout.lock().ok()?;
        cached
            .as_ref()
            .filter(|layout| layout.mark.same_layout(mark))
            .cloned()
    }

    /// Kept figures of this layout that a read in `mark`'s snapshot can
    /// bring up to date by fetching only the rows written since.
    fn figures(&self, mark: &Mark, now: Instant) -> Option<Arc<Figures>> {
        let cached = self.figures.lock().ok()?;
        cached
            .as_ref()
            .filter(|figures| {
                figures.mark.same_layout(mark)
                    && (0..DELTA_REACH_XIDS)
                        .contains(&(mark.snapshot_xmin - figures.mark.snapshot_xmin))
                    && now.saturating_duration_since(figures.read_at) <= KEPT_FIGURES_FOR
            })
            .cloned()
    }

    fn put_layout(&self, layout: Arc<Layout>) {
        if let Ok(mut cached) = self.layout.lock() {
            *cached = Some(layout);
        }
    }

    /// Keeps `figures` unless a read in a newer snapshot was kept already.
    fn put_figures(&self, figures: Arc<Figures>) {
        if let Ok(mut cached) = self.figures.lock() {
            let newer_kept = cached.as_ref().is_some_and(|kept| {
                kept.mark.same_layout(&figures.mark)
                    && kept.mark.snapshot_xmin > figures.mark.snapshot_xmin
            });
            if !newer_kept {
                *cached = Some(figures);
            }
        }
    }
}

/// Every present device with its newest figures, those this collector
/// (`writer` in `gpu_latest`) committed since the row's checkpoint laid
/// over it. `tx` is a snapshot (repeatable read).
pub(super) async fn latest_devices(
    tx: &mut Transaction<'static, Postgres>,
    cache: &LayoutCache,
    newest: &LatestCache,
    writer: i64,
) -> Result<FleetDevices, StoreError> {
    // The figures' age counts from here: the snapshot and the samples laid
    // over them below are at least as new.
    let read_at = Instant::now();
    let mark = read_mark(tx).await?;
    let layout = match cache.layout(&mark) {
        Some(layout) => layout,
        None => {
            let rows = read_layout(tx).await?;
            let device_ids: Vec<i64> = rows.iter().map(|row| row.device_id).collect();
            let slot_of = device_ids
                .iter()
                .enumerate()
                .map(|(slot, &device_id)| (device_id, slot))
                .collect();
            let layout = Arc::new(Layout {
                mark,
                devices: rows.into_iter().map(DeviceView::from).collect(),
                device_ids,
                slot_of,
            });
            cache.put_layout(layout.clone());
            layout
        }
    };
    let kept = cache.figures(&mark, read_at);
    let laid_through = kept.as_ref().and_then(|kept| kept.laid_through);
    let mut rows = read_figures(tx, &layout, kept, writer, &cache.spare).await?;
    // Kept figures hold this collector's newest samples as of their read:
    // only the devices whose samples came since need laying over them.
    let laid_through = laid_through
        .and_then(|since| {
            newest.lay_changed_over(
                since,
                |device_id| layout.slot_of.get(&device_id).copied(),
                rows.rows_mut(),
            )
        })
        .or_else(|| newest.lay_newest_over(layout.device_ids.iter().copied(), rows.rows_mut()));
    let figures = Arc::new(Figures {
        mark,
        rows: Arc::new(rows),
        read_at,
        laid_through,
    });
    cache.put_figures(figures.clone());
    Ok(FleetDevices::with_figures(
        layout.devices.clone(),
        figures.rows.clone(),
    ))
}

/// The mark of the layout in `tx`'s snapshot.
async fn read_mark(tx: &mut Transaction<'static, Postgres>) -> Result<Mark, StoreError> {
    Ok(sqlx::query_as(
        "SELECT count(*) AS nodes, COALESCE(sum(layout_version), 0)::int8 AS versions,
             COALESCE(max(node_id), 0) AS highest_id,
             pg_snapshot_xmin(pg_current_snapshot())::text::int8 AS snapshot_xmin
         FROM node_layouts",
    )
    .fetch_one(&mut **tx)
    .await?)
}

/// Every node with its GPU and MIG counts, in name order, as of `tx`'s
/// snapshot (repeatable read), and its last sample time as the newest of
/// its row and what this collector's checkpoints (`seen`) know.
pub(super) async fn nodes(
    tx: &mut Transaction<'static, Postgres>,
    cache: &LayoutCache,
    seen: &NodeCache,
) -> Result<Vec<NodeView>, StoreError> {
    let mark = read_mark(tx).await?;
    let kept = match cache.nodes(&mark) {
        Some(kept) => {
            let last_seen: HashMap<i64, i64> =
                sqlx::query_as::<_, (i64, i64)>("SELECT id, last_seen_ms FROM nodes")
                    .fetch_all(&mut **tx)
                    .await?
                    .into_iter()
                    .collect();
            return Ok(kept
                .nodes
                .iter()
                .map(|(id, view)| {
                    let row_ms = last_seen.get(id).copied().unwrap_or(view.last_seen_ms);
                    NodeView {
                        last_seen_ms: newest_seen(seen, *id, row_ms),
                        ..view.clone()
                    }
                })
                .collect());
        }
        None => {
            let rows: Vec<NodeRow> = sqlx::query_as(
                "SELECT n.id, n.name, n.boot_id, n.agent_version, n.driver_version,
                     n.sample_interval_ms::int8 AS sample_interval_ms, n.registered_at_ms, n.last_seen_ms,
                     COUNT(d.id) FILTER (WHERE d.parent_id IS NULL) AS gpu_count,
                     COUNT(d.id) FILTER (WHERE d.parent_id IS NOT NULL) AS mig_instance_count
                 FROM nodes n LEFT JOIN devices d ON d.node_id = n.id AND d.present
                 GROUP BY n.id ORDER BY n.name",
            )
            .fetch_all(&mut **tx)
            .await?;
            let kept = Arc::new(KeptNodes {
                mark,
                nodes: rows.into_iter().map(|row| (row.id, row.view)).collect(),
            });
            cache.put_nodes(kept.clone());
            kept
        }
    };
    Ok(kept
        .nodes
        .iter()
        .map(|(id, view)| NodeView {
            last_seen_ms: newest_seen(seen, *id, view.last_seen_ms),
            ..view.clone()
        })
        .collect())
}

/// Node `id`'s last sample time: its row's (a checkpoint), or what this
/// collector knows where that is newer.
fn newest_seen(seen: &NodeCache, id: i64, row_ms: i64) -> i64 {
    seen.newer_than(id, Some(row_ms))
        .map_or(row_ms, |newer| newer.timestamp_ms)
}

/// `gpu_latest` in the transaction's snapshot: `kept` brought up to date
/// with the rows other collectors than `writer` wrote since its snapshot,
/// or every row where there is no `kept`, in a buffer from `spare`. A row
/// never replaces newer figures (kept ones may hold this collector's
/// samples newer than any row).
async fn read_figures(
    tx: &mut Transaction<'static, Postgres>,
    layout: &Layout,
    kept: Option<Arc<Figures>>,
    writer: i64,
    spare: &Arc<SpareFigures>,
) -> Result<FigureRows, StoreError> {
    const COLUMNS: &str = "SELECT device_id::int8 AS device_id, ts_ms, used_last, used_min, used_max, reserved, total,
             utilization, pcie_tx, pcie_rx
         FROM gpu_latest";
    let (mut rows, written) = match kept {
        Some(kept) => {
            // The kept snapshot's xmin as the 32-bit id that `age` takes.
            let kept_xid = kept.mark.snapshot_xmin & 0xFFFF_FFFF;
            // `writer IS DISTINCT FROM $2`, spelled so that the index on
            // `writer` can answer it; planned with `$2` known (not kept as
            // a prepared statement), so that a fleet whose rows this
            // collector wrote reads none of them.
            let written: Vec<LatestRow> = sqlx::query_as(&format!(
                "{COLUMNS} WHERE (writer < $2 OR writer > $2 OR writer IS NULL)
                     AND age(xmin) <= age($1::int8::text::xid)"
            ))
            .bind(kept_xid)
            .bind(writer)
            .persistent(false)
            .fetch_all(&mut **tx)
            .await?;
            (FigureRows::copy_of(kept.rows.rows(), spare), written)
        }
        None => {
            let written: Vec<LatestRow> = sqlx::query_as(COLUMNS).fetch_all(&mut **tx).await?;
            (FigureRows::empty(layout.devices.len(), spare), written)
        }
    };
    let slots = rows.rows_mut();
    for row in written {
        if let Some(&slot) = layout.slot_of.get(&row.device_id)
            && let Some(figures) = slots.get_mut(slot)
            && figures
                .as_ref()
                .is_none_or(|kept| kept.timestamp_ms <= row.ts_ms)
        {
            *figures = Some(row.into());
        }
    }
    Ok(rows)
}

async fn read_layout(
    tx: &mut Transaction<'static, Postgres>,
) -> Result<Vec<DeviceRow>, StoreError> {
    Ok(sqlx::query_as::<_, DeviceRow>(
        "SELECT d.id::int8 AS device_id, d.uuid, n.name AS node, p.uuid AS parent_uuid, d.gpu_index::int8 AS gpu_index, d.name,
             d.mig_profile, d.mig_gpu_instance_id::int8 AS mig_gpu_instance_id,
             d.mig_compute_instance_id::int8 AS mig_compute_instance_id, d.memory_total,
             NULL::int8 AS ts_ms, NULL::int8 AS used_last, NULL::int8 AS used_min, NULL::int8 AS used_max,
             NULL::int8 AS reserved, NULL::int8 AS total, NULL::int8 AS utilization,
             NULL::int8 AS pcie_tx, NULL::int8 AS pcie_rx
         FROM devices d JOIN nodes n ON n.id = d.node_id
         LEFT JOIN devices p ON p.id = d.parent_id
         WHERE d.present
         ORDER BY n.name, d.gpu_index, d.parent_id NULLS FIRST, d.mig_gpu_instance_id, d.mig_compute_instance_id",
    )
    .fetch_all(&mut **tx)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(versions: i64, snapshot_xmin: i64) -> Mark {
        Mark {
            nodes: 2,
            versions,
            highest_id: 7,
            snapshot_xmin,
        }
    }

    fn figures(mark: Mark) -> Arc<Figures> {
        Arc::new(Figures {
            mark,
            rows: Arc::new(FigureRows::empty(3, &Arc::default())),
            read_at: Instant::now(),
            laid_through: None,
        })
    }

    fn kept_xmin(cache: &LayoutCache, at: Mark) -> Option<i64> {
        cache
            .figures(&at, Instant::now())
            .map(|kept| kept.mark.snapshot_xmin)
    }

    #[test]
    fn kept_figures_serve_a_later_snapshot_of_the_same_layout_only() {
        let cache = LayoutCache::default();
        assert_eq!(kept_xmin(&cache, mark(1, 100)), None, "nothing kept yet");
        cache.put_figures(figures(mark(1, 100)));
        assert_eq!(kept_xmin(&cache, mark(1, 100)), Some(100));
        assert_eq!(kept_xmin(&cache, mark(1, 5_000)), Some(100));
        assert_eq!(
            kept_xmin(&cache, mark(2, 5_000)),
            None,
            "the layout changed: every row is read again"
        );
        assert_eq!(
            kept_xmin(&cache, mark(1, 99)),
            None,
            "an older snapshot cannot start from a newer one"
        );
        assert_eq!(
            kept_xmin(&cache, mark(1, 100 + DELTA_REACH_XIDS)),
            None,
            "too far back for age() to compare exactly"
        );
        assert_eq!(
            kept_xmin(&cache, mark(1, 100 + DELTA_REACH_XIDS - 1)),
            Some(100)
        );
    }

    #[test]
    fn figures_left_unread_for_a_minute_are_read_again() {
        let cache = LayoutCache::default();
        let kept = figures(mark(1, 100));
        let read_at = kept.read_at;
        cache.put_figures(kept);
        let fetch_since = |after: Duration| {
            cache
                .figures(&mark(1, 200), read_at + after)
                .map(|kept| kept.mark.snapshot_xmin)
        };
        assert_eq!(fetch_since(Duration::from_secs(1)), Some(100));
        assert_eq!(fetch_since(KEPT_FIGURES_FOR), Some(100));
        assert_eq!(
            fetch_since(KEPT_FIGURES_FOR + Duration::from_secs(1)),
            None,
            "this collector may have forgotten samples whose rows were not fetched"
        );
    }

    #[test]
    fn a_read_that_finishes_late_does_not_replace_newer_figures() {
        let cache = LayoutCache::default();
        cache.put_figures(figures(mark(1, 200)));
        cache.put_figures(figures(mark(1, 150)));
        assert_eq!(kept_xmin(&cache, mark(1, 300)), Some(200));
        // A read of a new layout replaces them, whatever its snapshot.
        cache.put_figures(figures(mark(2, 180)));
        assert_eq!(kept_xmin(&cache, mark(2, 300)), Some(180));
    }
}
