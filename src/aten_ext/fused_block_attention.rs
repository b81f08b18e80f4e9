//! The drafter's grouped training attention of one layer as one autograd node
//! ([`grouped_block_attention_autograd`]), in two parts merged by their log-sum-exp:
//! - the context: per group of consecutive blocks of one sequence, cuDNN's fused attention of
//!   its queries over a view of that sequence's context keys under the staircase mask (a block
//!   anchored at a sees the positions p < a), with its log-sum-exp;
//! - each block over its own keys: the `block_attention_fwd` kernel (fused_kernels.cu, one launch
//!   over every row), which also merges the two parts: lse = log(exp(lse1) + exp(lse2)),
//!   out = exp(lse1 - lse) o1 + exp(lse2 - lse) o2, rounded once.
//!
//! The backward pass gives each part the merged output and log-sum-exp (as flash attention's
//! backward pass takes them): cuDNN's backward pass then yields each group's share of every
//! gradient and `block_attention_bwd` the own part's (its query gradient added into the context
//! part's in place).
//!
//! The node is libtorch's (autograd.cpp's `GroupedBlockAttention`); its kernel passes call back
//! into Rust here (`block_attention_callback`). The caller (src/model/drafter/groups.rs) uses it
//! where the kernels take the shapes ([`block_attention_takes`]).

use std::ffi::{c_char, c_int, c_void};

use anyhow::{anyhow, ensure, Result};
use tch::{Kind, Tensor};

use super::super::ffi;
use super::super::nvrtc::{arg, kind_index};
use super::autograd::{apply_node, borrowed, guarded_pass};
use super::FusedKernels;

/// The most rows a block the kernels take (their `BLOCK_ATTN_MAX`).
pub const BLOCK_ATTENTION_MAX_BLOCK: i64 = 16;

/// The shared memory a block of the kernels may use without opting in.
const SHARED_LIMIT: i64 = 48 * 1024;

/// Threads a block of the warp-cooperative form (the kernels' `BLOCK_ATTN_THREADS`).
const LANES_THREADS: i64 = 128;

/// The `lanes` value of the tensor-core form (the kernels' `BLOCK_ATTN_MMA`): a warp per query
/// head of a CUDA block.
const MMA_FORM: i64 = 32;

/// Padding of a key row and of a transposed row in the tensor-core form's shared memory (the
/// kernels' `BLOCK_ATTN_KPAD`, `BLOCK_ATTN_RPAD`).
const MMA_KEY_PAD: i64 = 32;
const MMA_ROW_PAD: i64 = 8;

/// The shape of one fused call: `entries` chunk entries of `rows` query rows (blocks of `bs`
/// rows), `heads` query heads over `kv` key/value heads of `d`; `lanes` the form: the lanes a
/// row of the warp-cooperative form (a 16-byte vector each: where a head is 8 or 16 of them),
/// [`MMA_FORM`] for the tensor-core form (bf16 or f16, blocks of 16 rows, heads of 64 or 128,
/// compute capability 8.0 on, where its shared memory fits), 0 for a thread a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CallShape {
    entries: i64,
    rows: i64,
    heads: i64,
    kv: i64,
    d: i64,
    bs: i64,
    lanes: i64,
}

impl CallShape {
    /// From the queries [E, rows, heads, d] and the blocks' keys [E, rows, kv, d], the blocks'
    /// anchors [E * rows / bs]; checks what the kernels need.
    fn of(q: &Tensor, kb: &Tensor, anchors: &Tensor) -> Result<CallShape> {
        let (entries, rows, heads, d) = q
            .size4()
            .map_err(|_| anyhow!("block attention: queries of shape {:?}", q.size()))?;
        let kv = match kb.size()[..] {
            [e, r, kv, dk] if e == entries && r == rows && dk == d => kv,
            _ => anyhow::bail!(
                "block attention: the blocks' keys {:?} for queries {:?}",
                kb.size(),
                q.size()
            ),
        };
        let blocks = anchors.numel() as i64;
        ensure!(
            blocks > 0 && (entries * rows) % blocks == 0,
            "block attention: {blocks} anchors for {entries} x {rows} rows"
        );
        let bs = entries * rows / blocks;
        let vec = 16 / q.kind().elt_size_in_bytes() as i64;
        let dense = [q, kb, anchors]
            .iter()
            .all(|t| (t.data_ptr() as usize).is_multiple_of(16));
        let lanes = match d / vec {
            l @ (8 | 16) if d % vec == 0 && dense => l,
            _ => 0,
        };
        let shape = CallShape {
            entries,
            rows,
            heads,
            kv,
            d,
            bs,
            lanes,
        };
        ensure!(
            kv > 0 && heads % kv == 0 && rows % bs == 0,
            "block attention: {heads} heads over {kv}, rows of {rows} in blocks of {bs}"
        );
        ensure!(
            bs <= BLOCK_ATTENTION_MAX_BLOCK && shape.block_rows() <= 1024 && d > 0,
            "block attention: blocks of {bs} rows, {} rows a CUDA block",
            shape.block_rows()
        );
        ensure!(
            shape.backward_shared() <= SHARED_LIMIT,
            "block attention: {} bytes of shared memory",
            shape.backward_shared()
        );
        Ok(shape)
    }

