//! Memory shapes: how much device memory one process holds as a function of
//! the time since it started.

use serde::Deserialize;

use headroom_common::bytes::{ByteSize, HumanBytes};

fn default_restart_after_s() -> f64 {
    120.0
}

/// The `memory = { shape = "…", … }` table of a process. Times are seconds
/// since the process started; byte fields take the byte syntax.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "shape", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum MemoryShape {
    /// `level`, wobbling by up to ±`jitter`.
    Steady {
        level: ByteSize,
        #[serde(default)]
        jitter: ByteSize,
    },
    /// Allocator warm-up: eases out from `start` to `plateau` over
    /// `warmup_s`, then stays there. A healthy job, not a leak.
    WarmupPlateau {
        plateau: ByteSize,
        warmup_s: f64,
        #[serde(default)]
        start: ByteSize,
        #[serde(default)]
        jitter: ByteSize,
    },
    /// `base + rate_per_min · minutes`.
    LinearLeak {
        base: ByteSize,
        rate_per_min: ByteSize,
    },
    /// `base + step · floor(t / every_s)`: a cache that grows in chunks.
    StepLeak {
        base: ByteSize,
        step: ByteSize,
        every_s: f64,
    },
    /// Climbs linearly from `low` to `high` each period, then drops back: an
    /// evaluation loop that frees its buffers at the end of each pass.
    Sawtooth {
        low: ByteSize,
        high: ByteSize,
        period_s: f64,
    },
    /// `base`, but `peak` during `[k·every_s, k·every_s + duration_s)` for
    /// k ≥ 1: checkpointing.
    Spike {
        base: ByteSize,
        peak: ByteSize,
        every_s: f64,
        duration_s: f64,
    },
    /// Grows without bound until the device is full, dies, and restarts from
    /// `start` after `restart_after_s`.
    RampToOom {
        start: ByteSize,
        rate_per_min: ByteSize,
        #[serde(default = "default_restart_after_s")]
        restart_after_s: f64,
    },
}

/// What a process holds at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Footprint {
    pub bytes: u64,
    /// When the current incarnation began, in seconds after the process's
    /// configured start; non-zero only once a process has been restarted.
    pub incarnation_offset_s: f64,
}

impl Footprint {
    fn first_incarnation(bytes: f64) -> Self {
        Self {
            bytes: to_bytes(bytes),
            incarnation_offset_s: 0.0,
        }
    }
}

/// Saturating: negative or NaN intermediate values (only possible through
/// jitter or absurd times) mean "nothing allocated", not a panic.
fn to_bytes(value: f64) -> u64 {
    if value.is_nan() || value <= 0.0 {
        0
    } else {
        value.round() as u64
    }
}

fn ease_out(progress: f64) -> f64 {
    let remaining = 1.0 - progress.clamp(0.0, 1.0);
    1.0 - remaining * remaining
}

impl MemoryShape {
    /// Whether the process's life depends on how full its device is.
    pub(crate) fn is_oom_prone(&self) -> bool {
        matches!(self, Self::RampToOom { .. })
    }

    /// The least the process holds while alive; other OOM-prone processes on
    /// the same device count a neighbour at this level, which keeps each
    /// evaluation independent of evaluation order.
    pub(crate) fn floor_bytes(&self) -> u64 {
        match self {
            Self::Steady { level, jitter } => level.0.saturating_sub(jitter.0),
            Self::WarmupPlateau { start, jitter, .. } => start.0.saturating_sub(jitter.0),
            Self::LinearLeak { base, .. }
            | Self::StepLeak { base, .. }
            | Self::Spike { base, .. } => base.0,
            Self::Sawtooth { low, .. } => low.0,
            Self::RampToOom { start, .. } => start.0,
        }
    }

    /// The level the process is configured to reach without leaking; it must
    /// fit on its device, or the scenario is contradictory.
    pub(crate) fn static_peak(&self) -> (&'static str, u64) {
        match self {
            Self::Steady { level, jitter } => ("level + jitter", level.0.saturating_add(jitter.0)),
            Self::WarmupPlateau {
                plateau, jitter, ..
            } => ("plateau + jitter", plateau.0.saturating_add(jitter.0)),
            Self::LinearLeak { base, .. } | Self::StepLeak { base, .. } => ("base", base.0),
            Self::Sawtooth { high, .. } => ("high", high.0),
            Self::Spike { peak, .. } => ("peak", peak.0),
            Self::RampToOom { start, .. } => ("start", start.0),
        }
    }

