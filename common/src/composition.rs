//! Where a training process's memory on one device goes: weights,
//! gradients and optimizer state as its client counts them, activations and
//! temporaries as the rest of the allocator's peak, the allocator's cache,
//! and what the driver sees beyond the allocator (CUDA context, other
//! libraries). The agent, the collector's checks, the rules' remedies and
//! the API all split memory with this one definition.

use serde::Serialize;

/// The element type holding most of a part's bytes. Finer names than these
/// change no advice, so the wire's dtype names fold into them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Float64,
    Float32,
    Bfloat16,
    Float16,
    Float8,
    Integer,
    Other,
}

impl Dtype {
    /// PyTorch's dtype name (`float32`, `bfloat16`, `float8_e4m3fn`, …),
    /// with or without its `torch.` prefix, or this type's own name.
    pub fn from_name(name: &str) -> Self {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        match name {
            "float64" | "double" => Self::Float64,
            "float32" | "float" => Self::Float32,
            "bfloat16" => Self::Bfloat16,
            "float16" | "half" => Self::Float16,
            n if n.starts_with("float8") => Self::Float8,
            "integer" | "bool" => Self::Integer,
            n if n.starts_with("int") || n.starts_with("uint") => Self::Integer,
            _ => Self::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Float64 => "float64",
            Self::Float32 => "float32",
            Self::Bfloat16 => "bfloat16",
            Self::Float16 => "float16",
            Self::Float8 => "float8",
            Self::Integer => "integer",
            Self::Other => "other",
        }
    }

    /// Four or more bytes per element: what bf16 training halves.
    pub fn is_full_precision(self) -> bool {
        matches!(self, Self::Float32 | Self::Float64)
    }
}

/// One of the parts a client counts: resident bytes on the device and the
/// dtype that holds most of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Part {
    pub bytes: u64,
    pub dtype: Dtype,
}

impl Part {
    /// Sums `(dtype name, bytes)` pairs; the dtype is the one with most bytes
    /// after folding names into [`Dtype`]. `None` for no pairs at all is the
    /// caller's business: an empty part is zero bytes, known.
    pub fn from_dtype_bytes<'a>(pairs: impl IntoIterator<Item = (&'a str, u64)>) -> Self {
        let mut by_dtype: Vec<(Dtype, u64)> = Vec::new();
        for (name, bytes) in pairs {
            let dtype = Dtype::from_name(name);
            match by_dtype.iter_mut().find(|(d, _)| *d == dtype) {
                Some((_, sum)) => *sum = sum.saturating_add(bytes),
                None => by_dtype.push((dtype, bytes)),
            }
        }
        let bytes = by_dtype.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b));
        let dtype = by_dtype
            .iter()
            .max_by_key(|(_, b)| *b)
            .map_or(Dtype::Float32, |(d, _)| *d);
        Self { bytes, dtype }
    }
}

/// What a client counted in its own tensors on one device. A part is `None`
/// when the client was not given what it needs to count it (no model, no
/// optimizer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Composition {
    pub weights: Option<Part>,
    pub gradients: Option<Part>,
    pub optimizer_state: Option<Part>,
}

/// Why a composition does not fit the allocator report it came with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompositionError {
    #[error("{part} = {bytes} bytes exceeds the allocator's peak of live tensors ({peak} bytes)")]
    PartOverPeak {
        part: &'static str,
        bytes: u64,
        peak: u64,
    },
    #[error(
        "weights, gradients and optimizer state add up to {sum} bytes, more than the allocator's peak of live tensors ({peak} bytes)"
    )]
    SumOverPeak { sum: u64, peak: u64 },
}

impl Composition {
    pub fn is_empty(&self) -> bool {
        self.weights.is_none() && self.gradients.is_none() && self.optimizer_state.is_none()
    }

