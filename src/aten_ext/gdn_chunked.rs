//! The chunked (WY) form of the gated delta rule on the GPU: its sizes, the shared memory its
//! two kernels take (`gdn_chunk_prep`, `gdn_chunk_scan` in gdn_chunked.cuh, float32; for bf16 and
//! f16 storage `gdn_tc_prep`, `gdn_tc_scan` in gdn_chunked_tc.cuh, on tensor cores) and their
//! launch.

use std::ffi::c_void;

use anyhow::{ensure, Result};
use tch::{Kind, Tensor};

use super::super::nvrtc::arg;
use super::{GdnInputs, GdnKernels, GdnParams};

/// The chunked form's sizes, as the source's `GDN_CHUNK`, `GDN_CHUNK_K`, `GDN_SCAN_COLUMNS`,
/// `GDN_CHUNK_THREADS`.
const CHUNK: i64 = 64;
pub const CHUNKED_KEY_DIM: i64 = 128;
const SCAN_COLUMNS: i64 = 32;
const CHUNK_THREADS: u32 = 256;

/// The calls from which [`GdnKernels::forward`] takes the chunked form: from this many tokens
/// (one chunk), with key heads of [`CHUNKED_KEY_DIM`], where it is the default.
pub const CHUNKED_FROM_STEPS: i64 = CHUNK;

/// Whether [`GdnKernels::forward`] takes the float32 chunked form for long calls. No: on an
/// H200 its first version was slower than the recurrent kernel (2.38 against 1.98 ms at the
/// 27B layer shape); the present one is checked on the CPU's emulation but not yet timed.
pub const CHUNKED_BY_DEFAULT: bool = false;

/// Whether [`GdnKernels::forward`] takes the chunked form for long calls that run on tensor
/// cores (bf16 / f16 on sm_80 and later: the training forwards and prefills of published
/// models). Yes, ahead of a timing: per chunk and block it issues 896 tensor-core instructions
/// where the float32 form issues ~1.8 M FMAs, and the recurrent kernel is a chain of 3072
/// dependent steps at the 27B shape. It is checked by the CPU emulation, not yet on a GPU;
/// `bench-gdn` and `bench-forward --gdn-prefill` time every form, and this is false again if
/// the measurement says so.
pub const TENSOR_CORE_CHUNKED_BY_DEFAULT: bool = true;

/// Dynamic shared memory of the two chunked kernels, bytes: the source's `GDN_PREP_FLOATS`
/// (two staged key tiles, A, gamma, beta, exp(gamma)) and `GDN_SCAN_FLOATS` ([W; Q]^T, then the
/// keys and P^T in its place; the state's columns, u, Q S0, gamma and the keys' decays).
pub(super) const PREP_SHARED_BYTES: usize = {
    let (c, row, arow) = (
        CHUNK as usize,
        CHUNKED_KEY_DIM as usize + 4,
        CHUNK as usize + 4,
    );
    4 * (2 * c * row + c * arow + 3 * c)
};
pub(super) const SCAN_SHARED_BYTES: usize = {
    let (c, k) = (CHUNK as usize, CHUNKED_KEY_DIM as usize);
    let (row, arow, xrow, srow) = (k + 4, c + 4, 2 * c + 4, SCAN_COLUMNS as usize + 4);
    let stage = if k * xrow > c * row + c * arow {
        k * xrow
    } else {
        c * row + c * arow
    };
    4 * (stage + k * srow + 2 * c * srow + 2 * c)
};
// Both fit twice in a multiprocessor of an H100 / H200 (227 KB).
const _: () = assert!(PREP_SHARED_BYTES > 48 * 1024 && 2 * PREP_SHARED_BYTES <= 227 * 1024);
const _: () = assert!(SCAN_SHARED_BYTES > 48 * 1024 && 2 * SCAN_SHARED_BYTES <= 227 * 1024);

