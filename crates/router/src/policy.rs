//! The [`Policy`] trait, the policy names ([`PolicyKind`]) and their configuration.

use std::fmt;
use std::str::FromStr;

use crate::cache_aware::{CacheAwareConfig, CacheAwarePolicy};
use crate::error::{ConfigError, RouteError};
use crate::kv::{KvConfig, KvPolicy};
use crate::prefix_hash::{PrefixHashConfig, PrefixHashPolicy};
use crate::rng::Rng;
use crate::simple::{LeastLoaded, PowerOfTwo, RandomPolicy, RoundRobin};
use tandem_protocol::WorkerId;

use crate::view::{Decision, RouteRequest, WorkerView};

/// A worker-selection policy. Implementations are deterministic given the candidates, their
/// own state and the generator: all randomness comes from `rng`.
pub trait Policy: fmt::Debug + Send {
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

/// The policies, by their flag names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    RoundRobin,
    Random,
    LeastLoaded,
    PowerOfTwo,
    Kv,
    CacheAware,
    PrefixHash,
}

impl PolicyKind {
    /// Every policy, in the order of [`PolicyKind::VALID_NAMES`].
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::PowerOfTwo,
        PolicyKind::Kv,
        PolicyKind::CacheAware,
        PolicyKind::PrefixHash,
    ];

    /// The names accepted by `FromStr`, for error messages and `--help`.
    pub const VALID_NAMES: &'static str =
        "round-robin, random, least-loaded, power-of-two, kv, cache-aware, prefix-hash";

    pub const fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::PowerOfTwo => "power-of-two",
            PolicyKind::Kv => "kv",
            PolicyKind::CacheAware => "cache-aware",
            PolicyKind::PrefixHash => "prefix-hash",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| ConfigError::UnknownPolicy {
                got: s.to_owned(),
                valid: PolicyKind::VALID_NAMES,
            })
    }
}

/// Which policy, and the knobs of every policy (only the chosen one's are used).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyConfig {
    pub kind: PolicyKind,
    pub kv: KvConfig,
    pub cache_aware: CacheAwareConfig,
    pub prefix_hash: PrefixHashConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::new(PolicyKind::Kv)
    }
}

impl PolicyConfig {
    /// `kind` with every knob at its default.
    pub fn new(kind: PolicyKind) -> Self {
        PolicyConfig {
            kind,
            kv: KvConfig::default(),
            cache_aware: CacheAwareConfig::default(),
            prefix_hash: PrefixHashConfig::default(),
        }
    }

    /// Validates the chosen policy's knobs and builds it.
    pub fn build(&self) -> Result<Box<dyn Policy>, ConfigError> {
        Ok(match self.kind {
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
            PolicyKind::Random => Box::new(RandomPolicy),
            PolicyKind::LeastLoaded => Box::new(LeastLoaded),
            PolicyKind::PowerOfTwo => Box::new(PowerOfTwo),
            PolicyKind::Kv => Box::new(KvPolicy::new(self.kv)?),
            PolicyKind::CacheAware => Box::new(CacheAwarePolicy::new(self.cache_aware)?),
            PolicyKind::PrefixHash => Box::new(PrefixHashPolicy::new(self.prefix_hash)?),
        })
    }
}
