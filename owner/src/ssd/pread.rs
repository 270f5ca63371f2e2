//! `PreadEngine`: the plain-file engine. Each transfer is a loop of positioned reads or writes on
//! tokio's blocking pool, so it works wherever files do and never blocks an async worker. Safe
//! code only.

use std::{fs::File, io, os::unix::fs::FileExt, sync::Arc};

use futures::future::BoxFuture;

use super::{
    buf::AlignedBuf,
    engine::{check_aligned, continue_short_read, eof, write_zero, DiskEngine, EngineKind},
};

pub(super) struct PreadEngine {
    file: Arc<File>,
}

impl PreadEngine {
    pub(super) fn new(file: File) -> PreadEngine {
        PreadEngine {
            file: Arc::new(file),
        }
    }
}

/// Runs `op` on the blocking pool; a panic there loses the buffer, so an empty one comes back.
async fn blocking<T: Send + 'static>(
    op: impl FnOnce() -> (AlignedBuf, io::Result<T>) + Send + 'static,
) -> (AlignedBuf, io::Result<T>) {
    match tokio::task::spawn_blocking(op).await {
        Ok(r) => r,
        Err(e) => (
            AlignedBuf::with_capacity(0),
            Err(io::Error::other(format!("ssd pread task failed: {e}"))),
        ),
    }
}

fn write_all(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.write_at(&buf[done..], offset + done as u64) {
            Ok(0) => return Err(write_zero(offset, buf.len(), done)),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_all(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => return Err(eof(offset, buf.len(), done)),
            Ok(n) => {
                done += n;
                if done < buf.len() && !continue_short_read(done) {
                    return Err(eof(offset, buf.len(), done));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl PreadEngine {
    /// One checked transfer of the whole buffer on the blocking pool.
    fn transfer(
        &self,
        mut buf: AlignedBuf,
        offset: u64,
        write: bool,
    ) -> BoxFuture<'static, (AlignedBuf, io::Result<()>)> {
        let file = self.file.clone();
        Box::pin(async move {
            if let Err(e) = check_aligned(buf.len(), offset) {
                return (buf, Err(e));
            }
            blocking(move || {
                let r = if write {
                    write_all(&file, &buf, offset)
                } else {
                    read_all(&file, &mut buf, offset)
                };
                (buf, r)
            })
            .await
        })
    }
}

impl DiskEngine for PreadEngine {
    fn write_at(
        &self,
        buf: AlignedBuf,
        offset: u64,
    ) -> BoxFuture<'static, (AlignedBuf, io::Result<()>)> {
        self.transfer(buf, offset, true)
    }

    fn read_at(
        &self,
        buf: AlignedBuf,
        offset: u64,
    ) -> BoxFuture<'static, (AlignedBuf, io::Result<()>)> {
        self.transfer(buf, offset, false)
    }

    fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
        let file = self.file.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || file.sync_data())
                .await
                .map_err(|e| io::Error::other(format!("ssd pread task failed: {e}")))?
        })
    }

    fn kind(&self) -> EngineKind {
        EngineKind::Pread
    }
}
