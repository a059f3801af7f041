//! ggml's tensor types: their numeric ids, block geometry, and the dequantization of the types
//! tandem loads.
//!
//! The ids and geometry are ggml's (`enum ggml_type` in ggml/include/ggml.h, the type traits in
//! ggml/src/ggml.c; gguf-py mirrors them as `GGMLQuantizationType` and `GGML_QUANT_SIZES`, and
//! tests/gguf_interop.rs checks this table against that copy). A type packs `block_size`
//! elements into `type_size` bytes; a row of `n` elements is `n / block_size` blocks back to
//! back, so `n` must be a multiple of `block_size`.

use std::fmt;

use crate::Error;

mod dequant;

/// A ggml tensor type. The variant names are ggml's own (`GGML_TYPE_Q4_K` is `Q4_K`), so that
/// code, messages and the file format read the same.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// The K-quants' super-block: 256 elements (ggml's `QK_K`).
const QK_K: usize = 256;

impl GgmlType {
    /// Every type ggml defines (ids 4, 5 and 31..=33, 36..=38 were removed from ggml and are
    /// unknown here too).
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
        GgmlType::Q1_0,
    ];

    /// The types tandem loads and dequantizes. A file with a tensor of any other type is
    /// refused when it is parsed.
    pub const SUPPORTED: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// `(id, name, block_size, type_size)`, the one table everything else reads.
    const fn traits(self) -> (u32, &'static str, usize, usize) {
        match self {
            GgmlType::F32 => (0, "F32", 1, 4),
            GgmlType::F16 => (1, "F16", 1, 2),
            GgmlType::Q4_0 => (2, "Q4_0", 32, 2 + 16),
            GgmlType::Q4_1 => (3, "Q4_1", 32, 2 + 2 + 16),
            GgmlType::Q5_0 => (6, "Q5_0", 32, 2 + 4 + 16),
            GgmlType::Q5_1 => (7, "Q5_1", 32, 2 + 2 + 4 + 16),
            GgmlType::Q8_0 => (8, "Q8_0", 32, 2 + 32),
            GgmlType::Q8_1 => (9, "Q8_1", 32, 4 + 4 + 32),
            GgmlType::Q2_K => (10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            GgmlType::Q3_K => (11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            GgmlType::Q4_K => (12, "Q4_K", QK_K, 2 + 2 + 12 + QK_K / 2),
            GgmlType::Q5_K => (13, "Q5_K", QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2),
            GgmlType::Q6_K => (14, "Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
            GgmlType::Q8_K => (15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8),
            GgmlType::IQ2_XXS => (16, "IQ2_XXS", QK_K, 2 + QK_K / 4),
            GgmlType::IQ2_XS => (17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32),
            GgmlType::IQ3_XXS => (18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8),
            GgmlType::IQ1_S => (19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16),
            GgmlType::IQ4_NL => (20, "IQ4_NL", 32, 2 + 16),
            GgmlType::IQ3_S => (21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            GgmlType::IQ2_S => (22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16),
            GgmlType::IQ4_XS => (23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            GgmlType::I8 => (24, "I8", 1, 1),
            GgmlType::I16 => (25, "I16", 1, 2),
            GgmlType::I32 => (26, "I32", 1, 4),
            GgmlType::I64 => (27, "I64", 1, 8),
            GgmlType::F64 => (28, "F64", 1, 8),
            GgmlType::IQ1_M => (29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            GgmlType::BF16 => (30, "BF16", 1, 2),
            GgmlType::TQ1_0 => (34, "TQ1_0", QK_K, 2 + 4 * 13),
            GgmlType::TQ2_0 => (35, "TQ2_0", QK_K, 2 + 64),
            GgmlType::MXFP4 => (39, "MXFP4", 32, 1 + 16),
            GgmlType::NVFP4 => (40, "NVFP4", 64, 4 + 32),
            GgmlType::Q1_0 => (41, "Q1_0", 128, 2 + 16),
        }
    }

    /// The type with ggml id `id`, if ggml defines one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|ty| ty.id() == id)
    }

    /// ggml's numeric id, as stored in a GGUF tensor info.
    pub const fn id(self) -> u32 {
        self.traits().0
    }

    /// ggml's name (`ggml_type_name`).
    pub const fn name(self) -> &'static str {
        self.traits().1
    }

    /// Elements per block.
    pub const fn block_size(self) -> usize {
        self.traits().2
    }

    /// Bytes per block.
    pub const fn type_size(self) -> usize {
        self.traits().3
    }

    /// Whether tandem loads and dequantizes this type ([`GgmlType::SUPPORTED`]).
    pub fn is_supported(self) -> bool {
        GgmlType::SUPPORTED.contains(&self)
    }

    /// The bytes that `n` elements take (ggml's `ggml_row_size`); an error when `n` is not a
    /// whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize, Error> {
        let block = self.block_size();
        if !n.is_multiple_of(block) {
            return Err(Error::NotBlockMultiple { ty: self, n, block });
        }
        (n / block)
            .checked_mul(self.type_size())
            .ok_or(Error::RowTooLarge { ty: self, n })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Dequantizes `dst.len()` elements of type `ty` from `src` into `dst`: one row, or any run of
/// whole blocks (a whole tensor is one run, its rows being back to back). `dst.len()` must be
/// a multiple of the block size and `src` exactly [`GgmlType::row_bytes`] of it.
///
/// The arithmetic is ggml's reference `dequantize_row_*` (ggml/src/ggml-quants.c), operation
/// for operation, so the results equal the reference bit for bit.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), Error> {
    if !ty.is_supported() {
        return Err(Error::UnsupportedType { ty });
    }
    let expected = ty.row_bytes(dst.len())?;
    if src.len() != expected {
        return Err(Error::RowBytes {
            ty,
            n: dst.len(),
            expected,
            got: src.len(),
        });
    }
    match ty {
        GgmlType::F32 => dequant::f32(src, dst),
        GgmlType::F16 => dequant::f16(src, dst),
        GgmlType::BF16 => dequant::bf16(src, dst),
        GgmlType::Q8_0 => dequant::q8_0(src, dst),
        GgmlType::Q4_0 => dequant::q4_0(src, dst),
        GgmlType::Q4_1 => dequant::q4_1(src, dst),
        GgmlType::Q4_K => dequant::q4_k(src, dst),
        GgmlType::Q5_K => dequant::q5_k(src, dst),
        GgmlType::Q6_K => dequant::q6_k(src, dst),
        _ => return Err(Error::UnsupportedType { ty }),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_distinct() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
        }
        assert_eq!(GgmlType::from_id(30), Some(GgmlType::BF16));
    }

    #[test]
    fn geometry_of_the_supported_types() {
        let expect = [
            (GgmlType::F32, 1, 4),
            (GgmlType::F16, 1, 2),
            (GgmlType::BF16, 1, 2),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q4_K, 256, 144),
            (GgmlType::Q5_K, 256, 176),
            (GgmlType::Q6_K, 256, 210),
        ];
        for (ty, block, size) in expect {
            assert!(ty.is_supported());
            assert_eq!((ty.block_size(), ty.type_size()), (block, size), "{ty}");
        }
        assert!(!GgmlType::Q2_K.is_supported());
    }

    #[test]
    fn row_bytes() {
        assert_eq!(GgmlType::Q4_1.row_bytes(576).unwrap(), 18 * 20);
        assert_eq!(GgmlType::Q6_K.row_bytes(512).unwrap(), 420);
        assert_eq!(GgmlType::F16.row_bytes(3).unwrap(), 6);
        assert_eq!(GgmlType::Q8_0.row_bytes(0).unwrap(), 0);
        assert!(matches!(
            GgmlType::Q4_K.row_bytes(255),
            Err(Error::NotBlockMultiple {
                n: 255,
                block: 256,
                ..
            })
        ));
        assert!(matches!(
            GgmlType::F64.row_bytes(usize::MAX),
            Err(Error::RowTooLarge { .. })
        ));
    }

    #[test]
    fn dequantize_row_checks_lengths_and_type() {
        let mut dst = [0f32; 32];
        assert!(matches!(
            dequantize_row(GgmlType::Q8_0, &[0; 33], &mut dst),
            Err(Error::RowBytes {
                expected: 34,
                got: 33,
                ..
            })
        ));
        assert!(matches!(
            dequantize_row(GgmlType::Q8_0, &[0; 34], &mut dst[..31]),
            Err(Error::NotBlockMultiple { .. })
        ));
        assert!(matches!(
            dequantize_row(GgmlType::Q5_0, &[0; 22], &mut dst),
            Err(Error::UnsupportedType { ty: GgmlType::Q5_0 })
        ));
        dequantize_row(GgmlType::Q8_0, &[0; 34], &mut dst).unwrap();
        assert!(dst.iter().all(|&x| x == 0.0));
    }
}
