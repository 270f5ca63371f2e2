//! Binned O(1) offset allocator (TLSF-style, after Sebastian Aaltonen's OffsetAllocator).
//!
//! Owns the bookkeeping of which `[offset, offset + size)` ranges of one owner memory segment
//! are handed out, and nothing else. It never reads, writes, maps or frees memory, and does not
//! know which segment it describes: turning an offset into an address and keeping that memory
//! alive is the caller's job. `allocate` and `free` must stay O(1) (bitmap scans and a bounded
//! number of list operations, never a walk over blocks), because they run on every placement
//! and removal.
//!
//! Free blocks sit in bins keyed by a tiny float of their size in granules: the exponent
//! (floor log2) picks one of 64 first-level bins and the next 3 bits one of 8 sub-bins.

/// Allocation granularity: every offset and reserved size is a multiple of this.
pub const GRANULE: u64 = 64;

const MANTISSA_BITS: u32 = 3;
const LEAF_BINS: usize = 1 << MANTISSA_BITS;
const TOP_BINS: usize = 64;
const BIN_COUNT: usize = TOP_BINS * LEAF_BINS;
/// Slab index meaning "no node"; also why the slab holds fewer than `u32::MAX - 1` nodes.
const NIL: u32 = u32::MAX;
/// `bin_prev` of a used block (used blocks sit in no bin): the used flag without a field of its
/// own, which keeps a node at 32 bytes (one per live object on a master).
const USED: u32 = u32::MAX - 1;

/// A live allocation. Not Clone/Copy: freeing consumes it, so a range cannot be freed twice.
/// Its size is the allocator's to tell (`OffsetAllocator::size_of`): a master keeps one of these
/// per object, so it holds only what a lookup needs.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "dropping an Allocation leaks its range; hand it back with OffsetAllocator::free"]
pub struct Allocation {
    offset: u64,
    node: u32,
    /// Which allocator handed it out (in what would be padding): a foreign free is caught.
    issuer: u32,
}

impl Allocation {
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// One physical block, free or used. Offsets and sizes are in granules so that the bin math
/// never has to divide.
#[derive(Clone, Copy, Debug)]
struct Node {
    offset: u64,
    size: u64,
    phys_prev: u32,
    phys_next: u32,
    /// The previous free block of the same bin, or USED.
    bin_prev: u32,
    bin_next: u32,
}

// One node per live allocation: the memory budget of a master's objects counts on 32 bytes.
const _: () = assert!(std::mem::size_of::<Node>() == 32);

impl Node {
    fn used(&self) -> bool {
        self.bin_prev == USED
    }
}

#[derive(Debug)]
pub struct OffsetAllocator {
    /// Tells this allocator's allocations from others' (process-wide counter, wraps).
    id: u32,
    capacity: u64,
    allocated: u64,
    live: usize,
    top_bitmap: u64,
    leaf_bitmaps: [u8; TOP_BINS],
    bin_heads: [u32; BIN_COUNT],
    nodes: Vec<Node>,
    /// Slab slots released by coalescing, reused before the slab grows.
    spare: Vec<u32>,
}

/// Bin whose lower bound is the largest one `<= size`: a free block filed here is at least as
/// large as every block the bin promises.
fn bin_round_down(size: u64) -> usize {
    if size < LEAF_BINS as u64 {
        return size as usize;
    }
    let shift = 63 - size.leading_zeros() - MANTISSA_BITS;
    let mantissa = (size >> shift) as usize & (LEAF_BINS - 1);
    ((shift as usize + 1) << MANTISSA_BITS) | mantissa
}

/// Smallest bin whose every block is `>= size`, so a request can take any block from it or
/// from a higher bin without looking at the block's size.
fn bin_round_up(size: u64) -> usize {
    let down = bin_round_down(size);
    down + usize::from(bin_size(down) != size)
}

/// Lower bound, in granules, of the sizes filed in `bin`.
fn bin_size(bin: usize) -> u64 {
    let exp = bin >> MANTISSA_BITS;
    let mantissa = (bin & (LEAF_BINS - 1)) as u64;
    if exp == 0 {
        mantissa
    } else {
        (mantissa | LEAF_BINS as u64) << (exp - 1)
    }
}

impl OffsetAllocator {
    /// Manages [0, capacity rounded down to GRANULE).
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity - capacity % GRANULE;
        static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let mut this = OffsetAllocator {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            capacity,
            allocated: 0,
            live: 0,
            top_bitmap: 0,
            leaf_bitmaps: [0; TOP_BINS],
            bin_heads: [NIL; BIN_COUNT],
            nodes: Vec::new(),
            spare: Vec::new(),
        };
        if capacity > 0 {
            let whole = this.new_node(0, capacity / GRANULE, NIL, NIL);
            this.insert_free(whole.expect("empty slab has room"));
        }
        this
    }

