//! Allocation of large tables.
//!
//! [Note: Huge pages for tables]
//! Planning 10^6 parameters writes ~130 MB of fresh tables. With 4 KiB pages
//! that is ~30k page faults, which cost more than the arithmetic. Tables are
//! allocated zeroed (untouched pages straight from the kernel) and, on Linux,
//! advised as huge-page candidates before the first write, so a 2 MiB region
//! faults once. Where transparent huge pages are off the advice is ignored.

use crate::parallel::{even_bounds, map_chunks, num_chunks, split_lengths};

/// A zeroed `Vec` of `len` elements, advised for huge pages when large.
pub fn zeroed<T: Clone + Default>(len: usize) -> Vec<T> {
    let table = vec![T::default(); len];
    advise_huge_pages(&table);
    table
}

/// A copy of `data` in a table allocated like [`zeroed`]; large copies are
/// split over threads ([Note: Parallel planning]).
pub fn copied<T: Clone + Default + Copy + Send + Sync>(data: &[T]) -> Vec<T> {
    let mut table = zeroed(data.len());
    let bounds = even_bounds(data.len(), num_chunks(data.len()));
    let lengths = bounds.windows(2).map(|pair| pair[1] - pair[0]);
    let sources = bounds.windows(2).map(|pair| &data[pair[0]..pair[1]]);
    let work: Vec<_> = split_lengths(&mut table, lengths)
        .into_iter()
        .zip(sources)
        .collect();
    map_chunks(work, |(to, from)| to.copy_from_slice(from));
    table
}

#[cfg(target_os = "linux")]
fn advise_huge_pages<T>(table: &[T]) {
    const HUGE: usize = 2 << 20;
    let bytes = std::mem::size_of_val(table);
    if bytes < 2 * HUGE {
        return;
    }
    let start = table.as_ptr() as usize;
    let aligned = (start + HUGE - 1) & !(HUGE - 1);
    let end = (start + bytes) & !(HUGE - 1);
    if end > aligned {
        // SAFETY: the range lies inside memory this process owns (the table's
        // buffer); MADV_HUGEPAGE only changes how it is backed, never its
        // contents, and its failure is harmless, so the result is ignored.
        unsafe {
            libc::madvise(
                aligned as *mut libc::c_void,
                end - aligned,
                libc::MADV_HUGEPAGE,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages<T>(_table: &[T]) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_zeroed_and_copied() {
        let big: Vec<i64> = zeroed(3 << 20);
        assert!(big.iter().all(|&v| v == 0));
        let data: Vec<i64> = (0..(1 << 20)).collect();
        assert_eq!(copied(&data), data);
        assert!(zeroed::<i32>(0).is_empty());
    }
}
