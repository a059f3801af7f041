//! Every kernel against a plain f64 computation over the dequantized values, and every SIMD
//! path bit for bit against the portable one.

use proptest::prelude::*;

use super::*;

/// A small deterministic generator (the tests need no entropy).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    fn unit(&mut self) -> f32 {
        (self.next() % 2_000_001) as f32 / 1_000_000.0 - 1.0
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// Random weight blocks of `format` for `cols` values, and their values as f64.
fn weights(format: WeightFormat, cols: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    for _ in 0..cols / QK {
        let d = rng.unit() * 0.05;
        let dq = f64::from(half::f16::from_f32(d).to_f32());
        match format {
            WeightFormat::F32 => {
                for _ in 0..QK {
                    let v = rng.unit();
                    bytes.extend_from_slice(&v.to_le_bytes());
                    values.push(f64::from(v));
                }
            }
            WeightFormat::Q4_0 | WeightFormat::Q4_1 => {
                bytes.extend_from_slice(&f16(d));
                let m = rng.unit() * 0.1;
                let mq = f64::from(half::f16::from_f32(m).to_f32());
                if format == WeightFormat::Q4_1 {
                    bytes.extend_from_slice(&f16(m));
                }
                let qs: Vec<u8> = (0..QK / 2).map(|_| rng.byte()).collect();
                let mut block = vec![0.0; QK];
                for (j, q) in qs.iter().enumerate() {
                    let (lo, hi) = (f64::from(q & 0x0F), f64::from(q >> 4));
                    if format == WeightFormat::Q4_1 {
                        block[j] = dq * lo + mq;
                        block[j + QK / 2] = dq * hi + mq;
                    } else {
                        block[j] = dq * (lo - 8.0);
                        block[j + QK / 2] = dq * (hi - 8.0);
                    }
                }
                bytes.extend_from_slice(&qs);
                values.extend(block);
            }
            WeightFormat::Q8_0 => {
                bytes.extend_from_slice(&f16(d));
                for _ in 0..QK {
                    let q = rng.byte() as i8;
                    bytes.push(q as u8);
                    values.push(dq * f64::from(q));
                }
            }
        }
    }
    assert_eq!(bytes.len(), format.row_bytes(cols));
    (bytes, values)
}

const FORMATS: [WeightFormat; 4] = [
    WeightFormat::F32,
    WeightFormat::Q4_0,
    WeightFormat::Q4_1,
    WeightFormat::Q8_0,
];

#[test]
fn quantized_activations_round_trip_within_half_a_step() {
    let mut rng = Rng(1);
    let x: Vec<f32> = (0..256).map(|_| rng.unit() * 3.0).collect();
    let mut q = vec![BlockQ8::default(); 8];
    Kernels::new(Isa::Portable).quantize_q8(&x, &mut q);
    for (b, xs) in q.iter().zip(x.chunks(QK)) {
        let sum: i32 = b.qs.iter().map(|&v| i32::from(v)).sum();
        assert_eq!(b.sum, sum);
        assert_eq!(b.s, b.d * sum as f32);
        for (&v, &qv) in xs.iter().zip(&b.qs) {
            assert!((v - b.d * f32::from(qv)).abs() <= b.d / 2.0 + 1e-6);
        }
    }
    // All zeros: a zero scale, no NaN.
    let mut z = [BlockQ8::default()];
    Kernels::new(Isa::Portable).quantize_q8(&[0.0; QK], &mut z);
    assert_eq!((z[0].d, z[0].s, z[0].qs), (0.0, 0.0, [0; QK]));
}

