//! How one column of a chunk (store/src/chunk_format.rs), a series'
//! integers in time order, becomes bytes and back, in either format.
//!
//! Format 1 wrote each column one way, fixed per column: zigzag varints of
//! the deltas (or of the spread around the last value), divided by their
//! common divisor. zstd then had to find the entropy in all columns at once,
//! with one literal table for all of them: a noisy PCIe column's random bytes
//! set the table, and every small value elsewhere paid for them.
//!
//! Format 2 lets each column choose, by the bytes it would take, how many
//! times to take differences (none for a noisy rate, once for memory, twice
//! for timestamps), and whether to write the result as varints (values that
//! are mostly small and now and then large: a steady series with a step) or
//! bit-packed at the width of their range (values spread evenly over a
//! range: a random PCIe rate costs its 24 bits, not four varint bytes).

use crate::chunk_format::ChunkError;

/// The layout of a chunk's columns; its number is the chunk's first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ColumnFormat {
    V1 = 1,
    V2 = 2,
}

/// Format 2's mode byte: the order of differences in the low bits, then
/// whether the values after the first `order` are bit-packed.
const ORDER_MASK: u8 = 0b11;
const PACKED: u8 = 0b100;
const MAX_ORDER: u8 = 2;

/// Writes a chunk's columns in `format`. Only tests write format 1, to show
/// that chunks written before format 2 still read.
pub(crate) struct ColumnWriter {
    pub format: ColumnFormat,
    pub out: Vec<u8>,
}

impl ColumnWriter {
    /// A column whose values move by steps: memory, counts, timestamps.
    pub(crate) fn deltas(&mut self, values: impl Iterator<Item = i64>) {
        match self.format {
            ColumnFormat::V1 => v1_put_deltas(&mut self.out, values),
            ColumnFormat::V2 => put_column(&mut self.out, &values.collect::<Vec<_>>()),
        }
    }

    /// A column whose values are small on their own: the spread of min and
    /// max around the last value.
    pub(crate) fn scaled(&mut self, values: impl Iterator<Item = i64>) {
        match self.format {
            ColumnFormat::V1 => v1_put_scaled(&mut self.out, values),
            ColumnFormat::V2 => put_column(&mut self.out, &values.collect::<Vec<_>>()),
        }
    }

    /// A column some samples lack: which have it, then their values.
    pub(crate) fn optional(&mut self, values: impl Iterator<Item = Option<i64>>) {
        let values: Vec<Option<i64>> = values.collect();
        match self.format {
            ColumnFormat::V1 => {
                for v in &values {
                    put_varint(&mut self.out, u64::from(v.is_some()));
                }
            }
            ColumnFormat::V2 => {
                let present: Vec<i64> = values.iter().map(|v| i64::from(v.is_some())).collect();
                put_column(&mut self.out, &present);
            }
        }
        self.deltas(values.into_iter().flatten());
    }

    /// Timestamps: format 1 wrote their deltas of deltas as varints ahead
    /// of every other column.
    pub(crate) fn timestamps(&mut self, values: impl Iterator<Item = i64>) {
        match self.format {
            ColumnFormat::V1 => {
                let (mut prev_ts, mut prev_step) = (0i64, 0i64);
                for ts in values {
                    let step = ts.wrapping_sub(prev_ts);
                    put_signed(&mut self.out, step.wrapping_sub(prev_step));
                    (prev_ts, prev_step) = (ts, step);
                }
            }
            ColumnFormat::V2 => put_column(&mut self.out, &values.collect::<Vec<_>>()),
        }
    }
}

/// Reads a chunk's columns in the format it was written in.
pub(crate) struct Reader<'a> {
    pub format: ColumnFormat,
    pub bytes: &'a [u8],
}

