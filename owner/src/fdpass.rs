//! The Unix-socket calls the same-host path needs that std does not offer on stable Rust:
//! sending a file descriptor (SCM_RIGHTS), and peeking at a connection's first bytes.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

/// Sends `payload` with `fd` attached on the connected Unix socket `sock`. The socket may be
/// non-blocking: `WouldBlock` is returned as is for the caller to wait and retry.
pub fn send_with_fd(sock: BorrowedFd<'_>, payload: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    // Of u64s: a cmsghdr (written through a pointer below) needs its 8-byte alignment, which a
    // byte buffer does not promise.
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is a valid empty header; the fields set below point at live
    // buffers (`iov`, `control`) that outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: `msg` has an 8-byte-aligned control buffer of CMSG_SPACE(sizeof(int)) bytes, so
    // CMSG_FIRSTHDR is non-null and aligned for a cmsghdr, and CMSG_DATA has room for one int.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut libc::c_int, fd.as_raw_fd());
    }
    // SAFETY: `sock` is a valid socket descriptor and `msg` is fully initialised above.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Copies the first bytes waiting on `sock` into `buf` without consuming them (`MSG_PEEK`),
/// without blocking: `WouldBlock` when nothing has arrived yet.
pub fn peek(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes for the duration of the
    // call, and `sock` is a valid descriptor.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}
