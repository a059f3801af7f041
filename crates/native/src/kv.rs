//! The KV cache's element type ([`KvDtype`]: f16, or f32), and the conversion of a block
//! between them, which a decode worker applies to KV from a prefill worker of the other type.

/// What K and V are stored as in the arena.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    /// IEEE half precision (the default: half the memory and bandwidth of f32).
    #[default]
    F16,
    /// IEEE single precision: the activations' own values, nothing rounded.
    F32,
}

impl KvDtype {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// The type whose elements are `bytes` wide, if the engine stores one.
    pub fn of_bytes(bytes: usize) -> Option<KvDtype> {
        match bytes {
            2 => Some(KvDtype::F16),
            4 => Some(KvDtype::F32),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            _ => Err(format!("`{s}`: expected f16 or f32")),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `src` (little-endian elements of `from`) written into `dst` as `to`: f32 to f16 rounds to
/// nearest, ties to even (IEEE's default, what `half` does); f16 to f32 is exact; the same
/// type is a copy. `dst` must hold as many elements as `src`.
///
/// # Panics
/// When the lengths do not hold the same number of elements (a caller's bug: blocks of one
/// model's shape differ only in their element width).
pub fn convert(src: &[u8], from: KvDtype, dst: &mut [u8], to: KvDtype) {
    assert_eq!(
        src.len() / from.bytes(),
        dst.len() / to.bytes(),
        "KV blocks of different shapes"
    );
    match (from, to) {
        (KvDtype::F32, KvDtype::F16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        (KvDtype::F16, KvDtype::F32) => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                let v = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => dst.copy_from_slice(src),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn rounding_is_to_nearest_even_and_widening_is_exact() {
        // 1 + 2^-11 lies halfway between two f16s (1 and 1 + 2^-10): ties go to the even one,
        // 1; 1 + 3·2^-11 rounds up to 1 + 2^-9. Past f16's range: infinity.
        let src = f32s(&[1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), 1e6, -0.0]);
        let mut half = vec![0u8; 8];
        convert(&src, KvDtype::F32, &mut half, KvDtype::F16);
        let got: Vec<f32> = half
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(got, [1.0, 1.0 + 2f32.powi(-9), f32::INFINITY, -0.0]);
        assert!(got[3].is_sign_negative());
        let mut back = vec![0u8; 16];
        convert(&half, KvDtype::F16, &mut back, KvDtype::F32);
        assert_eq!(back, f32s(&got));
    }

    proptest! {
        /// Block by block, every element as `half`'s round-to-nearest-even makes it, and a
        /// round trip through f32 gives the f16 bits back.
        #[test]
        fn a_block_converts_element_by_element(values in proptest::collection::vec(any::<f32>(), 0..256)) {
            let src = f32s(&values);
            let mut dst = vec![0u8; values.len() * 2];
            convert(&src, KvDtype::F32, &mut dst, KvDtype::F16);
            for (v, d) in values.iter().zip(dst.chunks_exact(2)) {
                let want = half::f16::from_f32(*v).to_bits();
                prop_assert_eq!(u16::from_le_bytes([d[0], d[1]]), want);
            }
            let mut wide = vec![0u8; values.len() * 4];
            convert(&dst, KvDtype::F16, &mut wide, KvDtype::F32);
            let mut again = vec![0u8; values.len() * 2];
            convert(&wide, KvDtype::F32, &mut again, KvDtype::F16);
            prop_assert_eq!(again, dst);
        }
    }
}
