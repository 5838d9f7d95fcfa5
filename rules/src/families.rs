//! The generator's families: how kinds of jobs use GPU memory, each with
//! the parameters it draws and where the shape comes from. A shape that
//! fooled a rule once gets a family here, with its parameters spread wide,
//! so that the next shape like it is scored too, and so that a rule change
//! is judged on the families it was not tuned on (leave-one-family-out,
//! [`crate::evaluate`]).
//!
//! Sizes are drawn as fractions of the GPU, rates so that the story fits in
//! the trace (a leak stays clear of capacity; an OOM comes after at least
//! 10 minutes of visible growth), and every trace gets its own sample
//! interval (1, 2 or 10 s), noise and, on about a third of them, gaps.

use std::f64::consts::{PI, TAU};

use crate::corpus::Kind;
use crate::generator::{Expect, Memory, ProcessPlan, Rng, Scenario, gaps, gib, interval, mib};

/// A parametric family of traces.
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    /// Where the shape comes from: a framework's documented behaviour, a
    /// peer's issue tracker, or the failure of a rule it was added for.
    pub source: &'static str,
    pub build: fn(&mut Rng) -> Scenario,
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family").field("name", &self.name).finish()
    }
}

/// GPUs as sold (GiB): T4, A10/L4, A100-40, L40S, A100-80/H100, H100 NVL, H200.
const GPU_SIZES_GIB: [f64; 7] = [16.0, 24.0, 40.0, 48.0, 80.0, 94.0, 141.0];
/// MIG slices (GiB): A100 1g.5gb, 2g.10gb/H100 1g.10gb, 3g.20gb/H100 2g.20gb.
const MIG_SIZES_GIB: [f64; 4] = [5.0, 10.0, 10.0, 20.0];

