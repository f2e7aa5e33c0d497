//! Peak-memory model of one training step over a sequence of parameter groups.
//!
//! [Note: Memory model]
//! Groups run in order in forward and in reverse in backward, FSDP2's schedule.
//! Always live (`persistent`): the sharded parameters and `resident` bytes (the
//! optimizer states, the inputs). On top of that the model takes the largest
//! sum over these moments, per group `g`:
//!
//! forward, at `g`'s copy-out and after its compute:
//! - the activations saved by earlier groups, and what each earlier group holds
//!   from its forward to its backward (its unsharded buffer when it does not
//!   reshard after forward; its post-forward shard when it reshards to a
//!   smaller world; nothing otherwise);
//! - `g`'s all-gather and unsharded buffers, and the all-gather buffers of the
//!   `forward_prefetch` groups after it;
//! - with side streams (an accelerator), `g`'s all-gather output through its
//!   compute: fsdp-rs releases it when the next group waits for its own
//!   all-gather, before that group's copy-out (FSDP2 keeps it until after:
//!   one all-gather output more); without side streams it is freed at its
//!   own copy-out;
//! - after the compute, `g`'s own activations and its output;
//! - when accumulating, every group's gradients accumulated in earlier micro-steps.
//!
//! between them, the loss and the backward up to the first group: every
//! group's activations and forward holdings and `loss` bytes (the outputs, the
//! loss's own tensors and transients, measured by `activation_profile`); the
//! last group's all-gather output, which FSDP2 keeps into backward with side
//! streams, fsdp-rs releases at the root's post-forward;
//!
//! backward, while `g` computes its gradients and while it reduces them:
//! - the activations of `g` and the groups before it, the forward holdings of
//!   the groups before it, and the sharded gradients of the groups after it
//!   (already reduced);
//! - the all-gather buffers of the `prefetch` groups before `g` that reshard
//!   (in flight), and the gradient flowing in and out (`g`'s output and its
//!   predecessor's);
//! - computing: `g`'s unsharded parameters and what its backward holds: its
//!   activations, the gradient flowing in and out and its unsharded gradients
//!   or, where `activation_profile` measured it (`backward`), the most its
//!   backward held at once, which also sees the transients between its ops (a
//!   GELU's input gradient beside its output's) and the gradients as they
//!   appear, but no less than all its gradients and the one flowing out;
//!   plus the previous group's reduce-scatter input (a module sharded as
//!   several groups, one per dtype: its last one's, `reduce_scatter_kept`),
//!   which FSDP2 frees only when `g` reduces (with side streams); without them it is freed after its
//!   collective, and a group whose gradients fit there gathers them into a
//!   buffer in its place while autograd computes each (its gradients once
//!   more, at most);
//! - reducing: `g`'s reduce-scatter input, and its unsharded gradients or,
//!   once the copy-in has read and dropped them, its reduce-scatter output (its
//!   unsharded parameters are freed first);
//! - when accumulating: the accumulated gradients of the groups not yet
//!   reduced and, in a micro-step without synchronization, every group's (in
//!   the reduce dtype where accumulation widens them).
//!
//! `peak = persistent + max(forward, backward)`. Allocator rounding and
//! fragmentation, and the transients inside one op, are not modeled.

use crate::error::{PlanError, Result};

/// Per-group byte counts the model takes (one entry per group, in forward order).
#[derive(Debug, Clone, Copy)]
pub struct GroupBytes<'a> {
    pub sharded: &'a [i64],
    pub all_gather: &'a [i64],
    pub unsharded: &'a [i64],
    pub reduce_scatter_input: &'a [i64],
    pub reduce_scatter_output: &'a [i64],
    /// Reduce-scatter input still held after the group's reduction, into the
    /// next group's backward: its own input, or for a module sharded as several
    /// groups (one per dtype) the last one's, each releasing the one before.
    pub reduce_scatter_kept: &'a [i64],
    /// Sharded gradients kept after the reduction.
    pub gradient: &'a [i64],
    /// Gradients autograd produces for the unsharded parameters.
    pub unsharded_gradient: &'a [i64],
    /// Unsharded gradients kept between micro-steps (in the reduce dtype where
    /// accumulation widens them).
    pub accumulated_gradient: &'a [i64],
    /// Saved for backward by the group's forward.
    pub activation: &'a [i64],
    /// Kept from forward to backward by a group resharded to a smaller world.
    pub post_forward: &'a [i64],
    /// The group's outputs (the size of the gradient flowing into its backward).
    pub output: &'a [i64],
    /// The most the group's backward holds at once, measured (0: not measured;
    /// see the note).
    pub backward: &'a [i64],
}

