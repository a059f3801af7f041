//! Capacity weights for unequal workers: each worker's speed while busy, measured from its
//! load reports, relative to its pool's median. The `kv` cost divides a worker's load terms
//! by it, so a worker twice as fast takes about twice the work before it costs as much.
//!
//! ```text
//! sample(w)  = (Δ prefill_tokens_total + Δ decode_tokens_total) / Δ busy_us_total
//! speed(w)   = EWMA of the samples (weight `alpha` for the newest)
//! weight(w)  = clamp(speed(w) / median speed of the pool, 1/MAX_RATIO, MAX_RATIO)
//! ```
//!
//! - A sample is taken once at least [`CapacityConfig::min_busy_ms`] of busy time has passed
//!   since the last one (reports in between accumulate), so an idle worker's estimate stands
//!   still instead of drifting.
//! - A worker with no estimate yet (new, or behind an engine that reports no busy time)
//!   weighs 1: it starts at the pool's median, and the pool's warm-up rule ([`crate::PoolConfig`])
//!   keeps new workers from being flooded while their estimate forms (slow start).
//! - Counters going backwards mean a restarted engine: its estimate starts over.
//! - The measure is tokens per busy second whatever the mix of prefill and decode: under a
//!   cache-aware policy the workers of a pool see similar mixes, so the ratio between workers
//!   is what carries; a worker given a very different mix is mis-weighed by that difference.
//!
//! - **Measured limit (crates/router/EXPERIMENTS.md, "New signals"): off by default for a
//!   reason.** Tokens per busy second grow with a worker's batch (decode tokens of a bigger
//!   batch cost little more per step), so a worker given more work measures faster and is
//!   given more still: on the synthetic trace with half the workers twice as fast, weights on
//!   lost 4–17 points of SLO attainment against weights off, whose tracked load already sends
//!   the fast half ~1.8× the requests (a faster worker drains its in-flight count sooner). The
//!   weights help at light load (the sim test) and are the hook for a load-independent speed
//!   signal (e.g. an engine's measured prefill time per token), which is what they need.
//!
//! The median is recomputed at most once per [`MEDIAN_REFRESH_MS`], not per decision. Time is
//! passed in (sans-IO).

use hashbrown::HashMap;
use tandem_protocol::{LoadReport, WorkerId};

use crate::error::{ConfigError, non_negative};

/// Weights are clamped to `[1/MAX_RATIO, MAX_RATIO]`: a mis-measured worker can be favoured or
/// avoided, never made free or infinitely dear.
pub const MAX_RATIO: f64 = 8.0;

/// How often the pool's median speed is recomputed.
pub const MEDIAN_REFRESH_MS: u64 = 1000;

/// Knobs of capacity weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CapacityConfig {
    /// Weigh workers by their measured speed (off: every worker weighs 1).
    pub enabled: bool,
    /// Weight of the newest sample in the moving average, in (0, 1].
    pub alpha: f64,
    /// Busy time one sample spans at least.
    pub min_busy_ms: u64,
}

impl Default for CapacityConfig {
    /// Off (equal workers gain nothing and a noisy estimate would only add jitter); when on,
    /// α 0.3 and samples of ≥ 200 ms busy (a few load reports of a busy worker).
    fn default() -> Self {
        CapacityConfig {
            enabled: false,
            alpha: 0.3,
            min_busy_ms: 200,
        }
    }
}

