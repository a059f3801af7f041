//! One request's state inside the scheduler: its tokens, how many have KV, its block hashes
//! and where it is in its lifecycle.

use tandem_protocol::{BlockHashes, BlockSize, HashSeed, RequestId, TokenBlockHasher};

use super::{EngineRequest, FinishReason};

/// Where a request is in its life. Finished and aborted requests leave the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestPhase {
    /// Queued, holding no KV blocks (new, or preempted).
    Waiting,
    /// Admitted, computing its prompt (after a preemption: prompt and generated tokens).
    Prefilling,
    /// Generating one token per step (running, or remotely prefilled and queued for a seat).
    Decoding,
    /// Remote prefill: holding blocks for its prompt while another worker's KV is written into
    /// them; neither waiting nor running, never scheduled, its blocks not evictable.
    AwaitingKv,
}

impl RequestPhase {
    /// Whether a request in this phase may have entries in a step plan.
    pub fn is_scheduled(self) -> bool {
        matches!(self, RequestPhase::Prefilling | RequestPhase::Decoding)
    }
}

/// A request as the scheduler tracks it.
#[derive(Clone, Debug)]
pub struct Sequence {
    id: RequestId,
    /// Prompt, then every generated token.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: u32,
    /// `None` when the request ignores its stop token.
    stop_token: Option<u32>,
    hash_seed: HashSeed,
    sampling_seed: u64,
    sampling: super::SamplingParams,
    adapter: Option<std::sync::Arc<str>>,
    /// Hashes of every full block of `tokens`, kept up to date by `hasher` as tokens arrive.
    hashes: Vec<BlockHashes>,
    hasher: TokenBlockHasher,
    pub(super) phase: RequestPhase,
    /// Leading tokens whose KV is in the sequence's blocks.
    pub(super) computed: usize,
    /// Leading full blocks committed to the prefix cache.
    pub(super) committed: usize,
    pub(super) generated: u32,
    pub(super) cached_tokens: usize,
    /// Times admitted from the waiting queue or given blocks by a remote prefill: a model
    /// keeping per-request state resets it when this changes (the KV was dropped and rebuilt).
    pub(super) admissions: u32,
    /// Times preempted by recompute.
    pub(super) preemptions: u32,
    pub(super) arrival_us: u64,
}

impl Sequence {
    pub(super) fn new(req: EngineRequest, block_size: BlockSize, now_us: u64) -> Self {
        let mut hasher = TokenBlockHasher::new(block_size, req.hash_seed);
        let mut hashes =
            Vec::with_capacity(block_size.blocks_for(req.prompt.len() + req.max_tokens as usize));
        hasher.extend(&req.prompt, &mut hashes);
        let prompt_len = req.prompt.len();
        let mut tokens = req.prompt;
        tokens.reserve(req.max_tokens.min(4096) as usize);
        Sequence {
            id: req.id,
            tokens,
            prompt_len,
            max_tokens: req.max_tokens,
            stop_token: if req.ignore_eos { None } else { req.stop_token },
            hash_seed: req.hash_seed,
            sampling_seed: req.sampling_seed,
            sampling: req.sampling,
            adapter: req.adapter.map(std::sync::Arc::from),
            hashes,
            hasher,
            phase: RequestPhase::Waiting,
            computed: 0,
            committed: 0,
            generated: 0,
            cached_tokens: 0,
            admissions: 0,
            preemptions: 0,
            arrival_us: now_us,
        }
    }

    /// Appends a sampled token; returns why the request ends, if it does.
    pub(super) fn push_token(&mut self, token: u32) -> Option<FinishReason> {
        self.tokens.push(token);
        if let Some(h) = self.hasher.push(token) {
            self.hashes.push(h);
        }
        self.generated += 1;
        if self.stop_token == Some(token) {
            Some(FinishReason::Stop)
        } else if self.generated >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Forgets all computed KV (the blocks were freed by a preemption).
    pub(super) fn reset_for_recompute(&mut self) {
        self.phase = RequestPhase::Waiting;
        self.computed = 0;
        self.committed = 0;
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Prompt followed by the tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Hashes of every full block of [`Sequence::tokens`].
    pub fn block_hashes(&self) -> &[BlockHashes] {
        &self.hashes
    }

    pub fn hash_seed(&self) -> HashSeed {
        self.hash_seed
    }

    /// The LoRA adapter it runs on.
    pub fn adapter(&self) -> Option<&std::sync::Arc<str>> {
        self.adapter.as_ref()
    }

    pub fn sampling(&self) -> &super::SamplingParams {
        &self.sampling
    }

    pub fn sampling_seed(&self) -> u64 {
        self.sampling_seed
    }

    pub fn phase(&self) -> RequestPhase {
        self.phase
    }

    /// Leading tokens whose KV is computed (or reused from the cache).
    pub fn computed(&self) -> usize {
        self.computed
    }

    pub fn generated(&self) -> u32 {
        self.generated
    }

    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }

    /// Prompt tokens served from the prefix cache at the last admission before the first token.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// Times admitted; changes exactly when the request's KV was dropped and is rebuilt.
    pub fn admissions(&self) -> u32 {
        self.admissions
    }

    pub fn arrival_us(&self) -> u64 {
        self.arrival_us
    }
}
