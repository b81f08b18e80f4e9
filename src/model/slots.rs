//! A key/value cache of fixed shape for decoding: `slots` sequences of at most `capacity`
//! positions each, per layer one key and one value tensor [slots * capacity, kv_heads,
//! head_dim] allocated once (the layout the flash kernel's variable-length mode reads). New
//! tokens are written to their rows with `index_copy_`; rolling back is forgetting rows (the
//! caller's length), which the next step overwrites. Because no shape depends on a sequence's
//! length, a decoding step is the same kernels every time and can be captured as a CUDA graph
//! (see [`crate::model::decode`]).
//!
//! Which tokens a forward adds, and what they see, is a [`SlotBatch`].

use std::cell::RefCell;

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use super::layers::RopeTable;
use super::slot_states::SlotStates;
use crate::aten_ext::fused::FusedKernels;
use crate::aten_ext::{flash_varlen, VarlenLengths};

/// How attention over the cache is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotAttention {
    /// The flash kernel's variable-length mode: reads only each sequence's own rows (bf16 or
    /// f16 on a GPU, head size a multiple of 8 up to 256).
    Flash,
    /// `scaled_dot_product_attention` over every row of a slot with a mask (any device and
    /// dtype; cost grows with the capacity, not the length).
    Dense,
}

impl SlotAttention {
    /// Flash where the kernel takes the shapes, else dense.
    pub(crate) fn for_model(device: Device, kind: Kind, heads: i64, kv_heads: i64, d: i64) -> Self {
        let half = matches!(kind, Kind::BFloat16 | Kind::Half);
        let heads_ok = kv_heads > 0 && heads % kv_heads == 0;
        if device.is_cuda() && half && d % 8 == 0 && d <= 256 && heads_ok {
            SlotAttention::Flash
        } else {
            SlotAttention::Dense
        }
    }
}

/// The cache.
#[derive(Debug)]
pub struct SlotCache {
    /// Every layer's keys and values, [layers, slots * capacity, kv_heads, head_dim]: one
    /// write can fill a row of all layers ([`SlotCache::write_all_layers`]).
    all_keys: Tensor,
    all_values: Tensor,
    /// Per layer, views of the above.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    pub slots: i64,
    pub capacity: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub attention: SlotAttention,
    pub device: Device,
    /// The model's rotary table for positions `0..capacity` (see [`SlotCache::with_rope`]).
    pub rope: Option<RopeTable>,
    /// Fused kernels for the norm, rotation and cache writes of a forward over this cache
    /// (flash attention on the kernels' device only; see [`SlotCache::with_kernels`]).
    kernels: Option<FusedKernels>,
    /// The parts of uniform batches that depend only on their shape, by (sequences, tokens
    /// each): made once, before any graph capture, and reused.
    uniform: RefCell<Vec<((i64, i64), UniformConstants)>>,
    /// Per layer, a sliding window (see [`SlotCache::with_windows`]); empty: none.
    windows: Vec<Option<i64>>,
    /// A hybrid target's Gated DeltaNet states (see [`SlotCache::with_states`]).
    states: Option<SlotStates>,
}

/// See [`SlotCache::uniform_constants`].
#[derive(Debug)]
struct UniformConstants {
    offsets: Tensor,
    slot_base: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    last: Tensor,
}

