//! Scalar, portable dequantizers: ggml's reference `dequantize_row_*` (ggml/src/ggml-quants.c)
//! and its f16/bf16 conversions (ggml/src/ggml-impl.h).
//!
//! Each function takes whole blocks: the caller ([`super::dequantize_row`]) has checked that
//! `src` is `dst.len() / block_size` blocks. The expressions are ggml's, in ggml's order.
//!
//! Why the results equal the reference bit for bit, whatever the order or the compiler: an
//! f16 scale has at most 11 significant bits, and every factor it meets is a small integer
//! (quants of at most 8 bits, 6-bit K-quant scales, Q6_K's 8-bit scales times 6-bit quants),
//! so every product below is exact in f32 (at most 24 significant bits). The only rounding is
//! the final addition of Q4_1's `m` and the K-quants' `dmin * m`; with an exact product an
//! FMA rounds that sum the same way, so a compiler contracting `a*b - c` (as C compilers may)
//! cannot change the bits either. gguf-py's numpy code and these functions therefore agree
//! with ggml's `dequantize_row_*` exactly; tests/gguf_interop.rs checks it.

use half::f16 as F16;

use super::QK_K;

/// ggml's `GGML_FP16_TO_FP32`: exact for every finite value and infinity; NaNs come out quiet
/// with their payload, as ggml's software conversion and the F16C/NEON instructions give.
fn f16_le(lo: u8, hi: u8) -> f32 {
    F16::from_le_bytes([lo, hi]).to_f32()
}

pub(super) fn f32(src: &[u8], dst: &mut [f32]) {
    let (words, _) = src.as_chunks::<4>();
    for (out, w) in dst.iter_mut().zip(words) {
        *out = f32::from_le_bytes(*w);
    }
}

pub(super) fn f16(src: &[u8], dst: &mut [f32]) {
    let (halves, _) = src.as_chunks::<2>();
    for (out, h) in dst.iter_mut().zip(halves) {
        *out = f16_le(h[0], h[1]);
    }
}

/// ggml's `GGML_BF16_TO_FP32`: the 16 bits become the top of an f32, NaN payloads and all.
pub(super) fn bf16(src: &[u8], dst: &mut [f32]) {
    let (halves, _) = src.as_chunks::<2>();
    for (out, h) in dst.iter_mut().zip(halves) {
        *out = f32::from_bits(u32::from(u16::from_le_bytes(*h)) << 16);
    }
}

/// `block_q8_0`: f16 `d`, then 32 `i8` quants; `x = q * d`.
pub(super) fn q8_0(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<34>();
    let (outs, _) = dst.as_chunks_mut::<32>();
    for (b, y) in blocks.iter().zip(outs) {
        let d = f16_le(b[0], b[1]);
        for j in 0..32 {
            y[j] = f32::from(b[2 + j] as i8) * d;
        }
    }
}

/// `block_q4_0`: f16 `d`, then 16 bytes of nibbles; the low nibble of byte `j` is element
/// `j`, the high one element `j + 16`; `x = (q - 8) * d`.
pub(super) fn q4_0(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<18>();
    let (outs, _) = dst.as_chunks_mut::<32>();
    for (b, y) in blocks.iter().zip(outs) {
        let d = f16_le(b[0], b[1]);
        for j in 0..16 {
            let q = b[2 + j];
            let x0 = i32::from(q & 0x0F) - 8;
            let x1 = i32::from(q >> 4) - 8;
            y[j] = x0 as f32 * d;
            y[j + 16] = x1 as f32 * d;
        }
    }
}

