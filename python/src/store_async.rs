//! The `async_*` forms of the data calls, native: each returns an asyncio awaitable whose work
//! runs as a task of the store's I/O runtime (see `aio`), with the same arguments, results and
//! codes as the blocking call of the same name. Registered memory stays pinned (unregister waits)
//! until the call is over; bytes objects given to a put stay referenced until it is over.

use std::{future::Future, sync::Arc};

use pyo3::{
    prelude::*,
    pybacked::PyBackedStr,
    types::{PyBytes, PyType},
    IntoPyObjectExt,
};

use crate::{
    aio,
    buffer::{FreshByteArray, PyBytesView, SendableViews},
    config::ReplicateConfig,
    registry::OwnedPin,
    session::Session,
    store::{
        buffer_results, exists_codes, get_code, log_miss, log_unregistered, multi_ranges, put_code,
        remove_codes, replicate, single_ranges, NativeStore, OnDevice, Ranges, INVALID,
    },
};

/// The first code alone (`single`: a call on one key), or the list.
fn one_or_all<'py, T>(py: Python<'py>, codes: Vec<T>, single: bool) -> PyResult<Bound<'py, PyAny>>
where
    T: Copy + IntoPyObjectExt<'py>,
{
    if single {
        codes[0].into_bound_py_any(py)
    } else {
        codes.into_bound_py_any(py)
    }
}

/// A Python value from a call's output.
fn value<'py, T: IntoPyObjectExt<'py>>(py: Python<'py>, v: T) -> PyResult<Bound<'py, PyAny>> {
    v.into_bound_py_any(py)
}

impl NativeStore {
    /// Spawns `work(session)` and returns an awaitable of `finish(its output)`; one that is ready
    /// with `missing` when the store is not set up.
    fn spawn<T, W, Fut, F>(
        &self,
        py: Python<'_>,
        missing: T,
        work: W,
        finish: F,
    ) -> PyResult<Py<PyAny>>
    where
        T: Send + 'static,
        W: FnOnce(Arc<Session>) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        F: for<'py> FnOnce(Python<'py>, T) -> PyResult<Bound<'py, PyAny>> + Send + 'static,
    {
        let Some(session) = self.session() else {
            tracing::error!("the store is not set up: call setup() first");
            return aio::ready(py, finish(py, missing)?);
        };
        let rt = session.rt.handle().clone();
        aio::spawn(py, &rt, work(session), finish)
    }
}

/// The keys whose ranges are all registered host memory (under `pin`), and those whose one
/// range is registered device memory; the others are logged and answer INVALID_PARAMS.
fn checked(
    pin: &OwnedPin,
    op: &str,
    ranges: &[(usize, usize)],
    counts: &[usize],
    writable: bool,
) -> (Vec<usize>, OnDevice) {
    let mut ok = Vec::with_capacity(counts.len());
    let mut on_device = if writable {
        OnDevice::writing()
    } else {
        OnDevice::default()
    };
    // Whether each range is registered host memory (for a read: and apart from the others).
    let host: Vec<bool> = if writable {
        pin.slices_mut(ranges).iter().map(Option::is_some).collect()
    } else {
        ranges
            .iter()
            .map(|&(p, len)| pin.slice(p, len).is_some())
            .collect()
    };
    let mut at = 0;
    for (i, &n) in counts.iter().enumerate() {
        let mine = &ranges[at..at + n];
        if on_device.take(pin, i, mine) {
            // Staged through the device's copies.
        } else if host[at..at + n].iter().all(|&h| h) {
            ok.push(i);
        } else {
            log_unregistered(
                op,
                mine.first().map_or(0, |r| r.0),
                mine.iter().map(|r| r.1).sum(),
            );
        }
        at += n;
    }
    (ok, on_device)
}

