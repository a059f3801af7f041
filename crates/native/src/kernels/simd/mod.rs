//! The SIMD kernels (x86-64 AVX2, AVX-VNNI and AVX-512 VNNI) and prefetches: with its
//! sub-modules, the one module of this crate's kernels with `unsafe`.
//!
//! Here: feature detection, the entry points `Kernels` calls, the f32 / f16 helpers and the
//! activation quantizer. `x86`: the 256-bit building blocks; `rows`: the 256-bit matrix
//! kernels (generated for AVX2 and for AVX-VNNI); `avx512`: the 512-bit ones; `attn`:
//! attention over f16 K and V.
//!
//! Each function here computes exactly what its namesake in `portable` computes, bit for
//! bit: a block's 8 integer lane sums are exact whatever adds them, and the f32 operations
//! that follow are the same ones lane by lane, in the same order (`tests.rs` checks every
//! path against the portable one on random data).
//!
//! Safety contract, shared by every block here and in the sub-modules: the `avx2` + `fma` target features are
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

/// Whether the CPU has AVX-512 (F, BW, VL) with its VNNI (on top of [`avx2_available`]);
/// AVX-VNNI is not needed (the 256-bit kernels take `vpdpbusd`'s EVEX form then).
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
mod x86;

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
mod attn;

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

/// The instruction the 256-bit kernels sum a block's byte products with: all three give the
/// same exact sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lanes {
    /// AVX2's `maddubs` + `madd` (callers checked [`avx2_available`]).
    Avx2,
    /// AVX-VNNI's `vpdpbusd` (callers checked [`vnni_available`]).
    AvxVnni,
    /// AVX-512 VL's `vpdpbusd` on 256-bit registers (callers checked [`avx512_available`]).
    Avx512Vl,
}

/// One weight row against several activation rows (see `Kernels::dot_many`): each weight
/// block is unpacked and its scales converted once, then met with every row's block; each
/// row's sum still runs over the blocks in order, with the portable path's f32 operations.
#[cfg(target_arch = "x86_64")]
pub(super) fn dot_many(
    format: super::WeightFormat,
    w: &[u8],
    xq: &[BlockQ8],
    scales: &[GroupScales],
    blocks: usize,
    out: &mut [f32],
    lanes: Lanes,
) {
    // SAFETY (each arm): see the module's contract; `lanes` names what the callers checked.
    match lanes {
        Lanes::Avx2 => unsafe { avx2::many(format, w, xq, scales, blocks, out) },
        Lanes::AvxVnni => unsafe { vnni::many(format, w, xq, scales, blocks, out) },
        Lanes::Avx512Vl => unsafe { vnni512::many(format, w, xq, scales, blocks, out) },
    }
}

/// Activation rows a weight block is unpacked for at once.
#[cfg(target_arch = "x86_64")]
const GROUP: usize = super::GROUP_ROWS;

/// Weight rows one activation row meets at once (`weight_rows`).
#[cfg(target_arch = "x86_64")]
const QUAD: usize = 4;

/// The 256-bit row kernels, AVX2, AVX-VNNI and AVX-512 VL (`rows.rs`).
#[cfg(target_arch = "x86_64")]
mod rows;
#[cfg(target_arch = "x86_64")]
use rows::{avx2, vnni, vnni512};

/// AVX-512 with VNNI: two weight rows in one 512-bit register, each half a row's 8 lanes
/// exactly as the 256-bit kernels keep them (the halves never mix until each is reduced on
/// its own), so every (weight row, activation row) pair gets the same bits for half the
/// instructions.
#[cfg(target_arch = "x86_64")]
mod avx512;

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
/// `Kernels::dot_rows`).
#[cfg(target_arch = "x86_64")]
pub(super) fn dot_rows(
    format: super::WeightFormat,
    w: &[u8],
    row_bytes: usize,
    xq: &[BlockQ8],
    out: &mut [f32],
    lanes: Lanes,
) {
    // SAFETY (each arm): see the module's contract; `lanes` names what the callers checked.
    match lanes {
        Lanes::Avx2 => unsafe { avx2::weight_rows(format, w, row_bytes, xq, out) },
        Lanes::AvxVnni => unsafe { vnni::weight_rows(format, w, row_bytes, xq, out) },
        Lanes::Avx512Vl => unsafe { vnni512::weight_rows(format, w, row_bytes, xq, out) },
    }
}

/// One weight row with one activation row.
#[cfg(target_arch = "x86_64")]
pub(super) fn dot_one(format: super::WeightFormat, w: &[u8], xq: &[BlockQ8], lanes: Lanes) -> f32 {
    let mut out = [0.0f32];
    dot_many(format, w, xq, &[], xq.len(), &mut out, lanes);
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
    _: Lanes,
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
    _: Lanes,
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
pub(super) fn dot_one(_: super::WeightFormat, _: &[u8], _: &[BlockQ8], _: Lanes) -> f32 {
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
