//! The decision, sans-IO: an [`Observation`] and the pools' current replica counts in, the
//! counts to set out, with the time passed in (seconds on the caller's clock).
//!
//! Per pool, every interval:
//!
//! 1. **Correction** `f` ∈ [`min_correction`, 1] of the rated per-worker capacity `C`
//!    (`--prefill-capacity`, `--decode-capacity`), learnt from evidence only. With `u` the
//!    observed load per ready worker over `C` and `r` the observed latency over its SLO (TTFT
//!    for prefill, ITL for decode):
//!    - `r > 1` while `u ≤ f`: the pool missed its SLO below what it was thought to carry,
//!      so `f ← max(min_correction, min(f, BACKOFF · u))` (`BACKOFF` = 0.9: the load that
//!      missed becomes 1/0.9 of a worker's share, which asks for one more worker). TTFT
//!      counts against prefill only while the decode pool is within its own effective
//!      capacity (TTFT includes waiting for a decode slot).
//!    - `r ≤ down_margin` while `u > f`: the pool carried more than thought, comfortably:
//!      `f ← min(u, 1)`.
//!
//!    Evidence is taken only from a pool at rest: the frontends see the count set, and its
//!    last change is `cooldown_s` old (right after a scale-up the latency still shows the
//!    backlog of the smaller pool). Nothing else moves `f`: no drift back towards 1, which
//!    would replay the cycle the correction ended.
//! 2. **Wanted** = `ceil(predicted load / (f · C))`, within `[min, max]`.
//! 3. **Hysteresis** against the current count `n`:
//!    - up when wanted > n for `up_after` consecutive intervals, by at most `max_step_up`;
//!    - down to `m = max(wanted, n − max_step_down, min)` only when the survivors would run
//!      at most `down_margin` of their effective capacity (`predicted / (m · f · C) ≤
//!      down_margin`: consolidation-aware — each survivor takes `n/m` of the load; the flat
//!      per-worker test without it is what made Dynamo's planner flap 2 ↔ 1, dyn#9294) and
//!      the latency is at most `down_margin` of its SLO, for `down_after` consecutive
//!      intervals, and `cooldown_s` after the pool's last change;
//!    - no change while the last one is still taking effect (the frontends see a number of
//!      workers other than the count set), for up to `settle_timeout_s`;
//!    - a count outside `[min, max]` (a worker died, the bounds changed) is corrected at once.

use serde::Serialize;

use crate::Pool;
use crate::observe::Observation;
use crate::predict::{Forecast, Forecaster};

/// The factor a capacity correction leaves below the load that missed the SLO.
pub const BACKOFF: f64 = 0.9;

/// One pool's bounds, rated capacity and SLO.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    pub min: u32,
    pub max: u32,
    /// Load one worker carries at its SLO: prompt tokens computed per second (prefill) or
    /// tokens generated per second (decode).
    pub capacity: f64,
    /// TTFT (prefill) or ITL (decode) target at the SLO quantile, seconds.
    pub slo_s: f64,
}

/// How reluctant the planner is to change its mind.
#[derive(Clone, Debug, PartialEq)]
pub struct Hysteresis {
    pub up_after: u32,
    pub down_after: u32,
    pub down_margin: f64,
    pub cooldown_s: f64,
    pub max_step_up: u32,
    pub max_step_down: u32,
    pub settle_timeout_s: f64,
    pub min_correction: f64,
}

impl Default for Hysteresis {
    fn default() -> Self {
        Hysteresis {
            up_after: 2,
            down_after: 3,
            down_margin: 0.8,
            cooldown_s: 30.0,
            max_step_up: 2,
            max_step_down: 1,
            settle_timeout_s: 120.0,
            min_correction: 0.25,
        }
    }
}

/// Everything the decision needs.
#[derive(Clone, Debug, PartialEq)]
pub struct DecideConfig {
    pub prefill: PoolConfig,
    pub decode: PoolConfig,
    pub hysteresis: Hysteresis,
    /// Holt's α and β ([`crate::predict`]).
    pub smoothing: f64,
    pub trend: f64,
}