impl Reader<'_> {
    pub(crate) fn varint(&mut self, column: &'static str) -> Result<u64, ChunkError> {
        let mut v = 0u64;
        for (i, &b) in self.bytes.iter().enumerate().take(10) {
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                self.bytes = &self.bytes[i + 1..];
                return Ok(v);
            }
        }
        Err(ChunkError::Truncated(column))
    }

    fn signed(&mut self, column: &'static str) -> Result<i64, ChunkError> {
        self.varint(column).map(unzigzag)
    }

    fn byte(&mut self, column: &'static str) -> Result<u8, ChunkError> {
        let (&b, rest) = self
            .bytes
            .split_first()
            .ok_or(ChunkError::Truncated(column))?;
        self.bytes = rest;
        Ok(b)
    }

    pub(crate) fn timestamps(
        &mut self,
        column: &'static str,
        n: usize,
    ) -> Result<Vec<i64>, ChunkError> {
        match self.format {
            ColumnFormat::V1 => {
                let (mut ts, mut step) = (0i64, 0i64);
                (0..n)
                    .map(|_| {
                        step = step.wrapping_add(self.signed(column)?);
                        ts = ts.wrapping_add(step);
                        Ok(ts)
                    })
                    .collect()
            }
            ColumnFormat::V2 => self.column(column, n),
        }
    }

    pub(crate) fn deltas(
        &mut self,
        column: &'static str,
        n: usize,
    ) -> Result<Vec<i64>, ChunkError> {
        match self.format {
            ColumnFormat::V1 => {
                let mut values = self.v1_scaled(column, n)?;
                undo_delta(&mut values);
                Ok(values)
            }
            ColumnFormat::V2 => self.column(column, n),
        }
    }

    pub(crate) fn scaled(
        &mut self,
        column: &'static str,
        n: usize,
    ) -> Result<Vec<i64>, ChunkError> {
        match self.format {
            ColumnFormat::V1 => self.v1_scaled(column, n),
            ColumnFormat::V2 => self.column(column, n),
        }
    }

    pub(crate) fn optional(
        &mut self,
        column: &'static str,
        n: usize,
    ) -> Result<Vec<Option<i64>>, ChunkError> {
        let flags = match self.format {
            ColumnFormat::V1 => (0..n)
                .map(|_| self.varint(column).map(|v| v as i64))
                .collect::<Result<Vec<i64>, _>>()?,
            ColumnFormat::V2 => self.column(column, n)?,
        };
        let present = flags
            .into_iter()
            .map(|flag| match flag {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(ChunkError::OutOfRange(column)),
            })
            .collect::<Result<Vec<bool>, _>>()?;
        let mut values = self
            .deltas(column, present.iter().filter(|p| **p).count())?
            .into_iter();
        Ok(present
            .into_iter()
            .map(|p| if p { values.next() } else { None })
            .collect())
    }

    fn v1_scaled(&mut self, column: &'static str, n: usize) -> Result<Vec<i64>, ChunkError> {
        // Wrapping: the encoder's quotient times its divisor is the value
        // exactly, so the product is right modulo 2^64 whatever it wraps.
        let divisor = self.varint(column)? as i64;
        (0..n)
            .map(|_| Ok(self.signed(column)?.wrapping_mul(divisor)))
            .collect()
    }

    /// A format-2 column of `n` values.
    fn column(&mut self, column: &'static str, n: usize) -> Result<Vec<i64>, ChunkError> {
        let mode = self.byte(column)?;
        let order = mode & ORDER_MASK;
        if order > MAX_ORDER || mode & !(ORDER_MASK | PACKED) != 0 {
            return Err(ChunkError::OutOfRange(column));
        }
        let heads = n.min(usize::from(order));
        let mut values = Vec::with_capacity(n);
        for _ in 0..heads {
            values.push(self.signed(column)?);
        }
        let tail = n - heads;
        if tail > 0 {
            let divisor = self.varint(column)? as i64;
            if mode & PACKED != 0 {
                let min = self.signed(column)?;
                let width = u32::from(self.byte(column)?);
                if width > 64 {
                    return Err(ChunkError::OutOfRange(column));
                }
                let bytes = (tail as u64 * u64::from(width)).div_ceil(8);
                if bytes > self.bytes.len() as u64 {
                    return Err(ChunkError::Truncated(column));
                }
                let (packed, rest) = self.bytes.split_at(bytes as usize);
                self.bytes = rest;
                let mut bits = BitReader::new(packed);
                for _ in 0..tail {
                    let offset = bits.take(width) as i64;
                    values.push(min.wrapping_add(offset).wrapping_mul(divisor));
                }
            } else {
                for _ in 0..tail {
                    values.push(self.signed(column)?.wrapping_mul(divisor));
                }
            }
        }
        for _ in 0..order {
            undo_delta(&mut values);
        }
        Ok(values)
    }
}

/// One way of writing a column: `heads` (the first `order` values of the
/// differences, which carry the series' level) as varints, then the rest
/// over their common divisor, as varints or bit-packed.
struct Candidate {
    order: u8,
    heads: Vec<i64>,
    divisor: u64,
    quotients: Vec<i64>,
    /// The smallest quotient and the bits every offset from it fits in.
    packing: Option<(i64, u32)>,
    bytes: u64,
}