    /// The shape with the warp-cooperative and tensor-core forms kept only where `more` tensors
    /// also start on 16 bytes (their loads and stores are 16-byte vectors).
    fn vectors_if_aligned(mut self, more: &[&Tensor]) -> CallShape {
        if !more
            .iter()
            .all(|t| (t.data_ptr() as usize).is_multiple_of(16))
        {
            self.lanes = 0;
        }
        self
    }

    /// The shape in the tensor-core form where it applies to a 16-byte-vector shape of 2-byte
    /// elements on a device of compute capability `arch` (its mma.sync needs 8.0).
    fn on_tensor_cores(mut self, arch: i32, elt_bytes: usize) -> CallShape {
        let tc = CallShape {
            lanes: MMA_FORM,
            ..self
        };
        if self.lanes > 0
            && arch >= 80
            && elt_bytes == 2
            && self.bs == BLOCK_ATTENTION_MAX_BLOCK
            && self.d % 32 == 0
            && tc.threads() <= 1024
            && tc.backward_shared() <= SHARED_LIMIT
        {
            self = tc;
        }
        self
    }

    /// Query rows a CUDA block: the heads of a key/value head x a block's rows.
    fn block_rows(&self) -> i64 {
        self.heads / self.kv * self.bs
    }

    /// Threads a CUDA block: a row each, in the warp-cooperative form a fixed 128, in the
    /// tensor-core form a warp per query head.
    fn threads(&self) -> i64 {
        match self.lanes {
            MMA_FORM => self.heads / self.kv * 32,
            0 => self.block_rows(),
            _ => LANES_THREADS,
        }
    }

    /// The grid: a block per (anchor block, key/value head).
    fn grid(&self) -> (u32, u32) {
        ((self.entries * self.rows / self.bs) as u32, self.kv as u32)
    }

    /// Shared memory of the forward kernel: the block's keys and values in float32; in the
    /// tensor-core form as stored, the keys' rows padded and the values transposed.
    fn forward_shared(&self) -> i64 {
        match self.lanes {
            MMA_FORM => 2 * (self.bs * (self.d + MMA_KEY_PAD) + self.bs * self.d),
            _ => 2 * self.bs * self.d * 4,
        }
    }

    /// ... of the backward kernel: also each row's probabilities and score gradients; in the
    /// tensor-core form those transposed, then the keys and values (the keys also transposed)
    /// or, in the same space, the queries and output gradients transposed.
    fn backward_shared(&self) -> i64 {
        match self.lanes {
            MMA_FORM => {
                let width = self.block_rows() + MMA_ROW_PAD;
                let keys = self.bs * (self.d + MMA_KEY_PAD);
                2 * (2 * self.bs * width + (2 * keys + self.bs * self.d).max(2 * self.d * width))
            }
            _ => self.forward_shared() + 2 * self.block_rows() * BLOCK_ATTENTION_MAX_BLOCK * 4,
        }
    }
}

impl FusedKernels {
    /// Checks that `t` is a dense tensor of `kind` on this device with `numel` elements.
    fn check_len(&self, what: &str, t: &Tensor, kind: Kind, numel: i64) -> Result<()> {
        self.check(what, t, kind)?;
        ensure!(
            t.numel() as i64 == numel,
            "block attention: {what} has {} elements, not {numel}",
            t.numel()
        );
        Ok(())
    }

