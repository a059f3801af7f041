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
                sampled.push(SampledToken {
                    id: entry.id,
                    token,
                    logprobs: seq
                        .sampling()
                        .logprobs
                        .map(|n| TokenLogprobs::certain(token, n)),
                });
            }
        }
    }

    fn forget(&mut self, id: RequestId) {
        self.digests.remove(&id);
    }
}