#[test]
fn every_format_computes_the_dot_product_of_its_values() {
    let k = Kernels::new(Isa::Portable);
    let mut rng = Rng(7);
    let cols = 576;
    for format in FORMATS {
        let (w, wv) = weights(format, cols, &mut rng);
        let x: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
        let mut xq = vec![BlockQ8::default(); cols / QK];
        k.quantize_q8(&x, &mut xq);
        // What the kernel should compute: the weights' values times the activations it was
        // given (f32 for F32 weights, their 8-bit quantization for the others), in f64.
        let want: f64 = (0..cols)
            .map(|i| {
                let a = if format == WeightFormat::F32 {
                    f64::from(x[i])
                } else {
                    let b = &xq[i / QK];
                    f64::from(b.d) * f64::from(b.qs[i % QK])
                };
                wv[i] * a
            })
            .sum();
        let got = f64::from(k.dot(format, &w, &x, &xq));
        let scale: f64 = (0..cols).map(|i| (wv[i] * f64::from(x[i])).abs()).sum();
        assert!(
            (got - want).abs() <= 1e-5 * scale.max(1.0),
            "{format:?}: {got} vs {want}"
        );
    }
}

#[test]
fn the_simd_quantizer_equals_the_portable_one_bit_for_bit() {
    let simd = Kernels::new(Isa::detect());
    let portable = Kernels::new(Isa::Portable);
    let mut rng = Rng(7);
    // Random rows; rows whose products land on halves (ties round away from zero) and just
    // below them; zeros, negative zeros and a NaN.
    let mut x: Vec<f32> = (0..QK * 64).map(|_| rng.unit() * 5.0).collect();
    let ties: Vec<f32> = (0..QK).map(|i| (i as f32 - 15.5) * 127.0 / 16.0).collect();
    x.extend(&ties);
    x.extend(ties.iter().map(|v| f32::from_bits(v.to_bits() - 1)));
    x.extend([0.0f32; QK]);
    x.extend((0..QK).map(|i| if i % 2 == 0 { -0.0 } else { 1e-30 }));
    for nan in [3, 9, 20, 31] {
        x.extend((0..QK).map(|i| if i == nan { f32::NAN } else { i as f32 - 9.0 }));
    }
    let blocks = x.len() / QK;
    let (mut a, mut b) = (
        vec![BlockQ8::default(); blocks],
        vec![BlockQ8::default(); blocks],
    );
    portable.quantize_q8(&x, &mut a);
    simd.quantize_q8(&x, &mut b);
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(a.qs, b.qs, "block {i}");
        assert_eq!(
            (a.d.to_bits(), a.s.to_bits(), a.sum),
            (b.d.to_bits(), b.s.to_bits(), b.sum),
            "block {i}"
        );
    }
}

