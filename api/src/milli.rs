//! Fractions of one GPU as integer milli-units (0..=1000).
//!
//! KubeShare compared float shares for equality and left GPUs "not quite free"
//! forever; holding shares as integers makes sums and comparisons exact.

use std::fmt;

/// A share of one GPU in thousandths: `Milli(500)` is half a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Milli(u16);

/// Why a decimal string is not a valid share.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MilliParseError {
    #[error("not a decimal number")]
    NotANumber,
    #[error("negative values are not allowed")]
    Negative,
    #[error("at most 3 decimal places are allowed")]
    TooPrecise,
    #[error("must be at most 1.0")]
    AboveOne,
}

impl Milli {
    pub const ZERO: Milli = Milli(0);
    /// One whole GPU.
    pub const ONE: Milli = Milli(1000);

    /// `None` when `v` exceeds 1000.
    pub const fn new(v: u16) -> Option<Milli> {
        if v <= 1000 { Some(Milli(v)) } else { None }
    }

    pub const fn get(self) -> u16 {
        self.0
    }

    pub fn as_f64(self) -> f64 {
        f64::from(self.0) / 1000.0
    }

    /// Parses a share written as a decimal in `[0, 1]` with at most 3 decimals.
    pub fn parse(s: &str) -> Result<Milli, MilliParseError> {
        let v = parse_decimal_milli(s)?;
        u16::try_from(v)
            .ok()
            .and_then(Milli::new)
            .ok_or(MilliParseError::AboveOne)
    }
}

impl fmt::Display for Milli {
    /// The shortest decimal that parses back to the same value: `0.5`, `0.125`, `1.0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let whole = self.0 / 1000;
        let frac = self.0 % 1000;
        if frac == 0 {
            return write!(f, "{whole}.0");
        }
        let digits = format!("{frac:03}");
        write!(f, "{whole}.{}", digits.trim_end_matches('0'))
    }
}

/// Parses an unsigned decimal (`2`, `0.5`, `1.000`) into thousandths, exactly.
/// Larger-than-one values are returned as is (callers decide what they mean).
///
/// Strict: digits on both sides of any decimal point, no sign, no spaces. `.5`, `1.`,
/// `+0.5` and ` 0.5` are refused: they are not valid Kubernetes label values, so the
/// apiserver would refuse them anyway, and a parser that accepted them would let the
/// labels and the record disagree on what a value means.
pub(crate) fn parse_decimal_milli(s: &str) -> Result<u64, MilliParseError> {
    if let Some(rest) = s.strip_prefix('-') {
        return if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            Err(MilliParseError::NotANumber)
        } else {
            Err(MilliParseError::Negative)
        };
    }
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    let digits_only = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    if !digits_only(int) || frac.is_some_and(|f| !digits_only(f)) {
        return Err(MilliParseError::NotANumber);
    }
    let frac = frac.unwrap_or("");
    let significant_frac = frac.trim_end_matches('0');
    if significant_frac.len() > 3 {
        return Err(MilliParseError::TooPrecise);
    }
    let int_trimmed = int.trim_start_matches('0');
    // Anything with more than 12 integer digits is absurd for a GPU count.
    if int_trimmed.len() > 12 {
        return Err(MilliParseError::AboveOne);
    }
    let int_v: u64 = if int_trimmed.is_empty() {
        0
    } else {
        int_trimmed
            .parse()
            .map_err(|_| MilliParseError::NotANumber)?
    };
    let mut frac_v: u64 = 0;
    for (i, b) in significant_frac.bytes().enumerate() {
        frac_v += u64::from(b - b'0') * 10u64.pow(2 - i as u32);
    }
    Ok(int_v * 1000 + frac_v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (s, v, shown) in [
            ("0.5", 500, "0.5"),
            ("1", 1000, "1.0"),
            ("1.000", 1000, "1.0"),
            ("0.125", 125, "0.125"),
            ("0", 0, "0.0"),
            ("0.0500", 50, "0.05"),
        ] {
            let m = Milli::parse(s).unwrap();
            assert_eq!(m.get(), v, "{s}");
            assert_eq!(m.to_string(), shown);
        }
    }

    #[test]
    fn rejects() {
        assert_eq!(Milli::parse("1.5"), Err(MilliParseError::AboveOne));
        assert_eq!(Milli::parse("-0.5"), Err(MilliParseError::Negative));
        assert_eq!(Milli::parse("0.1234"), Err(MilliParseError::TooPrecise));
        for bad in [
            "", ".", "abc", "1e-1", "0x1", "NaN", "inf", "1..2", " ", "--1", "0.5.5", ".5", "1.",
            "+0.5", " 0.5", "0.5 ", "-", "1 000",
        ] {
            assert_eq!(
                Milli::parse(bad),
                Err(MilliParseError::NotANumber),
                "{bad:?}"
            );
        }
    }
}
