//! Byte counts written as Kubernetes quantities (`1073741824`, `8Gi`, `1.5Gi`, `500M`,
//! `1e9`, `1Ei`), parsed exactly into a `u64`.
//!
//! The grammar is the apiserver's (`k8s.io/apimachinery/pkg/api/resource`): an optional
//! sign, digits with an optional decimal point, then a binary suffix (Ki..Ei), a decimal
//! suffix (n, u, m, k..E) or an exponent (`e9`, `E-3`). Unlike the apiserver, which
//! rounds `1.5` bytes up, a value that is not a whole number of bytes is refused: a
//! memory cap that silently differs from what was written is a surprise. Arithmetic is
//! exact (integers, no floats); a value beyond `u64` is refused, never wrapped.

/// The forms a byte count may take, for error messages.
pub const ACCEPTED_FORMS: &str = "accepted: a whole number of bytes written as a Kubernetes quantity: digits with an optional decimal point, then nothing (bytes), a binary suffix Ki, Mi, Gi, Ti, Pi or Ei (powers of 1024), a decimal suffix k, M, G, T, P or E (powers of 1000), or an exponent e<N>; for example 1073741824, 8Gi, 1.5Gi, 500M, 1e9, 1Ei";

/// Why a memory size could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("not a Kubernetes quantity; {ACCEPTED_FORMS}")]
    Malformed,
    #[error("unknown suffix {0:?}; {ACCEPTED_FORMS}")]
    UnknownSuffix(String),
    #[error("must not be negative")]
    Negative,
    #[error("is not a whole number of bytes; {ACCEPTED_FORMS}")]
    Fractional,
    #[error("is too large: at most {max} bytes (16Ei minus one byte)", max = u64::MAX)]
    Overflow,
}

/// A parsed quantity: `digits × 10^exp10 × 2^exp2`.
struct Parts<'a> {
    negative: bool,
    int: &'a str,
    frac: &'a str,
    exp10: i64,
    exp2: u32,
}

/// Exponents beyond this are absurd for a byte count; they are refused as too large
/// (or, negative, as fractional) without computing powers.
const MAX_EXPONENT: i64 = 1000;

fn split(s: &str) -> Result<Parts<'_>, QuantityError> {
    let (negative, rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let num_end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let (num, suffix) = rest.split_at(num_end);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(QuantityError::Malformed);
    }
    let (exp10, exp2) = match suffix {
        "" => (0, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        e if e.starts_with(['e', 'E']) => (parse_exponent(&e[1..])?, 0),
        other => {
            return Err(
                if !other.is_empty() && other.bytes().all(|b| b.is_ascii_alphabetic()) {
                    QuantityError::UnknownSuffix(other.to_string())
                } else {
                    QuantityError::Malformed
                },
            );
        }
    };
    Ok(Parts {
        negative,
        int,
        frac,
        exp10,
        exp2,
    })
}

/// The `<signedNumber>` after `e`/`E`: an integer, clamped to ±(MAX_EXPONENT + 1).
fn parse_exponent(s: &str) -> Result<i64, QuantityError> {
    let (sign, digits) = match s.as_bytes().first() {
        Some(b'-') => (-1, &s[1..]),
        Some(b'+') => (1, &s[1..]),
        _ => (1, s),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(QuantityError::Malformed);
    }
    let digits = digits.trim_start_matches('0');
    let v = if digits.len() > 6 {
        MAX_EXPONENT + 1
    } else {
        digits.parse::<i64>().unwrap_or(0).min(MAX_EXPONENT + 1)
    };
    Ok(sign * v)
}