    fn parts(&self) -> [(&'static str, Option<Part>); 3] {
        [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer_state", self.optimizer_state),
        ]
    }

    /// Keeps what fits the allocator's own figures: every part counted here
    /// is a live tensor, so no part, and not their sum, can exceed the most
    /// the allocator ever had in live tensors. A part that does is dropped
    /// (and named in the returned problems); when the rest still add up to
    /// too much, none of them can be told apart from the wrong one and all
    /// go. The allocator's own counters are untouched either way.
    pub fn checked(self, peak_tensors: u64) -> (Self, Vec<CompositionError>) {
        let mut problems = Vec::new();
        let mut kept = self;
        for (slot, (part, value)) in [
            &mut kept.weights,
            &mut kept.gradients,
            &mut kept.optimizer_state,
        ]
        .into_iter()
        .zip(self.parts())
        {
            if let Some(p) = value
                && p.bytes > peak_tensors
            {
                problems.push(CompositionError::PartOverPeak {
                    part,
                    bytes: p.bytes,
                    peak: peak_tensors,
                });
                *slot = None;
            }
        }
        let sum = kept.counted();
        if sum > peak_tensors {
            problems.push(CompositionError::SumOverPeak {
                sum,
                peak: peak_tensors,
            });
            kept = Self::default();
        }
        (kept, problems)
    }

    /// Bytes of the parts that were counted.
    pub fn counted(&self) -> u64 {
        self.parts()
            .iter()
            .filter_map(|(_, p)| p.map(|p| p.bytes))
            .fold(0u64, u64::saturating_add)
    }

    /// Whether every part was counted, so that the rest of the peak is
    /// activations and temporaries and nothing else.
    pub fn is_complete(&self) -> bool {
        self.parts().iter().all(|(_, p)| p.is_some())
    }
}

/// The figures of one allocator report that the split needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorFigures {
    pub allocated: u64,
    pub reserved: u64,
    pub peak_allocated: u64,
}

impl AllocatorFigures {
    /// The most the allocator ever had in live tensors: its peak, or what it
    /// has now where a reset peak reads lower.
    pub fn peak_tensors(&self) -> u64 {
        self.peak_allocated.max(self.allocated)
    }
}

/// One share of a process's memory at its peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Share {
    Weights,
    Gradients,
    OptimizerState,
    Activations,
    Cache,
    OutsideAllocator,
}

impl Share {
    pub fn label(self) -> &'static str {
        match self {
            Self::Weights => "weights",
            Self::Gradients => "gradients",
            Self::OptimizerState => "optimizer state",
            Self::Activations => "activations and temporaries",
            Self::Cache => "the allocator's cache",
            Self::OutsideAllocator => "memory outside the allocator",
        }
    }
}

/// A process's memory on one device at its peak, in shares that add up to
/// `total`: the counted parts, activations and temporaries (the rest of the
/// peak of live tensors), the cache the allocator holds beyond that peak,
/// and what the driver reports beyond the allocator's reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    pub weights_bytes: Option<u64>,
    pub weights_dtype: Option<Dtype>,
    pub gradients_bytes: Option<u64>,
    pub gradients_dtype: Option<Dtype>,
    pub optimizer_state_bytes: Option<u64>,
    pub optimizer_state_dtype: Option<Dtype>,
    /// The peak of live tensors less the counted parts. When a part was not
    /// counted (`complete` is false) it is in here too.
    pub activations_bytes: u64,
    pub complete: bool,
    pub cache_bytes: u64,
    /// CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, other
    /// libraries; zero when the driver's figure is unknown.
    pub outside_allocator_bytes: u64,
    pub total_bytes: u64,
    /// What [`Breakdown::largest`] picks, for readers of the API who choose
    /// nothing themselves.
    pub largest_share: Option<Share>,
}

impl Breakdown {
    /// `driver_used` is what NVML reports the process holds on the device.
    pub fn of(c: &Composition, a: AllocatorFigures, driver_used: Option<u64>) -> Self {
        let peak = a.peak_tensors();
        let activations = peak.saturating_sub(c.counted());
        let cache = a.reserved.saturating_sub(peak);
        let outside = driver_used.map_or(0, |u| u.saturating_sub(a.reserved.max(peak)));
        // An empty part (no gradients yet) has no dtype worth naming.
        let dtype = |p: Option<Part>| p.filter(|p| p.bytes > 0).map(|p| p.dtype);
        let mut b = Self {
            weights_bytes: c.weights.map(|p| p.bytes),
            weights_dtype: dtype(c.weights),
            gradients_bytes: c.gradients.map(|p| p.bytes),
            gradients_dtype: dtype(c.gradients),
            optimizer_state_bytes: c.optimizer_state.map(|p| p.bytes),
            optimizer_state_dtype: dtype(c.optimizer_state),
            activations_bytes: activations,
            complete: c.is_complete(),
            cache_bytes: cache,
            outside_allocator_bytes: outside,
            total_bytes: c
                .counted()
                .saturating_add(activations)
                .saturating_add(cache)
                .saturating_add(outside),
            largest_share: None,
        };
        b.largest_share = b.largest().map(|(share, _, _)| share);
        b
    }

