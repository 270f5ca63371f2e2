//! The exchange that opens a connection to a port with a keyring, before the port's own
//! protocol starts. All integers little-endian:
//!
//! ```text
//! client -> server  hello      "MCAUTH1\0" | client nonce [32] | identity length u8 | identity
//! server -> client  challenge  status i32, then for 0 (prove): server nonce [32] | server proof [32]
//!                              for 1 (this server runs open): nothing more
//!                              for a negative code: message length u16 | message
//! client -> server  proof      client proof [32]
//! server -> client  verdict    status i32 | message length u16 | message
//! ```
//!
//! A proof is the keyed hash (BLAKE3, keyed with the identity's connection key) of a role label,
//! the identity and both nonces: fresh nonces on both sides make a recorded exchange useless on
//! another connection, and the server's proof tells the client it reached a holder of the secret.
//! A server tells a peer that speaks its protocol without a hello (no credential configured) by
//! the first bytes it peeks, and answers it in that protocol with `Code::Unauthenticated`.

use std::{
    fmt,
    io::{self, Read, Write},
    time::Duration,
};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{Credential, Key, Keyring, MAX_IDENTITY};
use crate::Code;

/// The first bytes of a hello; no protocol of this project starts with them.
pub const HELLO_MAGIC: [u8; 8] = *b"MCAUTH1\0";
const NONCE: usize = 32;
const PROOF: usize = 32;
const PROVE: i32 = 0;
const OPEN: i32 = 1;
const MAX_MESSAGE: usize = 512;
const CLIENT_LABEL: &[u8] = b"mooncake-rs auth v1 client";
const SERVER_LABEL: &[u8] = b"mooncake-rs auth v1 server";

/// Whether a connection whose first bytes are `first` opens with a hello: `None` while they
/// are a proper prefix of one (wait for more).
pub fn starts_with_hello(first: &[u8]) -> Option<bool> {
    let n = first.len().min(HELLO_MAGIC.len());
    if first[..n] != HELLO_MAGIC[..n] {
        Some(false)
    } else if n == HELLO_MAGIC.len() {
        Some(true)
    } else {
        None
    }
}

/// How a server let a connection in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// The server has no keyring: everyone is let in.
    Open,
    /// The peer proved the secret of this identity.
    Authenticated(String),
    /// The server has a keyring and the peer started its protocol without a hello: answer its
    /// first request with `Code::Unauthenticated` in that protocol, then close.
    Unauthenticated,
}

/// The server's side of a connection whose first bytes were peeked (`hello`: they open a
/// hello). A failed proof is answered with a refusal and returned as an error; every refusal is
/// logged with `peer`. The exchange must finish within `timeout`.
pub async fn admit<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    hello: bool,
    keyring: Option<&Keyring>,
    peer: &(dyn fmt::Display + Sync),
    timeout: Duration,
) -> io::Result<Admission> {
    if !hello {
        if keyring.is_some() {
            tracing::warn!(%peer, "refused a peer that did not authenticate (it has no auth token configured)");
            return Ok(Admission::Unauthenticated);
        }
        return Ok(Admission::Open);
    }
    let exchange = async {
        let mut head = [0u8; HELLO_MAGIC.len() + NONCE + 1];
        stream.read_exact(&mut head).await?;
        let client_nonce: [u8; NONCE] = head[8..8 + NONCE].try_into().expect("32 bytes");
        let mut identity = vec![0u8; head[8 + NONCE] as usize];
        stream.read_exact(&mut identity).await?;
        let identity = String::from_utf8_lossy(&identity).into_owned();
        let Some(keyring) = keyring else {
            stream.write_all(&OPEN.to_le_bytes()).await?;
            stream.flush().await?;
            return Ok(Admission::Open);
        };
        // An unknown identity goes through the same exchange with a key nobody holds, so that
        // the answers do not tell which tenant names exist; only this server's log says why.
        let known = keyring.key(&identity);
        let unknown = known.is_none();
        let key = known.unwrap_or_else(decoy_key);
        let reason = |fallback: String| {
            if unknown {
                format!("unknown identity {identity:?}")
            } else {
                fallback
            }
        };
        let server_nonce = nonce()?;
        let mut challenge = Vec::with_capacity(4 + NONCE + PROOF);
        challenge.extend_from_slice(&PROVE.to_le_bytes());
        challenge.extend_from_slice(&server_nonce);
        challenge.extend_from_slice(
            key.mac(&[
                SERVER_LABEL,
                identity.as_bytes(),
                &client_nonce,
                &server_nonce,
            ])
            .as_bytes(),
        );
        stream.write_all(&challenge).await?;
        stream.flush().await?;
        let mut proof = [0u8; PROOF];
        if let Err(e) = stream.read_exact(&mut proof).await {
            return Err(refused(
                peer,
                &reason(format!(
                    "it hung up instead of proving ({e}): its secret differs from this server's"
                )),
            ));
        }
        let expected = key.mac(&[
            CLIENT_LABEL,
            identity.as_bytes(),
            &client_nonce,
            &server_nonce,
        ]);
        // `blake3::Hash` compares in constant time.
        if unknown || expected != blake3::Hash::from_bytes(proof) {
            // The same words to the peer either way.
            stream
                .write_all(&refusal(&format!("wrong secret for identity {identity:?}")))
                .await?;
            stream.flush().await?;
            return Err(refused(
                peer,
                &reason(format!("wrong secret for identity {identity:?}")),
            ));
        }
        stream.write_all(&verdict_ok()).await?;
        stream.flush().await?;
        Ok(Admission::Authenticated(identity))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!(%peer, "a peer did not finish authenticating within {timeout:?}");
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("peer did not finish authenticating within {timeout:?}"),
            ))
        }
    }
}