impl NativeStore {
    fn async_put_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        (ranges, counts): Ranges,
        config: Option<PyRef<'_, ReplicateConfig>>,
        single: bool,
    ) -> PyResult<Py<PyAny>> {
        let n = keys.len();
        let cfg = replicate(config);
        // Pinned in the call's task: a wait for the pin never holds the event loop.
        let pin = self.registry.pin_later();
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |at, &c| {
                let s = *at;
                *at += c;
                Some(s)
            })
            .collect();
        self.spawn(
            py,
            vec![INVALID; n],
            move |s| async move {
                let mut out = vec![INVALID; n];
                let Some(cfg) = cfg else { return out };
                let pin = pin.get().await;
                let (ok, on_device) = checked(&pin, "batch_put_from", &ranges, &counts, false);
                let parts: Vec<Vec<&[u8]>> = ok
                    .iter()
                    .map(|&i| {
                        ranges[starts[i]..starts[i] + counts[i]]
                            .iter()
                            .map(|&(p, len)| pin.slice(p, len).expect("checked under this pin"))
                            .collect()
                    })
                    .collect();
                let items: Vec<(&str, &[&[u8]])> = ok
                    .iter()
                    .zip(&parts)
                    .map(|(&i, p)| (&*keys[i], &p[..]))
                    .collect();
                let host = s.client.batch_put_parts(&items, &cfg);
                let device = on_device.put(&s.client, &keys, &cfg);
                let (res, device) = tokio::join!(host, device);
                for (&i, r) in ok.iter().zip(&res) {
                    out[i] = put_code(r);
                }
                for (i, c) in device {
                    out[i] = c;
                }
                out
            },
            move |py, v| one_or_all(py, v, single),
        )
    }

    fn async_get_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        (ranges, counts): Ranges,
        single: bool,
    ) -> PyResult<Py<PyAny>> {
        let n = keys.len();
        // Pinned in the call's task: a wait for the pin never holds the event loop.
        let pin = self.registry.pin_later();
        self.spawn(
            py,
            vec![INVALID as i64; n],
            move |s| async move {
                let mut out = vec![INVALID as i64; n];
                let pin = pin.get().await;
                let (ok, on_device) = checked(&pin, "batch_get_into", &ranges, &counts, true);
                let mut slices = pin.slices_mut(&ranges).into_iter();
                let mut bufs: Vec<Vec<&mut [u8]>> = Vec::with_capacity(ok.len());
                let mut next = ok.iter().peekable();
                for (i, &c) in counts.iter().enumerate() {
                    let mine: Vec<Option<&mut [u8]>> = slices.by_ref().take(c).collect();
                    if next.peek() == Some(&&i) {
                        next.next();
                        bufs.push(
                            mine.into_iter()
                                .map(|b| b.expect("checked under this pin"))
                                .collect(),
                        );
                    }
                }
                let refs: Vec<&str> = ok.iter().map(|&i| &*keys[i]).collect();
                let host = s.client.batch_get_parts(&refs, &mut bufs);
                let device = on_device.get(&s.client, &keys);
                let (res, device) = tokio::join!(host, device);
                for ((&i, r), k) in ok.iter().zip(&res).zip(&refs) {
                    if let Err(e) = r {
                        log_miss("get", k, e);
                    }
                    out[i] = get_code(r);
                }
                for (i, c) in device {
                    out[i] = c;
                }
                out
            },
            move |py, v| one_or_all(py, v, single),
        )
    }
}

#[pymethods]
impl NativeStore {
    #[pyo3(signature = (key, value, config=None))]
    fn async_put(
        &self,
        py: Python<'_>,
        key: String,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<Py<PyAny>> {
        let list = pyo3::types::PyList::new(py, [value])?;
        self.async_put_batch(py, vec![key], list.as_any(), config)
    }

    /// 0 if every value was stored (or already there), else the first failure's code.
    #[pyo3(signature = (keys, values, config=None))]
    fn async_put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<Py<PyAny>> {
        let values: Vec<Bound<'_, PyAny>> = values.try_iter()?.collect::<PyResult<_>>()?;
        let views = if values.len() == keys.len() {
            values
                .iter()
                .map(|v| PyBytesView::readable(v).map(PyBytesView::into_sendable))
                .collect::<PyResult<Vec<_>>>()?
        } else {
            tracing::error!("put_batch: {} keys but {} values", keys.len(), values.len());
            Vec::new()
        };
        let views = SendableViews(views);
        let cfg = replicate(config);
        self.spawn(
            py,
            INVALID,
            move |s| async move {
                let Some(cfg) = cfg.filter(|_| views.0.len() == keys.len()) else {
                    return INVALID;
                };
                let parts: Vec<[&[u8]; 1]> = views.0.iter().map(|v| [v.as_slice()]).collect();
                let items: Vec<(&str, &[&[u8]])> = keys
                    .iter()
                    .map(|k| k.as_str())
                    .zip(parts.iter().map(|p| &p[..]))
                    .collect();
                let res = s.client.batch_put_parts(&items, &cfg).await;
                res.iter().map(put_code).find(|c| *c != 0).unwrap_or(0)
            },
            |py, v| v.into_bound_py_any(py),
        )
    }

    /// The object's bytes, or b"" on a miss or an error.
    fn async_get(&self, py: Python<'_>, key: String) -> PyResult<Py<PyAny>> {
        self.spawn(
            py,
            None,
            move |s| async move { s.client.batch_get_owned(&[&key]).await.pop() },
            |py, got| {
                let bytes = match got {
                    Some(Ok(v)) => v,
                    Some(Err(_)) | None => Vec::new(),
                };
                Ok(PyBytes::new(py, &bytes).into_any())
            },
        )
    }

    fn async_get_batch(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Py<PyAny>> {
        let n = keys.len();
        self.spawn(
            py,
            Vec::new(),
            move |s| async move {
                let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
                s.client.batch_get_owned(&refs).await
            },
            move |py, got| {
                let list: Vec<Bound<'_, PyBytes>> = if got.is_empty() {
                    (0..n).map(|_| PyBytes::new(py, b"")).collect()
                } else {
                    got.iter()
                        .map(|r| PyBytes::new(py, r.as_deref().unwrap_or(b"")))
                        .collect()
                };
                value(py, list)
            },
        )
    }

    /// `BufferHandle`s (instances of `cls`) read straight into, or None per miss.
    fn _async_get_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        cls: Bound<'_, PyType>,
    ) -> PyResult<Py<PyAny>> {
        let cls = cls.unbind();
        let missing: Vec<Option<Py<PyAny>>> = keys.iter().map(|_| None).collect();
        self.spawn(
            py,
            missing,
            move |s| async move {
                let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
                let got = s
                    .client
                    .batch_get_alloc(&refs, FreshByteArray::maker(&cls))
                    .await;
                buffer_results(got, &refs)
                    .into_iter()
                    .map(|b| b.map(Py::into_any))
                    .collect()
            },
            |py, got| got.into_bound_py_any(py),
        )
    }

