//! The byte-size and byte-rate syntax used by every memory and PCIe field of a
//! scenario: either a plain integer (bytes) or a string such as `"80GiB"`,
//! `"1.5 GB"` or `"500MiB/s"`.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// Units are case-sensitive on purpose: `"mb"` (millibits?) is more likely a
/// typo than an intent, and guessing would hide it.
const UNITS: &[(&str, u64)] = &[
    ("B", 1),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
];

const UNIT_LIST: &str = "B, KiB, MiB, GiB, TiB, KB, MB, GB or TB";

/// More fractional digits than this cannot change the result of any unit up
/// to TiB by a whole byte, and bounding it keeps the arithmetic in `u128`.
const MAX_FRACTION_DIGITS: usize = 18;

/// Why a byte-size or rate string was rejected; the message quotes the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {input:?}: {reason}")]
pub struct ParseBytesError {
    kind: &'static str,
    input: String,
    reason: String,
}

impl ParseBytesError {
    fn new(kind: &'static str, input: &str, reason: impl Into<String>) -> Self {
        Self {
            kind,
            input: input.to_owned(),
            reason: reason.into(),
        }
    }
}

/// Parses `"80GiB"`, `"80 GiB"`, `"1.5GB"` or `"1024"` into bytes, rounding a
/// fractional result to the nearest byte.
pub fn parse_bytes(input: &str) -> Result<u64, ParseBytesError> {
    parse_size(input, "byte size")
}

/// Parses a rate such as `"2GB/s"` or `"500 MiB/s"` into bytes per second.
pub fn parse_rate(input: &str) -> Result<u64, ParseBytesError> {
    const KIND: &str = "byte rate";
    match input.trim_end().strip_suffix("/s") {
        Some(size) => parse_size(size, KIND).map_err(|err| ParseBytesError {
            input: input.to_owned(),
            ..err
        }),
        None => Err(ParseBytesError::new(
            KIND,
            input,
            "expected a size per second such as \"2GB/s\" or \"500MiB/s\", or an integer number of bytes per second",
        )),
    }
}

fn parse_size(input: &str, kind: &'static str) -> Result<u64, ParseBytesError> {
    let text = input.trim();
    if text.is_empty() {
        return Err(ParseBytesError::new(kind, input, "it is empty"));
    }
    if text.starts_with('-') {
        return Err(ParseBytesError::new(kind, input, "it is negative"));
    }
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_len);
    let unit = unit.trim_start();

    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || fraction.contains('.') || (number.contains('.') && fraction.is_empty()) {
        return Err(ParseBytesError::new(
            kind,
            input,
            "expected a number followed by an optional unit, such as \"80GiB\" or \"1.5 GB\"",
        ));
    }
    if fraction.len() > MAX_FRACTION_DIGITS {
        return Err(ParseBytesError::new(
            kind,
            input,
            format!("at most {MAX_FRACTION_DIGITS} digits may follow the decimal point"),
        ));
    }

    let multiplier = if unit.is_empty() {
        1
    } else {
        UNITS
            .iter()
            .find(|(name, _)| *name == unit)
            .map(|(_, multiplier)| *multiplier)
            .ok_or_else(|| {
                ParseBytesError::new(
                    kind,
                    input,
                    format!("unknown unit {unit:?} (expected {UNIT_LIST})"),
                )
            })?
    };

    let too_large = || ParseBytesError::new(kind, input, "it does not fit in 64 bits");
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let mut bytes = whole
        .checked_mul(u128::from(multiplier))
        .ok_or_else(too_large)?;
    if !fraction.is_empty() {
        let scale = 10u128.pow(fraction.len() as u32);
        let fraction: u128 = fraction.parse().map_err(|_| too_large())?;
        // Exact decimal arithmetic: "0.1GB" must be exactly 100_000_000 bytes.
        let scaled = fraction * u128::from(multiplier);
        bytes = bytes
            .checked_add((scaled + scale / 2) / scale)
            .ok_or_else(too_large)?;
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

/// Renders a byte count for error messages, e.g. `80 GiB` or `79.5 GiB`.
#[derive(Debug, Clone, Copy)]
pub struct HumanBytes(pub u64);

/// Binary units, largest first, for printing byte counts.
const BINARY_UNITS: &[(&str, u64)] = &[
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
];

impl fmt::Display for HumanBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.0;
        match BINARY_UNITS.iter().find(|(_, size)| bytes >= *size) {
            Some((unit, size)) if bytes.is_multiple_of(*size) => {
                write!(f, "{} {unit}", bytes / size)
            }
            Some((unit, size)) => {
                let value = format!("{:.2}", bytes as f64 / *size as f64);
                let value = value.trim_end_matches('0').trim_end_matches('.');
                write!(f, "{value} {unit} ({bytes} B)")
            }
            None => write!(f, "{bytes} B"),
        }
    }
}

/// A byte count for a sentence meant for people: three significant figures
/// at most (`18.3 GiB`, `512 MiB`), never the exact count beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxBytes(pub u64);

impl fmt::Display for ApproxBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.0;
        let Some((unit, size)) = BINARY_UNITS.iter().find(|(_, size)| bytes >= *size) else {
            return write!(f, "{bytes} B");
        };
        let value = bytes as f64 / *size as f64;
        let decimals = if value >= 100.0 { 0 } else { 1 };
        let text = format!("{value:.decimals$}");
        write!(f, "{} {unit}", text.strip_suffix(".0").unwrap_or(&text))
    }
}

