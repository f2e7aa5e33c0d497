//! FSDP1 flat-parameter metadata: what `FlatParamHandle` computes when it
//! flattens a group into one `FlatParameter` and shards it.
//!
//! [Note: FSDP1 flat sharding]
//! FSDP1 concatenates the flattened params, inserting alignment padding before
//! a param whenever the running numel is not a multiple of `aligned_numel`
//! (`16 // itemsize` with `use_orig_params=True`, else 0 and no padding), and
//! with alignment also pads the total to a multiple of the world size. The flat
//! parameter is then chunked `W` ways with `c = ceil(total / W)` elements per
//! rank (the tail rank's chunk padded with zeros). For each param, the rank
//! records whether its `[start, end]` interval intersects the rank's
//! `[c*r, c*(r+1) - 1]`, and where: `offset_in_shard`, `numel_in_shard` and the
//! inclusive `intra_param_start/end` slice of the flattened param. An empty
//! param intersects whenever its (empty) interval falls inside the shard, and
//! then has `intra_param_end == -1`; torch keeps that, so the planner does too.

use crate::alloc::zeroed;
use crate::arith::{add, ceil_div};
use crate::error::{PlanError, Result};
use crate::shapes::{checked_numel, Shapes};

/// `-1` stands for torch's `None` in the per-param shard tables.
pub const NOT_IN_SHARD: i64 = -1;

/// Tables in one allocation ([Note: Huge pages for tables]); accessors return slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatPlan {
    pub world_size: i64,
    pub rank: i64,
    pub aligned_numel: i64,
    /// Unsharded flat numel, padding included.
    pub flat_numel: i64,
    /// Sharded flat numel, `ceil(flat_numel / W)`.
    pub shard_numel: i64,
    /// Zeros this rank's shard carries past the flat parameter's end.
    pub shard_numel_padded: i64,
    /// `TABLES` tables of `P` entries, in the order of the accessors below.
    tables: Vec<i64>,
    in_shard: Vec<bool>,
}

const TABLES: usize = 6;

