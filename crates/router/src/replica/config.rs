//! What a routing replica is made from: [`RoutingConfig`] (the knobs the frontend's flags and
//! the simulator's flags both set) and [`ReplicaConfig`] (plus the replica's identity and seed).

use tandem_indexer::ApproxConfig;
use tandem_protocol::{BlockSize, HashSeed};

use crate::adapters::AdapterConfig;
use crate::breaker::{BreakerConfig, RetryBudgetConfig};
use crate::capacity::CapacityConfig;
use crate::disagg::DisaggConfig;
use crate::error::ConfigError;
use crate::pool::PoolConfig;
use crate::registry::PolicyConfig;
use crate::saturation::SaturationConfig;
use crate::sessions::SessionConfig;
use crate::tracker::{RouterId, TrackerConfig};
use crate::view::{PREFIX_KEY_TOKENS, RouteRequest};

/// How requests are routed: one type for the frontend and `tandem sim`, so a simulated
/// router is configured exactly as a live one.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoutingConfig {
    /// Policy over the decode (aggregated) pool when there is no prefill pool.
    pub policy: PolicyConfig,
    /// Warm-up and busy rules of that pool.
    pub pool: PoolConfig,
    /// Conditional disaggregation, its thresholds and both pools' `kv` knobs and rules, used
    /// when a prefill pool exists.
    pub disagg: DisaggConfig,
    pub tracker: TrackerConfig,
    /// Fold the workers' load reports into the tracked loads (the larger of the two on each
    /// count, [`crate::WorkerLoad::merge_report`]). Off by default: the tracker (with replica
    /// sync) knows every request routed, while a report lags by up to its interval — a report
    /// taken while a request was still running makes the worker that just cached its prefix
    /// look busy, and the next request with that prefix goes elsewhere. Turn it on for
    /// replicas that do not sync, or to route on reports alone (the simulator's snapshot
    /// mode). The KV usage (for the busy threshold) always comes from the reports.
    pub merge_load_reports: bool,
    /// The approximate index of workers that publish no KV events
    /// ([`crate::KvSource::Approximate`]): how long a routed prompt counts as cached there,
    /// and the most (worker, block) entries kept, oldest pruned first.
    pub approx: ApproxConfig,
    /// Route every worker on the replica's own decisions ([`crate::KvSource::Approximate`]),
    /// whatever it says it publishes: for engines whose KV events do not reach the router.
    /// KV events that still arrive are dropped.
    pub approximate_kv: bool,
    /// When a decode worker counts as saturated, for flow control
    /// ([`crate::RoutingReplica::route_admitted`]); the policies themselves ignore it.
    pub saturation: SaturationConfig,
    /// Circuit breakers per worker: when a failing worker stops being chosen.
    pub breaker: BreakerConfig,
    /// Retries (and hedges) allowed per recent success.
    pub retry_budget: RetryBudgetConfig,
    /// Session affinity ([`crate::sessions`]): for requests that name a session.
    pub sessions: SessionConfig,
    /// Capacity weights for unequal workers ([`crate::capacity`]).
    pub capacity: CapacityConfig,
    /// LoRA-aware routing ([`crate::adapters`]): the cost of loading a request's adapter.
    pub adapters: AdapterConfig,
}

impl RoutingConfig {
    /// The [`RouteRequest`] of a prompt under this configuration: its prefix key over the
    /// `prefix-hash` policy's `k` tokens.
    pub fn route_request(
        &self,
        tokens: &[u32],
        block_size: BlockSize,
        seed: HashSeed,
    ) -> RouteRequest {
        let mut r = RouteRequest::from_tokens(tokens, block_size, seed);
        if self.policy.prefix_hash.prefix_tokens != PREFIX_KEY_TOKENS {
            r.prefix_key = self.policy.prefix_hash.key(tokens, seed);
        }
        r
    }

    /// Checks every knob (the policy's by building it).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.pool.validate()?;
        self.saturation.validate()?;
        self.breaker.validate()?;
        self.retry_budget.validate()?;
        self.sessions.validate()?;
        self.capacity.validate()?;
        self.adapters.validate()?;
        self.policy.build()?;
        // Every policy's knobs, not only the chosen one's: a bad flag is an error whatever
        // the policy.
        self.policy.kv.validate()?;
        self.policy.cache_aware.validate()?;
        self.policy.prefix_hash.validate()?;
        self.disagg.validate()?;
        at_least_one("approximate KV TTL (ms)", self.approx.ttl_ms)?;
        at_least_one(
            "approximate KV max entries",
            u64::try_from(self.approx.max_entries).unwrap_or(u64::MAX),
        )
    }
}

/// A zero TTL or cap would make the approximate index forget every decision at once.
fn at_least_one(name: &'static str, value: u64) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(ConfigError::OutOfRange {
            name,
            requirement: "at least 1",
            value: 0.0,
        });
    }
    Ok(())
}

/// One replica: its routing, its identity among the replicas sharing one view, and the seed of
/// its random draws.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaConfig {
    pub router_id: RouterId,
    pub seed: u64,
    pub routing: RoutingConfig,
}