impl SlotCache {
    /// Uses `table` (from the model, covering the capacity) for the rotary angles.
    pub(crate) fn with_rope(mut self, table: RopeTable) -> Self {
        self.rope = Some(table);
        self
    }
    /// A zeroed cache for `layers` layers.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layers: usize,
        slots: i64,
        capacity: i64,
        kv_heads: i64,
        head_dim: i64,
        kind: Kind,
        device: Device,
        attention: SlotAttention,
    ) -> Result<Self> {
        if slots < 1 || capacity < 1 {
            bail!("a cache needs at least one slot and one position ({slots} x {capacity})");
        }
        let rows = slots * capacity;
        let shape = [layers as i64, rows, kv_heads, head_dim];
        let all_keys = Tensor::f_zeros(shape, (kind, device))?;
        let all_values = Tensor::f_zeros(shape, (kind, device))?;
        let per_layer = |all: &Tensor| (0..layers as i64).map(|l| all.select(0, l)).collect();
        Ok(SlotCache {
            keys: per_layer(&all_keys),
            values: per_layer(&all_values),
            all_keys,
            all_values,
            slots,
            capacity,
            kv_heads,
            head_dim,
            attention,
            device,
            rope: None,
            kernels: None,
            uniform: RefCell::new(Vec::new()),
            windows: Vec::new(),
            states: None,
        })
    }

    /// Holds a hybrid target's Gated DeltaNet states beside the keys and values (whose layers
    /// are then the attention layers only, in order).
    pub(crate) fn with_states(mut self, states: SlotStates) -> Self {
        self.states = Some(states);
        self
    }

    /// The Gated DeltaNet states (a hybrid target's cache).
    pub fn states(&self) -> Option<&SlotStates> {
        self.states.as_ref()
    }

    pub(crate) fn states_mut(&mut self) -> Option<&mut SlotStates> {
        self.states.as_mut()
    }

    /// Runs `work` on this cache, then puts a hybrid target's Gated DeltaNet states back as
    /// they were before it (other caches: just runs it). For a CUDA graph capture of a step:
    /// each eager warm-up run before it advances the states by the step's tokens once more
    /// (keys and values are only rewritten in place), and the replay must start where the
    /// step does.
    pub(crate) fn keeping_states<T>(&mut self, work: impl FnOnce(&mut Self) -> T) -> Result<T> {
        let saved = self.states.as_ref().map(SlotStates::save).transpose()?;
        let out = work(self);
        if let (Some(saved), Some(states)) = (&saved, &self.states) {
            states.restore(saved);
        }
        Ok(out)
    }

    /// Gives layer i the sliding window `windows[i]` (`None`: none): the new tokens of such a
    /// layer see, causally, only the keys of the last w positions up to their own (p - w < k
    /// <= p), whatever `causal` their forward asks for. A DFlash drafter's sliding layers.
    pub(crate) fn with_windows(mut self, windows: Vec<Option<i64>>) -> Self {
        self.windows = windows;
        self
    }

    /// The window of `layer` and whether its attention is causal.
    fn mask_of(&self, layer: usize, causal: bool) -> (Option<i64>, bool) {
        match self.windows.get(layer).copied().flatten() {
            Some(w) => (Some(w), true),
            None => (None, causal),
        }
    }

    /// The shape-only parts of a uniform batch of `b` sequences of `per_seq` tokens (made on
    /// first use).
    fn uniform_constants(&self, b: i64, per_seq: i64) -> UniformConstants {
        let mut known = self.uniform.borrow_mut();
        if let Some((_, c)) = known.iter().find(|(k, _)| *k == (b, per_seq)) {
            return c.clone();
        }
        let dev = self.device;
        let seq_index = Tensor::arange(b + 1, (Kind::Int64, dev));
        let c = UniformConstants {
            offsets: Tensor::arange(per_seq, (Kind::Int64, dev)),
            slot_base: (Tensor::arange(b, (Kind::Int64, dev)) * self.capacity).unsqueeze(1),
            cu_q: (&seq_index * per_seq).to_kind(Kind::Int),
            cu_k: (&seq_index * self.capacity).to_kind(Kind::Int),
            last: Tensor::arange(b, (Kind::Int64, dev)) * per_seq + (per_seq - 1),
        };
        known.push(((b, per_seq), c.clone()));
        c
    }

    /// Bytes a cache of this shape takes.
    pub fn bytes(
        layers: usize,
        slots: i64,
        capacity: i64,
        kv_heads: i64,
        d: i64,
        kind: Kind,
    ) -> i64 {
        2 * layers as i64 * slots * capacity * kv_heads * d * kind.elt_size_in_bytes() as i64
    }

    /// Writes the new keys and values `k`, `v` [1, kv_heads, n, d] of `layer` to the batch's
    /// rows and returns the attention output [1, heads, n, d] of the queries `q`
    /// [1, heads, n, d] over the cache (`causal`: bottom-right aligned, new tokens see the
    /// cache and the new tokens before them; else every used row of their sequence).
    pub fn attend(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        batch: &SlotBatch,
        causal: bool,
    ) -> Result<Tensor> {
        self.write(layer, k, v, &batch.rows);
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        let mask = self.mask_of(layer, causal);
        match (self.attention, &batch.geometry) {
            (SlotAttention::Flash, _) => {
                // [1, heads, n, d] -> [n, heads, d] (a strided view: the kernel needs only the
                // last dimension dense)
                let rows_q = q.squeeze_dim(0).transpose(0, 1);
                self.flash(layer, &rows_q, batch, causal)
            }
            (SlotAttention::Dense, Geometry::Uniform { batch: b, per_seq }) => {
                Ok(self.dense_uniform(keys, values, q, batch, (*b, *per_seq), mask))
            }
            (SlotAttention::Dense, Geometry::Packed(seqs)) => {
                Ok(self.dense_packed(keys, values, q, seqs, mask))
            }
        }
    }

    /// The flash attention [1, heads, n, d] of the queries `rows_q` [n, heads, d] (last
    /// dimension dense) over the cache rows of `layer` the batch sees, its keys and values
    /// already written.
    fn flash(
        &self,
        layer: usize,
        rows_q: &Tensor,
        batch: &SlotBatch,
        causal: bool,
    ) -> Result<Tensor> {
        let lengths = VarlenLengths {
            cu_q: &batch.cu_q,
            cu_k: &batch.cu_k,
            seqused_k: &batch.seq_used,
            max_q: batch.max_q,
            max_k: self.capacity,
        };
        // the kernel's window is bottom-right aligned as the cache rows are: a new token at
        // position p sees keys p - left ..= p
        let (window, causal) = self.mask_of(layer, causal);
        let out = flash_varlen(
            rows_q,
            &self.keys[layer],
            &self.values[layer],
            &lengths,
            causal,
            window.map(|w| w - 1),
        )?;
        Ok(out.transpose(0, 1).unsqueeze(0))
    }

    /// Uses `kernels` for the norm, rotation and cache writes of the forwards over this cache
    /// where they apply: flash attention (half-precision caches on a GPU) on the kernels'
    /// device. Elsewhere the cache keeps libtorch's operations.
    /// A hybrid target's cache (with Gated DeltaNet states) takes none: they assume the plain
    /// attention layout (no output gate, whole-head rotary).
    pub fn with_kernels(mut self, kernels: Option<FusedKernels>) -> Self {
        self.kernels = kernels.filter(|k| {
            self.attention == SlotAttention::Flash
                && self.device == k.device()
                && self.states.is_none()
        });
        self
    }

    /// The fused kernels forwards over this cache use, if any.
    pub(crate) fn kernels(&self) -> Option<&FusedKernels> {
        self.kernels.as_ref()
    }

    /// With the fused kernels: normalises and rotates the queries and keys of `y` [1, n,
    /// (heads + 2 * kv_heads) * d] (the fused q/k/v projection of `layer`'s n new tokens, dense),
    /// writes keys and values to the batch's rows, and returns the attention output [1, heads,
    /// n, d] over the cache (see [`FusedKernels::rotate_write`] for the other arguments).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend_projected(
        &mut self,
        layer: usize,
        y: &Tensor,
        heads: i64,
        norms: (Option<&Tensor>, Option<&Tensor>),
        eps: f64,
        (cos, sin): (&Tensor, &Tensor),
        batch: &SlotBatch,
        causal: bool,
    ) -> Result<Tensor> {
        let Some(kernels) = self.kernels else {
            bail!("this cache has no fused kernels");
        };
        let q = kernels.rotate_write(
            y,
            1,
            heads,
            norms.0,
            norms.1,
            eps,
            cos,
            sin,
            &batch.rows,
            &self.keys[layer],
            &self.values[layer],
        )?;
        let Some(q) = q else {
            bail!("an attention layer without queries");
        };
        self.flash(layer, &q.squeeze_dim(1), batch, causal)
    }

    /// With the fused kernels: the keys of every layer in `kv` [n, layers, 2, kv_heads, d]
    /// (keys, then values, per layer; dense) normalised by `k_norm` [layers, 1, d] and rotated,
    /// written with the values to every layer's cache rows `rows`.
    pub(crate) fn write_all_layers_projected(
        &mut self,
        kv: &Tensor,
        k_norm: &Tensor,
        eps: f64,
        (cos, sin): (&Tensor, &Tensor),
        rows: &Tensor,
    ) -> Result<()> {
        let Some(kernels) = self.kernels else {
            bail!("this cache has no fused kernels");
        };
        let layers = self.all_keys.size()[0];
        kernels.rotate_write(
            kv,
            layers,
            0,
            None,
            Some(k_norm),
            eps,
            cos,
            sin,
            rows,
            &self.all_keys,
            &self.all_values,
        )?;
        Ok(())
    }

    /// Writes keys and values [1, kv_heads, n, d] to the rows `rows` [n] (no attention): the
    /// drafter's context, which only ever serves as keys.
    pub fn write(&mut self, layer: usize, k: &Tensor, v: &Tensor, rows: &Tensor) {
        let as_rows = |t: &Tensor| t.squeeze_dim(0).transpose(0, 1);
        let _ = self.keys[layer].index_copy_(0, rows, &as_rows(k));
        let _ = self.values[layer].index_copy_(0, rows, &as_rows(v));
    }

    /// Writes the keys and values `k`, `v` [n, layers, kv_heads, d] of every layer to the rows
    /// `rows` [n] at once (the drafter's context: the same rows in every layer).
    pub(crate) fn write_all_layers(&mut self, k: &Tensor, v: &Tensor, rows: &Tensor) {
        let _ = self.all_keys.index_copy_(1, rows, &k.transpose(0, 1));
        let _ = self.all_values.index_copy_(1, rows, &v.transpose(0, 1));
    }

    /// A slot's rows as [batch, kv_heads, capacity, d] for the first `batch` slots.
    fn slot_view(&self, t: &Tensor, batch: i64) -> Tensor {
        t.view([self.slots, self.capacity, self.kv_heads, self.head_dim])
            .narrow(0, 0, batch)
            .permute([0, 2, 1, 3])
    }

    /// `mask`: the layer's window and whether it is causal ([`SlotCache::mask_of`]).
    fn dense_uniform(
        &self,
        keys: &Tensor,
        values: &Tensor,
        q: &Tensor,
        batch: &SlotBatch,
        (b, per_seq): (i64, i64),
        (window, causal): (Option<i64>, bool),
    ) -> Tensor {
        let heads = q.size()[1];
        let d = self.head_dim;
        // [1, heads, b*q, d] -> [b, heads, q, d]
        let qq = q.reshape([heads, b, per_seq, d]).permute([1, 0, 2, 3]);
        let k_pos = Tensor::arange(self.capacity, (Kind::Int64, self.device)).view([1, 1, -1]);
        let start = batch.start.view([b, 1, 1]);
        let q_pos = &start + Tensor::arange(per_seq, (Kind::Int64, self.device)).view([1, -1, 1]);
        let visible = if causal {
            k_pos.le_tensor(&q_pos)
        } else {
            k_pos.lt_tensor(&(start + per_seq))
        };
        let visible = match window {
            Some(w) => visible.logical_and(&k_pos.gt_tensor(&(q_pos - w))),
            None => visible,
        };
        let mask = visible.unsqueeze(1); // [b, 1, q or 1, capacity]
        let out = Tensor::scaled_dot_product_attention(
            &qq,
            &self.slot_view(keys, b),
            &self.slot_view(values, b),
            Some(&mask),
            0.0,
            false,
            None,
            heads != self.kv_heads,
        ); // [b, heads, q, d]
        out.permute([1, 0, 2, 3])
            .reshape([1, heads, b * per_seq, d])
    }

    fn dense_packed(
        &self,
        keys: &Tensor,
        values: &Tensor,
        q: &Tensor,
        seqs: &[SeqSpan],
        (window, causal): (Option<i64>, bool),
    ) -> Tensor {
        let heads = q.size()[1];
        let mut outs = Vec::with_capacity(seqs.len());
        let mut offset = 0;
        for s in seqs {
            let used = s.start + s.len;
            let first = s.slot * self.capacity;
            let kv = |t: &Tensor| t.narrow(0, first, used).permute([1, 0, 2]).unsqueeze(0);
            let qs = q.narrow(2, offset, s.len);
            let mask = causal.then(|| {
                let k_pos = Tensor::arange(used, (Kind::Int64, self.device)).view([1, -1]);
                let q_pos =
                    Tensor::arange_start(s.start, used, (Kind::Int64, self.device)).view([-1, 1]);
                let visible = k_pos.le_tensor(&q_pos);
                match window {
                    Some(w) => visible.logical_and(&k_pos.gt_tensor(&(q_pos - w))),
                    None => visible,
                }
            });
            outs.push(Tensor::scaled_dot_product_attention(
                &qs,
                &kv(keys),
                &kv(values),
                mask.as_ref(),
                0.0,
                false,
                None,
                heads != self.kv_heads,
            ));
            offset += s.len;
        }
        Tensor::cat(&outs, 2)
    }
}

