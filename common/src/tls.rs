//! TLS for the master's RPC port (rustls): the master's acceptor from its certificate, key and
//! optional client CA (with a CA, every peer must show a certificate it signed), and the
//! connector its clients and owners use from the CA they trust (and their own certificate where
//! the master asks for one). The data plane stays plaintext, its transfers scoped by the
//! master's seals.

use std::{io, path::Path, sync::Arc};

use rustls::{
    crypto::CryptoProvider,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName},
    server::WebPkiClientVerifier,
    RootCertStore,
};
use tokio::net::TcpStream;

pub use tokio_rustls::{client::TlsStream as ClientTls, TlsAcceptor};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read certificates from {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("cannot read a private key from {}: {e}", path.display()))
}

fn roots(ca: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for c in certs(ca)? {
        roots
            .add(c)
            .map_err(|e| format!("{}: not a usable CA certificate: {e}", ca.display()))?;
    }
    Ok(roots)
}

/// The master's acceptor: its certificate chain and key, and with `client_ca` the CA every
/// peer's certificate must chain to.
pub fn acceptor(
    cert: &Path,
    key_file: &Path,
    client_ca: Option<&Path>,
) -> Result<TlsAcceptor, String> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_ca {
        Some(ca) => builder.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                .build()
                .map_err(|e| format!("client CA {}: {e}", ca.display()))?,
        ),
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(certs(cert)?, key(key_file)?)
        .map_err(|e| {
            format!(
                "certificate {} with key {}: {e}",
                cert.display(),
                key_file.display()
            )
        })?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A client's TLS to the master: the CA it trusts, and its own certificate for masters that ask.
#[derive(Clone)]
pub struct TlsClient {
    connector: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsClient(..)")
    }
}

impl TlsClient {
    /// From PEM files: `ca` the master's certificate must chain to; `identity` (certificate,
    /// key) shown where the master checks clients.
    pub fn new(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<TlsClient, String> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots(ca)?);
        let config = match identity {
            Some((cert, key_file)) => builder
                .with_client_auth_cert(certs(cert)?, key(key_file)?)
                .map_err(|e| format!("client certificate {}: {e}", cert.display()))?,
            None => builder.with_no_client_auth(),
        };
        Ok(TlsClient {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
        })
    }

    /// From the files a config names: None without a CA (no TLS); a certificate needs its key.
    pub fn from_files(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key_file: Option<&Path>,
    ) -> Result<Option<TlsClient>, String> {
        match (ca, cert, key_file) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(c), Some(k)) => TlsClient::new(ca, Some((c, k))).map(Some),
            (Some(ca), None, None) => TlsClient::new(ca, None).map(Some),
            _ => {
                Err("TLS to the master needs tls_ca (and tls_cert with tls_key, or neither)".into())
            }
        }
    }

    /// TLS over `tcp` to `addr` ("host:port"), the master's certificate checked for `host`.
    pub async fn connect(&self, addr: &str, tcp: TcpStream) -> io::Result<ClientTls<TcpStream>> {
        let host = addr
            .rsplit_once(':')
            .map_or(addr, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = ServerName::try_from(host.to_string()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{host:?} is not a name TLS can check: {e}"),
            )
        })?;
        self.connector
            .connect(name, tcp)
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("TLS with {addr} failed: {e}")))
    }
}

/// A client's connection to the master: plain TCP, or TLS over it.
pub enum ClientStream {
    Plain(TcpStream),
    Tls(Box<ClientTls<TcpStream>>),
}

impl ClientStream {
    /// Connects to `addr` within `timeout`, with TLS where `tls` is given.
    pub async fn connect(
        addr: &str,
        tls: Option<&TlsClient>,
        timeout: std::time::Duration,
    ) -> io::Result<ClientStream> {
        tokio::time::timeout(timeout, Self::open(addr, tls))
            .await
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("cannot connect to {addr} within {timeout:?}"),
                ))
            })
    }

    /// Connects to `addr`, with TLS where `tls` is given (the caller bounds the time).
    pub async fn open(addr: &str, tls: Option<&TlsClient>) -> io::Result<ClientStream> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        Ok(match tls {
            Some(t) => ClientStream::Tls(Box::new(t.connect(addr, tcp).await?)),
            None => ClientStream::Plain(tcp),
        })
    }

    /// The TCP stream, where no TLS runs over it (its bytes can be read straight off the socket).
    pub fn plain(&self) -> Option<&TcpStream> {
        match self {
            ClientStream::Plain(s) => Some(s),
            ClientStream::Tls(_) => None,
        }
    }

    /// Whether an idle connection is still usable: its peer has not closed it (and, on plain
    /// TCP, sent nothing nobody asked for). Never waits. Through TLS, bytes waiting unread (a
    /// session ticket, say) are the session's to judge: only a close is seen here.
    pub fn idle_and_open(&self) -> bool {
        match self {
            ClientStream::Plain(s) => crate::data_socket::idle_and_open(s),
            ClientStream::Tls(s) => {
                let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
                match socket2::SockRef::from(s.get_ref().0).peek(&mut byte) {
                    Ok(n) => n > 0,
                    Err(e) => e.kind() == io::ErrorKind::WouldBlock,
                }
            }
        }
    }
}

impl tokio::io::AsyncRead for ClientStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for ClientStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            ClientStream::Tls(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_say_what_is_wrong() {
        let dir = std::env::temp_dir().join(format!("mooncake-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let e = TlsClient::new(&empty, None).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");
        let e = TlsClient::new(&dir.join("missing.pem"), None).unwrap_err();
        assert!(e.contains("cannot read"), "{e}");
        let e = acceptor(&empty, &empty, None).err().unwrap();
        assert!(e.contains("no PEM certificate"), "{e}");
        assert!(TlsClient::from_files(None, None, None).unwrap().is_none());
        let e = TlsClient::from_files(None, Some(&empty), None).unwrap_err();
        assert!(e.contains("needs tls_ca"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
