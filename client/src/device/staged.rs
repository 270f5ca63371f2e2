//! Puts from and gets into device memory through host staging buffers. A batch is cut into
//! slices of about `SLICE_BYTES`; a blocking thread does the device copies of one slice while
//! the network transfer of the slice before it is in flight (one slice staged ahead at most, so
//! staging memory stays at about two slices).

use std::{ops::Range, sync::Arc};

use tokio::sync::mpsc;

use super::{DeviceError, DeviceMemory};
use crate::{client::Client, error::ClientError, put::PutOutcome, ReplicateConfig};

/// Bytes staged per slice of a batch.
const SLICE_BYTES: usize = 16 << 20;

/// An object's bytes in device memory: `len` bytes at device address `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    pub ptr: usize,
    pub len: usize,
}

/// Consecutive runs of keys of about `SLICE_BYTES` each (at least one key per run).
fn slices(ranges: &[DeviceRange]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, r) in ranges.iter().enumerate() {
        if i > start && bytes + r.len > SLICE_BYTES {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += r.len;
    }
    if start < ranges.len() {
        out.push(start..ranges.len());
    }
    out
}

fn mismatch<T>(keys: usize, ranges: usize) -> Vec<Result<T, ClientError>> {
    let msg = format!("{keys} keys but {ranges} device ranges");
    (0..keys)
        .map(|_| Err(ClientError::Invalid(msg.clone())))
        .collect()
}

impl Client {
    /// Puts each key's value from device memory: copied slice by slice into host staging
    /// buffers, each slice put as a batch while the next one is copied.
    pub async fn batch_put_from_device(
        &self,
        keys: &[&str],
        ranges: &[DeviceRange],
        device: Arc<dyn DeviceMemory>,
        config: &ReplicateConfig,
    ) -> Vec<Result<PutOutcome, ClientError>> {
        if keys.len() != ranges.len() {
            return mismatch(keys.len(), ranges.len());
        }
        let plan = slices(ranges);
        type Staged = (Range<usize>, Vec<Result<Vec<u8>, DeviceError>>);
        let (tx, mut rx) = mpsc::channel::<Staged>(1);
        let stager = {
            let (ranges, plan) = (ranges.to_vec(), plan.clone());
            tokio::task::spawn_blocking(move || {
                for s in plan {
                    let bufs = s
                        .clone()
                        .map(|i| {
                            let mut buf = vec![0u8; ranges[i].len];
                            device.copy_to_host(ranges[i].ptr, &mut buf).map(|()| buf)
                        })
                        .collect();
                    if tx.blocking_send((s, bufs)).is_err() {
                        return;
                    }
                }
            })
        };
        let mut results: Vec<Option<Result<PutOutcome, ClientError>>> =
            (0..keys.len()).map(|_| None).collect();
        while let Some((s, bufs)) = rx.recv().await {
            let mut staged = Vec::with_capacity(bufs.len());
            for (i, b) in s.zip(bufs) {
                match b {
                    Ok(buf) => staged.push((i, buf)),
                    Err(e) => results[i] = Some(Err(e.into())),
                }
            }
            let parts: Vec<[&[u8]; 1]> = staged.iter().map(|(_, b)| [&b[..]]).collect();
            let items: Vec<(&str, &[&[u8]])> = staged
                .iter()
                .zip(&parts)
                .map(|((i, _), p)| (keys[*i], &p[..]))
                .collect();
            let res = self.batch_put_parts(&items, config).await;
            for ((i, _), r) in staged.iter().zip(res) {
                results[*i] = Some(r);
            }
        }
        finish(results, stager.await)
    }

    /// Reads each key into device memory: slice by slice into host staging buffers, each slice
    /// copied to the device while the next one is read. Answers the bytes read per key.
    pub async fn batch_get_into_device(
        &self,
        keys: &[&str],
        ranges: &[DeviceRange],
        device: Arc<dyn DeviceMemory>,
    ) -> Vec<Result<usize, ClientError>> {
        if keys.len() != ranges.len() {
            return mismatch(keys.len(), ranges.len());
        }
        type Read = (Range<usize>, Vec<Result<(usize, Vec<u8>), ClientError>>);
        let (tx, mut rx) = mpsc::channel::<Read>(1);
        let unstager = {
            let ranges = ranges.to_vec();
            tokio::task::spawn_blocking(move || {
                let mut out: Vec<(usize, Result<usize, ClientError>)> = Vec::new();
                while let Some((s, read)) = rx.blocking_recv() {
                    for (i, r) in s.zip(read) {
                        let r = r.and_then(|(n, buf)| {
                            device.copy_from_host(&buf[..n], ranges[i].ptr)?;
                            Ok(n)
                        });
                        out.push((i, r));
                    }
                }
                out
            })
        };
        for s in slices(ranges) {
            let mut bufs: Vec<Vec<u8>> = s.clone().map(|i| vec![0u8; ranges[i].len]).collect();
            let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let got = self.batch_get(&keys[s.clone()], &mut dst).await;
            let read = got
                .into_iter()
                .zip(bufs)
                .map(|(r, b)| r.map(|n| (n, b)))
                .collect();
            if tx.send((s, read)).await.is_err() {
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
        finish(results, copied.map(|_| ()))
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
        let r = |len| DeviceRange { ptr: 0, len };
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
    }
}
