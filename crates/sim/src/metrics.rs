//! Per-request timings gathered during a run, and the [`SimReport`] made from them.
//!
//! Definitions (also in the crate docs):
//! - TTFT: arrival at the router to the first token leaving the (decode) engine.
//! - ITL: the gap between two consecutive tokens of a request; every gap of every request is
//!   one sample. TPOT: a request's mean ITL, `(last − first token) / (tokens − 1)`.
//! - E2E: arrival to the last token.
//! - Latencies (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms`) are [`LatencySummary`]s, as in the
//!   bench report. Percentiles (their `p50` … `p99`, `ttft_cdf_ms`, `transfer_p50_ms`) are nearest-rank
//!   over every sample, from a [`tandem_workload::LatencyHistogram`]: within 0.1 % of the
//!   exact value (the top of its 1 µs … 1/1,024-wide bucket); means, maxima and counts are
//!   exact.
//! - A request *meets the SLO* when it completed, its TTFT ≤ `slo_ttft_ms` and its TPOT ≤
//!   `slo_itl_ms` ([`Slo::met`]). Goodput is the number of such requests per second of the
//!   run (first arrival to last completion); `slo_attainment` is their fraction of all
//!   requests.
//! - Prefix hit rate: prompt tokens the engines served from their prefix cache, over all
//!   prompt tokens, from the `cached_tokens` of each request's first token on the engine that
//!   prefilled it (the prefill worker for a remote prefill: the decode side's reuse of the
//!   transferred KV is counted as transferred, not as a hit).
//! - Index-predicted hit rate: what the router's KV index predicted of the same, at routing:
//!   for each request, the blocks the index said the prefilling worker holds (any tier), of
//!   which an engine can reuse all but the one holding the last prompt token (always
//!   computed), over all prompt tokens. Against the real hit rate it shows how true the index
//!   is: they differ by blocks evicted between routing and admission, preemptions, and
//!   whatever the index does not know (event delays, snapshots, lost events).
//! - Miss breakdown: of each request's reusable prompt blocks (all but the one holding its
//!   last token), at routing: *cold* — no request before had those leading blocks (a miss
//!   no cache and no policy avoids); *evicted* — computed before, but no candidate of the
//!   prefilling pool held them any more (the caches' size); *escaped* — some candidate held
//!   more of them than the worker chosen (the policy traded them for load, or a busy or
//!   warm-up rule did); and what the chosen worker held per the index, which splits into the
//!   hits and *stale* (predicted minus hit: evicted between routing and admission, or not
//!   known to the index). In tokens; cold + evicted + escaped + predicted = reusable tokens.
//!   "Computed before" is tracked over the first 16 M distinct blocks of a run (then counted
//!   as evicted).
//! - In-flight load imbalance (`inflight_imbalance_*`): every `sample_interval_us` of virtual
//!   time (`--sample-interval-ms`, from t = 0, until the last request ends), the requests in
//!   flight on each aggregated (or decode) worker are counted: waiting, running, or awaiting
//!   the KV of a remote prefill in its engine. Samples where no request is in flight anywhere
//!   are skipped. Per sample, two figures: **max − min** over workers (the imbalance of the
//!   router experiments; 0 means perfectly even), and max / mean (the worker count whenever a
//!   single request is in flight, so it mostly measures how light the load is). The report
//!   gives the mean and the max of each over the samples, the number of samples, and every
//!   sample as a `(virtual second, value)` series. Prefill workers are not sampled.

use serde::Serialize;
use tandem_workload::LatencySummary;

use tandem_workload::Slo;

/// Spread of a per-worker count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    pub min: u64,
    pub max: u64,
    pub mean: f64,
    /// Coefficient of variation (standard deviation / mean); 0 when the mean is 0.
    pub cv: f64,
}

impl Spread {
    pub(crate) fn of(xs: &[u64]) -> Spread {
        if xs.is_empty() {
            return Spread::default();
        }
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<u64>() as f64 / n;
        let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        Spread {
            min: xs.iter().copied().min().unwrap_or(0),
            max: xs.iter().copied().max().unwrap_or(0),
            mean,
            cv: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
        }
    }
}

