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
pub use tcp::{admit_tcp, grpc_channel, peek_hello, prove, refused_proof, AUTH_REQUIRED};

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

/// A secret's bytes, shared; its `Debug` shows nothing of them.
#[derive(Clone)]
struct Secret(std::sync::Arc<Vec<u8>>);

impl Secret {
    fn new(bytes: &[u8]) -> Secret {
        Secret(std::sync::Arc::new(bytes.to_vec()))
    }
}

impl std::ops::Deref for Secret {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
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
    secret: Secret,
}

impl ServerAuth {
    pub fn from_secret(secret: &[u8]) -> ServerAuth {
        ServerAuth {
            keyring: Keyring::cluster(secret),
            seals: SealKey::from_secret(secret),
            secret: Secret::new(secret),
        }
    }

    /// The cluster's secret (to derive tenants' tokens from).
    pub fn secret(&self) -> &[u8] {
        &self.secret
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

    /// The credential a token file holds: a tenant's (see `tenant_token`) proves that tenant's
    /// identity, any other secret the cluster's.
    pub fn from_file(path: &Path) -> Result<Credential, String> {
        let secret = read_secret(path)?;
        match tenant_of_token(&secret) {
            Some(name) => Credential::new(name, &secret),
            None => Credential::new(CLUSTER, &secret),
        }
    }

    /// The tenant this credential is bound to (None: the cluster's, which may act as any).
    pub fn tenant(&self) -> Option<&str> {
        (self.identity != CLUSTER).then_some(self.identity.as_str())
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }
}

/// The token of tenant `name` in the cluster whose secret is `cluster_secret`: what the tenant's
/// token file holds. Holders of the cluster's secret (the master, owners) derive it, so owners
/// admit a tenant's workers without a list; the master admits only the tenants its config names.
pub fn tenant_token(cluster_secret: &[u8], name: &str) -> String {
    let mut material = Vec::with_capacity(cluster_secret.len() + 1 + name.len());
    material.extend_from_slice(cluster_secret);
    material.push(0);
    material.extend_from_slice(name.as_bytes());
    let k = blake3::derive_key("mooncake-rs 2026-11 tenant token", &material);
    let hex: String = k.iter().map(|b| format!("{b:02x}")).collect();
    format!("{TENANT_TOKEN_PREFIX}{name}/{hex}")
}

const TENANT_TOKEN_PREFIX: &str = "tenant/";

/// The tenant named by a token of `tenant_token`'s form (not checked against any secret).
fn tenant_of_token(secret: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(secret).ok()?;
    let (name, _) = s.strip_prefix(TENANT_TOKEN_PREFIX)?.split_once('/')?;
    (!name.is_empty() && name != CLUSTER).then_some(name)
}

/// The identities a server accepts, with their keys.
#[derive(Clone, Debug, Default)]
pub struct Keyring {
    keys: HashMap<String, Key>,
    /// With the cluster's secret here, every tenant's identity is accepted with the key of its
    /// derived token (see `tenant_token`).
    tenants_of: Option<Secret>,
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

    /// Also accepts every tenant proving its token derived from `cluster_secret` (owners).
    pub fn with_derived_tenants(mut self, cluster_secret: &[u8]) -> Keyring {
        self.tenants_of = Some(Secret::new(cluster_secret));
        self
    }

    /// Accepts tenant `name` proving the token in `token_file`, which must be the one derived
    /// from `cluster_secret` (the master, for each tenant its config lists with a token file).
    pub fn insert_tenant(
        &mut self,
        cluster_secret: &[u8],
        name: &str,
        token_file: &Path,
    ) -> Result<(), String> {
        let token = read_secret(token_file)?;
        if token != tenant_token(cluster_secret, name).as_bytes() {
            return Err(format!(
                "the token file {} is not tenant {name:?}'s token of this cluster: make it with \
                 `mooncake_master --auth_token_file CLUSTER_TOKEN --print_tenant_token {name}`",
                token_file.display()
            ));
        }
        self.insert(name, &token)
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

    fn key(&self, identity: &str) -> Option<Key> {
        if let Some(k) = self.keys.get(identity) {
            return Some(k.clone());
        }
        let cluster = self.tenants_of.as_ref()?;
        let tenant = crate::tenant::Tenant::parse(identity).ok()?;
        (!tenant.is_default() && identity != CLUSTER)
            .then(|| Key::for_connections(tenant_token(cluster, identity).as_bytes()))
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
    fn debug_output_shows_nothing_of_a_secret() {
        let secret = b"a secret that must never be logged!!";
        let keyring = Keyring::cluster(secret).with_derived_tenants(secret);
        for shown in [
            format!("{:?}", ServerAuth::from_secret(secret)),
            format!("{keyring:?}"),
        ] {
            assert!(!shown.contains("must never"), "{shown}");
            // Nor as a list of byte values.
            assert!(
                !shown.contains(&format!("{}, {}", secret[0], secret[1])),
                "{shown}"
            );
        }
    }

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
    fn tenant_tokens_are_derived_and_bound_to_their_tenant() {
        let cluster = b"the cluster's secret, 32 bytes!!";
        let a = tenant_token(cluster, "a");
        assert!(a.starts_with("tenant/a/") && a.len() == "tenant/a/".len() + 64);
        assert_ne!(a, tenant_token(cluster, "b"));
        assert_ne!(a, tenant_token(b"another cluster's secret........", "a"));
        assert_eq!(tenant_of_token(a.as_bytes()), Some("a"));
        assert_eq!(tenant_of_token(cluster), None);
        // Owners accept any tenant's derived token; a cluster keyring alone does not.
        let owners = Keyring::cluster(cluster).with_derived_tenants(cluster);
        assert_eq!(owners.key("a"), Some(Key::for_connections(a.as_bytes())));
        assert_eq!(owners.key("bad name"), None);
        assert_eq!(Keyring::cluster(cluster).key("a"), None);
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
