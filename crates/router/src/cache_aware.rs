//! `cache-aware`: SGLang's router. Prefix affinity while the pool is balanced, least load when
//! it is not.
//!
//! The pool is *imbalanced* when `max − min > balance_abs_threshold` **and**
//! `max > balance_rel_threshold × min` (load = active requests): both, so that a small pool
//! with a few requests is not called imbalanced by the ratio alone, nor a big busy one by the
//! difference alone. Imbalanced → least loaded. Otherwise the best prefix match (most leading
//! prompt blocks cached, any tier; least loaded among equal matches) if its match rate —
//! matched blocks / full prompt blocks — exceeds `cache_threshold`, else least loaded.

use crate::error::{ConfigError, RouteError, non_negative};
use crate::policy::{Policy, check_candidates};
use crate::rng::Rng;
use crate::simple::least_loaded;
use crate::view::{Decision, RouteRequest, Rule, ScoreTerms, WorkerView};

/// Knobs of `cache-aware`, SGLang's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheAwareConfig {
    /// Absolute imbalance: max − min active requests above this…
    pub balance_abs_threshold: u64,
    /// …and max above this multiple of min.
    pub balance_rel_threshold: f64,
    /// Least match rate (matched / prompt blocks) that earns prefix affinity.
    pub cache_threshold: f64,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            cache_threshold: 0.3,
        }
    }
}

impl CacheAwareConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative(
            "cache-aware balance rel threshold",
            self.balance_rel_threshold,
        )?;
        non_negative("cache-aware cache threshold", self.cache_threshold)
    }

    /// Whether loads this spread call for load balancing over affinity.
    pub fn is_imbalanced(&self, min: u64, max: u64) -> bool {
        max - min > self.balance_abs_threshold
            && max as f64 > self.balance_rel_threshold * min as f64
    }
}

/// The `cache-aware` policy.
#[derive(Clone, Debug)]
pub struct CacheAwarePolicy {
    config: CacheAwareConfig,
}

impl CacheAwarePolicy {
    pub fn new(config: CacheAwareConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(CacheAwarePolicy { config })
    }
}

impl Policy for CacheAwarePolicy {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn select(
        &mut self,
        req: &RouteRequest,
        candidates: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        check_candidates(candidates)?;
        let mut explain: Vec<ScoreTerms> = candidates.iter().map(ScoreTerms::load_only).collect();
        let loads = candidates.iter().map(|v| v.load.active_requests);
        let (min, max) = (loads.clone().min().unwrap_or(0), loads.max().unwrap_or(0));
        let imbalanced = self.config.is_imbalanced(min, max);

        let best = candidates
            .iter()
            .map(|v| v.overlap.total())
            .max()
            .unwrap_or(0);
        let prompt_blocks = req.full_prompt_blocks();
        let rate = if prompt_blocks == 0 {
            0.0
        } else {
            f64::from(best) / prompt_blocks as f64
        };

        let (pool, rule): (Vec<usize>, Rule) = if imbalanced {
            ((0..candidates.len()).collect(), Rule::Imbalanced)
        } else if best > 0 && rate > self.config.cache_threshold {
            let matched = (0..candidates.len())
                .filter(|&i| candidates[i].overlap.total() == best)
                .collect();
            (matched, Rule::PrefixMatch)
        } else {
            ((0..candidates.len()).collect(), Rule::LowMatch)
        };

        // Least loaded within the pool (all candidates, or the best matches).
        let sub: Vec<WorkerView> = pool.iter().map(|&i| candidates[i]).collect();
        let (j, ties) = least_loaded(&sub, rng);
        let pool_min = sub[j].load.active_requests;
        for t in &mut explain {
            t.probability = Some(0.0);
        }
        let p = 1.0 / ties as f64;
        for (v, &i) in sub.iter().zip(&pool) {
            if v.load.active_requests == pool_min {
                explain[i].probability = Some(p);
            }
        }
        Ok(Decision {
            worker: sub[j].id,
            rule,
            explain,
            excluded_busy: Vec::new(),
        })
    }
}
