//! Put starts their callers gave up on without hearing the answer: the caller's deadline
//! passed, or its connection broke, after the start was sent. A start names itself with a token
//! its caller chose; when the caller abandons it, what it granted is revoked (see
//! `MasterState::abandon_start`), and a start that arrives after its abandonment (it waited in
//! a queue, or for offloads) grants nothing. Without it, each key would stay a put in flight
//! until the discard timeout, every other put of it told "already exists" for an object that
//! never comes. Tokens are the caller's tenant's: one tenant's abandonment never refuses
//! another tenant's start that happens to carry the same token.

use std::collections::HashMap;
use std::time::Duration;

use crate::clock::Millis;

/// Tokens kept at most. Only abandoned starts add one, and a token matters only while its
/// start may still arrive: the oldest go first.
const MAX: usize = 1 << 16;

#[derive(Default)]
pub(super) struct AbandonedStarts {
    /// By tenant name ("" for the default tenant) and token.
    at: HashMap<(Box<str>, u64), Millis>,
}

impl AbandonedStarts {
    /// Tenant `tenant`'s start tagged `token` was abandoned at `now`; tokens older than
    /// `horizon` are forgotten when room is needed.
    pub fn add(&mut self, tenant: &str, token: u64, now: Millis, horizon: Duration) {
        let key = (Box::from(tenant), token);
        if self.at.len() >= MAX && !self.at.contains_key(&key) {
            self.at.retain(|_, t| t.plus(horizon) > now);
            if self.at.len() >= MAX {
                let oldest = self
                    .at
                    .iter()
                    .min_by_key(|(_, t)| **t)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.at.remove(&k);
                }
            }
        }
        self.at.insert(key, now);
    }

    pub fn contains(&self, tenant: &str, token: u64) -> bool {
        !self.at.is_empty() && self.at.contains_key(&(Box::from(tenant), token))
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.at.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_forgets_expired_tokens_then_the_oldest() {
        let mut a = AbandonedStarts::default();
        let hour = Duration::from_secs(3600);
        for t in 0..MAX as u64 {
            a.add("", t + 1, Millis(1_000 + t), hour);
        }
        assert_eq!(a.len(), MAX);
        // None is an hour old: the oldest goes.
        a.add("", u64::MAX, Millis(1_000 + MAX as u64), hour);
        assert_eq!(a.len(), MAX);
        assert!(!a.contains("", 1), "the oldest went");
        assert!(a.contains("", 2) && a.contains("", u64::MAX));
        // Past the horizon, every expired one goes at once.
        a.add(
            "",
            u64::MAX - 1,
            Millis(1_000 + MAX as u64 + 10),
            Duration::from_millis(20),
        );
        assert_eq!(a.len(), 11, "the ten newest, and the one just added");
        assert!(a.contains("", u64::MAX - 1) && a.contains("", u64::MAX));
    }

    #[test]
    fn a_token_is_its_tenants() {
        let mut a = AbandonedStarts::default();
        a.add("b", 7, Millis(0), Duration::from_secs(30));
        assert!(a.contains("b", 7));
        assert!(!a.contains("a", 7) && !a.contains("", 7));
    }
}
