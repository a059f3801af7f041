//! tandem's routing core (docs/ARCHITECTURE.md §5, §6): which worker serves a request, and whether its
//! prompt is prefilled on a separate worker. Sans-IO: the frontend (`tandem-frontend`) and the
//! simulator (`tandem-sim`) are shells around it, and both route through the same
//! [`RoutingReplica`].
//!
//! # Job
//!
//! - [`RoutingReplica`]: one router replica's whole state — the KV index and its feed rules
//!   ([`tandem_indexer::IndexFeed`]), the [`ActiveSequences`] tracker, the policy behind the
//!   pool rules, the disaggregation rule, the pools' members and their load reports, the
//!   seeded [`Rng`], and the approximate index ([`tandem_indexer::ApproxIndex`]) that stands in
//!   for KV events for workers that publish none ([`KvSource::Approximate`]: the replica
//!   records its own decisions for them, with a TTL). `apply` takes what the cluster says
//!   (membership, KV events, repair answers, load reports, peers' [`SyncMessage`]s); `route`
//!   (or `decide` + `commit`) plans a request ([`Plan`]: decode worker, prefill worker or
//!   local, the explanation, the sync messages to publish); `first_token` and `finish` follow
//!   its lifecycle. Configured by [`ReplicaConfig`] / [`RoutingConfig`], the one type the
//!   frontend's and the simulator's flags both fill.
//! - Below it, usable alone: [`Router::select`] (one pool, any [`Policy`] chosen by name —
//!   [`PolicyKind`]: `round-robin`, `random`, `least-loaded`, `power-of-two`, `kv`,
//!   `cache-aware`, `prefix-hash` — after the pool rules: busy workers skipped, warming workers
//!   counted at the median load); [`disagg::decide`] (a decode and a prefill pool under a
//!   [`DisaggMode`]).
//!
//! Every [`Decision`] explains itself: each candidate's [`ScoreTerms`] (overlap by tier,
//! prefill and decode blocks, cost, probability) and the [`Rule`] that picked.
//!
//! # Sans-IO
//!
//! No async runtime, no clock (time is `u64` milliseconds passed in), no environment, no
//! threads, no sockets; `cargo tree -p tandem-router -e normal` has no tokio, tonic, axum or
//! tandem-runtime. All randomness comes from the seeded [`Rng`] (xoshiro256**, implemented in
//! tandem-protocol and re-exported here, so that a seed means the same decisions on every
//! platform and version).
//!
//! # Layout
//!
//! - `replica/`: [`RoutingReplica`], [`Input`], [`KvSource`], [`RouteInput`], [`Plan`],
//!   [`InFlight`];
//!   `config.rs`: [`RoutingConfig`], [`ReplicaConfig`]; `candidates.rs`: the candidates'
//!   views, and the shortcut that scores only the prompt's holders and the least loaded
//!   other workers where that cannot change the pick (a decision's cost then does not grow
//!   with workers that hold nothing of the prompt).
//! - `adapters.rs`: LoRA-aware routing ([`Adapters`]: which adapters each worker likely
//!   holds, and the `kv` cost of loading one). `sessions.rs`: session affinity.
//!   `capacity.rs`: capacity weights for unequal workers.
//! - `view.rs`: a decision's inputs and outputs ([`WorkerView`], [`WorkerLoad`],
//!   [`RouteRequest`], [`Decision`], [`ScoreTerms`], [`prefix_key`]).
//! - `policy.rs`: the [`Policy`] trait. `simple.rs`, `kv.rs`, `cache_aware.rs`,
//!   `prefix_hash.rs`: the policies. `registry.rs`: [`PolicyKind`], [`PolicyConfig`] and the
//!   factory that builds a policy by name.
//! - `pool.rs`: busy thresholds and warm-up ([`PoolConfig`]), and [`Router`].
//! - `tracker.rs`: [`ActiveSequences`] and replica sync. `disagg.rs`: conditional
//!   disaggregation.
//! - [`admission`] (what waits, what is refused): `flow/` ([`FlowQueue`]: the bounded queue
//!   with priority bands and tenant fairness, `buckets.rs` the per-tenant rate limits),
//!   `saturation.rs` ([`SaturationConfig`]: when a decode worker takes no more); with
//!   `replica/admit.rs` (routing a queued request only to unsaturated workers).
//! - [`resilience`] (what happens when workers fail): `breaker.rs` ([`Breakers`] per worker
//!   and the [`RetryBudget`]), `hedge.rs` ([`TtftHistory`], when a second attempt starts).
//! - [`groups`] (beyond one pool): a model's backend groups in priority order — this
//!   process's pool or endpoints it cannot see into — with each group's strategy, the
//!   endpoints' limits and cooldowns, and when a failed request spills to the next group.
//! - `error.rs`: [`RouteError`], [`ConfigError`]. [`Rng`] is `tandem_protocol::Rng`.
//!
//! # Invariants
//!
//! - Given the same inputs in the same order, a replica makes the same decisions.
//! - A policy never picks outside its candidates, and errors (never panics) on none.
//! - `kv` at temperature 0 picks only among minimum-cost workers, each with equal chance.
//! - Tracker loads are the sum over live sequences of their contributions, whatever the order
//!   and multiplicity in which sync messages arrived; a block shared by several live requests
//!   on one worker counts once there.
//! - The replica holds nothing per request beyond the tracker (bounded by its TTL) and, for
//!   approximate workers, the prompt blocks recorded in the approximate index (bounded by its
//!   TTL and entry cap, [`ApproxConfig`]): the request's [`InFlight`] is the caller's.
//! - Each worker's overlap comes from one source, its [`KvSource`]: event workers' from the
//!   exact index (or a standalone indexer), approximate workers' from the approximate index;
//!   approximate workers are never asked for dumps or repairs.

