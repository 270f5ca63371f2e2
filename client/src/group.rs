//! A batch's items grouped by where they go (an owner, or an owner and a tier), so each group
//! is one transport batch and all groups run at once. A batch names few owners, so a group is
//! found by a short linear scan, in first-seen order.

/// Groups of items, each with the positions (in the caller's batch) of its items.
pub(crate) struct Groups<K, I> {
    groups: Vec<Group<K, I>>,
}

pub(crate) struct Group<K, I> {
    pub to: K,
    /// The caller's position of each item, in the order of `items`.
    pub slots: Vec<usize>,
    pub items: Vec<I>,
}

impl<K: PartialEq, I> Groups<K, I> {
    pub fn new() -> Self {
        Groups { groups: Vec::new() }
    }

    /// Adds `item` (the caller's item `slot`) to the group going to `to`.
    pub fn push(&mut self, to: K, slot: usize, item: I) {
        let g = match self.groups.iter().position(|g| g.to == to) {
            Some(g) => g,
            None => {
                self.groups.push(Group {
                    to,
                    slots: Vec::new(),
                    items: Vec::new(),
                });
                self.groups.len() - 1
            }
        };
        self.groups[g].slots.push(slot);
        self.groups[g].items.push(item);
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Group<K, I>> {
        self.groups.iter_mut()
    }
}