pub static FAMILIES: &[Family] = &[
    // ---- healthy ----
    Family {
        name: "warmup_plateau",
        kind: Kind::None,
        source: "PyTorch's caching allocator reserves during the first iterations, then reuses its blocks (docs: CUDA semantics, memory management)",
        build: warmup_plateau,
    },
    Family {
        name: "eval_loop",
        kind: Kind::None,
        source: "Hugging Face Trainer's eval_strategy: an evaluation pass every N steps allocates its own activations and frees them",
        build: eval_loop,
    },
    Family {
        name: "checkpoint_spikes",
        kind: Kind::None,
        source: "torch.save / FSDP state_dict gathering: a short spike of staging memory at every checkpoint",
        build: checkpoint_spikes,
    },
    Family {
        name: "grad_accumulation",
        kind: Kind::None,
        source: "gradient accumulation and activations: memory climbs over each micro-batch and falls at the optimizer step (PyTorch memory snapshot's sawtooth)",
        build: grad_accumulation,
    },
    Family {
        name: "phase_change",
        kind: Kind::None,
        source: "curriculum or unfreezing: a training phase that changes sequence length or trainable layers moves memory to a new level once",
        build: phase_change,
    },
    Family {
        name: "empty_cache_cycles",
        kind: Kind::None,
        source: "allocator fragmentation: reserved memory creeps up in blocks until torch.cuda.empty_cache() returns it (PyTorch issue tracker, fragmentation threads)",
        build: empty_cache_cycles,
    },
    Family {
        name: "restarted_job",
        kind: Kind::None,
        source: "elastic or preempted jobs (torchrun --max-restarts, Slurm requeue): the same job again under a new pid, warming up again",
        build: restarted_job,
    },
    Family {
        name: "inference_follows_load",
        kind: Kind::None,
        source: "vLLM / TGI KV cache and dynamic batching: memory follows request load up and down with no period",
        build: inference_follows_load,
    },
    Family {
        name: "inference_bursts",
        kind: Kind::None,
        source: "bursty inference traffic: short batches of long prompts lift memory for a minute or two",
        build: inference_bursts,
    },
    Family {
        name: "shared_gpu_healthy",
        kind: Kind::None,
        source: "GPU sharing (HAMi, time-slicing, MPS): 2 to 8 processes with their own healthy shapes on one GPU",
        build: shared_gpu_healthy,
    },
    Family {
        name: "mig_slice_healthy",
        kind: Kind::None,
        source: "MIG slices of 5 to 20 GiB running small training or inference jobs",
        build: mig_slice_healthy,
    },
    Family {
        name: "bounded_rise",
        kind: Kind::None,
        source: "a rise that stops: a cache filling, a larger batch, a dataset shard with longer samples; held-out corpus: a 10-minute rise called a leak after it stopped",
        build: bounded_rise,
    },
    Family {
        name: "ramp_then_swings",
        kind: Kind::None,
        source: "held-out corpus: a 20-minute load ramp followed by swings around a level, called a leak after the ramp",
        build: ramp_then_swings,
    },
    Family {
        name: "saturating_rise",
        kind: Kind::None,
        source: "caches that fill ever slower (JIT kernels, cuDNN autotuning workspaces, a KV cache under steady load): sqrt-, log- and hyperbolic-shaped rises that level off within an hour",
        build: saturating_rise,
    },
    Family {
        name: "near_capacity_flat",
        kind: Kind::None,
        source: "jobs sized to the GPU (vLLM gpu_memory_utilization=0.9, JAX preallocation of 75 %): flat and noisy just below capacity",
        build: near_capacity_flat,
    },
    Family {
        name: "idle_then_job",
        kind: Kind::None,
        source: "a GPU idle for a while, then a job starting on it and warming up",
        build: idle_then_job,
    },
    // ---- leaks ----
    Family {
        name: "leak_linear",
        kind: Kind::Leak,
        source: "tensors kept alive across iterations (a loss summed without .item(), outputs appended to a list): PyTorch forum's most common leak",
        build: leak_linear,
    },
    Family {
        name: "leak_slow",
        kind: Kind::Leak,
        source: "held-out corpus: a 6 MiB/min leak over 4 h never flagged; a server leaking a few MiB a minute dies in days",
        build: leak_slow,
    },
    Family {
        name: "leak_under_swings",
        kind: Kind::Leak,
        source: "held-out corpus: a leak under a large periodic swing, allocations freed every few minutes while the troughs rise",
        build: leak_under_swings,
    },
    Family {
        name: "leak_late_start",
        kind: Kind::Leak,
        source: "a leak that begins hours into a job: a code path reached late (a new eval metric, a logging hook)",
        build: leak_late_start,
    },
    Family {
        name: "leak_after_restart",
        kind: Kind::Leak,
        source: "a job restarted under a new pid that leaks in its new life (requeue after a node failure)",
        build: leak_after_restart,
    },
    Family {
        name: "leak_stepwise",
        kind: Kind::Leak,
        source: "a cache keyed by input shape that never evicts (torch.compile recompiles, cuDNN plans per shape): memory rises a block at a time",
        build: leak_stepwise,
    },
    Family {
        name: "leak_on_shared_gpu",
        kind: Kind::Leak,
        source: "dcgm-exporter #109: which process holds the memory; one of 2 to 8 processes on a shared GPU leaks",
        build: leak_on_shared_gpu,
    },
    Family {
        name: "leak_in_mig_slice",
        kind: Kind::Leak,
        source: "a leaking inference server in a MIG slice of 5 to 20 GiB",
        build: leak_in_mig_slice,
    },
    // ---- OOMs ----
    Family {
        name: "oom_neighbour",
        kind: Kind::Oom,
        source: "held-out corpus: a second process starting and climbing beside a steady one; HAMi PR #2143 'warn before GPU OOM' on shared GPUs",
        build: oom_neighbour,
    },
    Family {
        name: "oom_stepwise",
        kind: Kind::Oom,
        source: "memory that grows a block at a time to OOM: bucketed sequence lengths, growing batch sizes (HF auto_find_batch_size)",
        build: oom_stepwise,
    },
    Family {
        name: "oom_accelerating",
        kind: Kind::Oom,
        source: "growth that speeds up: an attention cache quadratic in sequence length, a runaway retry loop",
        build: oom_accelerating,
    },
    Family {
        name: "oom_after_plateau",
        kind: Kind::Oom,
        source: "a long healthy plateau, then a climb to OOM (a data-dependent path, a leak that bites fast)",
        build: oom_after_plateau,
    },
    Family {
        name: "oom_ramp_from_start",
        kind: Kind::Oom,
        source: "a job that climbs from its start to OOM: a batch too large for the GPU that grows with every step",
        build: oom_ramp_from_start,
    },
    Family {
        name: "oom_decelerating_overshoot",
        kind: Kind::Oom,
        source: "growth that slows towards a level beyond capacity: a KV cache filling under rising load",
        build: oom_decelerating_overshoot,
    },
    Family {
        name: "oom_in_mig_slice",
        kind: Kind::Oom,
        source: "a small MIG slice filled by a growing job",
        build: oom_in_mig_slice,
    },
    Family {
        name: "oom_under_load_swings",
        kind: Kind::Oom,
        source: "a climb to OOM under a neighbour's load that comes and goes",
        build: oom_under_load_swings,
    },
];

// ---- shapes ----

/// Exponential approach from `from` to `to` with time constant `tau_s`.
fn approach(from: f64, to: f64, tau_s: f64) -> impl Fn(f64) -> f64 + Send + Sync + Copy {
    move |t| to - (to - from) * (-t / tau_s.max(1.0)).exp()
}

/// Periodic swing of `amplitude` bytes above zero with `period_s`, shaped
/// as a sawtooth (`saw`) or a raised cosine.
fn swing(
    amplitude: f64,
    period_s: f64,
    saw: bool,
    phase: f64,
) -> impl Fn(f64) -> f64 + Send + Sync + Copy {
    move |t| {
        let x = ((t / period_s) + phase).rem_euclid(1.0);
        if saw {
            amplitude * x
        } else {
            amplitude * (1.0 - (TAU * x).cos()) / 2.0
        }
    }
}