    /// Checks the tensors of a call of `shape`: the queries, the blocks' keys and values, the
    /// anchors and the log-sum-exp (`[q, kb, vb, anchors, lse]`), and `like_q`, dense tensors of
    /// the queries' type and size. Returns the kernels' index of that type.
    fn check_call(
        &self,
        shape: &CallShape,
        [q, kb, vb, anchors, lse]: [&Tensor; 5],
        like_q: &[(&str, &Tensor)],
    ) -> Result<usize> {
        let kind = q.kind();
        let which =
            kind_index(kind).ok_or_else(|| anyhow!("block attention: no kernel for {kind:?}"))?;
        self.check("the queries", q, kind)?;
        self.check("the blocks' keys", kb, kind)?;
        self.check_len("the blocks' values", vb, kind, kb.numel() as i64)?;
        for &(what, t) in like_q {
            self.check_len(what, t, kind, q.numel() as i64)?;
        }
        let CallShape {
            entries,
            rows,
            heads,
            bs,
            ..
        } = *shape;
        self.check_len("the log-sum-exp", lse, Kind::Float, entries * heads * rows)?;
        self.check_len("the anchors", anchors, Kind::Int64, entries * rows / bs)?;
        Ok(which)
    }

    /// The own-block part of the forward pass and the merge with the context part's output `o1`
    /// [E, rows, heads, d] and log-sum-exp `lse1` (E * heads * rows floats, [E, heads, rows]
    /// order): the merged output [E, rows, heads, d] and log-sum-exp (lse1's shape). `q`
    /// [E, rows, heads, d], `kb`, `vb` [E, rows, kv, d], `anchors` (int64) each block's anchor
    /// (0: the block sees no context, and o1, lse1 of its rows are not read). All dense, on this
    /// device; q, kb, vb, o1 of one storage type.
    pub fn block_attention_forward(
        &self,
        q: &Tensor,
        kb: &Tensor,
        vb: &Tensor,
        anchors: &Tensor,
        o1: &Tensor,
        lse1: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let shape = CallShape::of(q, kb, anchors)?
            .vectors_if_aligned(&[vb, o1])
            .on_tensor_cores(
                self.module.compute_capability(),
                q.kind().elt_size_in_bytes(),
            );
        let which = self.check_call(
            &shape,
            [q, kb, vb, anchors, lse1],
            &[("the context part", o1)],
        )?;
        let CallShape { rows, heads, .. } = shape;
        let out = q.empty_like();
        let lse = lse1.empty_like();
        let (mut qp, mut kp, mut vp, mut op, mut lp, mut ap, mut outp, mut lsep) = (
            q.data_ptr(),
            kb.data_ptr(),
            vb.data_ptr(),
            o1.data_ptr(),
            lse1.data_ptr(),
            anchors.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
        );
        let [mut h, mut kv, mut d, mut bs, mut r] =
            [heads, shape.kv, shape.d, shape.bs, rows].map(|v| v as c_int);
        let mut scale = (1.0 / (shape.d as f64).sqrt()) as f32;
        let mut lanes = shape.lanes as c_int;
        let (gx, gy) = shape.grid();
        self.module.launch_with_shared(
            self.block_attention_fwd[which],
            (gx, gy, 1),
            shape.threads() as u32,
            shape.forward_shared() as u32,
            &mut [
                arg(&mut qp),
                arg(&mut kp),
                arg(&mut vp),
                arg(&mut op),
                arg(&mut lp),
                arg(&mut ap),
                arg(&mut outp),
                arg(&mut lsep),
                arg(&mut h),
                arg(&mut kv),
                arg(&mut d),
                arg(&mut bs),
                arg(&mut r),
                arg(&mut scale),
                arg(&mut lanes),
            ],
        )?;
        Ok((out, lse))
    }

