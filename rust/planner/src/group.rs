//! The FSDP2 group plan: per-parameter metadata, the group-buffer layout and the
//! copy tile table, all from one pass over the shapes.
//!
//! [Note: FSDP2 sharding rule]
//! For a parameter `(d0, *rest)` with `inner = prod(rest)` and world size `W`,
//! FSDP2 takes `torch.chunk(param, W, dim=0)` and pads the list with empty
//! chunks. Every chunk but the tail has `c = ceil(d0 / W)` rows, so rank `r`
//! owns rows `[r*c, min((r+1)*c, d0))`, possibly none. The padded shard always
//! has `c` rows (the size of chunk 0). A chunk with zero elements reports size
//! `(0, *rest)` (torch's `_get_dim0_chunked_size`), so when `inner == 0` every
//! rank's sharded size has 0 rows even though the padded size has `c`.
//! Contiguous strides use `max(size, 1)` for every dim after the one they
//! describe, so the dim-0 size never enters them: the original, sharded,
//! padded and post-forward shards all share one stride table.
//!
//! [Note: Row layout]
//! The sharded buffer (orig dtype), one row of the all-gather buffer (param
//! dtype) and one row of the reduce-scatter input (reduce dtype) use the same
//! element offsets: each param's padded shard of `n = c * inner` elements
//! starts at a multiple of `align_numel = alignment / min(elem sizes)`. That
//! multiple is 16-byte aligned in every one of the three dtypes, so copy-in
//! (sharded -> all-gather row) and post-reduce (reduce-scatter output ->
//! sharded grads) are flat element-wise copies/casts over `S` elements with no
//! table at all, and the alignment gaps travel with the data (they hold
//! zeros). Each param's unsharded data (`W * n` elements, rank-major so it is
//! the padded param itself) starts at an aligned offset of the unsharded buffer.
//!
//! [Note: Tile table]
//! Copy-out (all-gather `[W, S]` -> unsharded) and reduce-scatter copy-in
//! (per-param gradients -> `[W, S]`) both walk each param's row segment
//! (`split_sizes[p]` elements, alignment gap included) once per rank, so one
//! table serves both: tile `t` covers `[tile_start, tile_start + tile_len)` of
//! param `tile_param`'s segment, and the kernel grid is `(num_tiles, W)`. The
//! tiles cover `[0, S)` exactly, so reduce-scatter copy-in writes every element
//! of its output (zeros in gaps and padding) and never needs a memset. Tiles
//! are `tile_numel` long (64Ki by default, the kernel looping in BLOCK pieces),
//! so the table has `sum(ceil(split / tile_numel)) <= P + S / tile_numel`
//! entries: for 1e12 elements over 1024 ranks, `S` ~ 1e9 and the table is
//! ~15k entries (a quarter of a MB) plus one per parameter.

use crate::arith::{add, align_up, ceil_div, is_pow2, mul};
use crate::error::{PlanError, Result};
use crate::shapes::{inner_numel, Shapes};

pub const DEFAULT_ALIGNMENT: i64 = 16;
pub const DEFAULT_TILE_NUMEL: i64 = 1 << 16;

/// Everything about a group except its shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupConfig {
    /// Ranks in the shard mesh dimension.
    pub world_size: i64,
    /// This process's rank in the shard mesh dimension.
    pub rank: i64,
    /// Bytes per element of the original (sharded, optimizer) dtype.
    pub orig_elem_size: i64,
    /// Bytes per element of the all-gather / unsharded (param) dtype.
    pub param_elem_size: i64,
    /// Bytes per element of the reduce-scatter (reduce) dtype.
    pub reduce_elem_size: i64,
    /// Byte alignment of every buffer segment (a power of two).
    pub alignment: i64,
    /// Shard world size after forward for `reshard_after_forward=int`.
    pub post_forward_world_size: Option<i64>,
    /// Elements per copy tile.
    pub tile_numel: i64,
}

