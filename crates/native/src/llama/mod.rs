//! The Llama family's forward pass (Llama, SmolLM, Mistral-style GQA; Qwen2 with its QKV
//! biases), over tandem's paged KV.
//!
//! One call computes every row of a scheduler step — prefill chunks and decode tokens of all
//! running requests — as one activation matrix, so each weight matrix is read once per step.
//! Each row's K and V go into the engine's arena at (its block, its slot, the layer) in f16,
//! in [`tandem_engine::KvShape`]'s layout (`[layer][token][kv][head][dim]` within a block);
//! attention reads them back from there, the step's own tokens included.
//!
//! **Batch invariance.** Every operation works on one row at a time (norms, the kernels'
//! per-(weight row, activation row) dot products, RoPE, attention over the row's own block
//! table in position order), and attention sees K/V only as f16 from the arena. A row's
//! logits are therefore bitwise the same whether its prompt was computed in one step or in
//! chunks, alone or batched, cold or from a prefix hit, here or from KV copied into another
//! arena at other block ids.

pub mod config;
mod rope;

use tandem_engine::KvArena;

pub use config::{Arch, LlamaConfig, RopeScaling};
pub use rope::Rope;

use crate::kernels::Kernels;
use crate::tensor::{Activations, Matrix};

/// What a forward pass computes with: the kernels, and the threads that split each matrix
/// product by output rows (none: the calling thread alone).
#[derive(Debug)]
pub struct Compute {
    pub kernels: Kernels,
    pool: Option<rayon::ThreadPool>,
}

impl Compute {
    /// `threads` threads (1: the caller's own). A rayon pool's idle threads sleep: workers
    /// sharing cores do not steal each other's time between steps.
    pub fn new(kernels: Kernels, threads: usize) -> Compute {
        let pool = (threads > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("tandem-native-{i}"))
                    .build()
                    .ok()
            })
            .flatten();
        Compute { kernels, pool }
    }

    pub fn threads(&self) -> usize {
        self.pool.as_ref().map_or(1, |p| p.current_num_threads())
    }

    /// `out = m · x` (`x.rows() × m.rows()`), split by output rows over the threads.
    pub fn matmul(&self, m: &Matrix, x: &Activations, out: &mut [f32]) {
        let k = &self.kernels;
        let Some(pool) = &self.pool else {
            return m.matmul(k, x, out);
        };
        let parts = pool.current_num_threads();
        // Whole tiles of 16 rows per part.
        let per = m.rows().div_ceil(parts).div_ceil(16) * 16;
        if m.rows() < 2 * 16 {
            return m.matmul(k, x, out);
        }
        use rayon::prelude::*;
        let chunks: Vec<(std::ops::Range<usize>, Vec<f32>)> = pool.install(|| {
            (0..m.rows().div_ceil(per))
                .into_par_iter()
                .map(|i| {
                    let range = i * per..((i + 1) * per).min(m.rows());
                    let mut buf = vec![0.0; x.rows() * range.len()];
                    m.matmul_range(k, x, range.clone(), &mut buf);
                    (range, buf)
                })
                .collect()
        });
        for (range, buf) in chunks {
            for r in 0..x.rows() {
                out[r * m.rows() + range.start..r * m.rows() + range.end]
                    .copy_from_slice(&buf[r * range.len()..(r + 1) * range.len()]);
            }
        }
    }
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    /// Qwen2's biases of Q, K and V.
    pub bias: Option<[Vec<f32>; 3]>,
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

/// A loaded model: configuration and weights.
#[derive(Clone, Debug)]
pub struct Llama {
    pub cfg: LlamaConfig,
    pub rope: Rope,
    /// `n_vocab` rows of `n_embd`.
    pub embed: Matrix,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The output projection; None when tied to the embedding.
    pub output: Option<Matrix>,
}

/// One row of a step: a token at a position of a sequence whose blocks are `table`.
#[derive(Clone, Copy, Debug)]
pub struct StepRow<'a> {
    pub token: u32,
    pub pos: usize,
    pub table: &'a [u32],
    /// Whether the step samples after this row (its logits are wanted).
    pub logits: bool,
}

/// Buffers reused from step to step.
#[derive(Debug, Default)]
pub struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    acts: Activations,
    cos: Vec<f32>,
    sin: Vec<f32>,
    scores: Vec<f32>,
    /// One row's context, K and V of every position in f32.
    kv_row: Vec<f32>,
}

