//! Module grouping: which consecutive modules share one `fully_shard` group.
//!
//! [Note: Module grouping]
//! A model of thousands of small modules, each its own `fully_shard` group, pays
//! every group's hooks and collectives per step (pytorch/pytorch#173680): the
//! step's host time grows with the number of groups, not with the bytes moved.
//! `auto_shard` therefore puts consecutive modules (in registration order, or
//! in the order one forward called them) into one group each, `fully_shard([m1,
//! m2, ...])`, until the group's unsharded bytes would pass a budget. A group
//! never holds more than the budget, except a single module larger than it
//! (nothing smaller is left to split it into), so the unsharded memory of a
//! step (a group and the one prefetched beside it) stays what the budget
//! implies. A module the user already passed to `fully_shard` keeps its own
//! group and ends the run before it: no group spans it (`boundary_before`).
//! Greedy and in order, which is optimal here: any grouping into consecutive
//! runs under the budget has at least as many groups as the greedy one.

use crate::error::{PlanError, Result};

/// The group of each unit: `unit_bytes[i]` unsharded bytes of unit `i`, in
/// order; `boundary_before[i]` starts a new group at unit `i`. Group ids start
/// at 0 and rise by one at each new group.
pub fn module_groups(
    unit_bytes: &[i64],
    boundary_before: &[bool],
    budget: i64,
) -> Result<Vec<i64>> {
    if budget < 1 {
        return Err(PlanError::GroupBudget { budget });
    }
    if unit_bytes.len() != boundary_before.len() {
        return Err(PlanError::UnitLengths {
            bytes: unit_bytes.len(),
            boundaries: boundary_before.len(),
        });
    }
    let mut groups = Vec::with_capacity(unit_bytes.len());
    let mut group = -1_i64;
    let mut held = 0_i64;
    for (index, (&bytes, &boundary)) in unit_bytes.iter().zip(boundary_before).enumerate() {
        if bytes < 0 {
            return Err(PlanError::NegativeBytes {
                name: "unit_bytes",
                index,
                value: bytes,
            });
        }
        let fits = held.checked_add(bytes).is_some_and(|sum| sum <= budget);
        if group < 0 || boundary || !fits {
            group += 1;
            held = bytes;
        } else {
            held += bytes;
        }
        groups.push(group);
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_until_the_budget() {
        let groups = module_groups(&[4, 4, 4, 4, 4], &[false; 5], 8).unwrap();
        assert_eq!(groups, vec![0, 0, 1, 1, 2]);
    }

    #[test]
    fn a_large_unit_stands_alone() {
        let groups = module_groups(&[2, 20, 2, 2], &[false; 4], 8).unwrap();
        assert_eq!(groups, vec![0, 1, 2, 2]);
    }

    #[test]
    fn boundaries_start_groups() {
        let groups = module_groups(&[1, 1, 1, 1], &[false, false, true, false], 100).unwrap();
        assert_eq!(groups, vec![0, 0, 1, 1]);
    }

    #[test]
    fn empty_and_zero_bytes() {
        assert_eq!(module_groups(&[], &[], 1).unwrap(), Vec::<i64>::new());
        assert_eq!(
            module_groups(&[0, 0, 5], &[false; 3], 5).unwrap(),
            vec![0, 0, 0]
        );
    }

    #[test]
    fn never_over_budget_unless_alone() {
        let bytes: Vec<i64> = (0..200).map(|i| (i * 7919) % 97).collect();
        let groups = module_groups(&bytes, &vec![false; bytes.len()], 150).unwrap();
        let count = (*groups.last().unwrap() + 1) as usize;
        let mut sums = vec![0_i64; count];
        let mut sizes = vec![0_usize; count];
        for (g, b) in groups.iter().zip(&bytes) {
            sums[*g as usize] += b;
            sizes[*g as usize] += 1;
        }
        for (g, (s, n)) in sums.iter().zip(&sizes).enumerate() {
            assert!(*s <= 150 || *n == 1, "group {g}: {s} bytes in {n} units");
        }
        // consecutive groups could not have been merged
        for g in 1..count {
            assert!(sums[g - 1] + sums[g] > 150 || sizes[g] == 0);
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        assert_eq!(
            module_groups(&[1], &[false], 0),
            Err(PlanError::GroupBudget { budget: 0 })
        );
        assert_eq!(
            module_groups(&[1, 2], &[false], 4),
            Err(PlanError::UnitLengths {
                bytes: 2,
                boundaries: 1
            })
        );
        assert_eq!(
            module_groups(&[1, -2], &[false; 2], 4),
            Err(PlanError::NegativeBytes {
                name: "unit_bytes",
                index: 1,
                value: -2
            })
        );
        // sums past i64::MAX start a new group instead of overflowing
        assert_eq!(
            module_groups(&[i64::MAX, 1], &[false; 2], i64::MAX).unwrap(),
            vec![0, 1]
        );
    }
}
