//! The 256-bit building blocks the kernels share: lanes of byte products, nibble unpacking,
//! loads, and the f32 row dot.

use std::arch::x86_64::*;

/// The 8 lanes of Σ u[i]·s[i] over 32 bytes (lane `j`: bytes `4j..4j + 4`), exact.
#[target_feature(enable = "avx2")]
pub(super) fn lanes_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    // Pairs of products fit an i16 (2 · 128 · 127 < 32768): no saturation.
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// [`lanes_u8_i8`] in one instruction (AVX-VNNI's `vpdpbusd`, which sums the four
/// products into the i32 lane without an i16 step): the same exact sums.
#[target_feature(enable = "avx2,avxvnni")]
pub(super) fn lanes_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
}

/// [`lanes_vnni`] in its EVEX form (AVX-512 VL with VNNI, on CPUs without AVX-VNNI): the
/// same instruction, the same sums.
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
pub(super) fn lanes_vnni512(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// 16 bytes of packed nibbles as 32 bytes: the low nibbles, then the high ones (ggml's
/// element order within a 4-bit block).
#[target_feature(enable = "avx2")]
pub(super) fn nibbles(packed: &[u8]) -> __m256i {
    debug_assert!(packed.len() >= 16);
    // SAFETY: `packed` holds at least 16 bytes (asserted by the callers' block size);
    // the load is unaligned.
    let b = unsafe { _mm_loadu_si128(packed.as_ptr().cast()) };
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(b, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm256_set_m128i(hi, lo)
}

#[target_feature(enable = "avx2")]
pub(super) fn load32(bytes: &[u8]) -> __m256i {
    debug_assert!(bytes.len() >= 32);
    // SAFETY: `bytes` holds at least 32 bytes (the callers pass whole blocks); unaligned.
    unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
}

#[target_feature(enable = "avx2")]
pub(super) fn load32_i8(qs: &[i8; 32]) -> __m256i {
    // SAFETY: an array of exactly 32 bytes; unaligned load.
    unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma")]
pub(super) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (wb, xs) in w.chunks_exact(32).zip(x.chunks_exact(8)) {
        // SAFETY: `wb` is 32 bytes (8 f32), `xs` 8 f32; unaligned loads.
        let (wv, xv) = unsafe {
            (
                _mm256_loadu_ps(wb.as_ptr().cast()),
                _mm256_loadu_ps(xs.as_ptr()),
            )
        };
        acc = _mm256_fmadd_ps(wv, xv, acc);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` is 8 f32; unaligned store.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    super::super::portable::reduce8(lanes)
}
