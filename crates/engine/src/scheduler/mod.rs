//! Continuous batching over the [`BlockPool`], in the manner of vLLM v1.
//!
//! Each step has a token budget (`max_num_batched_tokens`). [`Scheduler::schedule`] serves the
//! running requests first, in admission order: a decoding request gets one token, a request
//! mid-prefill gets its next chunk. When a running request needs a KV block and none can be
//! had, the most recently admitted running request is *preempted by recompute*: its blocks go
//! back to the pool and it returns to the front of the waiting queue, to prefill its prompt and
//! every token generated so far when it is admitted again. Then, if nothing was preempted,
//! waiting requests are admitted first come first served, each starting on its cached prefix.
//!
//! The caller runs the model over the [`StepPlan`] (writing KV into the pool's arena; see
//! [`Scheduler::model_view`]) and reports the sampled tokens with
//! [`Scheduler::complete_step`], which advances every request, commits full blocks to the
//! prefix cache, and finishes requests on their length limit or stop token.
//!
//! # Remote prefill (the decode side)
//! A decode worker whose request is prefilled by another worker calls
//! [`Scheduler::begin_remote_prefill`]: the request takes its cached prefix and blocks for the
//! rest of its prompt at once, and waits in [`RequestPhase::AwaitingKv`] while the transport
//! writes the prompt's KV into those blocks. [`Scheduler::finish_remote_prefill`] then commits
//! the blocks to the prefix cache, takes the prefill worker's first token as generated and
//! seats the request to decode; [`Scheduler::fail_remote_prefill`] drops the blocks and queues
//! the request at the front for a local prefill. See `remote.rs`.
//!
//! # Invariants
//! - A request is in exactly one of: the waiting queue (holding no blocks), the running list
//!   (holding a block table in the pool), awaiting KV (holding its prompt's block table, never
//!   scheduled), the prefilled queue (holding its prompt's KV, decoding as soon as a seat is
//!   free; seated before any waiting request is admitted), or nowhere (finished or aborted,
//!   holding nothing).
//! - `computed ≤ tokens.len()` for every request; a request samples a token exactly when a step
//!   brings `computed` to `tokens.len()`, so at most one token's KV is ever missing.
//! - At least one token is computed on every admission (the prefix reuse is capped), so the
//!   model always has logits to sample from.
//!
//! Time is `u64` microseconds, passed in by the caller; nothing here reads a clock.

#[cfg(test)]
mod adapter_tests;
mod adapters;
mod admit;
mod complete;
mod remote;
#[cfg(test)]
mod remote_tests;
mod sequence;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::ops::Range;

use hashbrown::HashMap;
use tandem_protocol::{HashSeed, LoadReport, RequestId, WorkerId};

use crate::arena::KvArena;
use crate::pool::{BlockPool, PoolError};

pub use remote::RemotePrefill;

use adapters::AdapterSlots;
pub use sequence::{RequestPhase, Sequence};

/// Scheduling limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens computed per step, prefill and decode together (default 8192).
    pub max_num_batched_tokens: usize,
    /// Running requests at most (default 256).
    pub max_num_seqs: usize,
    /// Split long prefills over several steps (default true). When off, a prefill runs whole
    /// in one step, so a request must fit the step budget.
    pub enable_chunked_prefill: bool,
    /// Largest prefill chunk of one request in one step (None: only the budget limits it).
    /// Ignored when chunked prefill is off.
    pub max_prefill_chunk: Option<usize>,
    /// Waiting requests at most; beyond it `add_request` answers `QueueFull` (default 65536).
    pub max_waiting: usize,
    /// LoRA adapters one step may use at most (vLLM's `max_loras`; [`adapters`]); 0: not
    /// limited, and no adapter load is modelled (default).
    pub max_loras: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            enable_chunked_prefill: true,
            max_prefill_chunk: None,
            max_waiting: 65536,
            max_loras: 0,
        }
    }
}

