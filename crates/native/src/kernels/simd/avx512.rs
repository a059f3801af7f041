//! The AVX-512 VNNI kernels: two weight rows in one 512-bit register (see `Kernels::dot_rows`
//! and `Kernels::dot_grid`).

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
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn weight_rows(
    format: WeightFormat,
    w: &[u8],
    row_bytes: usize,
    xq: &[BlockQ8],
    out: &mut [f32],
) {
    if !matches!(format, WeightFormat::Q4_1 | WeightFormat::Q8_0) {
        return super::vnni512::weight_rows(format, w, row_bytes, xq, out);
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
        super::vnni512::weight_rows(format, rest, row_bytes, xq, &mut out[o..]);
    }
}

/// Two weight rows against one activation row.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
        super::vnni512::many(format, row, xq, scales, blocks, &mut sums);
        for (r, v) in sums.iter().enumerate() {
            out[r * out_stride + o] = *v;
        }
    }
}

/// Two weight rows against the `G` groups of activation rows from group `g0` (`scales`:
/// every group's): for each group `[row a's, row b's]`, as `vnni512::group` computes each.
/// Each weight block is unpacked once for all `G · GROUP` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
                let dm =
                    _mm256_castps128_ps256(_mm_cvtph_ps(_mm_setr_epi32(word(wa), word(wb), 0, 0)));
                let d = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
                let mm = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
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
