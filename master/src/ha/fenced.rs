//! Writes a leader makes to etcd besides its key (the put-id reservation, the segment names), each
//! taken only while the leader key is still the one this term's election created. A leader whose
//! lease lapsed while a write was on its way (a pause, a slow etcd) must not overwrite what the
//! next leader wrote: a reservation written late could fall below the next leader's, and the term
//! after that would then issue put ids that were already issued.

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};

/// The term's seat: the leader key and the revision that created it (the term).
#[derive(Debug, Clone)]
pub struct Seat {
    pub leader_key: String,
    pub term: i64,
}

impl Seat {
    /// Puts `key` = `value` if this term still holds the leader key; an error otherwise (the
    /// caller steps down).
    pub async fn put(&self, etcd: &mut Client, key: &str, value: &str) -> anyhow::Result<()> {
        self.write(etcd, TxnOp::put(key, value, None), key).await
    }

    /// Deletes `key` if this term still holds the leader key; an error otherwise.
    pub async fn delete(&self, etcd: &mut Client, key: &str) -> anyhow::Result<()> {
        self.write(etcd, TxnOp::delete(key, None), key).await
    }

    async fn write(&self, etcd: &mut Client, op: TxnOp, key: &str) -> anyhow::Result<()> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.leader_key.as_str(),
                CompareOp::Equal,
                self.term,
            )])
            .and_then([op]);
        if etcd.txn(txn).await?.succeeded() {
            Ok(())
        } else {
            anyhow::bail!(
                "not writing {key}: the leader key is no longer this term's ({}); another master leads",
                self.term
            )
        }
    }
}