/// How a model picks each next token: OpenAI's and vLLM's parameters (a real model applies
/// them; the mocker derives its tokens and ignores them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy.
    pub temperature: f32,
    /// Keep the most likely tokens up to this much of the mass (1: all).
    pub top_p: f32,
    /// Keep this many most likely tokens (0: all).
    pub top_k: u32,
    /// Drop tokens less likely than this times the most likely one (0: none).
    pub min_p: f32,
    /// Report each sampled token's log-probability and this many of the most likely
    /// alternatives with theirs (OpenAI's `logprobs` / `top_logprobs`); `None`: report none.
    pub logprobs: Option<u8>,
    /// Also return the prompt's embedding with the first token ([`SampledToken::embedding`]):
    /// what `/v1/embeddings` asks of a model.
    pub embed: bool,
}

impl SamplingParams {
    /// Always the most likely token.
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        logprobs: None,
        embed: false,
    };
}

impl Default for SamplingParams {
    /// The OpenAI API's defaults: temperature 1, nothing cut.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            ..SamplingParams::GREEDY
        }
    }
}

/// One generation request as the engine sees it (already validated and tokenized upstream).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    /// Tokens to generate at most; at least 1.
    pub max_tokens: u32,
    /// Cache namespace (the request's cache salt): blocks are shared only within one seed.
    pub hash_seed: HashSeed,
    /// Seed of the model's sampler.
    pub sampling_seed: u64,
    pub sampling: SamplingParams,
    /// Generation stops after this token (it is emitted), unless `ignore_eos`.
    pub stop_token: Option<u32>,
    pub ignore_eos: bool,
    /// The LoRA adapter it runs on; `None`: the base model. `hash_seed` should include it
    /// ([`HashSeed::for_request`]).
    pub adapter: Option<String>,
}

impl EngineRequest {
    /// A request with the unsalted cache namespace, sampling seed 0 and no stop token.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> Self {
        EngineRequest {
            id,
            prompt,
            max_tokens,
            hash_seed: HashSeed::UNSALTED,
            sampling_seed: 0,
            sampling: SamplingParams::default(),
            stop_token: None,
            ignore_eos: false,
            adapter: None,
        }
    }
}

pub use tandem_protocol::ErrorClass;

/// Errors of the scheduler.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(&'static str),
    #[error("request {0} has an empty prompt")]
    EmptyPrompt(RequestId),
    #[error("request {0} asks for zero tokens")]
    ZeroMaxTokens(RequestId),
    #[error("request {id} needs {needed} KV tokens, the pool holds at most {capacity}")]
    TooLong {
        id: RequestId,
        needed: usize,
        capacity: usize,
    },
    #[error(
        "request {id} needs a {needed}-token prefill but chunked prefill is off and a step \
         computes at most {budget} tokens"
    )]
    ExceedsStepBudget {
        id: RequestId,
        needed: usize,
        budget: usize,
    },
    #[error("request {0} already exists")]
    DuplicateRequest(RequestId),
    #[error("waiting queue is full ({0} requests)")]
    QueueFull(usize),
    #[error(
        "request {id}: no room for its prompt's KV now: needs {needed} blocks, {available} \
         can be had"
    )]
    NoRoomForKv {
        id: RequestId,
        needed: usize,
        available: usize,
    },
    #[error("request {0} is not awaiting KV")]
    NotAwaitingKv(RequestId),
    #[error("no step is in flight")]
    NoStepInFlight,
    #[error("step outputs do not match the plan: expected a token for {expected:?}, got {got:?}")]
    OutputMismatch {
        expected: Option<RequestId>,
        got: Option<RequestId>,
    },
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl SchedulerError {
    pub fn class(&self) -> ErrorClass {
        match self {
            SchedulerError::EmptyPrompt(_)
            | SchedulerError::ZeroMaxTokens(_)
            | SchedulerError::TooLong { .. }
            | SchedulerError::ExceedsStepBudget { .. }
            | SchedulerError::DuplicateRequest(_) => ErrorClass::InvalidRequest,
            SchedulerError::QueueFull(_) | SchedulerError::NoRoomForKv { .. } => {
                ErrorClass::Overloaded
            }
            SchedulerError::InvalidConfig(_)
            | SchedulerError::NotAwaitingKv(_)
            | SchedulerError::NoStepInFlight
            | SchedulerError::OutputMismatch { .. }
            | SchedulerError::Pool(_) => ErrorClass::Internal,
        }
    }
}