    /// The own-block part of the backward pass, given the merged output `out` and log-sum-exp
    /// `lse` and the output's gradient `dout` ([E, rows, heads, d], dense): the own part's query
    /// gradient is added into `dq` (the context part's, [E, rows, heads, d], dense) in place;
    /// returns the gradients of kb and vb. Shapes as [`FusedKernels::block_attention_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn block_attention_backward(
        &self,
        q: &Tensor,
        kb: &Tensor,
        vb: &Tensor,
        anchors: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        dq: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let shape = CallShape::of(q, kb, anchors)?
            .vectors_if_aligned(&[vb, out, dout, dq])
            .on_tensor_cores(
                self.module.compute_capability(),
                q.kind().elt_size_in_bytes(),
            );
        let which = self.check_call(
            &shape,
            [q, kb, vb, anchors, lse],
            &[("the output", out), ("its gradient", dout), ("dq", dq)],
        )?;
        let CallShape { rows, heads, .. } = shape;
        let dkb = kb.empty_like();
        let dvb = vb.empty_like();
        let (mut qp, mut kp, mut vp, mut op, mut gp, mut lp, mut ap) = (
            q.data_ptr(),
            kb.data_ptr(),
            vb.data_ptr(),
            out.data_ptr(),
            dout.data_ptr(),
            lse.data_ptr(),
            anchors.data_ptr(),
        );
        let (mut dqp, mut dkp, mut dvp) = (dq.data_ptr(), dkb.data_ptr(), dvb.data_ptr());
        let [mut h, mut kv, mut d, mut bs, mut r] =
            [heads, shape.kv, shape.d, shape.bs, rows].map(|v| v as c_int);
        let mut scale = (1.0 / (shape.d as f64).sqrt()) as f32;
        let mut lanes = shape.lanes as c_int;
        let (gx, gy) = shape.grid();
        self.module.launch_with_shared(
            self.block_attention_bwd[which],
            (gx, gy, 1),
            shape.threads() as u32,
            shape.backward_shared() as u32,
            &mut [
                arg(&mut qp),
                arg(&mut kp),
                arg(&mut vp),
                arg(&mut op),
                arg(&mut gp),
                arg(&mut lp),
                arg(&mut ap),
                arg(&mut dqp),
                arg(&mut dkp),
                arg(&mut dvp),
                arg(&mut h),
                arg(&mut kv),
                arg(&mut d),
                arg(&mut bs),
                arg(&mut r),
                arg(&mut scale),
                arg(&mut lanes),
            ],
        )?;
        Ok((dkb, dvb))
    }
}

/// Whether the kernels take blocks of `bs` rows with `heads` query heads over `kv` key/value
/// heads of `d` (the checks of the call's shape, before any tensor exists).
pub fn block_attention_takes(heads: i64, kv: i64, d: i64, bs: i64) -> bool {
    let shape = CallShape {
        entries: 1,
        rows: bs,
        heads,
        kv,
        d,
        bs,
        lanes: 0,
    };
    bs > 0
        && d > 0
        && kv > 0
        && heads % kv == 0
        && bs <= BLOCK_ATTENTION_MAX_BLOCK
        && shape.block_rows() <= 1024
        && shape.backward_shared() <= SHARED_LIMIT
}

/// One group of [`grouped_block_attention_autograd`]: `rows` query rows from `first_row` on,
/// of the blocks of sequence `seq`, against its first `mask.size()[3]` context positions.
pub struct BlockGroup<'a> {
    pub seq: i64,
    pub first_row: i64,
    pub rows: i64,
    /// Additive mask [1, 1, rows, context] of the compute kind (0 or -inf; every row of a
    /// block anchored at 0 all -inf).
    pub mask: &'a Tensor,
}

