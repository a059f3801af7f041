//! The portable kernels: plain Rust, the reference for the SIMD ones.
//!
//! Each quantized dot product sums every block's integer products exactly (i32), turns the
//! block into f32 with the same two or three operations the SIMD paths use, and adds the
//! blocks up in order.

use super::{BlockQ8, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, QK};

pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

pub(super) fn dot_f32s(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] = ca[i].mul_add(cb[i], acc[i]);
        }
    }
    reduce8(acc)
}

/// [`dot_f32s`] of `a` with the little-endian f16 values `b` (each converted exactly).
pub(super) fn dot_f32_f16(a: &[f32], b: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(16)) {
        for i in 0..8 {
            acc[i] = ca[i].mul_add(f16_at(cb, 2 * i), acc[i]);
        }
    }
    reduce8(acc)
}

/// [`axpy`] of the little-endian f16 values `x` (each converted exactly).
pub(super) fn axpy_f16(w: f32, x: &[u8], y: &mut [f32]) {
    for (y, c) in y.iter_mut().zip(x.chunks_exact(2)) {
        *y = w.mul_add(f16_at(c, 0), *y);
    }
}

pub(super) fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = w.mul_add(*x, *y);
    }
}

pub(super) fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

pub(super) fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let mut sum = 0i32;
        for (q, &v) in block.qs.iter_mut().zip(xs) {
            // Round half away from zero, as ggml's `roundf`.
            let r = (v * id).round() as i32;
            *q = r.clamp(-127, 127) as i8;
            sum += i32::from(*q);
        }
        block.d = d;
        block.sum = sum;
        block.s = d * sum as f32;
    }
}

pub(super) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = w.chunks_exact(32).zip(x.chunks_exact(8));
    for (wb, xs) in chunks {
        for i in 0..8 {
            let wv = f32::from_le_bytes([wb[4 * i], wb[4 * i + 1], wb[4 * i + 2], wb[4 * i + 3]]);
            acc[i] = wv.mul_add(xs[i], acc[i]);
        }
    }
    reduce8(acc)
}

/// The fixed reduction of 8 lanes the SIMD path uses too: ((0+4)+(2+6)) + ((1+5)+(3+7)).
pub(super) fn reduce8(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let t = [s[0] + s[2], s[1] + s[3]];
    t[0] + t[1]
}

pub(super) fn dot_q4_0(w: &[u8], xq: &[BlockQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, a) in w.chunks_exact(Q4_0_BYTES).zip(xq) {
        let d = f16_at(wb, 0);
        let qs = &wb[2..];
        // Σ (q - 8)·a = Σ q·a - 8·Σ a, exactly, in integers.
        let sumi = nibble_dot(&qs[..QK / 2], &a.qs);
        acc += d * a.d * (sumi - 8 * a.sum) as f32;
    }
    acc
}

pub(super) fn dot_q4_1(w: &[u8], xq: &[BlockQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, a) in w.chunks_exact(Q4_1_BYTES).zip(xq) {
        let d = f16_at(wb, 0);
        let m = f16_at(wb, 2);
        let qs = &wb[4..];
        let sumi = nibble_dot(&qs[..QK / 2], &a.qs);
        acc += d * a.d * sumi as f32 + m * a.s;
    }
    acc
}

/// Σ q·a over a 4-bit block: element j is the low nibble of byte j, element j + 16 its high
/// nibble (ggml's order), each unsigned.
fn nibble_dot(qs: &[u8], a: &[i8; QK]) -> i32 {
    let (lo_a, hi_a) = a.split_at(QK / 2);
    qs.iter()
        .zip(lo_a.iter().zip(hi_a))
        .map(|(&q, (&l, &h))| i32::from(q & 0x0F) * i32::from(l) + i32::from(q >> 4) * i32::from(h))
        .sum()
}

pub(super) fn dot_q8_0(w: &[u8], xq: &[BlockQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, a) in w.chunks_exact(Q8_0_BYTES).zip(xq) {
        let d = f16_at(wb, 0);
        let mut sumi = 0i32;
        for j in 0..QK {
            sumi += i32::from(wb[2 + j] as i8) * i32::from(a.qs[j]);
        }
        acc += d * a.d * sumi as f32;
    }
    acc
}
