//! The SIMD kernels (x86-64 AVX2, AVX-VNNI and AVX-512 VNNI) and prefetches: the one module of this crate with `unsafe`.
//!
//! Each function here computes exactly what its namesake in `portable` computes, bit for
//! bit: a block's 8 integer lane sums are exact whatever adds them, and the f32 operations
//! that follow are the same ones lane by lane, in the same order (`tests.rs` checks every
//! path against the portable one on random data).
//!
//! Safety contract, shared by every block below: the `avx2` + `fma` target features are
//! enabled only through [`avx2_available`] having returned true on this CPU, `avxvnni` only
//! through [`vnni_available`] and the AVX-512 ones only through [`avx512_available`]
//! (checked by the callers in `Kernels`), and every load reads a 16-, 32- or 64-byte range
//! that the slice bounds checked just before it cover (`chunks_exact` of the block size, or a
//! slice of exactly the bytes loaded).
#![allow(unsafe_code)]

use super::{BlockQ8, GroupScales, QK};

/// Whether the CPU has AVX-VNNI's `vpdpbusd` (on top of [`avx2_available`]).
pub(super) fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_available() && std::is_x86_feature_detected!("avxvnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX-512 (F, BW, VL) with its VNNI (on top of [`avx2_available`]).
pub(super) fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_available()
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU runs the AVX2 kernels (AVX2, FMA and F16C).
pub(super) fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
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
}