/// Smooth random levels in [0, 1): a new level every `knot_s`, eased.
fn eased_levels(seed: u64, knot_s: f64) -> impl Fn(f64) -> f64 + Send + Sync + Copy {
    move |t| {
        let knot = (t / knot_s).floor();
        let x = t / knot_s - knot;
        let level = |k: f64| Rng::new(seed ^ (k as u64).wrapping_mul(0x9E37_79B9)).unit();
        let (a, b) = (level(knot), level(knot + 1.0));
        a + (b - a) * (1.0 - (x * PI).cos()) / 2.0
    }
}

/// Spikes of `height` for `width_s` every `every_s`, from `first_s` on.
fn spikes(
    height: f64,
    width_s: f64,
    every_s: f64,
    first_s: f64,
) -> impl Fn(f64) -> f64 + Send + Sync + Copy {
    move |t| {
        if t >= first_s && (t - first_s).rem_euclid(every_s) < width_s {
            height
        } else {
            0.0
        }
    }
}

fn context(rng: &mut Rng) -> f64 {
    mib(rng.range(300.0, 600.0))
}

fn noise(rng: &mut Rng, total: f64) -> f64 {
    // Allocator churn: tens of MiB, up to half a percent of a large GPU.
    rng.log_range(mib(8.0), (total * 0.005).max(mib(16.0)))
}

fn process(rng: &mut Rng, start_s: f64, total: f64, memory: Memory) -> ProcessPlan {
    ProcessPlan {
        pid: pid(rng),
        start_s,
        end_s: None,
        memory,
        noise: noise(rng, total),
        context: context(rng),
    }
}

fn pid(rng: &mut Rng) -> u32 {
    rng.int(1000, 4_000_000) as u32
}

fn scenario(
    rng: &mut Rng,
    total: f64,
    minutes: f64,
    processes: Vec<ProcessPlan>,
    expect: Expect,
    description: String,
) -> Scenario {
    let duration_s = minutes * 60.0;
    Scenario {
        total,
        interval_s: interval(rng, minutes > 360.0),
        gaps: gaps(rng, duration_s),
        duration_s,
        processes,
        expect,
        description,
    }
}

fn gpu(rng: &mut Rng) -> f64 {
    gib(rng.pick(&GPU_SIZES_GIB))
}

/// One healthy training-like process on a GPU of `total`, under `top`
/// of it: warm-up, then one of the healthy shapes.
fn healthy_process(rng: &mut Rng, total: f64, top: f64, start_s: f64) -> (ProcessPlan, String) {
    let level = total * rng.range(0.1, top * 0.7);
    let from = level * rng.range(0.05, 0.6);
    let tau = rng.log_range(20.0, 480.0);
    let warm = approach(from, level, tau);
    let room = (total * top - level).max(0.0);
    let seed = rng.next_u64();
    let (memory, what): (Memory, String) = match rng.int(0, 4) {
        0 => (Box::new(warm), "warm-up then flat".into()),
        1 => {
            let s = swing(
                room * rng.range(0.2, 0.9),
                rng.log_range(5.0, 600.0),
                rng.chance(0.5),
                rng.unit(),
            );
            (
                Box::new(move |t| warm(t) + s(t)),
                "warm-up then a sawtooth".into(),
            )
        }
        2 => {
            let e = eased_levels(seed, rng.log_range(60.0, 900.0));
            let amp = room * rng.range(0.3, 0.95);
            (
                Box::new(move |t| warm(t) + amp * e(t)),
                "memory following load".into(),
            )
        }
        3 => {
            let sp = spikes(
                room * rng.range(0.2, 0.9),
                rng.range(20.0, 300.0),
                rng.range(300.0, 3600.0),
                rng.range(120.0, 1800.0),
            );
            (
                Box::new(move |t| warm(t) + sp(t)),
                "spikes every few minutes".into(),
            )
        }
        _ => {
            let amp = room * rng.range(0.1, 0.5);
            let period = rng.log_range(600.0, 3600.0);
            (
                Box::new(move |t| warm(t) + amp * (1.0 - (TAU * t / period).cos()) / 2.0),
                "slow load cycle".into(),
            )
        }
    };
    (process(rng, start_s, total, memory), what)
}

// ---- healthy families ----

