//! Who owns a GPU process: user, command, container, pod and its namespace,
//! Slurm job and its account.
//!
//! NVML reports only pids and bytes. Everything else is read from procfs
//! under a configurable root, so the agent can read the host's `/proc` from
//! a container (Kubernetes `hostPID`, or the host's procfs mounted at another
//! path) and tests can point it at a fixture tree.
//!
//! The files are read once per process lifetime: a process's user, command
//! and cgroup do not change in ways that matter here, and the agent polls
//! many times a second. A pid alone cannot key that cache because the kernel
//! reuses pids; (pid, start time) can, and the start time costs one read of
//! `<pid>/stat` per call, which the start time needs anyway.

mod cgroup;
mod pod_logs;
pub mod process;
#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
mod users;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use cgroup::{Container, ContainerRuntime, Pod, QosClass};
pub use process::MAX_COMMAND_BYTES;
pub use users::UserNameResolver;

use cgroup::CgroupOwner;
use pod_logs::PodNamespaces;
use process::StatFields;
use users::UserNames;

/// The owner of one process, as far as procfs tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribution {
    /// Real uid, from the `Uid:` line of `status`, as seen from the host's
    /// user namespace.
    pub uid: u32,
    /// NSS name of `uid`, or the uid in decimal when it has none.
    pub user: String,
    /// Command line with arguments joined by spaces (at most
    /// [`MAX_COMMAND_BYTES`]); the kernel's `comm` when there is none
    /// (kernel threads, zombies).
    pub command: String,
    /// Unix epoch milliseconds; with the pid, it names a process uniquely
    /// across pid reuse.
    pub start_time_ms: i64,
    /// The pid in each nested pid namespace, outermost first: the last is
    /// the pid the process sees for itself inside its container. Empty when
    /// the kernel does not say.
    pub nspid: Vec<u32>,
    pub container: Option<Container>,
    pub pod: Option<Pod>,
    pub slurm_job_id: Option<String>,
    /// The process group, where it is one a launcher made (not init's).
    pub process_group: Option<u32>,
    /// A Slurm job's account, as its environment says (`SLURM_JOB_ACCOUNT`).
    /// Reading another user's `environ` takes `CAP_SYS_PTRACE` (or root);
    /// without it this is `None`. The user can change their own process's
    /// environment, so this routes alerts; it proves nothing.
    pub slurm_account: Option<String>,
    /// A pod's namespace, from the kubelet's log directory of the pod
    /// ([`pod_logs`]); absent where that directory is not visible.
    pub pod_namespace: Option<String>,
}

/// An `environ` is read this far at most: Slurm puts its variables among the
/// first few kilobytes, and a job may carry megabytes of environment.
const ENVIRON_LIMIT: usize = 64 * 1024;

/// Attributes pids to owners, caching each process for its lifetime.
#[derive(Debug)]
pub struct Attributor {
    root: PathBuf,
    /// Read once: the kernel recomputes `btime` from the wall clock, so it
    /// drifts by the clock's adjustments, and a start time that changed
    /// between polls would look like a new process downstream.
    btime_s: Option<u64>,
    /// Reused across reads so a poll allocates only for what it keeps.
    buf: Vec<u8>,
    cache: HashMap<u32, Cached>,
    users: UserNames,
    pods: PodNamespaces,
}

/// Where the kubelet keeps pods' logs, one directory per pod.
pub const DEFAULT_POD_LOG_DIR: &str = "/var/log/pods";

#[derive(Debug)]
struct Cached {
    start_ticks: u64,
    attribution: Arc<Attribution>,
}

impl Attributor {
    /// Reads procfs at `procfs_root` (normally `/proc`) and names users
    /// through the system's NSS.
    pub fn new(procfs_root: impl Into<PathBuf>) -> Self {
        Self::with_user_names(procfs_root, Box::new(users::nss_user_name))
    }

    /// As [`Attributor::new`], with user names from `resolver`, so tests do
    /// not depend on the machine's passwd database.
    pub fn with_user_names(procfs_root: impl Into<PathBuf>, resolver: UserNameResolver) -> Self {
        Self {
            root: procfs_root.into(),
            btime_s: None,
            buf: Vec::with_capacity(4096),
            cache: HashMap::new(),
            users: UserNames::new(resolver),
            pods: PodNamespaces::new(PathBuf::from(DEFAULT_POD_LOG_DIR)),
        }
    }