    /// An allocator over `capacity` in which exactly the `used` ranges (offset, size) are
    /// allocated, as when a master rebuilds a segment from what its owner reports; returns the
    /// allocations in the order given. The ranges must be sorted by offset, granule-aligned,
    /// inside the capacity and apart once rounded up to granules; None if they are not. One
    /// pass over the ranges, not one search per range.
    pub fn with_used(capacity: u64, used: &[(u64, u64)]) -> Option<(Self, Vec<Allocation>)> {
        let mut this = OffsetAllocator::new(0);
        this.capacity = capacity - capacity % GRANULE;
        let end = this.capacity / GRANULE;
        let mut allocations = Vec::with_capacity(used.len());
        let (mut at, mut prev) = (0u64, NIL);
        // Appends a block after `prev` in the physical chain.
        let mut append = |this: &mut Self, offset: u64, size: u64, used: bool| -> Option<u32> {
            let node = this.new_node(offset, size, prev, NIL)?;
            if prev != NIL {
                this.nodes[prev as usize].phys_next = node;
            }
            if used {
                this.nodes[node as usize].bin_prev = USED;
            } else {
                this.insert_free(node);
            }
            prev = node;
            Some(node)
        };
        for &(offset, size) in used {
            let granules = size.div_ceil(GRANULE);
            let first = offset / GRANULE;
            if size == 0 || offset % GRANULE != 0 || first < at || first + granules > end {
                return None;
            }
            if first > at {
                append(&mut this, at, first - at, false)?;
            }
            let node = append(&mut this, first, granules, true)?;
            this.allocated += granules * GRANULE;
            this.live += 1;
            allocations.push(Allocation {
                offset,
                node,
                issuer: this.id,
            });
            at = first + granules;
        }
        if at < end {
            append(&mut this, at, end - at, false)?;
        }
        Some((this, allocations))
    }

    /// None when size == 0 or no free block is large enough. O(1): bitmap scans, no loops over
    /// blocks.
    ///
    /// Good fit, not best fit: a block that fits but shares a bin with the request's size is only
    /// used if it heads that bin, so this can fail while `largest_free() >= size`. It cannot fail
    /// while `largest_free()` is at least `size` rounded up to the next bin boundary, which is
    /// less than 12.5% above `size`.
    pub fn allocate(&mut self, size: u64) -> Option<Allocation> {
        if size == 0 || size > self.capacity {
            return None;
        }
        let granules = size.div_ceil(GRANULE);
        let node = self.find_block(granules)?;
        let block = self.nodes[node as usize];
        let rest = block.size - granules;
        if rest > 0 {
            // Take the slab slot first: if the slab is exhausted nothing has been changed yet.
            let remainder = self.new_node(block.offset + granules, rest, node, block.phys_next)?;
            self.remove_free(node);
            if block.phys_next != NIL {
                self.nodes[block.phys_next as usize].phys_prev = remainder;
            }
            let taken = &mut self.nodes[node as usize];
            taken.phys_next = remainder;
            taken.size = granules;
            self.insert_free(remainder);
        } else {
            self.remove_free(node);
        }
        self.nodes[node as usize].bin_prev = USED;
        self.allocated += granules * GRANULE;
        self.live += 1;
        let offset = block.offset * GRANULE;
        Some(Allocation {
            offset,
            node,
            issuer: self.id,
        })
    }