/// Parses a byte count written as a Kubernetes quantity (see the module docs).
pub fn parse_bytes(s: &str) -> Result<u64, QuantityError> {
    let p = split(s)?;
    // digits = int ++ frac, value = digits × 10^(exp10 − frac.len()) × 2^exp2.
    let all = format!("{}{}", p.int, p.frac);
    let significant = all.trim_start_matches('0');
    if significant.is_empty() {
        // Zero, whatever its exponent or sign.
        return Ok(0);
    }
    if p.negative {
        return Err(QuantityError::Negative);
    }
    let trimmed = significant.trim_end_matches('0');
    let trailing_zeros = (significant.len() - trimmed.len()) as i64;
    let mut exp10 = p.exp10 - p.frac.len() as i64 + trailing_zeros;
    if trimmed.len() > 38 {
        // More significant digits than u128 holds: far beyond u64 unless a large
        // negative exponent brings it back, which no one writes for a byte count.
        return Err(if exp10 >= 0 {
            QuantityError::Overflow
        } else {
            QuantityError::Fractional
        });
    }
    let mut m: u128 = trimmed.parse().map_err(|_| QuantityError::Malformed)?;
    let mut exp2 = i64::from(p.exp2);
    if exp10 > 38 {
        return Err(QuantityError::Overflow);
    }
    if exp10 < 0 {
        // Divide by 10^k = 5^k × 2^k before multiplying, so nothing overflows: 5^k must
        // divide the digits (2^exp2 has no factor 5), and 2^k comes off exp2 or the digits.
        let k = -exp10;
        if k > 55 {
            return Err(QuantityError::Fractional);
        }
        let five_k = 5u128.pow(k as u32);
        if !m.is_multiple_of(five_k) {
            return Err(QuantityError::Fractional);
        }
        m /= five_k;
        exp2 -= k;
        exp10 = 0;
        if exp2 < 0 {
            let two_k = 1u128 << (-exp2).min(127);
            if -exp2 > 127 || !m.is_multiple_of(two_k) {
                return Err(QuantityError::Fractional);
            }
            m /= two_k;
            exp2 = 0;
        }
    }
    let total = 10u128
        .checked_pow(exp10 as u32)
        .and_then(|p10| m.checked_mul(p10))
        .and_then(|v| {
            if exp2 >= 128 {
                None
            } else {
                v.checked_mul(1u128 << exp2)
            }
        })
        .ok_or(QuantityError::Overflow)?;
    u64::try_from(total).map_err(|_| QuantityError::Overflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("8Gi"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_bytes("0.5Ki"), Ok(512));
        assert_eq!(parse_bytes("500M"), Ok(500_000_000));
        assert_eq!(parse_bytes("2e9"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1E9"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("1e+3"), Ok(1000));
        assert_eq!(parse_bytes("1500e-3"), Err(QuantityError::Fractional));
        assert_eq!(parse_bytes("15e-1"), Err(QuantityError::Fractional));
        assert_eq!(parse_bytes("20e-1"), Ok(2));
        assert_eq!(parse_bytes("4k"), Ok(4000));
        assert_eq!(parse_bytes("1E"), Ok(1_000_000_000_000_000_000));
        assert_eq!(parse_bytes("1Ei"), Ok(1 << 60));
        assert_eq!(parse_bytes("15Ei"), Ok(15 << 60));
        assert_eq!(parse_bytes("16Ei"), Err(QuantityError::Overflow));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(
            parse_bytes("18446744073709551616"),
            Err(QuantityError::Overflow)
        );
        assert_eq!(parse_bytes("1e19"), Ok(10_000_000_000_000_000_000));
        assert_eq!(parse_bytes("2e19"), Err(QuantityError::Overflow));
        assert_eq!(parse_bytes("1e999999999"), Err(QuantityError::Overflow));
        assert_eq!(parse_bytes("1e-999999999"), Err(QuantityError::Fractional));
        assert_eq!(parse_bytes("0e999999999"), Ok(0));
        assert_eq!(parse_bytes("0.5"), Err(QuantityError::Fractional));
        assert_eq!(parse_bytes("1500m"), Err(QuantityError::Fractional));
        assert_eq!(parse_bytes("2000m"), Ok(2));
        assert_eq!(parse_bytes("3000000000n"), Ok(3));
        assert_eq!(parse_bytes("5000000u"), Ok(5));
        assert_eq!(parse_bytes("1."), Ok(1));
        assert_eq!(parse_bytes(".5Ki"), Ok(512));
        assert_eq!(parse_bytes("+1Ki"), Ok(1024));
        assert_eq!(
            parse_bytes("8GB"),
            Err(QuantityError::UnknownSuffix("GB".into()))
        );
        assert_eq!(parse_bytes("-1"), Err(QuantityError::Negative));
        assert_eq!(parse_bytes("-0"), Ok(0));
        assert_eq!(parse_bytes(""), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes(" 1"), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("1 "), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("Gi"), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("."), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("1e"), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("1e1.5"), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("99999999999Pi"), Err(QuantityError::Overflow));
        assert_eq!(parse_bytes("1.2.3"), Err(QuantityError::Malformed));
        assert_eq!(
            parse_bytes("1000000000000000000000000000000000000000000"),
            Err(QuantityError::Overflow)
        );
        assert_eq!(
            parse_bytes("0.0000000000000000000000000000000000000000001"),
            Err(QuantityError::Fractional)
        );
        assert_eq!(
            parse_bytes("00000000000000000000000000000000000000000000000001"),
            Ok(1)
        );
    }

    #[test]
    fn messages_list_the_accepted_forms() {
        for e in [
            QuantityError::Malformed,
            QuantityError::UnknownSuffix("GB".into()),
            QuantityError::Fractional,
        ] {
            let m = e.to_string();
            for form in ["Ki", "Ei", "k, M, G, T, P or E", "e<N>", "1Ei", "1e9"] {
                assert!(m.contains(form), "{m}");
            }
        }
        assert!(
            QuantityError::Overflow
                .to_string()
                .contains("18446744073709551615")
        );
    }
}
