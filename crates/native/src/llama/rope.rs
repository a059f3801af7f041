//! Rotary position embeddings: the angles of a position, and their rotation of a head.

use super::config::{LlamaConfig, RopeScaling};

/// The frequencies of one model's RoPE, and what its scaling does to them.
#[derive(Clone, Debug)]
pub struct Rope {
    dims: usize,
    neox: bool,
    /// Per rotated pair: the angle per position, scaling and frequency factors applied.
    inv_freq: Vec<f64>,
    /// YaRN's magnitude correction of cos and sin (1 without YaRN).
    mscale: f64,
}

impl Rope {
    /// `freq_factors`: the per-pair divisors some files carry (`rope_freqs.weight`, Llama 3.1's
    /// long-context scaling), one per rotated pair.
    pub fn new(cfg: &LlamaConfig, freq_factors: Option<&[f32]>) -> Rope {
        let dims = cfg.rope_dims;
        let base = f64::from(cfg.rope_base);
        let mut mscale = 1.0;
        let inv_freq = (0..dims / 2)
            .map(|i| {
                let extrap = base.powf(-2.0 * i as f64 / dims as f64)
                    / freq_factors.map_or(1.0, |f| f64::from(f[i]));
                match cfg.rope_scaling {
                    RopeScaling::None => extrap,
                    RopeScaling::Linear { factor } => extrap / f64::from(factor),
                    RopeScaling::Yarn {
                        factor,
                        original_context,
                        beta_fast,
                        beta_slow,
                    } => {
                        // ggml's rope_yarn: between the extrapolated and the interpolated
                        // angle by a ramp over the pairs that the original context resolves.
                        let scale = 1.0 / f64::from(factor);
                        let corr = |beta: f32| {
                            dims as f64
                                * (f64::from(original_context)
                                    / (f64::from(beta) * 2.0 * std::f64::consts::PI))
                                    .ln()
                                / (2.0 * base.ln())
                        };
                        let low = corr(beta_fast).floor().max(0.0);
                        let high = corr(beta_slow).ceil().min(dims as f64 - 1.0);
                        let y = (i as f64 - low) / (high - low).max(0.001);
                        let ramp = 1.0 - y.clamp(0.0, 1.0);
                        mscale = 1.0 + 0.1 * (1.0 / scale).ln();
                        extrap * scale * (1.0 - ramp) + extrap * ramp
                    }
                }
            })
            .collect();
        Rope {
            dims,
            neox: cfg.arch.rope_neox(),
            inv_freq,
            mscale,
        }
    }

    /// The cos and sin of every rotated pair at position `pos` (`dims / 2` each).
    pub fn angles(&self, pos: usize, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        cos.clear();
        sin.clear();
        for &f in &self.inv_freq {
            let theta = pos as f64 * f;
            cos.push((theta.cos() * self.mscale) as f32);
            sin.push((theta.sin() * self.mscale) as f32);
        }
    }

    /// Rotates every head of `x` (heads of `head_dim`) by the angles of one position.
    pub fn rotate(&self, x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = self.dims / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = if self.neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}
