//! The handshake on TCP: a server's admission of an accepted connection (peeking its first
//! bytes to tell a hello from the port's own protocol), a client's connect-and-prove, and a gRPC
//! channel whose every connection proves a credential before HTTP/2 starts.

use std::{io, time::Duration};

use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};
use tonic::transport::{Channel, Endpoint};

use crate::tls::{ClientStream, TlsClient};

use super::{admit, authenticate, starts_with_hello, Admission, AuthError, Credential, Keyring};

/// What a server answers a peer that started its protocol without authenticating.
pub const AUTH_REQUIRED: &str = "this server requires authentication: give the client the \
     cluster's token file (auth_token_file in its config, MOONCAKE_AUTH_TOKEN_FILE for Python's \
     setup(), --auth_token_file for the binaries)";

/// Waits for a connection's first bytes (up to the hello magic's length, or until they cannot
/// be a hello) without consuming them: whether it opens with a hello.
pub async fn peek_hello(stream: &TcpStream, timeout: Duration) -> io::Result<bool> {
    let peek = async {
        let mut first = [0u8; super::HELLO_MAGIC.len()];
        loop {
            let n = stream.peek(&mut first).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            if let Some(hello) = starts_with_hello(&first[..n]) {
                return Ok(hello);
            }
            // A proper prefix of the magic: the rest is on its way.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(timeout, peek)
        .await
        .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

/// A server's admission of an accepted TCP connection (see `admit`), within `timeout`.
pub async fn admit_tcp(
    stream: &mut TcpStream,
    keyring: Option<&Keyring>,
    timeout: Duration,
) -> io::Result<Admission> {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown peer".to_string(), |a| a.to_string());
    let hello = peek_hello(stream, timeout).await?;
    admit(stream, hello, keyring, &peer, timeout).await
}

/// Proves `credential` on a fresh connection (nothing to do without one), within `timeout`.
pub async fn prove<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    credential: Option<&Credential>,
    timeout: Duration,
) -> Result<(), AuthError> {
    let Some(credential) = credential else {
        return Ok(());
    };
    tokio::time::timeout(timeout, authenticate(stream, credential))
        .await
        .unwrap_or_else(|_| {
            Err(AuthError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the server did not finish authenticating within {timeout:?}"),
            )))
        })
}

/// A lazily connecting channel for `endpoint` (made for `addr`); each connection runs TLS
/// where `tls` is given, then proves the credential if there is one. The endpoint's connect
/// timeout covers all of it.
pub fn grpc_channel(
    endpoint: Endpoint,
    addr: &str,
    credential: Option<Credential>,
    tls: Option<TlsClient>,
) -> Channel {
    if credential.is_none() && tls.is_none() {
        return endpoint.connect_lazy();
    }
    let addr = addr.to_string();
    endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
        let (addr, credential, tls) = (addr.clone(), credential.clone(), tls.clone());
        async move {
            let mut stream = ClientStream::open(&addr, tls.as_ref()).await?;
            if let Some(credential) = &credential {
                authenticate(&mut stream, credential)
                    .await
                    .map_err(AuthError::into_io)?;
            }
            Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    }))
}

/// Whether a call's error status on a `grpc_channel` comes from the server refusing this peer's
/// proof (another secret, an unknown identity): the connector reports that as a
/// permission-denied I/O error, which tonic wraps as an unavailable service. A retry does not
/// change it.
pub fn refused_proof(s: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(e) = source {
        if e.downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::PermissionDenied)
        {
            return true;
        }
        source = e.source();
    }
    false
}