fn warmup_plateau(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.15, 0.85);
    let tau = rng.log_range(15.0, 600.0);
    let from = level * rng.range(0.02, 0.5);
    let minutes = rng.range(90.0, 240.0);
    let p = process(rng, 0.0, total, Box::new(approach(from, level, tau)));
    let d = format!(
        "warm-up to {:.0} % (time constant {:.1} min), then flat",
        level / total * 100.0,
        tau / 60.0
    );
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn eval_loop(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.2, 0.7);
    let every = rng.range(600.0, 2400.0);
    let length = rng.range(90.0, 480.0);
    let extra = total * rng.range(0.03, 0.2);
    let ramp = rng.range(10.0, length * 0.6);
    let first = rng.range(300.0, every);
    let warm = approach(level * 0.3, level, rng.log_range(15.0, 300.0));
    let memory = move |t: f64| {
        let phase = (t - first).rem_euclid(every);
        let eval = if t >= first && phase < length {
            extra * (phase / ramp).min(1.0)
        } else {
            0.0
        };
        warm(t) + eval
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let d = format!(
        "training at {:.0} %, an eval pass of +{:.0} % every {:.0} min",
        level / total * 100.0,
        extra / total * 100.0,
        every / 60.0
    );
    let minutes = rng.range(120.0, 300.0);
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn checkpoint_spikes(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.2, 0.75);
    let sp = spikes(
        total * rng.range(0.03, 0.15),
        rng.range(20.0, 120.0),
        rng.range(600.0, 3600.0),
        rng.range(300.0, 1800.0),
    );
    let warm = approach(level * 0.2, level, rng.log_range(15.0, 300.0));
    let p = process(rng, 0.0, total, Box::new(move |t| warm(t) + sp(t)));
    let d = format!(
        "training at {:.0} % with checkpoint spikes",
        level / total * 100.0
    );
    let minutes = rng.range(120.0, 300.0);
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn grad_accumulation(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.15, 0.6);
    let s = swing(
        total * rng.range(0.03, 0.25),
        rng.log_range(4.0, 90.0),
        true,
        rng.unit(),
    );
    let warm = approach(level * 0.3, level, rng.log_range(15.0, 300.0));
    let p = process(rng, 0.0, total, Box::new(move |t| warm(t) + s(t)));
    let d = format!(
        "gradient accumulation sawtooth over {:.0} %",
        level / total * 100.0
    );
    let minutes = rng.range(90.0, 240.0);
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn phase_change(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.2, 0.6);
    let steps: Vec<(f64, f64)> = (0..rng.int(1, 3))
        .map(|_| (rng.range(1200.0, 10_000.0), total * rng.range(-0.12, 0.2)))
        .collect();
    let ramp = rng.range(1.0, 120.0);
    let warm = approach(level * 0.3, level, rng.log_range(15.0, 300.0));
    let memory = move |t: f64| {
        warm(t)
            + steps
                .iter()
                .map(|&(at, by)| by * ((t - at) / ramp).clamp(0.0, 1.0))
                .sum::<f64>()
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let minutes = rng.range(120.0, 240.0);
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Healthy,
        "training phases at different levels".into(),
    )
}

