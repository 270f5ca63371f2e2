//! Recovery of the ring log on open: every 4 KiB block of the file is checked for a record
//! header of this file (magic, file id, header checksum), and where valid records overlap (an
//! older record whose region was later reused in part), the newest (highest sequence number)
//! wins. Of each key only the newest surviving record counts; every other valid header found is
//! garbage, to be zeroed so it can never come back. Reads only; the store applies the result.

use std::collections::{BTreeMap, HashMap};

use mooncake_common::ObjectKey;

use super::{
    record::{self, RecordHeader, HEADER_LEN},
    AlignedBuf, DiskEngine, ALIGN,
};

/// Bytes read at a time.
const CHUNK: usize = 4 << 20;

/// What the file holds.
pub struct Scanned {
    /// The newest record of each key, by offset.
    pub live: Vec<(u64, RecordHeader)>,
    /// Offsets of valid headers that must not count (superseded or partly overwritten).
    pub garbage: Vec<u64>,
}

/// Reads `[start, end)` of the file and sorts what it finds into live records and garbage.
pub async fn scan(
    engine: &dyn DiskEngine,
    file_id: u64,
    start: u64,
    end: u64,
) -> std::io::Result<Scanned> {
    let mut found: Vec<(u64, RecordHeader)> = Vec::new();
    let mut buf = AlignedBuf::with_capacity(CHUNK);
    let mut pos = start;
    while pos < end {
        let n = (CHUNK as u64).min(end - pos) as usize;
        buf.set_len(n);
        let (b, res) = engine.read_at(buf, pos).await;
        buf = b;
        res?;
        let mut i = 0usize;
        while i < n {
            let block = &buf[i..n];
            if let Some(kl) = record::key_len_of(block) {
                if HEADER_LEN + kl > block.len() && i > 0 && pos + n as u64 != end {
                    break; // the header runs past this chunk: read again from here
                }
                if let Some(h) = record::decode_header(block, file_id) {
                    let at = pos + i as u64;
                    if at + h.record_len() <= end {
                        found.push((at, h));
                    }
                }
            }
            i += ALIGN;
        }
        pos += i as u64;
    }
    Ok(resolve(found))
}

/// Newest first: a record survives if no newer surviving record overlaps it, and counts if it
/// is the newest surviving record of its key.
fn resolve(mut found: Vec<(u64, RecordHeader)>) -> Scanned {
    found.sort_by_key(|(_, h)| std::cmp::Reverse(h.seq));
    let mut taken: BTreeMap<u64, u64> = BTreeMap::new();
    let mut keys: HashMap<ObjectKey, ()> = HashMap::new();
    let mut live = Vec::new();
    let mut garbage = Vec::new();
    for (at, h) in found {
        let len = h.record_len();
        let overlapped = taken
            .range(..at + len)
            .next_back()
            .is_some_and(|(s, l)| s + l > at);
        if overlapped {
            // Its header survived but part of its region holds newer records.
            garbage.push(at);
            continue;
        }
        taken.insert(at, len);
        if keys.insert(h.key.clone(), ()).is_some() {
            garbage.push(at); // an older version of a key whose newer record survives
            continue;
        }
        live.push((at, h));
    }
    Scanned { live, garbage }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(key: &str, seq: u64, value_len: u64) -> RecordHeader {
        RecordHeader {
            seq,
            put_id: seq * 10,
            value_len,
            key: ObjectKey::new(key).unwrap(),
            value_crc: 0,
        }
    }

    #[test]
    fn the_newest_record_wins_overlaps_and_keys() {
        let blocks = |n: u64| n * ALIGN as u64;
        let found = vec![
            // An old big record at 0 whose tail was reused by seq 7 (its header survived).
            (0, h("old", 2, blocks(8) - 100)),
            (blocks(4), h("new", 7, 10)),
            // Two versions of k, the newer at a higher offset.
            (blocks(10), h("k", 3, 10)),
            (blocks(11), h("k", 5, 10)),
            (blocks(12), h("other", 4, 10)),
        ];
        let s = resolve(found);
        let mut live: Vec<(u64, String)> = s
            .live
            .iter()
            .map(|(at, h)| (*at, h.key.to_string()))
            .collect();
        live.sort();
        assert_eq!(
            live,
            vec![
                (blocks(4), "new".to_string()),
                (blocks(11), "k".to_string()),
                (blocks(12), "other".to_string())
            ]
        );
        let mut garbage = s.garbage;
        garbage.sort();
        assert_eq!(garbage, vec![0, blocks(10)]);
    }
}