/// One sequence of a packed batch: `len` new tokens written to slot `slot` from position
/// `start` on (its rows before `start` hold its earlier tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    pub slot: i64,
    pub start: i64,
    pub len: i64,
}

#[derive(Debug)]
enum Geometry {
    /// Slots 0..batch, each with `per_seq` new tokens (decoding steps).
    Uniform { batch: i64, per_seq: i64 },
    /// Any slots, any numbers of new tokens (prefills), known on the host.
    Packed(Vec<SeqSpan>),
}

/// Which tokens a forward adds to a [`SlotCache`], all as device tensors.
#[derive(Debug)]
pub struct SlotBatch {
    /// [n] rotary positions of the new tokens (their position in their sequence).
    pub positions: Tensor,
    /// [n] flat cache rows of the new tokens.
    pub rows: Tensor,
    /// [sequences] position of each sequence's first new token.
    pub start: Tensor,
    /// [sequences + 1] int32: query offsets.
    pub cu_q: Tensor,
    /// [sequences + 1] int32: the first cache row of each sequence's slot.
    pub cu_k: Tensor,
    /// [sequences] int32: keys of each sequence after this forward.
    pub seq_used: Tensor,
    /// [sequences] indices (into the n new tokens) of each sequence's last new token.
    pub last: Tensor,
    pub max_q: i64,
    /// [sequences] bool: the sequences whose recurrent states this forward advances (None:
    /// all); the idle slots of a decoding batch keep theirs. Attention layers ignore it.
    pub live: Option<Tensor>,
    geometry: Geometry,
}