    /// Returns the range, merging it with free physical neighbours (O(1)).
    pub fn free(&mut self, allocation: Allocation) {
        let Allocation {
            offset,
            node,
            issuer,
        } = allocation;
        // Allocation is not Clone, so a mismatch means it came from another allocator; acting
        // on it would corrupt the neighbour links, so release builds drop it.
        let valid = self
            .nodes
            .get(node as usize)
            .is_some_and(|n| issuer == self.id && n.used() && n.offset * GRANULE == offset);
        debug_assert!(valid, "free of a foreign allocation at {offset:#x}");
        if !valid {
            return;
        }
        let mut block = self.nodes[node as usize];
        self.allocated -= block.size * GRANULE;
        self.live -= 1;
        block.bin_prev = NIL;
        let prev = block.phys_prev;
        if prev != NIL && !self.nodes[prev as usize].used() {
            self.remove_free(prev);
            let p = self.nodes[prev as usize];
            block.offset = p.offset;
            block.size += p.size;
            block.phys_prev = p.phys_prev;
            self.spare.push(prev);
        }
        let next = block.phys_next;
        if next != NIL && !self.nodes[next as usize].used() {
            self.remove_free(next);
            let n = self.nodes[next as usize];
            block.size += n.size;
            block.phys_next = n.phys_next;
            self.spare.push(next);
        }
        if block.phys_prev != NIL {
            self.nodes[block.phys_prev as usize].phys_next = node;
        }
        if block.phys_next != NIL {
            self.nodes[block.phys_next as usize].phys_prev = node;
        }
        self.nodes[node as usize] = block;
        self.insert_free(node);
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes `allocation` reserves (its request rounded up to GRANULE).
    pub fn size_of(&self, allocation: &Allocation) -> u64 {
        match self.nodes.get(allocation.node as usize) {
            Some(n) if allocation.issuer == self.id && n.used() => n.size * GRANULE,
            _ => 0,
        }
    }

    pub fn allocated(&self) -> u64 {
        self.allocated
    }

    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.allocated
    }

    /// Size of the largest free block, exact. Walks one bin's list: keep it off hot paths.
    pub fn largest_free(&self) -> u64 {
        if self.top_bitmap == 0 {
            return 0;
        }
        let top = 63 - self.top_bitmap.leading_zeros() as usize;
        let leaf = 7 - self.leaf_bitmaps[top].leading_zeros() as usize;
        let mut largest = 0;
        let mut cursor = self.bin_heads[(top << MANTISSA_BITS) | leaf];
        while cursor != NIL {
            let n = &self.nodes[cursor as usize];
            largest = largest.max(n.size);
            cursor = n.bin_next;
        }
        largest * GRANULE
    }

    pub fn live_allocations(&self) -> usize {
        self.live
    }

    fn find_block(&self, granules: u64) -> Option<u32> {
        let up = bin_round_up(granules);
        if let Some(bin) = self.first_bin_from(up) {
            return Some(self.bin_heads[bin]);
        }
        // Without this, a request that is not on a bin boundary could never take a block of
        // exactly its size (e.g. the whole segment). Checking only the head keeps it O(1).
        let head = self.bin_heads[bin_round_down(granules)];
        (head != NIL && self.nodes[head as usize].size >= granules).then_some(head)
    }

    /// Lowest non-empty bin `>= bin`.
    fn first_bin_from(&self, bin: usize) -> Option<usize> {
        let top = bin >> MANTISSA_BITS;
        let leaves = self.leaf_bitmaps[top] & (0xFF_u8 << (bin & (LEAF_BINS - 1)));
        if leaves != 0 {
            return Some((top << MANTISSA_BITS) | leaves.trailing_zeros() as usize);
        }
        let tops = self.top_bitmap & u64::MAX.checked_shl(top as u32 + 1).unwrap_or(0);
        if tops == 0 {
            return None;
        }
        let top = tops.trailing_zeros() as usize;
        Some((top << MANTISSA_BITS) | self.leaf_bitmaps[top].trailing_zeros() as usize)
    }

