//! Generates the gRPC code. protoc comes from the `protoc-bin-vendored` crate so a fresh machine
//! needs no system package; set PROTOC to use another one.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/master.proto");
    println!("cargo:rerun-if-env-changed=PROTOC");
    if std::env::var_os("PROTOC").is_none() {
        std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    }
    tonic_prost_build::configure().compile_protos(&["proto/master.proto"], &["proto"])?;
    Ok(())
}
