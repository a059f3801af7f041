//! The 256-bit row kernels: one weight row against a group of activation rows, or a few
//! weight rows against one activation row, generated for AVX2, for AVX-VNNI and for AVX-512
//! VL with its VNNI.

/// `many` and `rows` for one set of target features and one block-lanes instruction: the
/// AVX2 pair (`maddubs` + `madd`) or `vpdpbusd` (VEX or EVEX). Generated per set so that each
/// copy is compiled (and its lanes function inlined) with its own features.
macro_rules! row_kernels {
    ($module:ident, $features:literal, $lanes:path) => {
        pub(super) mod $module {
            use crate::kernels::simd::{GROUP, QUAD, f16_pair, x86};
            use crate::kernels::{
                BlockQ8, GroupScales, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, WeightFormat,
            };
            use std::arch::x86_64::*;

            #[target_feature(enable = $features)]
            pub(in crate::kernels::simd) fn many(
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
                    out[i] = crate::kernels::portable::reduce8(lanes) + extras[i];
                }
                out
            }

            /// Weight rows `w` (`out.len()` of them, `row_bytes` apart) against one
            /// activation row `xq`, four weight rows at a time ([`quad`]): what a step of
            /// one row (a decode at batch 1) asks of every matrix.
            #[target_feature(enable = $features)]
            pub(in crate::kernels::simd) fn weight_rows(
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
                    crate::kernels::simd::prefetch_range(
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
                    out[j] = crate::kernels::portable::reduce8(lanes) + e;
                }
                out
            }

            /// Rows `r0..r0 + R` of [`many`]: each row's 8 f32 lanes in a register and its
            /// extra term, over the blocks in order, with the portable path's operations
            /// (`portable::Lanes`).
            #[target_feature(enable = $features)]
            pub(in crate::kernels::simd) fn rows<const R: usize>(
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
                    out[i] = crate::kernels::portable::reduce8(lanes) + extra[i];
                }
                out
            }
        }
    };
}

row_kernels!(
    avx2,
    "avx2,fma,f16c",
    crate::kernels::simd::x86::lanes_u8_i8
);
row_kernels!(
    vnni,
    "avx2,fma,f16c,avxvnni",
    crate::kernels::simd::x86::lanes_vnni
);
row_kernels!(
    vnni512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    crate::kernels::simd::x86::lanes_vnni512
);
