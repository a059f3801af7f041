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
use crate::kv::KvDtype;
use crate::team::Team;
use crate::tensor::{Activations, Matrix};

/// What a forward pass computes with: the kernels, and the threads that split each matrix
/// product by output rows and attention by (row, KV head) (none: the calling thread alone).
#[derive(Debug)]
pub struct Compute {
    pub kernels: Kernels,
    team: Option<Team>,
    /// What K and V are stored as in the arena.
    pub kv: KvDtype,
}

impl Compute {
    /// `threads` threads (1: the caller's own). The team's threads spin only briefly between
    /// a step's regions, then sleep (`crate::team`): workers sharing cores do not steal each
    /// other's time between steps.
    pub fn new(kernels: Kernels, threads: usize) -> Compute {
        let team = (threads > 1).then(|| Team::new(threads)).flatten();
        Compute {
            kernels,
            team,
            kv: KvDtype::F16,
        }
    }

    pub fn threads(&self) -> usize {
        self.team.as_ref().map_or(1, Team::threads)
    }

    /// `acts` set to `rows × cols` values, quantized over the threads when the step is big.
    pub fn activations(&self, acts: &mut Activations, rows: usize, cols: usize, values: &[f32]) {
        acts.set_on(&self.kernels, rows, cols, values, self.team.as_ref())
    }

    /// `out = m · x` (`x.rows() × m.rows()`), split by output rows over the threads.
    pub fn matmul(&self, m: &Matrix, x: &Activations, out: &mut [f32]) {
        self.matmuls(&mut [(m, out)], x)
    }

    /// Every `out = m · x` of `jobs` (each `x.rows() × m.rows()`), in one parallel region:
    /// the output rows of all the matrices are split over the threads together, so products
    /// of the same activations (Q, K and V; gate and up) wake the team once. Each output is
    /// one kernel call on its own, so the split changes no result.
    pub fn matmuls(&self, jobs: &mut [(&Matrix, &mut [f32])], x: &Activations) {
        let k = &self.kernels;
        let total: usize = jobs.iter().map(|(m, _)| m.rows()).sum();
        let team = match &self.team {
            Some(team) if total >= 2 * 16 => team,
            _ => {
                for (m, out) in jobs.iter_mut() {
                    m.matmul(k, x, out);
                }
                return;
            }
        };
        // Whole tiles of 16 rows, a few per thread (whichever thread is free takes the next),
        // a part never spanning two matrices.
        let per = total.div_ceil(4 * team.threads()).div_ceil(16) * 16;
        let mut tasks: Vec<(usize, std::ops::Range<usize>, Vec<f32>)> = jobs
            .iter()
            .enumerate()
            .flat_map(|(j, (m, _))| {
                (0..m.rows().div_ceil(per))
                    .map(move |i| (j, i * per..((i + 1) * per).min(m.rows()), Vec::new()))
            })
            .collect();
        let matrices: Vec<&Matrix> = jobs.iter().map(|(m, _)| *m).collect();
        team.for_each(&mut tasks, |_, (j, range, buf)| {
            buf.resize(x.rows() * range.len(), 0.0);
            matrices[*j].matmul_range(k, x, range.clone(), buf);
        });
        for (j, range, buf) in tasks {
            let (m, out) = &mut jobs[j];
            for r in 0..x.rows() {
                out[r * m.rows() + range.start..r * m.rows() + range.end]
                    .copy_from_slice(&buf[r * range.len()..(r + 1) * range.len()]);
            }
        }
    }

    /// `f(i, chunk)` for every `span`-long chunk of `out`, over the threads when there are
    /// several and `work` (the caller's measure of the whole) makes waking them worth it.
    fn for_each_chunk(
        &self,
        out: &mut [f32],
        span: usize,
        work: usize,
        f: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        match &self.team {
            Some(team) if work >= PARALLEL_WORK => {
                let mut chunks: Vec<&mut [f32]> = out.chunks_mut(span).collect();
                team.for_each(&mut chunks, |i, c| f(i, c));
            }
            _ => out.chunks_mut(span).enumerate().for_each(|(i, c)| f(i, c)),
        }
    }
}

/// Attention work (positions × KV heads over a step's rows) below which one thread does it
/// all: waking the pool costs more than it saves.
const PARALLEL_WORK: usize = 1024;

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
}

impl Scratch {
    /// After [`Llama::forward`]: the final (output-normed) hidden state of every row that
    /// wanted logits, in the logits' order (`n_embd` each) — what the output projection read.
    pub fn output_hidden(&self) -> &[f32] {
        &self.h
    }
}

impl Llama {
    /// Bytes of KV one token takes in one layer (K and V, f16).
    pub fn kv_bytes_per_token_layer(&self) -> usize {
        self.kv_token_bytes(KvDtype::F16)
    }

