//! The master's objects by key. Each object is one allocation holding its own key (a shared
//! string); the table holds only a pointer per slot. A million objects then cost about 9 bytes of
//! table each (one pointer and one control byte, at the power-of-two slack a hash table keeps)
//! where a map from key to boxed object costs 25, and looking a key up still touches one slot and
//! one object.
//!
//! The table also keeps the eviction order (see `order`): every object with memory to free has
//! an entry there, made and dropped with the object here, so no path can forget it. Entries
//! name objects by a 32-bit hash of the key, and the table's hash is that same value spread to
//! 64 bits, so an entry finds its object in one probe.

use std::{borrow::Borrow, hash::BuildHasher};

use hashbrown::{hash_table::Entry, HashTable};

use super::{
    objects::Object,
    order::{Candidate, EvictionOrder, EvictionPolicy, List, OrderStats, Place},
};

/// Lists objects moved to on their second chance while eviction looked for a candidate.
#[derive(Debug, Default)]
pub struct Joins {
    /// To the back of the list they were taken from (a clock's turn).
    pub own: [bool; 2],
    /// From the other list (CAR's recent to frequent).
    pub moved: [bool; 2],
}

pub(super) struct ObjectTable {
    table: HashTable<Box<Object>>,
    /// Keys and bytes per tenant, kept with every insert, removal and resize here.
    usage: Usage,
    // Keys are ~100-byte strings looked up thousands of times per batch: a fast seeded hasher
    // (foldhash) instead of SipHash, still randomised per process against crafted collisions.
    hasher: foldhash::fast::RandomState,
    order: EvictionOrder,
}

/// The table's hash from the 32-bit one the eviction order keeps: the low half places the slot
/// and the top seven bits tag it, both from the same 32 bits.
fn spread(h32: u32) -> u64 {
    (h32 as u64) << 32 | h32 as u64
}

/// The 32-bit hash of a key from the 64-bit one.
fn fold(h: u64) -> u32 {
    (h ^ (h >> 32)) as u32
}

impl ObjectTable {
    pub fn new(policy: EvictionPolicy) -> Self {
        ObjectTable {
            table: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
            order: EvictionOrder::new(policy),
            usage: Usage::default(),
        }
    }

    /// Keys and bytes of tenant `name` ("" for the default tenant).
    pub fn usage_of(&self, name: &str) -> TenantUsage {
        self.usage.of(name)
    }

    /// Keys and bytes of every tenant that has (or had) objects.
    pub fn usage(&self) -> impl Iterator<Item = (&str, TenantUsage)> {
        self.usage.all()
    }

