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

use crate::alloc::zeroed;
use crate::arith::{add, align_up, is_pow2, mul, Divisor};
use crate::error::{PlanError, Result};
use crate::parallel::{even_bounds, map_chunks, num_chunks, split_lengths};
use crate::shapes::{checked_numel, Shapes};
use std::ops::Range;

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
///
/// The int64 tables live back to back in one allocation, the tile table in
/// two more ([Note: Huge pages for tables]); accessors return slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    pub config: GroupConfig,
    pub align_numel: i64,
    /// `S`: elements of the sharded buffer and of each all-gather / reduce-scatter row.
    pub row_numel: i64,
    pub unsharded_numel: i64,
    pub bytes: BufferBytes,
    tables: Vec<i64>,
    spans: Spans,
    tile_start: Vec<i64>,
    /// `tile_param` then `tile_len`.
    tile_i32: Vec<i32>,
}

/// Where each table sits in `GroupPlan::tables`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Spans {
    numel: Range<usize>,
    chunk_rows: Range<usize>,
    sharded_rows: Range<usize>,
    sharded_numel: Range<usize>,
    padded_sharded_numel: Range<usize>,
    split_sizes: Range<usize>,
    row_offsets: Range<usize>,
    unsharded_offsets: Range<usize>,
    dim_offsets: Range<usize>,
    sharded_sizes: Range<usize>,
    padded_sharded_sizes: Range<usize>,
    contiguous_strides: Range<usize>,
    post_forward_sizes: Option<Range<usize>>,
}

macro_rules! table_accessors {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        impl GroupPlan {
            $(
                $(#[$doc])*
                pub fn $name(&self) -> &[i64] {
                    &self.tables[self.spans.$name.clone()]
                }
            )*
        }
    };
}

table_accessors!(
    /// `P + 1` prefix sums of ndims, indexing every concatenated table.
    dim_offsets,
    numel,
    /// `ceil(d0 / W)`: rows of every padded shard.
    chunk_rows,
    /// Rows this rank owns, unpadded.
    sharded_rows,
    sharded_numel,
    /// `n = chunk_rows * prod(dims[1..])`.
    padded_sharded_numel,
    /// Concatenated `FSDPParam.sharded_size`.
    sharded_sizes,
    /// Concatenated `FSDPParam.padded_sharded_param_size`.
    padded_sharded_sizes,
    /// Concatenated contiguous strides ([Note: FSDP2 sharding rule]).
    contiguous_strides,
    /// Each param's start in a row ([Note: Row layout]).
    row_offsets,
    /// Each param's row segment, alignment gap included.
    split_sizes,
    /// Each param's start in the unsharded buffer.
    unsharded_offsets,
);

impl GroupPlan {
    /// Concatenated `sharded_post_forward_size`, with a post-forward world size.
    pub fn post_forward_sizes(&self) -> Option<&[i64]> {
        self.spans
            .post_forward_sizes
            .clone()
            .map(|span| &self.tables[span])
    }

    /// Param index of each tile ([Note: Tile table]).
    pub fn tile_param(&self) -> &[i32] {
        &self.tile_i32[..self.tile_start.len()]
    }

    /// Start of each tile inside its param's row segment.
    pub fn tile_start(&self) -> &[i64] {
        &self.tile_start
    }

    /// Length of each tile.
    pub fn tile_len(&self) -> &[i32] {
        &self.tile_i32[self.tile_start.len()..]
    }
}

/// Cut `storage` into consecutive tables of the given lengths, with each
/// table's span in `storage`.
fn carve<const N: usize>(
    storage: &mut [i64],
    lens: [usize; N],
) -> ([&mut [i64]; N], [Range<usize>; N]) {
    let mut at = 0;
    let spans = lens.map(|len| {
        at += len;
        at - len..at
    });
    let tables = split_lengths(storage, lens)
        .try_into()
        .unwrap_or_else(|_| unreachable!("one table per length"));
    (tables, spans)
}

/// Rows of the chunk `rank` gets when `d0` rows are chunked `world_size` ways.
#[inline]
fn chunk_rows_of(d0: i64, inner: i64, chunk: i64, rank: i64) -> i64 {
    if inner == 0 {
        return 0;
    }
    // Saturating: past i64::MAX the rank starts beyond d0 anyway.
    (d0 - rank.saturating_mul(chunk)).clamp(0, chunk)
}