impl CapacityConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("capacity alpha", self.alpha)?;
        if !(self.alpha > 0.0 && self.alpha <= 1.0) {
            return Err(ConfigError::OutOfRange {
                name: "capacity alpha",
                requirement: "in (0, 1]",
                value: self.alpha,
            });
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Estimate {
    /// Counters at the last sample: tokens (prefill + decode), busy µs.
    base: Option<(u64, u64)>,
    speed: Option<f64>,
}

/// One pool's speed estimates (see the module docs).
#[derive(Clone, Debug)]
pub struct Capacity {
    cfg: CapacityConfig,
    workers: HashMap<WorkerId, Estimate>,
    median: Option<f64>,
    median_at_ms: Option<u64>,
    dirty: bool,
}

impl Capacity {
    pub fn new(cfg: CapacityConfig) -> Self {
        Capacity {
            cfg,
            workers: HashMap::new(),
            median: None,
            median_at_ms: None,
            dirty: false,
        }
    }

    /// Takes a member's report.
    pub fn report(&mut self, r: &LoadReport) {
        if !self.cfg.enabled || r.busy_us_total == 0 {
            return;
        }
        let tokens = r.prefill_tokens_total.saturating_add(r.decode_tokens_total);
        let e = self.workers.entry(r.worker_id).or_default();
        let Some((t0, b0)) = e.base else {
            e.base = Some((tokens, r.busy_us_total));
            return;
        };
        if tokens < t0 || r.busy_us_total < b0 {
            // A restarted engine: its counters start over, and so does its estimate.
            *e = Estimate {
                base: Some((tokens, r.busy_us_total)),
                speed: None,
            };
            self.dirty = true;
            return;
        }
        let busy = r.busy_us_total - b0;
        if busy < self.cfg.min_busy_ms.saturating_mul(1000).max(1) {
            return;
        }
        let sample = (tokens - t0) as f64 / busy as f64;
        e.speed = Some(match e.speed {
            None => sample,
            Some(s) => s + self.cfg.alpha * (sample - s),
        });
        e.base = Some((tokens, r.busy_us_total));
        self.dirty = true;
    }

    /// The worker left (or re-joined): its estimate goes.
    pub fn remove(&mut self, worker: WorkerId) {
        if self.workers.remove(&worker).is_some() {
            self.dirty = true;
        }
    }

    /// Brings the median up to date (at most once per [`MEDIAN_REFRESH_MS`]).
    pub fn refresh(&mut self, now_ms: u64) {
        let due = self
            .median_at_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= MEDIAN_REFRESH_MS);
        if !(self.dirty && due) {
            return;
        }
        let mut speeds: Vec<f64> = self.workers.values().filter_map(|e| e.speed).collect();
        speeds.sort_by(f64::total_cmp);
        self.median = (!speeds.is_empty()).then(|| speeds[(speeds.len() - 1) / 2]);
        self.median_at_ms = Some(now_ms);
        self.dirty = false;
    }

    /// The worker's weight: its speed over the pool's median, 1 when either is unknown.
    pub fn weight(&self, worker: WorkerId) -> f64 {
        if !self.cfg.enabled {
            return 1.0;
        }
        match (self.workers.get(&worker).and_then(|e| e.speed), self.median) {
            (Some(s), Some(m)) if m > 0.0 => (s / m).clamp(1.0 / MAX_RATIO, MAX_RATIO),
            _ => 1.0,
        }
    }

    /// The worker's measured speed, tokens per busy µs.
    pub fn speed(&self, worker: WorkerId) -> Option<f64> {
        self.workers.get(&worker).and_then(|e| e.speed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(w: u64, tokens: u64, busy_us: u64) -> LoadReport {
        LoadReport {
            worker_id: WorkerId(w),
            prefill_tokens_total: tokens / 2,
            decode_tokens_total: tokens - tokens / 2,
            busy_us_total: busy_us,
            ..LoadReport::default()
        }
    }

    fn on() -> Capacity {
        Capacity::new(CapacityConfig {
            enabled: true,
            alpha: 0.5,
            min_busy_ms: 100,
        })
    }

    #[test]
    fn weights_are_speed_over_the_median() {
        let mut c = on();
        for (w, speed) in [(1, 1u64), (2, 1), (3, 2)] {
            c.report(&report(w, 0, 1));
            // 200 ms busy: 200,000 µs × speed tokens per µs.
            c.report(&report(w, 200_000 * speed, 200_001));
        }
        c.refresh(0);
        // Median of (1, 1, 2) tokens/µs is 1.
        assert_eq!(c.weight(WorkerId(1)), 1.0);
        assert_eq!(c.weight(WorkerId(3)), 2.0);
        // Unknown workers weigh 1.
        assert_eq!(c.weight(WorkerId(9)), 1.0);
        // Worker 3 slows to 1 token/µs: EWMA 2 + 0.5 × (1 − 2) = 1.5.
        c.report(&report(3, 400_000 + 200_000, 400_001));
        assert_eq!(c.speed(WorkerId(3)), Some(1.5));
        // The median is not recomputed within a second, but the weight uses the new speed.
        c.refresh(500);
        assert_eq!(c.weight(WorkerId(3)), 1.5);
    }

    #[test]
    fn short_busy_spans_accumulate_and_restarts_start_over() {
        let mut c = on();
        c.report(&report(1, 0, 10));
        // 50 ms busy: under the 100 ms minimum, no sample yet.
        c.report(&report(1, 50_000, 50_010));
        assert_eq!(c.speed(WorkerId(1)), None);
        // 100 ms in all since the base: one sample over the whole span.
        c.report(&report(1, 300_000, 100_010));
        assert_eq!(c.speed(WorkerId(1)), Some(3.0));
        // Counters went backwards: a restart, the estimate is gone.
        c.report(&report(1, 10, 5));
        assert_eq!(c.speed(WorkerId(1)), None);
        // No busy time reported (an external engine): ignored.
        c.report(&report(2, 1000, 0));
        assert_eq!(c.speed(WorkerId(2)), None);
    }

    #[test]
    fn off_or_extreme_weights_are_bounded() {
        let mut off = Capacity::new(CapacityConfig::default());
        off.report(&report(1, 0, 1));
        off.report(&report(1, 1_000_000, 1_000_001));
        off.refresh(0);
        assert_eq!(off.weight(WorkerId(1)), 1.0);
        let mut c = on();
        for (w, tokens) in [(1, 100_000u64), (2, 100_000), (3, 100_000_000)] {
            c.report(&report(w, 0, 1));
            c.report(&report(w, tokens, 100_001));
        }
        c.refresh(0);
        assert_eq!(c.weight(WorkerId(3)), MAX_RATIO);
        assert!(
            CapacityConfig {
                alpha: 0.0,
                ..CapacityConfig::default()
            }
            .validate()
            .is_err()
        );
    }
}