/// Why a client could not authenticate.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("authentication failed: {0}")]
    Io(#[from] io::Error),
    #[error("the server refused this client's credential: {0}")]
    Refused(String),
    #[error("the server did not prove it holds this peer's secret: it has another secret, it does not know this peer's identity (tenant name), or it is not the peer it claims to be")]
    BadServer,
    #[error("the server runs open (it has no auth token) while this peer has one: refused, since an open server proves nothing and anyone could be answering; give the server the same auth_token_file, or take this peer's away")]
    OpenServer,
}

impl AuthError {
    pub fn code(&self) -> Code {
        match self {
            AuthError::Io(_) => Code::RpcFail,
            AuthError::Refused(_) | AuthError::BadServer | AuthError::OpenServer => {
                Code::Unauthenticated
            }
        }
    }

    /// As an I/O error, for callers whose connect path reports those.
    pub fn into_io(self) -> io::Error {
        match self {
            AuthError::Io(e) => e,
            e => io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()),
        }
    }
}

/// The client's side: proves `credential` and checks the server's proof. A server that says it
/// runs open is refused: it proves nothing, so whoever took its address (a socket path squatted
/// in /tmp, a spoofed host) could be answering, and a peer given a secret expects its servers to
/// hold it. The caller bounds the time.
pub async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    credential: &Credential,
) -> Result<(), AuthError> {
    let client_nonce = nonce()?;
    stream.write_all(&hello(credential, &client_nonce)).await?;
    stream.flush().await?;
    let mut status = [0u8; 4];
    stream.read_exact(&mut status).await?;
    match i32::from_le_bytes(status) {
        PROVE => {}
        OPEN => return Err(AuthError::OpenServer),
        _ => return Err(AuthError::Refused(read_message(stream).await?)),
    }
    let mut challenge = [0u8; NONCE + PROOF];
    stream.read_exact(&mut challenge).await?;
    let proof = answer(credential, &client_nonce, &challenge)?;
    stream.write_all(&proof).await?;
    stream.flush().await?;
    stream.read_exact(&mut status).await?;
    let message = read_message(stream).await?;
    match i32::from_le_bytes(status) {
        0 => Ok(()),
        _ => Err(AuthError::Refused(message)),
    }
}

