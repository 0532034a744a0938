//! Byte sizes in human units: `80GiB` in, `80 GiB` out.
//!
//! Binary units (`KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024; decimal units (`kB`, `MB`, `GB`,
//! `TB`) are powers of 1000, as their names say. A bare number is a count of bytes. Unit names
//! are case-insensitive and a space may separate the number from the unit; a fraction is allowed
//! when the result is a whole number of bytes (`1.5GiB`).

use std::fmt;

/// A byte count that displays in the largest binary unit that keeps it readable: `80 GiB`,
/// `1.5 GiB`, `512 B`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut unit = 0;
        let mut scaled = self.0 as f64;
        while scaled >= 1024.0 && unit + 1 < UNITS.len() {
            scaled /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            return write!(f, "{} B", self.0);
        }
        let decimals = if scaled < 10.0 { 2 } else { 1 };
        let text = format!("{scaled:.decimals$}");
        let text = text.trim_end_matches('0').trim_end_matches('.');
        write!(f, "{text} {}", UNITS[unit])
    }
}

/// Why a size could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseBytesError {
    /// The text is empty or does not start with a number.
    #[error("`{text}` is not a size: expected a number with an optional unit such as `80GiB`")]
    NotANumber {
        /// The text that was read.
        text: String,
    },
    /// The unit is not one of B, KiB, MiB, GiB, TiB, PiB, kB, MB, GB, TB, PB.
    #[error("`{text}` has an unknown unit `{unit}`: use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB")]
    UnknownUnit {
        /// The text that was read.
        text: String,
        /// The unit as written.
        unit: String,
    },
    /// The size does not fit in 64 bits, or is not a whole number of bytes.
    #[error("`{text}` is not a whole number of bytes below 16 EiB")]
    OutOfRange {
        /// The text that was read.
        text: String,
    },
}

/// Reads a size such as `80GiB`, `1.5 GiB`, `512MiB`, `4096` or `10GB`.
pub fn parse_bytes(text: &str) -> Result<u64, ParseBytesError> {
    let trimmed = text.trim();
    let split = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim();
    let not_a_number = || ParseBytesError::NotANumber { text: text.to_owned() };
    if number.is_empty() || number.matches('.').count() > 1 {
        return Err(not_a_number());
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "pib" => 1 << 50,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        _ => return Err(ParseBytesError::UnknownUnit { text: text.to_owned(), unit: unit.to_owned() }),
    };
    let out_of_range = || ParseBytesError::OutOfRange { text: text.to_owned() };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| out_of_range())? };
    let mut bytes = whole.checked_mul(multiplier).ok_or_else(out_of_range)?;
    if !fraction.is_empty() {
        // Exact decimal arithmetic: fraction digits / 10^len * multiplier must be a whole number.
        let digits: u128 = fraction.parse().map_err(|_| not_a_number())?;
        let scale = 10u128.checked_pow(fraction.len() as u32).ok_or_else(out_of_range)?;
        let numerator = digits * u128::from(multiplier);
        if !numerator.is_multiple_of(scale) {
            return Err(out_of_range());
        }
        let extra = u64::try_from(numerator / scale).map_err(|_| out_of_range())?;
        bytes = bytes.checked_add(extra).ok_or_else(out_of_range)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_fractions() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("80 gib"), Ok(80 << 30));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("2MiB"), Ok(2 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("10GB"), Ok(10_000_000_000));
        assert_eq!(parse_bytes("0.5KiB"), Ok(512));
    }

    #[test]
    fn rejects_bad_sizes_with_the_text() {
        assert!(matches!(parse_bytes(""), Err(ParseBytesError::NotANumber { .. })));
        assert!(matches!(parse_bytes("GiB"), Err(ParseBytesError::NotANumber { .. })));
        assert!(matches!(parse_bytes("1.2.3GiB"), Err(ParseBytesError::NotANumber { .. })));
        assert!(matches!(parse_bytes("80 gigs"), Err(ParseBytesError::UnknownUnit { unit, .. }) if unit == "gigs"));
        assert!(matches!(parse_bytes("0.1B"), Err(ParseBytesError::OutOfRange { .. })));
        assert!(matches!(parse_bytes("20000PiB"), Err(ParseBytesError::OutOfRange { .. })));
        let message = parse_bytes("80 gigs").unwrap_err().to_string();
        assert!(message.contains("80 gigs") && message.contains("gigs"), "{message}");
    }

    #[test]
    fn displays_in_readable_units() {
        assert_eq!(Bytes(512).to_string(), "512 B");
        assert_eq!(Bytes(80 << 30).to_string(), "80 GiB");
        assert_eq!(Bytes(3 << 29).to_string(), "1.5 GiB");
        assert_eq!(Bytes((1 << 30) + (10 << 20)).to_string(), "1.01 GiB");
        assert_eq!(Bytes(2 << 20).to_string(), "2 MiB");
        assert_eq!(Bytes((100 << 20) + (300 << 10)).to_string(), "100.3 MiB");
    }

    #[test]
    fn display_and_parse_agree_on_whole_units() {
        for bytes in [1u64 << 10, 2 << 20, 80 << 30, 3 << 40] {
            assert_eq!(parse_bytes(&Bytes(bytes).to_string()), Ok(bytes));
        }
    }
}