/// What one run measured. Serialized as the `--json` record; keys name their units.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    pub workload: String,
    pub policy: String,
    /// `aggregated`, or the disaggregation mode.
    pub topology: String,
    pub workers: u32,
    pub prefill_workers: u32,
    pub routers: u32,
    pub replica_sync: bool,
    pub event_delay_ms: f64,
    pub snapshot_interval_ms: f64,
    pub seed: u64,
    pub requests: u64,
    pub completed: u64,
    /// Refused by an engine (prompt longer than its KV memory, or its queue full).
    pub rejected: u64,
    /// Arrivals per second over the arrival span (0 with a single request).
    pub offered_rate_rps: f64,
    /// First arrival to last completion.
    pub virtual_seconds: f64,
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    /// Time to first token, ms: count, mean, p50, p90, p95, p99 and max.
    pub ttft_ms: LatencySummary,
    /// Time per output token after the first, per request, ms: count, mean, p50, p90, p95, p99 and max.
    pub tpot_ms: LatencySummary,
    /// Gaps between consecutive output tokens, over all tokens, ms: count, mean, p50, p90, p95, p99 and max.
    pub itl_ms: LatencySummary,
    /// Arrival to last token, ms: count, mean, p50, p90, p95, p99 and max.
    pub e2e_ms: LatencySummary,
    pub slo_ttft_ms: f64,
    pub slo_itl_ms: f64,
    /// Requests meeting the SLO, over all requests.
    pub slo_attainment: f64,
    /// Requests meeting the SLO per second.
    pub goodput_rps: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub prefix_hit_rate: f64,
    /// Cached tokens the index predicted at routing (see the module docs).
    pub predicted_cached_tokens: u64,
    pub predicted_hit_rate: f64,
    /// Prompt tokens an engine could have reused (all but each prompt's last block).
    pub reusable_tokens: u64,
    /// Where the reusable prompt tokens that were not hits went (see the module docs).
    pub miss_cold_tokens: u64,
    pub miss_evicted_tokens: u64,
    pub miss_escaped_tokens: u64,
    /// Requests prefilled on a prefill worker.
    pub remote_prefills: u64,
    pub local_prefills: u64,
    /// Prompt tokens whose KV went from a prefill to a decode worker.
    pub transferred_tokens: u64,
    pub transfer_p50_ms: f64,
    pub transfer_max_ms: f64,
    /// Requests chosen for a remote prefill whose decode worker could not reserve blocks for
    /// the KV at routing: prefilled locally there instead (and counted in `local_prefills`).
    pub transfer_fallbacks: u64,
    /// Requests per aggregated (or decode) worker.
    pub worker_requests: Spread,
    pub prefill_worker_requests: Spread,
    /// Samples of the requests in flight per (decode) worker (see the module docs): one every
    /// `sample_interval_us` of virtual time while at least one request is in flight.
    pub inflight_imbalance_samples: u64,
    /// Most minus fewest requests in flight on a worker: mean over the samples…
    pub inflight_imbalance_max_minus_min_mean: f64,
    /// …and max over the samples.
    pub inflight_imbalance_max_minus_min_max: u64,
    /// Most requests in flight on a worker over the mean per worker: mean over the samples…
    /// (equals the worker count whenever a single request is in flight, so it overstates
    /// imbalance at low load; prefer max−min).
    pub inflight_imbalance_max_over_mean_mean: f64,
    /// …and max over the samples.
    pub inflight_imbalance_max_over_mean_max: f64,
    pub preemptions: u64,
    /// LoRA adapters the engines loaded (workloads with adapters, `--max-loras` set).
    pub adapter_loads: u64,
    pub kv_events_applied: u64,
    pub index_gaps_repaired: u64,
    /// TTFT at each percent 0, 1, …, 100 (the CDF, for plots).
    pub ttft_cdf_ms: Vec<f64>,
    /// `(virtual second, max − min)` of every sample.
    pub inflight_imbalance_max_minus_min_series: Vec<(f64, u64)>,
    /// `(virtual second, max / mean)` of every sample.
    pub inflight_imbalance_max_over_mean_series: Vec<(f64, f64)>,
    /// Each arm's figures, in an experiment (absent without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experiment: Option<ExperimentReport>,
}

/// An A/B experiment's arms side by side.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExperimentReport {
    pub name: String,
    /// The share of sessions (and of prompt prefixes) in arm `b`.
    pub b_share: f64,
    /// Arm `a`, then arm `b`.
    pub arms: Vec<ArmReport>,
}

/// One arm's requests: as [`SimReport`]'s figures of the same names.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ArmReport {
    pub arm: &'static str,
    pub requests: u64,
    pub completed: u64,
    pub ttft_ms: LatencySummary,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub prefix_hit_rate: f64,
    /// Against the experiment's `ttft_slo_ms` where it sets one (TTFT alone), else the run's
    /// SLO.
    pub slo_attainment: f64,
    pub goodput_rps: f64,
}

impl SimReport {
    /// Whether the run meets the SLO at the configured attainment.
    pub fn meets_slo(&self, slo: &Slo) -> bool {
        slo.attained(self.slo_attainment)
    }

