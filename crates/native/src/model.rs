//! [`NativeModel`]: the Llama forward pass as the engine's [`Model`].

use std::sync::Arc;

use tandem_engine::scheduler::ModelView;
use tandem_engine::{KvShape, Model, SampledToken, StepPlan};
use tandem_protocol::RequestId;

use crate::kernels::Kernels;
use crate::kv::KvDtype;
use crate::llama::{Compute, Llama, Scratch, StepRow};
use crate::sampling::Sampler;

/// A loaded model computing an engine's steps. The weights are shared (`Arc`): several
/// engines in one process (`tandem up`) hold one copy.
#[derive(Debug)]
pub struct NativeModel {
    llama: Arc<Llama>,
    compute: Compute,
    block_size: usize,
    scratch: Scratch,
    sampler: Sampler,
    logits: Vec<f32>,
}

impl NativeModel {
    /// A model for an engine whose blocks hold `block_size` tokens, computing each step on
    /// `threads` threads.
    pub fn new(
        llama: Arc<Llama>,
        kernels: Kernels,
        block_size: usize,
        threads: usize,
    ) -> NativeModel {
        NativeModel {
            llama,
            compute: Compute::new(kernels, threads),
            block_size,
            scratch: Scratch::default(),
            sampler: Sampler::default(),
            logits: Vec::new(),
        }
    }

    /// The model storing K and V as `kv` (f16 unless said).
    pub fn with_kv_dtype(mut self, kv: KvDtype) -> NativeModel {
        self.compute.kv = kv;
        self
    }

    pub fn llama(&self) -> &Llama {
        &self.llama
    }

    /// The KV geometry of `llama` in f16, the shape an engine's arena needs for it.
    pub fn kv_shape_of(llama: &Llama) -> KvShape {
        Self::kv_shape_as(llama, KvDtype::F16)
    }

    /// The KV geometry of `llama` with K and V as `kv`.
    pub fn kv_shape_as(llama: &Llama, kv: KvDtype) -> KvShape {
        KvShape {
            num_layers: llama.cfg.n_layer as u32,
            num_kv_heads: llama.cfg.n_head_kv as u32,
            head_dim: llama.cfg.head_dim as u32,
            dtype_bytes: kv.bytes() as u32,
        }
    }

    /// The logits of the last step's sampling rows, in plan order (`n_vocab` each).
    pub fn last_logits(&self) -> &[f32] {
        &self.logits
    }
}

impl Model for NativeModel {
    fn kv_shape(&self) -> KvShape {
        Self::kv_shape_as(&self.llama, self.compute.kv)
    }

    /// Real compute: a step takes what it takes.
    fn step_duration_ms(&self, _: &StepPlan, _: usize) -> f64 {
        0.0
    }

    fn compute(&mut self, view: ModelView<'_>, sampled: &mut Vec<SampledToken>) {
        let rows = step_rows(&view);
        self.llama.forward(
            &self.compute,
            &rows,
            view.arena,
            self.block_size,
            &mut self.scratch,
            &mut self.logits,
            view.progress,
        );
        sample_step(
            &view,
            (&self.logits, self.llama.cfg.n_vocab),
            Some((self.scratch.output_hidden(), self.llama.cfg.n_embd)),
            &mut self.sampler,
            sampled,
        );
    }

    fn forget(&mut self, _: RequestId) {}
}

/// The rows of `view`'s step, in plan order: every scheduled token of every entry, at its
/// position, with its sequence's block table; the last row of an entry that samples wants
/// logits.
pub(crate) fn step_rows<'a>(view: &ModelView<'a>) -> Vec<StepRow<'a>> {
    let mut rows = Vec::with_capacity(view.plan.prefill_tokens + view.plan.decode_tokens);
    for (entry, table) in view.plan.iter() {
        let Some(seq) = view.sequences.get(entry.id) else {
            continue;
        };
        let range = entry.tokens();
        let last = range.end - 1;
        for pos in range {
            rows.push(StepRow {
                token: seq.tokens()[pos],
                pos,
                table,
                logits: entry.samples && pos == last,
            });
        }
    }
    rows
}

/// One token for every entry of `view`'s plan that samples, drawn from its row of `logits`
/// (`n_vocab` each, in plan order, as [`step_rows`] marked them), pushed to `sampled`; with
/// the row's final hidden state from `hidden` (`n_embd` each, the same order), normalized,
/// as the embedding of a request that asked for one (none where `hidden` is `None`).
pub(crate) fn sample_step(
    view: &ModelView<'_>,
    (logits, n_vocab): (&[f32], usize),
    hidden: Option<(&[f32], usize)>,
    sampler: &mut Sampler,
    sampled: &mut Vec<SampledToken>,
) {
    let mut i = 0;
    for (entry, _) in view.plan.iter() {
        if !entry.samples {
            continue;
        }
        let Some(seq) = view.sequences.get(entry.id) else {
            continue;
        };
        let row = &logits[i * n_vocab..(i + 1) * n_vocab];
        // The prompt's last row (the first token's draw) carries its embedding.
        let embedding = hidden
            .filter(|_| seq.sampling().embed && entry.tokens().end == seq.prompt_len())
            .map(|(h, d)| {
                let mut v = h[i * d..(i + 1) * d].to_vec();
                tandem_engine::model::normalize(&mut v);
                v.into_boxed_slice()
            });
        i += 1;
        // The draw for the token at position `end` (the sequence's next one).
        let pos = entry.tokens().end as u64;
        let choice = sampler.sample(row, seq.sampling(), seq.sampling_seed(), pos);
        sampled.push(SampledToken {
            id: entry.id,
            token: choice.token,
            logprobs: choice.logprobs,
            embedding,
        });
    }
}