impl GroupConfig {
    /// A config with fp32 everywhere and the default alignment and tile size.
    pub fn new(world_size: i64, rank: i64) -> Self {
        Self {
            world_size,
            rank,
            orig_elem_size: 4,
            param_elem_size: 4,
            reduce_elem_size: 4,
            alignment: DEFAULT_ALIGNMENT,
            post_forward_world_size: None,
            tile_numel: DEFAULT_TILE_NUMEL,
        }
    }

    fn validate(&self) -> Result<()> {
        let &Self {
            world_size,
            rank,
            alignment,
            tile_numel,
            ..
        } = self;
        if world_size < 1 {
            return Err(PlanError::WorldSize { world_size });
        }
        if !(0..world_size).contains(&rank) {
            return Err(PlanError::Rank { rank, world_size });
        }
        if let Some(pf) = self.post_forward_world_size {
            if pf < 1 || pf > world_size || world_size % pf != 0 {
                return Err(PlanError::PostForwardWorldSize {
                    post_forward_world_size: pf,
                    world_size,
                });
            }
        }
        if !is_pow2(alignment) {
            return Err(PlanError::Alignment { alignment });
        }
        for (name, size) in [
            ("orig_elem_size", self.orig_elem_size),
            ("param_elem_size", self.param_elem_size),
            ("reduce_elem_size", self.reduce_elem_size),
        ] {
            if !is_pow2(size) {
                return Err(PlanError::ElemSize { name, size });
            }
        }
        if !(1..=i64::from(i32::MAX)).contains(&tile_numel) {
            return Err(PlanError::TileNumel { tile_numel });
        }
        Ok(())
    }

    /// Element alignment shared by every row and unsharded segment
    /// ([Note: Row layout]).
    pub fn align_numel(&self) -> i64 {
        let min_elem = self
            .orig_elem_size
            .min(self.param_elem_size)
            .min(self.reduce_elem_size);
        (self.alignment / min_elem).max(1)
    }

    /// The rank inside the post-forward shard group: FSDP2 builds the
    /// post-forward mesh as `(W / F, F)`, so rank `r` sits at column `r % F`.
    pub fn post_forward_rank(&self) -> Option<i64> {
        self.post_forward_world_size.map(|pf| self.rank % pf)
    }
}

/// Bytes of each buffer of one group ([Note: Row layout]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BufferBytes {
    pub sharded: i64,
    pub all_gather: i64,
    pub unsharded: i64,
    pub reduce_scatter_input: i64,
    pub reduce_scatter_output: i64,
}

/// Every table for one FSDP2 parameter group. Sizes and offsets are in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    pub config: GroupConfig,
    pub align_numel: i64,
    /// `P + 1` prefix sums of ndims, indexing every concatenated table.
    pub dim_offsets: Vec<i64>,
    pub numel: Vec<i64>,
    pub chunk_rows: Vec<i64>,
    pub sharded_rows: Vec<i64>,
    pub sharded_numel: Vec<i64>,
    pub padded_sharded_numel: Vec<i64>,
    pub sharded_sizes: Vec<i64>,
    pub padded_sharded_sizes: Vec<i64>,
    pub contiguous_strides: Vec<i64>,
    pub post_forward_sizes: Option<Vec<i64>>,
    pub row_offsets: Vec<i64>,
    pub split_sizes: Vec<i64>,
    pub unsharded_offsets: Vec<i64>,
    pub tile_param: Vec<i32>,
    pub tile_start: Vec<i64>,
    pub tile_len: Vec<i32>,
    /// `S`: elements of the sharded buffer and of each all-gather / reduce-scatter row.
    pub row_numel: i64,
    pub unsharded_numel: i64,
    pub bytes: BufferBytes,
}

