//! Which master the link talks to: one at a fixed address, or the elected master of an etcd
//! cluster, looked up when needed and looked up again after a call to it failed (it died or
//! stopped leading; the heartbeat that follows finds the new leader, which asks for a remount).

use std::time::Duration;

use mooncake_common::{
    auth::{grpc_channel, Credential},
    leader::{LeaderLookup, MasterAddress},
};
use mooncake_proto::master::master_client::MasterClient;
use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};

use mooncake_common::tls::TlsClient;

use super::LinkError;

pub(super) struct Target {
    /// What the link was given, for messages.
    given: String,
    lookup: Option<LeaderLookup>,
    rpc_timeout: Duration,
    credential: Option<Credential>,
    tls: Option<TlsClient>,
    current: Mutex<Option<(String, MasterClient<Channel>)>>,
}

impl Target {
    pub fn new(
        master: &str,
        cluster_id: &str,
        rpc_timeout: Duration,
        credential: Option<Credential>,
        tls: Option<TlsClient>,
    ) -> Result<Self, LinkError> {
        let bad = |_| LinkError::BadAddress(master.to_string());
        let (lookup, current) = match MasterAddress::parse(master).map_err(bad)? {
            MasterAddress::Fixed(addr) => (
                None,
                Some((
                    addr.clone(),
                    channel(&addr, rpc_timeout, credential.clone(), tls.clone())?,
                )),
            ),
            MasterAddress::Etcd(endpoints) => (
                Some(LeaderLookup::new(endpoints, cluster_id, rpc_timeout)),
                None,
            ),
        };
        Ok(Target {
            given: master.to_string(),
            lookup,
            rpc_timeout,
            credential,
            tls,
            current: Mutex::new(current),
        })
    }

    /// The master as given (an address or an etcd:// list), for messages.
    pub fn given(&self) -> &str {
        &self.given
    }

    /// The master to call now, with its address.
    pub async fn client(&self) -> Result<(String, MasterClient<Channel>), LinkError> {
        if let Some(c) = self.current.lock().clone() {
            return Ok(c);
        }
        let lookup = self
            .lookup
            .as_ref()
            .expect("a fixed master is never forgotten");
        let leader = lookup
            .leader()
            .await
            .map_err(|message| LinkError::Unreachable {
                master: self.given.clone(),
                message,
            })?;
        let c = (
            leader.address.clone(),
            channel(
                &leader.address,
                self.rpc_timeout,
                self.credential.clone(),
                self.tls.clone(),
            )?,
        );
        tracing::info!(leader = %leader.address, term = leader.term, "following the elected master");
        *self.current.lock() = Some(c.clone());
        Ok(c)
    }

    /// A call to `addr` failed: with etcd, look the leader up again next time.
    pub fn forget(&self, addr: &str) {
        if self.lookup.is_some() {
            let mut current = self.current.lock();
            if current.as_ref().is_some_and(|(a, _)| a == addr) {
                *current = None;
            }
        }
    }
}

fn channel(
    addr: &str,
    rpc_timeout: Duration,
    credential: Option<Credential>,
    tls: Option<TlsClient>,
) -> Result<MasterClient<Channel>, LinkError> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|_| LinkError::BadAddress(addr.to_string()))?
        // No per-request timeout here: every call has its own deadline (`MasterLink::call`),
        // which for a long poll includes its wait.
        .connect_timeout(rpc_timeout)
        .tcp_nodelay(true);
    Ok(MasterClient::new(grpc_channel(
        endpoint, addr, credential, tls,
    )))
}
