//! Attention over f16 K and V for a few query heads at a time (see `Kernels::scores_f16` and
//! `Kernels::weighted_f16`).

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