impl Candidate {
    fn new(values: &[i64], order: u8) -> Self {
        let mut diffs = values.to_vec();
        for _ in 0..order {
            take_delta(&mut diffs);
        }
        let heads_len = diffs.len().min(usize::from(order));
        let quotients_of = diffs.split_off(heads_len);
        let heads = diffs;
        let mut divisor = 0u64;
        for v in &quotients_of {
            divisor = gcd(divisor, v.unsigned_abs());
            if divisor == 1 {
                break;
            }
        }
        let divisor = divisor.max(1);
        // Exact, and within i64: |v / divisor| ≤ |v|.
        let quotients: Vec<i64> = match i64::try_from(divisor) {
            Ok(1) => quotients_of,
            Ok(d) => quotients_of.iter().map(|&v| v / d).collect(),
            // 2^63: every value is 0 or i64::MIN.
            Err(_) => quotients_of
                .iter()
                .map(|&v| (i128::from(v) / i128::from(divisor)) as i64)
                .collect(),
        };
        let head_bytes: u64 = heads.iter().map(|&h| signed_len(h)).sum();
        let fixed = 1
            + head_bytes
            + if quotients.is_empty() {
                0
            } else {
                varint_len(divisor)
            };
        let as_varints: u64 = quotients.iter().map(|&q| signed_len(q)).sum();
        let (min, max) = quotients
            .iter()
            .fold((i64::MAX, i64::MIN), |(lo, hi), &q| (lo.min(q), hi.max(q)));
        let mut candidate = Candidate {
            order,
            heads,
            divisor,
            packing: None,
            bytes: fixed + as_varints,
            quotients,
        };
        if !candidate.quotients.is_empty() {
            let width = 64 - (max.wrapping_sub(min) as u64).leading_zeros();
            let packed = signed_len(min)
                + 1
                + (candidate.quotients.len() as u64 * u64::from(width)).div_ceil(8);
            // Ties go to varints: zstd finds more in whole bytes.
            if packed < as_varints {
                candidate.packing = Some((min, width));
                candidate.bytes = fixed + packed;
            }
        }
        candidate
    }

    fn write(&self, out: &mut Vec<u8>) {
        let packed_flag = if self.packing.is_some() { PACKED } else { 0 };
        out.push(self.order | packed_flag);
        for &h in &self.heads {
            put_signed(out, h);
        }
        if self.quotients.is_empty() {
            return;
        }
        put_varint(out, self.divisor);
        match self.packing {
            Some((min, width)) => {
                put_signed(out, min);
                out.push(width as u8);
                let mut bits = BitWriter::new(out);
                for &q in &self.quotients {
                    bits.put(q.wrapping_sub(min) as u64, width);
                }
                bits.finish();
            }
            None => {
                for &q in &self.quotients {
                    put_signed(out, q);
                }
            }
        }
    }
}

/// Writes `values` as a format-2 column, in whichever of its ways takes
/// the fewest bytes before zstd.
fn put_column(out: &mut Vec<u8>, values: &[i64]) {
    let best = (0..=MAX_ORDER)
        .map(|order| Candidate::new(values, order))
        .min_by_key(|c| c.bytes);
    if let Some(best) = best {
        best.write(out);
    }
}

fn take_delta(values: &mut [i64]) {
    let mut prev = 0i64;
    for v in values {
        (*v, prev) = (v.wrapping_sub(prev), *v);
    }
}

fn undo_delta(values: &mut [i64]) {
    let mut prev = 0i64;
    for v in values {
        prev = prev.wrapping_add(*v);
        *v = prev;
    }
}

struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    pending: u128,
    pending_bits: u32,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        Self {
            out,
            pending: 0,
            pending_bits: 0,
        }
    }

    /// The low `width` bits of `v`, least significant first.
    fn put(&mut self, v: u64, width: u32) {
        if width == 0 {
            return;
        }
        self.pending |= u128::from(v) << self.pending_bits;
        self.pending_bits += width;
        while self.pending_bits >= 8 {
            self.out.push(self.pending as u8);
            self.pending >>= 8;
            self.pending_bits -= 8;
        }
    }

    fn finish(self) {
        if self.pending_bits > 0 {
            self.out.push(self.pending as u8);
        }
    }
}

struct BitReader<'a> {
    bytes: &'a [u8],
    pending: u128,
    pending_bits: u32,
}

impl<'a> BitReader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            pending: 0,
            pending_bits: 0,
        }
    }

    /// The next `width` bits; the caller has checked that they are there.
    fn take(&mut self, width: u32) -> u64 {
        if width == 0 {
            return 0;
        }
        while self.pending_bits < width {
            let Some((&b, rest)) = self.bytes.split_first() else {
                break;
            };
            self.pending |= u128::from(b) << self.pending_bits;
            self.pending_bits += 8;
            self.bytes = rest;
        }
        let mask = if width == 64 {
            u64::MAX
        } else {
            (1u64 << width) - 1
        };
        let v = (self.pending as u64) & mask;
        self.pending >>= width;
        self.pending_bits = self.pending_bits.saturating_sub(width);
        v
    }
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn varint_len(v: u64) -> u64 {
    u64::from((64 - v.leading_zeros()).max(1).div_ceil(7))
}