    /// Problems with the shape's own fields, each naming the field.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut positive = |field: &str, value: f64| {
            if !(value.is_finite() && value > 0.0) {
                problems.push(format!(
                    "memory.{field} must be a finite number > 0, got {value}"
                ));
            }
        };
        match self {
            Self::Steady { .. } | Self::LinearLeak { .. } => {}
            Self::WarmupPlateau { warmup_s, .. } => positive("warmup_s", *warmup_s),
            Self::StepLeak { every_s, .. } => positive("every_s", *every_s),
            Self::Sawtooth { period_s, .. } => positive("period_s", *period_s),
            Self::Spike {
                every_s,
                duration_s,
                ..
            } => {
                positive("every_s", *every_s);
                positive("duration_s", *duration_s);
            }
            Self::RampToOom {
                restart_after_s, ..
            } => {
                if !(restart_after_s.is_finite() && *restart_after_s >= 0.0) {
                    problems.push(format!(
                        "memory.restart_after_s must be a finite number >= 0, got {restart_after_s}"
                    ));
                }
            }
        }
        match self {
            Self::WarmupPlateau { plateau, start, .. } if plateau < start => problems.push(format!(
                "memory.plateau ({}) must not be below memory.start ({})",
                HumanBytes(plateau.0),
                HumanBytes(start.0)
            )),
            Self::Sawtooth { low, high, .. } if low > high => problems.push(format!(
                "memory.low ({}) must not be above memory.high ({})",
                HumanBytes(low.0),
                HumanBytes(high.0)
            )),
            Self::Spike { base, peak, .. } if peak < base => problems.push(format!(
                "memory.peak ({}) must not be below memory.base ({})",
                HumanBytes(peak.0),
                HumanBytes(base.0)
            )),
            Self::Spike {
                every_s,
                duration_s,
                ..
            } if duration_s >= every_s => problems.push(format!(
                "memory.duration_s ({duration_s}) must be shorter than memory.every_s ({every_s}), \
                 or the spike never ends"
            )),
            Self::RampToOom { rate_per_min, .. } if rate_per_min.0 == 0 => problems.push(
                "memory.rate_per_min must be > 0 for ramp_to_oom (use shape = \"steady\" for a flat line)"
                    .to_owned(),
            ),
            _ => {}
        }
        problems
    }

    /// The footprint `elapsed_s` seconds after the process started, or `None`
    /// while it is dead after an OOM.
    ///
    /// `noise` in `[-1, 1)` scales the jitter of shapes that have one.
    /// `room` is the memory left on the device for this process by everything
    /// else; only `ramp_to_oom` looks at it.
    pub(crate) fn sample(&self, elapsed_s: f64, noise: f64, room: u64) -> Option<Footprint> {
        let t = elapsed_s.max(0.0);
        let bytes = match self {
            Self::Steady { level, jitter } => level.0 as f64 + jitter.0 as f64 * noise,
            Self::WarmupPlateau {
                plateau,
                warmup_s,
                start,
                jitter,
            } => {
                let rise = (plateau.0 as f64 - start.0 as f64) * ease_out(t / warmup_s);
                start.0 as f64 + rise + jitter.0 as f64 * noise
            }
            Self::LinearLeak { base, rate_per_min } => {
                base.0 as f64 + rate_per_min.0 as f64 * t / 60.0
            }
            Self::StepLeak {
                base,
                step,
                every_s,
            } => {
                // Integer arithmetic keeps step counts exact for large t.
                let steps = (t / every_s).floor() as u64;
                return Some(Footprint {
                    bytes: base.0.saturating_add(step.0.saturating_mul(steps)),
                    incarnation_offset_s: 0.0,
                });
            }
            Self::Sawtooth {
                low,
                high,
                period_s,
            } => {
                let phase = t.rem_euclid(*period_s) / period_s;
                low.0 as f64 + (high.0 as f64 - low.0 as f64) * phase
            }
            Self::Spike {
                base,
                peak,
                every_s,
                duration_s,
            } => {
                let cycle = (t / every_s).floor();
                let in_spike = cycle >= 1.0 && t - cycle * every_s < *duration_s;
                return Some(Footprint {
                    bytes: if in_spike { peak.0 } else { base.0 },
                    incarnation_offset_s: 0.0,
                });
            }
            Self::RampToOom {
                start,
                rate_per_min,
                restart_after_s,
            } => return ramp_to_oom(t, start.0, rate_per_min.0, *restart_after_s, room),
        };
        Some(Footprint::first_incarnation(bytes))
    }
}