/// Rows of the chunk `rank` gets when `d0` rows are chunked `world_size` ways.
#[inline]
fn chunk_rows_of(d0: i64, inner: i64, chunk: i64, rank: i64) -> i64 {
    if inner == 0 {
        return 0;
    }
    // rank * chunk <= d0 + chunk * world_size fits: both factors are small.
    (d0 - rank.saturating_mul(chunk)).clamp(0, chunk)
}

impl GroupPlan {
    /// Plan a group. Pure arithmetic: no allocation beyond the output tables.
    pub fn new(shapes: &Shapes<'_>, config: GroupConfig) -> Result<Self> {
        config.validate()?;
        let num_params = shapes.len();
        let total_dims = shapes.total_dims();
        let world = config.world_size;
        let rank = config.rank;
        let align = config.align_numel();
        let pf = config
            .post_forward_world_size
            .zip(config.post_forward_rank());

        let mut dim_offsets = Vec::with_capacity(num_params + 1);
        let mut numel = Vec::with_capacity(num_params);
        let mut chunk_rows = Vec::with_capacity(num_params);
        let mut sharded_rows = Vec::with_capacity(num_params);
        let mut sharded_numel = Vec::with_capacity(num_params);
        let mut padded_sharded_numel = Vec::with_capacity(num_params);
        let mut sharded_sizes = Vec::with_capacity(total_dims);
        let mut padded_sharded_sizes = Vec::with_capacity(total_dims);
        let mut contiguous_strides = vec![0i64; total_dims];
        let mut post_forward_sizes = pf.map(|_| Vec::with_capacity(total_dims));
        let mut row_offsets = Vec::with_capacity(num_params);
        let mut split_sizes = Vec::with_capacity(num_params);
        let mut unsharded_offsets = Vec::with_capacity(num_params);

        let mut dim_start: usize = 0;
        let mut row_end: i64 = 0;
        let mut unsharded_end: i64 = 0;
        dim_offsets.push(0);
        for (index, shape) in shapes.iter().enumerate() {
            let at = Some(index);
            let ndim = shape.len();
            let d0 = shape[0];
            let inner = inner_numel(shape);
            let rest = &shape[1..];
            let chunk = ceil_div(d0, world);
            let rows = chunk_rows_of(d0, inner, chunk, rank);
            // chunk <= d0 and rows <= d0, so these products are at most numel.
            let padded = if d0 == 0 {
                0
            } else {
                mul(chunk, inner, at, "padded shard numel")?
            };

            numel.push(d0 * inner);
            chunk_rows.push(chunk);
            sharded_rows.push(rows);
            sharded_numel.push(rows * inner);
            padded_sharded_numel.push(padded);

            sharded_sizes.push(rows);
            sharded_sizes.extend_from_slice(rest);
            padded_sharded_sizes.push(chunk);
            padded_sharded_sizes.extend_from_slice(rest);
            if let (Some(sizes), Some((pf_world, pf_rank))) = (post_forward_sizes.as_mut(), pf) {
                sizes.push(chunk_rows_of(d0, inner, ceil_div(d0, pf_world), pf_rank));
                sizes.extend_from_slice(rest);
            }
            let strides = &mut contiguous_strides[dim_start..dim_start + ndim];
            let mut stride: i64 = 1;
            for axis in (0..ndim).rev() {
                strides[axis] = stride;
                if axis > 0 {
                    stride = mul(stride, shape[axis].max(1), at, "contiguous stride")?;
                }
            }

            row_offsets.push(row_end);
            let next_row = align_up(
                add(row_end, padded, at, "row offset")?,
                align,
                at,
                "row offset",
            )?;
            split_sizes.push(next_row - row_end);
            row_end = next_row;

            unsharded_offsets.push(unsharded_end);
            let unsharded = mul(padded, world, at, "unsharded numel")?;
            unsharded_end = align_up(
                add(unsharded_end, unsharded, at, "unsharded offset")?,
                align,
                at,
                "unsharded offset",
            )?;

            dim_start += ndim;
            dim_offsets.push(dim_start as i64);
        }

        let (tile_param, tile_start, tile_len) = tile_table(&split_sizes, config.tile_numel)?;
        let bytes = buffer_bytes(&config, row_end, unsharded_end)?;
        Ok(Self {
            config,
            align_numel: align,
            dim_offsets,
            numel,
            chunk_rows,
            sharded_rows,
            sharded_numel,
            padded_sharded_numel,
            sharded_sizes,
            padded_sharded_sizes,
            contiguous_strides,
            post_forward_sizes,
            row_offsets,
            split_sizes,
            unsharded_offsets,
            tile_param,
            tile_start,
            tile_len,
            row_numel: row_end,
            unsharded_numel: unsharded_end,
            bytes,
        })
    }

