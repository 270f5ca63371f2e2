//! Puts from and gets into device memory through host staging buffers. A batch is cut into
//! slices of about `SLICE_BYTES`, each staged in one buffer from the device (`staging`: pinned
//! for a GPU); a blocking thread does the device copies of one slice while the network transfer
//! of the slice before it is in flight (one slice staged ahead at most, so staging memory stays
//! at about three slices).

use std::{
    ops::Range,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::{DeviceError, DeviceMemory, Staging};
use crate::{client::Client, error::ClientError, put::PutOutcome, ReplicateConfig};

/// Bytes staged per slice of a batch.
pub(super) const SLICE_BYTES: usize = 16 << 20;

/// Bytes in device memory: `len` bytes at device address `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    pub ptr: usize,
    pub len: usize,
}

/// An object's value in device memory: its parts in order (one, or several such as a layer's K
/// and V), which together make the value.
pub type DeviceParts = Vec<DeviceRange>;

fn value_len(parts: &[DeviceRange]) -> usize {
    parts.iter().map(|r| r.len).sum()
}

/// Consecutive runs of keys of about `SLICE_BYTES` each (at least one key per run).
fn slices(values: &[DeviceParts]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, parts) in values.iter().enumerate() {
        let len = value_len(parts);
        if i > start && bytes + len > SLICE_BYTES {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += len;
    }
    if start < values.len() {
        out.push(start..values.len());
    }
    out
}

/// Where each key of the slice `keys` lies in the slice's staging buffer, and its total bytes.
fn layout(values: &[DeviceParts], keys: &Range<usize>) -> (Vec<Range<usize>>, usize) {
    let mut at = 0;
    let spans = keys
        .clone()
        .map(|i| {
            let span = at..at + value_len(&values[i]);
            at = span.end;
            span
        })
        .collect();
    (spans, at)
}

/// Copies a value's parts from the device into `dst` (their total length), in order.
fn gather(
    device: &dyn DeviceMemory,
    parts: &[DeviceRange],
    dst: &mut [u8],
) -> Result<(), DeviceError> {
    let mut at = 0;
    for r in parts {
        device.copy_to_host(r.ptr, &mut dst[at..at + r.len])?;
        at += r.len;
    }
    Ok(())
}

/// Copies `src` (a value read) to the device, filling the parts in order.
fn scatter(
    device: &dyn DeviceMemory,
    src: &[u8],
    parts: &[DeviceRange],
) -> Result<(), DeviceError> {
    let mut at = 0;
    for r in parts {
        let n = r.len.min(src.len() - at);
        if n == 0 {
            break;
        }
        device.copy_from_host(&src[at..at + n], r.ptr)?;
        at += n;
    }
    Ok(())
}

fn mismatch<T>(keys: usize, ranges: usize) -> Vec<Result<T, ClientError>> {
    let msg = format!("{keys} keys but {ranges} device ranges");
    (0..keys)
        .map(|_| Err(ClientError::Invalid(msg.clone())))
        .collect()
}

impl Client {
    /// Puts each key's value from device memory (its parts, joined in order): copied slice by
    /// slice into host staging buffers, each slice put as a batch while the next one is copied.
    pub async fn batch_put_from_device(
        &self,
        keys: &[&str],
        ranges: &[DeviceParts],
        device: Arc<dyn DeviceMemory>,
        config: &ReplicateConfig,
    ) -> Vec<Result<PutOutcome, ClientError>> {
        if keys.len() != ranges.len() {
            return mismatch(keys.len(), ranges.len());
        }
        let plan = slices(ranges);
        /// A slice staged: its keys, where each lies in the buffer, and each key's copy.
        type Staged = (
            Range<usize>,
            Vec<Range<usize>>,
            Staging,
            Vec<Result<(), DeviceError>>,
        );
        let (tx, mut rx) = mpsc::channel::<Result<Staged, DeviceError>>(1);
        let stager = {
            let (ranges, plan) = (ranges.to_vec(), plan.clone());
            tokio::task::spawn_blocking(move || {
                for s in plan {
                    let (spans, total) = layout(&ranges, &s);
                    let staged = device.staging(total).map(|mut buf| {
                        let copied = s
                            .clone()
                            .zip(&spans)
                            .map(|(i, span)| {
                                gather(&*device, &ranges[i], &mut buf.bytes_mut()[span.clone()])
                            })
                            .collect();
                        (s.clone(), spans, buf, copied)
                    });
                    let failed = staged.is_err();
                    if tx.blocking_send(staged).is_err() || failed {
                        return;
                    }
                }
            })
        };
        let mut results: Vec<Option<Result<PutOutcome, ClientError>>> =
            (0..keys.len()).map(|_| None).collect();
        while let Some(staged) = rx.recv().await {
            let (s, spans, buf, copied) = match staged {
                Ok(x) => x,
                Err(e) => {
                    for r in results.iter_mut().filter(|r| r.is_none()) {
                        *r = Some(Err(e.clone().into()));
                    }
                    break;
                }
            };
            let mut parts: Vec<(usize, [&[u8]; 1])> = Vec::with_capacity(spans.len());
            for ((i, span), c) in s.zip(spans).zip(copied) {
                match c {
                    Ok(()) => parts.push((i, [&buf.bytes()[span]])),
                    Err(e) => results[i] = Some(Err(e.into())),
                }
            }
            let items: Vec<(&str, &[&[u8]])> =
                parts.iter().map(|(i, p)| (keys[*i], &p[..])).collect();
            let res = self.batch_put_parts(&items, config).await;
            for ((i, _), r) in parts.iter().zip(res) {
                results[*i] = Some(r);
            }
        }
        finish(results, stager.await)
    }

