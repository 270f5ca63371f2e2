//! An RPC connection the master let in: its first bytes read ahead (to tell a hello from the
//! port's protocols, on plain TCP and inside TLS alike) and replayed (`Prefixed`), and, as
//! tonic serves it, the identity it proved (what gRPC handlers learn from the request's
//! extensions, see `Identity`).

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// A byte stream the RPC port serves: TCP, or TLS over it.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A stream whose first bytes were read ahead to look at; reads give them back first.
pub struct Prefixed<S> {
    ahead: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> Prefixed<S> {
    pub fn new(inner: S) -> Prefixed<S> {
        Prefixed {
            ahead: Vec::new(),
            pos: 0,
            inner,
        }
    }

    /// The bytes read ahead and not yet consumed, after reading more until there are `n` or
    /// `enough` says they decide (or the peer stops sending).
    pub async fn look(&mut self, n: usize, enough: impl Fn(&[u8]) -> bool) -> io::Result<&[u8]> {
        use tokio::io::AsyncReadExt;
        if self.pos > 0 {
            self.ahead.drain(..self.pos);
            self.pos = 0;
        }
        while self.ahead.len() < n && !enough(&self.ahead) {
            let mut buf = [0u8; 16];
            let want = n - self.ahead.len();
            let got = self.inner.read(&mut buf[..want.min(16)]).await?;
            if got == 0 {
                break;
            }
            self.ahead.extend_from_slice(&buf[..got]);
        }
        Ok(&self.ahead)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.ahead.len() {
            let n = (self.ahead.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.ahead[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A stream that ends at a deadline: reads then see its end and writes fail, so the server
/// serving it lets go (tonic keeps an HTTP/2 connection for as long as its peer does, and
/// answers its keepalive pings). For connections that are only ever refused.
pub struct Expiring<S> {
    inner: S,
    at: Pin<Box<tokio::time::Sleep>>,
}

impl<S> Expiring<S> {
    pub fn new(inner: S, after: std::time::Duration) -> Expiring<S> {
        Expiring {
            inner,
            at: Box::pin(tokio::time::sleep(after)),
        }
    }

    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.at.as_mut().poll(cx).is_ready()
    }
}

fn ended() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "a refused connection is closed after a while",
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for Expiring<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.expired(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Expiring<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.expired(cx) {
            return Poll::Ready(Err(ended()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The identity a connection proved: None where the master runs open.
#[derive(Clone, Debug, Default)]
pub struct Identity(pub Option<Arc<str>>);

pub struct Admitted<S> {
    pub stream: S,
    pub identity: Identity,
}

/// A gRPC connection, whatever it runs over.
pub type Rpc = Admitted<Box<dyn Io>>;

impl<S> Connected for Admitted<S> {
    type ConnectInfo = Identity;

    fn connect_info(&self) -> Identity {
        self.identity.clone()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
