//! `UringEngine`: the io_uring engine. One dedicated thread owns the ring and the file; transfers
//! reach it over a channel and their results come back over oneshots, so async callers only await.
//! While the thread waits for completions, a poll on an eventfd lets a new request wake it, so a
//! request never waits behind a slow transfer to be submitted.
//! This module owns every submission of a raw buffer pointer to the kernel: a buffer belongs to
//! the in-flight table from the push of its SQE until its CQE is reaped, and is never freed in
//! between (if the thread dies with operations in the kernel, their buffers are leaked instead).

use std::{
    collections::VecDeque,
    fs::File,
    io::{self, Read, Write},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        atomic::{fence, AtomicBool, Ordering},
        mpsc::{self, TryRecvError},
        Arc,
    },
    thread,
};

use futures::future::BoxFuture;
use io_uring::{opcode, squeue, types, IoUring, Probe};
use tokio::sync::oneshot;

use super::{
    buf::AlignedBuf,
    engine::{check_aligned, continue_short_read, eof, write_zero, DiskEngine, EngineKind},
};

/// The most one read or write SQE asks for (Linux caps a transfer at this, and it is aligned).
const MAX_RW: usize = 0x7fff_f000;

/// The user_data of the wake poll's CQE; slot indices are far smaller.
const WAKE: u64 = u64::MAX;

type TransferReply = oneshot::Sender<(AlignedBuf, io::Result<()>)>;

enum Request {
    Write {
        buf: AlignedBuf,
        offset: u64,
        reply: TransferReply,
    },
    Read {
        buf: AlignedBuf,
        offset: u64,
        reply: TransferReply,
    },
    Sync {
        reply: oneshot::Sender<io::Result<()>>,
    },
}

impl Request {
    /// Hands the result back; if the caller stopped waiting, the buffer is simply dropped here,
    /// after its completion.
    fn reply(self, result: io::Result<()>) {
        match self {
            Request::Write { buf, reply, .. } | Request::Read { buf, reply, .. } => {
                let _ = reply.send((buf, result));
            }
            Request::Sync { reply } => {
                let _ = reply.send(result);
            }
        }
    }
}

fn stopped() -> io::Error {
    io::Error::other("the ssd io_uring thread has stopped; the owner must reopen its ssd tier")
}

/// Wakes the ring's thread when it waits in the kernel: it sets `parked` before it waits, and a
/// sender that finds it set writes the eventfd, which completes the poll the thread keeps armed.
struct Wake {
    parked: AtomicBool,
    eventfd: File,
}

impl Wake {
    fn new() -> io::Result<Wake> {
        // SAFETY: eventfd takes two integers and returns a new fd or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Wake {
            parked: AtomicBool::new(false),
            eventfd: File::from(fd),
        })
    }

    /// Called after a send. The fence pairs with the thread's (store `parked`, fence, look at the
    /// channel): either the thread sees the request or this sees `parked`.
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.parked.swap(false, Ordering::SeqCst) {
            // Non-blocking; a full counter (impossible at 2^64 - 2) would already wake the thread.
            let _ = (&self.eventfd).write(&1u64.to_ne_bytes());
        }
    }

    /// Resets the counter so that the next poll waits again.
    fn drain(&self) {
        let _ = (&self.eventfd).read(&mut [0u8; 8]);
    }
}

/// What every handle and future shares: the way in to the ring's thread.
struct Shared {
    tx: mpsc::Sender<Request>,
    wake: Arc<Wake>,
}

impl Shared {
    /// Hands `req` to the thread, or gives it back when the thread has stopped.
    fn send(&self, req: Request) -> Result<(), Request> {
        self.tx.send(req).map_err(|mpsc::SendError(req)| req)?;
        self.wake.notify();
        Ok(())
    }
}

pub(super) struct UringEngine {
    shared: Arc<Shared>,
}