/// What a request computes in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// Tokens `start .. start + len` of the prompt (plus, after a preemption, of the tokens
    /// generated before it).
    Prefill { start: usize, len: usize },
    /// The KV of the token at `position` (the last one sampled), and the next token.
    Decode { position: usize },
}

/// One request's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub id: RequestId,
    pub kind: StepKind,
    /// Whether the model samples a token for it this step (decode, or the last prefill chunk).
    pub samples: bool,
    block_start: u32,
    block_len: u32,
}

impl ScheduledRequest {
    /// Token positions whose KV the step computes.
    pub fn tokens(&self) -> Range<usize> {
        match self.kind {
            StepKind::Prefill { start, len } => start..start + len,
            StepKind::Decode { position } => position..position + 1,
        }
    }

    pub fn is_prefill(&self) -> bool {
        matches!(self.kind, StepKind::Prefill { .. })
    }
}

/// The work of one step: who computes which tokens, over which KV blocks.
#[derive(Clone, Debug, Default)]
pub struct StepPlan {
    /// Step number, from 1.
    pub step: u64,
    /// When the step was scheduled (µs).
    pub now_us: u64,
    pub entries: Vec<ScheduledRequest>,
    /// Prefill tokens computed by the step (recomputation after preemption included).
    pub prefill_tokens: usize,
    /// Requests decoding one token each.
    pub decode_tokens: usize,
    /// KV tokens the running requests hold once the step has run (what decode attends over).
    pub kv_tokens: usize,
    /// Requests preempted while planning this step, in preemption order.
    pub preempted: Vec<RequestId>,
    /// LoRA adapters loaded for this step (each costs the step a load).
    pub adapter_loads: usize,
    // The block tables of all entries, back to back; entries index into it. One buffer,
    // reused from step to step, instead of one allocation per request.
    block_ids: Vec<u32>,
}

impl StepPlan {
    /// The block table an entry's step needs: every block from the sequence's first token up to
    /// its last computed one (attention reads the whole prefix).
    pub fn block_table(&self, entry: &ScheduledRequest) -> &[u32] {
        let s = entry.block_start as usize;
        &self.block_ids[s..s + entry.block_len as usize]
    }

    /// Entries with their block tables.
    pub fn iter(&self) -> impl Iterator<Item = (&ScheduledRequest, &[u32])> + '_ {
        self.entries.iter().map(move |e| (e, self.block_table(e)))
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn reset(&mut self, step: u64, now_us: u64) {
        self.step = step;
        self.now_us = now_us;
        self.entries.clear();
        self.prefill_tokens = 0;
        self.decode_tokens = 0;
        self.kv_tokens = 0;
        self.preempted.clear();
        self.adapter_loads = 0;
        self.block_ids.clear();
    }
}

/// The token the model sampled for one plan entry.
#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    pub id: RequestId,
    pub token: u32,
    /// When the request asked for them ([`SamplingParams::logprobs`]).
    pub logprobs: Option<Box<TokenLogprobs>>,
    /// When the request asked for it ([`SamplingParams::embed`]), with its first token: the
    /// model's final hidden state of the prompt's last token, normalized to length 1 (the
    /// last-token pooling vLLM applies to decoder models). `None` from a model that has none.
    pub embedding: Option<Box<[f32]>>,
}

/// A sampled token's log-probability and the most likely alternatives', under the model's
/// distribution before temperature and the top-k / top-p / min-p cuts (what vLLM reports by
/// default, and OpenAI's `logprobs` mean).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// `log p(token)`.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first (ties: lower
    /// id first); as many as the request asked for, fewer when fewer have any mass.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// What a model that puts all its mass on `token` reports (the mocker): log-probability 0,
    /// and `token` as the one alternative with any mass when `top >= 1`.
    pub fn certain(token: u32, top: u8) -> Box<TokenLogprobs> {
        Box::new(TokenLogprobs {
            logprob: 0.0,
            top: if top > 0 {
                vec![(token, 0.0)]
            } else {
                Vec::new()
            },
        })
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// `max_tokens` generated.
    Length,
    /// The stop token was generated.
    Stop,
}

