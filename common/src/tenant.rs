//! Tenants: namespaces of keys on a shared cluster. A tenant's keys are stored under its name,
//! as `"\0" name "\0" key`; the default tenant's keys are stored as they are. Clients scope
//! their keys before anything leaves them (the master and the data plane see only scoped keys);
//! the master checks that every key of a call lies in its connection's tenant, so a key of the
//! default tenant that spells another tenant's prefix is refused, and a key in a tenant stays
//! in it whatever it holds.

use std::borrow::Cow;

/// The gRPC metadata entry in which a client names its tenant (the framed RPC has a call).
pub const GRPC_HEADER: &str = "mooncake-tenant";
/// Longest tenant name.
pub const MAX_TENANT: usize = 48;
/// The byte that opens (and closes) a tenant's name in a scoped key.
const MARK: char = '\0';

/// A tenant's name, checked: 1 to `MAX_TENANT` bytes of ASCII letters, digits, `-`, `_` and
/// `.`. The default tenant is the empty name (`""` and `"default"` both name it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(Box<str>);

impl Tenant {
    /// `name` as a tenant ("" and "default" are the default tenant).
    pub fn parse(name: &str) -> Result<Tenant, String> {
        if name.is_empty() || name == "default" {
            return Ok(Tenant::default());
        }
        if name == crate::auth::CLUSTER {
            return Err(format!(
                "tenant {name:?} is reserved (it names the cluster's own credential)"
            ));
        }
        if name.len() > MAX_TENANT
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(format!(
                "tenant {name:?} must be 1 to {MAX_TENANT} ASCII letters, digits, '-', '_' or '.'"
            ));
        }
        Ok(Tenant(name.into()))
    }

    /// The name ("" for the default tenant).
    pub fn name(&self) -> &str {
        &self.0
    }

    pub fn is_default(&self) -> bool {
        self.0.is_empty()
    }

    /// How the name reads in logs and metrics labels.
    pub fn label(&self) -> &str {
        if self.is_default() {
            "default"
        } else {
            &self.0
        }
    }

    /// The stored form of `key` in this tenant's namespace (the key itself for the default
    /// tenant). The master checks what comes of it (its length, and that it lies in the
    /// caller's tenant): a default-tenant key that names another namespace is refused there.
    pub fn scope<'a>(&self, key: &'a str) -> Cow<'a, str> {
        if self.is_default() {
            return Cow::Borrowed(key);
        }
        let mut s = String::with_capacity(key.len() + self.0.len() + 2);
        s.push(MARK);
        s.push_str(&self.0);
        s.push(MARK);
        s.push_str(key);
        Cow::Owned(s)
    }

    /// `stored`'s key as its tenant's users know it, if `stored` lies in this tenant.
    pub fn unscope<'a>(&self, stored: &'a str) -> Option<&'a str> {
        let (tenant, key) = split(stored);
        (tenant == &*self.0).then_some(key)
    }

    /// Whether `stored` lies in this tenant's namespace.
    pub fn owns(&self, stored: &str) -> bool {
        split(stored).0 == &*self.0
    }
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// A stored key's tenant name ("" for the default tenant) and the key within it. A key that
/// opens a namespace without closing it reads as the default tenant's (no client makes one;
/// the master refuses it from every tenant but the default, whose users cannot give it).
pub fn split(stored: &str) -> (&str, &str) {
    if let Some(rest) = stored.strip_prefix(MARK) {
        if let Some(end) = rest.find(MARK) {
            return (&rest[..end], &rest[end + 1..]);
        }
    }
    ("", stored)
}

/// The tenant name of a stored key ("" for the default tenant).
pub fn tenant_of(stored: &str) -> &str {
    split(stored).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_default_is_empty() {
        assert!(Tenant::parse("").unwrap().is_default());
        assert!(Tenant::parse("default").unwrap().is_default());
        assert_eq!(Tenant::parse("team-a.v2_x").unwrap().name(), "team-a.v2_x");
        for bad in [
            "a b",
            "a/b",
            "ä",
            "a\0",
            "cluster",
            &"x".repeat(MAX_TENANT + 1),
        ] {
            assert!(Tenant::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn scoped_keys_stay_in_their_namespace() {
        let a = Tenant::parse("a").unwrap();
        let b = Tenant::parse("b").unwrap();
        let d = Tenant::default();
        let ka = a.scope("k");
        assert_eq!(ka, "\0a\0k");
        assert_eq!(d.scope("k"), "k");
        assert!(a.owns(&ka) && !b.owns(&ka) && !d.owns(&ka));
        assert_eq!(a.unscope(&ka), Some("k"));
        assert_eq!(b.unscope(&ka), None);
        assert!(d.owns("k") && !a.owns("k"));
        assert_eq!(split(&ka), ("a", "k"));
        // A default-tenant key spelling a's prefix reads as a's (the master refuses it from
        // the default tenant); in tenant b the same text stays in b.
        assert!(a.owns(&d.scope("\0a\0k")) && !d.owns(&d.scope("\0a\0k")));
        assert_eq!(split(&b.scope("\0a\0k")), ("b", "\0a\0k"));
        // An unterminated mark reads as the default tenant's key.
        assert_eq!(split("\0abc"), ("", "\0abc"));
    }
}