impl Llama {
    /// Bytes of KV one token takes in one layer (K and V, f16).
    pub fn kv_bytes_per_token_layer(&self) -> usize {
        2 * self.cfg.kv_dim() * 2
    }

    /// Computes `rows` against the KV in `arena` (blocks of `block_size` tokens) and
    /// returns, in row order, the logits of every row that wants them (`n_vocab` each).
    pub fn forward(
        &self,
        c: &Compute,
        rows: &[StepRow<'_>],
        arena: &mut KvArena,
        block_size: usize,
        s: &mut Scratch,
        logits: &mut Vec<f32>,
    ) {
        let k = &c.kernels;
        let cfg = &self.cfg;
        let (n, d) = (rows.len(), cfg.n_embd);
        logits.clear();
        if n == 0 {
            return;
        }
        s.x.resize(n * d, 0.0);
        for (r, row) in rows.iter().enumerate() {
            self.embed
                .dequantize_row(row.token as usize, &mut s.x[r * d..(r + 1) * d]);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            self.attention_block(c, l, layer, rows, arena, block_size, s);
            self.ffn_block(c, layer, n, s);
        }
        let out_rows: Vec<usize> = (0..n).filter(|&r| rows[r].logits).collect();
        if out_rows.is_empty() {
            return;
        }
        s.h.clear();
        for &r in &out_rows {
            let start = s.h.len();
            s.h.extend_from_slice(&s.x[r * d..(r + 1) * d]);
            rms_norm(&mut s.h[start..], &self.output_norm, cfg.rms_eps);
        }
        s.acts.set(k, out_rows.len(), d, &s.h);
        let out = self.output.as_ref().unwrap_or(&self.embed);
        logits.resize(out_rows.len() * out.rows(), 0.0);
        c.matmul(out, &s.acts, logits);
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        c: &Compute,
        l: usize,
        layer: &Layer,
        rows: &[StepRow<'_>],
        arena: &mut KvArena,
        bs: usize,
        s: &mut Scratch,
    ) {
        let (cfg, k) = (&self.cfg, &c.kernels);
        let (n, d, qd, kvd, hd) = (
            rows.len(),
            cfg.n_embd,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.head_dim,
        );
        self.normed(k, &layer.attn_norm, n, s);
        s.q.resize(n * qd, 0.0);
        s.k.resize(n * kvd, 0.0);
        s.v.resize(n * kvd, 0.0);
        c.matmul(&layer.wq, &s.acts, &mut s.q);
        c.matmul(&layer.wk, &s.acts, &mut s.k);
        c.matmul(&layer.wv, &s.acts, &mut s.v);
        if let Some([bq, bk, bv]) = &layer.bias {
            add_rows(&mut s.q, bq);
            add_rows(&mut s.k, bk);
            add_rows(&mut s.v, bv);
        }
        // RoPE, then every row's K and V into the arena before any row attends: a row of a
        // prefill chunk reads the chunk's earlier rows from there too.
        let kv_token = self.kv_bytes_per_token_layer();
        for (r, row) in rows.iter().enumerate() {
            self.rope.angles(row.pos, &mut s.cos, &mut s.sin);
            self.rope
                .rotate(&mut s.q[r * qd..(r + 1) * qd], hd, &s.cos, &s.sin);
            self.rope
                .rotate(&mut s.k[r * kvd..(r + 1) * kvd], hd, &s.cos, &s.sin);
            let at = (l * bs + row.pos % bs) * kv_token;
            let (kr, vr) = (&s.k[r * kvd..(r + 1) * kvd], &s.v[r * kvd..(r + 1) * kvd]);
            arena.with_block_mut(row.table[row.pos / bs], |block| {
                write_f16(&mut block[at..at + kvd * 2], kr);
                write_f16(&mut block[at + kvd * 2..at + kv_token], vr);
            });
        }
        s.att.resize(n * qd, 0.0);
        for (r, row) in rows.iter().enumerate() {
            self.attend(k, l, row, arena, bs, r, s);
        }
        s.acts.set(k, n, qd, &s.att);
        s.h.resize(n * d, 0.0);
        c.matmul(&layer.wo, &s.acts, &mut s.h);
        for (x, o) in s.x.iter_mut().zip(&s.h) {
            *x += o;
        }
    }

    /// Row `r`'s attention output (all heads) into `s.att`, over positions `0..=row.pos` read
    /// from the arena in position order: the layer's K and V of every position converted to
    /// f32 first, one arena access and one conversion per block.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        k: &Kernels,
        l: usize,
        row: &StepRow<'_>,
        arena: &KvArena,
        bs: usize,
        r: usize,
        s: &mut Scratch,
    ) {
        let cfg = &self.cfg;
        let (qd, kvd, hd, group, n_head) = (
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.head_dim,
            cfg.group(),
            cfg.n_head,
        );
        let len = row.pos + 1;
        let kv_token = self.kv_bytes_per_token_layer();
        // [position][K then V][kvd]: a layer's slots are consecutive within a block.
        let per_pos = 2 * kvd;
        s.kv_row.resize(len * per_pos, 0.0);
        for (b, &block) in row.table[..len.div_ceil(bs)].iter().enumerate() {
            let slots = (len - b * bs).min(bs);
            let at = l * bs * kv_token;
            let dst = &mut s.kv_row[b * bs * per_pos..(b * bs + slots) * per_pos];
            arena.with_block(block, |bytes| {
                k.f16_to_f32(&bytes[at..at + slots * kv_token], dst);
            });
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let q = &s.q[r * qd..(r + 1) * qd];
        // Scores of every head against every position: [head][position].
        s.scores.resize(n_head * len, 0.0);
        for t in 0..len {
            let kt = &s.kv_row[t * per_pos..t * per_pos + kvd];
            for h in 0..n_head {
                let kh = &kt[(h / group) * hd..(h / group + 1) * hd];
                s.scores[h * len + t] = k.dot_f32s(&q[h * hd..(h + 1) * hd], kh) * scale;
            }
        }
        for h in 0..n_head {
            softmax(&mut s.scores[h * len..(h + 1) * len]);
        }
        let out = &mut s.att[r * qd..(r + 1) * qd];
        out.fill(0.0);
        for t in 0..len {
            let vt = &s.kv_row[t * per_pos + kvd..(t + 1) * per_pos];
            for h in 0..n_head {
                let w = s.scores[h * len + t];
                let vh = &vt[(h / group) * hd..(h / group + 1) * hd];
                k.axpy(w, vh, &mut out[h * hd..(h + 1) * hd]);
            }
        }
    }

    /// Every row of the residual stream `s.x` RMS-normed by `norm`, as the next product's
    /// activations.
    fn normed(&self, k: &Kernels, norm: &[f32], n: usize, s: &mut Scratch) {
        let d = self.cfg.n_embd;
        s.h.clear();
        s.h.extend_from_slice(&s.x);
        for r in 0..n {
            rms_norm(&mut s.h[r * d..(r + 1) * d], norm, self.cfg.rms_eps);
        }
        s.acts.set(k, n, d, &s.h);
    }

    fn ffn_block(&self, c: &Compute, layer: &Layer, n: usize, s: &mut Scratch) {
        let (cfg, k) = (&self.cfg, &c.kernels);
        let (d, ff) = (cfg.n_embd, cfg.n_ff);
        self.normed(k, &layer.ffn_norm, n, s);
        s.gate.resize(n * ff, 0.0);
        s.up.resize(n * ff, 0.0);
        c.matmul(&layer.w_gate, &s.acts, &mut s.gate);
        c.matmul(&layer.w_up, &s.acts, &mut s.up);
        for (g, u) in s.gate.iter_mut().zip(&s.up) {
            *g = silu(*g) * u;
        }
        s.acts.set(k, n, ff, &s.gate);
        s.h.resize(n * d, 0.0);
        c.matmul(&layer.w_down, &s.acts, &mut s.h);
        for (x, o) in s.x.iter_mut().zip(&s.h) {
            *x += o;
        }
    }
}

/// `x ← x / rms(x) · w`, the mean square summed in f64 in index order (as ggml does).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v = *v * scale * w;
    }
}

fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// In place: `exp(x - max) / Σ`, summed in index order.
fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

fn write_f16(dst: &mut [u8], src: &[f32]) {
    for (d, &v) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
    }
}
