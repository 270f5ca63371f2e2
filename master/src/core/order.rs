//! The order in which eviction considers objects.
//!
//! The default is CAR (Clock with Adaptive Replacement; Bansal and Modha, FAST '04): ARC's
//! policy on two clocks. New keys join the *recent* list; a key read again, or put again soon
//! after eviction took it, joins the *frequent* list; the split between the two adapts to which
//! list's recently evicted keys come back (see `ghosts`). Prefix caches are full of blocks used
//! once (a request's unshared tail), and CAR keeps them from flushing the blocks that are
//! shared. `Lru` is a single clock (second chance), an approximation of LRU as Mooncake evicts.
//!
//! Everything is O(1) per object: a read only sets a bit in the object, and each list is a FIFO
//! queue of 8-byte entries (a key's 32-bit hash and a sequence number) that eviction pops from
//! the front. An object knows the sequence number of its live entry; entries left behind by
//! objects that went away are recognised by a different one and dropped when met (or in one
//! sweep once they outnumber a quarter of the live ones).

use std::collections::VecDeque;

use super::ghosts::{GhostList, Ghosts};

/// What eviction keeps and what it takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionPolicy {
    /// Adaptive between recency and frequency, scan-resistant (CAR).
    #[default]
    Car,
    /// Least recently used first (approximated by a clock), as Mooncake.
    Lru,
}

impl std::str::FromStr for EvictionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "car" => Ok(EvictionPolicy::Car),
            "lru" => Ok(EvictionPolicy::Lru),
            _ => Err(format!("expected car or lru, got {s:?}")),
        }
    }
}

/// The two lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum List {
    Recent = 0,
    Frequent = 1,
}

impl List {
    fn ghost(self) -> GhostList {
        match self {
            List::Recent => GhostList::Recent,
            List::Frequent => GhostList::Frequent,
        }
    }
}

/// An object's standing in the order, one word kept in the object: the sequence number of its
/// live entry, whether it has one, its list, and whether it was read since eviction last saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place(u64);

impl Place {
    const LINKED: u64 = 1 << 32;
    const FREQUENT: u64 = 1 << 33;
    const REFERENCED: u64 = 1 << 34;

    /// Not in the order: no memory to evict (yet, or any more).
    pub const UNLINKED: Place = Place(0);

    fn new(seq: u32, list: List) -> Place {
        let list = if list == List::Frequent {
            Self::FREQUENT
        } else {
            0
        };
        Place(seq as u64 | Self::LINKED | list)
    }

    pub fn is_linked(self) -> bool {
        self.0 & Self::LINKED != 0
    }

    pub fn seq(self) -> u32 {
        self.0 as u32
    }

    pub fn is_frequent(self) -> bool {
        self.list() == List::Frequent
    }

    fn list(self) -> List {
        if self.0 & Self::FREQUENT != 0 {
            List::Frequent
        } else {
            List::Recent
        }
    }

    /// A read: the object gets a second chance (and, in the recent list, a move to the
    /// frequent one) when eviction reaches it.
    pub fn touch(&mut self) {
        if self.is_linked() {
            self.0 |= Self::REFERENCED;
        }
    }

    pub fn referenced(self) -> bool {
        self.0 & Self::REFERENCED != 0
    }

    /// Whether this place is the live one of the entry with `seq`.
    pub fn is_entry(self, seq: u32) -> bool {
        self.is_linked() && self.seq() == seq
    }
}

/// One queued entry: the key's 32-bit hash (it finds the object) and the sequence number that
/// tells a live entry from a stale one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub hash: u32,
    pub seq: u32,
}

/// A FIFO queue in chunks, so that its memory follows its length (a `VecDeque` doubles).
struct Queue {
    chunks: VecDeque<Vec<Entry>>,
    /// Entries already popped from the front chunk.
    head: usize,
    len: usize,
}

const CHUNK: usize = 1024;

impl Queue {
    fn new() -> Self {
        Queue {
            chunks: VecDeque::new(),
            head: 0,
            len: 0,
        }
    }

    fn push(&mut self, e: Entry) {
        match self.chunks.back_mut() {
            Some(c) if c.len() < CHUNK => c.push(e),
            _ => {
                let mut c = Vec::with_capacity(CHUNK);
                c.push(e);
                self.chunks.push_back(c);
            }
        }
        self.len += 1;
    }