proptest! {
    #[test]
    fn the_simd_kernels_equal_the_portable_ones_bit_for_bit(seed in any::<u64>(), blocks in 1usize..40) {
        let portable = Kernels::new(Isa::Portable);
        for isa in [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni] {
        let simd = Kernels::new(isa);
        // Without the instructions, `new` falls back: what ran is then checked under its name.
        if simd.isa() != isa {
            continue;
        }
        let mut rng = Rng(seed);
        let cols = blocks * QK;
        for format in FORMATS {
            let (w, _) = weights(format, cols, &mut rng);
            let x: Vec<f32> = (0..cols).map(|_| rng.unit() * 4.0).collect();
            let mut xq = vec![BlockQ8::default(); blocks];
            portable.quantize_q8(&x, &mut xq);
            let (a, b) = (portable.dot(format, &w, &x, &xq), simd.dot(format, &w, &x, &xq));
            prop_assert_eq!(a.to_bits(), b.to_bits(), "{:?}: {} vs {}", format, a, b);
            // Several rows at once: each row's result is its own single-row one.
            // Up to 21: up to five groups of four rows, and single rows after them.
            let rows = 1 + (seed % 21) as usize;
            let xs: Vec<f32> = (0..rows * cols).map(|_| rng.unit() * 4.0).collect();
            let mut xqs = vec![BlockQ8::default(); rows * blocks];
            portable.quantize_q8(&xs, &mut xqs);
            let mut scales = Vec::new();
            super::group_scales(&xqs, blocks, &mut scales);
            for k in [&portable, &simd] {
                let mut out = vec![0.0f32; rows];
                k.dot_many(format, &w, &xs, &xqs, &scales, cols, &mut out);
                for r in 0..rows {
                    let one = portable.dot(
                        format,
                        &w,
                        &xs[r * cols..(r + 1) * cols],
                        &xqs[r * blocks..(r + 1) * blocks],
                    );
                    prop_assert_eq!(out[r].to_bits(), one.to_bits(), "{:?} {:?} row {}", isa, format, r);
                }
            }
            // Several weight rows against whole groups of rows, written with a stride.
            let whole = rows / GROUP_ROWS * GROUP_ROWS;
            if whole > 0 {
                let m = 1 + (seed / 7 % 5) as usize;
                let mut ws = w.clone();
                for _ in 1..m {
                    ws.extend(weights(format, cols, &mut rng).0);
                }
                let rb = format.row_bytes(cols);
                let stride = m + 2;
                for k in [&portable, &simd] {
                    let mut out = vec![f32::NAN; whole * stride];
                    k.dot_grid(format, &ws, m, &xs[..whole * cols], &xqs[..whole * blocks], &scales, cols, &mut out, stride);
                    for r in 0..whole {
                        for o in 0..m {
                            let one = portable.dot(
                                format,
                                &ws[o * rb..(o + 1) * rb],
                                &xs[r * cols..(r + 1) * cols],
                                &xqs[r * blocks..(r + 1) * blocks],
                            );
                            prop_assert_eq!(out[r * stride + o].to_bits(), one.to_bits(), "{:?} {:?} grid {} {}", isa, format, r, o);
                        }
                    }
                }
            }
            // Several weight rows against one activation row (fours, then single rows):
            // each the single dot of its row.
            let wrows = 1 + (seed / 13 % 9) as usize;
            let mut ws = w.clone();
            for _ in 1..wrows {
                ws.extend(weights(format, cols, &mut rng).0);
            }
            let rb = format.row_bytes(cols);
            for k in [&portable, &simd] {
                let mut out = vec![0.0f32; wrows];
                k.dot_rows(format, &ws, &x, &xq, cols, &mut out);
                for (o, got) in out.iter().enumerate() {
                    let one = portable.dot(format, &ws[o * rb..(o + 1) * rb], &x, &xq);
                    prop_assert_eq!(got.to_bits(), one.to_bits(), "{:?} {:?} weight row {}", isa, format, o);
                }
            }
        }
        }
    }
}

#[test]
fn the_attention_kernels_are_the_same_on_every_path() {
    let mut rng = Rng(3);
    let a: Vec<f32> = (0..64).map(|_| rng.unit()).collect();
    let b: Vec<f32> = (0..64).map(|_| rng.unit()).collect();
    let (p, s) = (Kernels::new(Isa::Portable), Kernels::new(Isa::detect()));
    assert_eq!(p.dot_f32s(&a, &b).to_bits(), s.dot_f32s(&a, &b).to_bits());
    let want: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    assert!((f64::from(p.dot_f32s(&a, &b)) - want).abs() < 1e-5);
    let (mut y1, mut y2) = (b.clone(), b.clone());
    p.axpy(0.37, &a, &mut y1);
    s.axpy(0.37, &a, &mut y2);
    assert_eq!(y1, y2);
    let halves: Vec<u8> = a
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let (mut h1, mut h2) = (vec![0.0; 64], vec![0.0; 64]);
    p.f16_to_f32(&halves, &mut h1);
    s.f16_to_f32(&halves[..], &mut h2);
    assert_eq!(h1, h2);
    assert!(h1.iter().zip(&a).all(|(h, x)| (h - x).abs() < 1e-3));
    // Straight from f16: the same bits as converting first, on every path.
    for k in [p, s] {
        assert_eq!(
            k.dot_f32_f16(&b, &halves).to_bits(),
            p.dot_f32s(&b, &h1).to_bits()
        );
        let (mut y3, mut y4) = (b.clone(), b.clone());
        k.axpy_f16(-0.61, &halves, &mut y3);
        p.axpy(-0.61, &h1, &mut y4);
        assert_eq!(y3, y4);
    }
}

