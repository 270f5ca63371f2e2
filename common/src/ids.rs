//! Validated identifiers. Construct them with `parse`/`new`; a value of these types is known to be
//! well formed, so deeper layers never re-check.

use std::{fmt, str::FromStr, sync::Arc};

use serde::{Deserialize, Serialize};

/// Longest key accepted, in bytes. Keys are hashes of token prefixes plus a few ids in practice.
pub const MAX_KEY_LEN: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("key is empty")]
    EmptyKey,
    #[error("key is {0} bytes, longer than the limit of {MAX_KEY_LEN}")]
    KeyTooLong(usize),
    #[error("segment name must be \"host:port\" with a non-zero port, got {0:?}")]
    BadSegmentName(String),
    #[error("client id must be 32 hex digits, got {0:?}")]
    BadClientId(String),
}

/// An object key. Cheap to clone (shared string).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(Arc<str>);

impl ObjectKey {
    pub fn new(key: &str) -> Result<Self, IdError> {
        Self::validate(key)?;
        Ok(ObjectKey(Arc::from(key)))
    }

    /// Checks that `key` would make a valid key, without allocating one.
    pub fn validate(key: &str) -> Result<(), IdError> {
        if key.is_empty() {
            return Err(IdError::EmptyKey);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(IdError::KeyTooLong(key.len()));
        }
        Ok(())
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, IdError> {
        if bytes.len() > MAX_KEY_LEN {
            return Err(IdError::KeyTooLong(bytes.len()));
        }
        let s = std::str::from_utf8(bytes).map_err(|_| IdError::EmptyKey)?;
        Self::new(s)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::borrow::Borrow<str> for ObjectKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// A segment's name, which is also its owner's data-plane endpoint: `host:port`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SegmentName(Arc<str>);

impl SegmentName {
    pub fn parse(name: &str) -> Result<Self, IdError> {
        let bad = || IdError::BadSegmentName(name.to_string());
        let (host, port) = name.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let host_ok = !host.is_empty()
            && !host.chars().any(|c| c.is_whitespace() || c == '/')
            && (!host.contains(':') || (host.starts_with('[') && host.ends_with(']')));
        if port == 0 || !host_ok {
            return Err(bad());
        }
        Ok(SegmentName(Arc::from(name)))
    }

    pub fn from_host_port(host: &str, port: u16) -> Result<Self, IdError> {
        if host.contains(':') && !host.starts_with('[') {
            Self::parse(&format!("[{host}]:{port}"))
        } else {
            Self::parse(&format!("{host}:{port}"))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SegmentName {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        Self::parse(s)
    }
}

impl TryFrom<String> for SegmentName {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        Self::parse(&s)
    }
}

impl From<SegmentName> for String {
    fn from(s: SegmentName) -> String {
        s.0.to_string()
    }
}

impl fmt::Debug for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Identity of one client or owner process incarnation (a restart gets a new one).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientId(u128);

impl ClientId {
    pub fn from_u128(v: u128) -> Self {
        ClientId(v)
    }

    pub fn parse(s: &str) -> Result<Self, IdError> {
        if s.len() != 32 {
            return Err(IdError::BadClientId(s.to_string()));
        }
        u128::from_str_radix(s, 16)
            .map(ClientId)
            .map_err(|_| IdError::BadClientId(s.to_string()))
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!(ObjectKey::new(""), Err(IdError::EmptyKey));
        assert!(ObjectKey::new(&"k".repeat(MAX_KEY_LEN)).is_ok());
        assert_eq!(
            ObjectKey::new(&"k".repeat(MAX_KEY_LEN + 1)),
            Err(IdError::KeyTooLong(MAX_KEY_LEN + 1))
        );
        assert_eq!(ObjectKey::new("a/b@1").unwrap().as_str(), "a/b@1");
    }

    #[test]
    fn segment_names() {
        for ok in [
            "127.0.0.1:5000",
            "node-3:1",
            "[::1]:8080",
            "h.example:65535",
        ] {
            assert_eq!(SegmentName::parse(ok).unwrap().as_str(), ok);
        }
        for bad in [
            "",
            "host",
            "host:",
            ":80",
            "host:0",
            "host:70000",
            "a b:1",
            "::1:80",
            "h/x:1",
        ] {
            assert!(SegmentName::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            SegmentName::from_host_port("::1", 9).unwrap().as_str(),
            "[::1]:9"
        );
    }

    #[test]
    fn client_ids() {
        let id = ClientId::from_u128(0xabc);
        assert_eq!(ClientId::parse(&id.to_string()).unwrap(), id);
        assert!(ClientId::parse("xyz").is_err());
        assert!(ClientId::parse(&"g".repeat(32)).is_err());
    }
}
