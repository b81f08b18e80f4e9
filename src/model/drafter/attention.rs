//! The formulation of the drafter's training attention ([`TrainAttention`]: dense, chunked or grouped,
//! with its automatic chunk size and text form) and the bucketed context length of the chunked
//! one.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Result};

/// Blocks a group of the grouped form by default (2,048 query rows with blocks of 16). At the
/// 8B shape on an H100 (docs/benchmarks.md, 2026-12-06, eighteenth session) groups of 128 ran
/// 6.75 to 6.77 samples/s against 6.61 to 6.65 for 64 and 6.51 for 32. The drafter's step
/// alone was the same for 128 and 64 (half the cuDNN calls, more masked keys each); the whole
/// pipeline, target and drafter on one GPU, ran 2 % faster.
pub const DEFAULT_GROUP_BLOCKS: i64 = 128;

/// The largest group the text form takes (cuDNN plans a shape per group size up to it).
const MAX_GROUP_BLOCKS: usize = 1024;

/// How [`Drafter::forward_train`] computes the attention of its N anchor blocks (spec §2.4).
/// Both formulations are exact; they differ in cost only.
///
/// - `Dense`: one fused attention call per layer over all N*B block queries of a sequence
///   against [context (S); all N*B block keys] with one boolean mask. Only B of the N*B block
///   keys are visible to a query, so for large N the block-block part (N*B x N*B) dominates
///   the cost. Kept as the reference.
/// - `Chunked`: the N (sorted) blocks of a sequence are cut into chunks of consecutive blocks;
///   each chunk's queries attend over [context; the chunk's own block keys] only, the chunks
///   of the batch in fused calls of a fixed number of chunks (along the batch axis), each call
///   holding the same chunk of several sequences and reading the context only up to its
///   chunks' last anchor. Cost per query: at most S + C*B keys instead of S + N*B (about half
///   the context on average). The context keys and values are copied once per chunk (N/C
///   copies). `blocks_per_chunk` is C; 0 chooses it from S (see
///   [`TrainAttention::blocks_per_chunk`]). The context lengths are bucketed, so that the
///   calls' shapes repeat.
/// - `Grouped`: the blocks of a sequence in groups of `blocks_per_group` consecutive blocks (a
///   power of two; 0: [`DEFAULT_GROUP_BLOCKS`]), each group's queries
///   over a view of its sequence's context (no copies) and each block over its own keys apart,
///   the two parts merged by their log-sum-exp (one autograd node a layer, see
///   `src/model/drafter/groups.rs`). Where it does not apply (no fused kernels on the device,
///   float32, sliding-window layers) the automatic chunked form runs instead.
///
/// Text form (for configs): `dense`, `chunked` (automatic chunk size), `chunked:C`, `grouped`
/// (groups of [`DEFAULT_GROUP_BLOCKS`]), `grouped:G` (G blocks a group, a power of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TrainAttention {
    Dense,
    Chunked { blocks_per_chunk: usize },
    Grouped { blocks_per_group: usize },
}

impl Default for TrainAttention {
    fn default() -> Self {
        TrainAttention::GROUPED
    }
}

impl TrainAttention {
    /// The automatic chunk size with the default `Chunked { blocks_per_chunk: 0 }`.
    pub const AUTO: TrainAttention = TrainAttention::Chunked {
        blocks_per_chunk: 0,
    };

    /// The grouped form with the default group size, [`DEFAULT_GROUP_BLOCKS`] (`grouped`).
    pub const GROUPED: TrainAttention = TrainAttention::Grouped {
        blocks_per_group: 0,
    };

    /// The blocks per group of the grouped form (a power of two; `None` for the others).
    pub fn blocks_per_group(&self) -> Option<i64> {
        match *self {
            TrainAttention::Grouped { blocks_per_group } => Some(match blocks_per_group {
                0 => DEFAULT_GROUP_BLOCKS,
                g => g as i64,
            }),
            _ => None,
        }
    }

