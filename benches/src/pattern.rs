//! Per-key payloads that are cheap to generate and to verify without keeping a copy: 8-byte words
//! of a key-seeded sequence, so a value of one key never matches another key's.

fn seed(key: &str) -> u64 {
    let mut x: u64 = 0xcbf29ce484222325;
    for b in key.bytes() {
        x = (x ^ b as u64).wrapping_mul(0x100000001b3);
    }
    x | 1
}

fn word(seed: u64, i: u64) -> u64 {
    (seed ^ i).wrapping_mul(0x9E3779B97F4A7C15)
}

pub fn fill(key: &str, buf: &mut [u8]) {
    let s = seed(key);
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&word(s, i as u64).to_le_bytes());
    }
    let tail = chunks.into_remainder();
    let last = word(s, u64::MAX).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

pub fn verify(key: &str, buf: &[u8]) -> bool {
    let s = seed(key);
    let mut chunks = buf.chunks_exact(8);
    for (i, c) in (&mut chunks).enumerate() {
        if c != word(s, i as u64).to_le_bytes() {
            return false;
        }
    }
    let tail = chunks.remainder();
    tail == &word(s, u64::MAX).to_le_bytes()[..tail.len()]
}

#[cfg(test)]
mod tests {
    #[test]
    fn fill_then_verify_and_detects_corruption() {
        for len in [1usize, 7, 8, 9, 4096, 4099] {
            let mut b = vec![0u8; len];
            super::fill("k", &mut b);
            assert!(super::verify("k", &b));
            assert!(!super::verify("other", &b));
            b[len / 2] ^= 1;
            assert!(!super::verify("k", &b));
        }
    }
}