    /// Adds another process's breakdown, as a job sums its ranks. A part
    /// counted by only some of them stays counted; the sum is complete only
    /// when every rank's was.
    pub fn add(&mut self, other: &Self) {
        fn sum(a: Option<u64>, b: Option<u64>) -> Option<u64> {
            match (a, b) {
                (None, None) => None,
                (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
            }
        }
        fn dtype(
            a: Option<u64>,
            da: Option<Dtype>,
            b: Option<u64>,
            db: Option<Dtype>,
        ) -> Option<Dtype> {
            if b.unwrap_or(0) > a.unwrap_or(0) {
                db.or(da)
            } else {
                da.or(db)
            }
        }
        self.weights_dtype = dtype(
            self.weights_bytes,
            self.weights_dtype,
            other.weights_bytes,
            other.weights_dtype,
        );
        self.gradients_dtype = dtype(
            self.gradients_bytes,
            self.gradients_dtype,
            other.gradients_bytes,
            other.gradients_dtype,
        );
        self.optimizer_state_dtype = dtype(
            self.optimizer_state_bytes,
            self.optimizer_state_dtype,
            other.optimizer_state_bytes,
            other.optimizer_state_dtype,
        );
        self.weights_bytes = sum(self.weights_bytes, other.weights_bytes);
        self.gradients_bytes = sum(self.gradients_bytes, other.gradients_bytes);
        self.optimizer_state_bytes = sum(self.optimizer_state_bytes, other.optimizer_state_bytes);
        self.activations_bytes = self
            .activations_bytes
            .saturating_add(other.activations_bytes);
        self.complete &= other.complete;
        self.cache_bytes = self.cache_bytes.saturating_add(other.cache_bytes);
        self.outside_allocator_bytes = self
            .outside_allocator_bytes
            .saturating_add(other.outside_allocator_bytes);
        self.total_bytes = self.total_bytes.saturating_add(other.total_bytes);
        self.largest_share = self.largest().map(|(share, _, _)| share);
    }

    /// The shares a remedy can be chosen from, with their bytes: the
    /// activations only when every other part was counted (otherwise the
    /// rest of the peak may be an uncounted part).
    pub fn shares(&self) -> Vec<(Share, u64)> {
        let mut shares = Vec::with_capacity(6);
        for (share, bytes) in [
            (Share::Weights, self.weights_bytes),
            (Share::Gradients, self.gradients_bytes),
            (Share::OptimizerState, self.optimizer_state_bytes),
            (
                Share::Activations,
                self.complete.then_some(self.activations_bytes),
            ),
            (Share::Cache, Some(self.cache_bytes)),
            (Share::OutsideAllocator, Some(self.outside_allocator_bytes)),
        ] {
            if let Some(bytes) = bytes {
                shares.push((share, bytes));
            }
        }
        shares
    }

    /// The largest share and its fraction of the total; `None` when nothing
    /// was counted or the total is zero. Ties go to the share listed first,
    /// so the choice is stable from one report to the next.
    pub fn largest(&self) -> Option<(Share, u64, f64)> {
        if self.total_bytes == 0 {
            return None;
        }
        let mut best: Option<(Share, u64)> = None;
        for (share, bytes) in self.shares() {
            if best.is_none_or(|(_, b)| bytes > b) {
                best = Some((share, bytes));
            }
        }
        best.filter(|(_, b)| *b > 0)
            .map(|(s, b)| (s, b, b as f64 / self.total_bytes as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn part(bytes: u64, dtype: Dtype) -> Option<Part> {
        Some(Part { bytes, dtype })
    }

    fn adam_fp32() -> Composition {
        Composition {
            weights: part(7 * GIB, Dtype::Float32),
            gradients: part(7 * GIB, Dtype::Float32),
            optimizer_state: part(14 * GIB, Dtype::Float32),
        }
    }

    fn figures(allocated: u64, reserved: u64, peak: u64) -> AllocatorFigures {
        AllocatorFigures {
            allocated,
            reserved,
            peak_allocated: peak,
        }
    }

    #[test]
    fn the_shares_add_up_to_what_the_driver_sees() {
        let b = Breakdown::of(
            &adam_fp32(),
            figures(30 * GIB, 50 * GIB, 40 * GIB),
            Some(52 * GIB),
        );
        assert_eq!(b.activations_bytes, 12 * GIB, "40 at peak less 28 counted");
        assert_eq!(b.cache_bytes, 10 * GIB, "50 reserved less the peak of 40");
        assert_eq!(b.outside_allocator_bytes, 2 * GIB, "CUDA context and co");
        assert_eq!(b.total_bytes, 52 * GIB);
        assert!(b.complete);
        let (share, bytes, fraction) = b.largest().unwrap();
        assert_eq!((share, bytes), (Share::OptimizerState, 14 * GIB));
        assert!((fraction - 14.0 / 52.0).abs() < 1e-9);
    }

    #[test]
    fn an_uncounted_part_is_never_called_activations() {
        let c = Composition {
            optimizer_state: None,
            ..adam_fp32()
        };
        let b = Breakdown::of(&c, figures(30 * GIB, 40 * GIB, 40 * GIB), None);
        assert!(!b.complete);
        assert_eq!(
            b.activations_bytes,
            26 * GIB,
            "holds the optimizer state too"
        );
        assert!(
            b.shares().iter().all(|(s, _)| *s != Share::Activations),
            "the rest of the peak may be the optimizer: no activations remedy"
        );
        assert_eq!(b.largest().unwrap().0, Share::Weights);
    }

    #[test]
    fn an_empty_part_is_zero_bytes_of_no_dtype() {
        let c = Composition {
            gradients: part(0, Dtype::Float32),
            ..adam_fp32()
        };
        let b = Breakdown::of(&c, figures(30 * GIB, 40 * GIB, 40 * GIB), None);
        assert_eq!((b.gradients_bytes, b.gradients_dtype), (Some(0), None));
        assert!(b.complete, "counted, and zero");
    }

    #[test]
    fn parts_that_cannot_be_live_tensors_are_dropped_and_named() {
        let c = Composition {
            weights: part(50 * GIB, Dtype::Float32),
            ..adam_fp32()
        };
        let (kept, problems) = c.checked(40 * GIB);
        assert_eq!(kept.weights, None);
        assert_eq!(kept.gradients, adam_fp32().gradients, "the rest is kept");
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0]
                .to_string()
                .contains("weights = 53687091200 bytes")
        );

        let (kept, problems) = adam_fp32().checked(20 * GIB);
        assert!(kept.is_empty(), "28 GiB of parts cannot fit a 20 GiB peak");
        assert!(problems[0].to_string().contains("add up to"));
        assert_eq!(adam_fp32().checked(28 * GIB), (adam_fp32(), vec![]));
    }

    #[test]
    fn dtype_names_fold_and_the_biggest_names_the_part() {
        let p = Part::from_dtype_bytes([("float32", 10), ("bfloat16", 30), ("torch.float16", 5)]);
        assert_eq!(
            p,
            Part {
                bytes: 45,
                dtype: Dtype::Bfloat16
            }
        );
        assert_eq!(Dtype::from_name("float8_e4m3fn"), Dtype::Float8);
        assert_eq!(Dtype::from_name("uint8"), Dtype::Integer);
        assert_eq!(Dtype::from_name("complex64"), Dtype::Other);
        assert_eq!(Dtype::from_name(Dtype::Bfloat16.as_str()), Dtype::Bfloat16);
        assert!(Dtype::Float32.is_full_precision() && !Dtype::Bfloat16.is_full_precision());
    }

    #[test]
    fn a_job_sums_its_ranks() {
        let one = Breakdown::of(&adam_fp32(), figures(30 * GIB, 50 * GIB, 40 * GIB), None);
        let mut job = one;
        job.add(&one);
        assert_eq!(job.optimizer_state_bytes, Some(28 * GIB));
        assert_eq!(job.largest_share, Some(Share::OptimizerState));
        assert_eq!(job.total_bytes, 2 * one.total_bytes);
        assert!(job.complete);
        let partial = Breakdown::of(
            &Composition {
                optimizer_state: None,
                ..adam_fp32()
            },
            figures(30 * GIB, 50 * GIB, 40 * GIB),
            None,
        );
        job.add(&partial);
        assert!(!job.complete);
        assert_eq!(job.optimizer_state_bytes, Some(28 * GIB));
    }
}
