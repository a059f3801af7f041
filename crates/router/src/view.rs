//! What a caller hands the router ([`WorkerView`], [`RouteRequest`]) and what it gets back
//! ([`Decision`], [`ScoreTerms`]).

use tandem_indexer::TierCounts;
use tandem_protocol::{AdapterId, BlockSize, HashSeed, LoadReport, WorkerId};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::RouteError;

/// Tokens hashed into [`RouteRequest::prefix_key`] by default (the `prefix-hash` policy's k).
pub const PREFIX_KEY_TOKENS: usize = 256;

/// A worker's load as the router sees it. Built by the caller from the active-sequence
/// tracker ([`crate::TrackedLoad`]) and, where available, the worker's own [`LoadReport`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerLoad {
    /// Prompt tokens routed to the worker and not yet prefilled.
    pub active_prefill_tokens: u64,
    /// KV blocks the worker's in-flight requests hold or will hold (see [`crate::tracker`]).
    pub potential_decode_blocks: u64,
    /// Requests accepted and not finished, queued ones included.
    pub active_requests: u64,
    /// Fraction of device KV blocks in use, from the latest load report (0 when none).
    pub kv_usage: f64,
}

impl WorkerLoad {
    /// Folds in a worker's own report. The tracker only knows this router's (and its peers')
    /// requests and the report lags; taking the larger of the two on each count means neither
    /// blind spot makes a busy worker look idle.
    pub fn merge_report(&mut self, report: &LoadReport) {
        self.kv_usage = report.kv_usage();
        self.active_prefill_tokens = self
            .active_prefill_tokens
            .max(report.pending_prefill_tokens);
        let reported = u64::from(report.running_requests) + u64::from(report.waiting_requests);
        self.active_requests = self.active_requests.max(reported);
        self.potential_decode_blocks = self.potential_decode_blocks.max(report.kv_active_blocks);
    }
}

/// One candidate worker, gathered by the caller just before a decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerView {
    pub id: WorkerId,
    /// Leading prompt blocks the worker caches, per tier (from the indexer); zero when none.
    pub overlap: TierCounts,
    pub load: WorkerLoad,
    /// New to the pool: its load counts as at least the pool's median
    /// (see [`crate::PoolConfig`]).
    pub warming_up: bool,
    /// Its speed relative to its pool's median ([`crate::capacity`]); 1 for equal workers.
    /// The `kv` cost divides the worker's load terms by it.
    pub speed: f64,
    /// Blocks added to the `kv` cost after the speed division: for a prefill worker, moving
    /// the prompt's KV to the chosen decode worker ([`crate::disagg`]); 0 otherwise.
    pub extra_cost: f64,
    /// Blocks added to the `kv` cost for the request's LoRA adapter: 0 where it is resident,
    /// a load elsewhere ([`crate::adapters`]).
    pub adapter_cost: f64,
}

impl WorkerView {
    /// A worker with no cached overlap, not warming up.
    pub fn new(id: WorkerId, load: WorkerLoad) -> Self {
        WorkerView {
            id,
            overlap: TierCounts::default(),
            load,
            warming_up: false,
            speed: 1.0,
            extra_cost: 0.0,
            adapter_cost: 0.0,
        }
    }
}

/// Per-request overrides of the `kv` policy's knobs (e.g. from request headers).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvOverrides {
    /// Device overlap credit `c`.
    pub overlap_credit: Option<f64>,
    /// Prefill load scale `s`.
    pub prefill_load_scale: Option<f64>,
    /// Softmax temperature; 0 picks the minimum.
    pub temperature: Option<f64>,
}