impl DecideConfig {
    pub fn pool(&self, pool: Pool) -> &PoolConfig {
        match pool {
            Pool::Prefill => &self.prefill,
            Pool::Decode => &self.decode,
        }
    }

    /// Checks the settings make sense together.
    pub fn validate(&self) -> Result<(), String> {
        for pool in Pool::ALL {
            let p = self.pool(pool);
            if p.min > p.max {
                return Err(format!("{pool}: min {} above max {}", p.min, p.max));
            }
            if !(p.capacity.is_finite() && p.capacity > 0.0) {
                return Err(format!("{pool}: the capacity must be positive"));
            }
            if !(p.slo_s.is_finite() && p.slo_s > 0.0) {
                return Err(format!("{pool}: the SLO must be positive"));
            }
        }
        let h = &self.hysteresis;
        if !(h.down_margin > 0.0 && h.down_margin < 1.0) {
            return Err("the scale-down margin must be in (0, 1)".into());
        }
        if h.max_step_up == 0 || h.max_step_down == 0 || h.up_after == 0 || h.down_after == 0 {
            return Err("steps and streaks must be at least 1".into());
        }
        if !(h.min_correction > 0.0 && h.min_correction <= 1.0) {
            return Err("the minimum correction must be in (0, 1]".into());
        }
        Ok(())
    }
}

/// One pool's part of a decision.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolDecision {
    pub observed_load: f64,
    pub predicted_load: f64,
    /// TTFT (prefill) or ITL (decode) at the SLO quantile, seconds.
    pub latency_s: Option<f64>,
    pub slo_s: f64,
    pub correction: f64,
    /// Effective capacity per worker, `f · C`.
    pub capacity: f64,
    /// Workers the frontends see.
    pub ready: u32,
    /// The count before this decision.
    pub current: u32,
    pub wanted: u32,
    /// The count after it.
    pub applied: u32,
    pub reason: String,
}

/// A whole interval's decision: the record `--decisions-out` writes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// Seconds since the planner started.
    pub t: f64,
    pub observed: Observation,
    pub predicted: Forecast,
    pub prefill: PoolDecision,
    pub decode: PoolDecision,
}

impl Decision {
    pub fn pool(&self, pool: Pool) -> &PoolDecision {
        match pool {
            Pool::Prefill => &self.prefill,
            Pool::Decode => &self.decode,
        }
    }
}

#[derive(Clone, Debug)]
struct PoolState {
    correction: f64,
    over: u32,
    under: u32,
    last_change: Option<f64>,
}

/// The planner's memory between intervals.
#[derive(Debug)]
pub struct Planner {
    cfg: DecideConfig,
    forecaster: Forecaster,
    state: [PoolState; 2],
}

/// One pool's inputs to [`Planner::step`].
struct PoolInput {
    observed: f64,
    predicted: f64,
    latency: Option<f64>,
    ready: u32,
    current: u32,
    /// Whether a latency over the SLO may lower this pool's correction.
    blame: bool,
}

impl Planner {
    pub fn new(cfg: DecideConfig) -> Self {
        let fresh = PoolState {
            correction: 1.0,
            over: 0,
            under: 0,
            last_change: None,
        };
        Planner {
            forecaster: Forecaster::new(cfg.smoothing, cfg.trend),
            cfg,
            state: [fresh.clone(), fresh],
        }
    }

    pub fn config(&self) -> &DecideConfig {
        &self.cfg
    }

    /// A count within the pool's bounds, for the start (before any observation).
    pub fn bounded(&self, pool: Pool, current: u32) -> u32 {
        let p = self.cfg.pool(pool);
        current.clamp(p.min, p.max)
    }

