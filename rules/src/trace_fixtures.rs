//! Synthetic memory traces: shared by the rule tests and the labelled corpus.

pub const MIB: f64 = 1024.0 * 1024.0;
pub const GIB: f64 = 1024.0 * MIB;

/// Deterministic uniform jitter in `[-amplitude, amplitude]` (splitmix64 of
/// seed and time), so a noisy trace is the same on every run.
pub fn jitter(seed: u64, t_s: i64, amplitude: f64) -> f64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(t_s as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let unit = (z >> 11) as f64 / (1u64 << 53) as f64;
    (unit * 2.0 - 1.0) * amplitude
}

/// A trace value as a byte count.
pub fn bytes(v: f64) -> u64 {
    v.max(0.0).round() as u64
}
