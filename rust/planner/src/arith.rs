//! Checked integer helpers shared by the planners.

use crate::error::{PlanError, Result};

/// `ceil(a / b)` for `a >= 0`, `b >= 1`.
#[inline]
pub fn ceil_div(a: i64, b: i64) -> i64 {
    a / b + i64::from(a % b != 0)
}

/// Round `x` up to a multiple of `align` (a power of two).
#[inline]
pub fn align_up(x: i64, align: i64, index: Option<usize>, what: &'static str) -> Result<i64> {
    x.checked_add(align - 1)
        .map(|v| v & !(align - 1))
        .ok_or(PlanError::Overflow { index, what })
}

#[inline]
pub fn mul(a: i64, b: i64, index: Option<usize>, what: &'static str) -> Result<i64> {
    a.checked_mul(b).ok_or(PlanError::Overflow { index, what })
}

#[inline]
pub fn add(a: i64, b: i64, index: Option<usize>, what: &'static str) -> Result<i64> {
    a.checked_add(b).ok_or(PlanError::Overflow { index, what })
}

pub fn is_pow2(x: i64) -> bool {
    x > 0 && (x & (x - 1)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceil_div_matches_torch_chunk_rule() {
        assert_eq!(ceil_div(0, 8), 0);
        assert_eq!(ceil_div(1, 8), 1);
        assert_eq!(ceil_div(8, 8), 1);
        assert_eq!(ceil_div(9, 8), 2);
        assert_eq!(ceil_div(i64::MAX, 1), i64::MAX);
        assert_eq!(ceil_div(i64::MAX, 2), i64::MAX / 2 + 1);
    }

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(align_up(0, 4, None, "x"), Ok(0));
        assert_eq!(align_up(5, 4, None, "x"), Ok(8));
        assert_eq!(align_up(8, 4, None, "x"), Ok(8));
        assert!(align_up(i64::MAX - 1, 4, Some(3), "x").is_err());
    }

    #[test]
    fn pow2() {
        assert!(is_pow2(1) && is_pow2(16) && !is_pow2(0) && !is_pow2(-4) && !is_pow2(12));
    }
}
