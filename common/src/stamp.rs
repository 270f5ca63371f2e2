//! What a write carries besides its bytes, so that the owner can fence stale writes and later
//! re-report the object to a master that lost its catalog: the put's id (the object's version,
//! issued by the master in increasing order) and the part of its replicate config that the
//! catalog keeps (replica count and pins).

use crate::replica::{ReplicateConfig, MAX_REPLICAS};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stamp {
    /// The grant the write belongs to; a later grant of the same range has a larger id.
    pub put_id: u64,
    /// Replicas the put asked for (1..=`MAX_REPLICAS`).
    pub replica_num: u8,
    pub soft_pin: bool,
    pub hard_pin: bool,
}

const REPLICAS_MASK: u16 = 0x7f;
const SOFT_PIN: u16 = 1 << 7;
const HARD_PIN: u16 = 1 << 8;

impl Stamp {
    pub fn new(put_id: u64, config: &ReplicateConfig) -> Stamp {
        Stamp {
            put_id,
            replica_num: config.replica_num.clamp(1, MAX_REPLICAS) as u8,
            soft_pin: config.soft_pin,
            hard_pin: config.hard_pin,
        }
    }

    /// The attributes packed into a data-plane header's flags.
    pub fn flags(&self) -> u16 {
        (self.replica_num as u16 & REPLICAS_MASK)
            | if self.soft_pin { SOFT_PIN } else { 0 }
            | if self.hard_pin { HARD_PIN } else { 0 }
    }

    /// The inverse of `flags`; a replica count outside 1..=`MAX_REPLICAS` reads as 1.
    pub fn from_flags(put_id: u64, flags: u16) -> Stamp {
        let n = (flags & REPLICAS_MASK) as usize;
        Stamp {
            put_id,
            replica_num: if (1..=MAX_REPLICAS).contains(&n) {
                n as u8
            } else {
                1
            },
            soft_pin: flags & SOFT_PIN != 0,
            hard_pin: flags & HARD_PIN != 0,
        }
    }

    /// The replicate config a rebuilt catalog gives the object (no preferred segments: placement
    /// is over once the bytes landed).
    pub fn config(&self) -> ReplicateConfig {
        ReplicateConfig {
            replica_num: self.replica_num.max(1) as usize,
            soft_pin: self.soft_pin,
            hard_pin: self.hard_pin,
            ..ReplicateConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn flags_round_trip(put_id: u64, n in 1u8..=MAX_REPLICAS as u8, soft: bool, hard: bool) {
            let s = Stamp { put_id, replica_num: n, soft_pin: soft, hard_pin: hard };
            prop_assert_eq!(Stamp::from_flags(put_id, s.flags()), s);
        }
    }

    #[test]
    fn config_round_trips_through_a_stamp() {
        let c = ReplicateConfig {
            replica_num: 3,
            hard_pin: true,
            ..ReplicateConfig::default()
        };
        assert_eq!(Stamp::new(9, &c).config(), c);
        assert_eq!(Stamp::from_flags(1, 0).replica_num, 1);
    }
}
