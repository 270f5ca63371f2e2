//! The master's objects by key. Each object is one allocation holding its own key (a shared
//! string); the table holds only a pointer per slot. A million objects then cost about 9 bytes of
//! table each (one pointer and one control byte, at the power-of-two slack a hash table keeps)
//! where a map from key to boxed object costs 25, and looking a key up still touches one slot and
//! one object.

use std::{borrow::Borrow, hash::BuildHasher};

use hashbrown::{hash_table::Entry, HashTable};

use super::objects::Object;

pub(super) struct ObjectTable {
    table: HashTable<Box<Object>>,
    // Keys are ~100-byte strings looked up thousands of times per batch: a fast seeded hasher
    // (foldhash) instead of SipHash, still randomised per process against crafted collisions.
    hasher: foldhash::fast::RandomState,
}

impl ObjectTable {
    pub fn new() -> Self {
        ObjectTable {
            table: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
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

    /// Stores `object` under its key; returns the object it replaced.
    pub fn insert(&mut self, object: Box<Object>) -> Option<Box<Object>> {
        let hasher = &self.hasher;
        let key = object.key().as_str();
        let entry = self.table.entry(
            hasher.hash_one(key),
            |o| o.key().as_str() == key,
            |o| hasher.hash_one(o.key().as_str()),
        );
        match entry {
            Entry::Occupied(mut e) => Some(std::mem::replace(e.get_mut(), object)),
            Entry::Vacant(e) => {
                e.insert(object);
                None
            }
        }
    }

    pub fn remove<K: Borrow<str> + ?Sized>(&mut self, key: &K) -> Option<Box<Object>> {
        let key = key.borrow();
        let hash = self.hash(key);
        match self.table.find_entry(hash, |o| o.key().as_str() == key) {
            Ok(e) => Some(e.remove().0),
            Err(_) => None,
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Object> {
        self.table.iter().map(|o| &**o)
    }

    /// Objects to change in place. The key cannot change: `Object` gives no way to.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Object> {
        self.table.iter_mut().map(|o| &mut **o)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&mut Object) -> bool) {
        self.table.retain(|o| keep(o));
    }
}

impl<K: Borrow<str> + ?Sized> std::ops::Index<&K> for ObjectTable {
    type Output = Object;

    fn index(&self, key: &K) -> &Object {
        self.get(key).expect("the object is stored")
    }
}
