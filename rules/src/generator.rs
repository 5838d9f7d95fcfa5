//! The scenario generator: labelled traces drawn from parametric families
//! ([`crate::families`]) instead of a hand-written list, so that the rules
//! are judged on shapes nobody tuned them on. A family describes how a kind
//! of job uses a GPU (its processes, their memory over time, the noise, the
//! sample interval, the gaps); every trace draws its own parameters from a
//! seeded generator, and its label comes from rendering it: an OOM is when
//! the rendered GPU reaches its total, not when a formula said it would.
//!
//! The random numbers are SplitMix64 written out here rather than a crate's
//! generator, because a corpus must be the same on every build: `rand`
//! documents that its `StdRng` may change between versions.

use std::fmt::Write as _;

use crate::backtest::HEADER;
use crate::corpus::{Kind, Label, LabelledTrace};
use crate::families::{FAMILIES, Family};
use crate::trace_fixtures::{GIB, MIB};

/// Traces start here (2023-11-14, off any minute boundary).
pub(crate) const START_MS: i64 = 1_700_000_000_123;
const NODE: &str = "gen-node";
const GPU: &str = "0";
/// What the driver shows in use with no process on the GPU.
const DRIVER_IDLE: f64 = 16.0 * MIB;

/// A seeded, reproducible stream of random numbers.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Log-uniform in [lo, hi): rates and periods spread over decades.
    pub fn log_range(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + (hi.ln() - lo.ln()) * self.unit()).exp()
    }

    /// An integer in [lo, hi].
    pub fn int(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[(self.next_u64() % items.len() as u64) as usize]
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.unit().max(f64::MIN_POSITIVE);
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// Memory a process holds, in bytes, at a time in seconds since it started.
pub type Memory = Box<dyn Fn(f64) -> f64 + Send + Sync>;

/// One process of a scenario.
pub struct ProcessPlan {
    pub pid: u32,
    /// Seconds from the trace's start.
    pub start_s: f64,
    /// When it exits of its own accord (a restart, the end of a job).
    pub end_s: Option<f64>,
    pub memory: Memory,
    /// Uniform noise either way, bytes, on every sample.
    pub noise: f64,
    /// The CUDA context and what else the driver charges it beyond `memory`.
    pub context: f64,
}

impl std::fmt::Debug for ProcessPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessPlan")
            .field("pid", &self.pid)
            .field("start_s", &self.start_s)
            .field("end_s", &self.end_s)
            .field("noise", &self.noise)
            .field("context", &self.context)
            .finish_non_exhaustive()
    }
}

/// What the rules should say about the scenario, before rendering settles
/// the OOM's time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Expect {
    Healthy,
    /// `pid` leaks from `start_s` at `rate` bytes a minute.
    Leak {
        pid: u32,
        start_s: f64,
        rate: f64,
    },
    /// `pid` drives the GPU to run out of memory.
    Oom {
        pid: u32,
    },
}

/// One trace as a family draws it, before rendering.
#[derive(Debug)]
pub struct Scenario {
    pub total: f64,
    pub duration_s: f64,
    pub interval_s: f64,
    /// Stretches `[from, to)` in seconds with no rows (agent or link down).
    pub gaps: Vec<(f64, f64)>,
    pub processes: Vec<ProcessPlan>,
    pub expect: Expect,
    pub description: String,
}

/// A leak is to be reported before it has taken this much memory…
pub const LEAK_REPORT_BY_BYTES: f64 = 1024.0 * MIB;
/// …and is never required sooner than this after it starts (the shortest
/// window of sustained growth, its process's warm-up and a few minutes).
pub const LEAK_REPORT_NO_SOONER_MS: i64 = 45 * 60_000;
/// An OOM warning shorter than this leaves no time to act.
pub const OOM_MIN_LEAD_MS: i64 = 5 * 60_000;

/// When a leak of `rate` bytes a minute, started at `start_ms`, must have
/// been reported: before it has taken [`LEAK_REPORT_BY_BYTES`], and no sooner
/// than [`LEAK_REPORT_NO_SOONER_MS`] after it started. Memory that swings
/// over the leak can put it later: see [`visible_leak_deadline_s`].
pub fn leak_deadline_ms(start_ms: i64, rate_per_min: f64) -> i64 {
    let by_size = (LEAK_REPORT_BY_BYTES / rate_per_min.max(1.0) * 60_000.0) as i64;
    start_ms + by_size.max(LEAK_REPORT_NO_SOONER_MS)
}

/// The leak's rise must stand this many times clear of how far the
/// process's own floor moves, at the scale it is judged on.
pub const LEAK_VISIBLE_OVER_FLOOR: f64 = 3.0;
/// The floor is judged in this many stretches of the elapsed time.
const FLOOR_STRETCHES: usize = 10;
/// A process's first minutes, which the leak rule ignores (warm-up).
const WARM_UP_S: f64 = 600.0;