macro_rules! flat_accessors {
    ($($(#[$doc:meta])* $name:ident = $k:expr),* $(,)?) => {
        impl FlatPlan {
            $(
                $(#[$doc])*
                pub fn $name(&self) -> &[i64] {
                    let p = self.num_params();
                    &self.tables[$k * p..($k + 1) * p]
                }
            )*
        }
    };
}

flat_accessors!(
    /// Start of each param in the unsharded flat parameter.
    flat_offsets = 0,
    numel = 1,
    /// `-1` ([`NOT_IN_SHARD`]) where the param is not in this rank's shard;
    /// likewise below.
    offset_in_shard = 2,
    numel_in_shard = 3,
    intra_param_start = 4,
    /// Inclusive; `-1` is a real value for an empty param inside the shard.
    intra_param_end = 5,
);

impl FlatPlan {
    pub fn new(
        shapes: &Shapes<'_>,
        world_size: i64,
        rank: i64,
        aligned_numel: i64,
    ) -> Result<Self> {
        if world_size < 1 {
            return Err(PlanError::WorldSize { world_size });
        }
        if !(0..world_size).contains(&rank) {
            return Err(PlanError::Rank { rank, world_size });
        }
        if aligned_numel < 0 {
            return Err(PlanError::AlignedNumel { aligned_numel });
        }
        let p = shapes.len();
        let mut tables: Vec<i64> = zeroed(TABLES * p);
        let mut in_shard: Vec<bool> = zeroed(p);
        let (flat_offsets, rest) = tables.split_at_mut(p);
        let (numel, rest) = rest.split_at_mut(p);
        let (offset_in_shard, rest) = rest.split_at_mut(p);
        let (numel_in_shard, rest) = rest.split_at_mut(p);
        let (intra_param_start, intra_param_end) = rest.split_at_mut(p);

        let mut total: i64 = 0;
        for (index, shape) in shapes.iter().enumerate() {
            let at = Some(index);
            if aligned_numel > 0 {
                let pad = aligned_numel - total % aligned_numel;
                if pad < aligned_numel {
                    total = add(total, pad, at, "flat parameter offset")?;
                }
            }
            let n = checked_numel(index, shape)?;
            flat_offsets[index] = total;
            numel[index] = n;
            total = add(total, n, at, "flat parameter numel")?;
        }
        if aligned_numel > 0 {
            let pad = world_size - total % world_size;
            if pad < world_size {
                total = add(total, pad, None, "flat parameter numel")?;
            }
        }
        let shard = ceil_div(total, world_size);
        // Checked: the tail rank's bounds pass i64::MAX when total is within
        // 2 * shard of it.
        let start = shard.checked_mul(rank);
        let end = shard.checked_mul(rank + 1).map(|e| e - 1);
        let (Some(start), Some(end)) = (start, end) else {
            return Err(PlanError::Overflow {
                index: None,
                what: "flat shard bounds",
            });
        };
        let chunk = (total - start).clamp(0, shard);

        for i in 0..p {
            let pstart = flat_offsets[i];
            let pend = pstart + numel[i] - 1;
            let inside = start <= pend && end >= pstart;
            in_shard[i] = inside;
            if !inside {
                offset_in_shard[i] = NOT_IN_SHARD;
                numel_in_shard[i] = NOT_IN_SHARD;
                intra_param_start[i] = NOT_IN_SHARD;
                intra_param_end[i] = NOT_IN_SHARD;
                continue;
            }
            let (intra_start, offset) = if start <= pstart {
                (0, pstart - start)
            } else {
                (start - pstart, 0)
            };
            let intra_end = pend.min(end) - pstart;
            offset_in_shard[i] = offset;
            numel_in_shard[i] = intra_end - intra_start + 1;
            intra_param_start[i] = intra_start;
            intra_param_end[i] = intra_end;
        }
        Ok(Self {
            world_size,
            rank,
            aligned_numel,
            flat_numel: total,
            shard_numel: shard,
            shard_numel_padded: shard - chunk,
            tables,
            in_shard,
        })
    }

    pub fn num_params(&self) -> usize {
        self.in_shard.len()
    }

    /// Whether each param intersects this rank's shard.
    pub fn in_shard(&self) -> &[bool] {
        &self.in_shard
    }

    /// Bytes of every table this plan owns.
    pub fn plan_bytes(&self) -> usize {
        self.tables.len() * 8 + self.in_shard.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(shapes: &[&[i64]], world: i64, rank: i64, aligned: i64) -> FlatPlan {
        let ndims: Vec<i64> = shapes.iter().map(|s| s.len() as i64).collect();
        let dims: Vec<i64> = shapes.iter().flat_map(|s| s.iter().copied()).collect();
        FlatPlan::new(&Shapes::new(&ndims, &dims).unwrap(), world, rank, aligned).unwrap()
    }

    #[test]
    fn aligned_layout_and_world_padding() {
        // numels 3, 5, 4 with 4-element alignment: 0..3 | pad 1 | 4..9 | pad 3 | 12..16,
        // then padded to a multiple of W = 3: 18; shards of 6.
        let p = flat(&[&[3], &[5], &[2, 2]], 3, 1, 4);
        assert_eq!(p.flat_offsets(), vec![0, 4, 12]);
        assert_eq!(p.flat_numel, 18);
        assert_eq!(p.shard_numel, 6);
        assert_eq!(p.shard_numel_padded, 0);
        // rank 1 holds [6, 11]: param 1 elements 2..4 at offset 0; param 2 not at all.
        assert_eq!(p.in_shard(), vec![false, true, false]);
        assert_eq!(p.offset_in_shard(), vec![-1, 0, -1]);
        assert_eq!(p.intra_param_start(), vec![-1, 2, -1]);
        assert_eq!(p.intra_param_end(), vec![-1, 4, -1]);
        assert_eq!(p.numel_in_shard(), vec![-1, 3, -1]);
    }

    #[test]
    fn unaligned_tail_rank_is_padded() {
        // 10 elements over 4 ranks: chunks of 3, rank 3 holds 1 element + 2 zeros.
        let p = flat(&[&[10]], 4, 3, 0);
        assert_eq!((p.shard_numel, p.shard_numel_padded), (3, 2));
        assert_eq!(p.intra_param_start(), vec![9]);
        assert_eq!(p.intra_param_end(), vec![9]);
        // 2 elements over 4 ranks: chunks of 1, rank 3 gets nothing.
        let p = flat(&[&[2]], 4, 3, 0);
        assert_eq!((p.shard_numel, p.shard_numel_padded), (1, 1));
        assert_eq!(p.in_shard(), vec![false]);
    }

    #[test]
    fn empty_param_inside_a_shard_has_end_minus_one() {
        let p = flat(&[&[2], &[0], &[2]], 1, 0, 0);
        assert_eq!(p.in_shard(), vec![true, true, true]);
        assert_eq!(p.numel_in_shard(), vec![2, 0, 2]);
        assert_eq!(p.intra_param_end(), vec![1, -1, 1]);
    }

    #[test]
    fn rejects_bad_input() {
        let shapes = Shapes::new(&[1], &[4]).unwrap();
        assert!(matches!(
            FlatPlan::new(&shapes, 0, 0, 0),
            Err(PlanError::WorldSize { .. })
        ));
        assert!(matches!(
            FlatPlan::new(&shapes, 2, 2, 0),
            Err(PlanError::Rank { .. })
        ));
        assert!(matches!(
            FlatPlan::new(&shapes, 2, 0, -4),
            Err(PlanError::AlignedNumel { .. })
        ));
    }
}
