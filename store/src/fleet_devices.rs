//! The fleet overview as a read answers it: every present device, in the
//! overview's order, with its newest figures.
//!
//! At 100,000 GPUs the views would be 26 MB made anew each second, and
//! dropped a second later, whether or not anyone looks at most of them: the
//! live stream sends only the devices that changed. So a read shares what
//! did not change (the layout's views, kept by the store until a device is
//! added or released) and holds only its own figures; a view is made when
//! one is asked for. The figures' buffer goes back to the store when the
//! read's last holder drops it, so a read a second reuses the memory of the
//! one before last instead of asking the system for 10 MB (and faulting it
//! in) each time.

use std::sync::{Arc, Mutex, Weak};

use serde::{Serialize, Serializer};

use crate::model::GpuSampleRow;
use crate::{DeviceView, LatestSample};

/// Every present GPU and MIG instance with its newest figures, as one read
/// saw them. Cloning it shares the read.
#[derive(Debug, Clone)]
pub struct FleetDevices {
    /// In the overview's order. A device's `latest` is its figures unless
    /// `figures` holds them.
    devices: Arc<[DeviceView]>,
    figures: Option<Arc<FigureRows>>,
}

impl FleetDevices {
    /// Views made whole by the read (their `latest` filled).
    pub fn from_views(views: Vec<DeviceView>) -> Self {
        Self {
            devices: views.into(),
            figures: None,
        }
    }

    /// The layout's views with one read's figures, slot for slot.
    pub(crate) fn with_figures(devices: Arc<[DeviceView]>, figures: Arc<FigureRows>) -> Self {
        debug_assert_eq!(devices.len(), figures.rows.len());
        Self {
            devices,
            figures: Some(figures),
        }
    }

    /// Whether `other` is a read of the same layout (the same devices in
    /// the same slots), so that the two compare slot by slot.
    pub fn same_layout(&self, other: &FleetDevices) -> bool {
        Arc::ptr_eq(&self.devices, &other.devices)
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// The device in `slot` of the overview's order, made into its view.
    pub fn view(&self, slot: usize) -> Option<DeviceView> {
        (slot < self.len()).then(|| self.view_at(slot))
    }

    /// Every device's view, made one at a time.
    pub fn views(&self) -> impl ExactSizeIterator<Item = DeviceView> + '_ {
        (0..self.len()).map(|slot| self.view_at(slot))
    }

    fn view_at(&self, slot: usize) -> DeviceView {
        let device = &self.devices[slot];
        match &self.figures {
            None => device.clone(),
            Some(figures) => DeviceView {
                latest: figures
                    .rows
                    .get(slot)
                    .and_then(Option::as_ref)
                    .map(LatestSample::from),
                ..device.clone()
            },
        }
    }

    pub fn to_vec(&self) -> Vec<DeviceView> {
        self.views().collect()
    }

    /// Each device's uuid and the time of its newest sample, in the
    /// overview's order, without making its view: what tells a client's
    /// update which devices changed.
    pub fn stamps(&self) -> impl ExactSizeIterator<Item = (&Arc<str>, Option<i64>)> + '_ {
        (0..self.len()).map(|slot| self.stamp_at(slot))
    }

    /// The uuid of the device in `slot` and the time of its newest sample.
    pub fn stamp(&self, slot: usize) -> Option<(&Arc<str>, Option<i64>)> {
        (slot < self.len()).then(|| self.stamp_at(slot))
    }

    fn stamp_at(&self, slot: usize) -> (&Arc<str>, Option<i64>) {
        let device = &self.devices[slot];
        let stamp = match &self.figures {
            None => device.latest.as_ref().map(|latest| latest.timestamp_ms),
            Some(figures) => figures
                .rows
                .get(slot)
                .and_then(Option::as_ref)
                .map(|row| row.timestamp_ms),
        };
        (&device.uuid, stamp)
    }

    /// The slots of `node`'s devices, in the overview's order.
    pub fn slots_of_node(&self, node: &str) -> Vec<usize> {
        self.slots_on_nodes(|name| name == node)
    }

    /// The slots of the devices on the nodes `on` keeps, in one pass.
    pub fn slots_on_nodes(&self, on: impl Fn(&str) -> bool) -> Vec<usize> {
        self.devices
            .iter()
            .enumerate()
            .filter(|(_, device)| on(&device.node))
            .map(|(slot, _)| slot)
            .collect()
    }

    /// Each MIG instance's uuid with its GPU's.
    pub fn mig_parents(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.devices
            .iter()
            .filter_map(|device| Some((&*device.uuid, device.parent_uuid.as_deref()?)))
    }
}

/// `GET /api/v1/gpus`' shape: a list of views, each made as it is written.
impl Serialize for FleetDevices {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.views())
    }
}

/// One read's newest figures per device, in the layout's order, in a buffer
/// that goes back to [`SpareFigures`] when the read's last holder drops it.
#[derive(Debug)]
pub(crate) struct FigureRows {
    rows: Vec<Option<GpuSampleRow>>,
    spare: Weak<SpareFigures>,
}

