//! The fleet overview's read. Which devices exist, on which node and named
//! what (the layout) changes when an agent registers or a device is
//! released; the newest figures of every device change every few seconds.
//! Joining and sorting the layout on every read is most of the overview's
//! cost at fleet scale (a row per GPU, hundreds of milliseconds at 100,000),
//! so the layout is read in full only when the nodes' mark says it changed,
//! and each read fetches only `gpu_latest`.
//!
//! The mark is read in the same snapshot as the figures: a change that
//! commits after it is seen by the next read, never lost. Every change to a
//! node's devices raises that node's `layout_version` in its own
//! transaction; a node added raises the highest id, one removed lowers the
//! count.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sqlx::{Postgres, Transaction};

use crate::rows::DeviceRow;
use crate::{DeviceView, StoreError};

use super::checkpoints::LatestCache;

/// What the nodes say of the layout: equal marks, equal layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
struct LayoutMark {
    nodes: i64,
    versions: i64,
    highest_id: i64,
}

/// The layout as last read, rows in the overview's order with no figures.
#[derive(Debug)]
struct Layout {
    mark: LayoutMark,
    devices: Vec<DeviceRow>,
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
    utilization: Option<i64>,
    pcie_tx: Option<i64>,
    pcie_rx: Option<i64>,
}

/// The layout shared by the store's clones.
#[derive(Debug, Default)]
pub(super) struct LayoutCache {
    layout: Mutex<Option<Arc<Layout>>>,
}

impl LayoutCache {
    fn get(&self, mark: LayoutMark) -> Option<Arc<Layout>> {
        let cached = self.layout.lock().ok()?;
        cached
            .as_ref()
            .filter(|layout| layout.mark == mark)
            .cloned()
    }

    fn put(&self, layout: Arc<Layout>) {
        if let Ok(mut cached) = self.layout.lock() {
            *cached = Some(layout);
        }
    }
}

/// Every present device with its newest figures, those this collector
/// committed since the row's checkpoint laid over it. `tx` is a snapshot
/// (repeatable read).
pub(super) async fn latest_devices(
    tx: &mut Transaction<'static, Postgres>,
    layouts: &LayoutCache,
    newest: &LatestCache,
) -> Result<Vec<DeviceView>, StoreError> {
    let mark: LayoutMark = sqlx::query_as(
        "SELECT count(*) AS nodes, COALESCE(sum(layout_version), 0)::int8 AS versions,
             COALESCE(max(id), 0) AS highest_id
         FROM nodes",
    )
    .fetch_one(&mut **tx)
    .await?;
    let layout = match layouts.get(mark) {
        Some(layout) => layout,
        None => {
            let layout = Arc::new(Layout {
                mark,
                devices: read_layout(tx).await?,
            });
            layouts.put(layout.clone());
            layout
        }
    };
    let latest: Vec<LatestRow> = sqlx::query_as(
        "SELECT device_id::int8 AS device_id, ts_ms, used_last, used_min, used_max, reserved, total,
             utilization::int8 AS utilization, pcie_tx, pcie_rx
         FROM gpu_latest",
    )
    .fetch_all(&mut **tx)
    .await?;
    let latest: HashMap<i64, LatestRow> =
        latest.into_iter().map(|row| (row.device_id, row)).collect();
    Ok(layout
        .devices
        .iter()
        .map(|device| {
            let mut row = device.clone();
            if let Some(figures) = latest.get(&row.device_id) {
                row.ts_ms = Some(figures.ts_ms);
                row.used_last = Some(figures.used_last);
                row.used_min = Some(figures.used_min);
                row.used_max = Some(figures.used_max);
                row.reserved = Some(figures.reserved);
                row.total = Some(figures.total);
                row.utilization = figures.utilization;
                row.pcie_tx = figures.pcie_tx;
                row.pcie_rx = figures.pcie_rx;
            }
            row.overlay_newer(|device, row_ms| newest.newer_than(device, row_ms));
            DeviceView::from(row)
        })
        .collect())
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
