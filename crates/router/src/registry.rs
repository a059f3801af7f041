//! The policies by name ([`PolicyKind`]) and the factory that builds one from its
//! configuration ([`PolicyConfig::build`]). It imports every policy; nothing imports it but
//! the callers that build a policy, so the trait's file stays free of its implementations.

use std::fmt;
use std::str::FromStr;

use crate::cache_aware::{CacheAwareConfig, CacheAwarePolicy};
use crate::error::ConfigError;
use crate::kv::{KvConfig, KvPolicy};
use crate::policy::Policy;
use crate::prefix_hash::{PrefixHashConfig, PrefixHashPolicy};
use crate::simple::{LeastLoaded, PowerOfTwo, RandomPolicy, RoundRobin};

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