fn empty_cache_cycles(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.2, 0.6);
    let creep = total * rng.range(0.02, 0.15);
    let period = rng.range(240.0, 1500.0);
    let block = rng.log_range(mib(20.0), mib(512.0));
    let warm = approach(level * 0.3, level, rng.log_range(15.0, 300.0));
    let memory = move |t: f64| {
        let x = (t / period).rem_euclid(1.0);
        warm(t) + ((creep * x) / block).floor() * block
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let d = format!(
        "fragmentation creeping {:.0} % then freed by empty_cache every {:.0} min",
        creep / total * 100.0,
        period / 60.0
    );
    let minutes = rng.range(120.0, 240.0);
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn restarted_job(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let minutes = rng.range(150.0, 300.0);
    let restarts = rng.int(1, 3) as usize;
    let mut bounds: Vec<f64> = (0..restarts)
        .map(|_| rng.range(0.15, 0.85) * minutes * 60.0)
        .collect();
    bounds.sort_by(f64::total_cmp);
    bounds.insert(0, 0.0);
    let mut processes = Vec::new();
    for (i, &start) in bounds.iter().enumerate() {
        let delay = if i > 0 { rng.range(10.0, 120.0) } else { 0.0 };
        let (mut p, _) = healthy_process(rng, total, 0.85, start + delay);
        p.end_s = bounds.get(i + 1).copied();
        processes.push(p);
    }
    scenario(
        rng,
        total,
        minutes,
        processes,
        Expect::Healthy,
        format!("a job restarted {restarts} times under new pids"),
    )
}

fn inference_follows_load(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let base = total * rng.range(0.1, 0.45);
    let amp = total * rng.range(0.1, 0.4);
    let levels = eased_levels(rng.next_u64(), rng.log_range(60.0, 1200.0));
    let p = process(rng, 0.0, total, Box::new(move |t| base + amp * levels(t)));
    let d = format!(
        "KV cache following load between {:.0} and {:.0} %",
        base / total * 100.0,
        (base + amp) / total * 100.0
    );
    let minutes = rng.range(120.0, 300.0);
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn inference_bursts(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let base = total * rng.range(0.15, 0.55);
    let minutes = rng.range(120.0, 240.0);
    let bursts: Vec<(f64, f64, f64)> = (0..rng.int(3, 30))
        .map(|_| {
            (
                rng.range(0.0, minutes * 60.0),
                rng.range(20.0, 300.0),
                total * rng.range(0.03, 0.3),
            )
        })
        .collect();
    let memory = move |t: f64| {
        base + bursts
            .iter()
            .filter(|&&(at, len, _)| t >= at && t < at + len)
            .map(|b| b.2)
            .fold(0.0, f64::max)
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Healthy,
        "inference with bursts of long prompts".into(),
    )
}

fn shared_gpu_healthy(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let n = rng.int(2, 8) as usize;
    let share = 0.85 / n as f64;
    let minutes = rng.range(120.0, 240.0);
    let processes = (0..n)
        .map(|_| {
            let start = if rng.chance(0.5) {
                0.0
            } else {
                rng.range(0.0, minutes * 30.0)
            };
            let (p, _) = healthy_process(rng, total * share, 0.95, start);
            p
        })
        .collect();
    scenario(
        rng,
        total,
        minutes,
        processes,
        Expect::Healthy,
        format!("{n} healthy processes sharing the GPU"),
    )
}

fn mig_slice_healthy(rng: &mut Rng) -> Scenario {
    let total = gib(rng.pick(&MIG_SIZES_GIB));
    let (p, what) = healthy_process(rng, total, 0.85, 0.0);
    let minutes = rng.range(120.0, 240.0);
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Healthy,
        format!("MIG slice of {:.0} GiB: {what}", total / gib(1.0)),
    )
}

fn bounded_rise(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.15, 0.5);
    let length = rng.log_range(120.0, 1200.0);
    let rise = total * rng.range(0.02, 0.3);
    let at = rng.range(1200.0, 5400.0);
    let shape = rng.int(0, 2);
    let memory = move |t: f64| {
        let x = ((t - at) / length).clamp(0.0, 1.0);
        let eased = match shape {
            0 => x,
            1 => 1.0 - (1.0 - x) * (1.0 - x),
            _ => (1.0 - (x * PI).cos()) / 2.0,
        };
        level + rise * eased
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let d = format!(
        "a rise of {:.0} % over {:.0} min that stops",
        rise / total * 100.0,
        length / 60.0
    );
    let minutes = rng.range(150.0, 240.0);
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn ramp_then_swings(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let from = total * rng.range(0.05, 0.3);
    let to = total * rng.range(0.35, 0.6);
    // A bounded rise is shorter than the leak rule's shortest window
    // (30 min) by a margin: see docs/rules.md.
    let ramp = rng.range(600.0, 1500.0);
    let start = rng.range(0.0, 1800.0);
    let amp = total * rng.range(0.05, 0.25);
    let s = swing(
        amp,
        rng.log_range(60.0, 1200.0),
        rng.chance(0.5),
        rng.unit(),
    );
    let memory = move |t: f64| {
        let x = ((t - start) / ramp).clamp(0.0, 1.0);
        from + (to - from) * x
            + if t > start + ramp {
                s(t - start - ramp)
            } else {
                0.0
            }
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let d = format!(
        "a {:.0}-minute load ramp, then swings around a level",
        ramp / 60.0
    );
    let minutes = rng.range(120.0, 240.0);
    scenario(rng, total, minutes, vec![p], Expect::Healthy, d)
}

fn saturating_rise(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let from = total * rng.range(0.1, 0.3);
    let rise = total * rng.range(0.1, 0.45);
    let over = rng.range(1200.0, 3600.0);
    let shape = rng.int(0, 2);
    let half = rng.range(120.0, 900.0);
    let memory = move |t: f64| {
        let x = (t / over).min(1.0);
        from + rise
            * match shape {
                0 => x.sqrt(),
                1 => (1.0 + 9.0 * x).ln() / 10f64.ln(),
                _ => t / (t + half) * (over + half) / over,
            }
            .min(1.0)
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let minutes = rng.range(120.0, 240.0);
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Healthy,
        "a rise that levels off ever slower".into(),
    )
}

fn near_capacity_flat(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.82, 0.92);
    let warm = approach(level * 0.3, level, rng.log_range(10.0, 120.0));
    let mut p = process(rng, 0.0, total, Box::new(warm));
    p.noise = total * rng.range(0.001, 0.01);
    let minutes = rng.range(90.0, 240.0);
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Healthy,
        format!("flat at {:.0} %, noisy", level / total * 100.0),
    )
}

fn idle_then_job(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let idle = rng.range(600.0, 3600.0);
    let (p, what) = healthy_process(rng, total, 0.85, idle);
    let minutes = rng.range(120.0, 240.0);
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Healthy,
        format!("idle {:.0} min, then a job: {what}", idle / 60.0),
    )
}

// ---- leak families ----

/// A linear leak of `rate` bytes/min on top of `healthy` from `from_s`.
fn leaking(healthy: Memory, rate: f64, from_s: f64) -> Memory {
    Box::new(move |t| healthy(t) + rate * ((t - from_s).max(0.0) / 60.0))
}

