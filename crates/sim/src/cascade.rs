//! A model cascade in the simulator: the small model's pool serves every request, a share of
//! them is escalated, and each escalated request arrives at the large model's pool when the
//! small model's answer is done, with its conversation unchanged (the same prompt).
//!
//! What a capacity plan must not assume is that the large pool sees "the escalation rate × the
//! raw traffic". Escalated requests are the harder ones — the cascade escalates where the small
//! model was unsure, which goes with longer, harder prompts — and they arrive correlated: a
//! burst of raw traffic becomes a burst of escalations one small-model answer later, after the
//! small pool's queue has reshaped it. [`CascadeConfig::correlation`] sets how much the
//! prompt's length decides which requests escalate (0: a uniform draw; 1: exactly the longest
//! prompts), and [`CascadeReport`] gives both pools' runs and the arrivals' burstiness at each.
//!
//! The two pools run one after the other, in virtual time: first the small pool on the
//! workload, then the large pool on the escalated requests at the times the small pool
//! finished them. Escalation adds no delay of its own (a verifier's call is not modelled), and
//! a request the small pool refused is not escalated.

use serde::Serialize;
use tandem_protocol::Rng;

use crate::config::SimConfig;
use crate::error::SimError;
use crate::metrics::SimReport;
use crate::workload::{self, RequestSpec};

/// A cascade: the small pool is [`SimConfig`]'s cluster; the large pool is the same but for
/// its worker count and speed.
#[derive(Clone, Debug, PartialEq)]
pub struct CascadeConfig {
    /// The share of requests escalated, in [0, 1].
    pub escalation_rate: f64,
    /// How much the prompt's length decides which requests escalate, in [0, 1].
    pub correlation: f64,
    /// Workers in the large model's pool (aggregated).
    pub large_workers: u32,
    /// The large model's engine speed relative to the small one's (`speedup_ratio`
    /// multiplies it): below 1, slower.
    pub large_speed: f64,
}

impl CascadeConfig {
    fn validate(&self) -> Result<(), SimError> {
        let bad = |what: String| Err(SimError::InvalidConfig(what));
        if !(0.0..=1.0).contains(&self.escalation_rate) {
            return bad(format!(
                "--cascade-escalation-rate must be in [0, 1], got {}",
                self.escalation_rate
            ));
        }
        if !(0.0..=1.0).contains(&self.correlation) {
            return bad(format!(
                "--cascade-correlation must be in [0, 1], got {}",
                self.correlation
            ));
        }
        if self.large_workers == 0 {
            return bad("--cascade-large-workers must be at least 1".into());
        }
        if !(self.large_speed.is_finite() && self.large_speed > 0.0) {
            return bad(format!(
                "--cascade-large-speed must be a number > 0, got {}",
                self.large_speed
            ));
        }
        Ok(())
    }
}

/// How bursty a stream of arrivals is.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Burstiness {
    pub arrivals: u64,
    /// Arrivals per second over their span.
    pub rate_rps: f64,
    /// Standard deviation over mean of the gaps between arrivals (a Poisson stream: 1).
    pub interarrival_cv: f64,
    /// The most arrivals in one second over the mean per second.
    pub peak_to_mean_1s: f64,
}

impl Burstiness {
    /// Of arrival times in µs, in any order.
    pub fn of(times_us: &[u64]) -> Burstiness {
        let mut t = times_us.to_vec();
        t.sort_unstable();
        let n = t.len();
        let span_s = match (t.first(), t.last()) {
            (Some(a), Some(b)) if b > a => (b - a) as f64 / 1e6,
            _ => 0.0,
        };
        let gaps: Vec<f64> = t.windows(2).map(|w| (w[1] - w[0]) as f64).collect();
        let cv = if gaps.is_empty() {
            0.0
        } else {
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
            if mean > 0.0 { var.sqrt() / mean } else { 0.0 }
        };
        let peak = match t.first() {
            Some(&start) if span_s > 0.0 => {
                let mut per_second: std::collections::BTreeMap<u64, u64> = Default::default();
                for x in &t {
                    *per_second.entry((x - start) / 1_000_000).or_default() += 1;
                }
                // The one-second windows from the first arrival through the last.
                let seconds = span_s.floor() + 1.0;
                let peak = per_second.values().copied().max().unwrap_or(0) as f64;
                peak / (n as f64 / seconds)
            }
            _ => 0.0,
        };
        Burstiness {
            arrivals: n as u64,
            rate_rps: if span_s > 0.0 {
                (n - 1) as f64 / span_s
            } else {
                0.0
            },
            interarrival_cv: cv,
            peak_to_mean_1s: peak,
        }
    }
}

