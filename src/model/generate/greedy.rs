//! Plain greedy decoding with a KV cache, one sequence at a time: the reference the other
//! engines are checked against.

use tch::{Kind, Tensor};

use crate::model::target::{KvCache, TargetModel};

/// The tokens greedy decoding produces after `prompt` (stopping after an `eos_ids` token, which
/// is included, or after `max_new_tokens`).
pub fn greedy_generate(
    model: &TargetModel,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_ids: &[u32],
) -> Vec<u32> {
    let mut out = Vec::with_capacity(max_new_tokens);
    if prompt.is_empty() || max_new_tokens == 0 {
        return out;
    }
    let mut cache = KvCache::new();
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let mut input = Tensor::from_slice(&ids).unsqueeze(0);
    while out.len() < max_new_tokens {
        let logits = model.forward(&input, Some(&mut cache));
        let next = logits
            .select(1, -1)
            .argmax(-1, false)
            .to_kind(Kind::Int64)
            .int64_value(&[0]) as u32;
        out.push(next);
        if eos_ids.contains(&next) {
            break;
        }
        input = Tensor::from_slice(&[next as i64]).unsqueeze(0);
    }
    out
}
