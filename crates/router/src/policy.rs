//! The [`Policy`] trait every selection policy implements. The policies live beside it
//! (`simple.rs`, `kv.rs`, `cache_aware.rs`, `prefix_hash.rs`); `registry.rs` names them and
//! builds one from its configuration.

use std::fmt;

use tandem_protocol::WorkerId;

use crate::error::RouteError;
use crate::rng::Rng;
use crate::view::{Decision, RouteRequest, WorkerView};

/// A worker-selection policy. Implementations are deterministic given the candidates, their
/// own state and the generator: all randomness comes from `rng`.
pub trait Policy: fmt::Debug + Send + Sync {
    /// The policy's name, as parsed by [`PolicyKind`].
    fn name(&self) -> &'static str;

    /// Picks one of `candidates` for `req`. Errors on an empty or duplicated candidate list
    /// and on invalid overrides; otherwise always picks one.
    fn select(
        &mut self,
        req: &RouteRequest,
        candidates: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError>;
}

/// Rejects an empty candidate list and a worker listed twice (it would get double odds).
pub(crate) fn check_candidates(candidates: &[WorkerView]) -> Result<(), RouteError> {
    if candidates.is_empty() {
        return Err(RouteError::NoWorkers);
    }
    // Callers usually pass workers in id order (the indexer's answers and discovery lists are
    // sorted): then one pass over adjacent ids proves uniqueness with no allocation.
    if candidates.windows(2).all(|w| w[0].id < w[1].id) {
        return Ok(());
    }
    let mut ids: Vec<WorkerId> = candidates.iter().map(|v| v.id).collect();
    ids.sort_unstable();
    match ids.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(RouteError::DuplicateWorker(w[0])),
        None => Ok(()),
    }
}