    #[pyo3(signature = (key, buffer_ptr, size, config=None))]
    fn async_put_from(
        &self,
        py: Python<'_>,
        key: PyBackedStr,
        buffer_ptr: usize,
        size: usize,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<Py<PyAny>> {
        let ranges = (vec![(buffer_ptr, size)], vec![1]);
        self.async_put_ranges(py, vec![key], ranges, config, true)
    }

    fn async_get_into(
        &self,
        py: Python<'_>,
        key: PyBackedStr,
        buffer_ptr: usize,
        size: usize,
    ) -> PyResult<Py<PyAny>> {
        self.async_get_ranges(py, vec![key], (vec![(buffer_ptr, size)], vec![1]), true)
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes, config=None))]
    fn async_batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<Py<PyAny>> {
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some(r) => self.async_put_ranges(py, keys, r, config, false),
            None => aio::ready(py, value(py, vec![INVALID; keys.len()])?),
        }
    }

    fn async_batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Py<PyAny>> {
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some(r) => self.async_get_ranges(py, keys, r, false),
            None => aio::ready(py, value(py, vec![INVALID as i64; keys.len()])?),
        }
    }

    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config=None))]
    fn async_batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<Py<PyAny>> {
        match multi_ranges(keys.len(), &all_buffer_ptrs, &all_sizes) {
            Some(r) => self.async_put_ranges(py, keys, r, config, false),
            None => aio::ready(py, value(py, vec![INVALID; keys.len()])?),
        }
    }

    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node=false))]
    fn async_batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        prefer_alloc_in_same_node: bool,
    ) -> PyResult<Py<PyAny>> {
        let _ = prefer_alloc_in_same_node;
        match multi_ranges(keys.len(), &all_buffer_ptrs, &all_sizes) {
            Some(r) => self.async_get_ranges(py, keys, r, false),
            None => aio::ready(py, value(py, vec![INVALID as i64; keys.len()])?),
        }
    }

    /// For tests: an async call whose work panics (its awaitable must still resolve).
    fn _async_call_that_panics(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.spawn(
            py,
            INVALID,
            |_| async { panic!("on purpose, for a test") },
            |py, v: i32| v.into_bound_py_any(py),
        )
    }

    fn async_is_exist(&self, py: Python<'_>, key: String) -> PyResult<Py<PyAny>> {
        self.async_exists(py, vec![key], true)
    }

    fn async_batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Py<PyAny>> {
        self.async_exists(py, keys, false)
    }

    #[pyo3(signature = (key, force=false))]
    fn async_remove(&self, py: Python<'_>, key: String, force: bool) -> PyResult<Py<PyAny>> {
        self.spawn(
            py,
            INVALID,
            move |s| async move {
                match s.client.remove(&key, force).await {
                    Ok(()) => 0,
                    Err(e) => e.code().as_i32(),
                }
            },
            |py, v| v.into_bound_py_any(py),
        )
    }

    #[pyo3(signature = (keys, force=false))]
    fn async_batch_remove(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        force: bool,
    ) -> PyResult<Py<PyAny>> {
        let n = keys.len();
        self.spawn(
            py,
            vec![INVALID; n],
            move |s| async move {
                let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
                remove_codes(s.client.batch_remove(&refs, force).await, n)
            },
            |py, v| v.into_bound_py_any(py),
        )
    }
}

impl NativeStore {
    /// 1 / 0 / negative per key; `single` answers the first alone.
    fn async_exists(&self, py: Python<'_>, keys: Vec<String>, single: bool) -> PyResult<Py<PyAny>> {
        let n = keys.len();
        self.spawn(
            py,
            vec![INVALID; n],
            move |s| async move {
                let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
                exists_codes(s.client.batch_exists(&refs).await, n)
            },
            move |py, codes| {
                if single {
                    value(py, codes.first().copied().unwrap_or(INVALID))
                } else {
                    value(py, codes)
                }
            },
        )
    }
}