impl UringEngine {
    /// Creates a ring for `queue_depth` operations (at least 8) and the wake poll, and checks that
    /// it can read, write and fsync.
    pub(super) fn ring(queue_depth: u32) -> io::Result<IoUring> {
        let entries = (queue_depth.clamp(8, 1 << 15) + 1).next_power_of_two();
        let ring = IoUring::new(entries).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "io_uring is unavailable ({e}): it may be disabled by the \
                     kernel.io_uring_disabled sysctl or a seccomp filter (containers); \
                     use the pread ssd engine"
                ),
            )
        })?;
        let mut probe = Probe::new();
        let supported = ring.submitter().register_probe(&mut probe).is_ok()
            && [opcode::Read::CODE, opcode::Write::CODE, opcode::Fsync::CODE]
                .into_iter()
                .all(|op| probe.is_supported(op));
        if !supported {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "this kernel's io_uring lacks read, write or fsync (Linux 5.6+ needed); \
                 use the pread ssd engine",
            ));
        }
        Ok(ring)
    }

    /// Starts the thread that owns `ring` and `file`. It stops once the engine is dropped and
    /// every operation in flight has completed.
    pub(super) fn start(ring: IoUring, file: File, queue_depth: u32) -> io::Result<UringEngine> {
        let (tx, rx) = mpsc::channel();
        let wake = Arc::new(Wake::new()?);
        let slots = queue_depth.clamp(8, 1 << 15) as usize;
        let worker = Worker::new(ring, file, slots, wake.clone());
        thread::Builder::new()
            .name("mooncake-uring".into())
            .spawn(move || worker.run(rx))?;
        Ok(UringEngine {
            shared: Arc::new(Shared { tx, wake }),
        })
    }

    fn transfer(
        &self,
        buf: AlignedBuf,
        offset: u64,
        write: bool,
    ) -> BoxFuture<'static, (AlignedBuf, io::Result<()>)> {
        let shared = self.shared.clone();
        Box::pin(async move {
            if let Err(e) = check_aligned(buf.len(), offset) {
                return (buf, Err(e));
            }
            if buf.is_empty() {
                return (buf, Ok(()));
            }
            let (reply, rx) = oneshot::channel();
            let req = if write {
                Request::Write { buf, offset, reply }
            } else {
                Request::Read { buf, offset, reply }
            };
            if let Err(req) = shared.send(req) {
                let (Request::Write { buf, .. } | Request::Read { buf, .. }) = req else {
                    unreachable!("a transfer request was sent")
                };
                return (buf, Err(stopped()));
            }
            // The thread only vanishes with the request on a bug; the buffer is then lost.
            rx.await
                .unwrap_or_else(|_| (AlignedBuf::with_capacity(0), Err(stopped())))
        })
    }
}

impl DiskEngine for UringEngine {
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
        let shared = self.shared.clone();
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            shared
                .send(Request::Sync { reply })
                .map_err(|_| stopped())?;
            rx.await.unwrap_or_else(|_| Err(stopped()))
        })
    }

    fn kind(&self) -> EngineKind {
        EngineKind::Uring
    }
}

/// An admitted request and how many of its bytes are done.
struct Slot {
    req: Request,
    done: usize,
}

impl Slot {
    /// The SQE for the rest of this request, tagged with its slot index.
    fn entry(&mut self, fd: types::Fd, idx: usize) -> squeue::Entry {
        let done = self.done;
        let entry = match &mut self.req {
            Request::Write { buf, offset, .. } => {
                let len = (buf.len() - done).min(MAX_RW) as u32;
                let ptr = buf.as_ptr().wrapping_add(done);
                opcode::Write::new(fd, ptr, len)
                    .offset(*offset + done as u64)
                    .build()
            }
            Request::Read { buf, offset, .. } => {
                let len = (buf.len() - done).min(MAX_RW) as u32;
                let ptr = buf.as_mut_ptr().wrapping_add(done);
                opcode::Read::new(fd, ptr, len)
                    .offset(*offset + done as u64)
                    .build()
            }
            Request::Sync { .. } => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        entry.user_data(idx as u64)
    }

    /// Applies a CQE result: `Some` when the request is finished, `None` to resubmit the rest.
    fn advance(&mut self, res: i32) -> Option<io::Result<()>> {
        if res < 0 {
            let errno = -res;
            if errno == libc::EINTR || errno == libc::EAGAIN {
                return None;
            }
            return Some(Err(io::Error::from_raw_os_error(errno)));
        }
        let n = res as usize;
        match &self.req {
            Request::Sync { .. } => Some(Ok(())),
            Request::Write { buf, offset, .. } => {
                if n == 0 {
                    return Some(Err(write_zero(*offset, buf.len(), self.done)));
                }
                self.done += n;
                (self.done >= buf.len()).then_some(Ok(()))
            }
            Request::Read { buf, offset, .. } => {
                if n == 0 {
                    return Some(Err(eof(*offset, buf.len(), self.done)));
                }
                self.done += n;
                if self.done >= buf.len() {
                    Some(Ok(()))
                } else if !continue_short_read(self.done) {
                    Some(Err(eof(*offset, buf.len(), self.done)))
                } else {
                    None
                }
            }
        }
    }
}

/// The ring's thread state: a slot per operation it may have in flight (the ring has one more
/// entry, for the wake poll), the slots waiting for an SQE, and how many of their SQEs the kernel
/// has not completed yet.
struct Worker {
    ring: IoUring,
    file: File,
    wake: Arc<Wake>,
    wake_armed: bool,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    ready: VecDeque<usize>,
    in_kernel: usize,
    cqes: Vec<(u64, i32)>,
}

impl Worker {
    fn new(ring: IoUring, file: File, slots: usize, wake: Arc<Wake>) -> Worker {
        debug_assert!(ring.params().sq_entries() as usize > slots);
        Worker {
            ring,
            file,
            wake,
            wake_armed: false,
            slots: (0..slots).map(|_| None).collect(),
            free: (0..slots).rev().collect(),
            ready: VecDeque::with_capacity(slots),
            in_kernel: 0,
            cqes: Vec::with_capacity(slots + 1),
        }
    }

    fn admit(&mut self, req: Request) {
        let idx = self.free.pop().expect("admitted with a free slot");
        self.slots[idx] = Some(Slot { req, done: 0 });
        self.ready.push_back(idx);
    }

