//! Keys that eviction took lately: CAR's history lists (B1 for keys taken from the recent list,
//! B2 for the frequent one). When such a key is put again, the list it was in says whether the
//! cache was losing by recency or by frequency, and the key goes straight to the frequent list.
//!
//! A key is a 27-bit fingerprint, tagged with its list and an age generation, in one open-
//! addressing array of `u32` kept between 7/12 and 7/8 full (4.6 to 6.9 bytes a ghost), and one
//! probe to ask. Keys are forgotten a generation (about a sixteenth of the cache) at a time, oldest
//! first, which keeps the lists in the FIFO order CAR wants without a link per key. A false hit
//! (two keys alike in 27 bits) only moves one key to the frequent list.

/// Which list a ghost came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GhostList {
    Recent = 0,
    Frequent = 1,
}

const GENS: usize = 16;
const GEN_BITS: u32 = 4;
const LIST_BIT: u32 = 1 << GEN_BITS;
const FINGERPRINT_SHIFT: u32 = GEN_BITS + 1;
/// The smallest generation, so that a tiny cache does not purge on every eviction.
const MIN_GEN: usize = 64;

pub(super) struct Ghosts {
    /// 0: empty; else fingerprint << 5 | list << 4 | generation.
    slots: Vec<u32>,
    len: [usize; 2],
    per_gen: [[usize; GENS]; 2],
    /// The generation new ghosts join, and how many joined it.
    gen: usize,
    gen_filled: usize,
    /// Table rebuilds so far (each O(table)).
    purges: u64,
}

impl Ghosts {
    pub fn new() -> Self {
        Ghosts {
            slots: vec![0; 64],
            len: [0; 2],
            per_gen: [[0; GENS]; 2],
            gen: 0,
            gen_filled: 0,
            purges: 0,
        }
    }

    #[cfg(test)]
    pub fn purges(&self) -> u64 {
        self.purges
    }

    pub fn len(&self, list: GhostList) -> usize {
        self.len[list as usize]
    }

