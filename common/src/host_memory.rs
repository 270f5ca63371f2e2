//! Whether a caller's pointer range is host memory this process may read and write, from the
//! kernel's map of the process (`/proc/self/maps`). Registration calls take raw addresses from
//! Python; an address that is not such memory (device memory a build does not recognise, as with
//! no CUDA driver found or another vendor's accelerator, an unmapped or read-only range) would be
//! dereferenced as host memory later and crash the process. Checked once, at registration.

/// Whether `[ptr, ptr + len)` lies wholly in mappings that are readable and writable. Where the
/// map cannot be read (not Linux), every range passes.
pub fn readable_and_writable(ptr: usize, len: usize) -> bool {
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => covered(&maps, ptr, len),
        Err(_) => true,
    }
}

/// `readable_and_writable` over the text of a maps file (lines in address order).
fn covered(maps: &str, ptr: usize, len: usize) -> bool {
    let Some(end) = ptr.checked_add(len) else {
        return false;
    };
    let mut from = ptr;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((start, stop)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(stop)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(stop, 16),
        ) else {
            continue;
        };
        if stop <= from {
            continue;
        }
        if start > from || !perms.starts_with("rw") {
            return false; // a hole, or memory that cannot be read and written
        }
        from = stop;
        if from >= end {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 rw-s 00000000 00:05 7 /memfd:pool (deleted)
5000-6000 r--p 00000000 00:00 0
7000-9000 ---p 00000000 00:00 0
";

    #[test]
    fn a_range_must_lie_in_readable_and_writable_mappings_without_holes() {
        assert!(covered(MAPS, 0x1000, 0x3000), "two adjacent rw mappings");
        assert!(covered(MAPS, 0x2fff, 2));
        assert!(!covered(MAPS, 0x3800, 0x1000), "runs into a hole");
        assert!(!covered(MAPS, 0x5000, 16), "read-only");
        assert!(
            !covered(MAPS, 0x7000, 16),
            "reserved, no access (as device address space)"
        );
        assert!(!covered(MAPS, 0x100, 16), "unmapped");
        assert!(!covered(MAPS, usize::MAX - 1, 16), "wraps");
    }

    #[test]
    fn this_process_heap_passes_and_the_null_page_does_not() {
        let v = vec![1u8; 1 << 20];
        assert!(readable_and_writable(v.as_ptr() as usize, v.len()));
        assert!(!readable_and_writable(16, 16));
    }
}
