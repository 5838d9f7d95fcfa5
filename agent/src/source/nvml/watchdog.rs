//! Which GPUs a polling thread reads, and which NVML call it is in, since
//! when. NVML calls can block for seconds (a GPU falling off the bus, a
//! driver in trouble); the source reads this to report a call that hangs
//! instead of hanging with it, and to move the other GPUs off a thread that
//! is stuck in one GPU's call.
//!
//! Both facts sit under one lock so that a thread never starts a GPU that
//! was taken from it: the source only takes GPUs from a thread while that
//! thread is inside another GPU's call, and the thread checks its GPUs
//! under the same lock before it starts the next one.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(crate) struct Watchdog {
    state: Mutex<Watched>,
}

#[derive(Debug)]
struct Watched {
    /// The GPUs (NVML indices) this thread reads, in order.
    assigned: Vec<u32>,
    current: Option<InFlight>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InFlight {
    pub gpu: u32,
    pub call: &'static str,
    pub since: Instant,
}

impl Watchdog {
    pub(crate) fn new(assigned: Vec<u32>) -> Self {
        Self {
            state: Mutex::new(Watched {
                assigned,
                current: None,
            }),
        }
    }

    /// Calls on GPU `gpu` go through this.
    pub(crate) fn watch(&self, gpu: u32) -> Watch<'_> {
        Watch {
            watchdog: self,
            gpu,
        }
    }

    /// The GPU in position `position` of this thread's list, if there is
    /// one: the thread reads its GPUs by asking for position 0, 1, ... so
    /// that a GPU taken away meanwhile is not started.
    pub(crate) fn assigned_at(&self, position: usize) -> Option<u32> {
        self.state
            .lock()
            .ok()
            .and_then(|s| s.assigned.get(position).copied())
    }

    /// Drops a lost GPU from this thread's list; `true` when none is left.
    pub(crate) fn release(&self, gpu: u32) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return true;
        };
        state.assigned.retain(|g| *g != gpu);
        state.assigned.is_empty()
    }

    pub(crate) fn assigned(&self) -> Vec<u32> {
        self.state
            .lock()
            .map(|s| s.assigned.clone())
            .unwrap_or_default()
    }

    /// The call in progress.
    pub(crate) fn in_flight(&self) -> Option<InFlight> {
        self.state.lock().ok().and_then(|s| s.current)
    }

    /// When this thread reads more than one GPU and is inside one GPU's
    /// call that has run at least `after`, keeps only that GPU and returns
    /// the others, for another thread to read.
    pub(crate) fn isolate_stuck(&self, after: Duration) -> Option<(InFlight, Vec<u32>)> {
        let mut state = self.state.lock().ok()?;
        let current = state.current?;
        if state.assigned.len() < 2 || current.since.elapsed() < after {
            return None;
        }
        let others = state
            .assigned
            .iter()
            .copied()
            .filter(|g| *g != current.gpu)
            .collect();
        state.assigned = vec![current.gpu];
        Some((current, others))
    }

    /// Gives back GPUs that [`Self::isolate_stuck`] took, when no other
    /// thread could be started for them.
    pub(crate) fn restore(&self, gpus: &[u32]) {
        if let Ok(mut state) = self.state.lock() {
            state.assigned.extend_from_slice(gpus);
        }
    }

    fn set(&self, value: Option<InFlight>) {
        if let Ok(mut state) = self.state.lock() {
            state.current = value;
        }
    }
}

/// One GPU's view of its thread's watchdog.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Watch<'a> {
    watchdog: &'a Watchdog,
    gpu: u32,
}

impl Watch<'_> {
    /// Runs `call` (the NVML function `name`) under watch.
    pub(crate) fn run<T>(&self, name: &'static str, call: impl FnOnce() -> T) -> T {
        self.watchdog.set(Some(InFlight {
            gpu: self.gpu,
            call: name,
            since: Instant::now(),
        }));
        let result = call();
        self.watchdog.set(None);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_the_call_in_flight_and_clears_it_after() {
        let watchdog = Watchdog::new(vec![3]);
        let seen = watchdog
            .watch(3)
            .run("nvmlDeviceGetMemoryInfo_v2", || watchdog.in_flight());
        let seen = seen.map(|f| (f.gpu, f.call));
        assert_eq!(seen, Some((3, "nvmlDeviceGetMemoryInfo_v2")));
        assert_eq!(watchdog.in_flight(), None);
    }

    #[test]
    fn a_stuck_call_keeps_its_gpu_and_gives_up_the_others() {
        let watchdog = Watchdog::new(vec![0, 1, 2, 3]);
        let taken = watchdog.watch(2).run("nvmlDeviceGetMemoryInfo_v2", || {
            let early = watchdog.isolate_stuck(Duration::from_secs(60));
            std::thread::sleep(Duration::from_millis(5));
            (early, watchdog.isolate_stuck(Duration::from_millis(1)))
        });
        assert_eq!(taken.0, None, "a call shorter than the limit keeps all");
        let (stuck, others) = taken.1.expect("isolated");
        assert_eq!((stuck.gpu, others), (2, vec![0, 1, 3]));
        assert_eq!(watchdog.assigned(), vec![2]);
        assert_eq!(watchdog.assigned_at(1), None, "GPU 3 is not started here");
    }

    #[test]
    fn a_thread_between_calls_or_with_one_gpu_is_left_alone() {
        let watchdog = Watchdog::new(vec![0, 1]);
        assert_eq!(watchdog.isolate_stuck(Duration::ZERO), None);
        let alone = Watchdog::new(vec![5]);
        let kept = alone
            .watch(5)
            .run("nvmlDeviceGetUUID", || alone.isolate_stuck(Duration::ZERO));
        assert_eq!(kept, None);
        assert!(alone.release(5));
    }
}