    /// Reads each key into device memory (filling its parts in order): slice by slice into
    /// host staging buffers, each slice copied to the device while the next one is read.
    /// Answers the bytes read per key.
    pub async fn batch_get_into_device(
        &self,
        keys: &[&str],
        ranges: &[DeviceParts],
        device: Arc<dyn DeviceMemory>,
    ) -> Vec<Result<usize, ClientError>> {
        if keys.len() != ranges.len() {
            return mismatch(keys.len(), ranges.len());
        }
        /// A slice read: its keys, where each lies in the buffer, and what each read got.
        type Read = (
            Range<usize>,
            Vec<Range<usize>>,
            Staging,
            Vec<Result<usize, ClientError>>,
        );
        let (tx, mut rx) = mpsc::channel::<Read>(1);
        let stop = StopScatter::default();
        let unstager = {
            let (ranges, device, stop) = (ranges.to_vec(), device.clone(), stop.0.clone());
            tokio::task::spawn_blocking(move || {
                let mut out: Vec<(usize, Result<usize, ClientError>)> = Vec::new();
                while let Some((s, spans, buf, read)) = rx.blocking_recv() {
                    for ((i, span), r) in s.zip(spans).zip(read) {
                        let _scattering = stop.scattering.lock();
                        if stop.dropped.load(Ordering::Acquire) {
                            return out;
                        }
                        let r = r.and_then(|n| {
                            let read = &buf.bytes()[span.start..span.start + n];
                            scatter(&*device, read, &ranges[i])?;
                            Ok(n)
                        });
                        out.push((i, r));
                    }
                }
                out
            })
        };
        let mut failed = Vec::new();
        for s in slices(ranges) {
            let (spans, total) = layout(ranges, &s);
            let staging = {
                let device = device.clone();
                tokio::task::spawn_blocking(move || device.staging(total)).await
            };
            let mut buf = match staging {
                Ok(Ok(buf)) => buf,
                Ok(Err(e)) => {
                    failed.extend(s.map(|i| (i, ClientError::from(e.clone()))));
                    continue;
                }
                Err(e) => {
                    let e = ClientError::Invalid(format!("device staging stopped: {e}"));
                    failed.extend(s.map(|i| (i, e.for_each_key())));
                    continue;
                }
            };
            let got = {
                let mut dst: Vec<&mut [u8]> = Vec::with_capacity(spans.len());
                let mut rest = buf.bytes_mut();
                for span in &spans {
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(span.len());
                    dst.push(head);
                    rest = tail;
                }
                self.batch_get(&keys[s.clone()], &mut dst).await
            };
            if tx.send((s, spans, buf, got)).await.is_err() {
                break;
            }
        }
        drop(tx);
        let mut results: Vec<Option<Result<usize, ClientError>>> =
            (0..keys.len()).map(|_| None).collect();
        let copied = unstager.await;
        if let Ok(copied) = &copied {
            for (i, r) in copied.iter() {
                results[*i] = Some(r.as_ref().map(|n| *n).map_err(ClientError::for_each_key));
            }
        }
        for (i, e) in failed {
            results[i] = Some(Err(e));
        }
        finish(results, copied.map(|_| ()))
    }
}

/// Stops a device get's copies to the device when the get is dropped (its caller's timeout, a
/// `select!`): no copy starts after, and the drop waits for the one under way, since the caller
/// may free or reuse that device memory as soon as the drop returns.
#[derive(Default)]
struct StopScatter(Arc<Scattering>);

#[derive(Default)]
struct Scattering {
    dropped: AtomicBool,
    /// Held by the staging thread across each copy to the device.
    scattering: Mutex<()>,
}

impl Drop for StopScatter {
    fn drop(&mut self) {
        self.0.dropped.store(true, Ordering::Release);
        drop(self.0.scattering.lock());
    }
}

/// Every key's result; keys the staging thread never reached (it panicked) fail.
fn finish<T, E: std::fmt::Display>(
    results: Vec<Option<Result<T, ClientError>>>,
    staging: Result<(), E>,
) -> Vec<Result<T, ClientError>> {
    let why = staging.err().map(|e| e.to_string());
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(ClientError::Invalid(format!(
                    "device staging stopped early{}",
                    why.as_deref().map(|w| format!(": {w}")).unwrap_or_default()
                )))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_cut_into_slices_of_bounded_bytes() {
        let r = |len| vec![DeviceRange { ptr: 0, len }];
        assert_eq!(slices(&[]), Vec::<Range<usize>>::new());
        assert_eq!(
            slices(&[r(SLICE_BYTES * 3)]),
            vec![0..1],
            "one key larger than a slice"
        );
        let ranges = vec![r(SLICE_BYTES / 2); 5];
        assert_eq!(slices(&ranges), vec![0..2, 2..4, 4..5]);
        assert_eq!(
            slices(&[r(1), r(SLICE_BYTES), r(1)]),
            vec![0..1, 1..2, 2..3]
        );
        // A value's parts count together.
        let kv = vec![
            DeviceRange {
                ptr: 0,
                len: SLICE_BYTES / 2
            };
            2
        ];
        assert_eq!(slices(&[kv.clone(), kv]), vec![0..1, 1..2]);
    }
}
