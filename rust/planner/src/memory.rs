//! Peak-memory model for a sequence of parameter groups.
//!
//! [Note: Memory model]
//! Groups run in order in forward and in reverse in backward. The sharded
//! parameters (`persistent`) are always resident. Transient bytes:
//! - forward, at group `i`: its all-gather buffer and unsharded buffer (both
//!   live during copy-out), the all-gather buffers of the next `prefetch`
//!   groups (in flight), and, without `reshard_after_forward`, the unsharded
//!   buffers of every earlier group;
//! - backward, at group `i`: its unsharded buffer, its reduce-scatter input and
//!   output, the sharded gradients of the groups already reduced (`j > i`),
//!   and either (resharded after forward) its all-gather buffer plus the
//!   all-gather buffers of the `prefetch` groups before it, or (not resharded)
//!   the unsharded buffers of every earlier group, still resident from forward.
//!
//! `peak = persistent + max(forward, backward)`. The model ignores activations
//! and allocator fragmentation; it bounds what FSDP itself holds.

use crate::error::{PlanError, Result};

/// Per-group byte counts the model takes (one entry per group, in forward order).
#[derive(Debug, Clone, Copy)]
pub struct GroupBytes<'a> {
    pub sharded: &'a [i64],
    pub all_gather: &'a [i64],
    pub unsharded: &'a [i64],
    pub reduce_scatter_input: &'a [i64],
    pub reduce_scatter_output: &'a [i64],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeakMemory {
    pub persistent: i64,
    pub forward: i64,
    pub backward: i64,
    pub peak: i64,
}

fn overflow() -> PlanError {
    PlanError::Overflow {
        index: None,
        what: "peak memory",
    }
}

/// `prefix[i] = sum(values[..i])`, `P + 1` entries. Sums run in i128 so that
/// only the quantities the model reports must fit an i64, not every partial
/// sum (2**63 bytes per group times 2**63 groups still fits an i128).
fn prefix_sums(values: &[i64]) -> Vec<i128> {
    let mut prefix = Vec::with_capacity(values.len() + 1);
    let mut acc = 0i128;
    prefix.push(acc);
    for &v in values {
        acc += i128::from(v);
        prefix.push(acc);
    }
    prefix
}

fn to_i64(value: i128) -> Result<i64> {
    i64::try_from(value).map_err(|_| overflow())
}

pub fn peak_memory(
    groups: GroupBytes<'_>,
    prefetch: i64,
    reshard_after_forward: bool,
) -> Result<PeakMemory> {
    if prefetch < 0 {
        return Err(PlanError::Prefetch { prefetch });
    }
    let count = groups.sharded.len();
    let named = [
        ("sharded_bytes", groups.sharded),
        ("all_gather_bytes", groups.all_gather),
        ("unsharded_bytes", groups.unsharded),
        ("reduce_scatter_input_bytes", groups.reduce_scatter_input),
        ("reduce_scatter_output_bytes", groups.reduce_scatter_output),
    ];
    for (name, values) in named {
        if values.len() != count {
            return Err(PlanError::GroupLengths {
                name,
                expected: count,
                got: values.len(),
            });
        }
        if let Some((index, &value)) = values.iter().enumerate().find(|(_, &v)| v < 0) {
            return Err(PlanError::NegativeBytes { name, index, value });
        }
    }
    let ag = prefix_sums(groups.all_gather);
    let unsharded = prefix_sums(groups.unsharded);
    let sharded = prefix_sums(groups.sharded);
    let at = |values: &[i64], i: usize| i128::from(values[i]);
    let depth = usize::try_from(prefetch).unwrap_or(usize::MAX);
    let still_unsharded = |i: usize| {
        if reshard_after_forward {
            0
        } else {
            unsharded[i]
        }
    };

    let mut forward = 0i128;
    let mut backward = 0i128;
    for i in 0..count {
        let ahead_end = i.saturating_add(depth).min(count - 1) + 1;
        let live = at(groups.all_gather, i)
            + at(groups.unsharded, i)
            + (ag[ahead_end] - ag[i + 1])
            + still_unsharded(i);
        forward = forward.max(live);

        let gathering = if reshard_after_forward {
            at(groups.all_gather, i) + (ag[i] - ag[i.saturating_sub(depth)])
        } else {
            0
        };
        let live = gathering
            + at(groups.unsharded, i)
            + at(groups.reduce_scatter_input, i)
            + at(groups.reduce_scatter_output, i)
            + (sharded[count] - sharded[i + 1])
            + still_unsharded(i);
        backward = backward.max(live);
    }
    let persistent = sharded[count];
    Ok(PeakMemory {
        persistent: to_i64(persistent)?,
        forward: to_i64(forward)?,
        backward: to_i64(backward)?,
        peak: to_i64(persistent + forward.max(backward))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(prefetch: i64, reshard: bool) -> PeakMemory {
        let groups = GroupBytes {
            sharded: &[10, 20, 30],
            all_gather: &[80, 160, 240],
            unsharded: &[80, 160, 240],
            reduce_scatter_input: &[160, 320, 480],
            reduce_scatter_output: &[20, 40, 60],
        };
        peak_memory(groups, prefetch, reshard).unwrap()
    }

    #[test]
    fn forward_and_backward_peaks() {
        let m = run(1, true);
        assert_eq!(m.persistent, 60);
        // forward i=1: 160 + 160 + 240 (prefetch 2) = 560; i=2: 480.
        assert_eq!(m.forward, 560);
        // backward i=2: 240 + 160 + 240 + 480 + 60 = 1180.
        assert_eq!(m.backward, 1180);
        assert_eq!(m.peak, 1240);
        let m = run(0, false);
        // forward i=2: 240 + 240 + 80 + 160 = 720.
        assert_eq!(m.forward, 720);
        // backward i=2: 240 + 480 + 60 + 240 = 1020; i=1: 160 + 320 + 40 + 30 + 80 = 630.
        assert_eq!(m.backward, 1020);
    }

    #[test]
    fn rejects_bad_input() {
        let bad = GroupBytes {
            sharded: &[1],
            all_gather: &[1, 2],
            unsharded: &[1],
            reduce_scatter_input: &[1],
            reduce_scatter_output: &[1],
        };
        assert!(matches!(
            peak_memory(bad, 1, true),
            Err(PlanError::GroupLengths { .. })
        ));
        let neg = GroupBytes {
            all_gather: &[-1],
            ..bad
        };
        assert!(matches!(
            peak_memory(neg, 1, true),
            Err(PlanError::NegativeBytes { .. })
        ));
        let ok = GroupBytes {
            all_gather: &[1],
            ..bad
        };
        assert!(matches!(
            peak_memory(ok, -1, true),
            Err(PlanError::Prefetch { .. })
        ));
        let huge = GroupBytes {
            sharded: &[i64::MAX],
            unsharded: &[1],
            ..ok
        };
        assert!(matches!(
            peak_memory(huge, 1, true),
            Err(PlanError::Overflow { .. })
        ));
    }

    #[test]
    fn no_groups_no_memory() {
        let empty = GroupBytes {
            sharded: &[],
            all_gather: &[],
            unsharded: &[],
            reduce_scatter_input: &[],
            reduce_scatter_output: &[],
        };
        let m = peak_memory(empty, 2, true).unwrap();
        assert_eq!((m.persistent, m.forward, m.backward, m.peak), (0, 0, 0, 0));
    }
}
