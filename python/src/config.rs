//! `ReplicateConfig` as Python sees it (Mooncake's field names), and the arguments of `setup` in
//! both of Mooncake's forms: seven positional arguments, or one dict.

use mooncake_client::{ReplicateConfig as ClientReplicateConfig, SegmentName};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    prelude::*,
    types::{PyDict, PyTuple},
};

/// Mooncake's fields. `prefer_alloc_in_same_node` is what this client does anyway (the node's
/// own segment first); `data_type` is a hint it stores nothing for, and so are replica groups
/// (`group_ids`, a placement hint: ignored, with a warning once); NVMe-oF replicas
/// (`nof_replica_num`, `preferred_nof_segments`) do not exist here, and a put that asks for
/// them answers INVALID_PARAMS.
#[pyclass(module = "mooncake_rs._native", get_all, set_all)]
#[derive(Clone, Debug, Default)]
pub struct ReplicateConfig {
    pub replica_num: usize,
    pub preferred_segment: String,
    pub preferred_segments: Vec<String>,
    pub with_soft_pin: bool,
    pub with_hard_pin: bool,
    pub prefer_alloc_in_same_node: bool,
    pub nof_replica_num: usize,
    pub preferred_nof_segments: Vec<String>,
    /// An `ObjectDataType` value.
    pub data_type: u8,
    pub group_ids: Option<Vec<String>>,
}

#[pymethods]
impl ReplicateConfig {
    #[new]
    #[pyo3(signature = (replica_num=1, preferred_segment=String::new(), preferred_segments=Vec::new(), with_soft_pin=false, with_hard_pin=false, prefer_alloc_in_same_node=false, nof_replica_num=0, preferred_nof_segments=Vec::new(), data_type=0, group_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        replica_num: usize,
        preferred_segment: String,
        preferred_segments: Vec<String>,
        with_soft_pin: bool,
        with_hard_pin: bool,
        prefer_alloc_in_same_node: bool,
        nof_replica_num: usize,
        preferred_nof_segments: Vec<String>,
        data_type: u8,
        group_ids: Option<Vec<String>>,
    ) -> Self {
        ReplicateConfig {
            replica_num,
            preferred_segment,
            preferred_segments,
            with_soft_pin,
            with_hard_pin,
            prefer_alloc_in_same_node,
            nof_replica_num,
            preferred_nof_segments,
            data_type,
            group_ids,
        }
    }

    fn __repr__(&self) -> String {
        let b = |v: bool| if v { "True" } else { "False" };
        format!(
            "ReplicateConfig(replica_num={}, preferred_segment={:?}, preferred_segments={:?}, with_soft_pin={}, with_hard_pin={}, prefer_alloc_in_same_node={}, nof_replica_num={}, preferred_nof_segments={:?}, data_type={}, group_ids={:?})",
            self.replica_num,
            self.preferred_segment,
            self.preferred_segments,
            b(self.with_soft_pin),
            b(self.with_hard_pin),
            b(self.prefer_alloc_in_same_node),
            self.nof_replica_num,
            self.preferred_nof_segments,
            self.data_type,
            self.group_ids,
        )
    }

    fn __str__(&self) -> String {
        self.__repr__()
    }
}

impl ReplicateConfig {
    /// The client's form: `preferred_segment` goes first, then `preferred_segments`. A name that
    /// is not a segment ("host:port"; a bare host, say) can be no segment, so placement falls
    /// back as for one that is absent (logged once per name). An error names what this store
    /// does not offer, or too many replicas.
    pub fn to_client(&self) -> Result<ClientReplicateConfig, String> {
        if self.nof_replica_num > 0 || !self.preferred_nof_segments.is_empty() {
            return Err(
                "NVMe-oF replicas (nof_replica_num, preferred_nof_segments) are not \
                        supported by this store; leave them at 0 and []"
                    .into(),
            );
        }
        if self.group_ids.as_ref().is_some_and(|g| !g.is_empty()) {
            // A placement hint in Mooncake (a group's keys on one node): placement here ignores
            // it, and the put goes on (SGLang sets it on every put when it finds the field).
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!("ReplicateConfig.group_ids is a placement hint this store ignores: keys are placed as without it");
            });
        }
        if self.data_type > 9 {
            return Err(format!(
                "data_type {} is not an ObjectDataType (0..=9)",
                self.data_type
            ));
        }
        let preferred_segments = std::iter::once(&self.preferred_segment)
            .chain(&self.preferred_segments)
            .filter(|s| !s.is_empty())
            .filter_map(|s| match SegmentName::parse(s) {
                Ok(name) => Some(name),
                Err(e) => {
                    not_a_segment(s, &e);
                    None
                }
            })
            .collect();
        Ok(ClientReplicateConfig {
            replica_num: ClientReplicateConfig::replica_count(self.replica_num as u64)?,
            preferred_segments,
            soft_pin: self.with_soft_pin,
            hard_pin: self.with_hard_pin,
            upsert: false,
        })
    }
}

/// What `setup` was given. `metadata_server`, `local_buffer_size` and `rdma_devices` are accepted
/// for compatibility; this design needs no metadata service and no staging buffer.
#[derive(Debug, Clone)]
pub struct SetupArgs {
    pub local_hostname: String,
    pub global_segment_size: u64,
    pub protocol: String,
    pub master_server_addr: String,
    /// The tenant whose namespace the keys live in; "default" or unset leaves the client's
    /// config (`MOONCAKE_TENANT_ID`, or the tenant of a tenant's token) to decide.
    pub tenant_id: Option<String>,
}

const NAMES: [&str; 7] = [
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
];

