//! The process-global state: the simulated host built at the first
//! successful `nvmlInit*`, and the init/shutdown refcount.
//!
//! The environment is read once: the host (or the reason it could not be
//! built) is kept for the life of the process, so a later init after a full
//! shutdown serves the same scenario on the same clock. Scenario time `t` is
//! seconds since the host was built.
//!
//! The library is linked with `-z nodelete` (see `build.rs`): nvml-wrapper
//! `dlclose`s it when an `Nvml` is dropped, and unloading would both reset
//! this state and pull the code from under a thread still inside a hung call.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use headroom_sim::{GpuInfo, NodeSpec};

use crate::config::{self, Config, Faults};
use crate::events::Registry;
use crate::ffi::{NvmlResult, UNINITIALIZED, UNKNOWN};
use crate::layout::{self, GpuLayouts};
use crate::snapshot::{Cache, Snapshot};

#[derive(Debug)]
pub(crate) struct Host {
    pub node: NodeSpec,
    pub inventory: Vec<GpuInfo>,
    pub faults: Faults,
    pub layouts: Vec<GpuLayouts>,
    pub events: Registry,
    started: Instant,
    started_unix_us: i64,
    cache: Cache,
}

static HOST: OnceLock<Result<Host, String>> = OnceLock::new();
static REFCOUNT: AtomicU32 = AtomicU32::new(0);

impl Host {
    fn build(config: Config) -> Host {
        let Config { node, faults } = config;
        let inventory = node.inventory();
        let layouts = layout::build(&inventory, &faults.mig_reconfigure);
        let started = Instant::now();
        let started_unix_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
            });
        let cache = Cache::new(&node, &layouts, faults.pcie_counters_start_near_wrap);
        let events = Registry::new(&faults);
        Host {
            node,
            inventory,
            faults,
            layouts,
            events,
            started,
            started_unix_us,
            cache,
        }
    }

    /// Scenario time: seconds since the first successful init.
    pub(crate) fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Microseconds since the Unix epoch at scenario time `t`, for the
    /// timestamps NVML reports.
    pub(crate) fn unix_us(&self, t: f64) -> i64 {
        self.started_unix_us.saturating_add((t * 1e6) as i64)
    }

    /// The scenario's state now (evaluated at most every 5 ms).
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        self.cache.at(self, self.now())
    }

    pub(crate) fn gpu_count(&self) -> usize {
        self.inventory.len()
    }
}

/// `nvmlInit*`: builds the host on first use, then counts the reference.
pub(crate) fn init() -> NvmlResult {
    let host = HOST.get_or_init(|| {
        config::load(|name| std::env::var(name).ok())
            .map(Host::build)
            .map_err(|err| config::one_line(&err))
    });
    match host {
        Ok(_) => {
            REFCOUNT.fetch_add(1, Ordering::AcqRel);
            Ok(())
        }
        Err(message) => {
            eprintln!("headroom-fake-nvml: nvmlInit failed: {message}");
            Err(UNKNOWN)
        }
    }
}

/// `nvmlShutdown`: `NVML_ERROR_UNINITIALIZED` when there is nothing to shut.
pub(crate) fn shutdown() -> NvmlResult {
    REFCOUNT
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |count| {
            count.checked_sub(1)
        })
        .map(|_| ())
        .map_err(|_| UNINITIALIZED)
}

pub(crate) fn is_initialized() -> bool {
    REFCOUNT.load(Ordering::Acquire) > 0
}

/// The host, if the library is initialised.
pub(crate) fn get() -> NvmlResult<&'static Host> {
    if !is_initialized() {
        return Err(UNINITIALIZED);
    }
    match HOST.get() {
        Some(Ok(host)) => Ok(host),
        _ => Err(UNINITIALIZED),
    }
}