/// When a leak must have been reported, in seconds from the trace's start:
/// by [`leak_deadline_ms`], and no sooner than its rise is visible, which is
/// a matter of information, not of any rule. A leak under memory that swings
/// (load, a sawtooth, a slow cycle) shows only on the floor the swings come
/// back to; until the rise over a stretch of `T` stands
/// [`LEAK_VISIBLE_OVER_FLOOR`] times clear of how far the process's floor
/// moves without the leak, measured as the spread of the minima of ten
/// stretches of `T / 10`, no method can tell it from the swings. So a leak
/// under a swing of period `P` is due once `T / 10` spans a period or so,
/// and one under random load later still. `None` when that is never within
/// `limit_s`.
pub fn visible_leak_deadline_s(
    process: &ProcessPlan,
    leak_start_s: f64,
    rate_per_min: f64,
    limit_s: f64,
) -> Option<f64> {
    let rate_s = rate_per_min / 60.0;
    let by_size = (leak_deadline_ms(0, rate_per_min) as f64 / 1000.0) + leak_start_s;
    // The memory without the leak, on a 10-s grid in trace time.
    let healthy =
        |t: f64| (process.memory)(t - process.start_s) - rate_s * (t - leak_start_s).max(0.0);
    let judged_from = leak_start_s.max(process.start_s + WARM_UP_S);
    let mut due = by_size;
    while due <= limit_s {
        let stretch = (due - judged_from) / FLOOR_STRETCHES as f64;
        if stretch <= 0.0 {
            return None;
        }
        let step = (stretch / 30.0).clamp(1.0, 10.0);
        let (mut low, mut high) = (f64::MAX, f64::MIN);
        for k in 0..FLOOR_STRETCHES {
            let from = judged_from + k as f64 * stretch;
            let mut least = f64::MAX;
            let mut t = from;
            while t < from + stretch {
                least = least.min(healthy(t));
                t += step;
            }
            low = low.min(least);
            high = high.max(least);
        }
        if rate_s * (due - leak_start_s) >= LEAK_VISIBLE_OVER_FLOOR * (high - low) {
            return Some(due);
        }
        due += 300.0;
    }
    None
}

/// A generated trace and the family it came from.
#[derive(Debug, Clone)]
pub struct GeneratedTrace {
    pub family: &'static str,
    pub trace: LabelledTrace,
    /// Hours of GPU time it covers.
    pub gpu_hours: f64,
}

/// Why a drawn scenario was thrown away and drawn again.
#[derive(Debug, PartialEq)]
enum Rejected {
    /// A healthy or leak scenario whose processes filled the GPU.
    UnplannedOom,
    /// An OOM scenario that never ran out, or ran out too early to warn.
    NoOom,
    /// A leak that would not be visible within the longest trace.
    NoLeak,
}

/// The longest trace drawn: a day and an hour.
const LONGEST_TRACE_S: f64 = 25.0 * 3600.0;

/// The trace number `index` of `family`, the same on every run for the same
/// `seed`. A draw that misses its family's intent (an OOM in a healthy
/// scenario, none in an OOM one) is drawn again from the next sub-seed.
pub fn generate_one(family: &Family, index: u64, seed: u64) -> GeneratedTrace {
    let base = seed
        ^ family_hash(family.name).wrapping_mul(0x2545_F491_4F6C_DD1D)
        ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for attempt in 0..64u64 {
        let mut rng = Rng::new(base.wrapping_add(attempt.wrapping_mul(0xD1B5_4A32_D192_ED03)));
        let scenario = (family.build)(&mut rng);
        let name = format!("{}_{index:03}", family.name);
        if let Ok((trace, duration_s)) = render(&name, &scenario, &mut rng) {
            return GeneratedTrace {
                family: family.name,
                gpu_hours: duration_s / 3600.0,
                trace,
            };
        }
    }
    // Families are written to hit their intent on almost every draw; one
    // that cannot is a bug in the family, found by the generator's tests.
    panic!("family {} missed its intent on 64 draws", family.name)
}

/// `per_family` traces of every family.
pub fn generate(per_family: u64, seed: u64) -> Vec<GeneratedTrace> {
    FAMILIES
        .iter()
        .flat_map(|f| (0..per_family).map(move |i| generate_one(f, i, seed)))
        .collect()
}

fn family_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    })
}