    /// Bytes held, for the memory accounting.
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u32>()
    }

    fn fingerprint(hash: u32) -> u32 {
        (hash >> FINGERPRINT_SHIFT).max(1)
    }

    fn home(&self, fingerprint: u32) -> usize {
        // Multiplicative mixing, then the range reduction that needs no power of two.
        let mixed = fingerprint.wrapping_mul(0x9E37_79B1) as u64;
        ((mixed * self.slots.len() as u64) >> 32) as usize
    }

    /// Takes the ghost of `hash` out, saying which list it was in.
    pub fn take(&mut self, hash: u32) -> Option<GhostList> {
        let fp = Self::fingerprint(hash);
        let n = self.slots.len();
        let mut i = self.home(fp);
        loop {
            let e = self.slots[i];
            if e == 0 {
                return None;
            }
            if e >> FINGERPRINT_SHIFT == fp {
                self.delete_at(i);
                let list = Self::list_of(e);
                self.len[list as usize] -= 1;
                self.per_gen[list as usize][(e & (LIST_BIT - 1)) as usize] -= 1;
                return Some(list);
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
    }

    fn list_of(e: u32) -> GhostList {
        if e & LIST_BIT != 0 {
            GhostList::Frequent
        } else {
            GhostList::Recent
        }
    }

    /// Empties slot `i`, shifting later entries of the same run back (no tombstones).
    fn delete_at(&mut self, mut i: usize) {
        let n = self.slots.len();
        self.slots[i] = 0;
        let mut j = i;
        loop {
            j = if j + 1 == n { 0 } else { j + 1 };
            let e = self.slots[j];
            if e == 0 {
                return;
            }
            let home = self.home(e >> FINGERPRINT_SHIFT);
            // Move e back to i unless its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.slots[i] = e;
                self.slots[j] = 0;
                i = j;
            }
        }
    }

    /// Remembers that eviction took `hash` from `list`. `resident` (the objects in the cache)
    /// sizes the generations.
    pub fn add(&mut self, hash: u32, list: GhostList, resident: usize) {
        if self.gen_filled >= Self::generation(resident) {
            self.gen = (self.gen + 1) % GENS;
            self.gen_filled = 0;
            // The generation reused is the oldest one: its ghosts go.
            let gen = self.gen;
            if self.per_gen[0][gen] + self.per_gen[1][gen] > 0 {
                self.purge(|e| (e & (LIST_BIT - 1)) as usize == gen);
            }
        }
        let total = self.len[0] + self.len[1] + 1;
        if total * 8 > self.slots.len() * 7 {
            // Half again as many slots: growth stays amortised O(1), and the array never holds
            // more than 7 bytes a ghost.
            self.resize(total * 3 / 2);
        }
        let e = Self::fingerprint(hash) << FINGERPRINT_SHIFT
            | (list as u32) << GEN_BITS
            | self.gen as u32;
        self.insert(e);
        self.len[list as usize] += 1;
        self.per_gen[list as usize][self.gen] += 1;
        self.gen_filled += 1;
    }

    fn insert(&mut self, e: u32) {
        let n = self.slots.len();
        let mut i = self.home(e >> FINGERPRINT_SHIFT);
        while self.slots[i] != 0 {
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        self.slots[i] = e;
    }

    /// Forgets the oldest ghosts of `list` until at most `max` are left (a generation at a time,
    /// so it may leave fewer), once more than `max + slack` are: every trim rebuilds the table,
    /// so a list held at its bound by trimming one ghost per put would cost the whole table on
    /// every put.
    pub fn trim(&mut self, list: GhostList, max: usize, slack: usize) {
        let l = list as usize;
        if self.len[l] <= max.saturating_add(slack) {
            return;
        }
        let mut g = self.gen;
        while self.len[l] > max {
            g = (g + 1) % GENS;
            if self.per_gen[l][g] > 0 {
                let bit = (list as u32) << GEN_BITS;
                self.purge(|e| e & LIST_BIT == bit && (e & (LIST_BIT - 1)) as usize == g);
            }
        }
        // Shrink once the array is mostly air.
        let total = self.len[0] + self.len[1];
        if self.slots.len() > 256 && total * 4 < self.slots.len() {
            self.resize(total * 2);
        }
    }

    /// Ghosts that go per trim or generation change, at least: a generation's worth (see
    /// `trim`).
    pub fn generation(resident: usize) -> usize {
        (resident / GENS).max(MIN_GEN)
    }

    /// Drops every ghost for which `gone` holds, rebuilding the array.
    fn purge(&mut self, gone: impl Fn(u32) -> bool) {
        self.purges += 1;
        let n = self.slots.len();
        let old = std::mem::replace(&mut self.slots, vec![0; n]);
        for e in old.into_iter().filter(|&e| e != 0) {
            if gone(e) {
                let list = Self::list_of(e) as usize;
                self.len[list] -= 1;
                self.per_gen[list][(e & (LIST_BIT - 1)) as usize] -= 1;
            } else {
                self.insert(e);
            }
        }
    }

    fn resize(&mut self, slots: usize) {
        let slots = slots.max(64);
        let old = std::mem::replace(&mut self.slots, vec![0; slots]);
        for e in old.into_iter().filter(|&e| e != 0) {
            self.insert(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u32) -> u32 {
        i.wrapping_mul(0x85EB_CA6B).rotate_left(13) ^ 0x2F00_0000
    }

    #[test]
    fn a_ghost_is_found_once_with_its_list() {
        let mut g = Ghosts::new();
        for i in 0..1000 {
            let list = if i % 3 == 0 {
                GhostList::Frequent
            } else {
                GhostList::Recent
            };
            g.add(h(i), list, 100_000);
        }
        assert_eq!(g.len(GhostList::Frequent), 334);
        assert_eq!(g.len(GhostList::Recent), 666);
        for i in 0..1000 {
            let want = if i % 3 == 0 {
                GhostList::Frequent
            } else {
                GhostList::Recent
            };
            assert_eq!(g.take(h(i)), Some(want), "key {i}");
            assert_eq!(g.take(h(i)), None, "key {i} twice");
        }
        assert_eq!(g.len(GhostList::Recent) + g.len(GhostList::Frequent), 0);
        assert_eq!(g.take(h(5000)), None);
    }

    #[test]
    fn the_oldest_generations_go_first() {
        let mut g = Ghosts::new();
        // Generations of 64 (the minimum): 16 of them hold 1024 ghosts; the 17th evicts the first.
        for i in 0..1024 + 64 {
            g.add(h(i), GhostList::Recent, 0);
        }
        assert_eq!(g.len(GhostList::Recent), 1024 + 64 - 64);
        assert_eq!(g.take(h(0)), None, "the oldest generation was forgotten");
        assert_eq!(g.take(h(63)), None);
        assert_eq!(g.take(h(64)), Some(GhostList::Recent));
        g.trim(GhostList::Recent, 900, 0);
        assert!(g.len(GhostList::Recent) <= 900);
        assert_eq!(g.take(h(127)), None, "trim drops the oldest first");
        assert_eq!(
            g.take(h(1024 + 63)),
            Some(GhostList::Recent),
            "the newest stay"
        );
    }

    #[test]
    fn trim_keeps_the_other_list_and_deletes_keep_runs_intact() {
        let mut g = Ghosts::new();
        for i in 0..500 {
            g.add(h(i), GhostList::Recent, 0);
            g.add(h(10_000 + i), GhostList::Frequent, 0);
        }
        // Take every other ghost: backward shifting must keep the rest findable.
        for i in (0..500).step_by(2) {
            assert_eq!(g.take(h(i)), Some(GhostList::Recent));
        }
        for i in (1..500).step_by(2) {
            assert_eq!(g.take(h(i)), Some(GhostList::Recent), "key {i}");
        }
        g.trim(GhostList::Recent, 0, 0);
        assert_eq!(g.len(GhostList::Frequent), 500);
        g.trim(GhostList::Frequent, 0, 0);
        assert_eq!(g.len(GhostList::Frequent), 0);
        assert!(
            g.bytes() <= 4 * 1024,
            "shrinks when empty: {} bytes",
            g.bytes()
        );
    }
}