/// The tensor-core form's sizes, as gdn_chunked_tc.cuh's `GDN_TC_COLUMNS`,
/// `GDN_TC_PREP_THREADS`, `GDN_TC_SCAN_THREADS`, `GDN_TC_MAX_V`, and the compute capability its
/// mma.sync TF32 needs.
const TC_COLUMNS: i64 = 64;
/// `GDN_TC_NARROW_COLUMNS`: value columns per block of the narrow scan.
const TC_NARROW_COLUMNS: i64 = 32;
const TC_PREP_THREADS: u32 = 256;
const TC_SCAN_THREADS: u32 = 512;
const TC_MAX_VALUE_DIM: i64 = 128;
pub(super) const TENSOR_CORE_ARCH: i32 = 80;

/// Dynamic shared memory of the tensor-core kernels, bytes: `GDN_TC_PREP_BYTES` (raw k, q, v
/// rows of 136 halves; A, then T's scaled copies, rows of 68 floats; four per-token scalars) and
/// `GDN_TC_SCAN_BYTES` (W, P; the state's columns and u twice as B operands, rows of 72
/// floats; three rows of scales; raw q and k).
pub(super) const TC_PREP_SHARED_BYTES: usize = {
    let c = CHUNK as usize;
    4 * c * (c + 4) * 4 + 4 * c * 4
};
pub(super) const TC_SCAN_SHARED_BYTES: usize = tc_scan_shared_bytes(TC_COLUMNS as usize);
/// `GDN_TC_NARROW_SCAN_BYTES`: the same for 32 value columns per block.
pub(super) const TC_NARROW_SCAN_SHARED_BYTES: usize =
    tc_scan_shared_bytes(TC_NARROW_COLUMNS as usize);

const fn tc_scan_shared_bytes(cols: usize) -> usize {
    let (c, k) = (CHUNK as usize, CHUNKED_KEY_DIM as usize);
    4 * (c * (k + 4) + c * (c + 4) + k * (cols + 8) + 2 * c * (cols + 8) + 3 * c)
        + 2 * 2 * c * (k + 8)
}
// Raw rows of q, k, v (halves) take the place of float rows of A / T: the same bytes.
const _: () = assert!(2 * (CHUNKED_KEY_DIM + 8) == 4 * (CHUNK + 4));
const _: () = assert!(TC_SCAN_SHARED_BYTES <= 227 * 1024 && 3 * TC_PREP_SHARED_BYTES <= 227 * 1024);

/// How many value columns one block of the tensor-core scan carries through a head's chunks.
/// The scan's blocks run one per multiprocessor, each through all its chunks in turn: a call
/// with few (batch row, value head) pairs (one sequence of the 35B-A3B shape: 32 heads of 128,
/// 64 blocks of 64 columns) leaves half of an H100 / H200's 132 multiprocessors idle, and 32
/// columns per block runs it on twice the blocks, each with half the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanColumns {
    /// 32 where the blocks of 32 all run at once on the GPU, 64 otherwise.
    Auto,
    /// 64 value columns per block.
    Wide,
    /// 32 value columns per block.
    Narrow,
}

/// The chunked kernels' argument: the kernel's `GdnChunkParams` (the rule's arguments, then
/// the work buffers, float32 and dense, and the chunk count).
#[repr(C)]
pub(super) struct GdnChunkParams {
    rule: GdnParams,
    /// [B, Hv, N, C, V]
    u: *mut c_void,
    /// [B, Hv, N, K, C]
    w: *mut c_void,
    /// [B, Hv, N, C, C]
    p: *mut c_void,
    /// [B, Hv, N, C]
    gamma: *mut c_void,
    chunks: i64,
}

/// Whether cp.async can copy the rows of a [B, T, H, D] input of 2-byte values in 16-byte
/// pieces: its data and its batch, token and head strides 16-byte aligned (an input whose last
/// dimension is not dense is copied densely first, which is).
fn rows_copy_in_pieces(t: &Tensor) -> bool {
    let stride = t.stride();
    if stride.len() != 4 || (stride[3] != 1 && t.size()[3] != 1) {
        return true;
    }
    (t.data_ptr() as usize).is_multiple_of(16) && stride[..3].iter().all(|s| (2 * s) % 16 == 0)
}