    fn pop(&mut self) -> Option<Entry> {
        let front = self.chunks.front()?;
        let e = front[self.head];
        self.head += 1;
        self.len -= 1;
        if self.head == front.len() && (front.len() == CHUNK || self.len == 0) {
            self.chunks.pop_front();
            self.head = 0;
        }
        Some(e)
    }

    fn drain(&mut self) -> Vec<Entry> {
        let mut all = Vec::with_capacity(self.len);
        while let Some(e) = self.pop() {
            all.push(e);
        }
        all
    }

    fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<Entry>()
    }
}

/// What eviction found at the front of a list, and must settle with `keep`, `unlink` or
/// `evicted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Candidate {
    pub entry: Entry,
    pub list: List,
}

/// Counts for the operator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrderStats {
    /// Keys put again soon after eviction took them from the recent list (recency was losing).
    pub recent_ghost_hits: u64,
    /// Same, from the frequent list (frequency was losing).
    pub frequent_ghost_hits: u64,
    /// Objects in the recent and the frequent list.
    pub recent: u64,
    pub frequent: u64,
    /// CAR's target for the recent list, in objects.
    pub recent_target: u64,
}

pub(super) struct EvictionOrder {
    policy: EvictionPolicy,
    queues: [Queue; 2],
    /// Live entries per list (stale ones are in the queues too, until met).
    live: [usize; 2],
    stale: usize,
    next_seq: u32,
    /// CAR's `p`: how many objects the recent list should hold.
    recent_target: usize,
    ghosts: Ghosts,
    ghost_hits: [u64; 2],
}

impl EvictionOrder {
    pub fn new(policy: EvictionPolicy) -> Self {
        EvictionOrder {
            policy,
            queues: [Queue::new(), Queue::new()],
            live: [0; 2],
            stale: 0,
            next_seq: 0,
            recent_target: 0,
            ghosts: Ghosts::new(),
            ghost_hits: [0; 2],
        }
    }

    /// Objects in the order.
    pub fn len(&self) -> usize {
        self.live[0] + self.live[1]
    }

    fn push(&mut self, hash: u32, list: List) -> Place {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.queues[list as usize].push(Entry { hash, seq });
        self.live[list as usize] += 1;
        Place::new(seq, list)
    }

    /// A key's put started: it joins the recent list, or the frequent one when eviction took it
    /// lately (and the split between the lists moves toward the list it came back from).
    pub fn admit(&mut self, hash: u32) -> Place {
        if self.policy == EvictionPolicy::Lru {
            return self.push(hash, List::Recent);
        }
        let resident = self.len();
        let (b1, b2) = (
            self.ghosts.len(GhostList::Recent),
            self.ghosts.len(GhostList::Frequent),
        );
        match self.ghosts.take(hash) {
            Some(GhostList::Recent) => {
                self.ghost_hits[0] += 1;
                let step = (b2 / b1.max(1)).max(1);
                self.recent_target = (self.recent_target + step).min(resident);
                self.push(hash, List::Frequent)
            }
            Some(GhostList::Frequent) => {
                self.ghost_hits[1] += 1;
                let step = (b1 / b2.max(1)).max(1);
                self.recent_target = self.recent_target.saturating_sub(step);
                self.push(hash, List::Frequent)
            }
            None => {
                // CAR's bounds on the history: |T1| + |B1| <= c, and all four lists <= 2c,
                // each kept within a generation (a trim rebuilds the ghost table: once a
                // generation, not once a put).
                let slack = Ghosts::generation(resident);
                let t1 = self.live[List::Recent as usize];
                self.ghosts
                    .trim(GhostList::Recent, resident.saturating_sub(t1), slack);
                let b1 = self.ghosts.len(GhostList::Recent);
                self.ghosts.trim(
                    GhostList::Frequent,
                    (2 * resident).saturating_sub(resident + b1),
                    slack,
                );
                self.push(hash, List::Recent)
            }
        }
    }

    /// An object back in memory without a new put (a promotion from disk, a copy): it was read,
    /// so it joins the frequent list.
    pub fn relink(&mut self, hash: u32) -> Place {
        // Back in memory: not a key eviction took any more.
        self.ghosts.take(hash);
        let list = match self.policy {
            EvictionPolicy::Car => List::Frequent,
            EvictionPolicy::Lru => List::Recent,
        };
        self.push(hash, list)
    }