/// The output tables of one contiguous range of parameters.
struct Tables<'a> {
    numel: &'a mut [i64],
    chunk_rows: &'a mut [i64],
    sharded_rows: &'a mut [i64],
    sharded_numel: &'a mut [i64],
    padded_sharded_numel: &'a mut [i64],
    split_sizes: &'a mut [i64],
    row_offsets: &'a mut [i64],
    unsharded_offsets: &'a mut [i64],
    /// The range's entries of `dim_offsets` (without the final total).
    dim_offsets: &'a mut [i64],
    sharded_sizes: &'a mut [i64],
    padded_sharded_sizes: &'a mut [i64],
    contiguous_strides: &'a mut [i64],
    post_forward_sizes: Option<&'a mut [i64]>,
}

impl<'a> Tables<'a> {
    /// Split after `params` parameters holding `dims` sizes.
    fn split_at(self, params: usize, dims: usize) -> (Self, Self) {
        macro_rules! cut {
            ($($field:ident @ $at:expr),*) => {{
                $(let $field = self.$field.split_at_mut($at);)*
                let (pf_a, pf_b) = match self.post_forward_sizes {
                    Some(t) => {
                        let (a, b) = t.split_at_mut(dims);
                        (Some(a), Some(b))
                    }
                    None => (None, None),
                };
                (
                    Tables { $($field: $field.0,)* post_forward_sizes: pf_a },
                    Tables { $($field: $field.1,)* post_forward_sizes: pf_b },
                )
            }};
        }
        cut!(
            numel @ params, chunk_rows @ params, sharded_rows @ params,
            sharded_numel @ params, padded_sharded_numel @ params, split_sizes @ params,
            row_offsets @ params, unsharded_offsets @ params, dim_offsets @ params,
            sharded_sizes @ dims, padded_sharded_sizes @ dims, contiguous_strides @ dims
        )
    }

    /// Shift the range's offsets by the totals of the ranges before it.
    fn shift(&mut self, base: Totals, first_index: usize) -> Result<()> {
        let at = Some(first_index);
        let shift_all = |table: &mut [i64], by: i64, what| -> Result<()> {
            for value in table.iter_mut() {
                *value = add(*value, by, at, what)?;
            }
            Ok(())
        };
        shift_all(self.row_offsets, base.row, "row offset")?;
        shift_all(self.unsharded_offsets, base.unsharded, "unsharded offset")?;
        shift_all(self.dim_offsets, base.dims, "dim offset")
    }
}

/// What a range of parameters adds to each running offset.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    row: i64,
    unsharded: i64,
    dims: i64,
    tiles: i64,
}

impl Totals {
    fn checked_add(self, other: Totals) -> Result<Totals> {
        let what = "buffer size";
        Ok(Totals {
            row: add(self.row, other.row, None, what)?,
            unsharded: add(self.unsharded, other.unsharded, None, what)?,
            dims: self.dims + other.dims,
            tiles: self.tiles.saturating_add(other.tiles),
        })
    }
}

