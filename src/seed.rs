//! Seed mixing: SplitMix64, for deriving independent, reproducible seeds from a run's seed and
//! some coordinates (a row, a turn, a step).

/// SplitMix64's increment (2^64 / golden ratio): consecutive states are this far apart.
pub(crate) const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (Stafford's variant 13): a bijection of `u64` that spreads
/// every input bit over the output.
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One SplitMix64 step from state `x`: the output of the next state, `x + GOLDEN_GAMMA`.
pub(crate) fn splitmix64(x: u64) -> u64 {
    mix64(x.wrapping_add(GOLDEN_GAMMA))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence() {
        // The first outputs of the reference SplitMix64 generator seeded with 0.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(GOLDEN_GAMMA), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(mix64(0), 0);
    }
}
