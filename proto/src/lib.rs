//! The master's control-plane protocol: the gRPC service generated from `proto/master.proto`,
//! and the framed RPC that carries the same messages without HTTP/2 (`framed`), with the
//! borrowed codecs its hot calls use. Wire forms only: conversions to validated domain types
//! belong to the roles' wire adapters.

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod master {
    tonic::include_proto!("mooncake.master.v1");
}

pub mod framed;