    /// Bytes of KV one token takes in one layer, K and V as `kv`.
    pub fn kv_token_bytes(&self, kv: KvDtype) -> usize {
        2 * self.cfg.kv_dim() * kv.bytes()
    }

    /// Computes `rows` against the KV in `arena` (blocks of `block_size` tokens) and
    /// returns, in row order, the logits of every row that wants them (`n_vocab` each).
    /// `progress` is told the number of layers whose K/V is in the arena after each one.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        c: &Compute,
        rows: &[StepRow<'_>],
        arena: &mut KvArena,
        block_size: usize,
        s: &mut Scratch,
        logits: &mut Vec<f32>,
        progress: &(dyn Fn(u32) + Sync),
    ) {
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
        // The blocks the step's rows attend over, each once, and each row's as indices into
        // them: a layer's attention takes them from the arena in one access.
        let mut blocks = BlockSet::default();
        for row in rows {
            blocks.add_row(&row.table[..(row.pos + 1).div_ceil(block_size)]);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            self.attention_block(c, l, layer, rows, &blocks, arena, block_size, s);
            // The layer's K/V is written: it may leave while the rest computes.
            progress(l as u32 + 1);
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
        c.activations(&mut s.acts, out_rows.len(), d, &s.h);
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
        blocks: &BlockSet,
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
        self.normed(c, &layer.attn_norm, n, s);
        s.q.resize(n * qd, 0.0);
        s.k.resize(n * kvd, 0.0);
        s.v.resize(n * kvd, 0.0);
        c.matmuls(
            &mut [
                (&layer.wq, &mut s.q[..]),
                (&layer.wk, &mut s.k[..]),
                (&layer.wv, &mut s.v[..]),
            ],
            &s.acts,
        );
        if let Some([bq, bk, bv]) = &layer.bias {
            add_rows(&mut s.q, bq);
            add_rows(&mut s.k, bk);
            add_rows(&mut s.v, bv);
        }
        // RoPE, then every row's K and V into the arena before any row attends: a row of a
        // prefill chunk reads the chunk's earlier rows from there too.
        let (kv_token, eb) = (self.kv_token_bytes(c.kv), c.kv.bytes());
        for (r, row) in rows.iter().enumerate() {
            self.rope.angles(row.pos, &mut s.cos, &mut s.sin);
            self.rope
                .rotate(&mut s.q[r * qd..(r + 1) * qd], hd, &s.cos, &s.sin);
            self.rope
                .rotate(&mut s.k[r * kvd..(r + 1) * kvd], hd, &s.cos, &s.sin);
            let at = (l * bs + row.pos % bs) * kv_token;
            let (kr, vr) = (&s.k[r * kvd..(r + 1) * kvd], &s.v[r * kvd..(r + 1) * kvd]);
            arena.with_block_mut(row.table[row.pos / bs], |block| {
                write_kv(c.kv, &mut block[at..at + kvd * eb], kr);
                write_kv(c.kv, &mut block[at + kvd * eb..at + kv_token], vr);
            });
        }
        // Every (row, KV head) on its own: the heads that share a KV head, over the row's
        // positions, straight from the arena's f16.
        s.att.resize(n * qd, 0.0);
        let (groups, span) = (cfg.n_head_kv, cfg.group() * hd);
        let work = rows.iter().map(|r| r.pos + 1).sum::<usize>() * groups;
        let (q, att) = (&s.q, &mut s.att);
        arena.with_blocks(&blocks.ids, |bytes| {
            c.for_each_chunk(att, span, work, |i, out| {
                let (r, g) = (i / groups, i % groups);
                let row_blocks: Vec<&[u8]> = blocks.rows[r].iter().map(|&b| bytes[b]).collect();
                self.attend(
                    k,
                    c.kv,
                    l,
                    &rows[r],
                    &row_blocks,
                    bs,
                    &q[r * qd..(r + 1) * qd],
                    g,
                    out,
                );
            });
        });
        c.activations(&mut s.acts, n, qd, &s.att);
        s.h.resize(n * d, 0.0);
        c.matmul(&layer.wo, &s.acts, &mut s.h);
        for (x, o) in s.x.iter_mut().zip(&s.h) {
            *x += o;
        }
    }

    /// The attention output of the query heads that share KV head `g` (`out`: theirs, back
    /// to back) for one row (`q`: all its query heads), over positions `0..=row.pos` read
    /// from the arena in position order, K and V as the f16 they are stored in (the kernels
    /// convert them exactly, in registers).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        k: &Kernels,
        kv: KvDtype,
        l: usize,
        row: &StepRow<'_>,
        blocks: &[&[u8]],
        bs: usize,
        q: &[f32],
        g: usize,
        out: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let (kvd, hd, group) = (cfg.kv_dim(), cfg.head_dim, cfg.group());
        let len = row.pos + 1;
        let (kv_token, eb) = (self.kv_token_bytes(kv), kv.bytes());
        // Where, in a block, position slot `j`'s K (V: `v` = 1) of KV head `g` starts: a
        // layer's slots are consecutive, `[token][K then V][head][dim]`.
        let at = |j: usize, v: usize| (l * bs + j) * kv_token + v * kvd * eb + g * hd * eb;
        let scale = 1.0 / (hd as f32).sqrt();
        // The group's query heads, back to back, meet the positions one block at a time:
        // within a block a layer's slots are `kv_token` bytes apart.
        let q = &q[g * group * hd..(g + 1) * group * hd];
        // Scores of each of the group's heads against every position: [head][position].
        let mut scores = vec![0.0f32; group * len];
        // The next block's K (`v` = 0) or V of this head, asked of memory while this block's
        // are computed with: blocks lie anywhere in the arena, no prefetcher guesses them.
        let ahead = |b: usize, v: usize| {
            if let Some(next) = blocks.get(b + 1) {
                let slots = (len - (b + 1) * bs).min(bs);
                for j in 0..slots {
                    k.prefetch(next, at(j, v)..at(j, v) + hd * eb);
                }
            }
        };
        for (b, bytes) in blocks.iter().enumerate() {
            let slots = (len - b * bs).min(bs);
            ahead(b, 0);
            let keys = &bytes[at(0, 0)..];
            let out = &mut scores[b * bs..];
            match kv {
                KvDtype::F16 => k.scores_f16(q, hd, keys, kv_token, slots, scale, out, len),
                KvDtype::F32 => k.scores_f32(q, hd, keys, kv_token, slots, scale, out, len),
            }
        }
        for i in 0..group {
            softmax(&mut scores[i * len..(i + 1) * len]);
        }
        out.fill(0.0);
        for (b, bytes) in blocks.iter().enumerate() {
            let slots = (len - b * bs).min(bs);
            ahead(b, 1);
            let values = &bytes[at(0, 1)..];
            let w = &scores[b * bs..];
            match kv {
                KvDtype::F16 => k.weighted_f16(w, len, values, kv_token, slots, hd, out),
                KvDtype::F32 => k.weighted_f32(w, len, values, kv_token, slots, hd, out),
            }
        }
    }