/// How the step runs.
#[derive(Debug, Clone, Copy)]
pub struct Schedule<'a> {
    /// Groups all-gathered ahead in backward.
    pub prefetch: i64,
    /// Groups all-gathered ahead in forward.
    pub forward_prefetch: i64,
    /// Per group: resharded after forward (all-gathered again in backward).
    pub reshard_after_forward: &'a [bool],
    /// Bytes live for the whole step besides the sharded parameters.
    pub resident: i64,
    /// The most the loss and the backward up to the first group hold beyond
    /// the groups' activations (the model's outputs included).
    pub loss: i64,
    /// Gradients accumulate over micro-steps without synchronization.
    pub accumulate: bool,
    /// Collectives run on side streams (see the note).
    pub side_streams: bool,
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
fn prefix_sums(values: impl IntoIterator<Item = i64>) -> Vec<i128> {
    let mut acc = 0i128;
    std::iter::once(0)
        .chain(values.into_iter().map(|v| {
            acc += i128::from(v);
            acc
        }))
        .collect()
}

fn to_i64(value: i128) -> Result<i64> {
    i64::try_from(value).map_err(|_| overflow())
}

fn check(groups: &GroupBytes<'_>, schedule: &Schedule<'_>) -> Result<()> {
    let count = groups.sharded.len();
    let named = [
        ("sharded_bytes", groups.sharded),
        ("all_gather_bytes", groups.all_gather),
        ("unsharded_bytes", groups.unsharded),
        ("reduce_scatter_input_bytes", groups.reduce_scatter_input),
        ("reduce_scatter_output_bytes", groups.reduce_scatter_output),
        ("reduce_scatter_kept_bytes", groups.reduce_scatter_kept),
        ("gradient_bytes", groups.gradient),
        ("unsharded_gradient_bytes", groups.unsharded_gradient),
        ("accumulated_gradient_bytes", groups.accumulated_gradient),
        ("activation_bytes", groups.activation),
        ("post_forward_bytes", groups.post_forward),
        ("output_bytes", groups.output),
        ("backward_bytes", groups.backward),
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
    if schedule.reshard_after_forward.len() != count {
        return Err(PlanError::GroupLengths {
            name: "reshard_after_forward",
            expected: count,
            got: schedule.reshard_after_forward.len(),
        });
    }
    for (name, value) in [
        ("prefetch", schedule.prefetch),
        ("forward_prefetch", schedule.forward_prefetch),
        ("resident_bytes", schedule.resident),
        ("loss_bytes", schedule.loss),
    ] {
        if value < 0 {
            return Err(PlanError::NegativeCount { name, value });
        }
    }
    Ok(())
}

pub fn peak_memory(groups: GroupBytes<'_>, schedule: Schedule<'_>) -> Result<PeakMemory> {
    check(&groups, &schedule)?;
    let n = groups.sharded.len();
    let resharded = schedule.reshard_after_forward;
    let at = |values: &[i64], g: usize| i128::from(values[g]);
    let ag = prefix_sums(groups.all_gather.iter().copied());
    let regathered = prefix_sums((0..n).map(|g| {
        if resharded[g] {
            groups.all_gather[g]
        } else {
            0
        }
    }));
    let held = prefix_sums((0..n).map(|g| {
        if resharded[g] {
            groups.post_forward[g]
        } else {
            groups.unsharded[g]
        }
    }));
    let acts = prefix_sums(groups.activation.iter().copied());
    let grads = prefix_sums(groups.gradient.iter().copied());
    let accs = prefix_sums(groups.accumulated_gradient.iter().copied());
    let sharded = prefix_sums(groups.sharded.iter().copied());
    let back = usize::try_from(schedule.prefetch).unwrap_or(usize::MAX);
    let ahead = usize::try_from(schedule.forward_prefetch).unwrap_or(usize::MAX);
    let (accumulate, side) = (schedule.accumulate, schedule.side_streams);
    let accumulated = if accumulate { accs[n] } else { 0 };

    let mut forward = 0i128;
    for g in 0..n {
        let before = acts[g] + held[g];
        let prefetched = ag[g.saturating_add(ahead).min(n - 1) + 1] - ag[g + 1];
        // with side streams `g`'s all-gather output lives through its compute;
        // the previous group's is released before `g`'s copy-out
        let kept = if side { at(groups.all_gather, g) } else { 0 };
        let common = before + at(groups.unsharded, g) + prefetched + accumulated;
        let copy_out = common + at(groups.all_gather, g);
        let computed = common + at(groups.activation, g) + at(groups.output, g) + kept;
        forward = forward.max(copy_out).max(computed);
    }

    let mut backward = 0i128;
    if n > 0 {
        // the last all-gather output is released at the root's post-forward
        backward = acts[n] + held[n] + i128::from(schedule.loss) + accumulated;
    }
    for g in 0..n {
        let ugrad = at(groups.unsharded_gradient, g);
        let in_flight = regathered[g] - regathered[g.saturating_sub(back)];
        let reduced = grads[n] - grads[g + 1];
        let mut previous_rs = if g + 1 < n {
            at(groups.reduce_scatter_kept, g + 1)
        } else {
            0
        };
        if !side {
            previous_rs = if ugrad <= previous_rs { ugrad } else { 0 };
        }
        // accumulated gradients of the groups before `g`, and `g`'s reduced:
        // autograd's, or those accumulated so far
        let (earlier_acc, reduced_now) = if accumulate {
            (accs[g], at(groups.accumulated_gradient, g))
        } else {
            (0, ugrad)
        };
        let flowing_out = if g > 0 { at(groups.output, g - 1) } else { 0 };
        let base = acts[g] + held[g] + in_flight;
        // `g`'s backward under way: its parameters and what its backward holds
        let measured = at(groups.backward, g);
        let holds = if measured > 0 {
            measured.max(ugrad + flowing_out)
        } else {
            at(groups.activation, g) + at(groups.output, g) + ugrad + flowing_out
        };
        let own = at(groups.unsharded, g) + holds;
        // accumulating, `g`'s earlier gradients are live beside the fresh ones
        let own_acc = if accumulate { reduced_now } else { 0 };
        let computing = base + own + previous_rs + reduced + earlier_acc + own_acc;
        // The gradients are dropped after the copy-in, before the output exists.
        let reducing = base
            + flowing_out
            + at(groups.reduce_scatter_input, g)
            + reduced_now.max(at(groups.reduce_scatter_output, g))
            + reduced
            + earlier_acc;
        backward = backward.max(computing).max(reducing);
        if accumulate {
            backward = backward.max(base + own + accumulated);
        }
    }
    let persistent = sharded[n] + i128::from(schedule.resident);
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

    const NONE: [i64; 3] = [0; 3];

    fn groups<'a>(gradient: &'a [i64], activation: &'a [i64], output: &'a [i64]) -> GroupBytes<'a> {
        GroupBytes {
            sharded: &[10, 20, 30],
            all_gather: &[80, 160, 240],
            unsharded: &[80, 160, 240],
            reduce_scatter_input: &[160, 320, 480],
            reduce_scatter_output: &[20, 40, 60],
            reduce_scatter_kept: &[160, 320, 480],
            gradient,
            unsharded_gradient: &[80, 160, 240],
            accumulated_gradient: &[80, 160, 240],
            activation,
            post_forward: &NONE,
            output,
            backward: &NONE,
        }
    }

    fn schedule(reshard: &[bool], side_streams: bool) -> Schedule<'_> {
        Schedule {
            prefetch: 1,
            forward_prefetch: 0,
            reshard_after_forward: reshard,
            resident: 0,
            loss: 0,
            accumulate: false,
            side_streams,
        }
    }

    #[test]
    fn forward_and_backward_peaks() {
        let grads = [20, 40, 60];
        let m = peak_memory(groups(&grads, &NONE, &NONE), schedule(&[true; 3], true)).unwrap();
        assert_eq!(m.persistent, 60);
        // forward g=2: ag 240 + unsharded 240 = 480 (the previous all-gather
        // output is gone by this copy-out), and the same after its compute.
        assert_eq!(m.forward, 480);
        // backward computing g=1: in flight 80 + unsharded 160 + gradients 160
        // + reduce-scatter input of g=2 480 + reduced 60 = 940; reducing g=2:
        // in flight 160 + 480 + its gradients 240 (dropped before the output) = 880.
        assert_eq!(m.backward, 940);
        assert_eq!(m.peak, 1000);
        // Without side streams: the same forward (480), and g=1 gathers its 160 bytes of gradients where the 480 were (620),
        // so reducing g=2 is the peak.
        let m = peak_memory(groups(&grads, &NONE, &NONE), schedule(&[true; 3], false)).unwrap();
        assert_eq!(m.forward, 480);
        assert_eq!(m.backward, 880);
        // g=1's backward measured to hold 500 at once: computing g=1 is 80 in
        // flight + 160 + 500 + 480 + 60; measured below its gradients (160),
        // they still count.
        for (measured, want) in [(500, 1280), (100, 940)] {
            let backward = [0, measured, 0];
            let g = GroupBytes {
                backward: &backward,
                ..groups(&grads, &NONE, &NONE)
            };
            let m = peak_memory(g, schedule(&[true; 3], true)).unwrap();
            assert_eq!(m.backward, want);
        }
    }

    #[test]
    fn several_groups_keep_the_last_input() {
        // g=2 a module of two groups (400 + 80 of reduce-scatter input): the
        // second releases the first's, so g=1 computes beside 80, not 480.
        let grads = [20, 40, 60];
        let g = GroupBytes {
            reduce_scatter_kept: &[160, 320, 80],
            ..groups(&grads, &NONE, &NONE)
        };
        // computing g=1: 940 - 480 + 80 = 540; reducing g=2 (880) is the peak.
        let m = peak_memory(g, schedule(&[true; 3], true)).unwrap();
        assert_eq!(m.backward, 880);
    }

    #[test]
    fn activations_holdings_and_accumulation() {
        let acts = [5, 6, 7];
        let outs = [1, 2, 3];
        let reshard = [false, true, true];
        let g = groups(&[20, 40, 60], &acts, &outs);
        let m = peak_memory(g, schedule(&reshard, true)).unwrap();
        // forward g=2 after its compute: acts 11 + held 80 + its acts 7 + output 3
        // + unsharded 240 + its all-gather output, kept, 240 = 581.
        assert_eq!(m.forward, 581);
        // backward reducing g=2: acts 11 + held 80 + in flight 160 + out of g=1 2
        // + 480 + 240 = 973.
        assert_eq!(m.backward, 973);
        let acc = Schedule {
            accumulate: true,
            resident: 7,
            ..schedule(&reshard, true)
        };
        // the loss: activations 18 + held 80 + 1000 (the last all-gather
        // output is released before it).
        let loss = Schedule {
            loss: 1000,
            ..schedule(&reshard, true)
        };
        assert_eq!(peak_memory(g, loss).unwrap().backward, 1098);
        let m = peak_memory(g, acc).unwrap();
        assert_eq!(m.persistent, 67);
        // every unsharded gradient (480) is held through later micro-steps.
        assert_eq!(m.forward, 581 + 480);
        // a micro-step without sync, g=2: acts 18 + held 80 + in flight 160 +
        // outputs 5 + 240 + fresh gradients 240 + accumulated 480 = 1223.
        assert_eq!(m.backward, 1223);
    }

    #[test]
    fn rejects_bad_input() {
        let grads = [1, 2, 3];
        let ok = groups(&grads, &NONE, &NONE);
        let sched = schedule(&[true; 3], true);
        let short = GroupBytes {
            all_gather: &[1, 2],
            ..ok
        };
        assert!(matches!(
            peak_memory(short, sched),
            Err(PlanError::GroupLengths { .. })
        ));
        let neg = GroupBytes {
            activation: &[0, -1, 0],
            ..ok
        };
        assert!(matches!(
            peak_memory(neg, sched),
            Err(PlanError::NegativeBytes { .. })
        ));
        assert!(matches!(
            peak_memory(ok, schedule(&[true; 2], true)),
            Err(PlanError::GroupLengths { .. })
        ));
        for bad in [
            Schedule {
                prefetch: -1,
                ..sched
            },
            Schedule {
                forward_prefetch: -1,
                ..sched
            },
            Schedule {
                resident: -1,
                ..sched
            },
            Schedule { loss: -1, ..sched },
        ] {
            assert!(matches!(
                peak_memory(ok, bad),
                Err(PlanError::NegativeCount { .. })
            ));
        }
        let huge = GroupBytes {
            sharded: &[i64::MAX, 1, 0],
            ..ok
        };
        assert!(matches!(
            peak_memory(huge, sched),
            Err(PlanError::Overflow { .. })
        ));
    }

    #[test]
    fn no_groups_no_memory() {
        let e: &[i64] = &[];
        let empty = GroupBytes {
            sharded: e,
            all_gather: e,
            unsharded: e,
            reduce_scatter_input: e,
            reduce_scatter_output: e,
            reduce_scatter_kept: e,
            gradient: e,
            unsharded_gradient: e,
            accumulated_gradient: e,
            activation: e,
            post_forward: e,
            output: e,
            backward: e,
        };
        let m = peak_memory(empty, schedule(&[], true)).unwrap();
        assert_eq!((m.persistent, m.forward, m.backward, m.peak), (0, 0, 0, 0));
    }
}
