//! The scenario's state, evaluated at most once per 5 ms of scenario time
//! and shared by every call in between, with MIG reconfigurations applied
//! and the cumulative PCIe byte counters integrated.
//!
//! A poller reading 8 GPUs × 50 processes through a few dozen calls per
//! cycle thus pays for one evaluation per cycle, not one per call.

use std::sync::{Arc, Mutex, PoisonError};

use headroom_sim::{GpuState, MigState, NodeSpec};

use crate::host::Host;
use crate::layout::{GpuLayouts, MigInstance};

/// Calls within this much scenario time share one evaluation.
const REFRESH_S: f64 = 0.005;
/// The PCIe integral takes trapezoid steps of at most this long, so a long
/// gap between calls still follows the rate's one-minute swing.
const MAX_STEP_S: f64 = 1.0;
/// ... but a gap of hours is not worth more than this many evaluations.
const MAX_STEPS: f64 = 3600.0;
/// With `pcie_counters_start_near_wrap`, counters start this many seconds of
/// traffic below `u64::MAX`.
const WRAP_AFTER_S: f64 = 2.0;

#[derive(Debug)]
pub(crate) struct Snapshot {
    /// Scenario time of the evaluation.
    pub t: f64,
    pub gpus: Vec<GpuNow>,
}

#[derive(Debug)]
pub(crate) struct GpuNow {
    /// The sim's readings, with the MIG layout of `generation` applied.
    pub state: GpuState,
    pub generation: usize,
    /// Cumulative bytes since init (wrapping), the integral of the rates.
    pub pcie_tx_bytes: u64,
    pub pcie_rx_bytes: u64,
}

#[derive(Debug)]
pub(crate) struct Cache {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    latest: Arc<Snapshot>,
    /// Sub-byte remainders of the integrals, `[tx, rx]` per GPU.
    carry: Vec<[f64; 2]>,
}

impl Cache {
    pub(crate) fn new(node: &NodeSpec, layouts: &[GpuLayouts], near_wrap: bool) -> Cache {
        let gpus = evaluate(node, layouts, 0.0)
            .into_iter()
            .map(|(state, generation)| {
                let start = |rate: u64| {
                    if near_wrap {
                        let room = (rate as f64 * WRAP_AFTER_S) as u64;
                        u64::MAX - room
                    } else {
                        0
                    }
                };
                GpuNow {
                    pcie_tx_bytes: start(state.pcie_tx_bytes_per_s),
                    pcie_rx_bytes: start(state.pcie_rx_bytes_per_s),
                    state,
                    generation,
                }
            })
            .collect::<Vec<_>>();
        let carry = vec![[0.0; 2]; gpus.len()];
        Cache {
            inner: Mutex::new(Inner {
                latest: Arc::new(Snapshot { t: 0.0, gpus }),
                carry,
            }),
        }
    }

    /// The state at `t`, re-evaluated only if the cached one is 5 ms old.
    pub(crate) fn at(&self, host: &Host, t: f64) -> Arc<Snapshot> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let gap = t - inner.latest.t;
        if gap >= REFRESH_S {
            let next = advance(&mut inner, &host.node, &host.layouts, t);
            inner.latest = Arc::new(next);
        }
        Arc::clone(&inner.latest)
    }
}

/// Evaluates `t`, integrating the PCIe counters from the previous snapshot
/// with the trapezoid rule (in steps of at most `MAX_STEP_S`).
fn advance(inner: &mut Inner, node: &NodeSpec, layouts: &[GpuLayouts], t: f64) -> Snapshot {
    let previous = Arc::clone(&inner.latest);
    let gap = t - previous.t;
    let steps = (gap / MAX_STEP_S).ceil().clamp(1.0, MAX_STEPS);
    let dt = gap / steps;

    let mut counters: Vec<[u64; 2]> = previous
        .gpus
        .iter()
        .map(|gpu| [gpu.pcie_tx_bytes, gpu.pcie_rx_bytes])
        .collect();
    let mut rates: Vec<[u64; 2]> = previous
        .gpus
        .iter()
        .map(|gpu| rates_of(&gpu.state))
        .collect();

    let mut integrate = |new_rates: Vec<[u64; 2]>, rates: &mut Vec<[u64; 2]>| {
        for (gpu, new) in new_rates.iter().enumerate() {
            for direction in 0..2 {
                let (Some(old), Some(counter), Some(carry)) = (
                    rates.get(gpu).map(|r| r[direction]),
                    counters.get_mut(gpu).map(|c| &mut c[direction]),
                    inner.carry.get_mut(gpu).map(|c| &mut c[direction]),
                ) else {
                    continue;
                };
                let bytes = (old as f64 + new[direction] as f64) / 2.0 * dt + *carry;
                let whole = bytes.floor();
                *carry = bytes - whole;
                *counter = counter.wrapping_add(whole as u64);
            }
        }
        *rates = new_rates;
    };

    // Intermediate points only matter for their rates.
    let intermediate = steps as u64 - 1;
    for step in 1..=intermediate {
        let at = previous.t + dt * step as f64;
        let new_rates = node.state_at(at).iter().map(rates_of).collect();
        integrate(new_rates, &mut rates);
    }
    let states = evaluate(node, layouts, t);
    integrate(
        states.iter().map(|(state, _)| rates_of(state)).collect(),
        &mut rates,
    );

    let gpus = states
        .into_iter()
        .zip(counters)
        .map(|((state, generation), [tx, rx])| GpuNow {
            state,
            generation,
            pcie_tx_bytes: tx,
            pcie_rx_bytes: rx,
        })
        .collect();
    Snapshot { t, gpus }
}

