//! Byte counts written as plain integers or Kubernetes quantities (`8Gi`, `500M`).

/// Why a memory size could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("not a byte count or a Kubernetes quantity such as 8Gi or 500Mi")]
    Malformed,
    #[error("unknown unit suffix {0:?}; use Ki, Mi, Gi, Ti, k, M, G or T")]
    UnknownSuffix(String),
    #[error("must be a whole number of bytes")]
    Fractional,
    #[error("too large")]
    Overflow,
}

/// Parses `1073741824`, `8Gi`, `1.5Gi`, `500M`, `2e9` into bytes.
pub fn parse_bytes(s: &str) -> Result<u64, QuantityError> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    if num.is_empty() || num.starts_with('.') && num.len() == 1 {
        return Err(QuantityError::Malformed);
    }
    // Exponent form: 2e9 / 2E9.
    let (mult_num, mult_den): (u128, u128) = match suffix {
        "" => (1, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "m" => (1, 1000),
        e if (e.starts_with('e') || e.starts_with('E'))
            && e.len() > 1
            && e.len() <= 3
            && e[1..].bytes().all(|b| b.is_ascii_digit()) =>
        {
            let exp: u32 = e[1..].parse().map_err(|_| QuantityError::Malformed)?;
            (10u128.checked_pow(exp).ok_or(QuantityError::Overflow)?, 1)
        }
        other => {
            if other.bytes().all(|b| b.is_ascii_alphabetic()) {
                return Err(QuantityError::UnknownSuffix(other.to_string()));
            }
            return Err(QuantityError::Malformed);
        }
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if frac.contains('.') || int.len() + frac.len() > 30 || (int.is_empty() && frac.is_empty()) {
        return Err(QuantityError::Malformed);
    }
    let digits: String = format!("{int}{frac}");
    let mantissa: u128 = digits.parse().map_err(|_| QuantityError::Malformed)?;
    let scale = 10u128.pow(frac.len() as u32) * mult_den;
    let total = mantissa
        .checked_mul(mult_num)
        .ok_or(QuantityError::Overflow)?;
    if total % scale != 0 {
        return Err(QuantityError::Fractional);
    }
    u64::try_from(total / scale).map_err(|_| QuantityError::Overflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("8Gi"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_bytes("500M"), Ok(500_000_000));
        assert_eq!(parse_bytes("2e9"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("4k"), Ok(4000));
        assert_eq!(parse_bytes("0.5"), Err(QuantityError::Fractional));
        assert_eq!(parse_bytes("1500m"), Err(QuantityError::Fractional));
        assert_eq!(parse_bytes("2000m"), Ok(2));
        assert_eq!(
            parse_bytes("8GB"),
            Err(QuantityError::UnknownSuffix("GB".into()))
        );
        assert_eq!(parse_bytes("-1"), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes(""), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("Gi"), Err(QuantityError::Malformed));
        assert_eq!(parse_bytes("99999999999Pi"), Err(QuantityError::Overflow));
        assert_eq!(parse_bytes("1.2.3"), Err(QuantityError::Malformed));
    }
}
