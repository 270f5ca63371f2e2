//! Reuse of aligned buffers between disk transfers. A fresh multi-MiB allocation is mapped and
//! page-faulted (and zeroed) by the kernel on first touch, which costs about as much CPU as the
//! copy it serves; keeping a few buffers around removes that from every offload and disk read.
//! A reused buffer holds old bytes: callers overwrite every byte they hand out (a disk read fills
//! the whole buffer; an encoded record zeroes its own padding).

use parking_lot::Mutex;

use super::AlignedBuf;

pub struct BufPool {
    free: Mutex<Vec<AlignedBuf>>,
    /// Buffers allocated because none idle fitted.
    pub allocated: std::sync::atomic::AtomicU64,
    /// Bytes of idle buffers kept at most.
    keep: usize,
}

impl BufPool {
    pub fn new(keep: usize) -> BufPool {
        BufPool {
            free: Mutex::new(Vec::new()),
            allocated: Default::default(),
            keep,
        }
    }

    /// A buffer of length `len` (a multiple of the alignment): an idle one that fits without
    /// wasting more than half of it, else a new one.
    pub fn take(&self, len: usize) -> AlignedBuf {
        let reused = {
            let mut free = self.free.lock();
            free.iter()
                .position(|b| b.capacity() >= len && b.capacity() / 2 <= len)
                .map(|i| free.swap_remove(i))
        };
        let mut buf = reused.unwrap_or_else(|| {
            self.allocated
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            AlignedBuf::with_capacity(len)
        });
        buf.set_len(len);
        buf
    }

    /// Keeps `buf` for reuse while the idle total stays within the limit; frees it otherwise.
    pub fn give(&self, mut buf: AlignedBuf) {
        buf.clear();
        let mut free = self.free.lock();
        let idle: usize = free.iter().map(|b| b.capacity()).sum();
        if idle + buf.capacity() <= self.keep {
            free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_within_the_limit() {
        let pool = BufPool::new(3 << 20);
        let a = pool.take(1 << 20);
        let p = a.as_ptr();
        pool.give(a);
        let b = pool.take((1 << 20) - 4096);
        assert_eq!(b.as_ptr(), p, "a fitting idle buffer is reused");
        assert_eq!(b.len(), (1 << 20) - 4096);
        let c = pool.take(8192);
        assert_ne!(c.as_ptr(), p);
        pool.give(b);
        pool.give(c);
        pool.give(AlignedBuf::with_capacity(4 << 20)); // over the limit: freed
        assert_eq!(pool.free.lock().len(), 2);
    }
}