/// `authenticate` on a blocking stream (whose timeouts bound it).
pub fn authenticate_blocking<S: Read + Write>(
    stream: &mut S,
    credential: &Credential,
) -> Result<(), AuthError> {
    let client_nonce = nonce()?;
    stream.write_all(&hello(credential, &client_nonce))?;
    let mut status = [0u8; 4];
    stream.read_exact(&mut status)?;
    let read_message = |stream: &mut S| -> io::Result<String> {
        let mut len = [0u8; 2];
        stream.read_exact(&mut len)?;
        let mut m = vec![0u8; u16::from_le_bytes(len) as usize];
        stream.read_exact(&mut m)?;
        Ok(String::from_utf8_lossy(&m).into_owned())
    };
    match i32::from_le_bytes(status) {
        PROVE => {}
        OPEN => return Err(AuthError::OpenServer),
        _ => return Err(AuthError::Refused(read_message(stream)?)),
    }
    let mut challenge = [0u8; NONCE + PROOF];
    stream.read_exact(&mut challenge)?;
    stream.write_all(&answer(credential, &client_nonce, &challenge)?)?;
    stream.read_exact(&mut status)?;
    let message = read_message(stream)?;
    match i32::from_le_bytes(status) {
        0 => Ok(()),
        _ => Err(AuthError::Refused(message)),
    }
}

fn hello(credential: &Credential, client_nonce: &[u8; NONCE]) -> Vec<u8> {
    let id = credential.identity.as_bytes();
    debug_assert!(id.len() <= MAX_IDENTITY);
    let mut b = Vec::with_capacity(HELLO_MAGIC.len() + NONCE + 1 + id.len());
    b.extend_from_slice(&HELLO_MAGIC);
    b.extend_from_slice(client_nonce);
    b.push(id.len() as u8);
    b.extend_from_slice(id);
    b
}

/// Checks the server's proof in `challenge` and computes the client's.
fn answer(
    credential: &Credential,
    client_nonce: &[u8; NONCE],
    challenge: &[u8; NONCE + PROOF],
) -> Result<[u8; PROOF], AuthError> {
    let (server_nonce, server_proof) = challenge.split_at(NONCE);
    let id = credential.identity.as_bytes();
    let expected = credential
        .key
        .mac(&[SERVER_LABEL, id, client_nonce, server_nonce]);
    let got = blake3::Hash::from_bytes(server_proof.try_into().expect("32 bytes"));
    if expected != got {
        return Err(AuthError::BadServer);
    }
    Ok(*credential
        .key
        .mac(&[CLIENT_LABEL, id, client_nonce, server_nonce])
        .as_bytes())
}

async fn read_message<S: AsyncRead + Unpin>(stream: &mut S) -> io::Result<String> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await?;
    let mut m = vec![0u8; u16::from_le_bytes(len) as usize];
    stream.read_exact(&mut m).await?;
    Ok(String::from_utf8_lossy(&m).into_owned())
}

fn refusal(why: &str) -> Vec<u8> {
    let why = &why.as_bytes()[..why.len().min(MAX_MESSAGE)];
    let mut b = Vec::with_capacity(6 + why.len());
    b.extend_from_slice(&Code::Unauthenticated.as_i32().to_le_bytes());
    b.extend_from_slice(&(why.len() as u16).to_le_bytes());
    b.extend_from_slice(why);
    b
}

fn verdict_ok() -> [u8; 6] {
    [0; 6]
}

fn refused(peer: &(dyn fmt::Display + Sync), why: &str) -> io::Error {
    tracing::warn!(%peer, reason = why, "refused a peer's authentication");
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("peer {peer} failed authentication: {why}"),
    )
}

/// A key for identities a server does not know: random, made once per process, never sent.
fn decoy_key() -> Key {
    static DECOY: std::sync::OnceLock<Key> = std::sync::OnceLock::new();
    DECOY
        .get_or_init(|| {
            let mut secret = [0u8; 32];
            // An unknown identity is refused whatever it proves, so even a decoy made without
            // random bytes lets nobody in; it would only tell unknown names from known ones.
            let _ = getrandom::fill(&mut secret);
            Key::for_connections(&[b"mooncake-rs decoy ".as_slice(), &secret].concat())
        })
        .clone()
}