    pub fn num_params(&self) -> usize {
        self.numel.len()
    }

    pub fn num_tiles(&self) -> usize {
        self.tile_param.len()
    }

    /// Bytes of every table this plan owns.
    pub fn plan_bytes(&self) -> usize {
        let i64_tables = [
            &self.dim_offsets,
            &self.numel,
            &self.chunk_rows,
            &self.sharded_rows,
            &self.sharded_numel,
            &self.padded_sharded_numel,
            &self.sharded_sizes,
            &self.padded_sharded_sizes,
            &self.contiguous_strides,
            &self.row_offsets,
            &self.split_sizes,
            &self.unsharded_offsets,
            &self.tile_start,
        ];
        let pf = self.post_forward_sizes.as_ref().map_or(0, Vec::len);
        let i64_len: usize = i64_tables.iter().map(|t| t.len()).sum::<usize>() + pf;
        i64_len * 8 + (self.tile_param.len() + self.tile_len.len()) * 4
    }
}

/// Cut every row segment into tiles of at most `tile_numel` elements
/// ([Note: Tile table]).
fn tile_table(split_sizes: &[i64], tile_numel: i64) -> Result<(Vec<i32>, Vec<i64>, Vec<i32>)> {
    // Each term is at most i64::MAX / 1 but the sum of ceil(split / tile) is at
    // most S, which the row layout already bounded by i64::MAX.
    let count: i64 = split_sizes.iter().map(|&s| ceil_div(s, tile_numel)).sum();
    if count > i64::from(i32::MAX) {
        return Err(PlanError::TooManyTiles {
            num_tiles: count,
            tile_numel,
        });
    }
    let count = count as usize;
    let mut param = Vec::with_capacity(count);
    let mut start = Vec::with_capacity(count);
    let mut len = Vec::with_capacity(count);
    for (p, &split) in split_sizes.iter().enumerate() {
        // Shapes::new bounds the param count by i32::MAX; tile_numel too.
        let p = p as i32;
        let mut at = 0i64;
        while at < split {
            let n = tile_numel.min(split - at);
            param.push(p);
            start.push(at);
            len.push(n as i32);
            at += n;
        }
    }
    Ok((param, start, len))
}