    /// Reads pods' namespaces from `dir` instead of [`DEFAULT_POD_LOG_DIR`]
    /// (the host's, mounted elsewhere in the agent's container; a fixture in
    /// tests).
    pub fn with_pod_log_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.pods = PodNamespaces::new(dir.into());
        self
    }

    /// `None` when the process is gone (it may exit between the NVML call
    /// and this read) or its files are unreadable or garbled beyond use;
    /// callers then report the process without attribution rather than drop
    /// its memory. A garbled `cmdline` or `cgroup` only leaves those parts
    /// out.
    pub fn attribute(&mut self, pid: u32) -> Option<Arc<Attribution>> {
        let Some(stat) = self.read_stat(pid) else {
            self.cache.remove(&pid);
            return None;
        };
        if let Some(cached) = self.cache.get(&pid)
            && cached.start_ticks == stat.start_ticks
        {
            return Some(cached.attribution.clone());
        }
        let start_ticks = stat.start_ticks;
        let attribution = Arc::new(self.read_attribution(pid, stat)?);
        // If the pid was reused while we read, the files may mix two
        // processes; the start time would have moved. Try again next poll.
        if self.read_stat(pid)?.start_ticks != start_ticks {
            return None;
        }
        self.cache.insert(
            pid,
            Cached {
                start_ticks,
                attribution: attribution.clone(),
            },
        );
        Some(attribution)
    }

    /// Forgets every pid not in `live`; call once per poll with the pids
    /// NVML reported so the cache stays the size of the GPU process list.
    pub fn retain(&mut self, live: impl IntoIterator<Item = u32>) {
        let live: HashSet<u32> = live.into_iter().collect();
        self.cache.retain(|pid, _| live.contains(pid));
        let uids: HashSet<u32> = self.cache.values().map(|c| c.attribution.uid).collect();
        self.users.retain(|uid| uids.contains(&uid));
    }

    /// How many processes are cached.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    fn read_attribution(&mut self, pid: u32, stat: StatFields) -> Option<Attribution> {
        let btime_s = self.btime_s()?;
        let start_time_ms = process::start_time_ms(btime_s, stat.start_ticks)?;
        let process_group = (stat.process_group > 1).then_some(stat.process_group);

        let status = self.read_pid_file(pid, "status", None).ok()?;
        let status = process::parse_status(&String::from_utf8_lossy(status));
        let uid = status.uid?;

        // Bounded: the parser keeps MAX_COMMAND_BYTES; a few more bytes let
        // a multi-byte character at the cut survive lossy decoding.
        let cmdline_limit = Some(MAX_COMMAND_BYTES + 4);
        let command = self
            .read_pid_file(pid, "cmdline", cmdline_limit)
            .ok()
            .and_then(process::parse_cmdline)
            .unwrap_or(stat.comm);
        let command = process::printable(command);

        let owner = match self.read_pid_file(pid, "cgroup", None) {
            Ok(contents) => cgroup::classify_cgroup_file(&String::from_utf8_lossy(contents)),
            Err(_) => CgroupOwner::default(),
        };

        // Read only for a process in a Slurm job or a pod, once per process.
        let slurm_account = match owner.slurm_job_id {
            Some(_) => self
                .read_pid_file(pid, "environ", Some(ENVIRON_LIMIT))
                .ok()
                .and_then(|env| process::environ_value(env, "SLURM_JOB_ACCOUNT")),
            None => None,
        };
        let pod_namespace = owner
            .pod
            .as_ref()
            .and_then(|pod| self.pods.namespace(&pod.uid));

        Some(Attribution {
            uid,
            user: process::printable(self.users.name(uid)),
            command,
            start_time_ms,
            nspid: status.nspid,
            container: owner.container,
            pod: owner.pod,
            slurm_job_id: owner.slurm_job_id,
            process_group,
            slurm_account,
            pod_namespace,
        })
    }

    fn read_stat(&mut self, pid: u32) -> Option<StatFields> {
        let contents = self.read_pid_file(pid, "stat", None).ok()?;
        process::parse_stat(contents)
    }

    fn btime_s(&mut self) -> Option<u64> {
        if self.btime_s.is_none() {
            let path = self.root.join("stat");
            let contents = read_into(&mut self.buf, &path, None).ok()?;
            self.btime_s = process::parse_btime(&String::from_utf8_lossy(contents));
        }
        self.btime_s
    }

    fn read_pid_file(&mut self, pid: u32, file: &str, limit: Option<usize>) -> io::Result<&[u8]> {
        let path = self.root.join(pid.to_string()).join(file);
        read_into(&mut self.buf, &path, limit)
    }
}

fn read_into<'a>(buf: &'a mut Vec<u8>, path: &Path, limit: Option<usize>) -> io::Result<&'a [u8]> {
    buf.clear();
    let file = File::open(path)?;
    match limit {
        Some(limit) => file.take(limit as u64).read_to_end(buf)?,
        None => (&file).read_to_end(buf)?,
    };
    Ok(buf)
}
