//! The agent's GPU figures under dcgm-exporter's names, labels and units,
//! beside Headroom's own, so that dashboards and alert rules written for
//! dcgm-exporter (Grafana dashboard 12239, `DCGM_FI_DEV_*` rules) work
//! unchanged where Headroom replaces it (`dcgm_metric_names = true`).
//!
//! Pinned to dcgm-exporter 4.8.2 (`4.5.3-4.8.2`) and its default counters:
//! `DCGM_FI_DEV_FB_USED`, `_FB_FREE`, `_FB_RESERVED` (MiB), `_GPU_UTIL` (%),
//! `DCGM_FI_PROF_PCIE_TX_BYTES` and `_RX_BYTES` (bytes per second),
//! `DCGM_FI_DEV_XID_ERRORS` (the last XID seen, 0 for none), and the three
//! that dashboard 12239 charts beside memory and keys its `instance` and
//! `gpu` variables on: `DCGM_FI_DEV_GPU_TEMP` (C), `_POWER_USAGE` (W) and
//! `_SM_CLOCK` (MHz). Labels as that release writes them: `gpu`, `UUID`,
//! `pci_bus_id`, `device` (`nvidia<gpu>`), `modelName`, `GPU_I_PROFILE` and
//! `GPU_I_ID` for a MIG instance (whose `gpu`, `UUID` and `pci_bus_id` are
//! its parent GPU's), `Hostname`, and the driver as
//! `DCGM_FI_DRIVER_VERSION`. Later releases renamed `Hostname` to
//! `hostname`. Not given: the profiling fields (`DCGM_FI_PROF_PIPE_TENSOR_ACTIVE`,
//! `_GR_ENGINE_ACTIVE`, `_DRAM_ACTIVE`), which only DCGM's profiling module
//! measures and NVML has no call for.

use std::collections::HashMap;
use std::fmt::Write as _;

use headroom_common::exposition::write_family;

use crate::metrics::escape;
use crate::source::{DeviceReading, GpuHealth, Poll};

/// Where a device sits, as dcgm-exporter labels it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DcgmDevice {
    /// The GPU's index; a MIG instance's parent's.
    pub gpu: u32,
    /// The GPU's UUID; a MIG instance's parent's.
    pub gpu_uuid: String,
    /// The GPU's; a MIG instance's parent's.
    pub pci_bus_id: String,
    pub model: String,
    /// For a MIG instance: its profile and GPU instance id.
    pub mig: Option<(String, u32)>,
    pub driver_version: String,
}

const MIB: u64 = 1024 * 1024;

fn labels(device: &DcgmDevice, hostname: &str) -> String {
    let mut out = format!(
        "gpu=\"{}\",UUID=\"{}\",pci_bus_id=\"{}\",device=\"nvidia{}\",modelName=\"{}\"",
        device.gpu,
        escape(&device.gpu_uuid),
        escape(&device.pci_bus_id),
        device.gpu,
        escape(&device.model)
    );
    if let Some((profile, instance)) = &device.mig {
        let _ = write!(
            out,
            ",GPU_I_PROFILE=\"{}\",GPU_I_ID=\"{instance}\"",
            escape(profile)
        );
    }
    let _ = write!(
        out,
        ",Hostname=\"{}\",DCGM_FI_DRIVER_VERSION=\"{}\"",
        escape(hostname),
        escape(&device.driver_version)
    );
    out
}

/// Appends the dcgm-exporter families for `poll` to `out`. `last_xid` is
/// the last XID code seen per device UUID.
pub(crate) fn render(
    out: &mut String,
    hostname: &str,
    devices: &HashMap<String, DcgmDevice>,
    poll: &Poll,
    last_xid: &HashMap<String, u32>,
) {
    let rows = |value: &dyn Fn(&DeviceReading, &DcgmDevice) -> Option<String>| {
        poll.devices
            .iter()
            .filter_map(|d| {
                let device = devices.get(&d.uuid)?;
                Some((labels(device, hostname), value(d, device)?))
            })
            .collect::<Vec<(String, String)>>()
    };
    write_family(
        out,
        "DCGM_FI_DEV_FB_FREE",
        "gauge",
        "Framebuffer memory free (in MiB).",
        rows(&|d, _| {
            let free = d
                .memory_total
                .saturating_sub(d.memory_used)
                .saturating_sub(d.memory_reserved);
            Some((free / MIB).to_string())
        }),
    );
    write_family(
        out,
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Framebuffer memory used (in MiB).",
        rows(&|d, _| Some((d.memory_used / MIB).to_string())),
    );
    write_family(
        out,
        "DCGM_FI_DEV_FB_RESERVED",
        "gauge",
        "Framebuffer memory reserved (in MiB).",
        rows(&|d, _| Some((d.memory_reserved / MIB).to_string())),
    );
    write_family(
        out,
        "DCGM_FI_DEV_GPU_UTIL",
        "gauge",
        "GPU utilization (in %).",
        rows(&|d, _| d.utilization_pct.map(|p| p.to_string())),
    );
    write_family(
        out,
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "gauge",
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        rows(&|d, _| d.pcie_tx_bytes_per_s.map(|v| v.to_string())),
    );
    write_family(
        out,
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "gauge",
        "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        rows(&|d, _| d.pcie_rx_bytes_per_s.map(|v| v.to_string())),
    );
    let health = |figure: fn(&GpuHealth) -> Option<String>| {
        move |d: &DeviceReading, _: &DcgmDevice| d.health.as_ref().and_then(figure)
    };
    write_family(
        out,
        "DCGM_FI_DEV_SM_CLOCK",
        "gauge",
        "SM clock frequency (in MHz).",
        rows(&health(|h| h.sm_clock_mhz.map(|v| v.to_string()))),
    );
    write_family(
        out,
        "DCGM_FI_DEV_GPU_TEMP",
        "gauge",
        "GPU temperature (in C).",
        rows(&health(|h| h.temperature_c.map(|v| v.to_string()))),
    );
    write_family(
        out,
        "DCGM_FI_DEV_POWER_USAGE",
        "gauge",
        "Power draw (in W).",
        // NVML gives milliwatts; DCGM writes watts with a fraction.
        rows(&health(|h| {
            h.power_mw
                .map(|mw| format!("{:.3}", f64::from(mw) / 1000.0))
        })),
    );
    write_family(
        out,
        "DCGM_FI_DEV_XID_ERRORS",
        "gauge",
        "Value of the last XID error encountered.",
        // An XID names the GPU; a MIG instance shows its parent's.
        rows(&|d, device| {
            let code = last_xid
                .get(&d.uuid)
                .or_else(|| last_xid.get(&device.gpu_uuid));
            Some(code.copied().unwrap_or(0).to_string())
        }),
    );
}
