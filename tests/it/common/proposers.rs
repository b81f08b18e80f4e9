//! Block proposers whose acceptance is known, for tests of the speculative decoding loop and of
//! the validation walk: one that is always wrong and an oracle that knows the target's answer.

use dflash_tui::eval::speculative::BlockDrafter;
use tch::Tensor;

pub fn ids_tensor(ids: &[u32]) -> Tensor {
    let v: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
    Tensor::from_slice(&v)
}

pub fn ids_vec(t: &Tensor) -> Vec<u32> {
    Vec::<i64>::try_from(&t.to_kind(tch::Kind::Int64))
        .unwrap()
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

/// A "drafter" that always proposes `token` for every slot.
pub struct AlwaysProposes {
    pub block: usize,
    pub token: u32,
}

impl BlockDrafter for AlwaysProposes {
    fn block_size(&self) -> usize {
        self.block
    }
    fn propose(
        &mut self,
        _ctx: &Tensor,
        x: u32,
        _x_dev: &Tensor,
        _pos: i64,
    ) -> anyhow::Result<Tensor> {
        let mut b = vec![self.token; self.block];
        b[0] = x;
        Ok(ids_tensor(&b))
    }
}

/// A "drafter" given the target's own greedy answer: it proposes exactly what the target will
/// say next, except at the slots `wrong[step]` (when set), where it proposes a wrong token.
pub struct Oracle {
    pub block: usize,
    pub prompt_len: i64,
    pub answer: Vec<u32>,
    pub wrong: Vec<Option<usize>>,
    pub step: usize,
    /// Context positions received so far: each call must bring exactly the accepted ones.
    pub context_len: i64,
}

impl Oracle {
    /// Always right.
    pub fn new(block: usize, prompt_len: usize, answer: Vec<u32>) -> Self {
        Oracle {
            block,
            prompt_len: prompt_len as i64,
            answer,
            wrong: vec![],
            step: 0,
            context_len: 0,
        }
    }
}

impl BlockDrafter for Oracle {
    fn block_size(&self) -> usize {
        self.block
    }
    fn propose(
        &mut self,
        ctx: &Tensor,
        x: u32,
        _x_dev: &Tensor,
        pos: i64,
    ) -> anyhow::Result<Tensor> {
        self.context_len += ctx.size()[0];
        assert_eq!(self.context_len, pos, "the context is every token before x");
        let at = (pos - self.prompt_len) as usize; // index of x in the answer
        assert_eq!(self.answer[at], x);
        let mut b: Vec<u32> = self.answer[at..at + self.block].to_vec();
        if let Some(Some(k)) = self.wrong.get(self.step) {
            b[*k] = (b[*k] + 1) % 50;
        }
        self.step += 1;
        Ok(ids_tensor(&b))
    }
}