    /// A free, not yet binned node; None only when the u32 slab indices are exhausted.
    fn new_node(&mut self, offset: u64, size: u64, phys_prev: u32, phys_next: u32) -> Option<u32> {
        let (bin_prev, bin_next) = (NIL, NIL);
        let node = Node {
            offset,
            size,
            phys_prev,
            phys_next,
            bin_prev,
            bin_next,
        };
        if let Some(index) = self.spare.pop() {
            self.nodes[index as usize] = node;
            return Some(index);
        }
        let index = u32::try_from(self.nodes.len()).ok().filter(|&i| i < USED)?;
        self.nodes.push(node);
        Some(index)
    }

    fn insert_free(&mut self, index: u32) {
        let bin = bin_round_down(self.nodes[index as usize].size);
        let head = self.bin_heads[bin];
        let node = &mut self.nodes[index as usize];
        node.bin_prev = NIL;
        node.bin_next = head;
        if head != NIL {
            self.nodes[head as usize].bin_prev = index;
        }
        self.bin_heads[bin] = index;
        self.leaf_bitmaps[bin >> MANTISSA_BITS] |= 1 << (bin & (LEAF_BINS - 1));
        self.top_bitmap |= 1 << (bin >> MANTISSA_BITS);
    }

    /// Unlinks a free node from its bin; must run before its size changes.
    fn remove_free(&mut self, index: u32) {
        let node = self.nodes[index as usize];
        let (bin_prev, bin_next) = (node.bin_prev, node.bin_next);
        if bin_next != NIL {
            self.nodes[bin_next as usize].bin_prev = bin_prev;
        }
        if bin_prev != NIL {
            self.nodes[bin_prev as usize].bin_next = bin_next;
            return;
        }
        let bin = bin_round_down(node.size);
        self.bin_heads[bin] = bin_next;
        if bin_next == NIL {
            let top = bin >> MANTISSA_BITS;
            self.leaf_bitmaps[top] &= !(1 << (bin & (LEAF_BINS - 1)));
            if self.leaf_bitmaps[top] == 0 {
                self.top_bitmap &= !(1 << top);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// Bins, bitmaps and the physical chain agree, and no two free blocks touch.
    fn assert_consistent(a: &OffsetAllocator) {
        let mut in_bins = 0;
        for bin in 0..BIN_COUNT {
            let bit = a.leaf_bitmaps[bin >> MANTISSA_BITS] >> (bin & (LEAF_BINS - 1)) & 1;
            assert_eq!(a.bin_heads[bin] != NIL, bit == 1);
            let (mut prev, mut cursor) = (NIL, a.bin_heads[bin]);
            while cursor != NIL {
                let n = a.nodes[cursor as usize];
                assert!(!n.used() && bin_round_down(n.size) == bin && n.bin_prev == prev);
                (in_bins, prev, cursor) = (in_bins + 1, cursor, n.bin_next);
            }
        }
        for top in 0..TOP_BINS {
            assert_eq!(a.leaf_bitmaps[top] != 0, a.top_bitmap >> top & 1 == 1);
        }
        let spare: HashSet<u32> = a.spare.iter().copied().collect();
        let mut cursor = (0..a.nodes.len() as u32)
            .find(|i| !spare.contains(i) && a.nodes[*i as usize].offset == 0)
            .unwrap_or(NIL);
        let (mut prev, mut end, mut free, mut walked) = (NIL, 0, 0, 0);
        while cursor != NIL {
            let n = a.nodes[cursor as usize];
            assert!(n.offset == end && n.phys_prev == prev && n.size > 0);
            let coalesced = n.used() || prev == NIL || a.nodes[prev as usize].used();
            assert!(coalesced, "adjacent free blocks at {end}");
            free += usize::from(!n.used());
            (prev, end, walked, cursor) = (cursor, end + n.size, walked + 1, n.phys_next);
        }
        assert_eq!((end * GRANULE, free), (a.capacity, in_bins));
        assert_eq!(walked + spare.len(), a.nodes.len());
    }

    #[test]
    fn zero_size_and_granule_rounding() {
        let mut a = OffsetAllocator::new(1 << 20);
        assert_eq!(a.allocate(0), None);
        let x = a.allocate(1).unwrap();
        let y = a.allocate(GRANULE + 1).unwrap();
        assert_eq!((x.offset(), a.size_of(&x)), (0, GRANULE));
        assert_eq!((y.offset(), a.size_of(&y)), (GRANULE, 2 * GRANULE));
        assert_eq!(a.allocated(), 3 * GRANULE);
    }

    #[test]
    fn capacity_not_multiple_of_granule() {
        let mut a = OffsetAllocator::new(1000);
        assert_eq!(a.capacity(), 960);
        assert!(a.allocate(960).is_some());
        assert_eq!(a.allocate(1), None);
        let mut tiny = OffsetAllocator::new(GRANULE - 1);
        assert_eq!((tiny.capacity(), tiny.largest_free()), (0, 0));
        assert_eq!(tiny.allocate(1), None);
    }

    #[test]
    fn exact_fit_full_and_reuse() {
        // 1000 granules is not a bin boundary: only the bin-head check can find this block.
        let mut a = OffsetAllocator::new(1000 * GRANULE);
        assert_ne!(bin_round_down(1000), bin_round_up(1000));
        let all = a.allocate(a.capacity()).unwrap();
        assert_eq!((all.offset(), a.size_of(&all)), (0, a.capacity()));
        assert_eq!((a.free_bytes(), a.largest_free()), (0, 0));
        assert_eq!(a.allocate(1), None);
        assert_eq!(a.allocate(u64::MAX), None);
        a.free(all);
        assert_eq!((a.allocated(), a.live_allocations()), (0, 0));
        assert!(a.allocate(1000 * GRANULE).is_some());
        assert_consistent(&a);
    }

    #[test]
    fn coalescing_restores_whole_capacity() {
        let mut a = OffsetAllocator::new(3 * 4096);
        let first = a.allocate(4096).unwrap();
        let middle = a.allocate(4096).unwrap();
        let last = a.allocate(4096).unwrap();
        a.free(first);
        a.free(last);
        assert_eq!(a.largest_free(), 4096);
        assert_eq!(a.allocate(2 * 4096), None);
        a.free(middle);
        assert_consistent(&a);
        assert!(a.allocate(3 * 4096).is_some());
    }

    #[test]
    fn large_segments() {
        let cap = 64 << 30;
        let mut a = OffsetAllocator::new(cap);
        let mut held: Vec<_> = (0..20_000u64)
            .map(|i| a.allocate((i * 7919 % 4096 + 1) * 1024).unwrap())
            .collect();
        held.push(a.allocate(16 << 30).unwrap());
        assert!(held.iter().all(|h| h.offset() + a.size_of(h) <= cap));
        let (even, odd): (Vec<_>, Vec<_>) =
            held.into_iter().enumerate().partition(|e| e.0 % 2 == 0);
        even.into_iter().for_each(|(_, h)| a.free(h));
        assert_consistent(&a);
        odd.into_iter().for_each(|(_, h)| a.free(h));
        assert_eq!((a.allocated(), a.largest_free()), (0, cap));
        assert!(a.allocate(cap).is_some());
        let mut huge = OffsetAllocator::new(1 << 48);
        let low = huge.allocate(1 << 47).unwrap();
        let high = huge.allocate(1 << 47).unwrap();
        assert_eq!((low.offset(), high.offset()), (0, 1 << 47));
        assert_eq!(huge.allocate(1), None);
    }

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "foreign allocation"))]
    fn foreign_free_is_ignored() {
        let mut a = OffsetAllocator::new(1 << 20);
        let mut b = OffsetAllocator::new(1 << 20);
        let _mine = a.allocate(GRANULE).unwrap();
        a.free(b.allocate(2 * GRANULE).unwrap());
        assert_eq!((a.allocated(), a.live_allocations()), (GRANULE, 1));
        assert_consistent(&a);
    }

