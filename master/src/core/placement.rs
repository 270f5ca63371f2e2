//! Replica placement as a pure function: given the mounted segments, the caller's preferred
//! segments and a strategy, the order in which segments are tried. No allocation happens here.

use rand::{seq::SliceRandom, Rng};
use serde::{Deserialize, Serialize};

use super::SegmentId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AllocationStrategy {
    /// Non-preferred segments in random order: spreads load evenly on average.
    #[default]
    Random,
    /// Non-preferred segments with the largest free fraction first: evens out fill levels.
    FreeRatioFirst,
}

impl std::str::FromStr for AllocationStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "random" => Ok(AllocationStrategy::Random),
            "free_ratio_first" => Ok(AllocationStrategy::FreeRatioFirst),
            _ => Err(format!(
                "unknown allocation strategy {s:?}: expected \"random\" or \"free_ratio_first\""
            )),
        }
    }
}

/// What placement needs to know of a segment.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub id: SegmentId,
    pub capacity: u64,
    pub free: u64,
}

/// Segments in the order to try them: the preferred ones that exist, in the caller's order and
/// without duplicates, then every other segment in strategy order.
pub fn order(
    strategy: AllocationStrategy,
    candidates: &[Candidate],
    preferred: &[SegmentId],
    rng: &mut impl Rng,
) -> Vec<SegmentId> {
    let mut out: Vec<SegmentId> = Vec::with_capacity(candidates.len());
    for p in preferred {
        if !out.contains(p) && candidates.iter().any(|c| c.id == *p) {
            out.push(*p);
        }
    }
    let mut rest: Vec<Candidate> = candidates
        .iter()
        .filter(|c| !out.contains(&c.id))
        .copied()
        .collect();
    match strategy {
        AllocationStrategy::Random => rest.shuffle(rng),
        AllocationStrategy::FreeRatioFirst => rest.sort_by(|a, b| {
            let ra = a.free as f64 / a.capacity.max(1) as f64;
            let rb = b.free as f64 / b.capacity.max(1) as f64;
            rb.total_cmp(&ra).then(a.id.cmp(&b.id))
        }),
    }
    out.extend(rest.iter().map(|c| c.id));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    fn cands() -> Vec<Candidate> {
        (0..5)
            .map(|i| Candidate {
                id: SegmentId(i),
                capacity: 100,
                free: 10 * i,
            })
            .collect()
    }

    #[test]
    fn preferred_first_in_order_then_rest() {
        let mut rng = StdRng::seed_from_u64(1);
        let pref = [SegmentId(3), SegmentId(9), SegmentId(1), SegmentId(3)];
        let o = order(AllocationStrategy::Random, &cands(), &pref, &mut rng);
        assert_eq!(&o[..2], &[SegmentId(3), SegmentId(1)]);
        let mut sorted = o.clone();
        sorted.sort();
        assert_eq!(sorted, (0..5).map(SegmentId).collect::<Vec<_>>());
    }

    #[test]
    fn free_ratio_first_orders_by_free_fraction() {
        let mut rng = StdRng::seed_from_u64(1);
        let o = order(
            AllocationStrategy::FreeRatioFirst,
            &cands(),
            &[SegmentId(0)],
            &mut rng,
        );
        assert_eq!(
            o,
            vec![
                SegmentId(0),
                SegmentId(4),
                SegmentId(3),
                SegmentId(2),
                SegmentId(1)
            ]
        );
    }

    #[test]
    fn random_spreads() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut firsts = std::collections::HashSet::new();
        for _ in 0..100 {
            firsts.insert(order(AllocationStrategy::Random, &cands(), &[], &mut rng)[0]);
        }
        assert_eq!(firsts.len(), 5);
    }
}