    /// The run's plot: its TTFT CDF, labelled with the policy.
    pub fn figures(&self) -> tandem_workload::plot::Figures<'_> {
        tandem_workload::plot::Figures {
            ttft_cdfs: vec![(self.policy.clone(), self.ttft_cdf_ms.as_slice())],
            goodput: None,
        }
    }

    /// A two-column markdown table of the main figures.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let mut row = |k: &str, v: String| s.push_str(&format!("| {k} | {v} |\n"));
        row("workload", self.workload.clone());
        row(
            "topology",
            format!(
                "{} ({} workers, {} prefill, {} routers{})",
                self.topology,
                self.workers,
                self.prefill_workers,
                self.routers,
                if self.routers > 1 && self.replica_sync {
                    ", synced"
                } else {
                    ""
                }
            ),
        );
        row("policy", self.policy.clone());
        row(
            "requests",
            format!(
                "{} ({} completed, {} rejected) at {:.2} req/s over {:.1} s",
                self.requests,
                self.completed,
                self.rejected,
                self.offered_rate_rps,
                self.virtual_seconds
            ),
        );
        let lat = |l: &LatencySummary| {
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1} / {:.1}",
                l.p50, l.p90, l.p95, l.p99, l.max
            )
        };
        s.push_str("| **latency, ms** | **p50 / p90 / p95 / p99 / max** |\n");
        let mut row = |k: &str, v: String| s.push_str(&format!("| {k} | {v} |\n"));
        row("TTFT", lat(&self.ttft_ms));
        row("TPOT", lat(&self.tpot_ms));
        row("ITL", lat(&self.itl_ms));
        row("E2E", lat(&self.e2e_ms));
        row(
            "goodput",
            format!(
                "{:.2} req/s ({:.1} % of requests meet TTFT ≤ {} ms and TPOT ≤ {} ms)",
                self.goodput_rps,
                100.0 * self.slo_attainment,
                self.slo_ttft_ms,
                self.slo_itl_ms
            ),
        );
        row(
            "prefix hit rate",
            format!("{:.1} %", 100.0 * self.prefix_hit_rate),
        );
        row(
            "index-predicted hit rate",
            format!("{:.1} %", 100.0 * self.predicted_hit_rate),
        );
        let share = |t: u64| 100.0 * t as f64 / self.prompt_tokens.max(1) as f64;
        row(
            "misses: cold / evicted / escaped / stale",
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1} %",
                share(self.miss_cold_tokens),
                share(self.miss_evicted_tokens),
                share(self.miss_escaped_tokens),
                100.0 * (self.predicted_hit_rate - self.prefix_hit_rate),
            ),
        );
        if self.prefill_workers > 0 {
            row(
                "remote / local prefills",
                format!(
                    "{} / {} ({} tokens transferred, p50 {:.2} ms, {} fallbacks)",
                    self.remote_prefills,
                    self.local_prefills,
                    self.transferred_tokens,
                    self.transfer_p50_ms,
                    self.transfer_fallbacks
                ),
            );
        }
        let spread = |sp: &Spread| {
            format!(
                "min {} / mean {:.1} / max {} (CV {:.3})",
                sp.min, sp.mean, sp.max, sp.cv
            )
        };
        row("requests per worker", spread(&self.worker_requests));
        if self.prefill_workers > 0 {
            row(
                "requests per prefill worker",
                spread(&self.prefill_worker_requests),
            );
        }
        row(
            "in-flight imbalance, max−min requests per worker",
            format!(
                "mean {:.2}, max {} (samples: {})",
                self.inflight_imbalance_max_minus_min_mean,
                self.inflight_imbalance_max_minus_min_max,
                self.inflight_imbalance_samples
            ),
        );
        row(
            "in-flight imbalance, max/mean requests per worker",
            format!(
                "mean {:.2}, max {:.2}",
                self.inflight_imbalance_max_over_mean_mean,
                self.inflight_imbalance_max_over_mean_max
            ),
        );
        row(
            "throughput",
            format!(
                "{:.2} req/s, {:.0} output tokens/s",
                self.throughput_rps, self.output_tokens_per_s
            ),
        );
        if self.adapter_loads > 0 {
            row("LoRA adapter loads", self.adapter_loads.to_string());
        }
        row(
            "preemptions / KV events applied / gaps",
            format!(
                "{} / {} / {}",
                self.preemptions, self.kv_events_applied, self.index_gaps_repaired
            ),
        );
        if let Some(e) = &self.experiment {
            for a in &e.arms {
                row(
                    &format!("experiment {} arm {}", e.name, a.arm),
                    format!(
                        "{} requests, TTFT p50 {:.1} p99 {:.1} ms, hit rate {:.1} %, \
                         SLO attainment {:.1} %, goodput {:.2} req/s",
                        a.requests,
                        a.ttft_ms.p50,
                        a.ttft_ms.p99,
                        100.0 * a.prefix_hit_rate,
                        100.0 * a.slo_attainment,
                        a.goodput_rps
                    ),
                );
            }
        }
        format!("| figure | value |\n|---|---|\n{s}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_per_worker_counts() {
        let sp = Spread::of(&[2, 2, 2]);
        assert_eq!((sp.min, sp.max, sp.cv), (2, 2, 0.0));
        assert!(Spread::of(&[0, 4]).cv > 0.99);
    }
}
