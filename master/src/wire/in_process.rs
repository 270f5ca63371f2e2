//! The in-process `MasterApi`: a client in the master's own process (tests, benches, tools)
//! calls the service directly, with no socket and no encoding. Answers are the same domain
//! values the wire adapters produce, so it passes the same conformance suite.

use std::sync::Arc;

use mooncake_common::{
    master_api::{
        Call, Existence, Found, Grant, Grants, Lookup, MasterApi, Releases, SegmentUsage,
    },
    ApiError, Code, ReplicaTaskSpec, ReplicaTaskState, ReplicateConfig, SegmentName,
};

use crate::{
    core::TaskRequest,
    error::MasterError,
    service::{Caller, MasterService},
};

/// A `MasterApi` on the master's service in this process, calling as `.1`.
#[derive(Clone)]
pub struct InProcessMaster(pub Arc<MasterService>, pub Caller);

fn codes(results: Vec<Result<(), MasterError>>) -> Vec<Result<(), Code>> {
    results
        .into_iter()
        .map(|r| r.map_err(|e| e.code()))
        .collect()
}

impl MasterApi for InProcessMaster {
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
        token: u64,
    ) -> Call<'a, Grants> {
        Box::pin(async move {
            let results = self.0.put_start(&self.1, items, config, token).await;
            let mut grants = Grants::with_capacity(results.len());
            for r in results {
                match r {
                    Ok(g) => grants.push_ok(g.replicas, |replicas| Grant {
                        put_id: g.put_id,
                        replicas,
                    }),
                    Err(e) => grants.push_err(ApiError::new(e.code(), e.to_string())),
                }
            }
            Ok(grants)
        })
    }

    fn abandon_put_start(&self, token: u64) -> Call<'_, u32> {
        Box::pin(async move { Ok(self.0.abandon_put_start(&self.1, token)) })
    }

    fn put_end<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move { Ok(codes(self.0.put_end(&self.1, puts))) })
    }

    fn put_revoke<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move { Ok(codes(self.0.put_revoke(&self.1, puts))) })
    }

    fn get_replicas<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Lookup> {
        Box::pin(async move {
            let mut objects = mooncake_common::master_api::Runs::with_capacity(keys.len());
            let leased = self
                .0
                .get_replicas(&self.1, keys, release, |found| match found {
                    Ok((size, replicas)) => {
                        objects.push_ok(replicas, |replicas| Found { size, replicas })
                    }
                    Err(e) => objects.push_err(e.code()),
                });
            Ok(Lookup {
                objects,
                lease_ttl: leased.ttl,
                epoch: leased.epoch,
            })
        })
    }

    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence> {
        Box::pin(async move {
            let (results, leased) = self.0.exists(&self.1, keys, release);
            let found = results
                .into_iter()
                .map(|r| r.map_err(|e| e.code()))
                .collect();
            Ok(Existence {
                found,
                lease_ttl: leased.ttl,
                epoch: leased.epoch,
            })
        })
    }

    fn remove<'a>(&'a self, keys: &'a [&'a str], force: bool) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move { Ok(codes(self.0.remove(&self.1, keys, force))) })
    }

    fn remove_all<'a>(&'a self, force: bool, key_regex: Option<&'a str>) -> Call<'a, u64> {
        Box::pin(async move {
            self.0
                .remove_all(&self.1, force, key_regex)
                .await
                .map_err(|e| ApiError::new(e.code(), e.to_string()))
        })
    }

    fn create_replica_task<'a>(&'a self, key: &'a str, spec: ReplicaTaskSpec<'a>) -> Call<'a, u64> {
        Box::pin(async move {
            let names = |names: &[&str]| {
                names
                    .iter()
                    .map(|n| SegmentName::parse(n))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ApiError::new(Code::InvalidParams, e.to_string()))
            };
            let res = match spec {
                ReplicaTaskSpec::Copy { targets } => {
                    let targets = names(targets)?;
                    self.0.create_replica_task(
                        &self.1,
                        key,
                        TaskRequest::Copy { targets: &targets },
                    )
                }
                ReplicaTaskSpec::Move { source, target } => {
                    let (source, target) = (names(&[source])?, names(&[target])?);
                    self.0.create_replica_task(
                        &self.1,
                        key,
                        TaskRequest::Move {
                            source: &source[0],
                            target: &target[0],
                        },
                    )
                }
            };
            res.map_err(|e| ApiError::new(e.code(), e.to_string()))
        })
    }

    fn query_task(&self, id: u64) -> Call<'_, ReplicaTaskState> {
        Box::pin(async move {
            let (info, created_at_ms, updated_at_ms) = self
                .0
                .query_task(&self.1, id)
                .ok_or_else(|| ApiError::new(Code::ObjectNotFound, format!("no task {id}")))?;
            Ok(ReplicaTaskState {
                id: info.id,
                kind: info.kind,
                status: info.status,
                created_at_ms,
                updated_at_ms,
                assigned: info.assigned.iter().map(|s| s.to_string()).collect(),
                detail: info.detail,
            })
        })
    }

    fn replica_clear<'a>(
        &'a self,
        keys: &'a [&'a str],
        segment: Option<&'a str>,
    ) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move {
            let segment = segment
                .map(SegmentName::parse)
                .transpose()
                .map_err(|e| ApiError::new(Code::InvalidParams, e.to_string()))?;
            Ok(codes(self.0.replica_clear(&self.1, keys, segment.as_ref())))
        })
    }

    fn release_leases<'a>(&'a self, release: Releases<'a>) -> Call<'a, ()> {
        Box::pin(async move {
            self.0.release_leases(&self.1, release);
            Ok(())
        })
    }

    fn list_segments(&self) -> Call<'_, Vec<SegmentUsage>> {
        Box::pin(async move {
            Ok(self
                .0
                .list_segments()
                .into_iter()
                .map(|s| SegmentUsage {
                    name: s.name,
                    capacity: s.capacity,
                    allocated: s.allocated,
                })
                .collect())
        })
    }
}
