//! A source that serves a simulation scenario as if it were the hardware.

use std::sync::Arc;
use std::time::Instant;

use headroom_sim::{GpuState, NodeSpec, ProcessState, Scenario};

use crate::allocator::AllocatorStats;
use crate::time::epoch_ms_now;

use super::{
    DeviceReading, GpuDevice, GpuHealth, GpuSource, Inventory, MigDevice, Poll, ProcessOwner,
    ProcessReading, SourceError,
};

#[derive(Debug)]
pub struct SimSource {
    node: NodeSpec,
    started: Instant,
    started_epoch_ms: i64,
}

impl SimSource {
    /// Serves node `node_name` of `scenario`, starting the scenario's clock now.
    pub fn new(scenario: &Scenario, node_name: &str) -> Result<Self, SourceError> {
        let node = scenario.node(node_name).cloned().ok_or_else(|| {
            let names: Vec<&str> = scenario.nodes().iter().map(|n| n.name.as_str()).collect();
            SourceError::UnknownSimNode(node_name.to_owned(), names.join(", "))
        })?;
        Ok(Self {
            node,
            started: Instant::now(),
            started_epoch_ms: epoch_ms_now(),
        })
    }

    pub fn node_name(&self) -> &str {
        &self.node.name
    }

    /// Wall-clock time (epoch ms) of the scenario's t = 0.
    pub fn started_epoch_ms(&self) -> i64 {
        self.started_epoch_ms
    }

    fn process(&self, device_uuid: &str, p: &ProcessState) -> ProcessReading {
        ProcessReading {
            device_uuid: Arc::from(device_uuid),
            pid: p.pid,
            start_time_ms: self
                .started_epoch_ms
                .saturating_add(i64::try_from(p.start_time_ms).unwrap_or(i64::MAX)),
            memory_used: p.memory_used,
            owner: Arc::new(ProcessOwner {
                name: p.name.to_string(),
                uid: p.uid,
                user: p.user.to_string(),
                container_id: p.container_id.to_string(),
                pod_uid: p.pod_uid.to_string(),
                pod_namespace: p.pod_namespace.to_string(),
                slurm_job_id: p.slurm_job_id.to_string(),
                slurm_account: p.slurm_account.to_string(),
                process_group: p.process_group,
                pod_labels: p.pod_labels.to_vec(),
                ..ProcessOwner::default()
            }),
            // The scenario's allocator model stands in for a job reporting
            // through clients/python.
            allocator: p.allocator.map(|a| AllocatorStats {
                timestamp_ms: epoch_ms_now(),
                allocated_bytes: a.allocated,
                reserved_bytes: a.reserved,
                active_bytes: a.active,
                inactive_split_bytes: a.inactive_split,
                peak_allocated_bytes: a.peak_allocated,
                alloc_retries: a.alloc_retries,
                ooms: a.ooms,
                composition: a.composition,
            }),
        }
    }

    fn read_gpu(&self, gpu: &GpuState, poll: &mut Poll) {
        poll.devices.push(DeviceReading {
            uuid: gpu.uuid.clone(),
            memory_used: gpu.memory_used,
            memory_reserved: gpu.memory_reserved,
            memory_total: gpu.memory_total,
            utilization_pct: Some(gpu.utilization_pct),
            pcie_tx_bytes_per_s: Some(gpu.pcie_tx_bytes_per_s),
            pcie_rx_bytes_per_s: Some(gpu.pcie_rx_bytes_per_s),
            health: Some(GpuHealth {
                temperature_c: Some(gpu.temperature_c),
                power_mw: Some(gpu.power_mw),
                sm_clock_mhz: Some(gpu.sm_clock_mhz),
            }),
        });
        for p in &gpu.processes {
            poll.processes.push(self.process(&gpu.uuid, p));
        }
        // Like NVML, MIG instances report memory but neither utilisation nor
        // PCIe, which have no meaning per instance.
        for mig in &gpu.mig {
            poll.devices.push(DeviceReading {
                uuid: mig.uuid.clone(),
                memory_used: mig.memory_used,
                memory_reserved: 0,
                memory_total: mig.memory_total,
                utilization_pct: None,
                pcie_tx_bytes_per_s: None,
                pcie_rx_bytes_per_s: None,
                health: None,
            });
            for p in &mig.processes {
                poll.processes.push(self.process(&mig.uuid, p));
            }
        }
    }
}

impl GpuSource for SimSource {
    fn inventory(&mut self) -> Result<Inventory, SourceError> {
        Ok(Inventory {
            driver_version: self.node.driver_version.clone(),
            gpus: self
                .node
                .inventory()
                .into_iter()
                .map(|g| GpuDevice {
                    index: g.index,
                    uuid: g.uuid,
                    name: g.name,
                    memory_total: g.memory_total,
                    pci_bus_id: g.pci_bus_id,
                    pcie_generation: g.pcie_generation,
                    pcie_width: g.pcie_width,
                    mig_instances: g
                        .mig
                        .into_iter()
                        .map(|m| MigDevice {
                            uuid: m.uuid,
                            gpu_instance_id: m.gpu_instance_id,
                            compute_instance_id: m.compute_instance_id,
                            profile: m.profile,
                            memory_total: m.memory_total,
                        })
                        .collect(),
                })
                .collect(),
        })
    }

    fn poll(&mut self) -> Result<Poll, SourceError> {
        let t = self.started.elapsed().as_secs_f64();
        let mut poll = Poll::default();
        for gpu in self.node.state_at(t) {
            self.read_gpu(&gpu, &mut poll);
        }
        Ok(poll)
    }
}