    /// Sets an object's size (an upsert in place), keeping its tenant's usage.
    pub fn resize(&mut self, key: &str, size: u64) {
        if let Some(o) = self.get_mut(key) {
            let old = std::mem::replace(&mut o.size, size);
            self.usage.change(key, -1, old);
            self.usage.change(key, 1, size);
        }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    fn hash32(&self, key: &str) -> u32 {
        fold(self.hasher.hash_one(key))
    }

    fn hash(&self, key: &str) -> u64 {
        spread(self.hash32(key))
    }

    pub fn get<K: Borrow<str> + ?Sized>(&self, key: &K) -> Option<&Object> {
        let key = key.borrow();
        self.table
            .find(self.hash(key), |o| o.key().as_str() == key)
            .map(|o| &**o)
    }

    pub fn get_mut<K: Borrow<str> + ?Sized>(&mut self, key: &K) -> Option<&mut Object> {
        let key = key.borrow();
        let hash = self.hash(key);
        self.table
            .find_mut(hash, |o| o.key().as_str() == key)
            .map(|o| &mut **o)
    }

    /// Stores `object` under its key, in the eviction order as a new key (or in the place of
    /// the object it replaces, which it returns).
    pub fn insert(&mut self, mut object: Box<Object>) -> Option<Box<Object>> {
        self.usage.change(object.key().as_str(), 1, object.size);
        let h32 = self.hash32(object.key().as_str());
        let hasher = &self.hasher;
        let key = object.key().as_str();
        let entry = self.table.entry(
            spread(h32),
            |o| o.key().as_str() == key,
            |o| spread(fold(hasher.hash_one(o.key().as_str()))),
        );
        match entry {
            Entry::Occupied(mut e) => {
                let mut place = e.get().place();
                if !place.is_linked() {
                    place = self.order.relink(h32);
                }
                place.touch();
                object.set_place(place);
                let mut old = std::mem::replace(e.get_mut(), object);
                old.set_place(Place::UNLINKED);
                self.usage.change(old.key().as_str(), -1, old.size);
                Some(old)
            }
            Entry::Vacant(e) => {
                object.set_place(self.order.admit(h32));
                e.insert(object);
                None
            }
        }
    }

    pub fn remove<K: Borrow<str> + ?Sized>(&mut self, key: &K) -> Option<Box<Object>> {
        let key = key.borrow();
        let hash = self.hash(key);
        let mut obj = match self.table.find_entry(hash, |o| o.key().as_str() == key) {
            Ok(e) => e.remove().0,
            Err(_) => return None,
        };
        self.order.forget(obj.place());
        obj.set_place(Place::UNLINKED);
        self.usage.change(key, -1, obj.size);
        self.maybe_compact();
        Some(obj)
    }

    /// Puts an object that got memory again (a promotion, a copy, an owner's report) back in
    /// the eviction order, if it was out.
    pub fn link<K: Borrow<str> + ?Sized>(&mut self, key: &K) {
        let key = key.borrow();
        let h32 = self.hash32(key);
        if let Some(o) = self
            .table
            .find_mut(spread(h32), |o| o.key().as_str() == key)
        {
            if !o.place().is_linked() {
                o.set_place(self.order.relink(h32));
            }
        }
    }

    /// Takes an object out of the eviction order (its memory is going) without evicting it
    /// through `next_candidate`.
    pub fn unlink_key<K: Borrow<str> + ?Sized>(&mut self, key: &K) {
        let key = key.borrow();
        let hash = self.hash(key);
        if let Some(o) = self.table.find_mut(hash, |o| o.key().as_str() == key) {
            self.order.forget(o.place());
            o.set_place(Place::UNLINKED);
        }
        self.maybe_compact();
    }

    fn maybe_compact(&mut self) {
        if self.order.wants_compaction() {
            let table = &self.table;
            self.order.compact(|e| {
                table
                    .find(spread(e.hash), |o| o.place().is_entry(e.seq))
                    .is_some()
            });
        }
    }

    /// Objects in the eviction order.
    pub fn order_len(&self) -> usize {
        self.order.len()
    }

    /// Objects in one list of the eviction order.
    pub fn order_live(&self, list: List) -> usize {
        self.order.live(list)
    }

    pub fn order_stats(&self) -> OrderStats {
        self.order.stats()
    }

    /// Bytes the eviction order holds beyond the objects.
    pub fn order_bytes(&self) -> usize {
        self.order.bytes()
    }

    /// The next object eviction should consider, by the policy, from a list not `exhausted`
    /// this round; objects read since it last looked get their second chance on the way, and
    /// `joins` marks the lists they moved to (each now holds an object the round has not
    /// looked at). The caller settles it with `keep`, `unlink` or `evicted`. None when nothing
    /// is left.
    pub fn next_candidate(&mut self, exhausted: [bool; 2], joins: &mut Joins) -> Option<Candidate> {
        loop {
            let c = self.order.pop(exhausted)?;
            let seq = c.entry.seq;
            match self
                .table
                .find_mut(spread(c.entry.hash), |o| o.place().is_entry(seq))
            {
                None => self.order.stale(),
                Some(o) if o.place().referenced() => {
                    let place = self.order.second_chance(c);
                    let to = usize::from(place.is_frequent());
                    if to == c.list as usize {
                        joins.own[to] = true;
                    } else {
                        joins.moved[to] = true;
                    }
                    o.set_place(place);
                }
                Some(_) => return Some(c),
            }
        }
    }

    fn candidate_mut(&mut self, c: Candidate) -> &mut Object {
        let seq = c.entry.seq;
        self.table
            .find_mut(spread(c.entry.hash), |o| o.place().is_entry(seq))
            .expect("a candidate's object stays until it is settled")
    }

    /// The object `next_candidate` found.
    pub fn candidate(&self, c: Candidate) -> &Object {
        let seq = c.entry.seq;
        self.table
            .find(spread(c.entry.hash), |o| o.place().is_entry(seq))
            .expect("a candidate's object stays until it is settled")
    }

    /// The candidate stays for now: back of its list.
    pub fn keep(&mut self, c: Candidate) {
        let place = self.order.keep(c);
        self.candidate_mut(c).set_place(place);
    }

    /// The candidate has no memory to free: out of the order until it gets some (`link`).
    pub fn unlink(&mut self, c: Candidate) {
        self.candidate_mut(c).set_place(Place::UNLINKED);
        self.order.unlink(c);
    }

    /// Eviction takes the candidate's memory: out of the order, remembered as a ghost.
    pub fn evicted(&mut self, c: Candidate) {
        self.candidate_mut(c).set_place(Place::UNLINKED);
        self.order.evicted(c);
    }

    /// Every object with memory is in the eviction order once, and the order counts right.
    pub fn check_order(&self) -> Result<(), String> {
        let entries: std::collections::HashSet<(u32, u32, bool)> = self
            .order
            .entries()
            .map(|(e, l)| (e.hash, e.seq, l == super::order::List::Frequent))
            .collect();
        let mut linked = 0;
        for o in self.iter() {
            let place = o.place();
            if place.is_linked() {
                linked += 1;
                let e = (
                    self.hash32(o.key().as_str()),
                    place.seq(),
                    place.is_frequent(),
                );
                if !entries.contains(&e) {
                    return Err(format!("{}: its eviction entry is missing", o.key()));
                }
            } else if !o.replicas.is_empty() {
                return Err(format!(
                    "{}: has memory but is not in the eviction order",
                    o.key()
                ));
            }
        }
        if linked != self.order.len() {
            return Err(format!(
                "{linked} objects are in the eviction order, it counts {}",
                self.order.len()
            ));
        }
        Ok(())
    }

    pub fn iter(&self) -> impl Iterator<Item = &Object> {
        self.table.iter().map(|o| &**o)
    }

    /// Objects to change in place. The key cannot change: `Object` gives no way to.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Object> {
        self.table.iter_mut().map(|o| &mut **o)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&mut Object) -> bool) {
        let order = &mut self.order;
        let usage = &mut self.usage;
        self.table.retain(|o| {
            let kept = keep(o);
            if !kept {
                order.forget(o.place());
                o.set_place(Place::UNLINKED);
                usage.change(o.key().as_str(), -1, o.size);
            }
            kept
        });
        self.maybe_compact();
    }
}

