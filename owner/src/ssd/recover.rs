//! Recovery of the ring log on open: every 4 KiB block of the file is checked for a record
//! header of this file (magic, file id, header checksum), and where valid records overlap (an
//! older record whose region was later reused in part), the newest (highest sequence number)
//! wins. Of each key only the newest version (highest put id) among the surviving records
//! counts: an older version can be written after a newer one (an offload of it still under way,
//! or queued behind), so the log's order is not the versions' order. Every other valid header
//! found is garbage, to be zeroed so it can never come back. Reads only; the store applies the
//! result.

use std::collections::{hash_map::Entry, BTreeMap, HashMap};

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
                    // A length that does not fit (a header of a record no file holds) is
                    // skipped.
                    if at.checked_add(h.record_len()).is_some_and(|e| e <= end) {
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

/// Regions of the file that newer records were written over, merged into disjoint spans as
/// they come (start to end).
#[derive(Default)]
struct Written(BTreeMap<u64, u64>);

impl Written {
    fn overlaps(&self, at: u64, end: u64) -> bool {
        self.0
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > at)
    }

    fn add(&mut self, mut at: u64, mut end: u64) {
        while let Some((&s, &e)) = self.0.range(..=end).next_back() {
            if e < at {
                break;
            }
            self.0.remove(&s);
            at = at.min(s);
            end = end.max(e);
        }
        self.0.insert(at, end);
    }
}

/// Newest first: a record survives if no newer record (surviving or not) overlaps it, and
/// counts if it is the surviving record of its key with the newest version (then the newest
/// record of it). A newer record that did not survive was still written over what lies under
/// it: an older record there that it alone overlaps is not whole either.
fn resolve(mut found: Vec<(u64, RecordHeader)>) -> Scanned {
    found.sort_by_key(|(_, h)| std::cmp::Reverse(h.seq));
    let mut written = Written::default();
    let mut newest: HashMap<ObjectKey, (u64, RecordHeader)> = HashMap::new();
    let mut garbage = Vec::new();
    for (at, h) in found {
        let end = at + h.record_len();
        let overlapped = written.overlaps(at, end);
        written.add(at, end);
        if overlapped {
            // Its header survived but part of its region holds newer records.
            garbage.push(at);
            continue;
        }
        match newest.entry(h.key.clone()) {
            Entry::Vacant(e) => {
                e.insert((at, h));
            }
            // Records come newest first: a later one wins only with a newer version.
            Entry::Occupied(mut e) if h.put_id > e.get().1.put_id => {
                let (older, _) = e.insert((at, h));
                garbage.push(older);
            }
            Entry::Occupied(_) => garbage.push(at),
        }
    }
    let live = newest.into_values().collect();
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

    /// A record overlapped only by a newer one that did not survive (itself partly overwritten
    /// by a still newer record) is not whole: the middle one was written over it. Before, only
    /// surviving records counted, and the oldest came back at a restart, its reads failing
    /// their checksum.
    #[test]
    fn a_record_under_one_that_did_not_survive_does_not_come_back() {
        let blocks = |n: u64| n * ALIGN as u64;
        let s = resolve(vec![
            (0, h("oldest", 2, blocks(5) - 100)),
            (blocks(4), h("middle", 5, blocks(4) - 100)),
            (blocks(7), h("newest", 7, blocks(3) - 100)),
        ]);
        let live: Vec<String> = s.live.iter().map(|(_, h)| h.key.to_string()).collect();
        assert_eq!(live, vec!["newest".to_string()]);
        let mut garbage = s.garbage;
        garbage.sort();
        assert_eq!(garbage, vec![0, blocks(4)]);
    }

    #[test]
    fn spans_merge_and_tell_overlaps() {
        let mut w = Written::default();
        w.add(10, 20);
        w.add(30, 40);
        w.add(0, 5);
        assert!(!w.overlaps(5, 10) && !w.overlaps(20, 30) && !w.overlaps(40, 50));
        assert!(w.overlaps(19, 21) && w.overlaps(0, 1) && w.overlaps(25, 35));
        w.add(15, 35); // joins [10, 20) and [30, 40)
        assert_eq!(w.0.len(), 2);
        assert!(w.overlaps(22, 23));
        w.add(5, 10); // touches both neighbours
        assert_eq!(w.0.iter().collect::<Vec<_>>(), vec![(&0, &40)]);
    }

    /// An older version written after a newer one (its offload was still under way) loses to
    /// it: before, the later record won, and a restart served the older bytes.
    #[test]
    fn the_newest_version_wins_over_a_later_record_of_an_older_one() {
        let blocks = |n: u64| n * ALIGN as u64;
        let version = |seq: u64, put_id: u64| RecordHeader {
            put_id,
            ..h("k", seq, 10)
        };
        let s = resolve(vec![
            (blocks(1), version(10, 200)),
            (blocks(2), version(11, 100)),
            (blocks(3), h("other", 12, 10)),
        ]);
        let mut live: Vec<(u64, u64)> = s.live.iter().map(|(at, h)| (*at, h.put_id)).collect();
        live.sort();
        assert_eq!(live, vec![(blocks(1), 200), (blocks(3), 120)]);
        assert_eq!(s.garbage, vec![blocks(2)]);
    }
}