impl GdnKernels {
    /// The same kernels with the chunked form of bf16 / f16 calls on tensor cores (`true`, the
    /// default, where the GPU has them and the call fits: value heads of 64 or 128, rows
    /// 16-byte aligned) or in float32 (`false`), as `bench-gdn` compares them.
    pub fn with_tensor_cores(mut self, tensor_cores: bool) -> Self {
        self.prefer_tensor_cores = tensor_cores;
        self
    }

    /// The same kernels with the tensor-core scan's blocks as wide as `columns` says.
    pub fn with_scan_columns(mut self, columns: ScanColumns) -> Self {
        self.scan_columns = columns;
        self
    }

    /// The value columns per block the tensor-core scan takes for a call of `blocks_of_64`
    /// blocks of 64 columns.
    fn tc_scan_columns(&self, blocks_of_64: i64) -> i64 {
        let narrow = match self.scan_columns {
            ScanColumns::Wide => false,
            ScanColumns::Narrow => true,
            ScanColumns::Auto => 2 * blocks_of_64 <= i64::from(self.module.multiprocessors()),
        };
        if narrow {
            TC_NARROW_COLUMNS
        } else {
            TC_COLUMNS
        }
    }

    /// The value columns per block of the tensor-core scan for this call (32 or 64), or `None`
    /// where the call does not run on tensor cores.
    pub fn tensor_core_scan_columns(&self, x: &GdnInputs<'_>) -> Result<Option<i64>> {
        if !self.chunked_on_tensor_cores(x)? {
            return Ok(None);
        }
        let shape = self.checked_shape(x)?;
        let blocks = shape.batch * shape.value_heads * (shape.value_dim / TC_COLUMNS);
        Ok(Some(self.tc_scan_columns(blocks)))
    }

    /// What the kernels do with a long call (a prefill or training forward) on this GPU, in
    /// words, for `doctor`.
    pub fn prefill_forms(&self) -> String {
        let chunked = match (self.chunked, self.tensor_cores) {
            (true, true) => {
                "the chunked form on tensor cores for bf16 / f16 (TF32), in float32 \
                             otherwise"
            }
            (true, false) => {
                "the chunked form in float32 (no tensor-core form: compute \
                              capability below 8.0, or less shared memory than it takes)"
            }
            (false, _) => "no chunked form (less shared memory than it takes)",
        };
        let default = match (
            TENSOR_CORE_CHUNKED_BY_DEFAULT && self.tensor_cores,
            CHUNKED_BY_DEFAULT,
        ) {
            (_, true) => "the chunked form",
            (true, false) => {
                "the chunked form where it runs on tensor cores, else the recurrent \
                              kernel"
            }
            (false, false) => "the recurrent kernel",
        };
        format!(
            "{chunked}; prefills of {CHUNKED_FROM_STEPS}+ tokens (key heads of \
             {CHUNKED_KEY_DIM}) take {default}"
        )
    }

    /// Whether [`GdnKernels::forward_chunked`] runs this call on tensor cores.
    pub fn chunked_on_tensor_cores(&self, x: &GdnInputs<'_>) -> Result<bool> {
        let shape = self.checked_shape(x)?;
        Ok(self.prefer_tensor_cores
            && self.tensor_cores
            && matches!(x.v.kind(), Kind::BFloat16 | Kind::Half)
            && shape.key_dim == CHUNKED_KEY_DIM
            && shape.value_dim % TC_COLUMNS == 0
            && shape.value_dim <= TC_MAX_VALUE_DIM
            && [x.q, x.k, x.v].into_iter().all(rows_copy_in_pieces))
    }

