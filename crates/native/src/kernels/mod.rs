//! The compute kernels: dot products of weight rows with activation rows, behind one small
//! interface with run-time CPU-feature dispatch.
//!
//! Weights stay in their GGUF block formats (Q4_0, Q4_1, Q8_0 as ggml lays them out) or in
//! f32. Activations are quantized per row into [`BlockQ8`] blocks (32 values, an f32 scale
//! and the scaled sum) for the quantized weights, as llama.cpp does with its Q8 activation
//! types; so a quantized dot product is integer work plus two multiplies per block.
//!
//! **Batch invariance.** Every kernel computes one (weight row, activation row) pair on its
//! own, its blocks summed in block order: a result never depends on which other rows share
//! the step, how many threads split the work, or which instruction set ran it. A quantized
//! dot keeps 8 f32 lanes, as a 256-bit register holds them: each block's integer products
//! are summed exactly into 8 lanes, scaled and added lane by lane, and the lanes are reduced
//! once per row in a fixed order (no horizontal sum per block, the cost that dominated); the
//! portable path computes the same lanes in plain Rust. The tests hold every path to bitwise
//! equality with the portable one.
//!
//! `unsafe` (the SIMD intrinsics) lives in `simd` only, each block with a `// SAFETY:`.

mod portable;
mod simd;

/// Values per quantization block (every format here).
pub const QK: usize = 32;

/// One block of 32 activations quantized to 8 bits: `value[i] ≈ d · qs[i]`; `sum = Σ qs`,
/// `s = d · sum`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub sum: i32,
    pub qs: [i8; QK],
}

impl Default for BlockQ8 {
    fn default() -> Self {
        BlockQ8 {
            d: 0.0,
            s: 0.0,
            sum: 0,
            qs: [0; QK],
        }
    }
}

/// Activation rows the SIMD kernels take at once (each weight block unpacked once for them).
pub const GROUP_ROWS: usize = 4;

/// The scales of one block of [`GROUP_ROWS`] activation rows side by side, `[d of each row,
/// s of each row]`: one load gives the SIMD kernels every row's, where reading them out of
/// each row's [`BlockQ8`] took scalar work per row and block (the profile's hottest
/// instructions).
pub type GroupScales = [f32; 2 * GROUP_ROWS];

/// The [`GroupScales`] of every whole group of [`GROUP_ROWS`] rows of `xq` (`blocks` per
/// row), group by group and block by block, into `out`.
pub fn group_scales(xq: &[BlockQ8], blocks: usize, out: &mut Vec<GroupScales>) {
    out.clear();
    if blocks == 0 {
        return;
    }
    let rows = xq.len() / blocks;
    for g in 0..rows / GROUP_ROWS {
        for b in 0..blocks {
            let mut s = [0.0f32; 2 * GROUP_ROWS];
            for i in 0..GROUP_ROWS {
                let a = &xq[(g * GROUP_ROWS + i) * blocks + b];
                s[i] = a.d;
                s[GROUP_ROWS + i] = a.s;
            }
            out.push(s);
        }
    }
}

/// Bytes of one GGUF block of each format a kernel reads directly.
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q8_0_BYTES: usize = 34;

/// The weight formats the kernels read directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl WeightFormat {
    /// Bytes of a row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            WeightFormat::F32 => cols * 4,
            WeightFormat::Q4_0 => cols / QK * Q4_0_BYTES,
            WeightFormat::Q4_1 => cols / QK * Q4_1_BYTES,
            WeightFormat::Q8_0 => cols / QK * Q8_0_BYTES,
        }
    }
}

/// The instruction set the kernels run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, on every target (the reference the SIMD paths are tested against).
    Portable,
    /// x86-64 AVX2 with FMA.
    Avx2,
    /// AVX2 with the 8-bit dot-product instruction (`vpdpbusd`) in the quantized kernels:
    /// the same integer sums in fewer instructions, so the same bits. AVX-VNNI's form, or
    /// AVX-512 VL's on CPUs with AVX-512 VNNI and no AVX-VNNI (AMD Zen 4, Intel Cascade Lake
    /// and Ice Lake servers).
    AvxVnni,
    /// AVX-512 (F, BW, VL) with its VNNI: for Q4_1 and Q8_0 weights two weight rows in one
    /// 512-bit register, each half the 8 lanes the 256-bit kernels keep (the same bits); the
    /// 256-bit kernels as [`Isa::AvxVnni`].
    Avx512Vnni,
}

