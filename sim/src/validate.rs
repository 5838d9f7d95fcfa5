//! Turns a parsed [`ScenarioFile`] into the validated model: applies
//! defaults, expands `count`, assigns indices and UUIDs, and collects every
//! problem (not just the first) with the node, GPU, pid and field it concerns.

use std::collections::HashMap;

use crate::ids::{gpu_uuid, mig_uuid};
use crate::model::{AllocatorModel, CompositionModel, Gpu, MigInstance, NodeSpec, Process};
use crate::spec::{GpuFile, MigFile, NodeFile, ProcessFile, ScenarioFile};
use headroom_common::Dtype;
use headroom_common::bytes::HumanBytes;

pub(crate) const DEFAULT_DRIVER_VERSION: &str = "550.54.15";
/// Kubernetes' limit for node names (a DNS subdomain).
const MAX_NODE_NAME_LEN: usize = 253;
/// Far beyond any real machine; it bounds what a typo in `count` can allocate.
const MAX_GPUS_PER_NODE: usize = 1024;
/// Copy k of a `count` entry runs its processes as pid + k · this.
pub(crate) const PID_STRIDE_PER_COPY: u32 = 1000;

/// Validates the whole file, returning every problem found.
pub(crate) fn validate(file: ScenarioFile) -> Result<Vec<NodeSpec>, Vec<String>> {
    let mut problems = Vec::new();
    if file.nodes.is_empty() {
        problems.push("the scenario defines no nodes; add at least one [[node]] table".to_owned());
    }

    let mut first_position: HashMap<String, usize> = HashMap::new();
    let mut nodes = Vec::with_capacity(file.nodes.len());
    for (position, node) in file.nodes.into_iter().enumerate() {
        let number = position + 1;
        if node.name.is_empty() {
            problems.push(format!("[[node]] #{number} has an empty name"));
        } else if let Some(first) = first_position.get(&node.name) {
            problems.push(format!(
                "node {:?} is defined twice ([[node]] #{first} and #{number}); node names must be unique",
                node.name
            ));
        } else {
            first_position.insert(node.name.clone(), number);
        }
        nodes.push(NodeBuilder::new(file.seed, &mut problems).build(node));
    }

    if problems.is_empty() {
        Ok(nodes)
    } else {
        Err(problems)
    }
}

fn name_problem(name: &str) -> Option<String> {
    let length = name.chars().count();
    if length > MAX_NODE_NAME_LEN {
        return Some(format!(
            "name is {length} characters long; at most {MAX_NODE_NAME_LEN} are allowed"
        ));
    }
    name.chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        .map(|bad| {
            format!(
                "name contains {bad:?}; only ASCII letters, digits, '.', '_' and '-' are allowed"
            )
        })
}

/// Where a process runs, for duplicate-pid messages.
struct Placement {
    gpu_index: usize,
    mig_profile: Option<String>,
    copy: Option<(u32, u32)>,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "gpu {}", self.gpu_index)?;
        if let Some(profile) = &self.mig_profile {
            write!(f, " (MIG {profile})")?;
        }
        if let Some((copy, original_pid)) = self.copy {
            write!(f, " as copy {copy} of pid {original_pid} from `count`")?;
        }
        Ok(())
    }
}

struct NodeBuilder<'p> {
    seed: u64,
    problems: &'p mut Vec<String>,
    node: String,
    pids: HashMap<u32, Placement>,
}

/// A `[[node.gpu]]` entry validated once, before `count` copies are made.
struct GpuTemplate {
    model: String,
    memory_total: u64,
    reserved: u64,
    unattributed: u64,
    utilization_pct: Option<u32>,
    pcie_tx: u64,
    pcie_rx: u64,
    processes: Vec<Process>,
    mig: Vec<MigTemplate>,
}

struct MigTemplate {
    gpu_instance_id: u32,
    compute_instance_id: u32,
    profile: String,
    memory_total: u64,
    processes: Vec<Process>,
}

impl<'p> NodeBuilder<'p> {
    fn new(seed: u64, problems: &'p mut Vec<String>) -> Self {
        Self {
            seed,
            problems,
            node: String::new(),
            pids: HashMap::new(),
        }
    }

    fn problem(&mut self, message: String) {
        self.problems.push(message);
    }

