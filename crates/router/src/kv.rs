//! The `kv` policy: docs/ARCHITECTURE.md §5's cost in KV blocks, lower is better.
//!
//! ```text
//! raw_prefill = (active_prefill_tokens(w) + prompt_tokens) / block_size
//! credit      = c·decay(w)·device_overlap + h·host_overlap + k·disk_overlap
//! decay(w)    = 1 / (1 + d·excess(w)),
//! excess(w)   = (backlog(w) − least backlog) / request blocks   (backlog in blocks)
//! cost(w)     = (s·max(raw_prefill − credit, 0) + potential_decode_blocks(w)
//!                + a·active_requests(w)) / speed(w)
//! ```
//!
//! The decode term is weighed by the request's band — `interactive_decode_weight` (1.5) for
//! interactive requests, `batch_decode_weight` (0.5) for batch ones, 1 for standard — so a
//! request someone waits on avoids workers with many generations in flight (its TPOT), and
//! batch work follows its cache onto busy workers (throughput).
//!
//! A prefill worker's cost also adds the transfer of the prompt's KV to the chosen decode
//! worker, in block-equivalents ([`crate::disagg`]), after the division by its speed.
//!
//! A request on a LoRA adapter adds the adapter's load where the worker does not hold it
//! ([`crate::adapters`]), also after the division.
//!
//! `speed(w)` is the worker's capacity weight ([`crate::capacity`]): 1 unless capacity
//! weights are on and the workers differ, so a worker twice as fast costs half as much for
//! the same blocks.
//!
//! Temperature 0 takes the minimum, ties broken uniformly at random; T > 0 samples
//! `p(w) ∝ exp(−(cost(w) − min)/((max − min)·T))`: normalising by the range makes T mean the
//! same thing whatever the scale of the costs.

use crate::error::{ConfigError, RouteError, non_negative};
use crate::policy::{Policy, check_candidates};
use crate::rng::Rng;
use crate::view::{Decision, RouteRequest, Rule, ScoreTerms, WorkerView};

/// Knobs of the `kv` cost; every one is a flag upstream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvConfig {
    /// `c`: credit per device block already cached.
    pub overlap_credit: f64,
    /// Credit per host block: cheaper to onboard than to recompute, dearer than device. The
    /// default is the share of a recompute a host hit saved on an H200
    /// (crates/router/EXPERIMENTS.md, "Tier weights from measured TTFT").
    pub host_weight: f64,
    /// Credit per disk block (its default measured likewise).
    pub disk_weight: f64,
    /// `s`: weight of the prefill term against the decode term.
    pub prefill_load_scale: f64,
    /// `d`: how fast a backlogged worker's device credit decays (0: never).
    pub decay: f64,
    /// `a`: cost per active request.
    pub active_request_weight: f64,
    /// Softmax temperature; 0 picks the minimum.
    pub temperature: f64,
    /// Weight of the decode term for interactive requests (standard ones: 1).
    pub interactive_decode_weight: f64,
    /// Weight of the decode term for batch requests.
    pub batch_decode_weight: f64,
}

impl Default for KvConfig {
    /// tandem's defaults, the `tandem` binary's flags' too: Dynamo's configuration
    /// ([`KvConfig::dynamo`]) with the prefill term weighed twice (`prefill_load_scale` 2),
    /// which lifted capacity under the SLO on both bundled traces (conversation ×0.85 →
    /// ×0.95, the oracle's; crates/router/EXPERIMENTS.md).
    fn default() -> Self {
        KvConfig {
            prefill_load_scale: 2.0,
            ..KvConfig::dynamo()
        }
    }
}

impl KvConfig {
    /// Dynamo's configuration (overlap weight 1, prefill and decode blocks weighed alike,
    /// temperature 0), the baseline of crates/router/EXPERIMENTS.md, and of the tests that
    /// check the cost formula term by term.
    pub fn dynamo() -> Self {
        KvConfig {
            overlap_credit: 1.0,
            host_weight: 0.85,
            disk_weight: 0.5,
            prefill_load_scale: 1.0,
            decay: 0.0,
            active_request_weight: 0.0,
            temperature: 0.0,
            interactive_decode_weight: 1.5,
            batch_decode_weight: 0.5,
        }
    }