/// One generated token of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    pub id: RequestId,
    pub token: u32,
    /// The request's first token (time to first token ends here).
    pub first_token: bool,
    /// Prompt tokens served from the prefix cache (device and host) at the admission that
    /// produced the first token: what usage reports as cached. For a remote prefill, what
    /// this worker held already (the rest was transferred).
    pub cached_tokens: usize,
    pub prompt_tokens: usize,
    /// Tokens generated so far, this one included.
    pub completion_tokens: u32,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
    /// On the first token: microseconds from `add_request` (or `begin_remote_prefill`) to the
    /// end of this step (or to `finish_remote_prefill`).
    pub time_to_first_token_us: Option<u64>,
    /// When the request asked for them.
    pub logprobs: Option<Box<TokenLogprobs>>,
    /// The prompt's embedding, on the first token of a request that asked for it
    /// ([`SampledToken::embedding`]).
    pub embedding: Option<Box<[f32]>>,
}

/// Counters since the scheduler was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Non-empty steps scheduled.
    pub steps: u64,
    pub preemptions: u64,
    /// Prefill tokens computed (recomputation included).
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// Tokens served from the prefix cache at requests' first admission (a remote prefill's
    /// blocks held already included).
    pub cached_tokens: u64,
    /// Tokens looked up in the prefix cache at requests' first admission (the whole prompt;
    /// vLLM's `prefix_cache_queries`, of which `cached_tokens` are its hits).
    pub queried_tokens: u64,
    /// The same two for re-admissions after a preemption, which mostly find the request's own
    /// blocks again (vLLM's `PrefixCacheStats.preempted_hits` / `preempted_queries`).
    pub preempted_cached_tokens: u64,
    pub preempted_queried_tokens: u64,
    /// Admissions from the waiting queue (re-admissions after preemption included).
    pub admissions: u64,
    pub finished: u64,
    pub aborted: u64,
    /// Remote prefills begun (`begin_remote_prefill` accepted).
    pub remote_prefills: u64,
    /// Remote prefills that failed and fell back to a local prefill.
    pub remote_prefill_fallbacks: u64,
    /// LoRA adapters loaded (see [`SchedulerConfig::max_loras`]).
    pub adapter_loads: u64,
}

/// Read access to the running requests, for a model computing the in-flight step.
#[derive(Clone, Copy, Debug)]
pub struct RunningSequences<'a> {
    seqs: &'a HashMap<RequestId, Sequence>,
}

impl<'a> RunningSequences<'a> {
    /// The request, if it is running (aborted ones are gone).
    pub fn get(&self, id: RequestId) -> Option<&'a Sequence> {
        self.seqs.get(&id).filter(|s| s.phase().is_scheduled())
    }
}

/// What a model needs to run the in-flight step: the plan, the requests, and the device KV
/// arena to write into, borrowed together.
pub struct ModelView<'a> {
    pub plan: &'a StepPlan,
    pub sequences: RunningSequences<'a>,
    pub arena: &'a mut KvArena,
    /// Told the number of layers whose K/V the step has written so far, as each layer
    /// completes, by a model that computes layer by layer (the native engine): a prefill
    /// worker sends those layers' parts of the step's blocks while the rest computes. A
    /// model that does not call it has its blocks sent when the step ends.
    pub progress: &'a (dyn Fn(u32) + Sync),
}

impl std::fmt::Debug for ModelView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelView")
            .field("plan", &self.plan)
            .field("sequences", &self.sequences)
            .field("arena", &self.arena)
            .finish_non_exhaustive()
    }
}

/// The [`ModelView::progress`] of a step nobody follows.
pub static NO_PROGRESS: fn(u32) = |_| {};

