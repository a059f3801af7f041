//! The GPU's kernels. `the_kernels_compile…` needs only NVRTC (scripts/test.sh fetches it
//! from PyPI, so CI compiles the CUDA source on every run); the `device_` tests need a GPU
//! (scripts/gpu-check.sh runs them), and with no device they fail, never pass quietly.

use super::*;
use crate::kernels::QK;

#[test]
fn the_kernels_compile_for_every_architecture_we_serve() {
    // Ampere, Ada, Hopper; and NVRTC's default (what an unknown device falls back to).
    for arch in [
        Some("compute_80"),
        Some("compute_89"),
        Some("compute_90"),
        None,
    ] {
        let ptx = compile(arch)
            .unwrap_or_else(|e| panic!("{arch:?}: {e}"))
            .to_src();
        for kernel in [
            "matmul_f32",
            "matmul_q8_0",
            "matmul_q4_0",
            "matmul_q4_1",
            "embed_q8_0",
            "rms_norm",
            "swiglu",
            "rope_store",
            "attention",
            "attention_combine",
        ] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{arch:?}: no {kernel}"
            );
        }
        // --fmad=false: no contraction the source did not write (the products' fmaf are
        // explicit; a stray `fma.rn` outside them would break batch invariance silently).
        assert!(
            !ptx.contains("mad.f32") && !ptx.contains("mad.rn.f32"),
            "{arch:?}"
        );
    }
}

fn device() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("a device test needs a GPU: {e}"))
}

/// A random `rows × cols` matrix in `format` and its values as the CPU dequantizes them.
fn random_matrix(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> (Matrix, Vec<f32>) {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let row_bytes = format.row_bytes(cols);
    let mut data = vec![0u8; rows * row_bytes];
    match format {
        WeightFormat::F32 => {
            for v in data.chunks_exact_mut(4) {
                let f = (next() % 2001) as f32 / 1000.0 - 1.0;
                v.copy_from_slice(&f.to_le_bytes());
            }
        }
        _ => {
            let bytes = row_bytes / (cols / QK);
            for blk in data.chunks_exact_mut(bytes) {
                for b in blk.iter_mut() {
                    *b = next() as u8;
                }
                // Sane scales (and minimum): small f16s, not random bit patterns.
                let d = half::f16::from_f32((next() % 100) as f32 / 4000.0 + 0.001);
                blk[..2].copy_from_slice(&d.to_le_bytes());
                if format == WeightFormat::Q4_1 {
                    let m = half::f16::from_f32(-((next() % 100) as f32) / 1000.0);
                    blk[2..4].copy_from_slice(&m.to_le_bytes());
                }
            }
        }
    }
    let m = Matrix::new(format, rows, cols, data).expect("whole blocks");
    let mut values = vec![0.0; rows * cols];
    for (o, row) in values.chunks_exact_mut(cols).enumerate() {
        m.dequantize_row(o, row);
    }
    (m, values)
}

#[test]
fn device_matrix_products_match_f64_and_do_not_depend_on_the_batch() {
    let gpu = device();
    // 13 and 70 rows: two and nine row tiles; each row alone: one, and seven rows of zeros.
    for batch in [13, 70] {
        products_of_a_batch(&gpu, batch);
    }
}

fn products_of_a_batch(gpu: &Gpu, batch: usize) {
    let cols = 96;
    let x: Vec<f32> = (0..batch * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let xd = upload(gpu, &x).unwrap();
    for format in [
        WeightFormat::F32,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
    ] {
        // Three products of the same activations in one launch (Q, K and V's shape), of
        // widths that leave partial warps and blocks, the first two with a bias.
        let sizes = [70, 37, 16];
        let mats: Vec<(Matrix, Vec<f32>)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &rows)| random_matrix(format, rows, cols, 7 + i as u64))
            .collect();
        let biases: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&rows| (0..rows).map(|i| i as f32 / 100.0).collect())
            .collect();
        let gms: Vec<GpuMatrix> = mats
            .iter()
            .map(|(m, _)| upload_matrix(gpu, m).unwrap())
            .collect();
        let bds: Vec<CudaSlice<f32>> = biases.iter().map(|b| upload(gpu, b).unwrap()).collect();
        let mut ys: Vec<CudaSlice<f32>> = sizes
            .iter()
            .map(|&rows| gpu.stream.alloc_zeros::<f32>(batch * rows).unwrap())
            .collect();
        let mut products: Vec<device::Product<'_>> = ys
            .iter_mut()
            .zip(&gms)
            .zip(&bds)
            .enumerate()
            .map(|(i, ((y, w), b))| device::Product {
                w,
                y,
                bias: (i < 2).then_some(b),
            })
            .collect();
        gpu.matmul(&gpu.stream, &mut products, &xd, batch, false)
            .unwrap();
        drop(products);
        let got: Vec<Vec<f32>> = ys
            .iter()
            .map(|y| gpu.stream.clone_dtoh(y).unwrap())
            .collect();
        for (i, &rows) in sizes.iter().enumerate() {
            let w = &mats[i].1;
            for r in 0..batch {
                for o in 0..rows {
                    let bias = if i < 2 { f64::from(biases[i][o]) } else { 0.0 };
                    let want: f64 = (0..cols)
                        .map(|k| f64::from(w[o * cols + k]) * f64::from(x[r * cols + k]))
                        .sum::<f64>()
                        + bias;
                    let g = f64::from(got[i][r * rows + o]);
                    assert!(
                        (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{format:?} product {i} ({r}, {o}) of {batch}: {g} vs {want}"
                    );
                }
            }
        }
        // Each row alone, through a launch of the first matrix only: the same bits.
        let rows = sizes[0];
        for r in [0, 5, 12, batch - 1] {
            let one = upload(gpu, &x[r * cols..(r + 1) * cols]).unwrap();
            let mut y1 = gpu.stream.alloc_zeros::<f32>(rows).unwrap();
            let p = device::Product {
                w: &gms[0],
                y: &mut y1,
                bias: Some(&bds[0]),
            };
            gpu.matmul(&gpu.stream, &mut [p], &one, 1, false).unwrap();
            let alone = gpu.stream.clone_dtoh(&y1).unwrap();
            let batched = &got[0][r * rows..(r + 1) * rows];
            assert!(
                alone
                    .iter()
                    .zip(batched)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{format:?}: row {r} alone differs from a batch of {batch}"
            );
        }
    }
}