    /// The object left (or its memory went) other than by eviction: its entry is stale now.
    pub fn forget(&mut self, place: Place) {
        if place.is_linked() {
            self.live[place.list() as usize] -= 1;
            self.stale += 1;
        }
    }

    /// Whether stale entries outnumber a quarter of the live ones (then `compact`).
    pub fn wants_compaction(&self) -> bool {
        self.stale > 1024 && self.stale * 4 > self.len()
    }

    /// Drops stale entries, keeping the order of the live ones; `live` tells them apart.
    pub fn compact(&mut self, live: impl Fn(Entry) -> bool) {
        for q in &mut self.queues {
            for e in q.drain() {
                if live(e) {
                    q.push(e);
                }
            }
        }
        self.stale = 0;
    }

    /// Which list CAR's replacement takes from next, passing over lists the caller found
    /// nothing to take from this round; None when neither is left.
    fn list_to_take(&self, exhausted: [bool; 2]) -> Option<List> {
        let recent = self.live[List::Recent as usize];
        let frequent = self.live[List::Frequent as usize];
        let prefer_recent = match self.policy {
            EvictionPolicy::Lru => true,
            EvictionPolicy::Car => frequent == 0 || recent >= self.recent_target.max(1),
        };
        let usable = |l: List| self.live[l as usize] > 0 && !exhausted[l as usize];
        let (first, second) = if prefer_recent {
            (List::Recent, List::Frequent)
        } else {
            (List::Frequent, List::Recent)
        };
        [first, second].into_iter().find(|&l| usable(l))
    }

    /// Pops the front entry of the list CAR's replacement takes from next (see `list_to_take`);
    /// None when nothing is left. The caller resolves it to its object and settles it: `stale`
    /// when it has none, `second_chance` when the object was read since, else it is a
    /// `Candidate`.
    pub fn pop(&mut self, exhausted: [bool; 2]) -> Option<Candidate> {
        if self.len() == 0 {
            // Whatever is left in the queues is stale.
            self.queues = [Queue::new(), Queue::new()];
            self.stale = 0;
            return None;
        }
        let list = self.list_to_take(exhausted)?;
        let entry = self.queues[list as usize].pop()?;
        Some(Candidate { entry, list })
    }

    /// Live objects in `list`.
    pub fn live(&self, list: List) -> usize {
        self.live[list as usize]
    }

    /// The popped entry had no live object.
    pub fn stale(&mut self) {
        self.stale = self.stale.saturating_sub(1);
    }

    /// The popped object was read since eviction last saw it: back of the frequent list (of the
    /// only list with `Lru`), its bit cleared.
    pub fn second_chance(&mut self, c: Candidate) -> Place {
        let to = match self.policy {
            EvictionPolicy::Car => List::Frequent,
            EvictionPolicy::Lru => List::Recent,
        };
        self.live[c.list as usize] -= 1;
        self.push(c.entry.hash, to)
    }

    /// The candidate cannot go now (being read or written, pinned): back of its own list.
    pub fn keep(&mut self, c: Candidate) -> Place {
        self.live[c.list as usize] -= 1;
        self.push(c.entry.hash, c.list)
    }

    /// The candidate has no memory to free (it lives on disk only): out of the order.
    pub fn unlink(&mut self, c: Candidate) {
        self.live[c.list as usize] -= 1;
    }

    /// Eviction takes the candidate: out of the order, remembered as a ghost.
    pub fn evicted(&mut self, c: Candidate) {
        self.live[c.list as usize] -= 1;
        if self.policy == EvictionPolicy::Car {
            let resident = self.len();
            self.ghosts.add(c.entry.hash, c.list.ghost(), resident);
        }
    }

    /// What the operator sees.
    pub fn stats(&self) -> OrderStats {
        OrderStats {
            recent_ghost_hits: self.ghost_hits[0],
            frequent_ghost_hits: self.ghost_hits[1],
            recent: self.live[0] as u64,
            frequent: self.live[1] as u64,
            recent_target: self.recent_target as u64,
        }
    }