    fn check(a: &OffsetAllocator, live: &[Allocation]) {
        let mut spans: Vec<(u64, u64)> = live.iter().map(|l| (l.offset(), a.size_of(l))).collect();
        spans.sort_unstable();
        let (mut end, mut gap) = (0, 0);
        for &(offset, size) in &spans {
            assert!(offset >= end && offset % GRANULE == 0 && size % GRANULE == 0 && size > 0);
            (gap, end) = (gap.max(offset - end), offset + size);
        }
        assert!(end <= a.capacity());
        assert_eq!(a.allocated(), spans.iter().map(|s| s.1).sum::<u64>());
        assert_eq!(a.free_bytes(), a.capacity() - a.allocated());
        assert_eq!(a.live_allocations(), live.len());
        // Fully coalesced free blocks are exactly the gaps between allocations.
        assert_eq!(a.largest_free(), gap.max(a.capacity() - end));
        assert_consistent(a);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn bins_bracket_sizes(size in 1u64..=1 << 58) {
            let (down, up) = (bin_round_down(size), bin_round_up(size));
            prop_assert!(bin_size(down) <= size && size < bin_size(down + 1));
            prop_assert!(bin_size(up) >= size && up - down <= 1 && up < BIN_COUNT);
        }

        /// `Some(size)` allocates, `None` frees a random live allocation.
        #[test]
        fn random_ops_keep_invariants(
            capacity in prop_oneof![0u64..=1 << 20, 1u64..=1 << 36],
            ops in prop::collection::vec((prop::option::weighted(
                0.6, prop_oneof![1u64..=256, 1u64..=1 << 16, 1u64..=1 << 30, 1u64..=1 << 34]
            ), any::<prop::sample::Index>()), 1..200),
        ) {
            let (mut a, mut live) = (OffsetAllocator::new(capacity), Vec::new());
            for (op, index) in ops {
                let largest = a.largest_free();
                match op.map(|size| (size, a.allocate(size))) {
                    Some((size, Some(got))) => {
                        prop_assert_eq!(a.size_of(&got), size.div_ceil(GRANULE) * GRANULE);
                        prop_assert!(a.size_of(&got) <= largest);
                        live.push(got);
                    }
                    // Failing is only allowed when no free block is guaranteed to fit.
                    Some((size, None)) => prop_assert!(size > a.capacity()
                        || bin_size(bin_round_up(size.div_ceil(GRANULE))) * GRANULE > largest),
                    None if !live.is_empty() => a.free(live.swap_remove(index.index(live.len()))),
                    None => {}
                }
                check(&a, &live);
            }
            live.into_iter().for_each(|l| a.free(l));
            prop_assert_eq!((a.allocated(), a.largest_free()), (0, a.capacity()));
            let all = a.allocate(a.capacity()).map(|all| (all.offset(), a.size_of(&all)));
            prop_assert_eq!(all, (a.capacity() > 0).then_some((0, a.capacity())));
        }
    }

