//! The load-only policies: `round-robin`, `random`, `least-loaded`, `power-of-two`. Load is
//! the active-request count (accepted and not finished, queued included).

use tandem_protocol::WorkerId;

use crate::error::RouteError;
use crate::policy::{Policy, check_candidates};
use crate::rng::Rng;
use crate::view::{Decision, RouteRequest, Rule, ScoreTerms, WorkerView};

/// Load-only terms for every candidate, with no probabilities yet.
fn load_terms(candidates: &[WorkerView]) -> Vec<ScoreTerms> {
    candidates.iter().map(ScoreTerms::load_only).collect()
}

fn decision(worker: WorkerId, rule: Rule, explain: Vec<ScoreTerms>) -> Decision {
    Decision {
        worker,
        rule,
        explain,
        excluded_busy: Vec::new(),
    }
}

/// Index of a least-loaded candidate (uniform among ties) and how many tie.
pub(crate) fn least_loaded(candidates: &[WorkerView], rng: &mut Rng) -> (usize, usize) {
    let min = candidates
        .iter()
        .map(|v| v.load.active_requests)
        .min()
        .unwrap_or(0);
    let ties: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].load.active_requests == min)
        .collect();
    (ties[rng.below(ties.len())], ties.len())
}

/// Sets the probabilities of a least-loaded pick: 1/ties for each tied minimum, 0 otherwise.
pub(crate) fn least_loaded_probabilities(explain: &mut [ScoreTerms], ties: usize) {
    let min = explain.iter().map(|t| t.active_requests).min().unwrap_or(0);
    for t in explain {
        t.probability = Some(if t.active_requests == min {
            1.0 / ties as f64
        } else {
            0.0
        });
    }
}

/// `round-robin`: the worker with the next id after the previous pick, wrapping. Going by id
/// rather than by position keeps the rotation fair when workers join, leave or are skipped
/// as busy between calls.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    last: Option<WorkerId>,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn select(
        &mut self,
        _req: &RouteRequest,
        candidates: &[WorkerView],
        _rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        check_candidates(candidates)?;
        let after = |v: &&WorkerView| self.last.is_none_or(|l| v.id > l);
        let next = candidates
            .iter()
            .filter(after)
            .min_by_key(|v| v.id)
            .or_else(|| candidates.iter().min_by_key(|v| v.id))
            .map(|v| v.id)
            .ok_or(RouteError::NoWorkers)?;
        self.last = Some(next);
        let mut explain = load_terms(candidates);
        for t in &mut explain {
            t.probability = Some(if t.worker == next { 1.0 } else { 0.0 });
        }
        Ok(decision(next, Rule::Rotation, explain))
    }
}

/// `random`: uniform over the candidates.
#[derive(Clone, Copy, Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(
        &mut self,
        _req: &RouteRequest,
        candidates: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        check_candidates(candidates)?;
        let i = rng.below(candidates.len());
        let mut explain = load_terms(candidates);
        let p = 1.0 / candidates.len() as f64;
        for t in &mut explain {
            t.probability = Some(p);
        }
        Ok(decision(candidates[i].id, Rule::Uniform, explain))
    }
}

/// `least-loaded`: fewest active requests, uniform among ties.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastLoaded;

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn select(
        &mut self,
        _req: &RouteRequest,
        candidates: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        check_candidates(candidates)?;
        let (i, ties) = least_loaded(candidates, rng);
        let mut explain = load_terms(candidates);
        least_loaded_probabilities(&mut explain, ties);
        Ok(decision(candidates[i].id, Rule::LeastLoaded, explain))
    }
}

/// `power-of-two`: two distinct random candidates, the less loaded of them (a fair coin on a
/// tie). Nearly as good as least-loaded at spreading load, without herding every router onto
/// the same idle worker when their views are stale.
#[derive(Clone, Copy, Debug, Default)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power-of-two"
    }

    fn select(
        &mut self,
        _req: &RouteRequest,
        candidates: &[WorkerView],
        rng: &mut Rng,
    ) -> Result<Decision, RouteError> {
        check_candidates(candidates)?;
        let n = candidates.len();
        let a = rng.below(n);
        // Drawing the second from the n − 1 others keeps the two distinct.
        let mut b = rng.below(n.saturating_sub(1).max(1));
        if n > 1 && b >= a {
            b += 1;
        }
        let (la, lb) = (
            candidates[a].load.active_requests,
            candidates[b].load.active_requests,
        );
        let pick = match la.cmp(&lb) {
            std::cmp::Ordering::Less => a,
            std::cmp::Ordering::Greater => b,
            std::cmp::Ordering::Equal => {
                if rng.below(2) == 0 {
                    a
                } else {
                    b
                }
            }
        };
        Ok(decision(
            candidates[pick].id,
            Rule::PowerOfTwo,
            load_terms(candidates),
        ))
    }
}