/// Fill one range's tables with offsets relative to the range's start
/// ([Note: FSDP2 sharding rule], [Note: Row layout]).
fn fill_range(
    shapes: &Shapes<'_>,
    first_index: usize,
    config: &GroupConfig,
    align: i64,
    t: &mut Tables<'_>,
) -> Result<Totals> {
    let world = config.world_size;
    let by_world = Divisor::new(world);
    let by_tile = Divisor::new(config.tile_numel);
    let rank = config.rank;
    let pf = config
        .post_forward_world_size
        .zip(config.post_forward_rank());
    let by_pf = pf.map(|(pf_world, pf_rank)| (Divisor::new(pf_world), pf_rank));
    let mut totals = Totals::default();
    let mut dim_start = 0usize;
    for (i, shape) in shapes.iter().enumerate() {
        let numel = checked_numel(first_index + i, shape)?;
        let at = Some(first_index + i);
        let ndim = shape.len();
        let dims = dim_start..dim_start + ndim;
        let sharded_sizes = &mut t.sharded_sizes[dims.clone()];
        let padded_sizes = &mut t.padded_sharded_sizes[dims.clone()];
        let strides = &mut t.contiguous_strides[dims.clone()];
        // From the last dim: sizes after dim 0 are copied as they are, strides
        // multiply max(size, 1), inner multiplies the sizes.
        let mut stride: i64 = 1;
        let mut inner: i64 = 1;
        for axis in (1..ndim).rev() {
            let size = shape[axis];
            sharded_sizes[axis] = size;
            padded_sizes[axis] = size;
            strides[axis] = stride;
            stride = mul(stride, size.max(1), at, "contiguous stride")?;
            // Saturates only when d0 == 0 (checked_numel checked the product).
            inner = inner.saturating_mul(size);
        }
        strides[0] = stride;
        let d0 = shape[0];
        let chunk = by_world.ceil_div(d0);
        let rows = chunk_rows_of(d0, inner, chunk, rank);
        sharded_sizes[0] = rows;
        padded_sizes[0] = chunk;
        if let (Some(sizes), Some((by_pf, pf_rank))) = (t.post_forward_sizes.as_deref_mut(), by_pf)
        {
            let sizes = &mut sizes[dims];
            sizes.copy_from_slice(shape);
            sizes[0] = chunk_rows_of(d0, inner, by_pf.ceil_div(d0), pf_rank);
        }
        // chunk <= d0 and rows <= d0, so these products are at most numel.
        let padded = if d0 == 0 { 0 } else { chunk * inner };
        t.numel[i] = numel;
        t.chunk_rows[i] = chunk;
        t.sharded_rows[i] = rows;
        t.sharded_numel[i] = rows * inner;
        t.padded_sharded_numel[i] = padded;

        // Segments start aligned, so their lengths do not depend on where.
        let split = align_up(padded, align, at, "row segment")?;
        let unsharded = mul(padded, world, at, "unsharded numel")?;
        let unsharded = align_up(unsharded, align, at, "unsharded numel")?;
        t.split_sizes[i] = split;
        t.row_offsets[i] = totals.row;
        t.unsharded_offsets[i] = totals.unsharded;
        t.dim_offsets[i] = totals.dims;
        totals.row = add(totals.row, split, at, "row offset")?;
        totals.unsharded = add(totals.unsharded, unsharded, at, "unsharded offset")?;
        totals.dims += ndim as i64;
        totals.tiles = totals.tiles.saturating_add(by_tile.ceil_div(split));
        dim_start += ndim;
    }
    Ok(totals)
}

impl GroupPlan {
    /// Plan a group: one pass over the shapes, split over a few threads for
    /// large groups ([Note: Parallel planning]).
    pub fn new(shapes: &Shapes<'_>, config: GroupConfig) -> Result<Self> {
        Self::with_ranges(shapes, config, num_chunks(shapes.len()))
    }

    /// [`GroupPlan::new`] with the parameters cut into `ranges` ranges.
    fn with_ranges(shapes: &Shapes<'_>, config: GroupConfig, ranges: usize) -> Result<Self> {
        config.validate()?;
        let num_params = shapes.len();
        let total_dims = shapes.total_dims();
        let align = config.align_numel();
        let has_pf = config.post_forward_world_size.is_some();

        let pf_len = if has_pf { total_dims } else { 0 };
        let p = num_params;
        let d = total_dims;
        let mut tables = zeroed(8 * p + (p + 1) + 3 * d + pf_len);
        let (
            [numel, chunk_rows, sharded_rows, sharded_numel, padded_sharded_numel, split_sizes, row_offsets, unsharded_offsets, dim_offsets, sharded_sizes, padded_sharded_sizes, contiguous_strides, post_forward_sizes],
            [s_numel, s_chunk_rows, s_sharded_rows, s_sharded_numel, s_padded_sharded_numel, s_split_sizes, s_row_offsets, s_unsharded_offsets, s_dim_offsets, s_sharded_sizes, s_padded_sharded_sizes, s_contiguous_strides, s_post_forward_sizes],
        ) = carve(
            &mut tables,
            [p, p, p, p, p, p, p, p, p + 1, d, d, d, pf_len],
        );
        let spans = Spans {
            numel: s_numel,
            chunk_rows: s_chunk_rows,
            sharded_rows: s_sharded_rows,
            sharded_numel: s_sharded_numel,
            padded_sharded_numel: s_padded_sharded_numel,
            split_sizes: s_split_sizes,
            row_offsets: s_row_offsets,
            unsharded_offsets: s_unsharded_offsets,
            dim_offsets: s_dim_offsets,
            sharded_sizes: s_sharded_sizes,
            padded_sharded_sizes: s_padded_sharded_sizes,
            contiguous_strides: s_contiguous_strides,
            post_forward_sizes: has_pf.then_some(s_post_forward_sizes),
        };
        let (dim_offsets, dim_total) = dim_offsets.split_at_mut(p);

        let mut rest = Tables {
            numel,
            chunk_rows,
            sharded_rows,
            sharded_numel,
            padded_sharded_numel,
            split_sizes,
            row_offsets,
            unsharded_offsets,
            dim_offsets,
            sharded_sizes,
            padded_sharded_sizes,
            contiguous_strides,
            post_forward_sizes: has_pf.then_some(post_forward_sizes),
        };
        let ranges = shapes.split(&even_bounds(num_params, ranges.max(1)));
        let mut work = Vec::with_capacity(ranges.len());
        for (first, range) in ranges {
            let (head, tail) = rest.split_at(range.len(), range.total_dims());
            work.push((first, range, head));
            rest = tail;
        }
        let filled = map_chunks(work, |(first, range, mut tables)| {
            let totals = fill_range(&range, first, &config, align, &mut tables)?;
            Ok::<_, PlanError>((first, totals, tables))
        });

        // Shift each range by the ranges before it, in order, so the first
        // error reported is the one at the lowest parameter index.
        let mut base = Totals::default();
        let mut tile_bases = Vec::with_capacity(filled.len());
        for result in filled {
            let (first, totals, mut tables) = result?;
            if first > 0 {
                tables.shift(base, first)?;
            }
            tile_bases.push((first, base.tiles));
            base = base.checked_add(totals)?;
        }
        dim_total[0] = base.dims;

        let split_sizes = &tables[spans.split_sizes.clone()];
        let (tile_start, tile_i32) =
            tile_table(split_sizes, &tile_bases, base.tiles, config.tile_numel)?;
        let bytes = buffer_bytes(&config, base.row, base.unsharded)?;
        Ok(Self {
            config,
            align_numel: align,
            row_numel: base.row,
            unsharded_numel: base.unsharded,
            bytes,
            tables,
            spans,
            tile_start,
            tile_i32,
        })
    }