/// Renders the scenario's rows; the GPU runs out of memory at the first
/// sample where its processes would hold more than its total, and the
/// process at fault dies of it there. Returns the trace and how long it
/// runs, in seconds (a leak's runs past the leak's due time).
fn render(name: &str, s: &Scenario, rng: &mut Rng) -> Result<(LabelledTrace, f64), Rejected> {
    let total = s.total.round() as u64;
    // A leak's trace runs until a while after its leak is due.
    let (leak_due_s, duration_s) = match s.expect {
        Expect::Leak { pid, start_s, rate } => {
            let process = s
                .processes
                .iter()
                .find(|p| p.pid == pid)
                .ok_or(Rejected::NoLeak)?;
            let due = visible_leak_deadline_s(process, start_s, rate, LONGEST_TRACE_S)
                .ok_or(Rejected::NoLeak)?;
            (
                Some(due),
                s.duration_s.max(due + 900.0).min(LONGEST_TRACE_S),
            )
        }
        _ => (None, s.duration_s),
    };
    let mut csv = String::with_capacity((duration_s / s.interval_s) as usize * 80);
    csv.push_str(HEADER);
    csv.push('\n');
    let mut dead: Vec<u32> = Vec::new();
    let mut oom_at_ms = None;
    let steps = (duration_s / s.interval_s).floor() as u64;
    let mut held = Vec::with_capacity(s.processes.len());
    for step in 0..=steps {
        let t = step as f64 * s.interval_s;
        // Jitter the sample clock a little, as agents' timers do.
        let ts = START_MS + (t * 1000.0) as i64 + (rng.unit() * 40.0) as i64;
        held.clear();
        for p in &s.processes {
            let alive =
                t >= p.start_s && p.end_s.is_none_or(|end| t < end) && !dead.contains(&p.pid);
            if alive {
                let noise = if p.noise > 0.0 {
                    rng.range(-p.noise, p.noise)
                } else {
                    0.0
                };
                let bytes = ((p.memory)(t - p.start_s) + noise).max(0.0);
                held.push((p.pid, bytes, p.context));
            }
        }
        let mut used: f64 = DRIVER_IDLE + held.iter().map(|(_, b, c)| b + c).sum::<f64>();
        if used >= s.total {
            let culprit = match s.expect {
                Expect::Oom { pid } if oom_at_ms.is_none() => pid,
                _ => return Err(Rejected::UnplannedOom),
            };
            // The allocation that fails is the culprit's: it holds what
            // was left and dies; the GPU shows full for this sample.
            oom_at_ms = Some(ts);
            dead.push(culprit);
            let others: f64 = DRIVER_IDLE
                + held
                    .iter()
                    .filter(|(pid, _, _)| *pid != culprit)
                    .map(|(_, b, c)| b + c)
                    .sum::<f64>();
            for entry in &mut held {
                if entry.0 == culprit {
                    entry.1 = (s.total - others - entry.2).max(0.0);
                }
            }
            used = s.total;
        }
        let in_gap = s.gaps.iter().any(|&(from, to)| t >= from && t < to);
        if in_gap {
            continue;
        }
        let used = (used.round() as u64).min(total);
        let _ = writeln!(csv, "{ts},{NODE},{GPU},,{used},{total}");
        for (pid, bytes, context) in &held {
            let _ = writeln!(
                csv,
                "{ts},{NODE},{GPU},{pid},{},{total}",
                (bytes + context).round() as u64
            );
        }
    }
    let label = match s.expect {
        Expect::Healthy => Label {
            kind: Kind::None,
            leak_found_by_ms: None,
            oom_at_ms: None,
            min_lead_ms: None,
            pid: None,
            description: s.description.clone(),
        },
        Expect::Leak { pid, .. } => Label {
            kind: Kind::Leak,
            leak_found_by_ms: leak_due_s.map(|due| START_MS + (due * 1000.0) as i64),
            oom_at_ms: None,
            min_lead_ms: None,
            pid: Some(pid),
            description: s.description.clone(),
        },
        Expect::Oom { pid } => {
            let at = oom_at_ms.ok_or(Rejected::NoOom)?;
            // An OOM the trace shows no run-up to is no test of a forecast.
            if at - START_MS < 20 * 60_000 {
                return Err(Rejected::NoOom);
            }
            Label {
                kind: Kind::Oom,
                leak_found_by_ms: None,
                oom_at_ms: Some(at),
                min_lead_ms: Some(OOM_MIN_LEAD_MS),
                pid: Some(pid),
                description: s.description.clone(),
            }
        }
    };
    Ok((
        LabelledTrace {
            name: name.to_owned(),
            label,
            csv,
        },
        duration_s,
    ))
}

/// Helpers the families draw with: sizes as fractions of the GPU.
pub(crate) fn gib(v: f64) -> f64 {
    v * GIB
}

pub(crate) fn mib(v: f64) -> f64 {
    v * MIB
}