/// Closed form of grow → OOM → wait → restart: the process lives for the
/// time it takes to grow from `start` to `room`, then is gone for
/// `restart_after_s`, and the cycle repeats.
fn ramp_to_oom(
    t: f64,
    start: u64,
    rate_per_min: u64,
    restart_after_s: f64,
    room: u64,
) -> Option<Footprint> {
    if start >= room || rate_per_min == 0 {
        // It cannot even allocate its starting footprint: every incarnation
        // dies at once, so it is never seen alive.
        return None;
    }
    let rate_per_s = rate_per_min as f64 / 60.0;
    let lifetime_s = (room - start) as f64 / rate_per_s;
    let cycle_s = lifetime_s + restart_after_s;
    let incarnation = (t / cycle_s).floor();
    let incarnation_offset_s = incarnation * cycle_s;
    let age_s = t - incarnation_offset_s;
    if age_s >= lifetime_s {
        return None;
    }
    Some(Footprint {
        bytes: to_bytes(start as f64 + rate_per_s * age_s).min(room),
        incarnation_offset_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn parse(memory: &str) -> MemoryShape {
        #[derive(Deserialize)]
        struct Holder {
            memory: MemoryShape,
        }
        toml::from_str::<Holder>(&format!("memory = {memory}"))
            .unwrap()
            .memory
    }

    fn bytes_at(shape: &MemoryShape, t: f64) -> u64 {
        shape.sample(t, 0.0, u64::MAX).unwrap().bytes
    }

    #[test]
    fn steady_is_flat_and_jitter_is_bounded() {
        let shape = parse(r#"{ shape = "steady", level = "10GiB" }"#);
        assert_eq!(bytes_at(&shape, 0.0), 10 * GIB);
        assert_eq!(bytes_at(&shape, 12_345.6), 10 * GIB);

        let shape = parse(r#"{ shape = "steady", level = "10GiB", jitter = "1GiB" }"#);
        assert_eq!(shape.sample(5.0, 1.0, u64::MAX).unwrap().bytes, 11 * GIB);
        assert_eq!(shape.sample(5.0, -1.0, u64::MAX).unwrap().bytes, 9 * GIB);
        assert_eq!(
            shape.sample(5.0, 0.5, u64::MAX).unwrap().bytes,
            10 * GIB + GIB / 2
        );
    }

    #[test]
    fn warmup_eases_out_to_the_plateau() {
        let shape = parse(
            r#"{ shape = "warmup_plateau", start = "10GiB", plateau = "50GiB", warmup_s = 100 }"#,
        );
        assert_eq!(bytes_at(&shape, 0.0), 10 * GIB);
        // Half-way through warm-up the ease-out curve is at 1 - 0.5² = 75 %.
        assert_eq!(bytes_at(&shape, 50.0), 40 * GIB);
        assert_eq!(bytes_at(&shape, 100.0), 50 * GIB);
        assert_eq!(bytes_at(&shape, 5_000.0), 50 * GIB);
    }

    #[test]
    fn linear_leak_grows_by_rate_per_minute() {
        let shape = parse(r#"{ shape = "linear_leak", base = "10GiB", rate_per_min = "64MiB" }"#);
        assert_eq!(bytes_at(&shape, 0.0), 10 * GIB);
        assert_eq!(bytes_at(&shape, 60.0), 10 * GIB + 64 * MIB);
        assert_eq!(bytes_at(&shape, 30.0), 10 * GIB + 32 * MIB);
        assert_eq!(bytes_at(&shape, 3600.0), 10 * GIB + 60 * 64 * MIB);
    }

    #[test]
    fn step_leak_grows_in_whole_steps() {
        let shape =
            parse(r#"{ shape = "step_leak", base = "30GiB", step = "1GiB", every_s = 600 }"#);
        assert_eq!(bytes_at(&shape, 0.0), 30 * GIB);
        assert_eq!(bytes_at(&shape, 599.9), 30 * GIB);
        assert_eq!(bytes_at(&shape, 600.0), 31 * GIB);
        assert_eq!(bytes_at(&shape, 1_900.0), 33 * GIB);
    }

    #[test]
    fn sawtooth_climbs_and_drops_each_period() {
        let shape =
            parse(r#"{ shape = "sawtooth", low = "12GiB", high = "36GiB", period_s = 300 }"#);
        assert_eq!(bytes_at(&shape, 0.0), 12 * GIB);
        assert_eq!(bytes_at(&shape, 150.0), 24 * GIB);
        assert_eq!(bytes_at(&shape, 225.0), 30 * GIB);
        assert_eq!(
            bytes_at(&shape, 300.0),
            12 * GIB,
            "drops back at the period"
        );
        assert_eq!(bytes_at(&shape, 450.0), 24 * GIB);
    }

    #[test]
    fn spike_peaks_only_inside_later_windows() {
        let shape = parse(
            r#"{ shape = "spike", base = "40GiB", peak = "64GiB", every_s = 900, duration_s = 45 }"#,
        );
        assert_eq!(bytes_at(&shape, 0.0), 40 * GIB, "no spike at k = 0");
        assert_eq!(bytes_at(&shape, 10.0), 40 * GIB);
        assert_eq!(bytes_at(&shape, 899.0), 40 * GIB);
        assert_eq!(bytes_at(&shape, 900.0), 64 * GIB);
        assert_eq!(bytes_at(&shape, 944.9), 64 * GIB);
        assert_eq!(bytes_at(&shape, 945.0), 40 * GIB);
        assert_eq!(bytes_at(&shape, 1_810.0), 64 * GIB);
    }

    #[test]
    fn ramp_to_oom_dies_at_the_cap_and_restarts() {
        let shape = parse(
            r#"{ shape = "ramp_to_oom", start = "60GiB", rate_per_min = "4GiB", restart_after_s = 60 }"#,
        );
        let room = 80 * GIB;
        // 20 GiB of headroom at 4 GiB/min: alive for 300 s, dead for 60 s.
        let at = |t: f64| shape.sample(t, 0.0, room);
        assert_eq!(at(0.0).unwrap().bytes, 60 * GIB);
        assert_eq!(at(150.0).unwrap().bytes, 70 * GIB);
        assert_eq!(at(299.0).unwrap().incarnation_offset_s, 0.0);
        assert_eq!(at(300.0), None);
        assert_eq!(at(359.0), None);
        let reborn = at(360.0).unwrap();
        assert_eq!(reborn.bytes, 60 * GIB);
        assert_eq!(reborn.incarnation_offset_s, 360.0);
        assert_eq!(at(375.0).unwrap().bytes, 61 * GIB);
        assert_eq!(at(725.0).unwrap().incarnation_offset_s, 720.0);
    }

    #[test]
    fn ramp_to_oom_that_cannot_start_is_never_alive() {
        let shape = parse(r#"{ shape = "ramp_to_oom", start = "60GiB", rate_per_min = "4GiB" }"#);
        assert_eq!(shape.sample(0.0, 0.0, 60 * GIB), None);
        assert_eq!(shape.sample(1_000.0, 0.0, 10 * GIB), None);
    }

    #[test]
    fn defaults_apply() {
        assert_eq!(
            parse(r#"{ shape = "ramp_to_oom", start = 1, rate_per_min = 1 }"#),
            MemoryShape::RampToOom {
                start: ByteSize(1),
                rate_per_min: ByteSize(1),
                restart_after_s: 120.0
            }
        );
        assert_eq!(
            parse(r#"{ shape = "warmup_plateau", plateau = 5, warmup_s = 1 }"#),
            MemoryShape::WarmupPlateau {
                plateau: ByteSize(5),
                warmup_s: 1.0,
                start: ByteSize(0),
                jitter: ByteSize(0)
            }
        );
    }

    #[test]
    fn unknown_shapes_and_fields_are_rejected() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Holder {
            memory: MemoryShape,
        }
        let err = toml::from_str::<Holder>(r#"memory = { shape = "wobble", level = 1 }"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("wobble") && err.contains("steady"), "{err}");
        let err =
            toml::from_str::<Holder>(r#"memory = { shape = "steady", level = 1, levle = 2 }"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("levle"), "{err}");
    }

    #[test]
    fn field_problems_name_the_field() {
        let cases = [
            (
                r#"{ shape = "step_leak", base = 1, step = 1, every_s = 0 }"#,
                "memory.every_s",
            ),
            (
                r#"{ shape = "sawtooth", low = 5, high = 1, period_s = 1 }"#,
                "memory.low",
            ),
            (
                r#"{ shape = "sawtooth", low = 1, high = 5, period_s = -1 }"#,
                "memory.period_s",
            ),
            (
                r#"{ shape = "warmup_plateau", start = 5, plateau = 1, warmup_s = 1 }"#,
                "memory.plateau",
            ),
            (
                r#"{ shape = "warmup_plateau", plateau = 1, warmup_s = 0 }"#,
                "memory.warmup_s",
            ),
            (
                r#"{ shape = "spike", base = 1, peak = 2, every_s = 10, duration_s = 10 }"#,
                "memory.duration_s",
            ),
            (
                r#"{ shape = "spike", base = 3, peak = 2, every_s = 10, duration_s = 1 }"#,
                "memory.peak",
            ),
            (
                r#"{ shape = "ramp_to_oom", start = 1, rate_per_min = 0 }"#,
                "memory.rate_per_min",
            ),
            (
                r#"{ shape = "ramp_to_oom", start = 1, rate_per_min = 1, restart_after_s = -1 }"#,
                "memory.restart_after_s",
            ),
        ];
        for (memory, field) in cases {
            let problems = parse(memory).problems();
            assert!(
                problems.iter().any(|p| p.contains(field)),
                "{memory}: {problems:?} should mention {field}"
            );
        }
        assert!(
            parse(r#"{ shape = "linear_leak", base = 1, rate_per_min = 0 }"#)
                .problems()
                .is_empty()
        );
    }
}