/// One layer of the drafter's block attention as one autograd node, in groups of consecutive
/// blocks of one sequence: queries `q` [T, heads, d] (dense, token-major) over their sequence's
/// context keys and values `ck`, `cv` [B, S, kv, d] (token-major, each position dense) under
/// each group's mask, read in place (no copies), and over their blocks' own keys and values
/// `kb`, `vb` [T, kv, d] (dense), merged by their log-sum-exp; `anchors` [T / bs] (int64) each
/// block's anchor. Returns [T, heads, d]. On `kernels`' device in bf16 or f16 (cuDNN's fused
/// attention); an error where the kernels do not take the shapes.
#[allow(clippy::too_many_arguments)]
pub fn grouped_block_attention_autograd(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (kb, vb): (&Tensor, &Tensor),
    anchors: &Tensor,
    groups: &[BlockGroup],
    bs: i64,
    kernels: &FusedKernels,
) -> Result<Tensor> {
    ensure!(
        matches!(q.kind(), Kind::BFloat16 | Kind::Half) && q.device() == kernels.device(),
        "block attention: {:?} queries on {:?}",
        q.kind(),
        q.device()
    );
    ensure!(!groups.is_empty(), "block attention: no group");
    let (t, _, d) = q
        .size3()
        .map_err(|_| anyhow!("block attention: queries of shape {:?}", q.size()))?;
    let (b, s, kv, dc) = ck
        .size4()
        .map_err(|_| anyhow!("block attention: context keys of shape {:?}", ck.size()))?;
    ensure!(
        dc == d
            && cv.size() == ck.size()
            && ck.stride()[1..] == [kv * d, d, 1]
            && cv.stride()[1..] == [kv * d, d, 1]
            && kb.size() == [t, kv, d]
            && vb.size() == kb.size()
            && anchors.size() == [t / bs.max(1)]
            && q.is_contiguous()
            && kb.is_contiguous()
            && vb.is_contiguous()
            && anchors.is_contiguous(),
        "block attention: queries {:?}, context keys {:?} (strides {:?}), values {:?}, own keys {:?}, values {:?}, anchors {:?}",
        q.size(),
        ck.size(),
        ck.stride(),
        cv.size(),
        kb.size(),
        vb.size(),
        anchors.size()
    );
    let mut next = 0;
    for g in groups {
        ensure!(
            g.first_row == next
                && g.rows > 0
                && g.rows % bs == 0
                && (0..b).contains(&g.seq)
                && g.mask.size()[..] == [1, 1, g.rows, g.mask.size()[3]]
                && g.mask.size()[3] <= s,
            "block attention: a group of {} rows from row {} of sequence {} with a mask {:?} (rows {next}.. of {t} expected, blocks of {bs}, contexts of at most {s})",
            g.rows,
            g.first_row,
            g.seq,
            g.mask.size()
        );
        next += g.rows;
    }
    ensure!(
        next == t,
        "block attention: the groups cover {next} of {t} rows"
    );
    let masks: Vec<*const c_void> = groups.iter().map(|g| g.mask.as_ptr().cast()).collect();
    let triples: Vec<i64> = groups
        .iter()
        .flat_map(|g| [g.seq, g.first_row, g.rows])
        .collect();
    apply_node("block attention", Some(kernels), |state, len, out| {
        // SAFETY: live tensors and vectors (see apply_node)
        unsafe {
            ffi::dflash_grouped_block_attention_autograd(
                q.as_ptr().cast(),
                ck.as_ptr().cast(),
                cv.as_ptr().cast(),
                kb.as_ptr().cast(),
                vb.as_ptr().cast(),
                anchors.as_ptr().cast(),
                masks.as_ptr(),
                triples.as_ptr(),
                groups.len(),
                bs,
                block_attention_callback,
                state,
                len,
                out,
            )
        }
    })
}