/// A sample interval the agent may be set to: mostly 1 s, as shipped.
pub(crate) fn interval(rng: &mut Rng, long_trace: bool) -> f64 {
    if long_trace {
        rng.pick(&[2.0, 10.0, 10.0])
    } else {
        rng.pick(&[1.0, 1.0, 2.0, 10.0])
    }
}

/// A few stretches without rows, on about a third of the traces.
pub(crate) fn gaps(rng: &mut Rng, duration_s: f64) -> Vec<(f64, f64)> {
    if !rng.chance(0.3) {
        return Vec::new();
    }
    (0..rng.int(1, 3))
        .map(|_| {
            let from = rng.range(0.1, 0.9) * duration_s;
            (from, from + rng.range(60.0, 600.0))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backtest::parse_row;

    #[test]
    fn the_same_seed_draws_the_same_trace_and_another_seed_another() {
        let family = &FAMILIES[0];
        let a = generate_one(family, 3, 7);
        let b = generate_one(family, 3, 7);
        let c = generate_one(family, 3, 8);
        assert_eq!(a.trace, b.trace);
        assert_ne!(a.trace.csv, c.trace.csv);
    }

    #[test]
    fn every_family_renders_valid_rows_and_a_label_that_fits_it() {
        for family in FAMILIES {
            let g = generate_one(family, 0, 1);
            g.trace
                .label
                .check()
                .unwrap_or_else(|e| panic!("{}: {e}", family.name));
            assert_eq!(g.trace.label.kind, family.kind, "{}", family.name);
            let mut last = 0;
            for line in g.trace.csv.lines().skip(1) {
                let row = parse_row(line).unwrap_or_else(|e| panic!("{}: {e}", family.name));
                assert!(row.ts >= last, "{}: time goes back", family.name);
                last = row.ts;
            }
            if let Some(pid) = g.trace.label.pid {
                assert!(
                    g.trace.csv.contains(&format!(",{pid},")),
                    "{}: the process at fault has rows",
                    family.name
                );
            }
        }
    }

    #[test]
    fn an_oom_is_where_the_rendered_gpu_fills() {
        let family = FAMILIES
            .iter()
            .find(|f| f.kind == Kind::Oom)
            .expect("an OOM family");
        let g = generate_one(family, 0, 1);
        let at = g.trace.label.oom_at_ms.expect("an OOM time");
        let full = g.trace.csv.lines().skip(1).find_map(|line| {
            let row = parse_row(line).ok()?;
            (row.pid.is_none() && row.used == row.total).then_some(row.ts)
        });
        assert_eq!(full, Some(at));
    }

    #[test]
    fn a_leak_is_due_sooner_the_faster_it_grows() {
        let slow = leak_deadline_ms(0, mib(2.0));
        let fast = leak_deadline_ms(0, mib(8.0));
        assert_eq!(slow, 512 * 60_000);
        assert_eq!(fast, 128 * 60_000);
        assert_eq!(leak_deadline_ms(0, mib(100.0)), LEAK_REPORT_NO_SOONER_MS);
    }

    fn plan(memory: Memory) -> ProcessPlan {
        ProcessPlan {
            pid: 1,
            start_s: 0.0,
            end_s: None,
            memory,
            noise: 0.0,
            context: 0.0,
        }
    }

    #[test]
    fn a_leak_under_swings_is_due_once_its_floor_can_show_it() {
        let rate = mib(40.0);
        let leak = move |t: f64| rate * t / 60.0;
        let plain = plan(Box::new(move |t| gib(10.0) + leak(t)));
        let plain_due = visible_leak_deadline_s(&plain, 0.0, rate, 86_400.0).expect("visible");
        assert_eq!(
            plain_due,
            45.0 * 60.0,
            "a plain leak is due by the size rule"
        );
        // A 4 GiB sawtooth of 20 minutes: the floor shows the leak only once
        // its stretches span most of a period, hours later.
        let swinging = plan(Box::new(move |t| {
            gib(10.0) + gib(4.0) * (t / 1200.0).rem_euclid(1.0) + leak(t)
        }));
        let due = visible_leak_deadline_s(&swinging, 0.0, rate, 86_400.0).expect("visible");
        assert!(
            (100.0 * 60.0..=260.0 * 60.0).contains(&due),
            "due at {} min",
            due / 60.0
        );
        // Random load moving 60 GiB every two hours hides 2 MiB/min all day.
        let load = plan(Box::new(move |t| {
            gib(10.0) + gib(60.0) * Rng::new((t / 7200.0) as u64).unit() + mib(2.0) * t / 60.0
        }));
        assert_eq!(
            visible_leak_deadline_s(&load, 0.0, mib(2.0), 86_400.0),
            None
        );
    }
}