impl Isa {
    /// The best the CPU supports. The 512-bit kernels only where the CPU also has AVX-VNNI
    /// (Intel Sapphire Rapids on, AMD Zen 5): there they took 16 streams from 352 to 403
    /// tok/s at the same batch-1 rate. A Zen 4 splits each 512-bit operation in two, and
    /// there they lose to the 256-bit `vpdpbusd` kernels everywhere (batch 1 at context
    /// 512: 137–143 against 159–185 tok/s; 16 streams 347–355 against 342–401;
    /// crates/native/BENCHMARKS.md).
    pub fn detect() -> Isa {
        if simd::avx512_available() && simd::vnni_available() {
            Isa::Avx512Vnni
        } else if simd::vnni_available() || simd::avx512_available() {
            Isa::AvxVnni
        } else if simd::avx2_available() {
            Isa::Avx2
        } else {
            Isa::Portable
        }
    }
}

/// Kernels bound to one instruction set. Cheap to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    isa: Isa,
    /// The instruction the 256-bit kernels sum a block's byte products with.
    lanes: simd::Lanes,
}

impl Kernels {
    /// Kernels for `isa`, or the portable ones where the CPU lacks it.
    pub fn new(isa: Isa) -> Kernels {
        let isa = match isa {
            Isa::Avx512Vnni if simd::avx512_available() => Isa::Avx512Vnni,
            Isa::AvxVnni | Isa::Avx512Vnni
                if simd::vnni_available() || simd::avx512_available() =>
            {
                Isa::AvxVnni
            }
            Isa::Avx2 | Isa::AvxVnni | Isa::Avx512Vnni if simd::avx2_available() => Isa::Avx2,
            _ => Isa::Portable,
        };
        let lanes = match isa {
            Isa::AvxVnni | Isa::Avx512Vnni if simd::vnni_available() => simd::Lanes::AvxVnni,
            Isa::AvxVnni | Isa::Avx512Vnni => simd::Lanes::Avx512Vl,
            Isa::Avx2 | Isa::Portable => simd::Lanes::Avx2,
        };
        Kernels { isa, lanes }
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Whether the SIMD kernels run (AVX2, with or without VNNI).
    fn simd(&self) -> bool {
        self.isa != Isa::Portable
    }

    fn lanes(&self) -> simd::Lanes {
        self.lanes
    }

    /// `Σ a[i]·b[i]` of two f32 slices of a multiple of 8 values: 8 lanes of fused
    /// multiply-adds, reduced in a fixed order (the same on every path; the portable one's
    /// `mul_add` is a libm call where the build does not enable FMA: slow, but exact).
    pub fn dot_f32s(&self, a: &[f32], b: &[f32]) -> f32 {
        debug_assert!(a.len() == b.len() && a.len().is_multiple_of(8));
        if self.simd() {
            simd::dot_f32s(a, b)
        } else {
            portable::dot_f32s(a, b)
        }
    }

    /// `y[i] = w · x[i] + y[i]`, fused (the same on every path).
    pub fn axpy(&self, w: f32, x: &[f32], y: &mut [f32]) {
        debug_assert!(x.len() == y.len() && x.len().is_multiple_of(8));
        if self.simd() {
            simd::axpy(w, x, y)
        } else {
            portable::axpy(w, x, y)
        }
    }

    /// [`dot_f32s`](Self::dot_f32s) of `a` with the little-endian f16 values `b` (2 bytes
    /// each, converted exactly): bit for bit the dot of `a` with `b` converted to f32 first,
    /// without writing the conversion anywhere (attention reads K from the arena this way).
    pub fn dot_f32_f16(&self, a: &[f32], b: &[u8]) -> f32 {
        debug_assert!(b.len() == a.len() * 2 && a.len().is_multiple_of(8));
        if self.simd() {
            simd::dot_f32_f16(a, b)
        } else {
            portable::dot_f32_f16(a, b)
        }
    }

    /// [`axpy`](Self::axpy) of the little-endian f16 values `x`, converted exactly (V, read
    /// from the arena).
    pub fn axpy_f16(&self, w: f32, x: &[u8], y: &mut [f32]) {
        debug_assert!(x.len() == y.len() * 2 && y.len().is_multiple_of(8));
        if self.simd() {
            simd::axpy_f16(w, x, y)
        } else {
            portable::axpy_f16(w, x, y)
        }
    }

    /// Asks memory for `bytes[range]` ahead of its use (a hint: no result changes; nothing
    /// on the portable path). Past the end of `bytes` is left out.
    pub fn prefetch(&self, bytes: &[u8], range: std::ops::Range<usize>) {
        if self.simd() {
            simd::prefetch_range(bytes, range)
        }
    }

    /// Attention scores of `heads` query heads (`q`: `hd` values each, back to back) against
    /// `n` keys (key `p`: `hd` little-endian f16 at `k[p * stride..]`):
    /// `out[h * out_stride + p] = dot_f32_f16(q_h, key_p) · scale`, bit for bit. The SIMD
    /// path converts each key once for all the heads and keeps several sums in flight.
    #[allow(clippy::too_many_arguments)]
    pub fn scores_f16(
        &self,
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
        debug_assert!(hd.is_multiple_of(8) && q.len() == heads * hd);
        debug_assert!(n == 0 || k.len() >= (n - 1) * stride + hd * 2);
        debug_assert!(heads == 0 || n == 0 || out.len() >= (heads - 1) * out_stride + n);
        if self.simd() {
            simd::scores_f16(q, hd, k, stride, n, scale, out, out_stride)
        } else {
            for h in 0..heads {
                for p in 0..n {
                    let key = &k[p * stride..p * stride + hd * 2];
                    out[h * out_stride + p] =
                        portable::dot_f32_f16(&q[h * hd..(h + 1) * hd], key) * scale;
                }
            }
        }
    }

    /// The weighted sum of `n` values into `heads` outputs (`y`: `hd` each, back to back):
    /// for `p` in order, `axpy_f16(w[h * w_stride + p], value_p, y_h)` for every head (value
    /// `p`: `hd` little-endian f16 at `v[p * stride..]`), bit for bit. The SIMD path converts
    /// each value once for all the heads and keeps the outputs in registers over the
    /// positions.
    #[allow(clippy::too_many_arguments)]
    pub fn weighted_f16(
        &self,
        w: &[f32],
        w_stride: usize,
        v: &[u8],
        stride: usize,
        n: usize,
        hd: usize,
        y: &mut [f32],
    ) {
        let heads = y.len() / hd;
        debug_assert!(hd.is_multiple_of(8) && y.len() == heads * hd);
        debug_assert!(n == 0 || v.len() >= (n - 1) * stride + hd * 2);
        debug_assert!(heads == 0 || n == 0 || w.len() >= (heads - 1) * w_stride + n);
        if self.simd() {
            simd::weighted_f16(w, w_stride, v, stride, n, hd, y)
        } else {
            for p in 0..n {
                let value = &v[p * stride..p * stride + hd * 2];
                for (h, yh) in y.chunks_exact_mut(hd).enumerate() {
                    portable::axpy_f16(w[h * w_stride + p], value, yh);
                }
            }
        }
    }

    /// [`scores_f16`](Self::scores_f16) over keys stored as little-endian f32 (an f32 KV
    /// cache): the portable path on every CPU, each score one [`portable`] dot in lane order.
    #[allow(clippy::too_many_arguments)]
    pub fn scores_f32(
        &self,
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
        debug_assert!(hd.is_multiple_of(8) && q.len() == heads * hd);
        debug_assert!(n == 0 || k.len() >= (n - 1) * stride + hd * 4);
        for h in 0..heads {
            for p in 0..n {
                let key = &k[p * stride..p * stride + hd * 4];
                out[h * out_stride + p] =
                    portable::dot_f32_f32le(&q[h * hd..(h + 1) * hd], key) * scale;
            }
        }
    }

    /// [`weighted_f16`](Self::weighted_f16) over values stored as little-endian f32.
    #[allow(clippy::too_many_arguments)]
    pub fn weighted_f32(
        &self,
        w: &[f32],
        w_stride: usize,
        v: &[u8],
        stride: usize,
        n: usize,
        hd: usize,
        y: &mut [f32],
    ) {
        debug_assert!(n == 0 || v.len() >= (n - 1) * stride + hd * 4);
        for p in 0..n {
            let value = &v[p * stride..p * stride + hd * 4];
            for (h, yh) in y.chunks_exact_mut(hd).enumerate() {
                portable::axpy_f32le(w[h * w_stride + p], value, yh);
            }
        }
    }

    /// Little-endian f16 `src` (2 bytes a value) as f32 into `dst` (exact on every path).
    pub fn f16_to_f32(&self, src: &[u8], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len() * 2);
        if self.simd() {
            simd::f16_to_f32(src, dst)
        } else {
            portable::f16_to_f32(src, dst)
        }
    }