/// Mooncake's defaults for `setup()`'s arguments left out.
const DEFAULT_SEGMENT_SIZE: u64 = 16 << 20;
const DEFAULT_MASTER: &str = "127.0.0.1:50051";

/// The keyword naming the client's tenant (see `mooncake_common::tenant`).
const TENANT_ID: &str = "tenant_id";

/// Mooncake keyword arguments after the seven that are accepted and have no effect here.
const IGNORED: [&str; 5] = [
    "engine",
    "enable_ssd_offload",
    "ssd_offload_path",
    "enable_client_http_server",
    "client_http_port",
];

impl SetupArgs {
    pub fn parse(args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        if args.len() == 1 && kwargs.is_none() {
            if let Ok(d) = args.get_item(0)?.cast_into::<PyDict>() {
                return Self::from_dict(&d);
            }
        }
        let mut values: Vec<Option<Bound<'_, PyAny>>> = vec![None; NAMES.len()];
        let mut tenant_id = None;
        if args.len() > NAMES.len() + IGNORED.len() + 1 {
            return Err(PyTypeError::new_err(format!(
                "setup() takes at most {} positional arguments ({} given)",
                NAMES.len() + IGNORED.len() + 1,
                args.len()
            )));
        }
        for (i, a) in args.iter().enumerate().take(NAMES.len()) {
            values[i] = Some(a);
        }
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                let name: String = k.extract()?;
                match NAMES.iter().position(|n| *n == name) {
                    Some(i) if values[i].is_some() => {
                        return Err(PyTypeError::new_err(format!(
                            "setup() got multiple values for argument '{name}'"
                        )))
                    }
                    Some(i) => values[i] = Some(v),
                    None if name == TENANT_ID => tenant_id = Some(v.str()?.extract()?),
                    None if name == "enable_ssd_offload" && v.is_truthy()? => {
                        // A caller that asks for SSD offload believes it is on: say where it is.
                        tracing::warn!("setup(enable_ssd_offload=True) has no effect here: the SSD tier is the owner's (mooncake_ownerd --ssd-path DIR --ssd-size SIZE), and this client's segment offloads nothing");
                    }
                    None if IGNORED.contains(&name.as_str()) => {}
                    None => {
                        return Err(PyTypeError::new_err(format!(
                            "setup() got an unexpected keyword argument '{name}'"
                        )))
                    }
                }
            }
        }
        let get = |i: usize| -> PyResult<Bound<'_, PyAny>> {
            values[i].clone().ok_or_else(|| {
                PyTypeError::new_err(format!("setup() missing required argument '{}'", NAMES[i]))
            })
        };
        // The last five have Mooncake's defaults (16 MiB, 16 MiB, "tcp", "", its default master).
        let global_segment_size = match &values[2] {
            Some(v) => int_arg(v, NAMES[2])?,
            None => DEFAULT_SEGMENT_SIZE,
        };
        let protocol = match &values[4] {
            Some(v) => v.extract()?,
            None => "tcp".to_string(),
        };
        let master_server_addr = match &values[6] {
            Some(v) => v.extract()?,
            None => DEFAULT_MASTER.to_string(),
        };
        Ok(SetupArgs {
            local_hostname: get(0)?.extract()?,
            global_segment_size,
            protocol,
            master_server_addr,
            tenant_id,
        })
    }

    /// Mooncake's dict form; values may be strings (its config dicts are string maps) or ints.
    fn from_dict(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        for (k, _) in d.iter() {
            let name: String = k.extract()?;
            let known = NAMES.contains(&name.as_str())
                || IGNORED.contains(&name.as_str())
                || name == TENANT_ID
                || name == "ipc_socket_path";
            if !known {
                return Err(PyValueError::new_err(format!(
                    "setup(): unknown config key '{name}'"
                )));
            }
        }
        let text = |name: &str, default: Option<&str>| -> PyResult<String> {
            match d.get_item(name)? {
                Some(v) => v.str()?.extract(),
                None => default.map(str::to_string).ok_or_else(|| {
                    PyValueError::new_err(format!("setup(): config key '{name}' is required"))
                }),
            }
        };
        let size = |name: &str, default: u64| -> PyResult<u64> {
            match d.get_item(name)? {
                Some(v) => int_arg(&v, name),
                None => Ok(default),
            }
        };
        Ok(SetupArgs {
            local_hostname: text("local_hostname", None)?,
            global_segment_size: size("global_segment_size", 16 << 20)?,
            protocol: text("protocol", Some("tcp"))?,
            master_server_addr: text("master_server_addr", Some("127.0.0.1:50051"))?,
            tenant_id: d
                .get_item(TENANT_ID)?
                .map(|v| v.str()?.extract())
                .transpose()?,
        })
    }
}

/// An int, or a string holding one (decimal, or a size such as "4GiB").
fn int_arg(v: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if let Ok(n) = v.extract::<u64>() {
        return Ok(n);
    }
    let s: String = v.extract().map_err(|_| {
        PyTypeError::new_err(format!("setup(): '{name}' must be a non-negative int"))
    })?;
    mooncake_common::ByteSize::parse(&s)
        .map(|b| b.bytes())
        .map_err(|e| PyValueError::new_err(format!("setup(): '{name}': {e}")))
}

/// Logs, once per name, a preferred segment that is not a segment name.
fn not_a_segment(name: &str, e: &impl std::fmt::Display) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.len() < 64 && !seen.iter().any(|s| s == name) {
        seen.push(name.to_string());
        tracing::warn!(preferred_segment = name, error = %e, "not a segment name (host:port); placing as if it were absent");
    }
}
