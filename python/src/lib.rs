//! `mooncake_rs._native`: the store's client as a Python extension with Mooncake's
//! `MooncakeDistributedStore` API (the Python package adds the tensor helpers on top). Raw memory
//! handling lives in `buffer` (the buffer protocol) and `registry` (registered pointers) alone.
#![deny(unsafe_code)]

mod aio;
#[allow(unsafe_code)]
mod buffer;
mod config;
mod engine;
mod gpu;
#[allow(unsafe_code)]
mod registry;
mod replica;
mod session;
mod stopping;
mod store;
mod store_async;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_class::<store::NativeStore>()?;
    m.add_class::<config::ReplicateConfig>()?;
    m.add_class::<replica::ReplicaDescriptor>()?;
    m.add_class::<replica::MemoryDescriptor>()?;
    m.add_class::<replica::BufferDescriptor>()?;
    m.add_class::<replica::DiskDescriptor>()?;
    m.add_class::<gpu::HostBackedDevice>()?;
    m.add_class::<engine::NativeEngine>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// Logs go to stderr; `MOONCAKE_LOG` (or `RUST_LOG`) sets the filter, default "warn".
fn init_logging() {
    let filter = std::env::var("MOONCAKE_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}