#[test]
fn q8_0_weights_of_minus_128_are_exact_on_every_path() {
    // A file may hold -128 (ggml's quantizer never writes it): |w| = 128 still fits.
    let mut w = f16(1.0).to_vec();
    w.extend([0x80u8; QK]);
    let x = [1.0f32; QK];
    let mut xq = [BlockQ8::default()];
    Kernels::new(Isa::Portable).quantize_q8(&x, &mut xq);
    let want = -128.0 * 32.0 * 127.0 * xq[0].d;
    for isa in [Isa::Portable, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni] {
        let k = Kernels::new(isa);
        assert_eq!(k.dot(WeightFormat::Q8_0, &w, &x, &xq), want, "{isa:?}");
        // Two rows at once (the 512-bit kernels' pairs), one activation row and a group.
        let ws = [w.clone(), w.clone()].concat();
        let mut out = [0.0f32; 2];
        k.dot_rows(WeightFormat::Q8_0, &ws, &x, &xq, QK, &mut out);
        assert_eq!(out, [want; 2], "{isa:?}");
        let xs = [x; GROUP_ROWS].concat();
        let xqs = [xq; GROUP_ROWS].concat();
        let mut scales = Vec::new();
        group_scales(&xqs, 1, &mut scales);
        let mut grid = [0.0f32; 2 * GROUP_ROWS];
        k.dot_grid(
            WeightFormat::Q8_0,
            &ws,
            2,
            &xs,
            &xqs,
            &scales,
            QK,
            &mut grid,
            2,
        );
        assert_eq!(grid, [want; 2 * GROUP_ROWS], "{isa:?}");
    }
}

#[test]
fn attention_over_several_heads_is_each_heads_own_dots_and_axpys_bit_for_bit() {
    let mut rng = Rng(11);
    let p = Kernels::new(Isa::Portable);
    for isa in [Isa::Portable, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni] {
        let k = Kernels::new(isa);
        for (heads, hd, n) in [
            (1, 8, 1),
            (3, 64, 16),
            (3, 64, 7),
            (4, 24, 5),
            (5, 128, 3),
            (9, 40, 2),
        ] {
            // Keys and values `stride` bytes apart, with other bytes between them.
            let stride = hd * 2 + 6;
            let halves: Vec<u8> = (0..n * stride)
                .flat_map(|_| half::f16::from_f32(rng.unit()).to_le_bytes())
                .take(n * stride)
                .collect();
            let q: Vec<f32> = (0..heads * hd).map(|_| rng.unit()).collect();
            let out_stride = n + 3;
            let mut scores = vec![0.0f32; heads * out_stride];
            k.scores_f16(&q, hd, &halves, stride, n, 0.125, &mut scores, out_stride);
            for h in 0..heads {
                for t in 0..n {
                    let key = &halves[t * stride..t * stride + hd * 2];
                    let want = p.dot_f32_f16(&q[h * hd..(h + 1) * hd], key) * 0.125;
                    assert_eq!(
                        scores[h * out_stride + t].to_bits(),
                        want.to_bits(),
                        "{isa:?} {heads} {hd} {n}"
                    );
                }
            }
            let start: Vec<f32> = (0..heads * hd).map(|_| rng.unit()).collect();
            let mut y = start.clone();
            k.weighted_f16(&scores, out_stride, &halves, stride, n, hd, &mut y);
            let mut want = start.clone();
            for t in 0..n {
                let value = &halves[t * stride..t * stride + hd * 2];
                for h in 0..heads {
                    p.axpy_f16(
                        scores[h * out_stride + t],
                        value,
                        &mut want[h * hd..(h + 1) * hd],
                    );
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y), bits(&want), "{isa:?} {heads} {hd} {n}");
        }
    }
}