    fn build(mut self, file: NodeFile) -> NodeSpec {
        self.node = file.name;
        let here = format!("node {:?}", self.node);
        if let Some(problem) = name_problem(&self.node) {
            self.problem(format!("{here}: {problem}"));
        }
        let driver_version = match file.driver_version {
            Some(version) if version.trim().is_empty() => {
                self.problem(format!("{here}: driver_version must not be empty"));
                version
            }
            Some(version) => version,
            None => DEFAULT_DRIVER_VERSION.to_owned(),
        };
        if file.gpus.is_empty() {
            self.problem(format!(
                "{here}: has no GPUs; add at least one [[node.gpu]] table"
            ));
        }

        let mut gpus: Vec<Gpu> = Vec::new();
        for entry in file.gpus {
            let first = gpus.len();
            let count = self.copy_count(&here, first, entry.count);
            let last = first + count as usize - 1;
            let gpu_here = if count == 1 {
                format!("{here} gpu {first}")
            } else {
                format!("{here} gpus {first}-{last}")
            };
            if last >= MAX_GPUS_PER_NODE {
                self.problem(format!(
                    "{gpu_here}: a node may have at most {MAX_GPUS_PER_NODE} GPUs"
                ));
                break;
            }
            let template = self.gpu_template(&gpu_here, count, entry);
            for copy in 0..count {
                let gpu = self.instantiate(&template, first + copy as usize, copy);
                gpus.push(gpu);
            }
        }

        NodeSpec {
            name: self.node,
            driver_version,
            seed: self.seed,
            gpus,
        }
    }

    fn copy_count(&mut self, here: &str, first: usize, count: Option<i64>) -> u32 {
        match count {
            None => 1,
            Some(count) if (1..=MAX_GPUS_PER_NODE as i64).contains(&count) => count as u32,
            Some(count) => {
                self.problem(format!(
                    "{here} gpu {first}: count must be between 1 and {MAX_GPUS_PER_NODE}, got {count}"
                ));
                1
            }
        }
    }

    fn gpu_template(&mut self, here: &str, count: u32, file: GpuFile) -> GpuTemplate {
        if file.model.trim().is_empty() {
            self.problem(format!("{here}: model must not be empty"));
        }
        let memory_total = file.memory_total.0;
        if memory_total == 0 {
            self.problem(format!("{here}: memory_total must be > 0"));
        }
        let (reserved, unattributed) = (file.reserved.0, file.unattributed.0);
        if reserved.saturating_add(unattributed) > memory_total {
            self.problem(format!(
                "{here}: reserved ({}) plus unattributed ({}) exceeds memory_total ({})",
                HumanBytes(reserved),
                HumanBytes(unattributed),
                HumanBytes(memory_total)
            ));
        }
        let utilization_pct = match file.utilization {
            None => None,
            Some(pct) if (0..=100).contains(&pct) => Some(pct as u32),
            Some(pct) => {
                self.problem(format!(
                    "{here}: utilization must be a percentage between 0 and 100, got {pct}"
                ));
                None
            }
        };

        let in_mig_mode = !file.mig.is_empty();
        if in_mig_mode && !file.processes.is_empty() {
            let pids: Vec<String> = file.processes.iter().map(|p| p.pid.to_string()).collect();
            self.problem(format!(
                "{here}: the GPU is in MIG mode, so its processes (pid {}) must be listed under \
                 [[node.gpu.mig.process]] of a MIG instance, not under [[node.gpu.process]]",
                pids.join(", ")
            ));
        }

        let capacity = memory_total
            .saturating_sub(reserved)
            .saturating_sub(unattributed);
        let device = format!(
            "the {} the GPU has for processes (memory_total minus reserved and unattributed)",
            HumanBytes(capacity)
        );
        let processes = if in_mig_mode {
            Vec::new()
        } else {
            self.processes(here, count, capacity, &device, file.processes)
        };
        let mig = self.mig_templates(here, count, memory_total, file.mig);

        GpuTemplate {
            model: file.model,
            memory_total,
            reserved,
            unattributed,
            utilization_pct,
            pcie_tx: file.pcie_tx.0,
            pcie_rx: file.pcie_rx.0,
            processes,
            mig,
        }
    }

    fn mig_templates(
        &mut self,
        gpu_here: &str,
        count: u32,
        gpu_memory_total: u64,
        files: Vec<MigFile>,
    ) -> Vec<MigTemplate> {
        let total: u64 = files
            .iter()
            .map(|m| m.memory_total.0)
            .fold(0, u64::saturating_add);
        if total > gpu_memory_total {
            self.problem(format!(
                "{gpu_here}: the MIG instances' memory_total values add up to {}, more than the GPU's memory_total ({})",
                HumanBytes(total),
                HumanBytes(gpu_memory_total)
            ));
        }

        let mut seen: HashMap<(u32, u32), usize> = HashMap::new();
        let mut instances = Vec::with_capacity(files.len());
        for (position, file) in files.into_iter().enumerate() {
            let here = format!("{gpu_here} mig {position} ({})", file.profile);
            if file.profile.trim().is_empty() {
                self.problem(format!("{here}: profile must not be empty"));
            }
            if file.memory_total.0 == 0 {
                self.problem(format!("{here}: memory_total must be > 0"));
            }
            let default_gi = position as i64 + 1;
            let gpu_instance_id = self.instance_id(
                &here,
                "gpu_instance_id",
                file.gpu_instance_id.unwrap_or(default_gi),
            );
            let compute_instance_id = self.instance_id(
                &here,
                "compute_instance_id",
                file.compute_instance_id.unwrap_or(0),
            );
            let key = (gpu_instance_id, compute_instance_id);
            if let Some(other) = seen.insert(key, position) {
                self.problem(format!(
                    "{here}: gpu_instance_id {gpu_instance_id} / compute_instance_id \
                     {compute_instance_id} is already used by mig {other}"
                ));
            }
            let device = format!(
                "the {} of MIG instance {} (its memory_total)",
                HumanBytes(file.memory_total.0),
                file.profile
            );
            let processes =
                self.processes(&here, count, file.memory_total.0, &device, file.processes);
            instances.push(MigTemplate {
                gpu_instance_id,
                compute_instance_id,
                profile: file.profile,
                memory_total: file.memory_total.0,
                processes,
            });
        }
        instances
    }