fn nonce() -> io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| io::Error::other(format!("no random bytes: {e}")))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::CLUSTER;

    const SECRET: &[u8] = b"the cluster's secret, 32 bytes!!";

    /// Runs both sides over a pipe. A client without a credential starts its protocol instead.
    async fn exchange(
        keyring: Option<Keyring>,
        credential: Option<Credential>,
    ) -> (io::Result<Admission>, Option<Result<(), AuthError>>) {
        let (mut c, mut s) = tokio::io::duplex(4096);
        let hello = credential.is_some();
        let server = tokio::spawn(async move {
            admit(
                &mut s,
                hello,
                keyring.as_ref(),
                &"test-peer",
                Duration::from_secs(5),
            )
            .await
        });
        let client = match &credential {
            Some(cred) => Some(authenticate(&mut c, cred).await),
            None => None,
        };
        drop(c);
        (server.await.unwrap(), client)
    }

    fn cluster(secret: &[u8]) -> Option<Credential> {
        Some(Credential::new(CLUSTER, secret).unwrap())
    }

    #[tokio::test]
    async fn the_right_secret_is_let_in() {
        let (s, c) = exchange(Some(Keyring::cluster(SECRET)), cluster(SECRET)).await;
        assert_eq!(s.unwrap(), Admission::Authenticated(CLUSTER.into()));
        c.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_wrong_secret_is_refused_on_both_sides() {
        let (s, c) = exchange(
            Some(Keyring::cluster(SECRET)),
            cluster(b"another secret, 32 bytes long!!!"),
        )
        .await;
        // The client finds the server's proof wrong first and hangs up without proving.
        assert_eq!(s.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        let c = c.unwrap().unwrap_err();
        assert!(matches!(c, AuthError::BadServer), "{c}");
        assert_eq!(c.code(), Code::Unauthenticated);
    }

    /// The server's log names the reason; the peer learns no more than from a wrong secret, so
    /// probing does not tell which tenant names exist.
    #[tokio::test]
    async fn an_unknown_identity_is_refused_like_a_wrong_secret() {
        let mut keyring = Keyring::cluster(SECRET);
        keyring
            .insert("tenant-a", b"tenant a's secret, long enough")
            .unwrap();
        let unknown = Some(Credential::new("tenant-x", SECRET).unwrap());
        let (s, c) = exchange(Some(keyring.clone()), unknown).await;
        assert!(s
            .unwrap_err()
            .to_string()
            .contains("unknown identity \"tenant-x\""));
        let unknown = c.unwrap().unwrap_err();
        let wrong = Some(Credential::new("tenant-a", SECRET).unwrap());
        let (s, c) = exchange(Some(keyring.clone()), wrong).await;
        assert!(!s.unwrap_err().to_string().contains("unknown identity"));
        let wrong = c.unwrap().unwrap_err();
        assert!(matches!(unknown, AuthError::BadServer), "{unknown}");
        assert_eq!(unknown.to_string(), wrong.to_string());
        assert!(unknown.to_string().contains("identity"), "{unknown}");

        // A peer that goes on and proves anyway (here: one that skips checking the server's
        // proof) is refused with the words a wrong secret gets, and never let in.
        let (mut c, mut srv) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move {
            admit(
                &mut srv,
                true,
                Some(&keyring),
                &"test-peer",
                Duration::from_secs(5),
            )
            .await
        });
        let cred = Credential::new("tenant-x", SECRET).unwrap();
        let client_nonce = [7u8; NONCE];
        c.write_all(&hello(&cred, &client_nonce)).await.unwrap();
        let mut challenge = [0u8; 4 + NONCE + PROOF];
        c.read_exact(&mut challenge).await.unwrap();
        assert_eq!(
            i32::from_le_bytes(challenge[..4].try_into().unwrap()),
            PROVE
        );
        let server_nonce = &challenge[4..4 + NONCE];
        let proof = cred
            .key
            .mac(&[CLIENT_LABEL, b"tenant-x", &client_nonce, server_nonce]);
        c.write_all(proof.as_bytes()).await.unwrap();
        let mut status = [0u8; 4];
        c.read_exact(&mut status).await.unwrap();
        assert_ne!(i32::from_le_bytes(status), 0);
        let message = read_message(&mut c).await.unwrap();
        assert_eq!(message, "wrong secret for identity \"tenant-x\"");
        assert!(server.await.unwrap().is_err());
    }

    #[tokio::test]
    async fn open_servers_let_peers_without_a_secret_in_and_guarded_ones_flag_silent_peers() {
        // A peer with a secret refuses an open server: it proves nothing.
        let (s, c) = exchange(None, cluster(SECRET)).await;
        assert_eq!(s.unwrap(), Admission::Open);
        let c = c.unwrap().unwrap_err();
        assert!(matches!(c, AuthError::OpenServer), "{c}");
        assert_eq!(c.code(), Code::Unauthenticated);
        assert!(c.to_string().contains("auth_token_file"), "{c}");
        let (s, _) = exchange(None, None).await;
        assert_eq!(s.unwrap(), Admission::Open);
        let (s, _) = exchange(Some(Keyring::cluster(SECRET)), None).await;
        assert_eq!(s.unwrap(), Admission::Unauthenticated);
    }

    /// The blocking side (the same-host path) refuses an open server too: a socket squatted by
    /// another local user that answers "open" gets no put and serves no get.
    #[test]
    fn the_blocking_client_refuses_an_open_server() {
        use std::os::unix::net::UnixStream;
        let (mut c, mut s) = UnixStream::pair().unwrap();
        let squatter = std::thread::spawn(move || {
            let mut head = [0u8; HELLO_MAGIC.len() + NONCE + 1];
            s.read_exact(&mut head).unwrap();
            let mut identity = vec![0u8; head[HELLO_MAGIC.len() + NONCE] as usize];
            s.read_exact(&mut identity).unwrap();
            s.write_all(&OPEN.to_le_bytes()).unwrap();
        });
        let cred = Credential::new(CLUSTER, SECRET).unwrap();
        let e = authenticate_blocking(&mut c, &cred).unwrap_err();
        assert!(matches!(e, AuthError::OpenServer), "{e}");
        assert_eq!(e.into_io().kind(), io::ErrorKind::PermissionDenied);
        squatter.join().unwrap();
    }

    #[tokio::test]
    async fn a_proof_from_another_connection_is_refused() {
        let cred = Credential::new(CLUSTER, SECRET).unwrap();
        let (mut c, mut s) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move {
            let k = Keyring::cluster(SECRET);
            admit(&mut s, true, Some(&k), &"replayer", Duration::from_secs(5)).await
        });
        let client_nonce = [7u8; NONCE];
        c.write_all(&hello(&cred, &client_nonce)).await.unwrap();
        let mut challenge = [0u8; 4 + NONCE + PROOF];
        c.read_exact(&mut challenge).await.unwrap();
        // A proof recorded on a connection whose server nonce was different.
        let stale = cred
            .key
            .mac(&[CLIENT_LABEL, b"cluster", &client_nonce, &[9u8; NONCE]]);
        c.write_all(stale.as_bytes()).await.unwrap();
        let mut status = [0u8; 4];
        c.read_exact(&mut status).await.unwrap();
        assert_eq!(i32::from_le_bytes(status), Code::Unauthenticated.as_i32());
        assert!(server
            .await
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("wrong secret"));
    }

    #[tokio::test]
    async fn a_silent_peer_is_cut_off_at_the_deadline() {
        let (_c, mut s) = tokio::io::duplex(4096);
        let k = Keyring::cluster(SECRET);
        let r = admit(&mut s, true, Some(&k), &"slow", Duration::from_millis(50)).await;
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn hello_prefixes() {
        assert_eq!(starts_with_hello(b"MCAUTH1\0rest"), Some(true));
        assert_eq!(starts_with_hello(b"MCA"), None);
        assert_eq!(starts_with_hello(b""), None);
        assert_eq!(starts_with_hello(b"MCRP\x01\0\0\0"), Some(false));
        assert_eq!(starts_with_hello(b"CM"), Some(false));
    }

    #[test]
    fn proofs_bind_both_nonces_and_the_identity() {
        let cred = Credential::new(CLUSTER, SECRET).unwrap();
        let k = &cred.key;
        let base = k.mac(&[CLIENT_LABEL, b"cluster", &[1; 32], &[2; 32]]);
        assert_ne!(base, k.mac(&[CLIENT_LABEL, b"cluster", &[1; 32], &[3; 32]]));
        assert_ne!(base, k.mac(&[CLIENT_LABEL, b"cluster", &[4; 32], &[2; 32]]));
        assert_ne!(base, k.mac(&[CLIENT_LABEL, b"tenant", &[1; 32], &[2; 32]]));
        assert_ne!(base, k.mac(&[SERVER_LABEL, b"cluster", &[1; 32], &[2; 32]]));
    }
}
