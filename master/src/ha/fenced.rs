//! Writes a leader makes to etcd besides its key (the put-id reservation, the segment names), each
//! taken only while the leader key is still the one this term's election created. A leader whose
//! lease lapsed while a write was on its way (a pause, a slow etcd) must not overwrite what the
//! next leader wrote: a reservation written late could fall below the next leader's, and the term
//! after that would then issue put ids that were already issued.

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};

/// Operations in one fenced transaction at most (etcd's default `--max-txn-ops` is 128).
pub const MAX_OPS: usize = 100;

/// A fenced write refused: the leader key is no longer this term's. The term is over; the
/// caller steps down (retrying cannot help, unlike a write etcd did not answer).
#[derive(Debug, thiserror::Error)]
#[error(
    "not writing {what}: the leader key is no longer this term's ({term}); another master leads"
)]
pub struct Deposed {
    what: String,
    term: i64,
}

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

    /// Takes `ops` (at most `MAX_OPS`) in one transaction if this term still holds the leader
    /// key; an error otherwise. `what` names them in the error.
    pub async fn write_all(
        &self,
        etcd: &mut Client,
        ops: Vec<TxnOp>,
        what: &str,
    ) -> anyhow::Result<()> {
        debug_assert!(ops.len() <= MAX_OPS);
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.leader_key.as_str(),
                CompareOp::Equal,
                self.term,
            )])
            .and_then(ops);
        if etcd.txn(txn).await?.succeeded() {
            Ok(())
        } else {
            Err(Deposed {
                what: what.to_string(),
                term: self.term,
            }
            .into())
        }
    }

    /// The value of `key`, read in one transaction with the check that this term still holds
    /// the leader key: a term deposed meanwhile reads nothing (an error, `Deposed`), so what it
    /// reads is never its successor's.
    pub async fn read(&self, etcd: &mut Client, key: &str) -> anyhow::Result<Option<String>> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.leader_key.as_str(),
                CompareOp::Equal,
                self.term,
            )])
            .and_then([TxnOp::get(key, None)]);
        let resp = etcd.txn(txn).await?;
        if !resp.succeeded() {
            return Err(Deposed {
                what: format!("reading {key}"),
                term: self.term,
            }
            .into());
        }
        Ok(resp.op_responses().into_iter().find_map(|r| match r {
            etcd_client::TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .and_then(|kv| kv.value_str().ok())
                .map(str::to_string),
            _ => None,
        }))
    }

    /// Whether this term still holds the leader key: an error (`Deposed`) once it was deleted
    /// (by an operator, a cleanup) or taken by another term, even while this term's lease
    /// lives on. Nothing is written.
    pub async fn confirm(&self, etcd: &mut Client) -> anyhow::Result<()> {
        self.write_all(etcd, Vec::new(), "nothing (the seat is confirmed)")
            .await
    }

    async fn write(&self, etcd: &mut Client, op: TxnOp, key: &str) -> anyhow::Result<()> {
        self.write_all(etcd, vec![op], key).await
    }
}
