//! The on-disk formats of the SSD tier: a superblock naming the file, and records that carry
//! their key, length, version and checksums, so a record is either read back exactly as written
//! or refused (corrupt, torn, overwritten, or from another file). Encoding only; no I/O.
//!
//! ```text
//! superblock (block 0): magic "MCSB" | version u32 | file_id u64 | capacity u64 | crc32c u32
//! record (4 KiB aligned, padded):
//!   magic "MCSR" u32 | version u8 | pad 3 | file_id u64 | seq u64 | put_id u64 | value_len u64
//!   | key_len u16 | pad 2 | value_crc u32 | header_crc u32 | pad 12 | key | value | zero padding
//! ```
//! `header_crc` covers the first 48 bytes and the key; `value_crc` the value. `file_id` is random
//! per file, so a record-shaped value stored inside another record is never taken for a record.

use mooncake_common::ObjectKey;

use super::ALIGN;

const SUPER_MAGIC: u32 = u32::from_le_bytes(*b"MCSB");
const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"MCSR");
const VERSION: u8 = 1;
/// Bytes before the key in a record.
pub const HEADER_LEN: usize = 64;

/// Rounds `n` up to the alignment of direct I/O (`u64::MAX` where that does not fit).
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64).saturating_mul(ALIGN as u64)
}

/// Bytes a record of this key and value occupies on disk (`u64::MAX` for a size no file holds:
/// it wrapped to a block before, and a reservation evicted records for it).
pub fn record_len(key_len: usize, value_len: u64) -> u64 {
    align_up((HEADER_LEN as u64 + key_len as u64).saturating_add(value_len))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub file_id: u64,
    pub capacity: u64,
}

impl Superblock {
    pub fn encode(&self, out: &mut [u8]) {
        out[..ALIGN].fill(0);
        out[0..4].copy_from_slice(&SUPER_MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&(VERSION as u32).to_le_bytes());
        out[8..16].copy_from_slice(&self.file_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        let crc = crc32c::crc32c(&out[0..24]);
        out[24..28].copy_from_slice(&crc.to_le_bytes());
    }

    /// `None` for a block that holds no superblock (a fresh, zeroed file); an error for one that
    /// looks like a superblock but does not check out.
    pub fn decode(b: &[u8]) -> Result<Option<Superblock>, String> {
        if b[0..4] != SUPER_MAGIC.to_le_bytes() {
            return if b[..ALIGN].iter().all(|x| *x == 0) {
                Ok(None)
            } else {
                Err("the file does not start with a mooncake SSD-tier superblock".into())
            };
        }
        if u32_at(b, 24) != crc32c::crc32c(&b[0..24]) {
            return Err("the superblock's checksum does not match".into());
        }
        let version = u32_at(b, 4);
        if version != VERSION as u32 {
            return Err(format!(
                "the SSD tier was written by format version {version}; this build reads {VERSION}"
            ));
        }
        Ok(Some(Superblock {
            file_id: u64_at(b, 8),
            capacity: u64_at(b, 16),
        }))
    }
}

/// What a record's header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    pub seq: u64,
    pub put_id: u64,
    pub value_len: u64,
    pub key: ObjectKey,
    pub value_crc: u32,
}

impl RecordHeader {
    /// Bytes the whole record occupies.
    pub fn record_len(&self) -> u64 {
        record_len(self.key.as_str().len(), self.value_len)
    }

    /// Where the value starts in the record.
    pub fn value_offset(&self) -> usize {
        HEADER_LEN + self.key.as_str().len()
    }
}

/// Writes a record's header and key into `out` (the value goes right after, at
/// `HEADER_LEN + key.len()`); `value` is only read for its checksum.
pub fn encode_header(
    out: &mut [u8],
    file_id: u64,
    seq: u64,
    put_id: u64,
    key: &ObjectKey,
    value: &[u8],
) {
    let k = key.as_str().as_bytes();
    out[..HEADER_LEN].fill(0);
    out[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    out[4] = VERSION;
    out[8..16].copy_from_slice(&file_id.to_le_bytes());
    out[16..24].copy_from_slice(&seq.to_le_bytes());
    out[24..32].copy_from_slice(&put_id.to_le_bytes());
    out[32..40].copy_from_slice(&(value.len() as u64).to_le_bytes());
    out[40..42].copy_from_slice(&(k.len() as u16).to_le_bytes());
    out[44..48].copy_from_slice(&crc32c::crc32c(value).to_le_bytes());
    out[HEADER_LEN..HEADER_LEN + k.len()].copy_from_slice(k);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[0..48]), k);
    out[48..52].copy_from_slice(&crc.to_le_bytes());
}