    fn instance_id(&mut self, here: &str, field: &str, value: i64) -> u32 {
        u32::try_from(value).unwrap_or_else(|_| {
            self.problem(format!(
                "{here}: {field} must be between 0 and {}, got {value}",
                u32::MAX
            ));
            0
        })
    }

    fn processes(
        &mut self,
        device_here: &str,
        count: u32,
        capacity: u64,
        device: &str,
        files: Vec<ProcessFile>,
    ) -> Vec<Process> {
        files
            .into_iter()
            .filter_map(|file| self.process(device_here, count, capacity, device, file))
            .collect()
    }

    fn process(
        &mut self,
        device_here: &str,
        count: u32,
        capacity: u64,
        device: &str,
        file: ProcessFile,
    ) -> Option<Process> {
        let here = format!("{device_here} pid {}", file.pid);
        let highest_copy_offset = i64::from(PID_STRIDE_PER_COPY) * (i64::from(count) - 1);
        let pid = match u32::try_from(file.pid) {
            Ok(pid) if pid > 0 => {
                if i64::from(pid) + highest_copy_offset > i64::from(u32::MAX) {
                    self.problem(format!(
                        "{here}: pid is too large for count = {count}: copies get pid + {PID_STRIDE_PER_COPY} per copy"
                    ));
                }
                Some(pid)
            }
            _ => {
                self.problem(format!(
                    "{here}: pid must be between 1 and {}, got {}",
                    u32::MAX,
                    file.pid
                ));
                None
            }
        };
        if file.name.trim().is_empty() {
            self.problem(format!("{here}: name must not be empty"));
        }
        let user = match file.user {
            Some(user) if user.trim().is_empty() => {
                self.problem(format!(
                    "{here}: user must not be empty (omit it for \"root\")"
                ));
                user
            }
            Some(user) => user,
            None => "root".to_owned(),
        };
        let uid = match file.uid {
            None => 0,
            Some(raw) => u32::try_from(raw).unwrap_or_else(|_| {
                self.problem(format!(
                    "{here}: uid must be between 0 and {}, got {raw}",
                    u32::MAX
                ));
                0
            }),
        };
        let process_group = file.process_group.and_then(|raw| match u32::try_from(raw) {
            Ok(group) if group > 0 => Some(group),
            _ => {
                self.problem(format!(
                    "{here}: process_group must be between 1 and {}, got {raw}",
                    u32::MAX
                ));
                None
            }
        });
        let start_s = file.start_s.unwrap_or(0.0);
        if !(start_s.is_finite() && start_s >= 0.0) {
            self.problem(format!(
                "{here}: start_s must be a finite number >= 0, got {start_s}"
            ));
        }
        if let Some(end_s) = file.end_s
            && !(end_s.is_finite() && end_s > start_s)
        {
            self.problem(format!(
                "{here}: end_s must be a finite number after start_s ({start_s}), got {end_s}"
            ));
        }

        for problem in file.memory.problems() {
            self.problem(format!("{here}: {problem}"));
        }
        let (what, peak) = file.memory.static_peak();
        let never_fits = if file.memory.is_oom_prone() {
            peak >= capacity
        } else {
            peak > capacity
        };
        if never_fits {
            self.problem(format!(
                "{here}: memory {what} ({}) does not fit in {device}",
                HumanBytes(peak)
            ));
        }

        let allocator = file.allocator.map(|a| {
            let fragmentation = a.fragmentation.unwrap_or(0.1);
            if !(0.0..1.0).contains(&fragmentation) {
                self.problem(format!(
                    "{here}: allocator.fragmentation must be in [0, 1), got {fragmentation}"
                ));
            }
            let retries_per_min = a.retries_per_min.unwrap_or(0.0);
            if !(retries_per_min.is_finite() && retries_per_min >= 0.0) {
                self.problem(format!(
                    "{here}: allocator.retries_per_min must be a finite number >= 0, got {retries_per_min}"
                ));
            }
            if let Some(at) = a.oom_at_s
                && !(at.is_finite() && at >= 0.0)
            {
                self.problem(format!(
                    "{here}: allocator.oom_at_s must be a finite number >= 0, got {at}"
                ));
            }
            let composition = a.composition.map(|c| {
                for (name, share) in [
                    ("weights", c.weights),
                    ("gradients", c.gradients),
                    ("optimizer_state", c.optimizer_state),
                ] {
                    if !(0.0..=1.0).contains(&share) {
                        self.problem(format!(
                            "{here}: allocator.composition.{name} must be a share in [0, 1], got {share}"
                        ));
                    }
                }
                let sum = c.weights + c.gradients + c.optimizer_state;
                if sum > 1.0 {
                    self.problem(format!(
                        "{here}: allocator.composition shares add up to {sum}, more than the live tensors (1)"
                    ));
                }
                let mut dtype = |key: &str, name: Option<&str>| {
                    let name = name.unwrap_or("float32");
                    let dtype = Dtype::from_name(name);
                    if dtype == Dtype::Other {
                        self.problem(format!(
                            "{here}: allocator.composition.{key} {name:?} is not a PyTorch dtype name (float32, bfloat16, float16, …)"
                        ));
                    }
                    dtype
                };
                CompositionModel {
                    weights: c.weights,
                    gradients: c.gradients,
                    optimizer_state: c.optimizer_state,
                    dtype: dtype("dtype", c.dtype.as_deref()),
                    optimizer_dtype: dtype("optimizer_dtype", c.optimizer_dtype.as_deref()),
                }
            });
            AllocatorModel {
                fragmentation,
                retries_per_min,
                oom_at_s: a.oom_at_s,
                composition,
            }
        });
        Some(Process {
            pid: pid?,
            name: file.name.into(),
            user: user.into(),
            uid,
            container_id: file.container_id.into(),
            pod_uid: file.pod_uid.into(),
            pod_namespace: file.pod_namespace.into(),
            slurm_job_id: file.slurm_job_id.into(),
            slurm_account: file.slurm_account.into(),
            process_group,
            pod_labels: file.pod_labels.into_iter().collect(),
            start_s,
            end_s: file.end_s,
            memory: file.memory,
            allocator,
        })
    }