#[cfg(target_arch = "x86_64")]
pub(super) fn dot_f32s(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: see the module's contract (callers checked `avx2_available`).
    unsafe { dots(a, b) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dots(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        // SAFETY: 8 f32 each; unaligned loads.
        let (va, vb) = unsafe { (_mm256_loadu_ps(ca.as_ptr()), _mm256_loadu_ps(cb.as_ptr())) };
        acc = _mm256_fmadd_ps(va, vb, acc);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` is 8 f32; unaligned store.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    super::portable::reduce8(lanes)
}

#[cfg(target_arch = "x86_64")]
pub(super) fn dot_f32_f16(a: &[f32], b: &[u8]) -> f32 {
    // SAFETY: see the module's contract (callers checked `avx2_available`).
    unsafe { dots_f16(a, b) }
}

/// [`dots`] with `b` read as f16 and converted in registers (exact), 8 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dots_f16(a: &[f32], b: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(16)) {
        // SAFETY: 8 f32 and 16 bytes (8 halves); unaligned loads.
        let (va, vb) = unsafe {
            (
                _mm256_loadu_ps(ca.as_ptr()),
                _mm256_cvtph_ps(_mm_loadu_si128(cb.as_ptr().cast())),
            )
        };
        acc = _mm256_fmadd_ps(va, vb, acc);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` is 8 f32; unaligned store.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    super::portable::reduce8(lanes)
}

/// Asks memory for every 64-byte line of `bytes[range]` (what is past the end of `bytes`
/// is left out): a hint that changes no result.
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_range(bytes: &[u8], range: std::ops::Range<usize>) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    let end = range.end.min(bytes.len());
    let Some(part) = bytes.get(range.start.min(end)..end) else {
        return;
    };
    for line in part.chunks(64) {
        // SAFETY: a prefetch reads nothing and cannot fault; the address is inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn prefetch_range(_: &[u8], _: std::ops::Range<usize>) {}

/// Heads an attention kernel takes at once: their running sums stay in registers.
#[cfg(target_arch = "x86_64")]
const HEADS: usize = 4;

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) fn scores_f16(
    q: &[f32],
    hd: usize,
    k: &[u8],
    stride: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    let heads = q.len() / hd;
    let mut h0 = 0;
    while h0 < heads {
        let q = &q[h0 * hd..];
        let out = &mut out[h0 * out_stride..];
        // SAFETY: see the module's contract (callers checked `avx2_available`).
        let taken = unsafe {
            match heads - h0 {
                1 => attn::scores::<1>(q, hd, k, stride, n, scale, out, out_stride),
                2 => attn::scores::<2>(q, hd, k, stride, n, scale, out, out_stride),
                3 => attn::scores::<3>(q, hd, k, stride, n, scale, out, out_stride),
                _ => attn::scores::<HEADS>(q, hd, k, stride, n, scale, out, out_stride),
            }
        };
        h0 += taken;
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn weighted_f16(
    w: &[f32],
    w_stride: usize,
    v: &[u8],
    stride: usize,
    n: usize,
    hd: usize,
    y: &mut [f32],
) {
    let heads = y.len() / hd;
    let mut h0 = 0;
    while h0 < heads {
        let w = &w[h0 * w_stride..];
        let y = &mut y[h0 * hd..];
        // SAFETY: see the module's contract (callers checked `avx2_available`).
        let taken = unsafe {
            match heads - h0 {
                1 => attn::weighted::<1>(w, w_stride, v, stride, n, hd, y),
                2 => attn::weighted::<2>(w, w_stride, v, stride, n, hd, y),
                3 => attn::weighted::<3>(w, w_stride, v, stride, n, hd, y),
                _ => attn::weighted::<HEADS>(w, w_stride, v, stride, n, hd, y),
            }
        };
        h0 += taken;
    }
}

/// Attention over f16 K and V for a few query heads at a time: the same operations as
/// `dots_f16` and `axpy8_f16` per (head, position), each key or value converted once for
/// all the heads.
#[cfg(target_arch = "x86_64")]
mod attn {
    use std::arch::x86_64::*;

    /// Eight f16 at `b[at..at + 16]` as f32 (exact).
    #[target_feature(enable = "avx2,f16c")]
    fn halves8(b: &[u8], at: usize) -> __m256 {
        let c = &b[at..at + 16];
        // SAFETY: `c` is 16 bytes; unaligned load.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(c.as_ptr().cast()) })
    }

    #[target_feature(enable = "avx2")]
    fn load8(x: &[f32], at: usize) -> __m256 {
        let c = &x[at..at + 8];
        // SAFETY: `c` is 8 f32; unaligned load.
        unsafe { _mm256_loadu_ps(c.as_ptr()) }
    }

    #[target_feature(enable = "avx2")]
    fn store8(x: &mut [f32], at: usize, v: __m256) {
        let c = &mut x[at..at + 8];
        // SAFETY: `c` is 8 f32; unaligned store.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), v) }
    }

    /// `portable::reduce8` in registers: ((0+4)+(2+6)) + ((1+5)+(3+7)), the same adds.
    #[target_feature(enable = "avx2")]
    fn reduce8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)))
    }

    /// `H` heads' scores (see `Kernels::scores_f16`), two keys at a time; returns `H`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn scores<const H: usize>(
        q: &[f32],
        hd: usize,
        k: &[u8],
        stride: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
    ) -> usize {
        let mut p = 0;
        while p + 2 <= n {
            let (k0, k1) = (p * stride, (p + 1) * stride);
            let mut acc = [[_mm256_setzero_ps(); 2]; H];
            for c in 0..hd / 8 {
                let (a, b) = (halves8(k, k0 + 16 * c), halves8(k, k1 + 16 * c));
                for (h, acc) in acc.iter_mut().enumerate() {
                    let qv = load8(q, h * hd + 8 * c);
                    acc[0] = _mm256_fmadd_ps(qv, a, acc[0]);
                    acc[1] = _mm256_fmadd_ps(qv, b, acc[1]);
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                out[h * out_stride + p] = reduce8(acc[0]) * scale;
                out[h * out_stride + p + 1] = reduce8(acc[1]) * scale;
            }
            p += 2;
        }
        if p < n {
            let k0 = p * stride;
            let mut acc = [_mm256_setzero_ps(); H];
            for c in 0..hd / 8 {
                let a = halves8(k, k0 + 16 * c);
                for (h, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(load8(q, h * hd + 8 * c), a, *acc);
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                out[h * out_stride + p] = reduce8(*acc) * scale;
            }
        }
        H
    }

    /// `H` heads' weighted sums (see `Kernels::weighted_f16`), 16 of the `hd` outputs at a
    /// time in registers over all the positions (each output's adds stay in position
    /// order); returns `H`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn weighted<const H: usize>(
        w: &[f32],
        w_stride: usize,
        v: &[u8],
        stride: usize,
        n: usize,
        hd: usize,
        y: &mut [f32],
    ) -> usize {
        let mut c = 0;
        while c < hd / 8 {
            let two = c + 2 <= hd / 8;
            let mut acc = [[_mm256_setzero_ps(); 2]; H];
            for (h, acc) in acc.iter_mut().enumerate() {
                acc[0] = load8(y, h * hd + 8 * c);
                if two {
                    acc[1] = load8(y, h * hd + 8 * c + 8);
                }
            }
            if two {
                for p in 0..n {
                    let at = p * stride + 16 * c;
                    let (a, b) = (halves8(v, at), halves8(v, at + 16));
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let wv = _mm256_set1_ps(w[h * w_stride + p]);
                        acc[0] = _mm256_fmadd_ps(wv, a, acc[0]);
                        acc[1] = _mm256_fmadd_ps(wv, b, acc[1]);
                    }
                }
            } else {
                for p in 0..n {
                    let a = halves8(v, p * stride + 16 * c);
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let wv = _mm256_set1_ps(w[h * w_stride + p]);
                        acc[0] = _mm256_fmadd_ps(wv, a, acc[0]);
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                store8(y, h * hd + 8 * c, acc[0]);
                if two {
                    store8(y, h * hd + 8 * c + 8, acc[1]);
                }
            }
            c += if two { 2 } else { 1 };
        }
        H
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn axpy_f16(w: f32, x: &[u8], y: &mut [f32]) {
    // SAFETY: see the module's contract (callers checked `avx2_available`).
    unsafe { axpy8_f16(w, x, y) }
}

/// [`axpy8`] with `x` read as f16 and converted in registers (exact), 8 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn axpy8_f16(w: f32, x: &[u8], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let wv = _mm256_set1_ps(w);
    for (cy, cx) in y.chunks_exact_mut(8).zip(x.chunks_exact(16)) {
        // SAFETY: 8 f32 and 16 bytes (8 halves); unaligned loads and store.
        unsafe {
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(cx.as_ptr().cast()));
            let v = _mm256_fmadd_ps(wv, xv, _mm256_loadu_ps(cy.as_ptr()));
            _mm256_storeu_ps(cy.as_mut_ptr(), v);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: see the module's contract (callers checked `avx2_available`).
    unsafe { axpy8(w, x, y) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn axpy8(w: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let wv = _mm256_set1_ps(w);
    for (cy, cx) in y.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
        // SAFETY: 8 f32 each; unaligned loads and store.
        unsafe {
            let v = _mm256_fmadd_ps(
                wv,
                _mm256_loadu_ps(cx.as_ptr()),
                _mm256_loadu_ps(cy.as_ptr()),
            );
            _mm256_storeu_ps(cy.as_mut_ptr(), v);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
    // SAFETY: see the module's contract (callers checked `avx2_available`).
    unsafe { halves(src, dst) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn halves(src: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let whole = dst.len() / 8 * 8;
    for (d, s) in dst[..whole].chunks_exact_mut(8).zip(src.chunks_exact(16)) {
        // SAFETY: `s` is 16 bytes (8 halves) and `d` 8 f32; unaligned load and store.
        unsafe {
            let h = _mm_loadu_si128(s.as_ptr().cast());
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    super::portable::f16_to_f32(&src[whole * 2..], &mut dst[whole..]);
}

#[cfg(target_arch = "x86_64")]
pub(super) fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    // SAFETY: see the module's contract (callers checked `avx2_available`).
    unsafe { quantize(x, out) }
}

/// `portable::quantize_q8`, 32 values at a time: the same maximum, scale and products, and
/// `round` (half away from zero) as truncation plus one where the dropped fraction is at least
/// a half, which is exact; NaN products become 0 as `as i32` makes them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize(x: &[f32], out: &mut [BlockQ8]) {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        // SAFETY: `xs` is 32 f32; four unaligned 8-value loads.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * i)) });
        let abs = v.map(|v| _mm256_andnot_ps(sign, v));
        // max(NaN, m) is m: a NaN is skipped, as `f32::max` skips it.
        let m = abs
            .iter()
            .fold(_mm256_setzero_ps(), |m, &a| _mm256_max_ps(a, m));
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` is 8 f32; unaligned store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
        let amax = lanes.iter().fold(0.0f32, |m, v| m.max(*v));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let q = v.map(|v| {
            let p = _mm256_mul_ps(v, _mm256_set1_ps(id));
            let t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(p, t));
            let up = _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), one);
            let r = _mm256_add_ps(t, _mm256_or_ps(up, _mm256_and_ps(p, sign)));
            let ok = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_ORD_Q));
            let i = _mm256_and_si256(_mm256_cvttps_epi32(r), ok);
            _mm256_min_epi32(_mm256_max_epi32(i, lo), hi)
        });
        let total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let mut sums = [0i32; 8];
        // SAFETY: `sums` is 8 i32; unaligned store.
        unsafe { _mm256_storeu_si256(sums.as_mut_ptr().cast(), total) };
        let sum: i32 = sums.iter().sum();
        // Four i32 vectors to 32 i8 (exact: every value is within ±127), back in order.
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let ordered =
            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `qs` is 32 bytes; unaligned store.
        unsafe { _mm256_storeu_si256(block.qs.as_mut_ptr().cast(), ordered) };
        block.d = d;
        block.sum = sum;
        block.s = d * sum as f32;
    }
}

/// The two f16 values at the start of `b` as f32 (exact, as `half`'s conversion).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn f16_pair(b: &[u8]) -> (f32, f32) {
    use std::arch::x86_64::*;
    let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)))
}

/// One weight row against several activation rows (see `Kernels::dot_many`): each weight
/// block is unpacked and its scales converted once, then met with every row's block; each
/// row's sum still runs over the blocks in order, with the portable path's f32 operations.
/// `vnni`: with AVX-VNNI's dot-product instruction (the same sums).
#[cfg(target_arch = "x86_64")]
pub(super) fn dot_many(
    format: super::WeightFormat,
    w: &[u8],
    xq: &[BlockQ8],
    scales: &[GroupScales],
    blocks: usize,
    out: &mut [f32],
    vnni: bool,
) {
    if vnni {
        // SAFETY: see the module's contract (callers checked `vnni_available`).
        unsafe { vnni::many(format, w, xq, scales, blocks, out) }
    } else {
        // SAFETY: see the module's contract (callers checked `avx2_available`).
        unsafe { avx2::many(format, w, xq, scales, blocks, out) }
    }
}

/// Activation rows a weight block is unpacked for at once.
#[cfg(target_arch = "x86_64")]
const GROUP: usize = super::GROUP_ROWS;

/// Weight rows one activation row meets at once (`weight_rows`).
#[cfg(target_arch = "x86_64")]
const QUAD: usize = 4;

/// `many` and `rows` for one set of target features and one block-lanes instruction: the
/// AVX2 pair (`maddubs` + `madd`) or AVX-VNNI's `vpdpbusd`. Generated twice so that each
/// copy is compiled (and its lanes function inlined) with its own features.
#[cfg(target_arch = "x86_64")]
macro_rules! row_kernels {
    ($module:ident, $features:literal, $lanes:path) => {
        mod $module {
            use super::super::{
                BlockQ8, GroupScales, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, WeightFormat,
            };
            use super::{GROUP, QUAD, f16_pair, x86};
            use std::arch::x86_64::*;

            #[target_feature(enable = $features)]
            pub(super) fn many(
                format: WeightFormat,
                w: &[u8],
                xq: &[BlockQ8],
                scales: &[GroupScales],
                blocks: usize,
                out: &mut [f32],
            ) {
                // Rows in groups whose running sums stay in registers: a sum kept in memory
                // makes every block wait for the store of the one before (store-to-load
                // forwarding, ~2× the add).
                let mut r0 = 0;
                while r0 + GROUP <= out.len() {
                    let g = &scales[r0 / GROUP * blocks..(r0 / GROUP + 1) * blocks];
                    out[r0..r0 + GROUP].copy_from_slice(&group(format, w, xq, g, blocks, r0));
                    r0 += GROUP;
                }
                while r0 < out.len() {
                    out[r0] = rows::<1>(format, w, xq, blocks, r0)[0];
                    r0 += 1;
                }
            }

            /// Rows `r0..r0 + GROUP` of [`many`], as [`rows`] computes them, with the rows'
            /// scales of each block read in one load (`scales`: the group's, block by
            /// block): one multiply gives every row's `d · a.d` (each then broadcast by a
            /// permute) and, for Q4_1, one multiply and one add every row's extra term.
            /// Lane by lane the same f32 operations as one row at a time.
            #[target_feature(enable = $features)]
            fn group(
                format: WeightFormat,
                w: &[u8],
                xq: &[BlockQ8],
                scales: &[GroupScales],
                blocks: usize,
                r0: usize,
            ) -> [f32; GROUP] {
                if format == WeightFormat::Q4_0 {
                    return rows::<GROUP>(format, w, xq, blocks, r0);
                }
                let mut acc = [_mm256_setzero_ps(); GROUP];
                let mut extra = _mm_setzero_ps();
                let lane: [__m256i; GROUP] = std::array::from_fn(|i| _mm256_set1_epi32(i as i32));
                let qs = |i: usize, b: usize| x86::load32_i8(&xq[(r0 + i) * blocks + b].qs);
                let load = |s: &GroupScales| {
                    // SAFETY: a `GroupScales` is 8 f32; unaligned load.
                    unsafe { _mm256_loadu_ps(s.as_ptr()) }
                };
                match format {
                    WeightFormat::Q4_1 => {
                        for ((b, wb), s) in w.chunks_exact(Q4_1_BYTES).enumerate().zip(scales) {
                            let (d, m) = f16_pair(wb);
                            let wv = x86::nibbles(&wb[4..]);
                            let ds = load(s);
                            let dd = _mm256_mul_ps(_mm256_set1_ps(d), ds);
                            let ms = _mm_mul_ps(_mm_set1_ps(m), _mm256_extractf128_ps(ds, 1));
                            extra = _mm_add_ps(extra, ms);
                            for i in 0..GROUP {
                                let lanes = $lanes(wv, qs(i, b));
                                let ddi = _mm256_permutevar8x32_ps(dd, lane[i]);
                                acc[i] = _mm256_fmadd_ps(ddi, _mm256_cvtepi32_ps(lanes), acc[i]);
                            }
                        }
                    }
                    WeightFormat::Q8_0 => {
                        for ((b, wb), s) in w.chunks_exact(Q8_0_BYTES).enumerate().zip(scales) {
                            let d = f16_pair(wb).0;
                            let wv = x86::load32(&wb[2..]);
                            let abs = _mm256_sign_epi8(wv, wv);
                            let dd = _mm256_mul_ps(_mm256_set1_ps(d), load(s));
                            for i in 0..GROUP {
                                let lanes = $lanes(abs, _mm256_sign_epi8(qs(i, b), wv));
                                let ddi = _mm256_permutevar8x32_ps(dd, lane[i]);
                                acc[i] = _mm256_fmadd_ps(ddi, _mm256_cvtepi32_ps(lanes), acc[i]);
                            }
                        }
                    }
                    WeightFormat::Q4_0 | WeightFormat::F32 => {
                        unreachable!("Q4_0 takes `rows`, f32 the row-by-row path")
                    }
                }
                let mut extras = [0.0f32; GROUP];
                // SAFETY: `extras` is 4 f32; unaligned store.
                unsafe { _mm_storeu_ps(extras.as_mut_ptr(), extra) };
                let mut out = [0.0f32; GROUP];
                for i in 0..GROUP {
                    let mut lanes = [0.0f32; 8];
                    // SAFETY: `lanes` is 8 f32; unaligned store.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i]) };
                    out[i] = super::super::portable::reduce8(lanes) + extras[i];
                }
                out
            }

            /// Weight rows `w` (`out.len()` of them, `row_bytes` apart) against one
            /// activation row `xq`, four weight rows at a time ([`quad`]): what a step of
            /// one row (a decode at batch 1) asks of every matrix.
            #[target_feature(enable = $features)]
            pub(super) fn weight_rows(
                format: WeightFormat,
                w: &[u8],
                row_bytes: usize,
                xq: &[BlockQ8],
                out: &mut [f32],
            ) {
                let mut o = 0;
                while o + QUAD <= out.len() {
                    let rows = &w[o * row_bytes..(o + QUAD) * row_bytes];
                    // The four after next, asked of memory now (a batch-1 step waits on
                    // weights more than it computes).
                    super::prefetch_range(
                        w,
                        (o + 2 * QUAD) * row_bytes..(o + 3 * QUAD) * row_bytes,
                    );
                    out[o..o + QUAD].copy_from_slice(&quad(format, rows, row_bytes, xq));
                    o += QUAD;
                }
                while o < out.len() {
                    let row = &w[o * row_bytes..(o + 1) * row_bytes];
                    out[o] = rows::<1>(format, row, xq, xq.len(), 0)[0];
                    o += 1;
                }
            }

            /// Four weight rows (`w`, `row_bytes` apart) against one activation row, as
            /// [`rows`] computes each pair: the activation block is loaded once for the
            /// four, their four scale pairs converted in one instruction and multiplied by
            /// the activation's scales in one more, and four running sums in registers keep
            /// the multiply-adds from waiting on each other. Lane by lane the same f32
            /// operations as one weight row at a time.
            #[target_feature(enable = $features)]
            fn quad(
                format: WeightFormat,
                w: &[u8],
                row_bytes: usize,
                xq: &[BlockQ8],
            ) -> [f32; QUAD] {
                let rows: [&[u8]; QUAD] =
                    std::array::from_fn(|j| &w[j * row_bytes..(j + 1) * row_bytes]);
                let mut acc = [_mm256_setzero_ps(); QUAD];
                // Q4_1: every lane pair's second lane is a row's extra term; Q4_0: lanes
                // 0..4 are the rows'.
                let mut extra = _mm256_setzero_ps();
                let lane = |i: usize| _mm256_set1_epi32(i as i32);
                // The f16 at `at` of each row's block `b` (`size` bytes a block).
                let half = |b: usize, size: usize, j: usize| {
                    let at = b * size;
                    u16::from_le_bytes([rows[j][at], rows[j][at + 1]])
                };
                match format {
                    WeightFormat::Q4_1 => {
                        let word = |b: usize, j: usize| {
                            let at = b * Q4_1_BYTES;
                            let r = &rows[j][at..at + 4];
                            i32::from_le_bytes([r[0], r[1], r[2], r[3]])
                        };
                        for (b, a) in xq.iter().enumerate() {
                            // [d0, m0, d1, m1, ...] times [a.d, a.s, a.d, a.s, ...]: every
                            // row's `d · a.d` and `m · a.s` in one multiply.
                            let pairs =
                                _mm_setr_epi32(word(b, 0), word(b, 1), word(b, 2), word(b, 3));
                            let dm = _mm256_cvtph_ps(pairs);
                            let scales = _mm256_setr_ps(a.d, a.s, a.d, a.s, a.d, a.s, a.d, a.s);
                            let prod = _mm256_mul_ps(dm, scales);
                            extra = _mm256_add_ps(extra, prod);
                            let aq = x86::load32_i8(&a.qs);
                            let at = b * Q4_1_BYTES + 4;
                            for j in 0..QUAD {
                                let wv = x86::nibbles(&rows[j][at..at + 16]);
                                let dd = _mm256_permutevar8x32_ps(prod, lane(2 * j));
                                let lanes = $lanes(wv, aq);
                                acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lanes), acc[j]);
                            }
                        }
                    }
                    WeightFormat::Q4_0 | WeightFormat::Q8_0 => {
                        let size = if format == WeightFormat::Q4_0 {
                            Q4_0_BYTES
                        } else {
                            Q8_0_BYTES
                        };
                        for (b, a) in xq.iter().enumerate() {
                            let ds = _mm_cvtph_ps(_mm_setr_epi16(
                                half(b, size, 0) as i16,
                                half(b, size, 1) as i16,
                                half(b, size, 2) as i16,
                                half(b, size, 3) as i16,
                                0,
                                0,
                                0,
                                0,
                            ));
                            let dd4 = _mm_mul_ps(ds, _mm_set1_ps(a.d));
                            let dd = _mm256_castps128_ps256(dd4);
                            let aq = x86::load32_i8(&a.qs);
                            let at = b * size + 2;
                            if format == WeightFormat::Q4_0 {
                                let off = _mm_set1_ps((-8 * a.sum) as f32);
                                let e = _mm_mul_ps(dd4, off);
                                extra = _mm256_castps128_ps256(_mm_add_ps(
                                    _mm256_castps256_ps128(extra),
                                    e,
                                ));
                                for j in 0..QUAD {
                                    let wv = x86::nibbles(&rows[j][at..at + 16]);
                                    let ddj = _mm256_permutevar8x32_ps(dd, lane(j));
                                    let lanes = $lanes(wv, aq);
                                    acc[j] =
                                        _mm256_fmadd_ps(ddj, _mm256_cvtepi32_ps(lanes), acc[j]);
                                }
                            } else {
                                for j in 0..QUAD {
                                    let wv = x86::load32(&rows[j][at..at + 32]);
                                    let abs = _mm256_sign_epi8(wv, wv);
                                    let ddj = _mm256_permutevar8x32_ps(dd, lane(j));
                                    let lanes = $lanes(abs, _mm256_sign_epi8(aq, wv));
                                    acc[j] =
                                        _mm256_fmadd_ps(ddj, _mm256_cvtepi32_ps(lanes), acc[j]);
                                }
                            }
                        }
                    }
                    WeightFormat::F32 => unreachable!("f32 weights take the row-by-row path"),
                }
                let mut extras = [0.0f32; 8];
                // SAFETY: `extras` is 8 f32; unaligned store.
                unsafe { _mm256_storeu_ps(extras.as_mut_ptr(), extra) };
                let mut out = [0.0f32; QUAD];
                for j in 0..QUAD {
                    let mut lanes = [0.0f32; 8];
                    // SAFETY: `lanes` is 8 f32; unaligned store.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[j]) };
                    let e = match format {
                        WeightFormat::Q4_1 => extras[2 * j + 1],
                        WeightFormat::Q4_0 => extras[j],
                        _ => 0.0,
                    };
                    out[j] = super::super::portable::reduce8(lanes) + e;
                }
                out
            }

            /// Rows `r0..r0 + R` of [`many`]: each row's 8 f32 lanes in a register and its
            /// extra term, over the blocks in order, with the portable path's operations
            /// (`portable::Lanes`).
            #[target_feature(enable = $features)]
            pub(super) fn rows<const R: usize>(
                format: WeightFormat,
                w: &[u8],
                xq: &[BlockQ8],
                blocks: usize,
                r0: usize,
            ) -> [f32; R] {
                let mut acc = [_mm256_setzero_ps(); R];
                let mut extra = [0.0f32; R];
                let at = |i: usize, b: usize| &xq[(r0 + i) * blocks + b];
                // acc += dd · lanes, fused (as the portable path).
                let scaled = |acc: __m256, dd: f32, lanes: __m256i| {
                    _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(lanes), acc)
                };
                match format {
                    WeightFormat::Q4_1 => {
                        for (b, wb) in w.chunks_exact(Q4_1_BYTES).enumerate() {
                            let (d, m) = f16_pair(wb);
                            let wv = x86::nibbles(&wb[4..]);
                            for i in 0..R {
                                let a = at(i, b);
                                let lanes = $lanes(wv, x86::load32_i8(&a.qs));
                                acc[i] = scaled(acc[i], d * a.d, lanes);
                                extra[i] += m * a.s;
                            }
                        }
                    }
                    WeightFormat::Q4_0 => {
                        for (b, wb) in w.chunks_exact(Q4_0_BYTES).enumerate() {
                            let d = f16_pair(wb).0;
                            let wv = x86::nibbles(&wb[2..]);
                            for i in 0..R {
                                let a = at(i, b);
                                let dd = d * a.d;
                                let lanes = $lanes(wv, x86::load32_i8(&a.qs));
                                acc[i] = scaled(acc[i], dd, lanes);
                                extra[i] += dd * (-8 * a.sum) as f32;
                            }
                        }
                    }
                    WeightFormat::Q8_0 => {
                        for (b, wb) in w.chunks_exact(Q8_0_BYTES).enumerate() {
                            let d = f16_pair(wb).0;
                            let wv = x86::load32(&wb[2..]);
                            let abs = _mm256_sign_epi8(wv, wv);
                            for (i, acc) in acc.iter_mut().enumerate() {
                                let a = at(i, b);
                                // Σ w·a as |w| · (a with w's sign): the instruction takes
                                // its first operand unsigned.
                                let lanes =
                                    $lanes(abs, _mm256_sign_epi8(x86::load32_i8(&a.qs), wv));
                                *acc = scaled(*acc, d * a.d, lanes);
                            }
                        }
                    }
                    WeightFormat::F32 => unreachable!("f32 weights take the row-by-row path"),
                }
                let mut out = [0.0f32; R];
                for i in 0..R {
                    let mut lanes = [0.0f32; 8];
                    // SAFETY: `lanes` is 8 f32; unaligned store.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i]) };
                    out[i] = super::super::portable::reduce8(lanes) + extra[i];
                }
                out
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
row_kernels!(avx2, "avx2,fma,f16c", x86::lanes_u8_i8);
#[cfg(target_arch = "x86_64")]
row_kernels!(vnni, "avx2,fma,f16c,avxvnni", x86::lanes_vnni);

/// AVX-512 with VNNI: two weight rows in one 512-bit register, each half a row's 8 lanes
/// exactly as the 256-bit kernels keep them (the halves never mix until each is reduced on
/// its own), so every (weight row, activation row) pair gets the same bits for half the
/// instructions.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::{BlockQ8, GroupScales, Q4_1_BYTES, Q8_0_BYTES, WeightFormat};
    use super::{GROUP, x86};
    use std::arch::x86_64::*;

    /// The 16 bytes of packed nibbles at `a[..16]` and at `b[..16]` as 64 bytes: `a`'s low
    /// nibbles, its high ones, then `b`'s (each half as `x86::nibbles` lays out a block).
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn nibble_pair(a: &[u8], b: &[u8]) -> __m512i {
        let (a, b) = (&a[..16], &b[..16]);
        // SAFETY: `a` and `b` are 16 bytes each; unaligned loads.
        let (va, vb) = unsafe {
            (
                _mm_loadu_si128(a.as_ptr().cast()),
                _mm_loadu_si128(b.as_ptr().cast()),
            )
        };
        let ab = _mm512_castsi256_si512(_mm256_set_m128i(vb, va));
        // 128-bit lanes [a, a, b, b]; the second of each shifted right by 4 bits.
        let dup = _mm512_shuffle_i64x2(ab, ab, 0b01_01_00_00);
        let shifted = _mm512_srlv_epi64(dup, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
        _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F))
    }

    /// `a[..32]` and `b[..32]` side by side.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn bytes_pair(a: &[u8], b: &[u8]) -> __m512i {
        let (a, b) = (&a[..32], &b[..32]);
        let lo = _mm512_castsi256_si512(x86::load32(a));
        _mm512_inserti64x4(lo, x86::load32(b), 1)
    }

    /// An activation block's 32 bytes in both halves.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn broadcast_qs(qs: &[i8; 32]) -> __m512i {
        _mm512_broadcast_i64x4(x86::load32_i8(qs))
    }

    /// `x86::lanes_vnni` of each half.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn lanes(u: __m512i, s: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s)
    }

    /// Q8_0's weights as unsigned magnitudes, and a mask of the negative ones: `a` with
    /// that mask negated is `_mm256_sign_epi8(a, w)` wherever `|w|` is not 0 (activations
    /// are within ±127: negating one is exact).
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn magnitudes(w: __m512i) -> (__m512i, __mmask64) {
        (_mm512_abs_epi8(w), _mm512_movepi8_mask(w))
    }

    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn signed(a: __m512i, negative: __mmask64) -> __m512i {
        _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a)
    }

    /// Each half of `acc` reduced as `portable::reduce8`, low half first.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn halves(acc: __m512) -> [f32; 2] {
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` is 16 f32; unaligned store.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        let half = |i: usize| {
            let mut l = [0.0f32; 8];
            l.copy_from_slice(&lanes[8 * i..8 * i + 8]);
            super::super::portable::reduce8(l)
        };
        [half(0), half(1)]
    }

    /// Lane `i` of `v` in the low half and lane `j` in the high half, each 8 times.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn spread(v: __m256, i: i32, j: i32) -> __m512 {
        let idx = _mm512_setr_epi32(i, i, i, i, i, i, i, i, j, j, j, j, j, j, j, j);
        _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v))
    }

    /// Weight rows `w` (`out.len()`, `row_bytes` apart) against one activation row, two at
    /// a time (Q4_1 and Q8_0; others, and a last odd row, take the 256-bit kernels).
    #[target_feature(enable = "avx2,fma,f16c,avxvnni,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) fn weight_rows(
        format: WeightFormat,
        w: &[u8],
        row_bytes: usize,
        xq: &[BlockQ8],
        out: &mut [f32],
    ) {
        if !matches!(format, WeightFormat::Q4_1 | WeightFormat::Q8_0) {
            return super::vnni::weight_rows(format, w, row_bytes, xq, out);
        }
        let mut o = 0;
        while o + 2 <= out.len() {
            let (a, b) = (
                &w[o * row_bytes..(o + 1) * row_bytes],
                &w[(o + 1) * row_bytes..(o + 2) * row_bytes],
            );
            // The pair after next, asked of memory now: a batch-1 step waits on weights
            // more than it computes.
            super::prefetch_range(w, (o + 4) * row_bytes..(o + 6) * row_bytes);
            out[o..o + 2].copy_from_slice(&pair(format, a, b, xq));
            o += 2;
        }
        if o < out.len() {
            let rest = &w[o * row_bytes..];
            super::vnni::weight_rows(format, rest, row_bytes, xq, &mut out[o..]);
        }
    }

    /// Two weight rows against one activation row.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn pair(format: WeightFormat, a: &[u8], b: &[u8], xq: &[BlockQ8]) -> [f32; 2] {
        let mut acc = _mm512_setzero_ps();
        let mut extra = _mm_setzero_ps();
        match format {
            WeightFormat::Q4_1 => {
                let blocks = a.chunks_exact(Q4_1_BYTES).zip(b.chunks_exact(Q4_1_BYTES));
                for ((wa, wb), x) in blocks.zip(xq) {
                    let word = |r: &[u8]| i32::from_le_bytes([r[0], r[1], r[2], r[3]]);
                    // [d_a, m_a, d_b, m_b] times [x.d, x.s, x.d, x.s].
                    let dm = _mm_cvtph_ps(_mm_setr_epi32(word(wa), word(wb), 0, 0));
                    let prod = _mm_mul_ps(dm, _mm_setr_ps(x.d, x.s, x.d, x.s));
                    extra = _mm_add_ps(extra, prod);
                    let wv = nibble_pair(&wa[4..], &wb[4..]);
                    let l = lanes(wv, broadcast_qs(&x.qs));
                    let dd = spread(_mm256_castps128_ps256(prod), 0, 2);
                    acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(l), acc);
                }
            }
            WeightFormat::Q8_0 => {
                let blocks = a.chunks_exact(Q8_0_BYTES).zip(b.chunks_exact(Q8_0_BYTES));
                for ((wa, wb), x) in blocks.zip(xq) {
                    let half = |r: &[u8]| i16::from_le_bytes([r[0], r[1]]);
                    let d = _mm_cvtph_ps(_mm_setr_epi16(half(wa), half(wb), 0, 0, 0, 0, 0, 0));
                    let dd = spread(
                        _mm256_castps128_ps256(_mm_mul_ps(d, _mm_set1_ps(x.d))),
                        0,
                        1,
                    );
                    let (abs, negative) = magnitudes(bytes_pair(&wa[2..], &wb[2..]));
                    let l = lanes(abs, signed(broadcast_qs(&x.qs), negative));
                    acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(l), acc);
                }
            }
            _ => unreachable!("weight_rows sends other formats to the 256-bit kernels"),
        }
        let [sa, sb] = halves(acc);
        if format == WeightFormat::Q4_1 {
            let mut e = [0.0f32; 4];
            // SAFETY: `e` is 4 f32; unaligned store.
            unsafe { _mm_storeu_ps(e.as_mut_ptr(), extra) };
            [sa + e[1], sb + e[3]]
        } else {
            [sa, sb]
        }
    }

    /// Weight rows `w` (`m` of them, `row_bytes` apart) against whole groups of activation
    /// rows (`xq`: `rows` of `blocks` blocks; `scales`: their [`GroupScales`]):
    /// `out[r * out_stride + o]`, two weight rows and a group at a time (Q4_1 and Q8_0;
    /// others, and a last odd row, take the 256-bit kernels).
    #[target_feature(enable = "avx2,fma,f16c,avxvnni,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grid(
        format: WeightFormat,
        w: &[u8],
        row_bytes: usize,
        m: usize,
        xq: &[BlockQ8],
        scales: &[GroupScales],
        blocks: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let rows = xq.len() / blocks;
        let paired = if matches!(format, WeightFormat::Q4_1 | WeightFormat::Q8_0) {
            m / 2 * 2
        } else {
            0
        };
        for o in (0..paired).step_by(2) {
            let (a, b) = (
                &w[o * row_bytes..(o + 1) * row_bytes],
                &w[(o + 1) * row_bytes..(o + 2) * row_bytes],
            );
            super::prefetch_range(w, (o + 4) * row_bytes..(o + 6) * row_bytes);
            // Four groups at a time (sixteen rows: each weight block unpacked once for
            // them), then what is left.
            let (groups, mut g0) = (rows / GROUP, 0);
            while g0 < groups {
                let sums: &[[[f32; GROUP]; 2]] = match groups - g0 {
                    1 => &groups_pair::<1>(format, a, b, xq, scales, blocks, g0),
                    2 => &groups_pair::<2>(format, a, b, xq, scales, blocks, g0),
                    3 => &groups_pair::<3>(format, a, b, xq, scales, blocks, g0),
                    _ => &groups_pair::<4>(format, a, b, xq, scales, blocks, g0),
                };
                for (g, [sa, sb]) in sums.iter().enumerate() {
                    for (i, (va, vb)) in sa.iter().zip(sb).enumerate() {
                        let at = ((g0 + g) * GROUP + i) * out_stride + o;
                        out[at] = *va;
                        out[at + 1] = *vb;
                    }
                }
                g0 += sums.len();
            }
        }
        let mut sums = vec![0.0f32; rows];
        for o in paired..m {
            let row = &w[o * row_bytes..(o + 1) * row_bytes];
            super::vnni::many(format, row, xq, scales, blocks, &mut sums);
            for (r, v) in sums.iter().enumerate() {
                out[r * out_stride + o] = *v;
            }
        }
    }

    /// Two weight rows against the `G` groups of activation rows from group `g0` (`scales`:
    /// every group's): for each group `[row a's, row b's]`, as `vnni::group` computes each.
    /// Each weight block is unpacked once for all `G · GROUP` rows.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    fn groups_pair<const G: usize>(
        format: WeightFormat,
        a: &[u8],
        b: &[u8],
        xq: &[BlockQ8],
        scales: &[GroupScales],
        blocks: usize,
        g0: usize,
    ) -> [[[f32; GROUP]; 2]; G] {
        let mut acc = [[_mm512_setzero_ps(); GROUP]; G];
        // Per group: row a's extra terms in lanes 0..4, row b's in 4..8.
        let mut extra = [_mm256_setzero_ps(); G];
        let rows: [[&[BlockQ8]; GROUP]; G] = std::array::from_fn(|g| {
            std::array::from_fn(|i| {
                let r = (g0 + g) * GROUP + i;
                &xq[r * blocks..(r + 1) * blocks]
            })
        });
        let group_scales: [&[GroupScales]; G] =
            std::array::from_fn(|g| &scales[(g0 + g) * blocks..(g0 + g + 1) * blocks]);
        // The activations' `d` (0) or `s` (1) of a group, twice: [x0..x3, x0..x3].
        let twice = |s: &GroupScales, which: usize| {
            let v = &s[4 * which..4 * which + 4];
            // SAFETY: `v` is 4 f32; unaligned load.
            let v = unsafe { _mm_loadu_ps(v.as_ptr()) };
            _mm256_set_m128(v, v)
        };
        match format {
            WeightFormat::Q4_1 => {
                let blocks_ab = a.chunks_exact(Q4_1_BYTES).zip(b.chunks_exact(Q4_1_BYTES));
                for (blk, (wa, wb)) in blocks_ab.enumerate() {
                    let word = |r: &[u8]| i32::from_le_bytes([r[0], r[1], r[2], r[3]]);
                    // [d_a, m_a, d_b, m_b] as [d_a ×4, d_b ×4] and [m_a ×4, m_b ×4].
                    let dm = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_setr_epi32(
                        word(wa),
                        word(wb),
                        0,
                        0,
                    )));
                    let d = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
                    let mm =
                        _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
                    let wv = nibble_pair(&wa[4..], &wb[4..]);
                    for g in 0..G {
                        let s = &group_scales[g][blk];
                        let dd = _mm256_mul_ps(d, twice(s, 0));
                        extra[g] = _mm256_add_ps(extra[g], _mm256_mul_ps(mm, twice(s, 1)));
                        for (i, acc) in acc[g].iter_mut().enumerate() {
                            let l = lanes(wv, broadcast_qs(&rows[g][i][blk].qs));
                            let ddi = spread(dd, i as i32, 4 + i as i32);
                            *acc = _mm512_fmadd_ps(ddi, _mm512_cvtepi32_ps(l), *acc);
                        }
                    }
                }
            }
            WeightFormat::Q8_0 => {
                let blocks_ab = a.chunks_exact(Q8_0_BYTES).zip(b.chunks_exact(Q8_0_BYTES));
                for (blk, (wa, wb)) in blocks_ab.enumerate() {
                    let half = |r: &[u8]| i16::from_le_bytes([r[0], r[1]]);
                    let d2 = _mm_cvtph_ps(_mm_setr_epi16(half(wa), half(wb), 0, 0, 0, 0, 0, 0));
                    let d = _mm256_permutevar8x32_ps(
                        _mm256_castps128_ps256(d2),
                        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                    );
                    let (abs, negative) = magnitudes(bytes_pair(&wa[2..], &wb[2..]));
                    for g in 0..G {
                        let dd = _mm256_mul_ps(d, twice(&group_scales[g][blk], 0));
                        for (i, acc) in acc[g].iter_mut().enumerate() {
                            let qs = broadcast_qs(&rows[g][i][blk].qs);
                            let l = lanes(abs, signed(qs, negative));
                            let ddi = spread(dd, i as i32, 4 + i as i32);
                            *acc = _mm512_fmadd_ps(ddi, _mm512_cvtepi32_ps(l), *acc);
                        }
                    }
                }
            }
            _ => unreachable!("grid sends other formats to the 256-bit kernels"),
        }
        let mut out = [[[0.0f32; GROUP]; 2]; G];
        for g in 0..G {
            let mut extras = [0.0f32; 8];
            if format == WeightFormat::Q4_1 {
                // SAFETY: `extras` is 8 f32; unaligned store.
                unsafe { _mm256_storeu_ps(extras.as_mut_ptr(), extra[g]) };
            }
            for (i, acc) in acc[g].iter().enumerate() {
                let [sa, sb] = halves(*acc);
                out[g][0][i] = sa + extras[i];
                out[g][1][i] = sb + extras[4 + i];
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn dot_rows_avx512(
    format: super::WeightFormat,
    w: &[u8],
    row_bytes: usize,
    xq: &[BlockQ8],
    out: &mut [f32],
) {
    // SAFETY: see the module's contract (callers checked `avx512_available`).
    unsafe { avx512::weight_rows(format, w, row_bytes, xq, out) }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) fn dot_grid_avx512(
    format: super::WeightFormat,
    w: &[u8],
    row_bytes: usize,
    m: usize,
    xq: &[BlockQ8],
    scales: &[GroupScales],
    blocks: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: see the module's contract (callers checked `avx512_available`).
    unsafe { avx512::grid(format, w, row_bytes, m, xq, scales, blocks, out, out_stride) }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    // SAFETY: see the module's contract (callers checked `avx2_available`).
    unsafe { x86::dot_f32(w, x) }
}

/// Weight rows `w` (`out.len()`, `row_bytes` apart) against one activation row (see
/// `Kernels::dot_rows`; `vnni` as in [`dot_many`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn dot_rows(
    format: super::WeightFormat,
    w: &[u8],
    row_bytes: usize,
    xq: &[BlockQ8],
    out: &mut [f32],
    vnni: bool,
) {
    if vnni {
        // SAFETY: see the module's contract (callers checked `vnni_available`).
        unsafe { vnni::weight_rows(format, w, row_bytes, xq, out) }
    } else {
        // SAFETY: see the module's contract (callers checked `avx2_available`).
        unsafe { avx2::weight_rows(format, w, row_bytes, xq, out) }
    }
}

/// One weight row with one activation row (`vnni` as in [`dot_many`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn dot_one(format: super::WeightFormat, w: &[u8], xq: &[BlockQ8], vnni: bool) -> f32 {
    let mut out = [0.0f32];
    dot_many(format, w, xq, &[], xq.len(), &mut out, vnni);
    out[0]
}

