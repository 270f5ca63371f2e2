//! Generated gRPC code for the master's control-plane service. Nothing hand-written lives here
//! except this re-export; conversions to validated types belong to `mooncake-common`.

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod master {
    tonic::include_proto!("mooncake.master.v1");
}