fn rates_of(state: &GpuState) -> [u64; 2] {
    [state.pcie_tx_bytes_per_s, state.pcie_rx_bytes_per_s]
}

/// The sim's readings at `t` with each GPU's MIG layout applied.
fn evaluate(node: &NodeSpec, layouts: &[GpuLayouts], t: f64) -> Vec<(GpuState, usize)> {
    node.state_at(t)
        .into_iter()
        .zip(layouts)
        .map(|(mut state, layouts)| {
            let generation = layouts.generation_at(t);
            if generation > 0 {
                reconfigure(&mut state, layouts.instances(generation));
            }
            (state, generation)
        })
        .collect()
}

/// After a MIG reconfiguration the GPU has the new instances, empty: every
/// process the scenario placed on it (or in its old instances) is gone, and
/// only memory no process accounts for stays in use.
fn reconfigure(state: &mut GpuState, instances: &[MigInstance]) {
    let attributed = state
        .processes
        .iter()
        .map(|p| p.memory_used)
        .chain(state.mig.iter().map(|m| m.memory_used))
        .fold(0, u64::saturating_add);
    state.memory_used = state.memory_used.saturating_sub(attributed);
    state.utilization_pct = 0;
    state.processes.clear();
    state.mig = instances
        .iter()
        .map(|instance| MigState {
            uuid: instance.uuid.clone(),
            memory_used: 0,
            memory_total: instance.memory_total,
            processes: Vec::new(),
        })
        .collect();
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_sim::Scenario;

    const ONE_GPU: &str = r#"
        [[node]]
        name = "n"
        [[node.gpu]]
        model = "NVIDIA H100 80GB HBM3"
        memory_total = "80GiB"
        pcie_tx = "1GB/s"
        pcie_rx = 1000
        [[node.gpu.process]]
        pid = 1
        name = "p"
        memory = { shape = "steady", level = "1GiB" }
    "#;

    fn inner_for(node: &NodeSpec, layouts: &[GpuLayouts], near_wrap: bool) -> Inner {
        Cache::new(node, layouts, near_wrap)
            .inner
            .into_inner()
            .unwrap()
    }

    /// The exact integral of `mean · (1 + 0.3 sin(2πt/60 + φ))` over
    /// [0, t], recovering φ from the rate at 0 and 15 s.
    fn exact_integral(node: &NodeSpec, t: f64) -> f64 {
        let rate = |at: f64| node.state_at(at)[0].pcie_tx_bytes_per_s as f64;
        let mean = 1e9;
        let omega = std::f64::consts::TAU / 60.0;
        let sin_phi = (rate(0.0) / mean - 1.0) / 0.3;
        let cos_phi = (rate(15.0) / mean - 1.0) / 0.3;
        // ∫ sin(ωs + φ) ds = (cos φ − cos(ωt + φ)) / ω
        let cos_end = (omega * t).cos() * cos_phi - (omega * t).sin() * sin_phi;
        mean * t + mean * 0.3 * (cos_phi - cos_end) / omega
    }

    #[test]
    fn counters_integrate_the_rate_over_short_and_long_gaps() {
        let scenario = Scenario::from_toml_str(ONE_GPU).unwrap();
        let node = &scenario.nodes()[0];
        let layouts = crate::layout::build(&node.inventory(), &[]);

        // Many short steps, as a 10 Hz poller makes them.
        let mut inner = inner_for(node, &layouts, false);
        for tick in 1..=900 {
            let next = advance(&mut inner, node, &layouts, f64::from(tick) * 0.1);
            inner.latest = Arc::new(next);
        }
        let polled = inner.latest.gpus[0].pcie_tx_bytes as f64;

        // One call after 90 s of silence.
        let mut inner = inner_for(node, &layouts, false);
        let silent = advance(&mut inner, node, &layouts, 90.0).gpus[0].pcie_tx_bytes as f64;

        let exact = exact_integral(node, 90.0);
        assert!((polled / exact - 1.0).abs() < 1e-3, "{polled} vs {exact}");
        assert!((silent / exact - 1.0).abs() < 1e-3, "{silent} vs {exact}");
    }

    #[test]
    fn near_wrap_counters_wrap_after_about_two_seconds() {
        let scenario = Scenario::from_toml_str(ONE_GPU).unwrap();
        let node = &scenario.nodes()[0];
        let layouts = crate::layout::build(&node.inventory(), &[]);
        let mut inner = inner_for(node, &layouts, true);
        let start = inner.latest.gpus[0].pcie_tx_bytes;
        assert!(start > u64::MAX - 3_000_000_000, "{start}");
        let before = advance(&mut inner, node, &layouts, 1.5);
        assert!(before.gpus[0].pcie_tx_bytes > start);
        inner.latest = Arc::new(before);
        let after = advance(&mut inner, node, &layouts, 3.0);
        assert!(after.gpus[0].pcie_tx_bytes < start, "wrapped");
    }
}