/// The store's one spare figures buffer, refilled by the read before last.
#[derive(Debug, Default)]
pub(crate) struct SpareFigures(Mutex<Option<Vec<Option<GpuSampleRow>>>>);

impl FigureRows {
    /// A copy of `source`, in the spare buffer when there is one.
    pub(crate) fn copy_of(source: &[Option<GpuSampleRow>], spare: &Arc<SpareFigures>) -> Self {
        let mut rows = spare.take();
        rows.extend_from_slice(source);
        Self {
            rows,
            spare: Arc::downgrade(spare),
        }
    }

    /// `len` devices with no figures yet.
    pub(crate) fn empty(len: usize, spare: &Arc<SpareFigures>) -> Self {
        let mut rows = spare.take();
        rows.resize(len, None);
        Self {
            rows,
            spare: Arc::downgrade(spare),
        }
    }

    pub(crate) fn rows(&self) -> &[Option<GpuSampleRow>] {
        &self.rows
    }

    pub(crate) fn rows_mut(&mut self) -> &mut [Option<GpuSampleRow>] {
        &mut self.rows
    }
}

impl SpareFigures {
    /// The spare buffer emptied, or a new one.
    fn take(&self) -> Vec<Option<GpuSampleRow>> {
        let mut rows = self
            .0
            .lock()
            .ok()
            .and_then(|mut spare| spare.take())
            .unwrap_or_default();
        rows.clear();
        rows
    }
}

impl Drop for FigureRows {
    fn drop(&mut self) {
        if let Some(spare) = self.spare.upgrade()
            && let Ok(mut slot) = spare.0.lock()
            && slot.is_none()
        {
            *slot = Some(std::mem::take(&mut self.rows));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(uuid: &str, parent: Option<&str>) -> DeviceView {
        DeviceView {
            uuid: uuid.into(),
            node: "node-a".into(),
            kind: if parent.is_some() { "mig" } else { "gpu" },
            parent_uuid: parent.map(Into::into),
            index: 0,
            name: "H100".into(),
            mig_profile: None,
            mig_gpu_instance_id: None,
            mig_compute_instance_id: None,
            memory_total_bytes: 80,
            latest: None,
        }
    }

    fn sample(timestamp_ms: i64, used: i64) -> Option<GpuSampleRow> {
        Some(GpuSampleRow {
            timestamp_ms,
            used_last: used,
            used_min: used,
            used_max: used,
            total: 80,
            ..GpuSampleRow::default()
        })
    }

    #[test]
    fn a_read_shows_its_own_figures_over_the_shared_layout() {
        let spare = Arc::new(SpareFigures::default());
        let layout: Arc<[DeviceView]> =
            vec![device("GPU-a", None), device("MIG-b", Some("GPU-a"))].into();
        let mut first = FigureRows::empty(2, &spare);
        first.rows_mut()[0] = sample(1_000, 10);
        let first = Arc::new(first);
        let mut second = FigureRows::copy_of(first.rows(), &spare);
        second.rows_mut()[1] = sample(2_000, 20);
        let older = FleetDevices::with_figures(layout.clone(), first);
        let newer = FleetDevices::with_figures(layout, Arc::new(second));

        let stamps = |fleet: &FleetDevices| fleet.stamps().map(|(_, at)| at).collect::<Vec<_>>();
        assert_eq!(stamps(&older), [Some(1_000), None]);
        assert_eq!(stamps(&newer), [Some(1_000), Some(2_000)]);
        assert!(
            older.same_layout(&newer),
            "reads of one layout compare by slot"
        );
        let views = newer.to_vec();
        assert_eq!(views.len(), 2);
        assert!(!FleetDevices::from_views(views.clone()).same_layout(&newer));
        assert_eq!(
            views[1].latest.as_ref().map(|l| l.memory_used_bytes),
            Some(20)
        );
        assert_eq!(views[1].latest.as_ref().map(|l| l.headroom_bytes), Some(60));
        assert_eq!(
            newer.mig_parents().collect::<Vec<_>>(),
            [("MIG-b", "GPU-a")]
        );
        let json = serde_json::to_value(&newer).unwrap();
        assert_eq!(json[1]["uuid"], "MIG-b");
        assert_eq!(json[1]["latest"]["timestamp_ms"], 2_000);
        assert!(json[0]["latest"].is_object() && json.as_array().map(Vec::len) == Some(2));
    }

    #[test]
    fn a_dropped_read_lends_its_buffer_to_the_next() {
        let spare = Arc::new(SpareFigures::default());
        let first = FigureRows::copy_of(&[sample(1, 1), sample(2, 2)], &spare);
        let buffer = first.rows().as_ptr();
        drop(first);
        let second = FigureRows::empty(3, &spare);
        assert_eq!(
            second.rows().as_ptr(),
            buffer,
            "the spare buffer was reused"
        );
        assert!(second.rows().iter().all(Option::is_none), "and emptied");
        // Held by a read still in use, it is not lent: the next read takes a new one.
        let held = Arc::new(second);
        let third = FigureRows::empty(3, &spare);
        assert_ne!(third.rows().as_ptr(), held.rows().as_ptr());
    }
}
