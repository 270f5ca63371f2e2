//! The client's side of the master seam: which `MasterApi` a client uses, built from its
//! config. Two wire adapters carry the same calls: the framed RPC (default; plain
//! length-prefixed frames on the master's RPC port) and gRPC. Both answer in the domain types of
//! `mooncake_common::master_api`, under the RPC deadline, with transport failures turned into
//! RPC_FAIL / RPC_TIMEOUT. The in-process implementation lives with the master.

pub mod answers;
mod following;
mod framed;
mod grpc;
mod patient;

use std::{future::Future, sync::Arc, time::Duration};

use mooncake_common::{
    leader::{LeaderLookup, MasterAddress},
    master_api::Releases,
    ApiError, Code, MasterApi,
};

pub use following::Following;
pub use framed::FramedMaster;
pub use grpc::GrpcMaster;
pub use patient::Patient;

use crate::{
    config::{ClientConfig, MasterProtocol},
    error::ClientError,
};

/// The `MasterApi` the config asks for (no connection is made yet): the master at a fixed
/// address, or the elected one of an `etcd://` cluster; lookups wait out a catalog rebuild.
pub fn connect(config: &ClientConfig) -> Result<Arc<dyn MasterApi>, ClientError> {
    let wire: Arc<dyn MasterApi> = match MasterAddress::parse(&config.master)
        .map_err(ClientError::Config)?
    {
        MasterAddress::Fixed(addr) => wire_adapter(config, &addr)?,
        MasterAddress::Etcd(endpoints) => {
            let lookup = LeaderLookup::new(endpoints, &config.cluster_id, config.connect_timeout);
            let c = config.clone();
            let connect = Box::new(move |addr: &str| {
                wire_adapter(&c, addr).map_err(|e| format!("the leader key names {e}"))
            });
            Arc::new(Following::new(lookup, connect, config.rpc_timeout))
        }
    };
    Ok(Arc::new(Patient::new(wire, config.rpc_timeout)))
}

/// The wire adapter for one master address.
fn wire_adapter(config: &ClientConfig, addr: &str) -> Result<Arc<dyn MasterApi>, ClientError> {
    let bad = || {
        ClientError::Config(format!(
            "invalid master address {addr:?}: expected HOST:PORT"
        ))
    };
    if addr
        .rsplit_once(':')
        .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
    {
        return Err(bad());
    }
    let credential = config.credential()?;
    let tenant = config.tenant()?;
    let tls = config.master_tls()?;
    Ok(match config.master_protocol {
        MasterProtocol::Framed => Arc::new(FramedMaster::new(
            addr,
            config.rpc_timeout,
            config.connect_timeout,
            config.master_spin,
            credential,
            tenant,
            tls,
        )),
        MasterProtocol::Grpc => Arc::new(
            GrpcMaster::new(
                addr,
                config.rpc_timeout,
                config.connect_timeout,
                credential,
                &tenant,
                tls,
            )
            .ok_or_else(bad)?,
        ),
    })
}

/// `call` under the RPC deadline.
async fn within<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::new(
                Code::RpcTimeout,
                format!("master call timed out after {timeout:?}"),
            ))
        })
}

/// A batch answer must hold one result per item.
/// `release` on the first call made with `first`, nothing after: a call that goes again must
/// not hand back the same holds twice (another reader's hold would go with them).
fn first_try<'a>(first: &std::sync::atomic::AtomicBool, release: Releases<'a>) -> Releases<'a> {
    if first.swap(false, std::sync::atomic::Ordering::Relaxed) {
        release
    } else {
        Releases::NONE
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<(), ApiError> {
    if got == want {
        Ok(())
    } else {
        Err(ApiError::rpc(format!(
            "master answered {got} {what} results for {want} items"
        )))
    }
}

fn expect_len<T>(what: &str, got: Vec<T>, want: usize) -> Result<Vec<T>, ApiError> {
    check_len(what, got.len(), want).map(|()| got)
}

/// Per-item codes as the wire carries them (0 ok, else the error).
fn unit_codes(codes: Vec<i32>) -> Vec<Result<(), Code>> {
    codes
        .into_iter()
        .map(|c| match Code::from_i32(c) {
            Code::Ok => Ok(()),
            c => Err(c),
        })
        .collect()
}

/// `BatchExistsResponse` codes: 1 exists, 0 missing, negative an error.
fn exists_codes(codes: Vec<i32>) -> Vec<Result<bool, Code>> {
    codes
        .into_iter()
        .map(|c| match c {
            1 => Ok(true),
            0 => Ok(false),
            c => Err(Code::from_i32(c)),
        })
        .collect()
}