// Other targets have no SIMD path yet: `avx2_available` is false there, so these are never
// reached; they exist so that `Kernels` compiles everywhere.
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn dot_many(
    _: super::WeightFormat,
    _: &[u8],
    _: &[BlockQ8],
    _: &[GroupScales],
    _: usize,
    _: &mut [f32],
    _: bool,
) {
    unreachable!("no SIMD kernels on this target: avx2_available is false")
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn dot_rows(
    _: super::WeightFormat,
    _: &[u8],
    _: usize,
    _: &[BlockQ8],
    _: &mut [f32],
    _: bool,
) {
    unreachable!("no SIMD kernels on this target: avx2_available is false")
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn dot_rows_avx512(
    _: super::WeightFormat,
    _: &[u8],
    _: usize,
    _: &[BlockQ8],
    _: &mut [f32],
) {
    unreachable!("no SIMD kernels on this target: avx2_available is false")
}
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub(super) fn dot_grid_avx512(
    _: super::WeightFormat,
    _: &[u8],
    _: usize,
    _: usize,
    _: &[BlockQ8],
    _: &[GroupScales],
    _: usize,
    _: &mut [f32],
    _: usize,
) {
    unreachable!("no SIMD kernels on this target: avx2_available is false")
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn dot_one(_: super::WeightFormat, _: &[u8], _: &[BlockQ8], _: bool) -> f32 {
    unreachable!("no SIMD kernels on this target: avx2_available is false")
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn dot_f32s(a: &[f32], b: &[f32]) -> f32 {
    super::portable::dot_f32s(a, b)
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    super::portable::axpy(w, x, y)
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    super::portable::quantize_q8(x, out)
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn dot_f32_f16(a: &[f32], b: &[u8]) -> f32 {
    super::portable::dot_f32_f16(a, b)
}
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub(super) fn scores_f16(
    _: &[f32],
    _: usize,
    _: &[u8],
    _: usize,
    _: usize,
    _: f32,
    _: &mut [f32],
    _: usize,
) {
    unreachable!("no SIMD kernels on this target: avx2_available is false")
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn weighted_f16(
    _: &[f32],
    _: usize,
    _: &[u8],
    _: usize,
    _: usize,
    _: usize,
    _: &mut [f32],
) {
    unreachable!("no SIMD kernels on this target: avx2_available is false")
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn axpy_f16(w: f32, x: &[u8], y: &mut [f32]) {
    super::portable::axpy_f16(w, x, y)
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
    super::portable::f16_to_f32(src, dst)
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    super::portable::dot_f32(w, x)
}

const _: () = assert!(QK == 32, "the SIMD kernels read 32-value blocks");