/// Minutes a leak trace runs: past its deadline and its growth in room.
fn leak_minutes(rng: &mut Rng, start_s: f64, rate: f64, at_least: f64) -> f64 {
    let due_min = crate::generator::leak_deadline_ms(0, rate) as f64 / 60_000.0;
    (start_s / 60.0 + due_min + rng.range(15.0, 60.0)).max(at_least)
}

fn leak_linear(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let rate = rng.log_range(mib(10.0), mib(80.0));
    let at_least = rng.range(90.0, 180.0);
    let minutes = leak_minutes(rng, 0.0, rate, at_least);
    let level = total * rng.range(0.1, 0.4);
    let room = total * 0.85 - level;
    let rate = rate.min(room / minutes);
    let warm = approach(level * 0.3, level, rng.log_range(15.0, 300.0));
    let p = process(rng, 0.0, total, leaking(Box::new(warm), rate, 0.0));
    let d = format!("a leak of {:.1} MiB/min from the start", rate / mib(1.0));
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Leak {
            pid: id,
            start_s: 0.0,
            rate,
        },
        d,
    )
}

fn leak_slow(rng: &mut Rng) -> Scenario {
    let total = gib(rng.pick(&[40.0, 48.0, 80.0, 94.0, 141.0]));
    let rate = rng.range(mib(2.0), mib(10.0));
    let at_least = rng.range(360.0, 1440.0);
    let minutes = leak_minutes(rng, 0.0, rate, at_least).min(1500.0);
    let level = total * rng.range(0.1, 0.4);
    let warm = approach(level * 0.3, level, rng.log_range(15.0, 300.0));
    let s = swing(
        total * rng.range(0.0, 0.05),
        rng.log_range(10.0, 300.0),
        true,
        0.0,
    );
    let p = process(
        rng,
        0.0,
        total,
        leaking(Box::new(move |t| warm(t) + s(t)), rate, 0.0),
    );
    let d = format!(
        "a slow leak of {:.1} MiB/min over {:.1} h",
        rate / mib(1.0),
        minutes / 60.0
    );
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Leak {
            pid: id,
            start_s: 0.0,
            rate,
        },
        d,
    )
}

fn leak_under_swings(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let rate = rng.log_range(mib(5.0), mib(40.0));
    let at_least = rng.range(120.0, 240.0);
    let minutes = leak_minutes(rng, 0.0, rate, at_least);
    let level = total * rng.range(0.1, 0.3);
    let amp = total * rng.range(0.1, 0.3);
    let rate = rate.min((total * 0.9 - level - amp) / minutes);
    let s = swing(amp, rng.range(60.0, 600.0), rng.chance(0.5), rng.unit());
    let p = process(
        rng,
        0.0,
        total,
        leaking(Box::new(move |t| level + s(t)), rate, 0.0),
    );
    let d = format!(
        "troughs rising {:.1} MiB/min under swings of {:.0} %",
        rate / mib(1.0),
        amp / total * 100.0
    );
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Leak {
            pid: id,
            start_s: 0.0,
            rate,
        },
        d,
    )
}

fn leak_late_start(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let rate = rng.log_range(mib(5.0), mib(60.0));
    let at = rng.range(3600.0, 4.0 * 3600.0);
    let (p, what) = healthy_process(rng, total, 0.5, 0.0);
    let minutes = leak_minutes(rng, at, rate, 0.0);
    let rate = rate.min(total * 0.3 / (minutes - at / 60.0));
    let id = p.pid;
    let p = ProcessPlan {
        memory: leaking(p.memory, rate, at),
        ..p
    };
    let d = format!(
        "{what}; a leak of {:.1} MiB/min from {:.0} min",
        rate / mib(1.0),
        at / 60.0
    );
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Leak {
            pid: id,
            start_s: at,
            rate,
        },
        d,
    )
}

fn leak_after_restart(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let restart = rng.range(1800.0, 5400.0);
    let (mut first, _) = healthy_process(rng, total, 0.6, 0.0);
    first.end_s = Some(restart);
    let rate = rng.log_range(mib(5.0), mib(50.0));
    let back = restart + rng.range(10.0, 180.0);
    let (second, _) = healthy_process(rng, total, 0.5, back);
    let minutes = leak_minutes(rng, back, rate, 0.0);
    let rate = rate.min(total * 0.3 / (minutes - back / 60.0));
    let id = second.pid;
    let second = ProcessPlan {
        memory: leaking(second.memory, rate, 0.0),
        ..second
    };
    let d = format!(
        "restarted at {:.0} min under a new pid that leaks {:.1} MiB/min",
        restart / 60.0,
        rate / mib(1.0)
    );
    scenario(
        rng,
        total,
        minutes,
        vec![first, second],
        Expect::Leak {
            pid: id,
            start_s: back,
            rate,
        },
        d,
    )
}