/// `block_q4_1`: f16 `d`, f16 `m`, then nibbles laid out as in Q4_0; `x = q * d + m`.
pub(super) fn q4_1(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<20>();
    let (outs, _) = dst.as_chunks_mut::<32>();
    for (b, y) in blocks.iter().zip(outs) {
        let d = f16_le(b[0], b[1]);
        let m = f16_le(b[2], b[3]);
        for j in 0..16 {
            let q = b[4 + j];
            y[j] = f32::from(q & 0x0F) * d + m;
            y[j + 16] = f32::from(q >> 4) * d + m;
        }
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) from the 12
/// packed bytes of a Q4_K/Q5_K block. Sub-blocks 0..4 keep theirs in the low 6 bits of bytes
/// `j` and `j + 4`; 4..8 keep the low 4 bits in byte `j + 4` and the top 2 in the spare high
/// bits of bytes `j - 4` and `j`.
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 12 scale bytes at `at` in a K-quant block.
fn scales_at<const N: usize>(b: &[u8; N], at: usize) -> [u8; 12] {
    let mut s = [0u8; 12];
    s.copy_from_slice(&b[at..at + 12]);
    s
}

/// `block_q4_K`: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
/// 32, then 128 bytes of nibbles: each 32 bytes hold two sub-blocks, the low nibbles the first
/// and the high nibbles the second. `x = (d * sc) * q - (dmin * m)`.
pub(super) fn q4_k(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<144>();
    let (outs, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(outs) {
        let d = f16_le(b[0], b[1]);
        let min = f16_le(b[2], b[3]);
        let scales = scales_at(b, 4);
        let qs = &b[16..];
        for chunk in 0..4 {
            let (sc, m) = scale_min_k4(2 * chunk, &scales);
            let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
            let (sc, m) = scale_min_k4(2 * chunk + 1, &scales);
            let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
            let q = &qs[32 * chunk..32 * chunk + 32];
            let y = &mut y[64 * chunk..64 * chunk + 64];
            for l in 0..32 {
                y[l] = d1 * f32::from(q[l] & 0x0F) - m1;
                y[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
            }
        }
    }
}

/// `block_q5_K`: as Q4_K, with 32 bytes of fifth bits (`qh`) between the scales and the
/// nibbles: bit `2c` of `qh[l]` belongs to element `l` of the first sub-block of chunk `c`,
/// bit `2c + 1` to element `l` of the second. `x = (d * sc) * (q + 16 * hi) - (dmin * m)`.
pub(super) fn q5_k(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<176>();
    let (outs, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(outs) {
        let d = f16_le(b[0], b[1]);
        let min = f16_le(b[2], b[3]);
        let scales = scales_at(b, 4);
        let qh = &b[16..48];
        let qs = &b[48..];
        for chunk in 0..4 {
            let (sc, m) = scale_min_k4(2 * chunk, &scales);
            let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
            let (sc, m) = scale_min_k4(2 * chunk + 1, &scales);
            let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
            let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
            let ql = &qs[32 * chunk..32 * chunk + 32];
            let y = &mut y[64 * chunk..64 * chunk + 64];
            for l in 0..32 {
                let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * f32::from((ql[l] & 0x0F) + hi1) - m1;
                y[l + 32] = d2 * f32::from((ql[l] >> 4) + hi2) - m2;
            }
        }
    }
}

/// `block_q6_K`: 128 bytes of low nibbles (`ql`), 64 bytes of high 2-bit pairs (`qh`), 16
/// `i8` scales (one per 16 elements), then f16 `d`. Each half of 128 elements reads 64 bytes of
/// `ql`, 32 of `qh` and 8 scales. `x = (d * sc) * (q - 32)`.
pub(super) fn q6_k(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<210>();
    let (outs, _) = dst.as_chunks_mut::<QK_K>();
    for (b, y) in blocks.iter().zip(outs) {
        let d = f16_le(b[208], b[209]);
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let sc = &b[192 + 8 * half..192 + 8 * half + 8];
            let y = &mut y[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = i32::from((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32;
                let q2 = i32::from((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
                let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                // `(d * sc) * q`, left to right as ggml's `d * sc[is] * q1` (exact anyway).
                y[l] = d * f32::from(sc[is] as i8) * q1 as f32;
                y[l + 32] = d * f32::from(sc[is + 2] as i8) * q2 as f32;
                y[l + 64] = d * f32::from(sc[is + 4] as i8) * q3 as f32;
                y[l + 96] = d * f32::from(sc[is + 6] as i8) * q4 as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Hand-built blocks with values chosen so that every product is exact: the expected
    //! numbers are plain arithmetic on the quants the test packed, so a wrong bit layout (or a
    //! wrong scale unpacking) shows. Bitwise agreement with the reference on random blocks is
    //! tests/gguf_interop.rs's job.
    use super::super::{GgmlType, dequantize_row};

    const ONE: [u8; 2] = [0x00, 0x3C]; // f16 1.0
    const HALF: [u8; 2] = [0x00, 0x38]; // f16 0.5
    const QUARTER: [u8; 2] = [0x00, 0x34]; // f16 0.25
    const MINUS_ONE: [u8; 2] = [0x00, 0xBC]; // f16 -1.0

    fn run(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; n];
        dequantize_row(ty, src, &mut out).unwrap();
        out
    }

    #[test]
    fn floats() {
        let src: Vec<u8> = [1.5f32, -0.0, f32::INFINITY]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let out = run(GgmlType::F32, &src, 3);
        assert_eq!(out[0].to_bits(), 1.5f32.to_bits());
        assert_eq!(out[1].to_bits(), (-0.0f32).to_bits());
        assert_eq!(out[2], f32::INFINITY);

        // f16: 1.0, the smallest subnormal 2^-24, -65504, and a signalling NaN 0x7C01, which
        // ggml's conversions return quiet (0x7FC02000; numpy's astype keeps it signalling).
        let src = [0x00, 0x3C, 0x01, 0x00, 0xFF, 0xFB, 0x01, 0x7C];
        let out = run(GgmlType::F16, &src, 4);
        assert_eq!(out[0], 1.0);
        assert_eq!(out[1], 2f32.powi(-24));
        assert_eq!(out[2], -65504.0);
        assert_eq!(out[3].to_bits(), 0x7FC0_2000);

        // bf16 keeps every bit, a signalling NaN's included.
        let src = [0x80, 0x3F, 0x81, 0x7F];
        let out = run(GgmlType::BF16, &src, 2);
        assert_eq!(out[0], 1.0);
        assert_eq!(out[1].to_bits(), 0x7F81_0000);
    }

    #[test]
    fn q8_0() {
        let mut b = HALF.to_vec();
        b.extend((0..32).map(|j: i32| (j * 8 - 128) as i8 as u8));
        let out = run(GgmlType::Q8_0, &b, 32);
        for (j, x) in out.iter().enumerate() {
            assert_eq!(*x, (j as f32 * 8.0 - 128.0) * 0.5, "element {j}");
        }
    }

    #[test]
    fn q4_0_and_q4_1() {
        // byte j holds element j (low nibble, j) and element j + 16 (high nibble, 15 - j).
        let nibbles: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let mut b = HALF.to_vec();
        b.extend(&nibbles);
        let out = run(GgmlType::Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], (7.0 - j as f32) * 0.5);
        }

        let mut b = QUARTER.to_vec();
        b.extend(MINUS_ONE);
        b.extend(&nibbles);
        let out = run(GgmlType::Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.25 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.25 - 1.0);
        }
    }

    /// Packs 8 six-bit (scale, min) pairs as ggml's `quantize_row_q4_K_ref` does.
    fn pack_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                s[j] = sc[j];
                s[j + 4] = m[j];
            } else {
                s[j + 4] = (sc[j] & 0x0F) | ((m[j] & 0x0F) << 4);
                s[j - 4] |= (sc[j] >> 4) << 6;
                s[j] |= (m[j] >> 4) << 6;
            }
        }
        s
    }

    // Scales and mins that use the high bits of sub-blocks 4..8.
    const SC: [u8; 8] = [1, 2, 3, 63, 17, 33, 48, 62];
    const MN: [u8; 8] = [0, 5, 63, 7, 16, 40, 1, 59];

    /// Element `e` of a K-quant test block: a 0..=31 pattern that differs per sub-block.
    fn q5(e: usize) -> u8 {
        ((e * 7 + e / 32) % 32) as u8
    }

    #[test]
    fn q4_k() {
        let mut b = ONE.to_vec();
        b.extend(HALF);
        b.extend(pack_scales(SC, MN));
        let mut qs = [0u8; 128];
        for e in 0..256 {
            let (chunk, sub, l) = (e / 64, (e / 32) % 2, e % 32);
            qs[32 * chunk + l] |= (q5(e) & 0x0F) << (4 * sub);
        }
        b.extend(qs);
        let out = run(GgmlType::Q4_K, &b, 256);
        for (e, x) in out.iter().enumerate() {
            let s = e / 32;
            let want = f32::from(SC[s]) * f32::from(q5(e) & 0x0F) - 0.5 * f32::from(MN[s]);
            assert_eq!(*x, want, "element {e}");
        }
    }

    #[test]
    fn q5_k() {
        let mut b = ONE.to_vec();
        b.extend(HALF);
        b.extend(pack_scales(SC, MN));
        let mut qh = [0u8; 32];
        let mut qs = [0u8; 128];
        for e in 0..256 {
            let (chunk, sub, l) = (e / 64, (e / 32) % 2, e % 32);
            qs[32 * chunk + l] |= (q5(e) & 0x0F) << (4 * sub);
            qh[l] |= (q5(e) >> 4) << (2 * chunk + sub);
        }
        b.extend(qh);
        b.extend(qs);
        let out = run(GgmlType::Q5_K, &b, 256);
        for (e, x) in out.iter().enumerate() {
            let s = e / 32;
            let want = f32::from(SC[s]) * f32::from(q5(e)) - 0.5 * f32::from(MN[s]);
            assert_eq!(*x, want, "element {e}");
        }
    }

    #[test]
    fn q6_k() {
        let q6 = |e: usize| ((e * 5 + e / 16) % 64) as u8;
        let scales: [i8; 16] = [
            1, -1, 2, -2, 3, 127, -128, 0, 5, -7, 9, 11, -13, 15, 17, -19,
        ];
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for e in 0..256 {
            // Element e sits in half h at position p: p / 32 picks which of ql's two 32-byte
            // runs (and which nibble), and which 2-bit pair of qh[l].
            let (h, p) = (e / 128, e % 128);
            let (quarter, l) = (p / 32, p % 32);
            let q = q6(e);
            ql[64 * h + 32 * (quarter % 2) + l] |= (q & 0x0F) << (4 * (quarter / 2));
            qh[32 * h + l] |= (q >> 4) << (2 * quarter);
        }
        let mut b = ql.to_vec();
        b.extend(qh);
        b.extend(scales.map(|s| s as u8));
        b.extend(HALF);
        let out = run(GgmlType::Q6_K, &b, 256);
        for (e, x) in out.iter().enumerate() {
            let want = 0.5 * f32::from(scales[e / 16]) * (f32::from(q6(e)) - 32.0);
            assert_eq!(*x, want, "element {e}");
        }
    }

    #[test]
    fn several_blocks_in_one_call() {
        let mut src = Vec::new();
        for d in [ONE, HALF, QUARTER] {
            src.extend(d);
            src.extend([0x11u8; 32]);
        }
        let out = run(GgmlType::Q8_0, &src, 96);
        assert_eq!((out[0], out[32], out[64]), (17.0, 8.5, 4.25));
    }
}