impl SlotBatch {
    /// Slots 0..b with `per_seq` new tokens each, the first at position `start[s]` (int64 [b]
    /// on the cache's device). Made of tensor operations only: under a CUDA graph capture,
    /// replays follow new values written into `start`.
    pub fn uniform(cache: &SlotCache, start: &Tensor, per_seq: i64) -> Self {
        let b = start.size()[0];
        let c = cache.uniform_constants(b, per_seq);
        let positions = (start.unsqueeze(1) + &c.offsets).view([-1]);
        let rows = (&c.slot_base + &positions.view([b, per_seq])).view([-1]);
        SlotBatch {
            positions,
            rows,
            start: start.shallow_clone(),
            cu_q: c.cu_q,
            cu_k: c.cu_k,
            seq_used: (start + per_seq).to_kind(Kind::Int),
            last: c.last,
            max_q: per_seq,
            live: None,
            geometry: Geometry::Uniform { batch: b, per_seq },
        }
    }

    /// Sequences in any slots with any numbers of new tokens, known on the host (prefills;
    /// never captured). Fails where a sequence would not fit its slot.
    pub fn packed(cache: &SlotCache, seqs: &[SeqSpan]) -> Result<Self> {
        if seqs.is_empty() {
            bail!("a packed batch needs at least one sequence");
        }
        let (mut positions, mut rows, mut cu_q, mut cu_k, mut used, mut last, mut start) =
            (vec![], vec![], vec![0i32], vec![], vec![], vec![], vec![]);
        let mut n = 0i64;
        for s in seqs {
            if s.len < 1 || s.start < 0 || s.start + s.len > cache.capacity || s.slot >= cache.slots
            {
                bail!(
                    "{} new tokens from position {} do not fit slot {} of a cache of {} x {}",
                    s.len,
                    s.start,
                    s.slot,
                    cache.slots,
                    cache.capacity
                );
            }
            for i in 0..s.len {
                positions.push(s.start + i);
                rows.push(s.slot * cache.capacity + s.start + i);
            }
            n += s.len;
            cu_q.push(n as i32);
            cu_k.push((s.slot * cache.capacity) as i32);
            used.push((s.start + s.len) as i32);
            last.push(n - 1);
            start.push(s.start);
        }
        // The kernel reads cu_k[b] as sequence b's first row; the last entry is unused.
        cu_k.push((cache.slots * cache.capacity) as i32);
        let dev = cache.device;
        let up = |v: &[i64]| Tensor::from_slice(v).to_device(dev);
        let up32 = |v: &[i32]| Tensor::from_slice(v).to_device(dev);
        Ok(SlotBatch {
            positions: up(&positions),
            rows: up(&rows),
            start: up(&start),
            cu_q: up32(&cu_q),
            cu_k: up32(&cu_k),
            seq_used: up32(&used),
            last: up(&last),
            max_q: seqs.iter().map(|s| s.len).max().unwrap_or(1),
            live: None,
            geometry: Geometry::Packed(seqs.to_vec()),
        })
    }

