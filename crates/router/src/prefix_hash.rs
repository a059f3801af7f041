//! `prefix-hash`: consistent hashing of the prompt's first k tokens, with a bounded-load
//! escape.
//!
//! Each worker owns `virtual_nodes` points on a 64-bit ring; a request goes to the owner of
//! the first point at or after its [`RouteRequest::prefix_key`] (wrapping). Adding or removing
//! a worker moves only the keys of its own arcs (~1/n of them), so prefixes stay where their
//! cache is. If the owner's load exceeds `load_factor × mean load`, the request goes to the
//! least loaded worker instead: affinity must not pile a hot prefix onto one worker.

use tandem_protocol::{HashSeed, WorkerId};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{ConfigError, RouteError, non_negative};
use crate::policy::{Policy, check_candidates};
use crate::rng::Rng;
use crate::simple::{least_loaded, least_loaded_probabilities};
use crate::view::{Decision, PREFIX_KEY_TOKENS, RouteRequest, Rule, ScoreTerms, WorkerView};

/// Knobs of `prefix-hash`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefixHashConfig {
    /// k: tokens hashed into the key. The key is computed by the caller
    /// ([`PrefixHashConfig::key`]), which holds the tokens.
    pub prefix_tokens: usize,
    /// Ring points per worker: more points, more even arcs.
    pub virtual_nodes: u32,
    /// Escape to least loaded when the owner's load exceeds this multiple of the mean.
    pub load_factor: f64,
}

impl Default for PrefixHashConfig {
    fn default() -> Self {
        PrefixHashConfig {
            prefix_tokens: PREFIX_KEY_TOKENS,
            virtual_nodes: 160,
            load_factor: 1.25,
        }
    }
}

impl PrefixHashConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.virtual_nodes == 0 {
            return Err(ConfigError::OutOfRange {
                name: "prefix-hash virtual nodes",
                requirement: "at least 1",
                value: 0.0,
            });
        }
        non_negative("prefix-hash load factor", self.load_factor)
    }

    /// The routing key of a prompt under this configuration.
    pub fn key(&self, tokens: &[u32], seed: HashSeed) -> u64 {
        crate::view::prefix_key(tokens, self.prefix_tokens, seed)
    }
}

/// The ring for one set of workers.
#[derive(Clone, Debug, Default)]
struct Ring {
    /// Sorted ids of the workers the ring was built for.
    members: Vec<WorkerId>,
    /// (point, owner), sorted by point.
    points: Vec<(u64, WorkerId)>,
}

impl Ring {
    fn build(mut members: Vec<WorkerId>, virtual_nodes: u32) -> Ring {
        members.sort_unstable();
        let mut points = Vec::with_capacity(members.len() * virtual_nodes as usize);
        for &w in &members {
            for v in 0..virtual_nodes {
                let mut buf = [0u8; 12];
                buf[..8].copy_from_slice(&w.0.to_le_bytes());
                buf[8..].copy_from_slice(&v.to_le_bytes());
                points.push((xxh3_64(&buf), w));
            }
        }
        // Ties between points (astronomically rare) are broken by worker id: deterministic.
        points.sort_unstable();
        Ring { members, points }
    }

    fn owner(&self, key: u64) -> WorkerId {
        let i = self.points.partition_point(|&(p, _)| p < key);
        self.points[i % self.points.len()].1
    }
}

/// The `prefix-hash` policy. Keeps the ring of the last candidate set: rebuilding costs
/// O(n·v log(n·v)) and the set rarely changes between requests.
#[derive(Clone, Debug)]
pub struct PrefixHashPolicy {
    config: PrefixHashConfig,
    ring: Ring,
}

impl PrefixHashPolicy {
    pub fn new(config: PrefixHashConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(PrefixHashPolicy {
            config,
            ring: Ring::default(),
        })
    }

    /// The ring owner of `key` among `candidates`, ignoring load.
    pub fn owner(&mut self, key: u64, candidates: &[WorkerView]) -> Result<WorkerId, RouteError> {
        check_candidates(candidates)?;
        let mut ids: Vec<WorkerId> = candidates.iter().map(|v| v.id).collect();
        ids.sort_unstable();
        if ids != self.ring.members {
            self.ring = Ring::build(ids, self.config.virtual_nodes);
        }
        Ok(self.ring.owner(key))
    }
}

impl Policy for PrefixHashPolicy {
    fn name(&self) -> &'static str {
        "prefix-hash"
    }

    fn select(
        &mut self,
        req: &RouteRequest,
        candidates: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        let owner = self.owner(req.prefix_key, candidates)?;
        let total: u64 = candidates.iter().map(|v| v.load.active_requests).sum();
        let mean = total as f64 / candidates.len() as f64;
        let owner_load = candidates
            .iter()
            .find(|v| v.id == owner)
            .map_or(0, |v| v.load.active_requests);
        let mut explain: Vec<ScoreTerms> = candidates.iter().map(ScoreTerms::load_only).collect();
        let (worker, rule) = if owner_load as f64 > self.config.load_factor * mean {
            let (i, ties) = least_loaded(candidates, rng);
            least_loaded_probabilities(&mut explain, ties);
            (candidates[i].id, Rule::BoundedLoadEscape)
        } else {
            for t in &mut explain {
                t.probability = Some(if t.worker == owner { 1.0 } else { 0.0 });
            }
            (owner, Rule::RingOwner)
        };
        Ok(Decision {
            worker,
            rule,
            explain,
            excluded_busy: Vec::new(),
        })
    }
}
