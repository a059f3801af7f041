//! `tandem sim`: a discrete-event simulation of a tandem cluster in virtual time.
//!
//! # Job
//!
//! Every worker is a real [`tandem_engine::MockEngine`] (block pool, continuous-batching
//! scheduler, mocker step timing; timing-only KV). Every router replica is a
//! [`tandem_router::RoutingReplica`], the type the frontend routes with, configured from the
//! same [`tandem_router::RoutingConfig`] ([`SimConfig::replica_config`]): its own KV index and
//! feed rules, its own active-sequence tracker, the policy or the disaggregation rule, the
//! load reports it received. Between them a simulated event plane carries KV events, load
//! reports and replica-sync messages after a configurable delay, either streamed or as
//! periodic snapshots (phase-aligned or staggered across routers). [`run`] returns the
//! figures as a [`SimReport`]; [`sweep`] runs the same workload at several rates and finds the
//! capacity. The workload, the SLO, the latency percentiles and the plots are
//! `tandem-workload`'s (re-exported here where a [`SimConfig`] needs them).
//!
//! # Layout
//!
//! - `config.rs`: [`SimConfig`] and its parts, validated once.
//! - `workload.rs`: the requests, from [`tandem_workload::build`] (Mooncake trace and
//!   synthetic workloads: Poisson, gamma, constant arrivals; random, shared-prefix, multi-turn
//!   prompts; optional seeded arrival jitter), expanded to tokens at arrival.
//! - `queue.rs`: the event heap. `sim.rs`: the event loop and the request lifecycle.
//!   `replica.rs`: what the event plane delivers to a replica, and its repairs answered.
//!   `stats.rs`, `metrics.rs`: counters, the run's plain outcome, and [`SimReport`].
//! - `cascade.rs`: a model cascade, the small model's pool then the large one's on the
//!   escalated requests, and the burstiness of what each pool is sent ([`run_cascade`]).
//! - `sweep.rs`: rate sweeps. `plan.rs`: `tandem size`'s search for the smallest cluster
//!   meeting an SLO. Plots: [`tandem_workload::plot`] over [`SimReport::ttft_cdf_ms`] and
//!   [`SweepReport::goodput_points`].
//!
//! # Model, and where it is approximate
//!
//! - A request's lifecycle in the tracker: `add` at routing, `prefill_done` at its first
//!   token, `free` at its last (or at refusal). Routers learn first and last tokens at once
//!   (they stream the response); only KV events, load reports and peers' sync messages pay
//!   the event-plane delay.
//! - Streaming mode (snapshot interval 0): a worker's new KV events are sent after each of
//!   its engine steps; routers use their trackers as the load signal (no load reports).
//!   Snapshot mode: every T, each router gets every worker's events since its last snapshot
//!   and every worker's load report; with `merge_load_reports` (`--merge-load-reports true`)
//!   the reports are folded into the tracker's load (`WorkerLoad::merge_report`), otherwise
//!   only their KV usage is used (the frontend's default).
//! - Remote prefill: at routing, the decode worker reserves blocks for the prompt tokens it
//!   does not cache (`MockEngine::begin_remote_prefill`; they are held, not evictable, until
//!   the KV is in); the prefill worker runs the prompt as a one-token request; the KV of the
//!   reserved blocks travels for `bytes / bandwidth`; then the decode worker commits them to
//!   its prefix cache and takes the prefill worker's token as its first
//!   (`finish_remote_prefill`), and decodes on. TTFT ends when the KV is in. If the decode
//!   pool has no room for the reservation at routing, the request is prefilled locally on the
//!   decode worker instead (`transfer_fallbacks`, counted as a local prefill). Transfers
//!   never fail in the simulation.
//! - Time is integer microseconds; ties are broken by scheduling order; every random draw
//!   comes from [`tandem_protocol::Rng`] seeded from [`SimConfig::seed`]. Same config, same
//!   report, byte for byte. Nothing reads a clock.
//! - What that tie rule means for arrivals: every arrival is queued before the run starts, so
//!   at an equal microsecond an arrival is handled before any KV event (snapshot mode, or
//!   streaming with a delay), load report or timer queued during the run. Replica-sync
//!   messages are the exception: they go through the queue at `now + delay_us` *ahead of*
//!   every other event of that microsecond, so with delay 0 a replica's peers learn of a
//!   request before they route the next arrival of the same microsecond, as they would with a
//!   sub-millisecond event plane. (Before, they landed after every other arrival of that
//!   microsecond: the Mooncake trace's ~10 requests per 3-second bucket were all routed from
//!   the same stale view, which made replica sync look harmful.) Streamed KV events with
//!   delay 0 skip the queue: every replica applies them when the worker publishes them (after
//!   each step, and when a request is added). [`SimConfig::arrival_jitter_us`] spreads
//!   same-instant arrivals out, so that the engines' events of one are seen by the next.
//!
//! Metric definitions are in `metrics.rs` ([`SimReport`]).

mod cascade;
mod config;
mod error;
mod metrics;
mod plan;
mod queue;
mod replica;
mod sim;
mod stats;
mod sweep;
mod workload;

pub use cascade::{
    Burstiness, CascadeConfig, CascadeReport, LargePoolSize, run_cascade, size_large_pool,
};
pub use config::{EngineSettings, EventPlaneConfig, SimConfig, TopologyConfig, TransferConfig};
pub use error::SimError;
pub use metrics::{ArmReport, ExperimentReport, SimReport, Spread};
pub use plan::{Candidate, Plan, Topologies, plan};
pub use sweep::{SweepPoint, SweepReport, sweep};
/// An A/B experiment ([`SimConfig::experiment`]): the frontend's own type.
pub use tandem_router::groups::{ArmConfig, ExperimentConfig};
/// The router's names and knobs a [`SimConfig`] is made of, for callers that build one.
pub use tandem_router::{DisaggConfig, DisaggMode, KvConfig, PolicyConfig, PolicyKind};
/// The workload and SLO types a [`SimConfig`] is made of (`tandem-workload`'s).
pub use tandem_workload::{
    ArrivalProcess, LengthDist, PromptShape, Slo, SyntheticConfig, TraceWorkload, WorkloadConfig,
};
/// The requests of a workload (what `tandem bench` sends to a live endpoint).
pub use workload::{PromptSpec, RequestSpec, build as build_workload};

/// Runs one simulation to the end of its last request.
pub fn run(config: SimConfig) -> Result<SimReport, SimError> {
    config.validate()?;
    let specs = workload::build(&config.workload, config.seed, config.arrival_jitter_us)?;
    run_specs(&config, &specs)
}

pub(crate) fn run_specs(
    config: &SimConfig,
    specs: &[workload::RequestSpec],
) -> Result<SimReport, SimError> {
    Ok(run_specs_with_times(config, specs)?.0)
}

/// [`run_specs`], and each request's times (in `specs`' order).
pub(crate) fn run_specs_with_times(
    config: &SimConfig,
    specs: &[workload::RequestSpec],
) -> Result<(SimReport, Vec<stats::RequestTimes>), SimError> {
    let mut sim = sim::Sim::new(config, specs)?;
    let end = sim.run()?;
    let outcome = sim.outcome(end);
    let times = outcome.requests.clone();
    Ok((stats::report(config, specs, outcome), times))
}
