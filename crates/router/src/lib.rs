//! tandem's routing core (DESIGN.md §5, §6): which worker serves a request, and whether its
//! prompt is prefilled on a separate worker.
//!
//! # Job
//!
//! A caller — the HTTP frontend, or `tandem sim` in virtual time — gathers a [`WorkerView`]
//! per candidate (prefix overlap per tier from the indexer, load from the
//! [`ActiveSequences`] tracker and the workers' load reports, whether it is warming up),
//! describes the request ([`RouteRequest`]), and asks for a decision:
//!
//! - [`Router::select`]: one pool, any [`Policy`] chosen by name ([`PolicyKind`]:
//!   `round-robin`, `random`, `least-loaded`, `power-of-two`, `kv`, `cache-aware`,
//!   `prefix-hash`), after the pool rules (busy workers skipped, warming workers counted at
//!   the median load);
//! - [`disagg::decide`]: a decode pool and a prefill pool under a [`DisaggMode`], returning the
//!   decode worker, the prefill worker if prefill is remote, and why.
//!
//! Every [`Decision`] explains itself: each candidate's [`ScoreTerms`] (overlap by tier,
//! prefill and decode blocks, cost, probability) and the [`Rule`] that picked.
//!
//! The caller then reports the request's lifecycle to the tracker — [`ActiveSequences::add`]
//! when routed, [`ActiveSequences::prefill_done`] at the first token,
//! [`ActiveSequences::free`] at the end — publishes the returned [`SyncMessage`]s to the other
//! router replicas, and applies theirs with [`ActiveSequences::apply`].
//!
//! # Sans-IO core, async shell
//!
//! The core (everything but `http/` and `cluster/`) has no async runtime, no clock (time is
//! `u64` milliseconds passed in), no environment, no threads. All randomness comes from the
//! caller's seeded [`Rng`] (xoshiro256**, implemented here so that a seed means the same
//! decisions on every platform and version).
//!
//! # Layout
//!
//! - `view.rs`: inputs and outputs ([`WorkerView`], [`WorkerLoad`], [`RouteRequest`],
//!   [`Decision`], [`ScoreTerms`], [`prefix_key`]).
//! - `policy.rs`: the [`Policy`] trait, [`PolicyKind`], [`PolicyConfig`].
//! - `simple.rs`, `kv.rs`, `cache_aware.rs`, `prefix_hash.rs`: the policies.
//! - `pool.rs`: busy thresholds and warm-up ([`PoolConfig`]), and [`Router`].
//! - `tracker.rs`: [`ActiveSequences`] and replica sync.
//! - `disagg.rs`: conditional disaggregation.
//! - `rng.rs`: [`Rng`]. `error.rs`: [`RouteError`], [`ConfigError`].
//! - `http/`: the OpenAI-compatible HTTP edge of the frontend (async, axum): [`http::app`],
//!   [`http::serve`], and the [`http::Backend`] trait the routing glue implements.
//! - `cluster/`: the frontend and the standalone indexer as services over a live cluster
//!   (async): discovery → workers, event plane → KV index with gap repair, the core's
//!   decisions → gRPC calls to decode workers, retries and migration, replica sync
//!   ([`cluster::run_frontend`], [`cluster::run_indexer`]).
//!
//! # Invariants
//!
//! - Given the same candidates, policy state and generator state, a decision is the same.
//! - A policy never picks outside its candidates, and errors (never panics) on none.
//! - `kv` at temperature 0 picks only among minimum-cost workers, each with equal chance.
//! - Tracker loads are the sum over live sequences of their contributions, whatever the order
//!   and multiplicity in which sync messages arrived; a block shared by several live requests
//!   on one worker counts once there.

pub mod cache_aware;
pub mod cluster;
pub mod disagg;
mod error;
pub mod http;
pub mod kv;
mod policy;
mod pool;
pub mod prefix_hash;
mod rng;
mod simple;
pub mod tracker;
mod view;

#[cfg(test)]
mod tests;

pub use cache_aware::{CacheAwareConfig, CacheAwarePolicy};
pub use disagg::{DisaggConfig, DisaggDecision, DisaggMode, DisaggReason};
pub use error::{ConfigError, ErrorClass, RouteError};
pub use kv::{KvConfig, KvPolicy};
pub use policy::{Policy, PolicyConfig, PolicyKind};
pub use pool::{Candidates, PoolConfig, Router, RouterConfig, prepare_candidates};
pub use prefix_hash::{PrefixHashConfig, PrefixHashPolicy};
pub use rng::Rng;
pub use simple::{LeastLoaded, PowerOfTwo, RandomPolicy, RoundRobin};
pub use tandem_indexer::TierCounts;
pub use tracker::{
    ActiveSequences, NewSequence, RouterId, SyncMessage, TrackedLoad, TrackerConfig,
};
pub use view::{
    Decision, KvOverrides, PREFIX_KEY_TOKENS, RouteRequest, Rule, ScoreTerms, WorkerLoad,
    WorkerView, prefix_key,
};