    #[test]
    fn an_allocator_rebuilt_from_used_ranges_behaves_like_the_original() {
        let mut a = OffsetAllocator::new(1 << 20);
        let held: Vec<Allocation> = (0..50).map(|i| a.allocate(100 + i * 37).unwrap()).collect();
        let mut ranges: Vec<(u64, u64)> = held
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 3 != 0)
            .map(|(_, x)| (x.offset(), a.size_of(x)))
            .collect();
        ranges.sort();
        let (mut b, allocations) = OffsetAllocator::with_used(1 << 20, &ranges).unwrap();
        assert_consistent(&b);
        assert_eq!(b.live_allocations(), ranges.len());
        assert_eq!(b.allocated(), ranges.iter().map(|r| r.1).sum::<u64>());
        // New allocations never overlap the rebuilt ones; freeing everything coalesces back to
        // one block.
        let fresh: Vec<Allocation> = (0..40).filter_map(|i| b.allocate(64 + i * 11)).collect();
        for f in &fresh {
            for &(o, s) in &ranges {
                assert!(f.offset() + b.size_of(f) <= o || o + s <= f.offset());
            }
        }
        for x in allocations.into_iter().chain(fresh) {
            b.free(x);
        }
        assert_consistent(&b);
        assert_eq!(b.largest_free(), 1 << 20);
        // Misaligned, overlapping, unsorted or out-of-range input is refused.
        for bad in [
            vec![(10, 64)],
            vec![(0, 100), (64, 64)],
            vec![(128, 64), (0, 64)],
            vec![((1 << 20) - 64, 128)],
            vec![(0, 0)],
        ] {
            assert!(
                OffsetAllocator::with_used(1 << 20, &bad).is_none(),
                "{bad:?}"
            );
        }
        drop(held);
    }
}
