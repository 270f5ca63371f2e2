//! Reading a body whose length a peer declared, without trusting the declaration: the buffer
//! grows as bytes arrive (at most twice what came), so a frame that claims a gigabyte and sends
//! nothing costs nothing, and a buffer a large frame grew is given back afterwards.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

/// Capacity a buffer keeps between frames; a larger one is shrunk back to it.
const KEEP: usize = 256 << 10;

/// Reads exactly `len` bytes into `buf` (replacing what it held); `UnexpectedEof` if the peer
/// stops short.
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    len: usize,
    buf: &mut Vec<u8>,
) -> io::Result<()> {
    buf.clear();
    if buf.capacity() > KEEP.max(len) {
        buf.shrink_to(KEEP);
    }
    // Room for small bodies at once; larger ones grow with what arrives.
    buf.reserve(len.min(KEEP));
    let got = r.take(len as u64).read_to_end(buf).await?;
    if got < len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the peer declared {len} bytes and sent {got}"),
        ));
    }
    Ok(())
}

/// `read_body` into a fresh buffer.
pub async fn read_new_body<R: AsyncRead + Unpin>(r: &mut R, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_body(r, len, &mut buf).await?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn a_huge_declared_length_costs_only_what_arrives() {
        let (mut c, mut s) = tokio::io::duplex(1 << 16);
        c.write_all(&[7u8; 1000]).await.unwrap();
        drop(c);
        let mut buf = Vec::new();
        let e = read_body(&mut s, 1 << 30, &mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(buf.capacity() < 1 << 20, "grew to {}", buf.capacity());
    }

    #[tokio::test]
    async fn whole_bodies_are_read_and_big_buffers_given_back() {
        let (mut c, mut s) = tokio::io::duplex(1 << 16);
        let big = vec![3u8; 4 << 20];
        let sender = tokio::spawn(async move {
            c.write_all(&big).await.unwrap();
            c.write_all(b"tail").await.unwrap();
        });
        let mut buf = Vec::new();
        read_body(&mut s, 4 << 20, &mut buf).await.unwrap();
        assert!(buf.len() == 4 << 20 && buf.iter().all(|b| *b == 3));
        read_body(&mut s, 4, &mut buf).await.unwrap();
        assert_eq!(buf, b"tail");
        assert!(buf.capacity() <= KEEP, "kept {}", buf.capacity());
        sender.await.unwrap();
    }
}
