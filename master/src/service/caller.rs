//! Who a call comes from: the tenant whose namespace its keys must lie in (see
//! `mooncake_common::tenant`), and whether it may make the owners' calls. A connection's caller
//! follows from how it authenticated and which tenant it asked to act as.

use mooncake_common::{auth::CLUSTER, tenant::Tenant, ObjectKey};

use crate::error::MasterError;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    tenant: Tenant,
    /// Holds the cluster's secret (or the master runs open): may mount segments and report.
    owner: bool,
}

impl Caller {
    /// A peer of the cluster (or of an open master) acting in the default tenant.
    pub fn cluster() -> Caller {
        Caller {
            tenant: Tenant::default(),
            owner: true,
        }
    }

    /// The caller of a connection that authenticated as `identity` (None: the master runs
    /// open) and asked to act as tenant `declared` (None: did not ask). The cluster's secret may
    /// act as any tenant; a tenant's own token only as that tenant.
    pub fn resolve(identity: Option<&str>, declared: Option<&str>) -> Result<Caller, MasterError> {
        let declared = declared
            .map(|d| Tenant::parse(d).map_err(MasterError::Invalid))
            .transpose()?;
        match identity {
            None | Some(CLUSTER) => Ok(match declared {
                Some(tenant) if !tenant.is_default() => Caller {
                    tenant,
                    owner: false,
                },
                _ => Caller::cluster(),
            }),
            Some(name) => {
                let own = Tenant::parse(name).map_err(MasterError::Invalid)?;
                if let Some(d) = declared.filter(|d| *d != own) {
                    return Err(MasterError::Denied(format!(
                        "this connection proved tenant {own}'s token; it cannot act as tenant {d}"
                    )));
                }
                Ok(Caller {
                    tenant: own,
                    owner: false,
                })
            }
        }
    }

    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// `key`, if it is a valid key of this caller's tenant.
    pub fn key<'a>(&self, key: &'a str) -> Result<&'a str, MasterError> {
        ObjectKey::validate(key)?;
        if !self.tenant.owns(key) {
            return Err(self.foreign(key));
        }
        // A tenant's empty key is refused as the default tenant's is.
        if mooncake_common::tenant::split(key).1.is_empty() {
            return Err(mooncake_common::IdError::EmptyKey.into());
        }
        Ok(key)
    }

    /// `key` as an `ObjectKey`, if it is a valid key of this caller's tenant.
    pub fn object_key(&self, key: &str) -> Result<ObjectKey, MasterError> {
        self.key(key).and_then(|k| Ok(ObjectKey::new(k)?))
    }

    /// Whether a stored key lies in this caller's tenant.
    pub fn owns(&self, stored: &str) -> bool {
        self.tenant.owns(stored)
    }

    /// The owners' calls (mounting, heartbeats, reports) need the cluster's secret.
    pub fn owner_call(&self) -> Result<(), MasterError> {
        if self.owner {
            Ok(())
        } else {
            Err(MasterError::Denied(format!(
                "tenant {}'s workers may not make an owner's calls (they need the cluster's token)",
                self.tenant
            )))
        }
    }

    fn foreign(&self, key: &str) -> MasterError {
        tracing::warn!(tenant = %self.tenant, key = ?key, "refused a key outside the caller's tenant");
        MasterError::Denied(format!(
            "key {key:?} lies outside tenant {}'s namespace",
            self.tenant
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_common::Code;

    #[test]
    fn identities_and_declarations_make_callers() {
        let open = Caller::resolve(None, None).unwrap();
        assert_eq!(open, Caller::cluster());
        let a = Caller::resolve(None, Some("a")).unwrap();
        assert_eq!(a.tenant().name(), "a");
        assert!(a.owner_call().is_err());
        assert_eq!(Caller::resolve(Some(CLUSTER), Some("a")).unwrap(), a);
        assert_eq!(Caller::resolve(Some("a"), None).unwrap(), a);
        assert_eq!(Caller::resolve(Some("a"), Some("a")).unwrap(), a);
        let e = Caller::resolve(Some("a"), Some("b")).unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        let e = Caller::resolve(Some("a"), Some("default")).unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        assert_eq!(
            Caller::resolve(None, Some("bad name")).unwrap_err().code(),
            Code::InvalidParams
        );
    }

    #[test]
    fn keys_must_lie_in_the_callers_tenant() {
        let a = Caller::resolve(None, Some("a")).unwrap();
        let d = Caller::cluster();
        let ka = Tenant::parse("a").unwrap().scope("k").into_owned();
        assert_eq!(a.key(&ka).unwrap(), ka);
        assert_eq!(a.key("k").unwrap_err().code(), Code::PermissionDenied);
        assert_eq!(d.key(&ka).unwrap_err().code(), Code::PermissionDenied);
        assert_eq!(d.key("k").unwrap(), "k");
        assert_eq!(d.key("").unwrap_err().code(), Code::InvalidParams);
        // A tenant's empty key (its namespace's marks and nothing after) too; before, a raw
        // client's put of it was stored.
        let empty = Tenant::parse("a").unwrap().scope("").into_owned();
        assert_eq!(a.key(&empty).unwrap_err().code(), Code::InvalidParams);
    }
}
