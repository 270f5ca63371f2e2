//! Starting a disk engine: the factory that builds the io_uring or pread engine for an
//! `EngineKind`, and the `Auto` choice between them (io_uring where the kernel offers it, else
//! pread). The only module that knows every engine; the engines and the seam know none of it.

use std::{fs::File, io, sync::Arc};

use super::{
    engine::{DiskEngine, EngineKind},
    pread::PreadEngine,
    uring::UringEngine,
};

/// Starts the engine of `kind` on `file` with up to `queue_depth` operations in the kernel at once
/// (io_uring; pread runs on tokio's blocking pool and ignores it).
pub fn open_engine(
    kind: EngineKind,
    file: File,
    queue_depth: u32,
) -> io::Result<Arc<dyn DiskEngine>> {
    match kind {
        EngineKind::Pread => Ok(Arc::new(PreadEngine::new(file))),
        EngineKind::Uring => Ok(Arc::new(UringEngine::start(
            UringEngine::ring(queue_depth)?,
            file,
            queue_depth,
        )?)),
        EngineKind::Auto => match UringEngine::ring(queue_depth) {
            Ok(ring) => Ok(Arc::new(UringEngine::start(ring, file, queue_depth)?)),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring is unavailable; the ssd tier falls back to pread");
                Ok(Arc::new(PreadEngine::new(file)))
            }
        },
    }
}