    /// Quantizes `x` (a multiple of [`QK`] long) into `out` (`x.len() / QK` blocks).
    pub fn quantize_q8(&self, x: &[f32], out: &mut [BlockQ8]) {
        if self.simd() {
            simd::quantize_q8(x, out)
        } else {
            portable::quantize_q8(x, out)
        }
    }

    /// One weight row against `out.len()` activation rows at once: `out[r]` is
    /// [`dot`](Self::dot) of `w` with row `r` (`x`: the f32 rows back to back, `cols` each;
    /// `xq`: their quantized blocks back to back; `scales`: [`group_scales`] of `xq`), bit
    /// for bit. The SIMD path unpacks each weight block once for a group of rows: weights
    /// are read once per step, not per row.
    #[allow(clippy::too_many_arguments)]
    pub fn dot_many(
        &self,
        format: WeightFormat,
        w: &[u8],
        x: &[f32],
        xq: &[BlockQ8],
        scales: &[GroupScales],
        cols: usize,
        out: &mut [f32],
    ) {
        let blocks = cols / QK;
        match (self.simd(), format) {
            (true, WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0) => {
                debug_assert_eq!(scales.len(), out.len() / GROUP_ROWS * blocks);
                simd::dot_many(format, w, xq, scales, blocks, out, self.lanes())
            }
            _ => {
                for (r, o) in out.iter_mut().enumerate() {
                    let (xr, qr) = (
                        &x[r * cols..(r + 1) * cols],
                        &xq[r * blocks..(r + 1) * blocks],
                    );
                    *o = self.dot(format, w, xr, qr);
                }
            }
        }
    }