    /// Number of new tokens.
    pub fn tokens(&self) -> i64 {
        self.positions.size()[0]
    }

    /// Advances the recurrent states of the sequences `live` [sequences] (bool, on the
    /// device) marks, only (see [`SlotBatch::live`]).
    pub fn with_live(mut self, live: &Tensor) -> Self {
        self.live = Some(live.shallow_clone());
        self
    }

    /// (sequences, tokens each) of a uniform batch (slots 0..sequences).
    pub(crate) fn uniform_shape(&self) -> Option<(i64, i64)> {
        match self.geometry {
            Geometry::Uniform { batch, per_seq } => Some((batch, per_seq)),
            Geometry::Packed(_) => None,
        }
    }

    /// The sequences of a packed batch, in token order.
    pub(crate) fn spans(&self) -> Option<&[SeqSpan]> {
        match &self.geometry {
            Geometry::Uniform { .. } => None,
            Geometry::Packed(seqs) => Some(seqs),
        }
    }
}

impl Clone for UniformConstants {
    fn clone(&self) -> Self {
        UniformConstants {
            offsets: self.offsets.shallow_clone(),
            slot_base: self.slot_base.shallow_clone(),
            cu_q: self.cu_q.shallow_clone(),
            cu_k: self.cu_k.shallow_clone(),
            last: self.last.shallow_clone(),
        }
    }
}