fn signed_len(v: i64) -> u64 {
    varint_len(zigzag(v))
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn put_signed(out: &mut Vec<u8>, v: i64) {
    put_varint(out, zigzag(v));
}

/// Format 1's column: the values' greatest common divisor, then each
/// divided by it: memory moves in MiB, PCIe rates in KiB/s, and the zeros
/// below that unit would otherwise cost bits in every value.
fn v1_put_scaled(out: &mut Vec<u8>, values: impl Iterator<Item = i64>) {
    let values: Vec<i64> = values.collect();
    let divisor = values
        .iter()
        .fold(0u64, |g, v| gcd(g, v.unsigned_abs()))
        .max(1);
    put_varint(out, divisor);
    for v in values {
        put_signed(out, (i128::from(v) / i128::from(divisor)) as i64);
    }
}

fn v1_put_deltas(out: &mut Vec<u8>, values: impl Iterator<Item = i64>) {
    let mut values: Vec<i64> = values.collect();
    take_delta(&mut values);
    v1_put_scaled(out, values.into_iter());
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(values: &[i64]) -> Vec<u8> {
        let mut out = Vec::new();
        put_column(&mut out, values);
        let mut r = Reader {
            format: ColumnFormat::V2,
            bytes: &out,
        };
        assert_eq!(r.column("test", values.len()).unwrap(), values);
        assert!(r.bytes.is_empty());
        out
    }

    #[test]
    fn each_column_takes_the_cheapest_way() {
        // A random rate in KiB/s: bit-packed at its 24 bits, not deltas.
        let mut state = 7u64;
        let rates: Vec<i64> = (0..600)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % 16_000_000) as i64 * 1024
            })
            .collect();
        let bytes = round_trip(&rates);
        assert_eq!(bytes[0], PACKED, "values as they are, bit-packed");
        assert!(bytes.len() <= 600 * 3 + 16, "{} bytes", bytes.len());

        // Timestamps a second apart: the first, and the step at zero bits
        // a sample.
        let ts: Vec<i64> = (0..600).map(|i| 1_764_547_200_000 + i * 1000).collect();
        let bytes = round_trip(&ts);
        assert_eq!(bytes[0], 1 | PACKED, "deltas, all the same");
        assert!(bytes.len() <= 12, "{} bytes", bytes.len());
        // With jitter, deltas of deltas.
        let jittered: Vec<i64> = (0..600).map(|i| ts[i] + (i as i64 * 7) % 5).collect();
        let bytes = round_trip(&jittered);
        assert_eq!(bytes[0], 2 | PACKED);
        assert!(bytes.len() <= 16 + 600 * 4 / 8, "{} bytes", bytes.len());

        // A steady series with a large step and a small one: varints of
        // the deltas, a byte a sample that zstd takes to almost nothing.
        let steps: Vec<i64> = (0..600)
            .map(|i| match i {
                0..300 => 10 << 30,
                300..450 => 12 << 30,
                _ => (12 << 30) - (6 << 20),
            })
            .collect();
        let bytes = round_trip(&steps);
        assert_eq!(bytes[0], 1, "deltas as varints");
        assert!(bytes.len() < 620, "{} bytes", bytes.len());
    }

    #[test]
    fn short_and_extreme_columns_read_back() {
        for values in [
            vec![],
            vec![5],
            vec![i64::MIN, i64::MAX],
            vec![i64::MAX, i64::MIN, 0, -1, i64::MAX],
            vec![0, i64::MIN, i64::MAX, i64::MIN, 1, 2, 3],
        ] {
            round_trip(&values);
        }
    }

    #[test]
    fn a_packed_column_cut_short_or_too_wide_is_named() {
        let values: Vec<i64> = (0..100).map(|i| (i * 7919) % 1000).collect();
        let mut out = Vec::new();
        put_column(&mut out, &values);
        assert_eq!(out[0] & PACKED, PACKED);
        let mut cut = Reader {
            format: ColumnFormat::V2,
            bytes: &out[..out.len() - 1],
        };
        assert_eq!(cut.column("used", 100), Err(ChunkError::Truncated("used")));
        let mut bad_mode = out.clone();
        bad_mode[0] = 3;
        let mut r = Reader {
            format: ColumnFormat::V2,
            bytes: &bad_mode,
        };
        assert_eq!(r.column("used", 100), Err(ChunkError::OutOfRange("used")));
    }

    proptest::proptest! {
        #[test]
        fn any_column_reads_back(values in proptest::collection::vec(proptest::prelude::any::<i64>(), 0..100),
                                 small in proptest::collection::vec(-300i64..300, 0..100)) {
            round_trip(&values);
            round_trip(&small);
        }
    }
}
