//! The matrix kernels' rate on one thread, by the number of activation rows a step brings
//! (1: a decode at batch 1; 4, 16, 64: batched decodes and prefill chunks), on SmolLM2-135M's
//! three shapes with random Q4_1 weights. The weights of the two layer shapes fit in L2 on the
//! machines measured, so those figures are compute, not memory: what batching rows can win
//! per core (crates/native/BENCHMARKS.md).
//!
//!   cargo run --release -p tandem-native --example kernel_speed [avx2|avxvnni|avx512vnni]
//!
//! Prints one JSON line per (shape, rows): microseconds per product (the best of three runs)
//! and GMAC/s (10⁹ multiply-adds per second).

use std::time::Instant;

use tandem_native::kernels::{Isa, Kernels, Q4_1_BYTES, QK, WeightFormat};
use tandem_native::tensor::{Activations, Matrix};

fn main() {
    let isa = match std::env::args().nth(1).as_deref() {
        Some("avx2") => Isa::Avx2,
        Some("avxvnni") => Isa::AvxVnni,
        Some("avx512vnni") => Isa::Avx512Vnni,
        Some(other) => panic!("unknown instruction set {other}: avx2, avxvnni or avx512vnni"),
        None => Isa::detect(),
    };
    let k = Kernels::new(isa);
    // xorshift64: the same weights and activations every run.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // (outputs, inputs): the gate and up projections, the down projection, the logits.
    for (m, cols) in [(1536usize, 576usize), (576, 1536), (49152, 576)] {
        let mut data = Vec::with_capacity(m * cols / QK * Q4_1_BYTES);
        for _ in 0..m * cols / QK {
            let d = half::f16::from_f32(0.01 + (next() % 100) as f32 * 1e-4);
            let min = half::f16::from_f32(-0.05 + (next() % 100) as f32 * 1e-4);
            data.extend_from_slice(&d.to_le_bytes());
            data.extend_from_slice(&min.to_le_bytes());
            data.extend((0..16).map(|_| next() as u8));
        }
        let w = Matrix::new(WeightFormat::Q4_1, m, cols, data).expect("whole blocks");
        for rows in [1usize, 4, 16, 64] {
            let values: Vec<f32> = (0..rows * cols)
                .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
                .collect();
            let mut x = Activations::default();
            x.set(&k, rows, cols, &values);
            let mut out = vec![0.0f32; rows * m];
            let macs = m * cols * rows;
            let reps = (4_000_000_000 / macs).max(3);
            w.matmul(&k, &x, &mut out);
            let mut best = f64::MAX;
            for _ in 0..3 {
                let start = Instant::now();
                for _ in 0..reps {
                    w.matmul(&k, &x, &mut out);
                }
                best = best.min(start.elapsed().as_secs_f64() / reps as f64);
            }
            println!(
                "{}",
                serde_json::json!({
                    "isa": format!("{:?}", k.isa()),
                    "shape": format!("{m}x{cols}"),
                    "rows": rows,
                    "us": best * 1e6,
                    "gmac_s": macs as f64 / best / 1e9,
                })
            );
        }
    }
}