/// Both pools of a cascade, and what the large pool is sent.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CascadeReport {
    pub escalation_rate: f64,
    pub correlation: f64,
    pub requests: u64,
    pub escalated: u64,
    /// Mean prompt length of every request, and of the escalated ones (tokens).
    pub prompt_tokens_mean: f64,
    pub escalated_prompt_tokens_mean: f64,
    /// The raw traffic's arrivals, and the large pool's.
    pub arrivals: Burstiness,
    pub large_arrivals: Burstiness,
    pub small: SimReport,
    pub large: SimReport,
}

impl CascadeReport {
    /// The cascade's table, then each pool's.
    pub fn to_markdown(&self) -> String {
        let b = |x: &Burstiness| {
            format!(
                "{} arrivals, {:.2} req/s, inter-arrival CV {:.2}, peak/mean per second {:.2}",
                x.arrivals, x.rate_rps, x.interarrival_cv, x.peak_to_mean_1s
            )
        };
        format!(
            "| cascade | value |\n|---|---|\n\
             | escalated | {} of {} ({:.1} %; rate {}, correlation {}) |\n\
             | prompt tokens, mean | {:.0} all, {:.0} escalated |\n\
             | raw arrivals | {} |\n| large pool arrivals | {} |\n\n\
             small model's pool:\n\n{}\nlarge model's pool:\n\n{}",
            self.escalated,
            self.requests,
            100.0 * self.escalated as f64 / self.requests.max(1) as f64,
            self.escalation_rate,
            self.correlation,
            self.prompt_tokens_mean,
            self.escalated_prompt_tokens_mean,
            b(&self.arrivals),
            b(&self.large_arrivals),
            self.small.to_markdown(),
            self.large.to_markdown(),
        )
    }
}

/// Runs `config`'s workload through a cascade: its cluster as the small model's pool, then
/// the escalated requests through the large model's.
pub fn run_cascade(config: SimConfig, cascade: &CascadeConfig) -> Result<CascadeReport, SimError> {
    let (specs, small, large_specs) = escalated_stream(&config, cascade)?;
    let large = crate::run_specs(
        &large_config(&config, cascade, cascade.large_workers)?,
        &large_specs,
    )?;
    let mean = |xs: &mut dyn Iterator<Item = usize>| {
        let (sum, n) = xs.fold((0usize, 0usize), |(s, n), x| (s + x, n + 1));
        sum as f64 / n.max(1) as f64
    };
    Ok(CascadeReport {
        escalation_rate: cascade.escalation_rate,
        correlation: cascade.correlation,
        requests: specs.len() as u64,
        escalated: large_specs.len() as u64,
        prompt_tokens_mean: mean(&mut specs.iter().map(|s| s.prompt.len())),
        escalated_prompt_tokens_mean: mean(&mut large_specs.iter().map(|s| s.prompt.len())),
        arrivals: Burstiness::of(&specs.iter().map(|s| s.arrival_us).collect::<Vec<_>>()),
        large_arrivals: Burstiness::of(
            &large_specs.iter().map(|s| s.arrival_us).collect::<Vec<_>>(),
        ),
        small,
        large,
    })
}

/// The workload, the small pool's run, and the escalated requests at the times the small pool
/// finished them (in arrival order).
fn escalated_stream(
    config: &SimConfig,
    cascade: &CascadeConfig,
) -> Result<(Vec<RequestSpec>, SimReport, Vec<RequestSpec>), SimError> {
    config.validate()?;
    cascade.validate()?;
    let specs = workload::build(&config.workload, config.seed, config.arrival_jitter_us)?;
    let (small, times) = crate::run_specs_with_times(config, &specs)?;
    let mut large_specs: Vec<RequestSpec> = escalated(&specs, cascade, config.seed)
        .into_iter()
        .filter(|&i| times[i].done && !times[i].rejected)
        .map(|i| RequestSpec {
            arrival_us: times[i].last_token_us,
            ..specs[i].clone()
        })
        .collect();
    large_specs.sort_by_key(|s| s.arrival_us);
    Ok((specs, small, large_specs))
}

/// The large model's pool of `workers`: the small pool's settings but for its size and speed.
fn large_config(
    config: &SimConfig,
    cascade: &CascadeConfig,
    workers: u32,
) -> Result<SimConfig, SimError> {
    let mut large = config.clone();
    large.topology.workers = workers;
    large.topology.prefill_workers = 0;
    large.engine.speedup_ratio *= cascade.large_speed;
    large.worker_speedups.clear();
    large.experiment = None;
    large.validate()?;
    Ok(large)
}

