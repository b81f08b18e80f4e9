//! ggml tensor types and their dequantisation to f32.
//!
//! Block formats (32 values per block, as in ggml-common.h):
//! - Q4_0: f16 scale `d`, 16 bytes of nibbles; `x = (q - 8) * d`.
//! - Q4_1: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; `x = q * d + m`.
//! - Q8_0: f16 scale `d`, 32 signed bytes; `x = q * d`.
//!
//! In the nibble formats byte `j` holds value `j` in its low nibble and value `j + 16` in its
//! high nibble.

use half::{bf16, f16};

pub(crate) const QK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
    /// A type this reader knows by id but cannot convert.
    Unsupported(u32),
}

impl GgmlType {
    pub(crate) const SUPPORTED_NAMES: &'static str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1";

    pub(crate) fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            other => GgmlType::Unsupported(other),
        }
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::BF16 => 30,
            GgmlType::Unsupported(id) => id,
        }
    }

    /// Values per block and bytes per block.
    fn block(self) -> Option<(u64, u64)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 | GgmlType::BF16 => Some((1, 2)),
            GgmlType::Q4_0 => Some((QK as u64, 2 + QK as u64 / 2)),
            GgmlType::Q4_1 => Some((QK as u64, 4 + QK as u64 / 2)),
            GgmlType::Q8_0 => Some((QK as u64, 2 + QK as u64)),
            GgmlType::Unsupported(_) => None,
        }
    }

    /// Bytes that `elements` values occupy, if the type is supported and the count fits whole
    /// blocks.
    pub(crate) fn byte_size(self, elements: u64) -> Option<u64> {
        let (per_block, bytes) = self.block()?;
        if !elements.is_multiple_of(per_block) {
            return None;
        }
        (elements / per_block).checked_mul(bytes)
    }

    /// Dequantises `elements` values from `bytes`; `None` for unsupported types or a size
    /// mismatch.
    pub fn dequantize(self, bytes: &[u8], elements: usize) -> Option<Vec<f32>> {
        if self.byte_size(elements as u64)? != bytes.len() as u64 {
            return None;
        }
        let mut out = Vec::with_capacity(elements);
        match self {
            GgmlType::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            GgmlType::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            GgmlType::BF16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            GgmlType::Q4_0 => {
                for block in bytes.chunks_exact(2 + QK / 2) {
                    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                    push_nibbles(&mut out, &block[2..], |q| (q as f32 - 8.0) * d);
                }
            }
            GgmlType::Q4_1 => {
                for block in bytes.chunks_exact(4 + QK / 2) {
                    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                    let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
                    push_nibbles(&mut out, &block[4..], |q| q as f32 * d + m);
                }
            }
            GgmlType::Q8_0 => {
                for block in bytes.chunks_exact(2 + QK) {
                    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                    out.extend(block[2..].iter().map(|&q| q as i8 as f32 * d));
                }
            }
            GgmlType::Unsupported(_) => return None,
        }
        Some(out)
    }
}

fn push_nibbles(out: &mut Vec<f32>, qs: &[u8], value: impl Fn(u8) -> f32) {
    out.extend(qs.iter().map(|&b| value(b & 0x0f)));
    out.extend(qs.iter().map(|&b| value(b >> 4)));
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match *self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::BF16 => "BF16",
            GgmlType::Unsupported(id) => {
                // Names of the common ggml types this reader does not convert.
                let known = match id {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    12 => "Q4_K",
                    13 => "Q5_K",
                    14 => "Q6_K",
                    15 => "Q8_K",
                    16..=23 | 29 => "IQ",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    _ => "unknown",
                };
                return write!(f, "{known} (id {id})");
            }
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_follows_the_nibble_layout() {
        let d = f16::from_f32(0.5);
        let m = f16::from_f32(-1.0);
        let mut block = Vec::new();
        block.extend(d.to_le_bytes());
        block.extend(m.to_le_bytes());
        // byte j: low nibble j % 16, high nibble 15 - j % 16
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = GgmlType::Q4_1.dequantize(&block, 32).unwrap();
        for j in 0..16 {
            assert_eq!(v[j], j as f32 * 0.5 - 1.0);
            assert_eq!(v[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn q4_0_and_q8_0_are_signed() {
        let d = f16::from_f32(2.0);
        let mut q4 = d.to_le_bytes().to_vec();
        q4.extend([0x80u8; 16]); // low nibble 0 -> -8, high nibble 8 -> 0
        let v = GgmlType::Q4_0.dequantize(&q4, 32).unwrap();
        assert!(v[..16].iter().all(|&x| x == -16.0));
        assert!(v[16..].iter().all(|&x| x == 0.0));

        let mut q8 = d.to_le_bytes().to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = GgmlType::Q8_0.dequantize(&q8, 32).unwrap();
        assert_eq!(v[0], -32.0);
        assert_eq!(v[31], 30.0);
    }

    #[test]
    fn size_mismatch_and_unknown_types_are_refused() {
        assert!(GgmlType::Q8_0.dequantize(&[0u8; 33], 32).is_none());
        assert!(GgmlType::from_id(13).dequantize(&[0u8; 176], 256).is_none());
        assert_eq!(GgmlType::from_id(13).to_string(), "Q5_K (id 13)");
        assert_eq!(GgmlType::F32.byte_size(3), Some(12));
        assert_eq!(GgmlType::Q4_1.byte_size(31), None);
    }
}