/// The node's kernel passes (autograd.cpp's `dflash_block_attention_fn`): forward (`dout`
/// null) `[out, lse]`, backward `[dkb, dvb]` with the own part's query gradient added into
/// `dq`.
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn block_attention_callback(
    state: *const c_void,
    q: *const c_void,
    kb: *const c_void,
    vb: *const c_void,
    anchors: *const c_void,
    o: *const c_void,
    lse: *const c_void,
    dout: *const c_void,
    dq: *mut c_void,
    out0: *mut *mut c_void,
    out1: *mut *mut c_void,
    msg: *mut c_char,
    msg_len: usize,
) -> c_int {
    guarded_pass(&[out0, out1], (msg, msg_len), || {
        // SAFETY: `state` holds the bytes of an Option<FusedKernels> (apply_node); the tensors
        // are live `at::Tensor`s, shallow-copied here (dq shares its storage: the kernel adds
        // into it in place).
        let kernels: Option<FusedKernels> = std::ptr::read_unaligned(state.cast());
        let Some(k) = kernels else {
            panic!("block attention: the node has no kernels");
        };
        let (q, kb, vb, anchors, o, lse) = (
            borrowed(q),
            borrowed(kb),
            borrowed(vb),
            borrowed(anchors),
            borrowed(o),
            borrowed(lse),
        );
        let done = if dout.is_null() {
            k.block_attention_forward(&q, &kb, &vb, &anchors, &o, &lse)
        } else {
            let (dout, dq) = (borrowed(dout), borrowed(dq.cast_const()));
            k.block_attention_backward(&q, &kb, &vb, &anchors, &o, &lse, &dout, &dq)
        };
        match done {
            Ok((a, b)) => vec![a, b],
            Err(e) => panic!("{e:#}"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// The launch geometry at the 8B shape (32 query heads over 8, heads of 128, blocks of 16):
    /// 64 rows a block, in the warp-cooperative form (16 lanes a row) 128 threads, 16 KB of
    /// shared memory forward and 24 KB backward, in the tensor-core form where it applies a
    /// warp per head; heads of 96 take a thread a row; shapes the kernels do not take are
    /// refused.
    #[test]
    fn the_call_shape_is_checked_and_sized() {
        let q = Tensor::zeros([8, 512, 32, 128], (Kind::BFloat16, Device::Cpu));
        let kb = Tensor::zeros([8, 512, 8, 128], (Kind::BFloat16, Device::Cpu));
        let anchors = Tensor::zeros([8 * 32], (Kind::Int64, Device::Cpu));
        let shape = CallShape::of(&q, &kb, &anchors).unwrap();
        assert_eq!(shape.bs, 16);
        assert_eq!(
            (shape.lanes, shape.block_rows(), shape.threads()),
            (16, 64, 128)
        );
        let q96 = Tensor::zeros([8, 512, 32, 96], (Kind::BFloat16, Device::Cpu));
        let kb96 = Tensor::zeros([8, 512, 8, 96], (Kind::BFloat16, Device::Cpu));
        let shape96 = CallShape::of(&q96, &kb96, &anchors).unwrap();
        assert_eq!((shape96.lanes, shape96.threads()), (0, 64));
        assert_eq!(shape.grid(), (256, 8));
        assert_eq!(shape.forward_shared(), 16 * 1024);
        assert_eq!(shape.backward_shared(), 24 * 1024);
        // the tensor-core form on compute capability 8.0 on, for 2-byte elements: a warp per
        // query head; 5 KB of padded keys + 4 KB of transposed values forward; backward 2 x 2.25
        // KB of transposed probabilities and score gradients + 2 x 18 KB of transposed queries
        // and output gradients (more than the 14 KB of keys and values)
        let tc = shape.on_tensor_cores(90, 2);
        assert_eq!((tc.lanes, tc.threads()), (MMA_FORM, 128));
        assert_eq!(tc.forward_shared(), 2 * (16 * 160 + 16 * 128));
        assert_eq!(tc.backward_shared(), 2 * (2 * 16 * 72 + 2 * 128 * 72));
        assert!(tc.backward_shared() <= SHARED_LIMIT);
        // not before 8.0, not for float32, not without 16-byte vectors, not for blocks of 8
        assert_eq!(shape.on_tensor_cores(75, 2).lanes, 16);
        assert_eq!(shape.on_tensor_cores(90, 4).lanes, 16);
        assert_eq!(shape96.on_tensor_cores(90, 2).lanes, 0);
        let a8 = Tensor::zeros([8 * 64], (Kind::Int64, Device::Cpu));
        let shape8 = CallShape::of(&q, &kb, &a8).unwrap();
        assert_eq!((shape8.bs, shape8.on_tensor_cores(90, 2).lanes), (8, 16));
        // 64 query heads over 8 (g = 8): the transposed rows need 72 KB, so the warp form stays
        let q64 = Tensor::zeros([8, 512, 64, 128], (Kind::BFloat16, Device::Cpu));
        let shape64 = CallShape::of(&q64, &kb, &anchors).unwrap();
        assert_eq!(shape64.on_tensor_cores(90, 2).lanes, 16);
        // blocks of 32 rows: more than the kernels hold
        let wide = Tensor::zeros([8 * 16], (Kind::Int64, Device::Cpu));
        assert!(CallShape::of(&q, &kb, &wide).is_err());
        // 32 heads over 5 key/value heads
        let kb5 = Tensor::zeros([8, 512, 5, 128], (Kind::BFloat16, Device::Cpu));
        assert!(CallShape::of(&q, &kb5, &anchors).is_err());
        // heads of 512 with 8 query heads a key/value head: 64 KB of keys and values
        let q512 = Tensor::zeros([1, 64, 8, 512], (Kind::BFloat16, Device::Cpu));
        let kb512 = Tensor::zeros([1, 64, 1, 512], (Kind::BFloat16, Device::Cpu));
        let a4 = Tensor::zeros([4], (Kind::Int64, Device::Cpu));
        assert!(CallShape::of(&q512, &kb512, &a4).is_err());
    }
}