/// What `tandem size` finds for a cascade's large pool: the fewest workers (up to
/// `max_workers`) meeting the SLO on the stream the cascade sends it, and on the stream a
/// plan that takes "the escalation rate × the raw traffic" would size for (a random share of
/// the requests, at their own arrival times).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LargePoolSize {
    pub small_workers: u32,
    pub max_workers: u32,
    pub escalated: u64,
    /// `None`: none up to `max_workers` meets the SLO.
    pub large_workers: Option<u32>,
    pub naive_large_workers: Option<u32>,
}

impl LargePoolSize {
    pub fn to_markdown(&self) -> String {
        let n = |w: Option<u32>| {
            w.map_or_else(
                || format!("none up to {}", self.max_workers),
                |w| w.to_string(),
            )
        };
        format!(
            "\ncascade: the large model's pool behind {} small-model workers ({} escalated): \
             {} workers (sized as a random share of the raw traffic: {})\n",
            self.small_workers,
            self.escalated,
            n(self.large_workers),
            n(self.naive_large_workers),
        )
    }
}

/// Sizes a cascade's large pool behind `config`'s cluster (see [`LargePoolSize`]).
pub fn size_large_pool(
    config: &SimConfig,
    cascade: &CascadeConfig,
    max_workers: u32,
) -> Result<LargePoolSize, SimError> {
    let (specs, _, large_specs) = escalated_stream(config, cascade)?;
    let random = CascadeConfig {
        correlation: 0.0,
        ..cascade.clone()
    };
    let naive: Vec<RequestSpec> = escalated(&specs, &random, config.seed)
        .into_iter()
        .map(|i| specs[i].clone())
        .collect();
    let fewest = |stream: &[RequestSpec]| -> Result<Option<u32>, SimError> {
        let meets = |w: u32| -> Result<bool, SimError> {
            let cfg = large_config(config, cascade, w)?;
            Ok(crate::run_specs(&cfg, stream)?.meets_slo(&config.slo))
        };
        if stream.is_empty() {
            return Ok(Some(0));
        }
        if !meets(max_workers)? {
            return Ok(None);
        }
        let (mut lo, mut hi) = (1, max_workers);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if meets(mid)? {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(Some(hi))
    };
    Ok(LargePoolSize {
        small_workers: config.topology.workers,
        max_workers,
        escalated: large_specs.len() as u64,
        large_workers: fewest(&large_specs)?,
        naive_large_workers: fewest(&naive)?,
    })
}

/// The requests the cascade escalates: the top `escalation_rate` of a score that mixes the
/// prompt's length rank (weight `correlation`) with a seeded uniform draw.
fn escalated(specs: &[RequestSpec], cascade: &CascadeConfig, seed: u64) -> Vec<usize> {
    let n = specs.len();
    let mut by_length: Vec<usize> = (0..n).collect();
    by_length.sort_by_key(|&i| (specs[i].prompt.len(), i));
    // Equal lengths share their mean rank: the draw orders them.
    let mut rank = vec![0.0; n];
    let mut start = 0;
    while start < n {
        let len = specs[by_length[start]].prompt.len();
        let end = start
            + by_length[start..]
                .iter()
                .take_while(|&&i| specs[i].prompt.len() == len)
                .count();
        let mid = (start + end - 1) as f64 / 2.0 / (n - 1).max(1) as f64;
        for &i in &by_length[start..end] {
            rank[i] = mid;
        }
        start = end;
    }
    let mut rng = Rng::seed_from_u64(seed ^ 0x0063_6173_6361_6465);
    let c = cascade.correlation;
    let mut scored: Vec<(f64, usize)> = (0..n)
        .map(|i| (c * rank[i] + (1.0 - c) * rng.unit_f64(), i))
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let k = (cascade.escalation_rate * n as f64).round() as usize;
    let mut chosen: Vec<usize> = scored.into_iter().take(k).map(|(_, i)| i).collect();
    chosen.sort_unstable();
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burstiness_of_even_and_clumped_arrivals() {
        let even: Vec<u64> = (0..10).map(|i| i * 100_000).collect();
        let b = Burstiness::of(&even);
        assert_eq!(b.arrivals, 10);
        assert!(b.interarrival_cv < 1e-9, "{b:?}");
        assert!((b.rate_rps - 10.0).abs() < 1e-9, "{b:?}");
        // Five at once, a pause, five at once: gaps 0 and one long one.
        let clumped: Vec<u64> = [0u64; 5].into_iter().chain([3_000_000; 5]).collect();
        let c = Burstiness::of(&clumped);
        assert!(c.interarrival_cv > 2.0, "{c:?}");
        assert_eq!(c.peak_to_mean_1s, 2.0, "{c:?}");
        assert_eq!(b.peak_to_mean_1s, 1.0, "{b:?}");
        assert_eq!(Burstiness::of(&[]).arrivals, 0);
        assert_eq!(Burstiness::of(&[5]).rate_rps, 0.0);
    }
}