    pub fn num_params(&self) -> usize {
        self.spans.numel.len()
    }

    pub fn num_tiles(&self) -> usize {
        self.tile_start.len()
    }

    /// Bytes of every table this plan owns.
    pub fn plan_bytes(&self) -> usize {
        (self.tables.len() + self.tile_start.len()) * 8 + self.tile_i32.len() * 4
    }
}

/// Cut every row segment into tiles of at most `tile_numel` elements
/// ([Note: Tile table]). `bases` holds `(first param, first tile)` per range.
fn tile_table(
    split_sizes: &[i64],
    bases: &[(usize, i64)],
    num_tiles: i64,
    tile_numel: i64,
) -> Result<(Vec<i64>, Vec<i32>)> {
    if num_tiles > i64::from(i32::MAX) {
        return Err(PlanError::TooManyTiles {
            num_tiles,
            tile_numel,
        });
    }
    let count = num_tiles as usize;
    let mut start: Vec<i64> = zeroed(count);
    let mut param_len: Vec<i32> = zeroed(2 * count);
    let (param, len) = param_len.split_at_mut(count);
    // Range k owns tiles [bases[k].1, bases[k + 1].1) and params [bases[k].0, bases[k + 1].0).
    let ends = bases
        .iter()
        .skip(1)
        .copied()
        .chain([(split_sizes.len(), num_tiles)]);
    let spans: Vec<_> = bases.iter().copied().zip(ends).collect();
    let tile_counts = || spans.iter().map(|&((_, a), (_, b))| (b - a) as usize);
    let work: Vec<_> = spans
        .iter()
        .zip(split_lengths(param, tile_counts()))
        .zip(split_lengths(&mut start, tile_counts()))
        .zip(split_lengths(len, tile_counts()))
        .map(|(((&((first, _), (end, _)), p), s), l)| (first, &split_sizes[first..end], p, s, l))
        .collect();
    map_chunks(work, |(first, splits, param, start, len)| {
        let mut t = 0usize;
        for (i, &split) in splits.iter().enumerate() {
            // Shapes::new bounds the param count by i32::MAX; tile_numel too.
            let p = (first + i) as i32;
            let mut at = 0i64;
            while at < split {
                let n = tile_numel.min(split - at);
                param[t] = p;
                start[t] = at;
                len[t] = n as i32;
                at += n;
                t += 1;
            }
        }
    });
    Ok((start, param_len))
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
            .map(|r| plan(&[shape], GroupConfig::new(world, r)).sharded_rows()[0])
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
        assert_eq!(p.chunk_rows(), vec![3, 33, 0, 1]);
        // rank 7: 17 - 21 < 0 -> 0 rows; 257 - 231 = 26 rows; d0 = 0; inner = 0 -> 0.
        assert_eq!(p.sharded_rows(), vec![0, 26, 0, 0]);
        assert_eq!(p.sharded_sizes(), vec![0, 257, 26, 0, 3, 0, 0, 2]);
        assert_eq!(p.padded_sharded_sizes(), vec![3, 257, 33, 0, 3, 1, 0, 2]);
        assert_eq!(p.contiguous_strides(), vec![257, 1, 1, 3, 1, 2, 2, 1]);
        assert_eq!(p.padded_sharded_numel(), vec![771, 33, 0, 0]);
        assert_eq!(p.dim_offsets(), vec![0, 2, 3, 5, 8]);
    }

    #[test]
    fn row_layout_is_aligned_in_every_dtype() {
        let mut config = GroupConfig::new(2, 0);
        config.param_elem_size = 2; // fp32 orig, bf16 param, fp32 reduce
        let p = plan(&[&[3], &[5, 2], &[1]], config);
        assert_eq!(p.align_numel, 8);
        // n = 2, 6, 1 -> offsets 0, 8, 16; S = 24.
        assert_eq!(p.row_offsets(), vec![0, 8, 16]);
        assert_eq!(p.split_sizes(), vec![8, 8, 8]);
        assert_eq!(p.row_numel, 24);
        // W * n = 4, 12, 2 -> 0, 8, 24; U = 32.
        assert_eq!(p.unsharded_offsets(), vec![0, 8, 24]);
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
            let param = p.tile_param()[t] as usize;
            let absolute = p.row_offsets()[param] + p.tile_start()[t];
            assert_eq!(absolute, expected_start);
            assert!(p.tile_len()[t] >= 1 && p.tile_len()[t] <= 7);
            expected_start += i64::from(p.tile_len()[t]);
        }
        assert_eq!(expected_start, p.row_numel);
        assert!(!p.tile_param().contains(&1), "an empty param gets no tile");
    }

    #[test]
    fn post_forward_sizes_use_the_smaller_world() {
        let mut config = GroupConfig::new(8, 5);
        config.post_forward_world_size = Some(4);
        let p = plan(&[&[10, 2]], config);
        // post-forward rank 5 % 4 = 1, chunks of ceil(10 / 4) = 3 rows.
        assert_eq!(p.post_forward_sizes(), Some(&[3, 2][..]));
        assert_eq!(p.sharded_sizes(), vec![0, 2]); // ceil(10/8) = 2, rank 5 starts at 10.
    }

    #[test]
    fn huge_dims_plan_or_report_overflow() {
        // 2**50 rows over 1024 ranks: 2**40 rows each, a table of 1024 big tiles.
        let d0 = 1i64 << 50;
        let mut config = GroupConfig::new(1024, 1023);
        config.tile_numel = 1 << 30;
        let p = plan(&[&[d0], &[3]], config);
        assert_eq!(p.chunk_rows(), vec![1 << 40, 1]);
        assert_eq!(p.sharded_rows(), vec![1 << 40, 0]);
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
    fn ranges_plan_like_one_pass() {
        // Mixed ranks, empty params and 3-D shapes, cut at uneven places.
        let shapes: Vec<Vec<i64>> = (0..5000i64)
            .map(|i| match i % 5 {
                0 => vec![i % 37],
                1 => vec![i % 11, 7],
                2 => vec![3, 0, i % 5 + 1],
                3 => vec![1 + i % 97, 2, 3],
                _ => vec![4096 + i, 16],
            })
            .collect();
        let ndims: Vec<i64> = shapes.iter().map(|s| s.len() as i64).collect();
        let dims: Vec<i64> = shapes.iter().flatten().copied().collect();
        let shapes = Shapes::new(&ndims, &dims).unwrap();
        let mut config = GroupConfig::new(6, 4);
        config.post_forward_world_size = Some(3);
        config.param_elem_size = 2;
        config.tile_numel = 1000;
        let one = GroupPlan::with_ranges(&shapes, config, 1).unwrap();
        for ranges in [2, 3, 7] {
            assert_eq!(
                GroupPlan::with_ranges(&shapes, config, ranges).unwrap(),
                one
            );
        }
        // The error names the lowest bad parameter even when later ranges fail too.
        let mut bad = dims.clone();
        let at = |p: usize| ndims[..p].iter().sum::<i64>() as usize;
        bad[at(4000)] = i64::MAX; // W * n overflows in the last range
        bad[at(2500)] = i64::MAX; // and in the middle one
        let shapes = Shapes::new(&ndims, &bad).unwrap();
        let err = GroupPlan::with_ranges(&shapes, config, 3).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::Overflow {
                    index: Some(2500),
                    ..
                }
            ),
            "{err:?}"
        );
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