    /// Every live-looking entry with its list, for consistency checks (O(n)).
    pub fn entries(&self) -> impl Iterator<Item = (Entry, List)> + '_ {
        [List::Recent, List::Frequent]
            .into_iter()
            .flat_map(move |l| {
                let q = &self.queues[l as usize];
                q.chunks
                    .iter()
                    .enumerate()
                    .flat_map(move |(i, c)| c[if i == 0 { q.head } else { 0 }..].iter())
                    .map(move |e| (*e, l))
            })
    }

    /// Bytes the order holds beyond the objects themselves.
    pub fn bytes(&self) -> usize {
        self.queues.iter().map(Queue::bytes).sum::<usize>() + self.ghosts.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_pops_in_order_across_chunks_and_gives_memory_back() {
        let mut q = Queue::new();
        for i in 0..3 * CHUNK as u32 + 7 {
            q.push(Entry { hash: i, seq: i });
        }
        assert_eq!(q.bytes(), 4 * CHUNK * 8);
        for i in 0..2 * CHUNK as u32 {
            assert_eq!(q.pop().map(|e| e.seq), Some(i));
        }
        assert_eq!(q.bytes(), 2 * CHUNK * 8, "popped chunks are freed");
        let rest = q.drain();
        assert_eq!(rest.len(), CHUNK + 7);
        assert_eq!(rest[0].seq, 2 * CHUNK as u32);
        assert_eq!(q.pop(), None);
        q.push(Entry { hash: 1, seq: 1 });
        assert_eq!(q.pop().map(|e| e.seq), Some(1));
    }

    #[test]
    fn a_place_knows_its_entry_list_and_reads() {
        let mut order = EvictionOrder::new(EvictionPolicy::Car);
        let mut p = order.admit(42);
        assert!(p.is_linked() && !p.is_frequent() && !p.referenced());
        p.touch();
        assert!(p.referenced());
        let c = order.pop([false; 2]).unwrap();
        assert!(p.is_entry(c.entry.seq) && c.entry.hash == 42);
        let p2 = order.second_chance(c);
        assert!(p2.is_frequent() && !p2.referenced() && !p2.is_entry(c.entry.seq));
        let mut gone = Place::UNLINKED;
        gone.touch();
        assert!(
            !gone.is_linked() && !gone.referenced(),
            "no bit on an unlinked place"
        );
        // A key evicted and then back in memory without a put (a promotion) is no ghost.
        let mut order = EvictionOrder::new(EvictionPolicy::Car);
        order.admit(7);
        let c = order.pop([false; 2]).unwrap();
        order.evicted(c);
        order.relink(7);
        assert_eq!(order.ghosts.len(GhostList::Recent), 0);
        // With LRU there is one list.
        let mut lru = EvictionOrder::new(EvictionPolicy::Lru);
        lru.admit(1);
        let c = lru.pop([false; 2]).unwrap();
        assert!(!lru.second_chance(c).is_frequent());
    }

    /// A recent list holding about the whole cache (its ghost bound about zero) while the
    /// frequent list's ghosts are many: each put's eviction adds a recent ghost over the bound.
    /// The ghost table is rebuilt once a generation, not on every put. Before, every put
    /// rebuilt it: O(ghosts) per put.
    #[test]
    fn a_ghost_list_at_its_bound_is_trimmed_once_a_generation() {
        let n = 4096u32;
        let mut order = EvictionOrder::new(EvictionPolicy::Car);
        for h in 0..n {
            order.admit(h);
        }
        // Everything read once: all in the frequent list.
        for _ in 0..n {
            let c = order.pop([false; 2]).unwrap();
            order.second_chance(c);
        }
        // New keys push the frequent ones out into their ghosts, and the recent list fills.
        order.recent_target = n as usize;
        let mut next = n;
        let mut step = |order: &mut EvictionOrder| {
            order.admit(next);
            next += 1;
            let c = order.pop([false; 2]).unwrap();
            order.evicted(c);
        };
        for _ in 0..n {
            step(&mut order);
        }
        assert!(order.ghosts.len(GhostList::Frequent) > n as usize / 2);
        let before = order.ghosts.purges();
        let steps = 2048;
        for _ in 0..steps {
            step(&mut order);
        }
        let purges = order.ghosts.purges() - before;
        let generation = Ghosts::generation(n as usize) as u64;
        // A generation change, and a trim of each list, once a generation each.
        assert!(
            purges <= 3 * steps / generation + 2,
            "{purges} rebuilds of the ghost table in {steps} puts"
        );
    }
}