fn buffer_bytes(config: &GroupConfig, row_numel: i64, unsharded_numel: i64) -> Result<BufferBytes> {
    let w = config.world_size;
    let bytes = |numel: i64, elem: i64, what| mul(numel, elem, None, what);
    Ok(BufferBytes {
        sharded: bytes(row_numel, config.orig_elem_size, "sharded buffer bytes")?,
        all_gather: bytes(
            mul(row_numel, w, None, "all-gather buffer numel")?,
            config.param_elem_size,
            "all-gather buffer bytes",
        )?,
        unsharded: bytes(
            unsharded_numel,
            config.param_elem_size,
            "unsharded buffer bytes",
        )?,
        reduce_scatter_input: bytes(
            mul(row_numel, w, None, "reduce-scatter buffer numel")?,
            config.reduce_elem_size,
            "reduce-scatter input bytes",
        )?,
        reduce_scatter_output: bytes(
            row_numel,
            config.reduce_elem_size,
            "reduce-scatter output bytes",
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(shapes: &[&[i64]], config: GroupConfig) -> GroupPlan {
        let ndims: Vec<i64> = shapes.iter().map(|s| s.len() as i64).collect();
        let dims: Vec<i64> = shapes.iter().flat_map(|s| s.iter().copied()).collect();
        GroupPlan::new(&Shapes::new(&ndims, &dims).unwrap(), config).unwrap()
    }

    fn rows_over_ranks(shape: &[i64], world: i64) -> Vec<i64> {
        (0..world)
            .map(|r| plan(&[shape], GroupConfig::new(world, r)).sharded_rows[0])
            .collect()
    }

    #[test]
    fn chunk_rule_matches_torch_chunk() {
        // torch.chunk(arange(5), 4) -> sizes [2, 2, 1] then one empty chunk.
        assert_eq!(rows_over_ranks(&[5], 4), vec![2, 2, 1, 0]);
        // d0 < W: ceil(3 / 8) = 1 row for ranks 0..3, none after.
        assert_eq!(rows_over_ranks(&[3, 7], 8), vec![1, 1, 1, 0, 0, 0, 0, 0]);
        // 6 rows over 4 ranks: chunks of 2, so rank 3 is empty (not 1-1-2-2).
        assert_eq!(rows_over_ranks(&[6], 4), vec![2, 2, 2, 0]);
        assert_eq!(rows_over_ranks(&[17, 257], 3), vec![6, 6, 5]);
    }

    #[test]
    fn sizes_and_strides() {
        let p = plan(
            &[&[17, 257], &[257], &[0, 3], &[5, 0, 2]],
            GroupConfig::new(8, 7),
        );
        assert_eq!(p.chunk_rows, vec![3, 33, 0, 1]);
        // rank 7: 17 - 21 < 0 -> 0 rows; 257 - 231 = 26 rows; d0 = 0; inner = 0 -> 0.
        assert_eq!(p.sharded_rows, vec![0, 26, 0, 0]);
        assert_eq!(p.sharded_sizes, vec![0, 257, 26, 0, 3, 0, 0, 2]);
        assert_eq!(p.padded_sharded_sizes, vec![3, 257, 33, 0, 3, 1, 0, 2]);
        assert_eq!(p.contiguous_strides, vec![257, 1, 1, 3, 1, 2, 2, 1]);
        assert_eq!(p.padded_sharded_numel, vec![771, 33, 0, 0]);
        assert_eq!(p.dim_offsets, vec![0, 2, 3, 5, 8]);
    }

    #[test]
    fn row_layout_is_aligned_in_every_dtype() {
        let mut config = GroupConfig::new(2, 0);
        config.param_elem_size = 2; // fp32 orig, bf16 param, fp32 reduce
        let p = plan(&[&[3], &[5, 2], &[1]], config);
        assert_eq!(p.align_numel, 8);
        // n = 2, 6, 1 -> offsets 0, 8, 16; S = 24.
        assert_eq!(p.row_offsets, vec![0, 8, 16]);
        assert_eq!(p.split_sizes, vec![8, 8, 8]);
        assert_eq!(p.row_numel, 24);
        // W * n = 4, 12, 2 -> 0, 8, 24; U = 32.
        assert_eq!(p.unsharded_offsets, vec![0, 8, 24]);
        assert_eq!(p.unsharded_numel, 32);
        assert_eq!(p.bytes.sharded, 24 * 4);
        assert_eq!(p.bytes.all_gather, 2 * 24 * 2);
        assert_eq!(p.bytes.reduce_scatter_input, 2 * 24 * 4);
    }

    #[test]
    fn tiles_cover_the_row_exactly() {
        let mut config = GroupConfig::new(3, 1);
        config.tile_numel = 7;
        config.alignment = 4;
        let p = plan(&[&[40, 3], &[0], &[2], &[1, 1]], config);
        let mut expected_start = 0;
        for t in 0..p.num_tiles() {
            let param = p.tile_param[t] as usize;
            let absolute = p.row_offsets[param] + p.tile_start[t];
            assert_eq!(absolute, expected_start);
            assert!(p.tile_len[t] >= 1 && p.tile_len[t] <= 7);
            expected_start += i64::from(p.tile_len[t]);
        }
        assert_eq!(expected_start, p.row_numel);
        assert!(!p.tile_param.contains(&1), "an empty param gets no tile");
    }

    #[test]
    fn post_forward_sizes_use_the_smaller_world() {
        let mut config = GroupConfig::new(8, 5);
        config.post_forward_world_size = Some(4);
        let p = plan(&[&[10, 2]], config);
        // post-forward rank 5 % 4 = 1, chunks of ceil(10 / 4) = 3 rows.
        assert_eq!(p.post_forward_sizes, Some(vec![3, 2]));
        assert_eq!(p.sharded_sizes, vec![0, 2]); // ceil(10/8) = 2, rank 5 starts at 10.
    }

    #[test]
    fn huge_dims_plan_or_report_overflow() {
        // 2**50 rows over 1024 ranks: 2**40 rows each, a table of 1024 big tiles.
        let d0 = 1i64 << 50;
        let mut config = GroupConfig::new(1024, 1023);
        config.tile_numel = 1 << 30;
        let p = plan(&[&[d0], &[3]], config);
        assert_eq!(p.chunk_rows, vec![1 << 40, 1]);
        assert_eq!(p.sharded_rows, vec![1 << 40, 0]);
        assert_eq!(p.unsharded_numel, d0 + 1024);
        assert_eq!(p.num_tiles(), 1025);
        assert_eq!(p.bytes.all_gather, 1024 * ((1 << 40) + 4) * 4);

        let single = |d0: i64, config: GroupConfig| {
            let ndims = [1i64];
            let dims = [d0];
            GroupPlan::new(&Shapes::new(&ndims, &dims).unwrap(), config).unwrap_err()
        };
        // W * n overflows: an error naming param 0, never a panic.
        let err = single(i64::MAX, GroupConfig::new(3, 0));
        assert!(
            matches!(err, PlanError::Overflow { index: Some(0), .. }),
            "{err:?}"
        );
        // A table too long to launch (or to allocate) is an error, not an abort.
        let mut bytes1 = GroupConfig::new(1024, 0);
        (
            bytes1.orig_elem_size,
            bytes1.param_elem_size,
            bytes1.reduce_elem_size,
        ) = (1, 1, 1);
        let err = single(i64::MAX / 1024 * 1024, bytes1);
        assert!(matches!(err, PlanError::TooManyTiles { .. }), "{err:?}");
    }

    #[test]
    fn rejects_bad_config() {
        let ndims = [1i64];
        let dims = [4i64];
        let shapes = Shapes::new(&ndims, &dims).unwrap();
        let bad = |f: fn(&mut GroupConfig)| {
            let mut c = GroupConfig::new(4, 1);
            f(&mut c);
            GroupPlan::new(&shapes, c).unwrap_err()
        };
        assert_eq!(
            bad(|c| c.world_size = 0),
            PlanError::WorldSize { world_size: 0 }
        );
        assert_eq!(
            bad(|c| c.rank = 4),
            PlanError::Rank {
                rank: 4,
                world_size: 4
            }
        );
        assert_eq!(
            bad(|c| c.alignment = 12),
            PlanError::Alignment { alignment: 12 }
        );
        assert!(matches!(
            bad(|c| c.param_elem_size = 3),
            PlanError::ElemSize { .. }
        ));
        assert!(matches!(
            bad(|c| c.tile_numel = 0),
            PlanError::TileNumel { .. }
        ));
        assert!(matches!(
            bad(|c| c.post_forward_world_size = Some(3)),
            PlanError::PostForwardWorldSize { .. }
        ));
    }
}
