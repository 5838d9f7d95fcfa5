//! A thread that reads a set of GPUs, one after the other, once per
//! request. At first one thread reads every GPU: a poll then wakes one
//! thread instead of one per GPU, which at 10 Hz costs more than the
//! readings themselves. A GPU whose call hangs keeps this thread to itself;
//! the source moves the others to a new one ([`super::watchdog`]).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use nvml_wrapper::Nvml;

use super::gpu::{Gpu, GpuReply, Outcome, ReadTiming};
use super::pcie::ThroughputBoard;
use super::watchdog::Watchdog;

/// Where a polling thread's answers go: the readings land in `replies`
/// (taken by the source without waking it), and the thread's `id` goes
/// down `done` once per request, when it has read all its GPUs.
#[derive(Debug, Clone)]
pub(crate) struct Answers {
    pub id: usize,
    pub replies: Arc<Mutex<Vec<GpuReply>>>,
    pub done: Sender<usize>,
}

/// Starts a thread that reads the GPUs `watchdog` assigns it each time a
/// message arrives on `requests`. It ends when `requests` closes, the
/// source goes away, or its last GPU is lost.
pub(crate) fn spawn(
    name: String,
    nvml: Arc<Nvml>,
    watchdog: Arc<Watchdog>,
    requests: Receiver<()>,
    answers: Answers,
    pcie: Arc<ThroughputBoard>,
    timing: ReadTiming,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(move || {
        let mut gpus: Vec<Gpu<'_>> = Vec::new();
        while requests.recv().is_ok() {
            let mut position = 0;
            let mut none_left = false;
            // Asked position by position, under the watchdog's lock: a GPU
            // moved to another thread while this one was stuck is skipped.
            while let Some(index) = watchdog.assigned_at(position) {
                position += 1;
                let at = match gpus.iter().position(|g| g.index() == index) {
                    Some(at) => at,
                    None => {
                        gpus.push(Gpu::new(&nvml, index, watchdog.watch(index), &pcie, timing));
                        gpus.len() - 1
                    }
                };
                let outcome = gpus[at].read();
                if matches!(outcome, Outcome::Lost) {
                    gpus.remove(at);
                    none_left = watchdog.release(index);
                    position -= 1;
                }
                let Ok(mut replies) = answers.replies.lock() else {
                    return;
                };
                replies.push(GpuReply { index, outcome });
            }
            // Fewer GPUs read than held: some moved away and are read
            // elsewhere now. Checked by count, so that a usual round does
            // not copy the GPU list.
            if gpus.len() > position {
                let assigned = watchdog.assigned();
                gpus.retain(|g| assigned.contains(&g.index()));
            }
            if answers.done.send(answers.id).is_err() || none_left {
                break;
            }
        }
    })
}