/// How many keys, and how many bytes of values, a tenant stores (each object's size once,
/// whatever its replicas and tiers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantUsage {
    pub keys: u64,
    pub bytes: u64,
}

/// Usage per tenant; the default tenant's apart, so most objects cost no map lookup.
#[derive(Default)]
struct Usage {
    default: TenantUsage,
    named: std::collections::HashMap<Box<str>, TenantUsage>,
}

impl Usage {
    fn change(&mut self, key: &str, keys: i64, bytes: u64) {
        let tenant = mooncake_common::tenant::tenant_of(key);
        let u = if tenant.is_empty() {
            &mut self.default
        } else if let Some(u) = self.named.get_mut(tenant) {
            u
        } else {
            self.named.entry(tenant.into()).or_default()
        };
        if keys > 0 {
            u.keys += 1;
            u.bytes += bytes;
        } else {
            u.keys -= 1;
            u.bytes -= bytes;
            if u.keys == 0 && !tenant.is_empty() {
                // A tenant without objects costs nothing (names come and go on open masters).
                self.named.remove(tenant);
            }
        }
    }

    fn of(&self, name: &str) -> TenantUsage {
        if name.is_empty() {
            self.default
        } else {
            self.named.get(name).copied().unwrap_or_default()
        }
    }

    fn all(&self) -> impl Iterator<Item = (&str, TenantUsage)> {
        std::iter::once(("", self.default)).chain(self.named.iter().map(|(k, v)| (&**k, *v)))
    }
}

impl<K: Borrow<str> + ?Sized> std::ops::Index<&K> for ObjectTable {
    type Output = Object;

    fn index(&self, key: &K) -> &Object {
        self.get(key).expect("the object is stored")
    }
}