    /// [`GdnKernels::forward`] through the chunked form, whatever the length (key heads of
    /// [`CHUNKED_KEY_DIM`] only): on tensor cores where [`GdnKernels::with_tensor_cores`] and
    /// the call allow, else in float32.
    pub fn forward_chunked(&self, x: &GdnInputs<'_>, l2norm: bool) -> Result<(Tensor, Tensor)> {
        let shape = self.checked_shape(x)?;
        ensure!(
            self.chunked,
            "gated delta rule: cuda:{} does not grant the chunked kernels {SCAN_SHARED_BYTES} \
             bytes of shared memory per block",
            self.module.index()
        );
        ensure!(
            shape.key_dim == CHUNKED_KEY_DIM,
            "gated delta rule: the chunked form takes key heads of {CHUNKED_KEY_DIM}, not {}",
            shape.key_dim
        );
        let device = self.device();
        let final_state = Tensor::empty(shape.state_size(), (Kind::Float, device));
        let out = Tensor::empty(
            [shape.batch, shape.steps, shape.value_heads, shape.value_dim],
            (x.v.kind(), device),
        );
        if shape.steps == 0 || shape.batch == 0 {
            let mut copy = final_state.shallow_clone();
            match x.initial_state {
                Some(s) => copy.copy_(s),
                None => {
                    let _ = copy.zero_();
                }
            }
            return Ok((out, final_state));
        }
        let (b, hv, k, v) = (
            shape.batch,
            shape.value_heads,
            shape.key_dim,
            shape.value_dim,
        );
        let chunks = (shape.steps + CHUNK - 1) / CHUNK;
        let (rule, which, _inputs) =
            self.params(&shape, x, l2norm, &out, Some(&final_state), None)?;
        let tensor_cores = self.chunked_on_tensor_cores(x)?;
        let work = |size: &[i64]| Tensor::empty(size, (Kind::Float, device));
        // U' [C, V]; W [K, C] (float32 form) or [C, K] (tensor cores); P; gamma [C] or the
        // tensor-core form's three rows of scales [3, C]
        let u = work(&[b, hv, chunks, CHUNK, v]);
        let w = work(&[b, hv, chunks, k, CHUNK]);
        let p = work(&[b, hv, chunks, CHUNK, CHUNK]);
        let gamma = work(&[b, hv, chunks, if tensor_cores { 3 } else { 1 }, CHUNK]);
        let mut params = GdnChunkParams {
            rule,
            u: u.data_ptr(),
            w: w.data_ptr(),
            p: p.data_ptr(),
            gamma: gamma.data_ptr(),
            chunks,
        };
        ensure!(
            chunks <= u32::MAX as i64,
            "gated delta rule: {} tokens are more chunks than one launch takes",
            shape.steps
        );
        let rows = (b * hv) as u32;
        if tensor_cores {
            self.module.launch_with_shared(
                self.tc_prep[which],
                (chunks as u32, rows, 1),
                TC_PREP_THREADS,
                TC_PREP_SHARED_BYTES as u32,
                &mut [arg(&mut params)],
            )?;
            let columns = self.tc_scan_columns(b * hv * (v / TC_COLUMNS));
            let (scan, bytes) = if columns == TC_NARROW_COLUMNS {
                (self.tc_scan[1][which], TC_NARROW_SCAN_SHARED_BYTES)
            } else {
                (self.tc_scan[0][which], TC_SCAN_SHARED_BYTES)
            };
            self.module.launch_with_shared(
                scan,
                ((v / columns) as u32, rows, 1),
                TC_SCAN_THREADS,
                bytes as u32,
                &mut [arg(&mut params)],
            )?;
            return Ok((out, final_state));
        }
        self.module.launch_with_shared(
            self.chunk_prep[which],
            (chunks as u32, rows, 1),
            CHUNK_THREADS,
            PREP_SHARED_BYTES as u32,
            &mut [arg(&mut params)],
        )?;
        self.module.launch_with_shared(
            self.chunk_scan[which],
            (((v + SCAN_COLUMNS - 1) / SCAN_COLUMNS) as u32, rows, 1),
            CHUNK_THREADS,
            SCAN_SHARED_BYTES as u32,
            &mut [arg(&mut params)],
        )?;
        Ok((out, final_state))
    }
}