/// A byte count read from a configuration file: an integer or a string with
/// a unit (`"80GiB"`, `"512 MiB"`, `"1.5GB"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

/// A rate in bytes per second read from a scenario: an integer or a string
/// such as `"2GB/s"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteRate(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(AmountVisitor {
                expecting: "a byte count: an integer or a string such as \"80GiB\"",
                parse: parse_bytes,
            })
            .map(ByteSize)
    }
}

impl<'de> Deserialize<'de> for ByteRate {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(AmountVisitor {
                expecting: "a rate: an integer number of bytes per second or a string such as \"2GB/s\"",
                parse: parse_rate,
            })
            .map(ByteRate)
    }
}

struct AmountVisitor {
    expecting: &'static str,
    parse: fn(&str) -> Result<u64, ParseBytesError>,
}

impl Visitor<'_> for AmountVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<u64, E> {
        Ok(value)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<u64, E> {
        u64::try_from(value)
            .map_err(|_| E::custom(format!("{value} is negative; {} cannot be", self.expecting)))
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<u64, E> {
        Err(E::custom(format!(
            "{value} is a float; use {} (fractions are allowed inside strings, e.g. \"1.5GiB\")",
            self.expecting
        )))
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<u64, E> {
        (self.parse)(value).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_bytes("0").unwrap(), 0);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("7B").unwrap(), 7);
        assert_eq!(parse_bytes("2KiB").unwrap(), 2048);
        assert_eq!(parse_bytes("3MiB").unwrap(), 3 << 20);
        assert_eq!(parse_bytes("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_bytes("1TiB").unwrap(), 1 << 40);
        assert_eq!(parse_bytes("2KB").unwrap(), 2_000);
        assert_eq!(parse_bytes("5MB").unwrap(), 5_000_000);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("3TB").unwrap(), 3_000_000_000_000);
    }

    #[test]
    fn accepts_spaces_and_fractions() {
        assert_eq!(parse_bytes("80 GiB").unwrap(), 80 << 30);
        assert_eq!(parse_bytes("  512MiB ").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("0.1GB").unwrap(), 100_000_000);
        assert_eq!(parse_bytes("0.5B").unwrap(), 1, "rounds half up");
    }

    #[test]
    fn rejects_bad_sizes_with_reasons() {
        let err = parse_bytes("12 parsecs").unwrap_err().to_string();
        assert!(
            err.contains("12 parsecs") && err.contains("unknown unit \"parsecs\""),
            "{err}"
        );
        assert!(err.contains("GiB"), "lists the valid units: {err}");
        assert!(parse_bytes("80gib").is_err(), "units are case-sensitive");
        assert!(parse_bytes("").unwrap_err().to_string().contains("empty"));
        assert!(
            parse_bytes("-1GiB")
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("1.2.3GiB").is_err());
        assert!(parse_bytes("1.GiB").is_err());
        assert!(parse_bytes("1 2GiB").is_err());
        let err = parse_bytes("99999999999TiB").unwrap_err().to_string();
        assert!(err.contains("64 bits"), "{err}");
    }

    #[test]
    fn parses_rates() {
        assert_eq!(parse_rate("2GB/s").unwrap(), 2_000_000_000);
        assert_eq!(parse_rate("500MiB/s").unwrap(), 500 << 20);
        assert_eq!(parse_rate("500 MiB/s").unwrap(), 500 << 20);
        let err = parse_rate("2GB").unwrap_err().to_string();
        assert!(
            err.contains("byte rate \"2GB\"") && err.contains("/s"),
            "{err}"
        );
        let err = parse_rate("2 furlongs/s").unwrap_err().to_string();
        assert!(
            err.contains("\"2 furlongs/s\"") && err.contains("furlongs"),
            "{err}"
        );
    }

    #[test]
    fn formats_for_humans() {
        assert_eq!(HumanBytes(80 << 30).to_string(), "80 GiB");
        assert_eq!(HumanBytes(512).to_string(), "512 B");
        assert_eq!(HumanBytes(3 << 29).to_string(), "1.5 GiB (1610612736 B)");
    }

    #[derive(Debug, serde::Deserialize)]
    struct Amounts {
        size: ByteSize,
        rate: ByteRate,
    }

    #[test]
    fn deserializes_integers_and_strings() {
        let parsed: Amounts = toml::from_str("size = 4096\nrate = \"1KB/s\"").unwrap();
        assert_eq!(parsed.size, ByteSize(4096));
        assert_eq!(parsed.rate, ByteRate(1000));
        let parsed: Amounts = toml::from_str("size = \"1KiB\"\nrate = 7").unwrap();
        assert_eq!(parsed.size, ByteSize(1024));
        assert_eq!(parsed.rate, ByteRate(7));
    }

    #[test]
    fn deserialization_errors_name_the_line() {
        let err = toml::from_str::<Amounts>("rate = 1\nsize = -5")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2") && err.contains("negative"), "{err}");
        let err = toml::from_str::<Amounts>("rate = 1\nsize = 1.5")
            .unwrap_err()
            .to_string();
        assert!(err.contains("float"), "{err}");
    }

    #[test]
    fn approximate_bytes_read_as_people_say_them() {
        assert_eq!(ApproxBytes(19_684_005_194).to_string(), "18.3 GiB");
        assert_eq!(ApproxBytes(32 << 30).to_string(), "32 GiB");
        assert_eq!(ApproxBytes(512 << 20).to_string(), "512 MiB");
        assert_eq!(ApproxBytes(150 << 30).to_string(), "150 GiB");
        assert_eq!(ApproxBytes(100).to_string(), "100 B");
    }
}