fn leak_stepwise(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let every = rng.range(60.0, 600.0);
    let step = rng.log_range(mib(64.0), mib(1024.0));
    let rate = step / (every / 60.0);
    let at_least = rng.range(120.0, 240.0);
    let minutes = leak_minutes(rng, 0.0, rate, at_least);
    let level = total * rng.range(0.1, 0.3);
    let max_steps = ((total * 0.85 - level) / step).floor();
    let memory = move |t: f64| level + step * (t / every).floor().min(max_steps);
    if max_steps * every < minutes * 60.0 {
        // The staircase would stop inside the trace: draw again.
        return leak_stepwise(rng);
    }
    let p = process(rng, 0.0, total, Box::new(memory));
    let d = format!(
        "{:.0} MiB more every {:.1} min",
        step / mib(1.0),
        every / 60.0
    );
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Leak {
            pid: id,
            start_s: 0.0,
            rate,
        },
        d,
    )
}

fn leak_on_shared_gpu(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let n = rng.int(2, 8) as usize;
    let share = 0.7 / n as f64;
    let rate = rng.log_range(mib(5.0), mib(40.0));
    let at_least = rng.range(120.0, 240.0);
    let minutes = leak_minutes(rng, 0.0, rate, at_least);
    let rate = rate.min(total * 0.2 / minutes);
    let mut processes: Vec<ProcessPlan> = (0..n)
        .map(|_| healthy_process(rng, total * share, 0.95, 0.0).0)
        .collect();
    let culprit = rng.int(0, n as u64 - 1) as usize;
    let leaker = processes.remove(culprit);
    let id = leaker.pid;
    processes.push(ProcessPlan {
        memory: leaking(leaker.memory, rate, 0.0),
        ..leaker
    });
    let d = format!("one of {n} processes leaks {:.1} MiB/min", rate / mib(1.0));
    scenario(
        rng,
        total,
        minutes,
        processes,
        Expect::Leak {
            pid: id,
            start_s: 0.0,
            rate,
        },
        d,
    )
}

fn leak_in_mig_slice(rng: &mut Rng) -> Scenario {
    let total = gib(rng.pick(&MIG_SIZES_GIB));
    let rate = rng.log_range(mib(2.0), mib(20.0));
    let at_least = rng.range(120.0, 240.0);
    let minutes = leak_minutes(rng, 0.0, rate, at_least).min(1500.0);
    let level = total * rng.range(0.1, 0.3);
    let rate = rate.min(total * 0.55 / minutes);
    if leak_minutes(rng, 0.0, rate, 0.0) > 1500.0 {
        return leak_in_mig_slice(rng);
    }
    let warm = approach(level * 0.3, level, rng.log_range(15.0, 300.0));
    let mut p = process(rng, 0.0, total, leaking(Box::new(warm), rate, 0.0));
    p.noise = p.noise.min(mib(32.0));
    let minutes = leak_minutes(rng, 0.0, rate, minutes);
    let d = format!(
        "MIG slice of {:.0} GiB, a leak of {:.1} MiB/min",
        total / gib(1.0),
        rate / mib(1.0)
    );
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Leak {
            pid: id,
            start_s: 0.0,
            rate,
        },
        d,
    )
}

// ---- OOM families ----

/// A climb `shape(x)` for x in [0, 1] over `climb_s` from `at` taking
/// `from` to `beyond` (past capacity, so that the GPU fills).
fn climb(from: f64, beyond: f64, at: f64, climb_s: f64, shape: fn(f64) -> f64) -> Memory {
    Box::new(move |t| from + (beyond - from) * shape(((t - at) / climb_s).clamp(0.0, 1.0)))
}

fn linear(x: f64) -> f64 {
    x
}

fn oom_neighbour(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let steady_level = total * rng.range(0.2, 0.6);
    let warm = approach(steady_level * 0.5, steady_level, rng.log_range(15.0, 300.0));
    let steady = process(rng, 0.0, total, Box::new(warm));
    let start = rng.range(1200.0, 3600.0);
    let climb_min = rng.range(12.0, 45.0);
    let room = total - steady_level;
    let climber = process(
        rng,
        start,
        total,
        climb(room * 0.05, room * 1.3, 0.0, climb_min * 60.0 * 1.3, linear),
    );
    let d =
        format!("a second process climbing to OOM in about {climb_min:.0} min beside a steady one");
    let id = climber.pid;
    scenario(
        rng,
        total,
        start / 60.0 + climb_min * 1.3 + 20.0,
        vec![steady, climber],
        Expect::Oom { pid: id },
        d,
    )
}

fn oom_stepwise(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.2, 0.5);
    let at = rng.range(1800.0, 5400.0);
    let every = rng.range(45.0, 420.0);
    let steps = rng.range(4.0, 12.0);
    let step = (total - level) / steps * 1.05;
    let memory = move |t: f64| {
        level
            + if t >= at {
                step * ((t - at) / every).floor()
            } else {
                0.0
            }
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let d = format!(
        "{:.0} % more every {:.1} min to OOM",
        step / total * 100.0,
        every / 60.0
    );
    let minutes = (at + every * (steps + 1.0)) / 60.0 + 20.0;
    let id = p.pid;
    scenario(rng, total, minutes, vec![p], Expect::Oom { pid: id }, d)
}

