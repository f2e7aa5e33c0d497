//! Checked integer helpers shared by the planners.

use crate::error::{PlanError, Result};

/// `ceil(a / b)` for `a >= 0`, `b >= 1`.
#[inline]
pub fn ceil_div(a: i64, b: i64) -> i64 {
    a / b + i64::from(a % b != 0)
}

/// A divisor fixed for a whole plan: powers of two (the usual world sizes and
/// tile sizes) divide by shifting, which is several times cheaper than `idiv`.
#[derive(Debug, Clone, Copy)]
pub struct Divisor {
    divisor: i64,
    shift: Option<u32>,
}

impl Divisor {
    /// `divisor >= 1`.
    pub fn new(divisor: i64) -> Self {
        Self {
            divisor,
            shift: is_pow2(divisor).then(|| divisor.trailing_zeros()),
        }
    }

    /// `ceil(a / divisor)` for `a >= 0`.
    #[inline]
    pub fn ceil_div(self, a: i64) -> i64 {
        match self.shift {
            Some(shift) => (a >> shift) + i64::from(a & (self.divisor - 1) != 0),
            None => ceil_div(a, self.divisor),
        }
    }
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
    fn divisor_matches_ceil_div() {
        for d in [1, 2, 3, 7, 8, 1024, 65536, 1000] {
            let by = Divisor::new(d);
            for a in [0, 1, d - 1, d, d + 1, 12345, i64::MAX - 1, i64::MAX] {
                assert_eq!(by.ceil_div(a), ceil_div(a, d), "{a} / {d}");
            }
        }
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