pub mod adapters;
pub mod admission;
pub mod cache_aware;
pub mod capacity;
pub mod disagg;
mod error;
pub mod groups;
pub mod kv;
mod policy;
mod pool;
pub mod prefix_hash;
mod registry;
mod replica;
pub mod resilience;
pub mod sessions;
// The policies name it `crate::rng::Rng`; it lives in tandem-protocol.
use tandem_protocol::rng;
mod simple;
pub mod tracker;
mod view;

#[cfg(test)]
mod tests;

pub use adapters::{AdapterConfig, AdapterFit, Adapters};
// The admission and resilience modules under their own names too (`tandem_router::flow`, …).
pub use admission::{flow, saturation};
pub use resilience::{breaker, hedge};

pub use breaker::{BreakerConfig, BreakerState, Breakers, RetryBudget, RetryBudgetConfig};
pub use cache_aware::{CacheAwareConfig, CacheAwarePolicy};
pub use capacity::{Capacity, CapacityConfig};
pub use disagg::{DisaggConfig, DisaggDecision, DisaggMode, DisaggReason, TransferCosts};
pub use error::{ConfigError, ErrorClass, RouteError};
pub use flow::{FlowConfig, FlowQueue, Priority, RejectReason, Rejection, TenantLimits};
pub use hedge::TtftHistory;
pub use kv::{KvConfig, KvPolicy};
pub use policy::Policy;
pub use pool::{Candidates, PoolConfig, Router, RouterConfig, prepare_candidates};
pub use prefix_hash::{PrefixHashConfig, PrefixHashPolicy};
pub use registry::{PolicyConfig, PolicyKind};
pub use replica::{
    FedIndex, InFlight, Input, KvSource, Plan, ReplicaConfig, RouteInput, RoutingConfig,
    RoutingReplica,
};
pub use saturation::SaturationConfig;
pub use sessions::{SessionConfig, SessionKey, SessionOutcome, SessionStats, Sessions};
pub use simple::{LeastLoaded, PowerOfTwo, RandomPolicy, RoundRobin};
pub use tandem_indexer::{
    ApproxConfig, FeedError, FeedStats, OverlapScores, Repair, RepairReply, TierCounts,
};
pub use tandem_protocol::Rng;
pub use tracker::{
    ActiveSequences, NewSequence, RouterId, SyncHello, SyncMessage, TrackedLoad, TrackerConfig,
};
pub use view::{
    Decision, KvOverrides, PREFIX_KEY_TOKENS, RouteRequest, Rule, ScoreTerms, WorkerLoad,
    WorkerView, prefix_key,
};