/// How much of a record must be read to decode its header: the fixed part, then the key.
pub fn key_len_of(b: &[u8]) -> Option<usize> {
    if b.len() < HEADER_LEN || b[0..4] != RECORD_MAGIC.to_le_bytes() {
        return None;
    }
    Some(u16::from_le_bytes([b[40], b[41]]) as usize)
}

/// Decodes a record header from `b` (at least `HEADER_LEN + key_len` bytes). `None` when the
/// bytes are not a valid record header of file `file_id`.
pub fn decode_header(b: &[u8], file_id: u64) -> Option<RecordHeader> {
    let key_len = key_len_of(b)?;
    if b[4] != VERSION || u64_at(b, 8) != file_id || b.len() < HEADER_LEN + key_len {
        return None;
    }
    let k = &b[HEADER_LEN..HEADER_LEN + key_len];
    let crc = crc32c::crc32c_append(crc32c::crc32c(&b[0..48]), k);
    if crc != u32_at(b, 48) {
        return None;
    }
    let key = ObjectKey::from_bytes(k).ok()?;
    Some(RecordHeader {
        seq: u64_at(b, 16),
        put_id: u64_at(b, 24),
        value_len: u64_at(b, 32),
        key,
        value_crc: u32_at(b, 44),
    })
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_any_flipped_header_bit_is_caught() {
        let key = ObjectKey::new("layer0/block7").unwrap();
        let value: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let len = record_len(key.as_str().len(), value.len() as u64) as usize;
        assert_eq!(len % ALIGN, 0);
        let mut rec = vec![0u8; len];
        encode_header(&mut rec, 99, 5, 1234, &key, &value);
        let at = HEADER_LEN + key.as_str().len();
        rec[at..at + value.len()].copy_from_slice(&value);
        let h = decode_header(&rec, 99).unwrap();
        assert_eq!(
            (h.seq, h.put_id, h.value_len),
            (5, 1234, value.len() as u64)
        );
        assert_eq!(h.key, key);
        assert_eq!(h.value_offset(), at);
        assert_eq!(h.value_crc, crc32c::crc32c(&value));
        assert!(decode_header(&rec, 98).is_none(), "another file's record");
        for bit in 0..(at * 8) {
            let mut bad = rec.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(
                decode_header(&bad, 99).is_none_or(|h2| h2 == h && bit / 8 >= 52),
                "flipped bit {bit} went unnoticed"
            );
        }
    }

    /// A size no file holds is too large, not a block: it wrapped before, and an offload of it
    /// (a master's bad task) evicted the records of one block before its read was refused.
    #[test]
    fn a_size_near_the_top_of_u64_is_too_large_for_any_file() {
        assert_eq!(record_len(13, u64::MAX), u64::MAX);
        assert_eq!(record_len(13, u64::MAX - 70), u64::MAX);
        assert_eq!(align_up(u64::MAX - 1), u64::MAX);
        assert_eq!(record_len(13, 100), ALIGN as u64);
    }

    #[test]
    fn superblocks_round_trip_and_a_zero_block_is_fresh() {
        let mut b = vec![0u8; ALIGN];
        assert_eq!(Superblock::decode(&b), Ok(None));
        let sb = Superblock {
            file_id: 42,
            capacity: 1 << 30,
        };
        sb.encode(&mut b);
        assert_eq!(Superblock::decode(&b), Ok(Some(sb)));
        b[17] ^= 1;
        assert!(Superblock::decode(&b).is_err());
        let mut junk = vec![0u8; ALIGN];
        junk[100] = 1;
        assert!(Superblock::decode(&junk).is_err());
    }
}
