//! A stable 64-bit fingerprint of a group plan: equal on every rank that
//! planned the same group, whatever its rank.
//!
//! [Note: Plan fingerprints]
//! Ranks that shard different models (a layer width set differently on one
//! rank, parameters in another order, another mixed-precision dtype) issue
//! collectives of different sizes: gloo aborts, NCCL hangs or reads garbage.
//! The runtime therefore compares a digest of every group's plan across the
//! ranks before the first collective ([Note: Cross-rank plan check] in
//! `python/fsdp_rs/runtime/checks/plan_check.py`). A plan's part of that digest covers
//! what all ranks of a shard group compute alike: the config but the rank, the
//! buffer sizes and the rank-independent tables (numels, chunk rows, padded
//! shard sizes and numels, strides, row segments and offsets, unsharded
//! offsets). This rank's own shard sizes (`sharded_*`, `post_forward_sizes`)
//! differ between the ranks of one plan and are left out; the tile table
//! follows from the row segments and the tile size, which are in.
//!
//! The hash is a fixed function of the words, with no per-process seed and
//! not `std::hash` (whose algorithm may change between Rust releases), so
//! ranks running separate builds of one source agree. It is meant to catch
//! accidental differences, not to resist crafted ones.

use crate::group::GroupPlan;

const SEED: u64 = 0x6673_6470_2d72_7321; // "fsdp-rs!"
const MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 finalizer: every input bit flips about half the output bits.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An order-sensitive 64-bit hash over a stream of integer words.
#[derive(Debug, Clone)]
pub struct Fingerprint {
    state: u64,
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self::new()
    }
}

impl Fingerprint {
    pub fn new() -> Self {
        Self { state: SEED }
    }

    /// Add one word.
    #[inline]
    pub fn word(&mut self, word: i64) {
        self.state = (self.state.rotate_left(29) ^ mix(word as u64)).wrapping_mul(MULTIPLIER);
    }

    /// Add a table: its length, then its words (so that `[1, 2], [3]` and
    /// `[1], [2, 3]` differ).
    pub fn words(&mut self, words: &[i64]) {
        self.word(words.len() as i64);
        for &word in words {
            self.word(word);
        }
    }

    pub fn finish(&self) -> u64 {
        mix(self.state)
    }
}

impl GroupPlan {
    /// The plan's rank-independent digest ([Note: Plan fingerprints]).
    pub fn fingerprint(&self) -> u64 {
        let c = &self.config;
        let mut f = Fingerprint::new();
        for word in [
            c.world_size,
            c.orig_elem_size,
            c.param_elem_size,
            c.reduce_elem_size,
            c.alignment,
            c.post_forward_world_size.unwrap_or(0),
            c.tile_numel,
            self.align_numel,
            self.row_numel,
            self.unsharded_numel,
        ] {
            f.word(word);
        }
        for table in [
            self.numel(),
            self.chunk_rows(),
            self.padded_sharded_numel(),
            self.split_sizes(),
            self.row_offsets(),
            self.unsharded_offsets(),
            self.dim_offsets(),
            self.padded_sharded_sizes(),
            self.contiguous_strides(),
        ] {
            f.words(table);
        }
        f.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GroupConfig, Shapes};

    fn plan(shapes: &[&[i64]], config: GroupConfig) -> GroupPlan {
        let ndims: Vec<i64> = shapes.iter().map(|s| s.len() as i64).collect();
        let dims: Vec<i64> = shapes.iter().flat_map(|s| s.iter().copied()).collect();
        GroupPlan::new(&Shapes::new(&ndims, &dims).unwrap(), config).unwrap()
    }

    const SHAPES: &[&[i64]] = &[&[17, 3], &[5], &[0, 4], &[3, 2, 2]];

    #[test]
    fn equal_on_every_rank() {
        let world = 4;
        let first = plan(SHAPES, GroupConfig::new(world, 0)).fingerprint();
        for rank in 1..world {
            assert_eq!(
                plan(SHAPES, GroupConfig::new(world, rank)).fingerprint(),
                first
            );
            let config = GroupConfig {
                post_forward_world_size: Some(2),
                ..GroupConfig::new(world, rank)
            };
            let with_pf = GroupConfig {
                post_forward_world_size: Some(2),
                ..GroupConfig::new(world, 0)
            };
            assert_eq!(
                plan(SHAPES, config).fingerprint(),
                plan(SHAPES, with_pf).fingerprint()
            );
        }
    }

    #[test]
    fn differs_with_what_changes_the_collectives() {
        let base = GroupConfig::new(4, 1);
        let reference = plan(SHAPES, base).fingerprint();
        let with = |change: fn(&mut GroupConfig)| {
            let mut config = base;
            change(&mut config);
            plan(SHAPES, config)
        };
        let others = [
            plan(&[&[18, 3], &[5], &[0, 4], &[3, 2, 2]], base),
            plan(&[&[5], &[17, 3], &[0, 4], &[3, 2, 2]], base),
            plan(&[&[17, 3], &[5], &[0, 4]], base),
            plan(&[&[17, 3], &[5], &[0, 4], &[3, 4]], base),
            plan(SHAPES, GroupConfig::new(2, 1)),
            with(|c| c.param_elem_size = 2),
            with(|c| c.reduce_elem_size = 2),
            with(|c| c.orig_elem_size = 8),
            with(|c| c.alignment = 64),
            with(|c| c.post_forward_world_size = Some(2)),
            with(|c| c.tile_numel = 7),
        ];
        for (i, other) in others.iter().enumerate() {
            assert_ne!(other.fingerprint(), reference, "variant {i}");
        }
    }

    #[test]
    fn stable_across_builds() {
        // Ranks may run separate builds: these values must not change unless
        // the hash or the plan is changed on purpose (then update them here).
        let mut f = Fingerprint::new();
        f.words(&[1, 2, 3]);
        assert_eq!(f.finish(), 4_422_823_354_664_260_424);
        assert_eq!(
            plan(SHAPES, GroupConfig::new(4, 3)).fingerprint(),
            14_561_621_846_365_187_771
        );
    }

    #[test]
    fn table_boundaries_count() {
        let mut a = Fingerprint::new();
        a.words(&[1, 2]);
        a.words(&[3]);
        let mut b = Fingerprint::new();
        b.words(&[1]);
        b.words(&[2, 3]);
        assert_ne!(a.finish(), b.finish());
    }
}