    /// How the prefill pool is scored under disaggregation: its workers decode nothing, so
    /// the prefill term is their whole load, and its scale only weighs a block to prefill
    /// against a block to move (the transfer term): one to one.
    pub fn prefill_pool() -> Self {
        KvConfig {
            prefill_load_scale: 1.0,
            ..KvConfig::default()
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("kv overlap credit", self.overlap_credit)?;
        non_negative("kv host weight", self.host_weight)?;
        non_negative("kv disk weight", self.disk_weight)?;
        non_negative("kv prefill load scale", self.prefill_load_scale)?;
        non_negative("kv decay", self.decay)?;
        non_negative("kv active request weight", self.active_request_weight)?;
        non_negative("kv temperature", self.temperature)?;
        non_negative(
            "kv interactive decode weight",
            self.interactive_decode_weight,
        )?;
        non_negative("kv batch decode weight", self.batch_decode_weight)
    }

    /// The decode term's weight for a request of band `p`.
    pub fn decode_weight(&self, p: crate::Priority) -> f64 {
        match p {
            crate::Priority::Interactive => self.interactive_decode_weight,
            crate::Priority::Standard => 1.0,
            crate::Priority::Batch => self.batch_decode_weight,
        }
    }

    /// No credit for any tier: the worker's cache is ignored, only load counts. Used for the
    /// decode worker when every prompt is prefilled remotely (docs/ARCHITECTURE.md §6).
    pub fn without_credit(self) -> Self {
        KvConfig {
            overlap_credit: 0.0,
            host_weight: 0.0,
            disk_weight: 0.0,
            ..self
        }
    }

    /// The request's overrides applied on top.
    fn effective(&self, req: &RouteRequest) -> KvConfig {
        let o = &req.overrides;
        KvConfig {
            overlap_credit: o.overlap_credit.unwrap_or(self.overlap_credit),
            prefill_load_scale: o.prefill_load_scale.unwrap_or(self.prefill_load_scale),
            temperature: o.temperature.unwrap_or(self.temperature),
            ..*self
        }
    }
}

/// Every candidate's cost terms (probability not yet set).
pub fn kv_terms(cfg: &KvConfig, req: &RouteRequest, candidates: &[WorkerView]) -> Vec<ScoreTerms> {
    let bs = f64::from(req.block_size.get());
    let request_blocks = req.prompt_blocks();
    let decode_weight = cfg.decode_weight(req.priority);
    let least_backlog = candidates
        .iter()
        .map(|v| v.load.active_prefill_tokens)
        .min()
        .unwrap_or(0);
    candidates
        .iter()
        .map(|v| {
            let backlog = v.load.active_prefill_tokens;
            // A prompt under one block has no overlap to decay: avoid dividing by ~0.
            let excess = if request_blocks > 0.0 {
                (backlog - least_backlog) as f64 / bs / request_blocks
            } else {
                0.0
            };
            let decay = 1.0 / (1.0 + cfg.decay * excess);
            let credit = cfg.overlap_credit * decay * f64::from(v.overlap.device)
                + cfg.host_weight * f64::from(v.overlap.host)
                + cfg.disk_weight * f64::from(v.overlap.disk);
            let raw = (backlog + req.prompt_tokens) as f64 / bs;
            let prefill = (raw - credit).max(0.0);
            let cost = (cfg.prefill_load_scale * prefill
                + decode_weight * v.load.potential_decode_blocks as f64
                + cfg.active_request_weight * v.load.active_requests as f64)
                / v.speed
                + v.extra_cost
                + v.adapter_cost;
            ScoreTerms {
                worker: v.id,
                overlap: v.overlap,
                decay,
                credit,
                raw_prefill_blocks: raw,
                prefill_blocks: prefill,
                decode_blocks: v.load.potential_decode_blocks,
                active_requests: v.load.active_requests,
                speed: v.speed,
                transfer: v.extra_cost,
                adapter: v.adapter_cost,
                cost,
                probability: None,
            }
        })
        .collect()
}

/// Costs within this relative distance of the minimum count as tied: the same state reached
/// through differently rounded sums must not turn a tie into a preference.
const TIE_EPSILON: f64 = 1e-9;

fn tied(cost: f64, min: f64) -> bool {
    cost - min <= TIE_EPSILON * min.abs().max(1.0)
}

/// Picks among `terms` by cost at `temperature`, filling in each probability. Returns the
/// index of the pick and the rule used. `terms` must not be empty.
pub fn choose_by_cost(terms: &mut [ScoreTerms], temperature: f64, rng: &mut Rng) -> (usize, Rule) {
    let min = terms.iter().map(|t| t.cost).fold(f64::INFINITY, f64::min);
    let max = terms
        .iter()
        .map(|t| t.cost)
        .fold(f64::NEG_INFINITY, f64::max);
    if temperature == 0.0 || tied(max, min) {
        let ties: Vec<usize> = (0..terms.len())
            .filter(|&i| tied(terms[i].cost, min))
            .collect();
        let p = 1.0 / ties.len() as f64;
        for t in terms.iter_mut() {
            t.probability = Some(if tied(t.cost, min) { p } else { 0.0 });
        }
        let rule = if temperature == 0.0 {
            Rule::MinCost
        } else {
            Rule::Sampled
        };
        return (ties[rng.below(ties.len())], rule);
    }
    let scale = (max - min) * temperature;
    let weights: Vec<f64> = terms
        .iter()
        .map(|t| (-(t.cost - min) / scale).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    for (t, w) in terms.iter_mut().zip(&weights) {
        t.probability = Some(w / total);
    }
    // The minimum has weight exactly 1, so `total >= 1` and the walk always lands somewhere;
    // the fallback covers the last ulp of rounding.
    let mut target = rng.unit_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return (i, Rule::Sampled);
        }
        target -= w;
    }
    (weights.len() - 1, Rule::Sampled)
}

/// Scores and picks with `cfg` after the request's overrides: the `kv` policy's whole
/// decision, also used by the disaggregation rule for both pools.
pub fn kv_decide(
    cfg: &KvConfig,
    req: &RouteRequest,
    candidates: &[WorkerView],
    rng: &mut Rng,
) -> Result<Decision, RouteError> {
    req.overrides.validate()?;
    check_candidates(candidates)?;
    let cfg = cfg.effective(req);
    let mut explain = kv_terms(&cfg, req, candidates);
    let (i, rule) = choose_by_cost(&mut explain, cfg.temperature, rng);
    Ok(Decision {
        worker: explain[i].worker,
        rule,
        explain,
        excluded_busy: Vec::new(),
    })
}

/// The `kv` policy.
#[derive(Clone, Debug)]
pub struct KvPolicy {
    config: KvConfig,
}

impl KvPolicy {
    pub fn new(config: KvConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(KvPolicy { config })
    }
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn select(
        &mut self,
        req: &RouteRequest,
        candidates: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        kv_decide(&self.config, req, candidates, rng)
    }
}
