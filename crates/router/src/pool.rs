//! Candidate preparation shared by every policy: warm-up and busy thresholds (docs/ARCHITECTURE.md §5),
//! and [`Router`], which applies them before its policy.
//!
//! - **Busy**: a worker whose KV usage or pending prefill tokens exceed a threshold is left
//!   out while at least one worker is under both; when every worker is busy, all stay
//!   candidates (refusing would be admission control's call, not the policy's).
//! - **Warm-up**: a worker new to the pool has an empty cache and an empty tracker entry; left
//!   as it is, every load-driven policy would pile new requests onto it. During its warm-up its
//!   load counts as at least the median of the other (non-warming) candidates, field by field.
//!   The median is taken after the busy filter: those are the workers it competes with.

use tandem_protocol::WorkerId;

use crate::error::{ConfigError, RouteError, non_negative};
use crate::policy::{Policy, check_candidates};
use crate::registry::PolicyConfig;
use crate::rng::Rng;
use crate::view::{Decision, RouteRequest, WorkerLoad, WorkerView};

/// Warm-up and busy thresholds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolConfig {
    /// How long a new worker counts as warming up, in milliseconds.
    pub warmup_ms: u64,
    /// Busy above this KV usage fraction; `None` disables the check.
    pub busy_kv_usage: Option<f64>,
    /// Busy above this many pending prefill tokens; `None` disables the check.
    pub busy_prefill_tokens: Option<u64>,
}

impl Default for PoolConfig {
    /// Warm-up 30 s; busy checks off, as they change routing in ways an operator should opt
    /// into with thresholds that fit their workers.
    fn default() -> Self {
        PoolConfig {
            warmup_ms: 30_000,
            busy_kv_usage: None,
            busy_prefill_tokens: None,
        }
    }
}

impl PoolConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(u) = self.busy_kv_usage {
            non_negative("busy kv usage", u)?;
        }
        Ok(())
    }

    /// Whether a worker that joined at `joined_at_ms` is still warming up at `now_ms`.
    pub fn is_warming_up(&self, joined_at_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(joined_at_ms) < self.warmup_ms
    }

    /// Whether a load is over either busy threshold.
    pub fn is_busy(&self, load: &WorkerLoad) -> bool {
        self.busy_kv_usage.is_some_and(|t| load.kv_usage > t)
            || self
                .busy_prefill_tokens
                .is_some_and(|t| load.active_prefill_tokens > t)
    }
}

/// The candidates a policy sees, and who was left out as busy.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    pub views: Vec<WorkerView>,
    pub excluded_busy: Vec<WorkerId>,
}

/// Lower median (of an even count, the smaller middle value): a warming worker is never made
/// to look busier than half of the pool.
fn lower_median<T: Copy + PartialOrd>(mut xs: Vec<T>) -> Option<T> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Some(xs[(xs.len() - 1) / 2])
}

/// Applies the busy filter, then lifts warming workers to the median load.
pub fn prepare_candidates(cfg: &PoolConfig, views: &[WorkerView]) -> Candidates {
    let any_free = views.iter().any(|v| !cfg.is_busy(&v.load));
    let (mut kept, mut excluded_busy) = (Vec::with_capacity(views.len()), Vec::new());
    for v in views {
        if any_free && cfg.is_busy(&v.load) {
            excluded_busy.push(v.id);
        } else {
            kept.push(*v);
        }
    }
    let warm: Vec<WorkerLoad> = kept
        .iter()
        .filter(|v| !v.warming_up)
        .map(|v| v.load)
        .collect();
    let median = || -> Option<WorkerLoad> {
        Some(WorkerLoad {
            active_prefill_tokens: lower_median(
                warm.iter().map(|l| l.active_prefill_tokens).collect(),
            )?,
            potential_decode_blocks: lower_median(
                warm.iter().map(|l| l.potential_decode_blocks).collect(),
            )?,
            active_requests: lower_median(warm.iter().map(|l| l.active_requests).collect())?,
            kv_usage: lower_median(warm.iter().map(|l| l.kv_usage).collect())?,
        })
    };
    if let Some(m) = kept.iter().any(|v| v.warming_up).then(median).flatten() {
        for v in kept.iter_mut().filter(|v| v.warming_up) {
            let l = &mut v.load;
            l.active_prefill_tokens = l.active_prefill_tokens.max(m.active_prefill_tokens);
            l.potential_decode_blocks = l.potential_decode_blocks.max(m.potential_decode_blocks);
            l.active_requests = l.active_requests.max(m.active_requests);
            l.kv_usage = l.kv_usage.max(m.kv_usage);
        }
    }
    Candidates {
        views: kept,
        excluded_busy,
    }
}

/// Everything a non-disaggregated frontend needs to pick a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RouterConfig {
    pub policy: PolicyConfig,
    pub pool: PoolConfig,
}

/// A policy behind the pool rules: the one call a frontend or the simulator makes per request.
#[derive(Debug)]
pub struct Router {
    pool: PoolConfig,
    policy: Box<dyn Policy>,
}

impl Router {
    pub fn new(config: RouterConfig) -> Result<Self, ConfigError> {
        config.pool.validate()?;
        Ok(Router {
            pool: config.pool,
            policy: config.policy.build()?,
        })
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    pub fn pool_config(&self) -> &PoolConfig {
        &self.pool
    }

    /// Picks a worker among `views`. The decision's terms show the loads the policy saw
    /// (warming workers already lifted to the median).
    pub fn select(
        &mut self,
        req: &RouteRequest,
        views: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        check_candidates(views)?;
        let c = prepare_candidates(&self.pool, views);
        let mut d = self.policy.select(req, &c.views, rng)?;
        d.excluded_busy = c.excluded_busy;
        Ok(d)
    }
}
