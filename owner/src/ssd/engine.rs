//! The disk engine seam: the `DiskEngine` trait, the name of each engine (`EngineKind`), opening an
//! O_DIRECT file of a fixed size, and the checks both engines share. Engines own how I/O is
//! submitted; they never interpret the bytes or decide offsets. This module knows no engine;
//! starting one of a given kind is `engines`'.

use std::{
    fmt, fs,
    fs::File,
    io,
    os::{
        fd::AsRawFd,
        unix::fs::{OpenOptionsExt, PermissionsExt},
    },
    path::Path,
    str::FromStr,
};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use super::buf::{AlignedBuf, ALIGN};

/// Moves aligned buffers to and from one file. Futures own their buffer until they finish and give
/// it back with the result, also on error; they never block the calling tokio worker.
pub trait DiskEngine: Send + Sync + 'static {
    /// Writes all of `buf` (its len a multiple of ALIGN) at `offset` (a multiple of ALIGN); gives
    /// the buffer back.
    fn write_at(
        &self,
        buf: AlignedBuf,
        offset: u64,
    ) -> BoxFuture<'static, (AlignedBuf, io::Result<()>)>;

    /// Fills all of `buf` (len a multiple of ALIGN) from `offset`; a read past the end of the file
    /// is an UnexpectedEof error.
    fn read_at(
        &self,
        buf: AlignedBuf,
        offset: u64,
    ) -> BoxFuture<'static, (AlignedBuf, io::Result<()>)>;

    /// fdatasync: everything written before is durable.
    fn sync(&self) -> BoxFuture<'static, io::Result<()>>;

    fn kind(&self) -> EngineKind;
}

/// Which engine to use: `Auto` prefers io_uring and falls back to pread when it is unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Auto,
    Uring,
    Pread,
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineKind::Auto => "auto",
            EngineKind::Uring => "uring",
            EngineKind::Pread => "pread",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown ssd engine {0:?}: expected auto, uring or pread")]
pub struct ParseEngineKindError(String);

impl FromStr for EngineKind {
    type Err = ParseEngineKindError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(EngineKind::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(EngineKind::Uring),
            "pread" => Ok(EngineKind::Pread),
            _ => Err(ParseEngineKindError(s.to_string())),
        }
    }
}

/// Opens (creating if needed) `path` for direct I/O and makes it at least `size` bytes long,
/// allocating the blocks up front where the file system can. `size` must be a multiple of ALIGN.
pub fn open_direct(path: &Path, size: u64) -> io::Result<File> {
    if !size.is_multiple_of(ALIGN as u64) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("ssd file size must be a multiple of {ALIGN} bytes, got {size}"),
        ));
    }
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        // Every tenant's offloaded keys and values: readable by the owner's user only.
        .mode(0o600)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                let dir = path.parent().unwrap_or(Path::new("."));
                io::Error::new(
                    e.kind(),
                    format!(
                        "the file system of {} does not support O_DIRECT (tmpfs, overlay?): \
                         pick a directory on a real disk for the ssd tier",
                        dir.display()
                    ),
                )
            } else {
                io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display()))
            }
        })?;
    // A file made before this owner set its mode keeps the one it had: narrow it too.
    let meta = file.metadata()?;
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(path = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "the ssd data file was readable by others; making it the owner's only");
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
    }
    let len = meta.len();
    if len < size {
        match fallocate(&file, len, size - len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => file.set_len(size)?,
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                        "cannot allocate {size} bytes for {} (is the disk full?): {e}",
                        path.display()
                    ),
                ))
            }
            Ok(()) => {}
        }
    }
    Ok(file)
}

/// Allocates `[offset, offset + len)` of `file` (mode 0: extends the file size).
#[allow(unsafe_code)]
fn fallocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let (offset, len) = match (i64::try_from(offset), i64::try_from(len)) {
        (Ok(o), Ok(l)) => (o, l),
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "ssd file size exceeds i64::MAX",
            ))
        }
    };
    loop {
        // SAFETY: fallocate takes an fd that `file` keeps open and two integers; it touches no
        // memory of ours.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Refuses a transfer that direct I/O cannot do.
pub(super) fn check_aligned(len: usize, offset: u64) -> io::Result<()> {
    if !len.is_multiple_of(ALIGN) || !offset.is_multiple_of(ALIGN as u64) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "ssd transfers need the buffer length and the file offset to be multiples of \
                 {ALIGN} bytes, got len {len} at offset {offset}"
            ),
        ));
    }
    Ok(())
}

/// What a read that ended early at `offset` means: the end of the file.
pub(super) fn eof(offset: u64, want: usize, done: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("ssd read of {want} bytes at offset {offset} hit the end of the file after {done} bytes"),
    )
}

/// Whether a read that returned fewer bytes than asked should be continued: a read on a regular
/// file only ends early at the end of the file, and an unaligned end cannot be resumed with direct
/// I/O, so only an aligned short read is retried (its retry then returns 0 at the end).
pub(super) fn continue_short_read(done: usize) -> bool {
    done.is_multiple_of(ALIGN)
}

pub(super) fn write_zero(offset: u64, want: usize, done: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::WriteZero,
        format!("ssd write of {want} bytes at offset {offset} stopped after {done} bytes"),
    )
}