/// The continuous-batching scheduler of one worker; owns the worker's block pool.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    seqs: HashMap<RequestId, Sequence>,
    waiting: VecDeque<RequestId>,
    /// In admission order: the last one is the first to be preempted.
    running: Vec<RequestId>,
    /// Remote prefills finished while every seat was taken: decoding, holding their KV,
    /// seated (in order) before any waiting request is admitted.
    prefilled: VecDeque<RequestId>,
    /// Requests in [`RequestPhase::AwaitingKv`].
    awaiting_kv: usize,
    plan: StepPlan,
    in_flight: bool,
    stats: SchedulerStats,
    last_now_us: u64,
    /// Requests whose blocks are pinned when they finish (see [`Scheduler::pin_when_finished`]).
    pin_on_finish: hashbrown::HashSet<RequestId>,
    /// Finished requests' pinned blocks, until released.
    pinned: HashMap<RequestId, Vec<u32>>,
    adapters: AdapterSlots,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, pool: BlockPool) -> Result<Self, SchedulerError> {
        if cfg.max_num_batched_tokens == 0 {
            return Err(SchedulerError::InvalidConfig(
                "max_num_batched_tokens must be at least 1",
            ));
        }
        if cfg.max_num_seqs == 0 {
            return Err(SchedulerError::InvalidConfig(
                "max_num_seqs must be at least 1",
            ));
        }
        if cfg.max_prefill_chunk == Some(0) {
            return Err(SchedulerError::InvalidConfig(
                "max_prefill_chunk must be at least 1",
            ));
        }
        let adapters = AdapterSlots::new(cfg.max_loras);
        Ok(Scheduler {
            plan: StepPlan {
                entries: Vec::with_capacity(cfg.max_num_seqs.min(4096)),
                ..StepPlan::default()
            },
            cfg,
            pool,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefilled: VecDeque::new(),
            awaiting_kv: 0,
            in_flight: false,
            stats: SchedulerStats::default(),
            last_now_us: 0,
            pin_on_finish: hashbrown::HashSet::new(),
            pinned: HashMap::new(),
            adapters,
        })
    }

    /// Validates a request and queues it behind the others.
    pub fn add_request(&mut self, req: EngineRequest, now_us: u64) -> Result<(), SchedulerError> {
        self.validate(&req)?;
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(SchedulerError::QueueFull(self.waiting.len()));
        }
        self.last_now_us = self.last_now_us.max(now_us);
        let id = req.id;
        let seq = Sequence::new(req, self.pool.block_size(), now_us);
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// The checks every new request passes, wherever it is prefilled.
    fn validate(&self, req: &EngineRequest) -> Result<(), SchedulerError> {
        let id = req.id;
        if req.prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt(id));
        }
        if req.max_tokens == 0 {
            return Err(SchedulerError::ZeroMaxTokens(id));
        }
        // The last generated token's KV is never computed: the longest sequence in KV is
        // prompt + max_tokens - 1. One that the whole pool cannot hold would preempt itself
        // forever, so it is refused up front.
        let needed = req.prompt.len() + req.max_tokens as usize - 1;
        let capacity = self.pool.device_capacity() * self.pool.block_size().tokens();
        if needed > capacity {
            return Err(SchedulerError::TooLong {
                id,
                needed,
                capacity,
            });
        }
        let budget = self.cfg.max_num_batched_tokens;
        if !self.cfg.enable_chunked_prefill && needed > budget {
            // A recompute after preemption prefills up to `needed` tokens in one step.
            return Err(SchedulerError::ExceedsStepBudget { id, needed, budget });
        }
        if self.seqs.contains_key(&id) || self.pinned.contains_key(&id) {
            return Err(SchedulerError::DuplicateRequest(id));
        }
        Ok(())
    }

    /// When request `id` finishes, its blocks stay pinned (out of reuse, bytes unchanged)
    /// until [`release_pinned`](Self::release_pinned); its id stays taken until then.
    pub fn pin_when_finished(&mut self, id: RequestId) {
        if self.seqs.contains_key(&id) {
            self.pin_on_finish.insert(id);
        }
    }

    /// Releases the blocks pinned when `id` finished; false when none are.
    pub fn release_pinned(&mut self, id: RequestId) -> bool {
        let Some(blocks) = self.pinned.remove(&id) else {
            return false;
        };
        let released = self.pool.release_hold(&blocks);
        debug_assert!(released.is_ok(), "pinned blocks of {id} were held");
        true
    }

    /// Blocks of finished requests still pinned.
    pub fn pinned_blocks(&self) -> usize {
        self.pinned.values().map(Vec::len).sum()
    }

    /// Drops a request wherever it is (awaiting KV included) and frees its blocks. Safe while a step is in flight: the
    /// request's entry is skipped when the step completes. False when the request is unknown
    /// (finished already, or never added).
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.pin_on_finish.remove(&id);
        let Some(seq) = self.seqs.remove(&id) else {
            return self.release_pinned(id);
        };
        if seq.phase() == RequestPhase::Waiting {
            if let Some(pos) = self.waiting.iter().position(|w| *w == id) {
                self.waiting.remove(pos);
            }
        } else {
            if seq.phase() == RequestPhase::AwaitingKv {
                self.awaiting_kv -= 1;
            } else if let Some(pos) = self.running.iter().position(|r| *r == id) {
                self.running.remove(pos);
            } else if let Some(pos) = self.prefilled.iter().position(|r| *r == id) {
                self.prefilled.remove(pos);
            }
            let freed = self.pool.free(id);
            debug_assert!(freed.is_ok(), "request {id} had no block table");
        }
        self.stats.aborted += 1;
        true
    }

    /// The in-flight plan with the running requests and the device arena, for the model.
    /// None when no step is in flight.
    pub fn model_view(&mut self) -> Option<ModelView<'_>> {
        if !self.in_flight {
            return None;
        }
        Some(ModelView {
            plan: &self.plan,
            sequences: RunningSequences { seqs: &self.seqs },
            arena: self.pool.device_arena_mut(),
            progress: &NO_PROGRESS,
        })
    }

    /// The in-flight plan, or the last one planned.
    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }

    /// Whether a planned step awaits `complete_step`.
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Mutable pool, for moving KV bytes in and out of the arena (transfers, tests). Changing
    /// block tables behind the scheduler's back breaks it.
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    pub fn sequence(&self, id: RequestId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn phase(&self, id: RequestId) -> Option<RequestPhase> {
        self.seqs.get(&id).map(Sequence::phase)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests awaiting their prompt's KV from a remote prefill.
    pub fn num_awaiting_kv(&self) -> usize {
        self.awaiting_kv
    }

    /// Remotely prefilled requests waiting for a seat to decode.
    pub fn num_prefilled_queued(&self) -> usize {
        self.prefilled.len()
    }

    /// Whether any request is tracked: waiting, running, awaiting KV or prefilled and queued.
    /// With only requests awaiting KV, `schedule` plans nothing until their transfers end.
    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Tokens still to prefill here: all of each waiting request (its cache hit is not known
    /// before admission) and the rest of each running prefill; none of a remote prefill's.
    /// O(requests).
    pub fn pending_prefill_tokens(&self) -> usize {
        let waiting: usize = self
            .waiting
            .iter()
            .map(|id| self.seqs[id].tokens().len())
            .sum();
        let running: usize = self
            .running
            .iter()
            .map(|id| &self.seqs[id])
            .filter(|s| s.phase() == RequestPhase::Prefilling)
            .map(|s| s.tokens().len() - s.computed())
            .sum();
        waiting + running
    }

    /// Tokens whose KV the running requests hold. O(running).
    pub fn active_kv_tokens(&self) -> usize {
        self.running.iter().map(|id| self.seqs[id].computed()).sum()
    }

    /// A load report as of `now_us` (the latest time seen when older). Requests awaiting KV
    /// and prefilled ones queued for a seat count as running: they hold KV here and decode
    /// here next, and their prefill is not this worker's work.
    pub fn load_report(&self, worker_id: WorkerId, now_us: u64) -> LoadReport {
        let running = self.running.len() + self.prefilled.len() + self.awaiting_kv;
        LoadReport {
            worker_id,
            timestamp_ms: now_us.max(self.last_now_us) / 1000,
            running_requests: running as u32,
            waiting_requests: self.waiting.len() as u32,
            pending_prefill_tokens: self.pending_prefill_tokens() as u64,
            kv_active_blocks: self.pool.active_blocks() as u64,
            kv_total_blocks: self.pool.device_capacity() as u64,
            last_kv_event_id: self.pool.last_event_id(),
            prefill_tokens_total: self.stats.prefill_tokens,
            decode_tokens_total: self.stats.decode_tokens,
            busy_us_total: 0,
            adapters: tandem_protocol::AdapterLoad {
                max_loaded: self.adapters.max() as u32,
                resident: self.adapters.resident(),
            },
        }
    }
}