    /// One interval: `current` is `[prefill, decode]` as the actuator has them now.
    pub fn step(&mut self, now: f64, obs: &Observation, current: [u32; 2]) -> Decision {
        let predicted = self.forecaster.update(obs);
        // TTFT includes the wait for a decode slot: it is the prefill pool's fault only while
        // the decode pool carries no more than its effective capacity.
        let d = &self.cfg.decode;
        let decode_cap = self.state[1].correction * d.capacity * f64::from(obs.decode_workers);
        let decode_within = obs.decode_workers > 0 && obs.decode_load <= decode_cap;
        let prefill = self.step_pool(
            Pool::Prefill,
            now,
            PoolInput {
                observed: obs.prefill_load,
                predicted: predicted.prefill_load,
                latency: obs.ttft_q,
                ready: obs.prefill_workers,
                current: current[0],
                blame: decode_within,
            },
        );
        let decode = self.step_pool(
            Pool::Decode,
            now,
            PoolInput {
                observed: obs.decode_load,
                predicted: predicted.decode_load,
                latency: obs.itl_q,
                ready: obs.decode_workers,
                current: current[1],
                blame: true,
            },
        );
        Decision {
            t: now,
            observed: obs.clone(),
            predicted,
            prefill,
            decode,
        }
    }

    fn step_pool(&mut self, pool: Pool, now: f64, x: PoolInput) -> PoolDecision {
        let p = self.cfg.pool(pool).clone();
        let h = self.cfg.hysteresis.clone();
        let s = &mut self.state[pool.index()];
        let since = s.last_change.map(|t| now - t);
        let at_rest = x.ready == x.current && since.is_none_or(|t| t >= h.cooldown_s);
        if let (Some(lat), true) = (x.latency, x.ready > 0 && at_rest) {
            let r = lat / p.slo_s;
            let u = x.observed / (f64::from(x.ready) * p.capacity);
            if r > 1.0 && u > 0.0 && u <= s.correction && x.blame {
                s.correction = (BACKOFF * u).max(h.min_correction).min(s.correction);
            } else if r <= h.down_margin && u > s.correction {
                s.correction = u.min(1.0);
            }
        }
        let cap = s.correction * p.capacity;
        let raw = if x.predicted > 0.0 {
            (x.predicted / cap).ceil().min(f64::from(u32::MAX)) as u32
        } else {
            0
        };
        let wanted = raw.clamp(p.min, p.max);
        let n = x.current;
        let settling = x.ready != n && since.is_some_and(|t| t < h.settle_timeout_s);
        let mut applied = n;
        let reason;
        if n < p.min || n > p.max {
            applied = n.clamp(p.min, p.max);
            reason = format!("outside [{}, {}]", p.min, p.max);
        } else if wanted > n {
            s.under = 0;
            s.over += 1;
            if settling {
                reason = format!("up wanted; waiting for {n} to be ready (sees {})", x.ready);
            } else if s.over >= h.up_after {
                applied = wanted.min(n + h.max_step_up);
                reason = format!("up: wanted {wanted} for {} intervals", s.over);
            } else {
                reason = format!("up wanted ({}/{})", s.over, h.up_after);
            }
        } else if wanted < n {
            s.over = 0;
            let next = n.saturating_sub(h.max_step_down).max(wanted).max(p.min);
            let survivors = x.predicted / (f64::from(next) * cap);
            let latency_ok = x.latency.is_none_or(|l| l <= h.down_margin * p.slo_s);
            if survivors > h.down_margin {
                s.under = 0;
                reason = format!("down blocked: {next} would run at {survivors:.2} of capacity");
            } else if !latency_ok {
                s.under = 0;
                reason = "down blocked: latency above the margin".into();
            } else {
                s.under += 1;
                let cooled = since.is_none_or(|t| t >= h.cooldown_s);
                if s.under < h.down_after {
                    reason = format!("down wanted ({}/{})", s.under, h.down_after);
                } else if settling {
                    reason = "down wanted; the last change is still taking effect".into();
                } else if !cooled {
                    reason = "down wanted; cooling down".into();
                } else {
                    applied = next;
                    reason = format!("down: {next} run at {survivors:.2} of capacity");
                }
            }
        } else {
            s.over = 0;
            s.under = 0;
            reason = "steady".into();
        }
        if applied != n {
            s.over = 0;
            s.under = 0;
            s.last_change = Some(now);
        }
        PoolDecision {
            observed_load: x.observed,
            predicted_load: x.predicted,
            latency_s: x.latency,
            slo_s: p.slo_s,
            correction: s.correction,
            capacity: cap,
            ready: x.ready,
            current: n,
            wanted,
            applied,
            reason,
        }
    }
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