    fn run(mut self, rx: mpsc::Receiver<Request>) {
        let mut open = true;
        loop {
            while open && !self.free.is_empty() {
                let idle = self.in_kernel == 0 && self.ready.is_empty();
                let req = if idle {
                    match rx.recv() {
                        Ok(req) => req,
                        Err(_) => {
                            open = false;
                            break;
                        }
                    }
                } else {
                    match rx.try_recv() {
                        Ok(req) => req,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                };
                self.admit(req);
            }
            self.push_ready();
            if self.in_kernel == 0 {
                if open {
                    continue;
                }
                return;
            }
            if open && !self.free.is_empty() {
                self.arm_wake();
                self.wake.parked.store(true, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                // A request sent before `parked` was set did not write the eventfd: take it now.
                match rx.try_recv() {
                    Ok(req) => {
                        self.wake.parked.store(false, Ordering::Relaxed);
                        self.admit(req);
                        continue;
                    }
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            let waited = self.ring.submit_and_wait(1);
            self.wake.parked.store(false, Ordering::Relaxed);
            if let Err(e) = waited {
                let transient = [libc::EINTR, libc::EAGAIN, libc::EBUSY];
                if !e.raw_os_error().is_some_and(|c| transient.contains(&c)) {
                    // `Drop` leaks the buffers still in the kernel; their callers get an error.
                    tracing::error!(error = %e, "the ssd io_uring failed; its operations are abandoned");
                    return;
                }
            }
            self.reap();
        }
    }

    /// Keeps one poll for the eventfd in the ring while the thread may wait in the kernel.
    fn arm_wake(&mut self) {
        if self.wake_armed {
            return;
        }
        let fd = types::Fd(self.wake.eventfd.as_raw_fd());
        let entry = opcode::PollAdd::new(fd, libc::POLLIN as u32)
            .build()
            .user_data(WAKE);
        // SAFETY: a poll references no memory of ours; the eventfd lives in `self.wake` for as
        // long as the ring. The ring has one entry more than there are slots, so there is room.
        unsafe { self.ring.submission().push(&entry) }
            .expect("the ring keeps an entry for the wake poll");
        self.wake_armed = true;
    }

    fn push_ready(&mut self) {
        let fd = types::Fd(self.file.as_raw_fd());
        let mut sq = self.ring.submission();
        while let Some(&idx) = self.ready.front() {
            if sq.is_full() {
                break;
            }
            let slot = self.slots[idx].as_mut().expect("a ready slot is occupied");
            let entry = slot.entry(fd, idx);
            // SAFETY: the SQE points into the slot's AlignedBuf (a heap allocation that does not
            // move with the slot) and stays within its len. The slot owns the buffer until `reap`
            // sees this SQE's CQE; nothing frees or touches it before (and `Drop` leaks it if the
            // thread ends first). The fd is `self.file`, open for the ring's whole life.
            unsafe { sq.push(&entry) }.expect("the submission queue has room");
            self.ready.pop_front();
            self.in_kernel += 1;
        }
    }

    fn reap(&mut self) {
        self.cqes
            .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        while let Some((user_data, res)) = self.cqes.pop() {
            if user_data == WAKE {
                self.wake.drain();
                self.wake_armed = false;
                continue;
            }
            self.in_kernel -= 1;
            let idx = user_data as usize;
            let slot = self.slots[idx]
                .as_mut()
                .expect("a completed slot is occupied");
            match slot.advance(res) {
                None => self.ready.push_back(idx),
                Some(result) => {
                    let slot = self.slots[idx].take().expect("checked above");
                    self.free.push(idx);
                    slot.req.reply(result);
                }
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.in_kernel > 0 {
            // The kernel may still write into these buffers: leak them rather than free them.
            // Their callers are answered all the same (their reply channels close: an error).
            for slot in std::mem::take(&mut self.slots).into_iter().flatten() {
                match slot.req {
                    Request::Write { buf, reply, .. } | Request::Read { buf, reply, .. } => {
                        std::mem::forget(buf);
                        drop(reply);
                    }
                    Request::Sync { reply } => drop(reply),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring that failed leaves its thread with requests the kernel may still hold: their
    /// buffers are leaked, but their callers get an error instead of waiting forever.
    #[test]
    fn a_worker_dropped_with_requests_in_the_kernel_answers_their_callers() {
        let ring = IoUring::new(4).expect("io_uring (the ssd tier's engine) is available");
        let file = File::open("/dev/null").unwrap();
        let mut worker = Worker::new(ring, file, 2, Arc::new(Wake::new().unwrap()));
        let (reply, mut read) = oneshot::channel();
        worker.admit(Request::Read {
            buf: AlignedBuf::with_capacity(4096),
            offset: 0,
            reply,
        });
        let (reply, mut sync) = oneshot::channel();
        worker.admit(Request::Sync { reply });
        worker.in_kernel = 2;
        drop(worker);
        assert!(matches!(
            read.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
        assert!(matches!(
            sync.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
    }
}