impl KvOverrides {
    /// Rejects negative, NaN or infinite values: they would make every cost meaningless.
    pub fn validate(&self) -> Result<(), RouteError> {
        let fields = [
            ("overlap_credit", self.overlap_credit),
            ("prefill_load_scale", self.prefill_load_scale),
            ("temperature", self.temperature),
        ];
        for (name, v) in fields {
            match v {
                Some(v) if !(v.is_finite() && v >= 0.0) => {
                    return Err(RouteError::InvalidOverride { name, value: v });
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// What the router needs to know about a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteRequest {
    pub prompt_tokens: u64,
    pub block_size: BlockSize,
    /// xxh3 of the first [`PREFIX_KEY_TOKENS`] prompt tokens ([`prefix_key`]).
    pub prefix_key: u64,
    pub overrides: KvOverrides,
    /// Its band: `kv` weighs the decode term by it ([`crate::KvConfig::interactive_decode_weight`],
    /// [`crate::KvConfig::batch_decode_weight`]).
    pub priority: crate::Priority,
    /// Its LoRA adapter ([`crate::adapters`]); `None`: the base model.
    pub adapter: Option<AdapterId>,
    /// Prefilled where it decodes, whatever the disaggregation rule would say: an
    /// embedding is the prompt's last hidden state, which only the worker that computes the
    /// prompt has ([`crate::DisaggReason::LocalOnly`]).
    pub local_prefill: bool,
}

impl RouteRequest {
    /// A request for `tokens`, with its prefix key computed over the default k tokens.
    pub fn from_tokens(tokens: &[u32], block_size: BlockSize, seed: HashSeed) -> Self {
        RouteRequest {
            prompt_tokens: tokens.len() as u64,
            block_size,
            prefix_key: prefix_key(tokens, PREFIX_KEY_TOKENS, seed),
            overrides: KvOverrides::default(),
            priority: crate::Priority::Standard,
            adapter: None,
            local_prefill: false,
        }
    }

    /// The prompt in blocks, fractional: the unit every `kv` cost term is counted in.
    pub fn prompt_blocks(&self) -> f64 {
        self.prompt_tokens as f64 / f64::from(self.block_size.get())
    }

    /// Full prompt blocks: the most blocks any worker can have cached.
    pub fn full_prompt_blocks(&self) -> u64 {
        self.prompt_tokens / u64::from(self.block_size.get())
    }
}

/// xxh3-64 of the first `k` tokens (u32 little-endian) under the request's cache seed, so
/// tenants with different salts are placed independently.
pub fn prefix_key(tokens: &[u32], k: usize, seed: HashSeed) -> u64 {
    let bytes: Vec<u8> = tokens[..tokens.len().min(k)]
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    xxh3_64_with_seed(&bytes, seed.0)
}

/// Which rule of the policy made the choice: for logs, metrics and the simulator's reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rule {
    /// `round-robin`: the next worker by id after the previous pick.
    Rotation,
    /// `random`: uniform.
    Uniform,
    /// The least loaded worker (`least-loaded`, and the fallbacks of the affinity policies).
    LeastLoaded,
    /// `power-of-two`: the less loaded of two sampled workers.
    PowerOfTwo,
    /// `kv` at temperature 0: the minimum cost.
    MinCost,
    /// `kv` at temperature > 0: sampled from the softmax.
    Sampled,
    /// `cache-aware`: load imbalance over both thresholds, so least loaded.
    Imbalanced,
    /// `cache-aware`: best prefix match above the match-rate threshold.
    PrefixMatch,
    /// `cache-aware`: match rate too low, so least loaded.
    LowMatch,
    /// `prefix-hash`: the owner of the key on the ring.
    RingOwner,
    /// `prefix-hash`: the owner was over the load bound, so least loaded.
    BoundedLoadEscape,
    /// The request's session is pinned to this worker, which could take it
    /// ([`crate::sessions`]).
    Session,
}

/// One candidate's terms in a decision. The `kv` policy fills every field; the others fill
/// `cost` with the load they compare (active requests) and leave the `kv` terms at zero.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreTerms {
    pub worker: WorkerId,
    pub overlap: TierCounts,
    /// `decay(w)` applied to the device credit.
    pub decay: f64,
    /// `credit` in blocks.
    pub credit: f64,
    /// `raw_prefill` in blocks, before the credit.
    pub raw_prefill_blocks: f64,
    /// `max(raw_prefill − credit, 0)`, before the scale `s`.
    pub prefill_blocks: f64,
    pub decode_blocks: u64,
    pub active_requests: u64,
    /// The worker's capacity weight the load terms were divided by.
    pub speed: f64,
    /// [`WorkerView::extra_cost`]: the KV transfer of a remote prefill, in blocks.
    pub transfer: f64,
    /// [`WorkerView::adapter_cost`]: loading the request's LoRA adapter, in blocks.
    pub adapter: f64,
    /// The score compared; lower is better.
    pub cost: f64,
    /// Chance this worker was the pick given the state, when the policy knows it exactly
    /// (`power-of-two` does not compute it: it would cost O(n²) per decision).
    pub probability: Option<f64>,
}

impl ScoreTerms {
    /// Terms of a load-only policy: the cost is the active-request count.
    pub(crate) fn load_only(v: &WorkerView) -> Self {
        ScoreTerms {
            worker: v.id,
            overlap: v.overlap,
            decay: 1.0,
            credit: 0.0,
            raw_prefill_blocks: 0.0,
            prefill_blocks: 0.0,
            decode_blocks: v.load.potential_decode_blocks,
            active_requests: v.load.active_requests,
            speed: v.speed,
            transfer: 0.0,
            adapter: 0.0,
            cost: v.load.active_requests as f64,
            probability: None,
        }
    }
}

/// A policy's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub worker: WorkerId,
    pub rule: Rule,
    /// Every candidate's terms, in the order of the candidates given.
    pub explain: Vec<ScoreTerms>,
    /// Workers left out as busy before the policy ran (see [`crate::PoolConfig`]).
    pub excluded_busy: Vec<WorkerId>,
}

impl Decision {
    /// The chosen worker's terms.
    pub fn chosen_terms(&self) -> Option<&ScoreTerms> {
        self.explain.iter().find(|t| t.worker == self.worker)
    }
}