    /// Consecutive weight rows (`w`: `m` rows of `cols` values in `format`) against whole
    /// groups of [`GROUP_ROWS`] activation rows (`x`, `xq`, `scales` as for
    /// [`dot_many`](Self::dot_many)): `out[r * out_stride + o]` is [`dot`](Self::dot) of
    /// weight row `o` with activation row `r`, bit for bit. With AVX-512, two weight rows
    /// meet a group at once.
    #[allow(clippy::too_many_arguments)]
    pub fn dot_grid(
        &self,
        format: WeightFormat,
        w: &[u8],
        m: usize,
        x: &[f32],
        xq: &[BlockQ8],
        scales: &[GroupScales],
        cols: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let (row_bytes, blocks) = (format.row_bytes(cols), cols / QK);
        let rows = xq.len() / blocks.max(1);
        debug_assert!(rows.is_multiple_of(GROUP_ROWS) && w.len() == m * row_bytes);
        if self.isa == Isa::Avx512Vnni && format != WeightFormat::F32 {
            return simd::dot_grid_avx512(
                format, w, row_bytes, m, xq, scales, blocks, out, out_stride,
            );
        }
        let mut sums = vec![0.0f32; rows];
        for o in 0..m {
            let row = &w[o * row_bytes..(o + 1) * row_bytes];
            self.prefetch(w, (o + 2) * row_bytes..(o + 3) * row_bytes);
            self.dot_many(format, row, x, xq, scales, cols, &mut sums);
            for (r, v) in sums.iter().enumerate() {
                out[r * out_stride + o] = *v;
            }
        }
    }

    /// Consecutive weight rows (`w`: `out.len()` rows of `cols` values in `format`) against
    /// one activation row: `out[o]` is [`dot`](Self::dot) of row `o` with it, bit for bit.
    /// The SIMD path takes four weight rows at a time, the activation's blocks loaded once
    /// for them (a step of one row: a decode at batch 1).
    pub fn dot_rows(
        &self,
        format: WeightFormat,
        w: &[u8],
        x: &[f32],
        xq: &[BlockQ8],
        cols: usize,
        out: &mut [f32],
    ) {
        let row_bytes = format.row_bytes(cols);
        debug_assert_eq!(w.len(), out.len() * row_bytes);
        match (self.simd(), format) {
            (true, WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0) => {
                if self.isa == Isa::Avx512Vnni {
                    simd::dot_rows_avx512(format, w, row_bytes, xq, out)
                } else {
                    simd::dot_rows(format, w, row_bytes, xq, out, self.lanes())
                }
            }
            _ => {
                for (o, v) in out.iter_mut().enumerate() {
                    *v = self.dot(format, &w[o * row_bytes..(o + 1) * row_bytes], x, xq);
                }
            }
        }
    }

    /// The dot product of one weight row (`format`, raw bytes) with one activation row: the
    /// f32 row for [`WeightFormat::F32`], its [`BlockQ8`] quantization for the others.
    pub fn dot(&self, format: WeightFormat, w: &[u8], x: &[f32], xq: &[BlockQ8]) -> f32 {
        match (self.simd(), format) {
            (true, WeightFormat::F32) => simd::dot_f32(w, x),
            (false, WeightFormat::F32) => portable::dot_f32(w, x),
            (true, _) => simd::dot_one(format, w, xq, self.lanes()),
            (false, WeightFormat::Q4_0) => portable::dot_q4_0(w, xq),
            (false, WeightFormat::Q4_1) => portable::dot_q4_1(w, xq),
            (false, WeightFormat::Q8_0) => portable::dot_q8_0(w, xq),
        }
    }
}

#[cfg(test)]
mod tests;
