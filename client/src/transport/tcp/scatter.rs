//! Receiving the answers to a pipelined batch of small reads straight into the caller's memory.
//!
//! Each answer is laid out as the request predicts: a fixed-size header, then exactly the bytes
//! asked for. So one `readv` lands many answers at once, headers into a small array and values
//! into their destinations, with no stop in the connection's buffer and no call per answer. An
//! answer that turns out to be a refusal (its header carries a status and a message instead of
//! the value) means the bytes behind that header went to the wrong places: they are put back, in
//! stream order, into the connection's buffer, and the rest is read the ordinary way.

use std::io::{self, IoSliceMut};

use mooncake_common::{
    transport::{ReadItem, TransferError},
    wire::{self, Op, ResponseHeader},
    SegmentName,
};

use super::{Conn, RECV_BUF};

const H: usize = wire::RESPONSE_HEADER_LEN;
/// Bytes asked of one `readv`: what may need putting back (plus one header) fits the buffer.
const READ_CAP: usize = RECV_BUF - H;
/// Buffers handed to one `readv`.
const MAX_IOV: usize = 512;

impl Conn {
    /// Receives the answers to requests `first..` for `items` (of `lens` bytes each). Returns
    /// `k`: items `..k` arrived whole and valid. Below `items.len()`, answer `k` is a refusal
    /// and the stream (through the buffer) is positioned at its header, to be read the ordinary
    /// way. Answers that break the protocol are an error, as in `receive`.
    pub(super) async fn receive_scattered(
        &mut self,
        target: &SegmentName,
        op: Op,
        first: u64,
        items: &mut [ReadItem<'_, '_>],
        lens: &[u64],
    ) -> Result<usize, TransferError> {
        let io_err = |source| TransferError::Io {
            target: target.clone(),
            source,
        };
        debug_assert_eq!(
            self.rpos, self.rend,
            "an exchange starts with nothing buffered"
        );
        let n = items.len();
        let mut hdrs = vec![[0u8; H]; n];
        // Everything the answers fill, in stream order; `hdr_at[j]` is answer j's header.
        let mut targets: Vec<&mut [u8]> = Vec::with_capacity(n * 2);
        let mut hdr_at = Vec::with_capacity(n);
        for (h, it) in hdrs.iter_mut().zip(items.iter_mut()) {
            hdr_at.push(targets.len());
            targets.push(&mut h[..]);
            targets.extend(
                it.parts
                    .iter_mut()
                    .filter(|p| !p.is_empty())
                    .map(|p| &mut p[..]),
            );
        }
        // Cursor: `targets[t][off..]` is filled next; answers below `checked` were validated.
        let (mut t, mut off, mut checked) = (0usize, 0usize, 0usize);
        while t < targets.len() {
            let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(MAX_IOV.min(targets.len() - t));
            let mut asked = 0;
            for (k, dst) in targets[t..].iter_mut().enumerate() {
                if asked >= READ_CAP || iov.len() == MAX_IOV {
                    break;
                }
                let from = if k == 0 { off } else { 0 };
                let want = (dst.len() - from).min(READ_CAP - asked);
                iov.push(IoSliceMut::new(&mut dst[from..from + want]));
                asked += want;
            }
            let got = loop {
                self.stream.readable().await.map_err(io_err)?;
                match self.stream.try_read_vectored(&mut iov) {
                    Ok(0) => return Err(io_err(io::ErrorKind::UnexpectedEof.into())),
                    Ok(k) => break k,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(io_err(e)),
                }
            };
            drop(iov);
            let (t0, off0) = (t, off);
            let mut left = got;
            while left > 0 {
                let room = targets[t].len() - off;
                if left < room {
                    off += left;
                    left = 0;
                } else {
                    left -= room;
                    t += 1;
                    off = 0;
                }
            }
            // Validate every header this read completed.
            while checked < n && hdr_at[checked] < t {
                let j = checked;
                let hb: &[u8; H] = (&*targets[hdr_at[j]]).try_into().expect("header size");
                let h = ResponseHeader::decode(hb).map_err(|source| TransferError::Protocol {
                    target: target.clone(),
                    source,
                })?;
                let id = first + j as u64;
                if h.request_id != id || (h.op != op && h.status == 0) {
                    return Err(io_err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("response {} does not match request {id}", h.request_id),
                    )));
                }
                if h.status != 0 {
                    // Everything from this header to the cursor belongs to the refusal and the
                    // answers behind it: back into the buffer, in order.
                    self.put_back(&targets, hdr_at[j], (t0, off0), (t, off));
                    return Ok(j);
                }
                if h.length != lens[j] {
                    return Err(io_err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("owner sent {} bytes, {} were asked for", h.length, lens[j]),
                    )));
                }
                checked += 1;
            }
        }
        Ok(n)
    }

    /// Copies into the (empty) buffer the bytes of `targets` from the start of `targets[from]` to
    /// `to`, where `targets[from]` (a header) was completed by the read that began at `began`.
    fn put_back(
        &mut self,
        targets: &[&mut [u8]],
        from: usize,
        began: (usize, usize),
        to: (usize, usize),
    ) {
        // Only the header may predate the last read; all else came with it (at most READ_CAP).
        debug_assert!(from >= began.0);
        let mut at = 0;
        for (k, dst) in targets.iter().enumerate().take(to.0 + 1).skip(from) {
            let end = if k == to.0 { to.1 } else { dst.len() };
            self.rbuf[at..at + end].copy_from_slice(&dst[..end]);
            at += end;
        }
        (self.rpos, self.rend) = (0, at);
    }
}