    fn instantiate(&mut self, template: &GpuTemplate, index: usize, copy: u32) -> Gpu {
        // `index` < MAX_GPUS_PER_NODE, checked before any copy is made.
        let index_u32 = index as u32;
        let uuid = gpu_uuid(&self.node, index_u32);
        let processes = self.copy_processes(&template.processes, index, None, copy);
        let mig = template
            .mig
            .iter()
            .map(|instance| MigInstance {
                uuid: mig_uuid(
                    &uuid,
                    instance.gpu_instance_id,
                    instance.compute_instance_id,
                ),
                gpu_instance_id: instance.gpu_instance_id,
                compute_instance_id: instance.compute_instance_id,
                profile: instance.profile.clone(),
                memory_total: instance.memory_total,
                processes: self.copy_processes(
                    &instance.processes,
                    index,
                    Some(&instance.profile),
                    copy,
                ),
            })
            .collect();
        Gpu {
            index: index_u32,
            uuid,
            model: template.model.clone(),
            memory_total: template.memory_total,
            reserved: template.reserved,
            unattributed: template.unattributed,
            utilization_pct: template.utilization_pct,
            pcie_tx: template.pcie_tx,
            pcie_rx: template.pcie_rx,
            processes,
            mig,
        }
    }

    fn copy_processes(
        &mut self,
        originals: &[Process],
        gpu_index: usize,
        mig_profile: Option<&str>,
        copy: u32,
    ) -> Vec<Process> {
        let offset = PID_STRIDE_PER_COPY.saturating_mul(copy);
        originals
            .iter()
            .map(|original| {
                let pid = original.pid.saturating_add(offset);
                let placement = Placement {
                    gpu_index,
                    mig_profile: mig_profile.map(str::to_owned),
                    copy: (copy > 0).then_some((copy, original.pid)),
                };
                self.register_pid(pid, placement);
                Process {
                    pid,
                    ..original.clone()
                }
            })
            .collect()
    }

    fn register_pid(&mut self, pid: u32, placement: Placement) {
        if let Some(first) = self.pids.get(&pid) {
            let message = format!(
                "node {:?}: duplicate pid {pid}: used on {first} and on {placement}; pids must be unique per node",
                self.node
            );
            self.problem(message);
        } else {
            self.pids.insert(pid, placement);
        }
    }
}
