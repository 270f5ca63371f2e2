//! Who may talk to a port: keys derived from secret files, a keyring of the identities a server
//! accepts, and the credential a client proves (see `handshake` for the exchange). The secret
//! itself never crosses the wire: a peer proves it by a keyed hash over two fresh nonces.

mod handshake;
pub mod seal;
mod tcp;

use std::{collections::HashMap, fmt, path::Path};

pub use handshake::{
    admit, authenticate, authenticate_blocking, starts_with_hello, Admission, AuthError,
    HELLO_MAGIC,
};
pub use seal::{wall_clock_us, Access, Scope, Seal, SealError, SealKey, SEAL_LEN};
pub use tcp::{admit_tcp, grpc_channel, peek_hello, prove, AUTH_REQUIRED};

/// The identity of the cluster-wide secret (owners, the master, and clients of no tenant).
pub const CLUSTER: &str = "cluster";
/// Longest identity a hello may name.
pub const MAX_IDENTITY: usize = 64;
/// Fewest bytes a secret file must hold (after trimming whitespace).
pub const MIN_SECRET: usize = 16;

/// A 256-bit key, derived from a secret for one purpose. Its `Debug` shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct Key([u8; 32]);

impl Key {
    /// The key that proves connections, derived from a secret's bytes.
    pub fn for_connections(secret: &[u8]) -> Key {
        Key(blake3::derive_key(
            "mooncake-rs 2026-11 connection authentication",
            secret,
        ))
    }

    /// The keyed hash of `parts`, each length-prefixed so that no two splits collide.
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        for p in parts {
            h.update(&(p.len() as u32).to_le_bytes());
            h.update(p);
        }
        h.finalize()
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(..)")
    }
}

/// Reads a secret file: its bytes without surrounding whitespace, at least `MIN_SECRET` of them.
/// A file others may read is accepted with a warning (the operator may share it through a group).
pub fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let raw = std::fs::read(path)
        .map_err(|e| format!("cannot read auth token file {}: {e}", path.display()))?;
    let secret = raw.trim_ascii().to_vec();
    if secret.len() < MIN_SECRET {
        return Err(format!(
            "auth token file {} holds {} bytes; a secret needs at least {MIN_SECRET} \
             (make one with `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`)",
            path.display(),
            secret.len()
        ));
    }
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o007 != 0 {
                tracing::warn!(
                    file = %path.display(),
                    "the auth token file is readable by every user; chmod 600 (or 640) it"
                );
            }
        }
    }
    Ok(secret)
}

/// What a server of a cluster with a secret holds: who may connect, and the key of the master's
/// seals on grants and leases.
#[derive(Clone, Debug)]
pub struct ServerAuth {
    pub keyring: Keyring,
    pub seals: SealKey,
}

impl ServerAuth {
    pub fn from_secret(secret: &[u8]) -> ServerAuth {
        ServerAuth {
            keyring: Keyring::cluster(secret),
            seals: SealKey::from_secret(secret),
        }
    }

    /// From the cluster's secret file (see `read_secret`).
    pub fn from_file(path: &Path) -> Result<ServerAuth, String> {
        Ok(ServerAuth::from_secret(&read_secret(path)?))
    }

    /// What this server proves when it connects to its peers (an owner to the master and to
    /// other owners).
    pub fn credential(&self) -> Credential {
        self.keyring
            .credential(CLUSTER)
            .expect("a server's keyring holds the cluster's secret")
    }
}

/// What a client proves: an identity and the key of its secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credential {
    identity: String,
    key: Key,
}

impl Credential {
    /// `identity` must be 1 to `MAX_IDENTITY` bytes.
    pub fn new(identity: &str, secret: &[u8]) -> Result<Credential, String> {
        check_identity(identity)?;
        Ok(Credential {
            identity: identity.to_string(),
            key: Key::for_connections(secret),
        })
    }

    /// The cluster's credential from its secret file.
    pub fn cluster_from_file(path: &Path) -> Result<Credential, String> {
        Credential::new(CLUSTER, &read_secret(path)?)
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }
}

/// The identities a server accepts, with their keys.
#[derive(Clone, Debug, Default)]
pub struct Keyring {
    keys: HashMap<String, Key>,
}

impl Keyring {
    /// A keyring accepting only the cluster's secret.
    pub fn cluster(secret: &[u8]) -> Keyring {
        let mut k = Keyring::default();
        k.insert(CLUSTER, secret)
            .expect("the cluster identity is valid");
        k
    }

    /// A keyring accepting only the cluster's secret, read from its file.
    pub fn cluster_from_file(path: &Path) -> Result<Keyring, String> {
        Ok(Keyring::cluster(&read_secret(path)?))
    }

    /// Accepts `identity` proving `secret` (replacing an earlier secret of that identity).
    pub fn insert(&mut self, identity: &str, secret: &[u8]) -> Result<(), String> {
        check_identity(identity)?;
        self.keys
            .insert(identity.to_string(), Key::for_connections(secret));
        Ok(())
    }

    /// The credential this keyring's holder proves when it connects to its peers.
    pub fn credential(&self, identity: &str) -> Option<Credential> {
        self.keys.get(identity).map(|key| Credential {
            identity: identity.to_string(),
            key: key.clone(),
        })
    }

    fn key(&self, identity: &str) -> Option<&Key> {
        self.keys.get(identity)
    }
}

fn check_identity(identity: &str) -> Result<(), String> {
    if identity.is_empty() || identity.len() > MAX_IDENTITY {
        return Err(format!(
            "identity {identity:?} must be 1 to {MAX_IDENTITY} bytes"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_files_are_trimmed_and_checked() {
        let dir = std::env::temp_dir().join(format!("mooncake-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(&good, "  0123456789abcdef0123\n").unwrap();
        assert_eq!(read_secret(&good).unwrap(), b"0123456789abcdef0123");
        let short = dir.join("short");
        std::fs::write(&short, "tiny\n").unwrap();
        assert!(read_secret(&short).unwrap_err().contains("at least 16"));
        assert!(read_secret(&dir.join("missing"))
            .unwrap_err()
            .contains("cannot read"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn keys_differ_by_secret_and_hide_themselves() {
        let a = Key::for_connections(b"secret number one");
        assert_ne!(a, Key::for_connections(b"secret number two"));
        assert_eq!(format!("{a:?}"), "Key(..)");
        // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        assert_ne!(a.mac(&[b"ab", b"c"]), a.mac(&[b"a", b"bc"]));
    }
}
