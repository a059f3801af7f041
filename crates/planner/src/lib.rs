//! `tandem planner`: the online loop that sizes the prefill and decode pools from the
//! cluster's live metrics (`tandem size` is its offline counterpart, from simulator runs).
//!
//! Every interval it scrapes each frontend's `/metrics`, turns counter and histogram deltas
//! into an [`Observation`] (request rate, ISL, OSL, prefix hit rate, the pools' loads, TTFT
//! and ITL quantiles, the workers the frontends see), forecasts the next interval (Holt's
//! linear trend), decides the replica counts ([`Planner`]: rated per-worker capacities
//! corrected by observed latency against the SLO, behind hysteresis) and sets them through an
//! [`Actuator`]: [`Local`] child processes, or the [`Kubernetes`] scale subresource of two
//! Deployments.
//!
//! Layout: `prom.rs` (Prometheus / OpenMetrics text → [`Scrape`]), `observe.rs` (scrapes →
//! [`Observation`]), `predict.rs` (Holt), `decide.rs` (the sans-IO decision, its rule in the
//! module doc), `actuate/` (the trait, `local.rs`, `kubernetes.rs`), `run.rs` (the async
//! loop, logging, `--decisions-out`).
//!
//! Invariants: the decision is a pure function of its inputs, its state and the time passed
//! in (no clock, no I/O: unit-tested by hand-computed cases); a pool is never set outside its
//! `[min, max]`; at most one change per pool is in flight (the next waits until the
//! frontends see the count, or a settle timeout); a worker taken away is asked to drain
//! (SIGTERM, or Kubernetes' own termination) and killed only past the drain timeout.

pub mod actuate;
pub mod decide;
mod error;
pub mod observe;
pub mod predict;
pub mod prom;
mod run;

pub use actuate::Actuator;
pub use actuate::kubernetes::{Kubernetes, KubernetesConfig};
pub use actuate::local::{Local, LocalConfig};
pub use decide::{DecideConfig, Decision, Hysteresis, Planner, PoolConfig, PoolDecision};
pub use error::PlannerError;
pub use observe::{Observation, Observer};
pub use prom::Scrape;
pub use run::{AdminKey, RunConfig, run};

use serde::Serialize;

/// The two pools the planner sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    Prefill,
    Decode,
}

impl Pool {
    pub const ALL: [Pool; 2] = [Pool::Prefill, Pool::Decode];

    /// The `role` label value and the `tandem` subcommand.
    pub fn as_str(self) -> &'static str {
        match self {
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }

    pub fn from_role(role: &str) -> Option<Pool> {
        match role {
            "prefill" => Some(Pool::Prefill),
            "decode" => Some(Pool::Decode),
            _ => None,
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Pool::Prefill => 0,
            Pool::Decode => 1,
        }
    }
}

impl std::fmt::Display for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