    /// The number of blocks per chunk actually used for `n` blocks of `block` tokens per
    /// sequence, against `context` positions, with `heads` query heads and `kv_heads` key/value
    /// heads; `None` for `Dense`. `Grouped` gives the automatic size of the chunked form it
    /// falls back to.
    ///
    /// Automatic choice: per query, the fused kernel's work grows with the keys it reads,
    /// S + C*B, while copying the context keys and values once per chunk costs about
    /// S * kv_heads * head_dim / (C*B) per query (memory traffic, forward and backward). The
    /// sum is smallest at C*B = sqrt(r * S) with r = 640 * kv_heads / heads (measured on an
    /// H200 with cuDNN's fused attention, head_dim 128: the step time falls from C = 4 to
    /// C = 32 at S = 1522, for 16/8 and 32/8 heads); the optimum is flat, so C is rounded to a
    /// power of two. Examples (GQA 32/8 heads, B = 16): S = 256 -> 16, S = 1024 -> 32,
    /// S = 3072 -> 32, S = 8192 -> 64.
    ///
    /// C does not depend on the number of blocks: with the bucketed context length
    /// ([`context_bucket`]) it fixes the shape of every fused attention call, and a fused
    /// kernel builds its plan once per shape.
    pub fn blocks_per_chunk(
        &self,
        block: i64,
        context: i64,
        heads: i64,
        kv_heads: i64,
    ) -> Option<i64> {
        let blocks_per_chunk = match *self {
            TrainAttention::Dense => return None,
            TrainAttention::Chunked { blocks_per_chunk } => blocks_per_chunk,
            TrainAttention::Grouped { .. } => 0,
        };
        let c = if blocks_per_chunk > 0 {
            blocks_per_chunk as i64
        } else {
            let r = 640.0 * kv_heads.max(1) as f64 / heads.max(1) as f64;
            let rows = (r * context.max(1) as f64).sqrt();
            let c = (rows / block.max(1) as f64).max(1.0);
            1i64 << (c.log2().round() as i64).clamp(0, 20)
        };
        Some(c.max(1))
    }
}

/// The context length the chunked training attention pads `s` to: a multiple of 1/16 of the
/// largest power of two not above `s`, and of at least 128 (128 up to 4096, 256 up to 8192,
/// ...): fewer than max(128, s/16) padding keys, 24 distinct lengths up to 3072. Fused
/// attention kernels (cuDNN's) build a plan per shape, tens of milliseconds of host time
/// each: with raw sequence lengths nearly every batch would build new ones.
pub fn context_bucket(s: i64) -> i64 {
    let s = s.max(1);
    let floor_pow2 = 1i64 << (63 - s.leading_zeros() as i64);
    let step = (floor_pow2 / 16).max(128);
    (s + step - 1) / step * step
}

impl fmt::Display for TrainAttention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainAttention::Dense => write!(f, "dense"),
            TrainAttention::Chunked {
                blocks_per_chunk: 0,
            } => write!(f, "chunked"),
            TrainAttention::Chunked { blocks_per_chunk } => write!(f, "chunked:{blocks_per_chunk}"),
            TrainAttention::Grouped {
                blocks_per_group: 0,
            } => write!(f, "grouped"),
            TrainAttention::Grouped { blocks_per_group } => write!(f, "grouped:{blocks_per_group}"),
        }
    }
}

impl FromStr for TrainAttention {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "dense" => Ok(TrainAttention::Dense),
            "grouped" | "grouped:auto" | "grouped:0" => Ok(TrainAttention::GROUPED),
            "chunked" | "chunked:auto" | "chunked:0" => Ok(TrainAttention::AUTO),
            _ if t.starts_with("grouped:") => {
                let g = t["grouped:".len()..]
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|g| g.is_power_of_two() && *g <= MAX_GROUP_BLOCKS);
                match g {
                    Some(blocks_per_group) => Ok(TrainAttention::Grouped { blocks_per_group }),
                    None => bail!(
                        "attention {s:?}: expected \"grouped:G\" with G blocks per group, a power of two from 1 to {MAX_GROUP_BLOCKS}"
                    ),
                }
            }
            _ => {
                let c = t
                    .strip_prefix("chunked:")
                    .and_then(|c| c.trim().parse::<usize>().ok())
                    .filter(|&c| (1..=1 << 20).contains(&c));
                match c {
                    Some(blocks_per_chunk) => Ok(TrainAttention::Chunked { blocks_per_chunk }),
                    None => bail!(
                        "attention {s:?}: expected \"grouped\" (automatic group size), \"grouped:G\", \"dense\", \"chunked\" (automatic chunk size) or \"chunked:C\" with C blocks per chunk, 1 <= C <= 1048576"
                    ),
                }
            }
        }
    }
}

impl TryFrom<String> for TrainAttention {
    type Error = anyhow::Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<TrainAttention> for String {
    fn from(a: TrainAttention) -> String {
        a.to_string()
    }
}