    /// Every row of the residual stream `s.x` RMS-normed by `norm`, as the next product's
    /// activations.
    fn normed(&self, c: &Compute, norm: &[f32], n: usize, s: &mut Scratch) {
        let d = self.cfg.n_embd;
        s.h.clear();
        s.h.extend_from_slice(&s.x);
        for r in 0..n {
            rms_norm(&mut s.h[r * d..(r + 1) * d], norm, self.cfg.rms_eps);
        }
        c.activations(&mut s.acts, n, d, &s.h);
    }

    fn ffn_block(&self, c: &Compute, layer: &Layer, n: usize, s: &mut Scratch) {
        let cfg = &self.cfg;
        let (d, ff) = (cfg.n_embd, cfg.n_ff);
        self.normed(c, &layer.ffn_norm, n, s);
        s.gate.resize(n * ff, 0.0);
        s.up.resize(n * ff, 0.0);
        c.matmuls(
            &mut [
                (&layer.w_gate, &mut s.gate[..]),
                (&layer.w_up, &mut s.up[..]),
            ],
            &s.acts,
        );
        for (g, u) in s.gate.iter_mut().zip(&s.up) {
            *g = silu(*g) * u;
        }
        c.activations(&mut s.acts, n, ff, &s.gate);
        s.h.resize(n * d, 0.0);
        c.matmul(&layer.w_down, &s.acts, &mut s.h);
        for (x, o) in s.x.iter_mut().zip(&s.h) {
            *x += o;
        }
    }
}

/// The distinct blocks of a step's rows (`ids`, each once) and each row's blocks in
/// position order as indices into `ids`.
#[derive(Debug, Default)]
struct BlockSet {
    ids: Vec<u32>,
    rows: Vec<Vec<usize>>,
    at: std::collections::HashMap<u32, usize>,
}

impl BlockSet {
    fn add_row(&mut self, table: &[u32]) {
        let row = table
            .iter()
            .map(|&b| {
                *self.at.entry(b).or_insert_with(|| {
                    self.ids.push(b);
                    self.ids.len() - 1
                })
            })
            .collect();
        self.rows.push(row);
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

/// `src` into `dst` as `kv` (f16: rounded to nearest even).
fn write_kv(kv: KvDtype, dst: &mut [u8], src: &[f32]) {
    match kv {
        KvDtype::F16 => write_f16(dst, src),
        KvDtype::F32 => {
            for (d, &v) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

fn write_f16(dst: &mut [u8], src: &[f32]) {
    for (d, &v) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
    }
}
