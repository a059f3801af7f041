//! The portable kernels: plain Rust, the reference for the SIMD ones.
//!
//! Each quantized dot product sums every block's integer products exactly (i32) in 8 lanes,
//! scales them into 8 f32 lanes with the same operations the SIMD paths use, adds the blocks
//! up in order, and reduces the lanes once at the end ([`Lanes`]).

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

/// [`dot_f32_f16`] with `b` little-endian f32 values (an f32 KV cache's keys).
pub(super) fn dot_f32_f32le(a: &[f32], b: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(32)) {
        for i in 0..8 {
            acc[i] = ca[i].mul_add(f32_at(cb, 4 * i), acc[i]);
        }
    }
    reduce8(acc)
}

pub(super) fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// [`axpy`] of the little-endian f32 values `x` (an f32 KV cache's values).
pub(super) fn axpy_f32le(w: f32, x: &[u8], y: &mut [f32]) {
    for (y, c) in y.iter_mut().zip(x.chunks_exact(4)) {
        *y = w.mul_add(f32_at(c, 0), *y);
    }
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

/// A quantized row's running sum: 8 f32 lanes, each taking its share of every block's
/// integer products times the product of the block's two scales (a fused multiply-add), plus one f32
/// term outside the lanes (Q4_1's minimum, Q4_0's offset), in block order. The SIMD paths
/// keep the same lanes in a register: no horizontal sum per block.
#[derive(Clone, Copy, Default)]
pub(super) struct Lanes {
    acc: [f32; 8],
    extra: f32,
}

impl Lanes {
    /// Adds a block: `dd` (the product of its scales) times each lane's integer sum, fused
    /// (as the SIMD paths' FMA; a libm call where the build does not enable FMA: slow, but
    /// exact).
    fn add(&mut self, dd: f32, lanes: [i32; 8]) {
        for (a, l) in self.acc.iter_mut().zip(lanes) {
            *a = dd.mul_add(l as f32, *a);
        }
    }

    fn sum(self) -> f32 {
        reduce8(self.acc) + self.extra
    }
}

/// Lane `j` of a block: `Σ w[e]·a[e]` over its elements `4j..4j + 4` (what a 32-byte
/// multiply-add of bytes, then of pairs, leaves in 32-bit lane `j`).
fn lane_sums(w: impl Fn(usize) -> i32, a: &[i8; QK]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for (e, &x) in a.iter().enumerate() {
        lanes[e / 4] += w(e) * i32::from(x);
    }
    lanes
}

/// Element `e` of a 4-bit block, unsigned: the low nibble of byte `e`, or for `e` ≥ 16 the
/// high nibble of byte `e - 16` (ggml's order).
fn nibble(qs: &[u8], e: usize) -> i32 {
    i32::from(if e < QK / 2 {
        qs[e] & 0x0F
    } else {
        qs[e - QK / 2] >> 4
    })
}

pub(super) fn dot_q4_0(w: &[u8], xq: &[BlockQ8]) -> f32 {
    let mut acc = Lanes::default();
    for (wb, a) in w.chunks_exact(Q4_0_BYTES).zip(xq) {
        let dd = f16_at(wb, 0) * a.d;
        // Σ (q - 8)·a = Σ q·a - 8·Σ a: the lanes take the first, the extra term the second.
        acc.add(dd, lane_sums(|e| nibble(&wb[2..], e), &a.qs));
        acc.extra += dd * (-8 * a.sum) as f32;
    }
    acc.sum()
}

pub(super) fn dot_q4_1(w: &[u8], xq: &[BlockQ8]) -> f32 {
    let mut acc = Lanes::default();
    for (wb, a) in w.chunks_exact(Q4_1_BYTES).zip(xq) {
        let (d, m) = (f16_at(wb, 0), f16_at(wb, 2));
        acc.add(d * a.d, lane_sums(|e| nibble(&wb[4..], e), &a.qs));
        acc.extra += m * a.s;
    }
    acc.sum()
}

pub(super) fn dot_q8_0(w: &[u8], xq: &[BlockQ8]) -> f32 {
    let mut acc = Lanes::default();
    for (wb, a) in w.chunks_exact(Q8_0_BYTES).zip(xq) {
        let dd = f16_at(wb, 0) * a.d;
        acc.add(dd, lane_sums(|e| i32::from(wb[2 + e] as i8), &a.qs));
    }
    acc.sum()
}