fn oom_accelerating(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.2, 0.5);
    let at = rng.range(1200.0, 3600.0);
    let climb_s = rng.range(25.0, 80.0) * 60.0;
    let shape: fn(f64) -> f64 = if rng.chance(0.5) {
        |x| x * x
    } else {
        |x| ((3.0 * x).exp() - 1.0) / (3f64.exp() - 1.0)
    };
    let p = process(
        rng,
        0.0,
        total,
        climb(level, total * 1.05, at, climb_s, shape),
    );
    let minutes = (at + climb_s) / 60.0 + 20.0;
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Oom { pid: id },
        "growth that speeds up to OOM".into(),
    )
}

fn oom_after_plateau(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.3, 0.7);
    let at = rng.range(3600.0, 3.0 * 3600.0);
    let climb_s = rng.range(12.0, 60.0) * 60.0;
    let p = process(
        rng,
        0.0,
        total,
        climb(level, total * 1.1, at, climb_s * 1.1, linear),
    );
    let minutes = (at + climb_s * 1.1) / 60.0 + 20.0;
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Oom { pid: id },
        format!("a plateau of {:.0} min, then a climb to OOM", at / 60.0),
    )
}

fn oom_ramp_from_start(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let idle = if rng.chance(0.5) {
        0.0
    } else {
        rng.range(600.0, 2400.0)
    };
    let climb_s = rng.range(20.0, 60.0) * 60.0;
    let from = total * rng.range(0.05, 0.2);
    let p = process(
        rng,
        idle,
        total,
        climb(from, total * 1.1, 0.0, climb_s * 1.1, linear),
    );
    let minutes = (idle + climb_s * 1.1) / 60.0 + 20.0;
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Oom { pid: id },
        "a job climbing from its start to OOM".into(),
    )
}

fn oom_decelerating_overshoot(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let level = total * rng.range(0.2, 0.4);
    let at = rng.range(1200.0, 3600.0);
    let towards = total * rng.range(1.15, 1.6);
    // Reaches the total after 15 to 50 minutes.
    let reach_s = rng.range(15.0, 50.0) * 60.0;
    let tau = reach_s / ((towards - level) / (towards - total)).ln();
    let memory = move |t: f64| {
        if t < at {
            level
        } else {
            towards - (towards - level) * (-(t - at) / tau).exp()
        }
    };
    let p = process(rng, 0.0, total, Box::new(memory));
    let minutes = (at + reach_s) / 60.0 + 20.0;
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Oom { pid: id },
        "growth slowing towards a level beyond capacity".into(),
    )
}

fn oom_in_mig_slice(rng: &mut Rng) -> Scenario {
    let total = gib(rng.pick(&MIG_SIZES_GIB));
    let level = total * rng.range(0.2, 0.5);
    let at = rng.range(1200.0, 3600.0);
    let climb_s = rng.range(12.0, 60.0) * 60.0;
    let mut p = process(
        rng,
        0.0,
        total,
        climb(level, total * 1.1, at, climb_s * 1.1, linear),
    );
    p.noise = p.noise.min(mib(32.0));
    let minutes = (at + climb_s * 1.1) / 60.0 + 20.0;
    let id = p.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![p],
        Expect::Oom { pid: id },
        format!("MIG slice of {:.0} GiB filled by a climb", total / gib(1.0)),
    )
}

fn oom_under_load_swings(rng: &mut Rng) -> Scenario {
    let total = gpu(rng);
    let base = total * rng.range(0.1, 0.25);
    let amp = total * rng.range(0.05, 0.15);
    let levels = eased_levels(rng.next_u64(), rng.log_range(60.0, 600.0));
    let server = process(rng, 0.0, total, Box::new(move |t| base + amp * levels(t)));
    let at = rng.range(1200.0, 3600.0);
    let climb_s = rng.range(15.0, 60.0) * 60.0;
    let trainer = process(
        rng,
        0.0,
        total,
        climb(total * 0.1, total * 1.0, at, climb_s, linear),
    );
    let minutes = (at + climb_s) / 60.0 + 20.0;
    let id = trainer.pid;
    scenario(
        rng,
        total,
        minutes,
        vec![server, trainer],
        Expect::Oom { pid: id },
        "a climb to OOM beside a server following load".into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_every_kind_has_families() {
        let mut names: Vec<_> = FAMILIES.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len());
        assert!(FAMILIES.len() >= 25);
        for kind in [Kind::None, Kind::Leak, Kind::Oom] {
            assert!(
                FAMILIES.iter().filter(|f| f.kind == kind).count() >= 6,
                "{kind:?}"
            );
        }
    }
}
