//! [`Mocker`]: the mocker as a [`Model`].

use hashbrown::HashMap;
use tandem_protocol::RequestId;

use super::MockerConfig;
use super::kv::{self, KvLayout, SeqDigest};
use crate::arena::KvShape;
use crate::model::Model;
use crate::scheduler::{ModelView, SampledToken, StepPlan, TokenLogprobs};

/// The mocker model: steps timed by [`super::TimingModel`], deterministic KV bytes, tokens
/// derived from the KV read back from the arena (see the module docs).
#[derive(Debug)]
pub struct Mocker {
    cfg: MockerConfig,
    layout: KvLayout,
    digests: HashMap<RequestId, SeqDigest>,
}

impl Mocker {
    /// A mocker for blocks of `block_size` tokens.
    pub fn new(cfg: MockerConfig, block_size: usize) -> Self {
        Mocker {
            layout: KvLayout::new(cfg.kv_shape, block_size),
            cfg,
            digests: HashMap::new(),
        }
    }

    pub fn config(&self) -> &MockerConfig {
        &self.cfg
    }
}

impl Model for Mocker {
    fn kv_shape(&self) -> KvShape {
        self.cfg.kv_shape
    }

    fn step_duration_ms(&self, plan: &StepPlan, kv_capacity_tokens: usize) -> f64 {
        let kv_usage = plan.kv_tokens as f64 / kv_capacity_tokens as f64;
        self.cfg.timing.step_ms(
            plan.prefill_tokens,
            plan.decode_tokens > 0,
            kv_usage,
            self.cfg.speedup_ratio,
        ) + plan.adapter_loads as f64 * self.cfg.adapter_load_ms
    }

    fn compute(&mut self, view: ModelView<'_>, sampled: &mut Vec<SampledToken>) {
        let bs = self.layout.block_size();
        for (entry, table) in view.plan.iter() {
            let Some(seq) = view.sequences.get(entry.id) else {
                continue;
            };
            let state = self
                .digests
                .entry(entry.id)
                .or_insert_with(|| SeqDigest::new(seq.admissions()));
            if state.epoch() != seq.admissions() {
                // Preempted since: its KV was dropped and is being rebuilt from scratch.
                *state = SeqDigest::new(seq.admissions());
            }
            let range = entry.tokens();
            let end = range.end;
            kv::write_tokens(view.arena, &self.layout, table, seq, range, state);
            kv::fold_complete_blocks(view.arena, table, seq.block_hashes(), end / bs, state);
            if entry.samples {
                let token = kv::sample(
                    view.arena,
                    &self.layout,
                    table,
                    seq,
                    end,
                    state,
                    self.cfg.vocab_size,
                );
                let first = end == seq.prompt_len();
                sampled.push(SampledToken {
                    id: entry.id,
                    token,
                    logprobs: seq
                        .sampling()
                        .logprobs
                        .map(|n| TokenLogprobs::certain(token, n)),
                    embedding: (first && seq.sampling().embed)
                        .then(|| embedding(&seq.tokens()[..end])),
                });
            }
        }
    }

    fn forget(&mut self, id: RequestId) {
        self.digests.remove(&id);
    }
}

/// Dimensions of the mocker's embeddings.
pub const EMBEDDING_DIM: usize = 256;

/// The mocker's embedding of a prompt: its tokens hashed into [`EMBEDDING_DIM`] signed
/// buckets (the hashing trick), normalized to length 1. Not a model's meaning, but a fixed
/// function of the prompt in which prompts sharing most of their tokens lie close: enough
/// for what sits on top of embeddings (a semantic cache) to be exercised without a model.
pub fn embedding(tokens: &[u32]) -> Box<[f32]> {
    let mut v = vec![0f32; EMBEDDING_DIM];
    for &t in tokens {
        // splitmix64 of the token: four buckets, each with its own sign.
        let mut z = u64::from(t).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        for k in 0..4 {
            let bits = z >> (16 * k);
            let sign = if bits & 0x100 == 0 { 1.0 } else { -1.0 };
            v[(bits & 0xFF) as usize % EMBEDDING_DIM] += sign;
        }
    }
    crate::model::normalize(&mut v);
    v.into_boxed_slice()
}
