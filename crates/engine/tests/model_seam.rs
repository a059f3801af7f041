//! The engine with a model other than the mocker, through the public [`Model`] seam: the
//! pool, scheduler, prefix cache and export are the engine's, whatever computes the steps.
//!
//! The model here writes each token's id (and its position) as its K/V in every layer, and
//! samples from what it reads back from the arena through the block table: the sum of every
//! token id the sequence's KV holds. A prefix hit, a chunked prefill or a preemption that read
//! or wrote the wrong blocks changes the tokens.

use tandem_engine::scheduler::ModelView;
use tandem_engine::{
    BlockPoolConfig, Engine, EngineConfig, EngineRequest, KvShape, Model, RequestOutput,
    SampledToken, SchedulerConfig, StepPlan,
};
use tandem_protocol::{BlockSize, RequestId, WorkerId};

const BS: usize = 4;
const SHAPE: KvShape = KvShape {
    num_layers: 2,
    num_kv_heads: 1,
    head_dim: 2,
    dtype_bytes: 2,
};

/// K = (token id, position) as two u16, V = the same, in every layer.
#[derive(Debug, Default)]
struct ReadBack {
    forgotten: Vec<RequestId>,
}

impl Model for ReadBack {
    fn kv_shape(&self) -> KvShape {
        SHAPE
    }

    fn step_duration_ms(&self, _: &StepPlan, _: usize) -> f64 {
        0.0
    }

    fn compute(&mut self, view: ModelView<'_>, sampled: &mut Vec<SampledToken>) {
        let per_token = SHAPE.bytes_per_token_layer();
        for (entry, table) in view.plan.iter() {
            let seq = view.sequences.get(entry.id).expect("running");
            for p in entry.tokens() {
                let (token, pos) = (seq.tokens()[p] as u16, p as u16);
                view.arena.with_block_mut(table[p / BS], |block| {
                    for layer in 0..SHAPE.num_layers as usize {
                        let at = (layer * BS + p % BS) * per_token;
                        for (i, half) in [token, pos, token, pos].into_iter().enumerate() {
                            block[at + 2 * i..at + 2 * i + 2].copy_from_slice(&half.to_le_bytes());
                        }
                    }
                });
            }
            if entry.samples {
                // Every K of the last layer, from the arena: a sum of token ids, position-checked.
                let end = entry.tokens().end;
                let mut sum = 0u32;
                for p in 0..end {
                    let layer = SHAPE.num_layers as usize - 1;
                    let at = (layer * BS + p % BS) * per_token;
                    let (t, pos) = view.arena.with_block(table[p / BS], |b| {
                        let read = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
                        (read(at), read(at + 2))
                    });
                    assert_eq!(pos as usize, p, "position {p} read from the wrong slot");
                    sum += u32::from(t);
                }
                sampled.push(SampledToken {
                    id: entry.id,
                    token: sum % 1000,
                    logprobs: None,
                    embedding: None,
                });
            }
        }
    }

    fn forget(&mut self, id: RequestId) {
        self.forgotten.push(id);
    }
}

fn engine(device_blocks: u32, scheduler: SchedulerConfig) -> Engine<ReadBack> {
    let mut pool = BlockPoolConfig::new(WorkerId(3), device_blocks);
    pool.block_size = BlockSize::new(BS as u32).unwrap();
    Engine::new_with_model(EngineConfig { pool, scheduler }, ReadBack::default()).unwrap()
}

fn request(id: u64, prompt: &[u32], max_tokens: u32) -> EngineRequest {
    let mut r = EngineRequest::new(RequestId(id), prompt.to_vec(), max_tokens);
    r.ignore_eos = true;
    r
}

fn run(e: &mut Engine<ReadBack>) -> Vec<RequestOutput> {
    let mut out = Vec::new();
    for t in 0..10_000u64 {
        let Some(step) = e.begin_step(t) else {
            return out;
        };
        assert_eq!(
            step.duration_ms, 0.0,
            "the model's own duration, not the mocker's"
        );
        out.extend(e.finish_step(t));
    }
    panic!("did not drain");
}

fn tokens_of(out: &[RequestOutput], id: u64) -> Vec<u32> {
    out.iter()
        .filter(|o| o.id == RequestId(id))
        .map(|o| o.token)
        .collect()
}

/// What the model's tokens are, computed without an engine: each next token is the sum of
/// the sequence so far, mod 1000.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        seq.push(seq.iter().sum::<u32>() % 1000);
    }
    seq[prompt.len()..].to_vec()
}

#[test]
fn another_model_runs_in_the_engine_with_its_kv_in_the_arena() {
    let prompt: Vec<u32> = (1..=10).collect();
    let mut e = engine(32, SchedulerConfig::default());
    e.add_request(request(1, &prompt, 5), 0).unwrap();
    let out = run(&mut e);
    assert_eq!(tokens_of(&out, 1), expected(&prompt, 5));
    assert_eq!(
        e.model().forgotten,
        vec![RequestId(1)],
        "told when it finished"
    );
    // The same prompt again: its two full blocks come from the prefix cache, written by the
    // first request, and give the same tokens.
    e.add_request(request(2, &prompt, 5), 100).unwrap();
    let out = run(&mut e);
    assert_eq!(out[0].cached_tokens, 8);
    assert_eq!(tokens_of(&out, 2), expected(&prompt, 5));
}

#[test]
fn chunks_batches_and_preemptions_give_the_tokens_of_one_lone_request() {
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| (0..(9 + 5 * i)).map(|t| 7 * t + i).collect())
        .collect();
    // Prompts in 3-token chunks, four at once, in a pool small enough to preempt.
    let cfg = SchedulerConfig {
        max_prefill_chunk: Some(3),
        ..SchedulerConfig::default()
    };
    let mut e = engine(14, cfg);
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(request(i as u64, p, 12), 0).unwrap();
    }
    let out = run(&mut e);
    assert!(
        e.stats().preemptions > 0,
        "the scenario preempts: {:?}",
        e.stats()
    );
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(tokens_of(&out, i as u64), expected(p, 12), "request {i}");
    }
}

#[test]
fn an_export_copies_the_bytes_the_model_wrote() {
    let prompt: Vec<u32> = (20..30).collect();
    let mut e = engine(32, SchedulerConfig::default());
    e.add_request(request(1, &prompt, 1), 0).unwrap();
    e.export_kv(RequestId(1), 0);
    run(&mut e);
    let (blocks, finished) = e.take_exported(RequestId(1)).expect("exported");
    assert!(finished);
    assert_eq!(blocks.len(), 3, "two full blocks and the partial last one");
    let per_token = SHAPE.bytes_per_token_layer();
    for b in &blocks {
        for slot in 0..BS {
            let p = b.index * BS + slot;
            if p >= prompt.len() {
                break;
            }
            let k = u16::from_le_bytes([b.bytes[slot * per_token], b.bytes[slot * per_token + 1]]);
            assert_eq!(u32::from(k), prompt[p], "token {p} in block {}", b.index);
        }
    }
}
