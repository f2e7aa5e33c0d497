//! Splitting planner work over a few threads.
//!
//! [Note: Parallel planning]
//! Every per-parameter value depends only on that parameter's shape, and every
//! offset is an exclusive prefix sum of per-parameter segment lengths (segments
//! start aligned, so a segment's length `align_up(n)` does not depend on where
//! it starts). So the planner fills contiguous ranges of parameters on separate
//! threads with offsets relative to the range, then shifts each range by the
//! totals of the ranges before it. Small groups stay on the calling thread:
//! spawning costs more than planning a few thousand parameters.

use std::sync::OnceLock;

/// Groups smaller than this are planned on the calling thread.
pub const MIN_PARAMS_PER_THREAD: usize = 1 << 15;
const MAX_THREADS: usize = 8;

/// How many ranges to cut `num_params` parameters into.
pub fn num_chunks(num_params: usize) -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    let threads = *THREADS.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS)
    });
    (num_params / MIN_PARAMS_PER_THREAD).clamp(1, threads)
}

/// Run `f` on every item, one thread per item (the first on this thread), and
/// return the results in order.
pub fn map_chunks<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.into_iter().map(f).collect();
    }
    let f = &f;
    std::thread::scope(|scope| {
        let mut items = items.into_iter();
        let first = items.next().expect("at least two items");
        let handles: Vec<_> = items.map(|item| scope.spawn(move || f(item))).collect();
        let mut results = Vec::with_capacity(handles.len() + 1);
        results.push(f(first));
        for handle in handles {
            // A panic in a worker is re-raised here, where the binding catches it.
            results.push(
                handle
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p)),
            );
        }
        results
    })
}

/// Cut `slice` into consecutive pieces of the given lengths (summing to at
/// most its length), for handing disjoint parts of one table to threads.
pub fn split_lengths<T>(
    mut slice: &mut [T],
    lengths: impl IntoIterator<Item = usize>,
) -> Vec<&mut [T]> {
    lengths
        .into_iter()
        .map(|len| {
            let (head, tail) = std::mem::take(&mut slice).split_at_mut(len);
            slice = tail;
            head
        })
        .collect()
}

/// Cut `0..len` into `parts` contiguous ranges of nearly equal length.
pub fn even_bounds(len: usize, parts: usize) -> Vec<usize> {
    (0..=parts).map(|k| len * k / parts).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_chunks_keeps_order() {
        assert_eq!(
            map_chunks(vec![1, 2, 3, 4], |x| x * 10),
            vec![10, 20, 30, 40]
        );
        assert_eq!(map_chunks(Vec::<i32>::new(), |x| x), Vec::<i32>::new());
    }

    #[test]
    fn split_lengths_hands_out_consecutive_pieces() {
        let mut data = [1, 2, 3, 4, 5, 6];
        let pieces = split_lengths(&mut data, [2, 0, 3]);
        assert_eq!(
            pieces,
            vec![&mut [1, 2][..], &mut [][..], &mut [3, 4, 5][..]]
        );
    }

    #[test]
    fn bounds_cover_everything() {
        assert_eq!(even_bounds(10, 3), vec![0, 3, 6, 10]);
        assert_eq!(even_bounds(0, 1), vec![0, 0]);
        assert!(num_chunks(10) == 1 && num_chunks(1 << 30) >= 1);
    }
}
