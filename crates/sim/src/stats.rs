//! Counters gathered during a run, and the [`SimReport`] made from them at the end.

use tandem_router::groups::Arm;
use tandem_workload::{LatencyHistogram, Slo, WorkloadConfig};

use crate::config::SimConfig;
use crate::metrics::{ArmReport, ExperimentReport, SimReport, Spread};
use crate::workload::RequestSpec;

#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Cached tokens the index predicted for the prefilling worker at routing.
    pub predicted_cached_tokens: u64,
    /// Reusable prompt tokens (all but the last token's block) missed at routing because no
    /// worker had ever computed them, because no candidate held them any more, or because a
    /// candidate held more of them than the one chosen (see `metrics.rs`).
    pub reusable_tokens: u64,
    pub miss_cold_tokens: u64,
    pub miss_evicted_tokens: u64,
    pub miss_escaped_tokens: u64,
    pub transferred_tokens: u64,
    pub remote_prefills: u64,
    pub local_prefills: u64,
    pub transfer_fallbacks: u64,
    /// Every KV transfer's duration.
    pub transfer: LatencyHistogram,
    /// Every inter-token gap (bounded memory however many tokens the run makes).
    pub itl: LatencyHistogram,
    /// One sample per `sample_interval_us` while requests are in flight.
    pub imbalance: Vec<ImbalanceSample>,
    /// In an experiment: each arm's prompt tokens and cached tokens (arm a, then b).
    pub arm_tokens: [(u64, u64); 2],
}

/// An arm's place in per-arm arrays.
pub(crate) fn arm_index(arm: Arm) -> usize {
    match arm {
        Arm::A => 0,
        Arm::B => 1,
    }
}

/// The requests in flight per (decode) worker at one sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ImbalanceSample {
    pub secs: f64,
    /// Most minus fewest requests in flight on a worker.
    pub max_minus_min: u64,
    /// Most requests in flight on a worker over the mean.
    pub max_over_mean: f64,
}

impl Stats {
    /// Counts a prefill's cached tokens, toward its arm's too.
    pub fn cached(&mut self, arm: Option<Arm>, tokens: u64) {
        self.cached_tokens += tokens;
        if let Some(arm) = arm {
            self.arm_tokens[arm_index(arm)].1 += tokens;
        }
    }

    /// Records max−min and max/mean of the per-worker loads, when anything is in flight.
    pub fn sample_imbalance(&mut self, now_us: u64, loads: &[u64]) {
        let total: u64 = loads.iter().sum();
        if total == 0 || loads.is_empty() {
            return;
        }
        let mean = total as f64 / loads.len() as f64;
        let max = loads.iter().copied().max().unwrap_or(0);
        let min = loads.iter().copied().min().unwrap_or(0);
        self.imbalance.push(ImbalanceSample {
            secs: now_us as f64 / 1e6,
            max_minus_min: max - min,
            max_over_mean: max as f64 / mean,
        });
    }
}

fn mean(xs: impl ExactSizeIterator<Item = f64>) -> f64 {
    let n = xs.len();
    if n == 0 {
        0.0
    } else {
        xs.sum::<f64>() / n as f64
    }
}

fn workload_name(cfg: &SimConfig) -> String {
    let name = match &cfg.workload {
        WorkloadConfig::Trace(t) => format!(
            "trace {} ×{}",
            t.path.file_name().map_or_else(
                || t.path.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            t.arrival_speedup
        ),
        WorkloadConfig::Synthetic(s) => format!(
            "synthetic {:?} {:?} {} req/s, ISL {}±{:.0}%, OSL {}±{:.0}%",
            s.shape,
            s.arrival,
            s.rate,
            s.isl.mean,
            100.0 * s.isl.spread,
            s.osl.mean,
            100.0 * s.osl.spread
        ),
    };
    // Named only when on, so runs without jitter report exactly as before.
    match cfg.arrival_jitter_us {
        0 => name,
        j => format!("{name}, arrival jitter {} ms", j as f64 / 1000.0),
    }
}

/// What the finished requests measured: per-request latencies and counts.
/// One request's times, as the report needs them (µs of virtual time).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RequestTimes {
    pub arrival_us: u64,
    pub first_token_us: Option<u64>,
    pub last_token_us: u64,
    pub tokens: u32,
    pub done: bool,
    pub rejected: bool,
    /// Its arm, in an experiment.
    pub arm: Option<Arm>,
}

/// What a finished run hands the report: plain data, no simulator state.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub requests: Vec<RequestTimes>,
    pub stats: Stats,
    /// Requests routed per aggregated (or decode) worker, and per prefill worker.
    pub decode_routed: Vec<u64>,
    pub prefill_routed: Vec<u64>,
    pub preemptions: u64,
    /// LoRA adapters the engines loaded.
    pub adapter_loads: u64,
    /// KV events the replicas' indexes applied, and the repairs made for them.
    pub events_applied: u64,
    pub gaps_repaired: u64,
    /// Virtual time of the last event.
    pub end_us: u64,
}

#[derive(Default)]
struct RequestFigures {
    ttft: LatencyHistogram,
    /// A single-token request counts with a TPOT of 0.
    tpot: LatencyHistogram,
    e2e: LatencyHistogram,
    completed: u64,
    rejected: u64,
    /// Requests meeting the SLO.
    good: u64,
    out_tokens: u64,
}

impl RequestFigures {
    fn of(requests: &[RequestTimes], slo: &Slo) -> Self {
        let mut f = RequestFigures::default();
        for st in requests {
            if st.rejected {
                f.rejected += 1;
                continue;
            }
            let Some(first) = st.first_token_us.filter(|_| st.done) else {
                continue;
            };
            f.completed += 1;
            f.out_tokens += u64::from(st.tokens);
            let tpot = if st.tokens > 1 {
                (st.last_token_us - first) as f64 / 1000.0 / f64::from(st.tokens - 1)
            } else {
                0.0
            };
            f.ttft.record_us(first - st.arrival_us);
            f.tpot.record_ms(tpot);
            f.e2e.record_us(st.last_token_us - st.arrival_us);
            if slo.met((first - st.arrival_us) as f64 / 1000.0, Some(tpot)) {
                f.good += 1;
            }
        }
        f
    }
}

/// Each arm's figures, in an experiment: its requests' TTFT, hit rate and goodput (against
/// the experiment's TTFT SLO where it sets one, else the run's SLO), over the run's span.
fn experiment(cfg: &SimConfig, outcome: &Outcome, secs: f64) -> Option<ExperimentReport> {
    let e = cfg.experiment.as_ref()?;
    let slo = match e.ttft_slo_ms {
        Some(ttft_ms) => Slo {
            ttft_ms,
            tpot_ms: f64::INFINITY,
            ..cfg.slo
        },
        None => cfg.slo,
    };
    let arms = [Arm::A, Arm::B]
        .into_iter()
        .map(|arm| {
            let mine: Vec<RequestTimes> = outcome
                .requests
                .iter()
                .filter(|r| r.arm == Some(arm))
                .copied()
                .collect();
            let f = RequestFigures::of(&mine, &slo);
            let (prompt, cached) = outcome.stats.arm_tokens[arm_index(arm)];
            let n = mine.len() as u64;
            ArmReport {
                arm: arm.as_str(),
                requests: n,
                completed: f.completed,
                ttft_ms: f.ttft.summary(),
                prompt_tokens: prompt,
                cached_tokens: cached,
                prefix_hit_rate: cached as f64 / prompt.max(1) as f64,
                slo_attainment: f.good as f64 / n.max(1) as f64,
                goodput_rps: f.good as f64 / secs,
            }
        })
        .collect();
    Some(ExperimentReport {
        name: e.name.clone(),
        b_share: e.b_share,
        arms,
    })
}

pub(crate) fn report(cfg: &SimConfig, specs: &[RequestSpec], outcome: Outcome) -> SimReport {
    let end_us = outcome.end_us;
    let slo = cfg.slo;
    let RequestFigures {
        ttft,
        tpot,
        e2e,
        completed,
        rejected,
        good,
        out_tokens,
    } = RequestFigures::of(&outcome.requests, &slo);
    let stats = &outcome.stats;
    let (ttft_s, tpot_s, itl_s, e2e_s) = (
        ttft.summary(),
        tpot.summary(),
        stats.itl.summary(),
        e2e.summary(),
    );
    let transfer_s = stats.transfer.summary();
    // The first arrival is at 0 unless `arrival_jitter_us` moved it later.
    let first_us = specs.first().map_or(0, |s| s.arrival_us);
    let secs = (end_us.saturating_sub(first_us) as f64 / 1e6).max(1e-6);
    let span = specs.last().map_or(0, |s| s.arrival_us - first_us) as f64 / 1e6;
    let offered = if specs.len() > 1 && span > 0.0 {
        (specs.len() - 1) as f64 / span
    } else {
        0.0
    };
    let imb = &stats.imbalance;
    let (decode_routed, prefill_routed) = (&outcome.decode_routed, &outcome.prefill_routed);
    let (applied, gaps) = (outcome.events_applied, outcome.gaps_repaired);
    let n = specs.len() as u64;
    let experiment = experiment(cfg, &outcome, secs);
    SimReport {
        workload: workload_name(cfg),
        policy: if cfg.topology.prefill_workers > 0 {
            "kv (disagg)".to_owned()
        } else {
            cfg.routing.policy.kind.name().to_owned()
        },
        topology: if cfg.topology.prefill_workers > 0 {
            format!("disaggregated, {}", cfg.routing.disagg.mode)
        } else {
            "aggregated".to_owned()
        },
        workers: cfg.topology.workers,
        prefill_workers: cfg.topology.prefill_workers,
        routers: cfg.topology.routers,
        replica_sync: cfg.topology.replica_sync,
        event_delay_ms: cfg.event_plane.delay_us as f64 / 1000.0,
        snapshot_interval_ms: cfg.event_plane.snapshot_interval_us as f64 / 1000.0,
        seed: cfg.seed,
        requests: n,
        completed,
        rejected,
        offered_rate_rps: offered,
        virtual_seconds: secs,
        throughput_rps: completed as f64 / secs,
        output_tokens_per_s: out_tokens as f64 / secs,
        ttft_ms: ttft_s,
        tpot_ms: tpot_s,
        itl_ms: itl_s,
        e2e_ms: e2e_s,
        slo_ttft_ms: slo.ttft_ms,
        slo_itl_ms: slo.tpot_ms,
        slo_attainment: good as f64 / n.max(1) as f64,
        goodput_rps: good as f64 / secs,
        prompt_tokens: stats.prompt_tokens,
        cached_tokens: stats.cached_tokens,
        prefix_hit_rate: stats.cached_tokens as f64 / stats.prompt_tokens.max(1) as f64,
        predicted_cached_tokens: stats.predicted_cached_tokens,
        predicted_hit_rate: stats.predicted_cached_tokens as f64
            / stats.prompt_tokens.max(1) as f64,
        reusable_tokens: stats.reusable_tokens,
        miss_cold_tokens: stats.miss_cold_tokens,
        miss_evicted_tokens: stats.miss_evicted_tokens,
        miss_escaped_tokens: stats.miss_escaped_tokens,
        remote_prefills: stats.remote_prefills,
        local_prefills: stats.local_prefills,
        transferred_tokens: stats.transferred_tokens,
        transfer_p50_ms: transfer_s.p50,
        transfer_max_ms: transfer_s.max,
        transfer_fallbacks: stats.transfer_fallbacks,
        worker_requests: Spread::of(decode_routed),
        prefill_worker_requests: Spread::of(prefill_routed),
        inflight_imbalance_samples: imb.len() as u64,
        inflight_imbalance_max_minus_min_mean: mean(imb.iter().map(|x| x.max_minus_min as f64)),
        inflight_imbalance_max_minus_min_max: imb
            .iter()
            .map(|x| x.max_minus_min)
            .max()
            .unwrap_or(0),
        inflight_imbalance_max_over_mean_mean: mean(imb.iter().map(|x| x.max_over_mean)),
        inflight_imbalance_max_over_mean_max: imb
            .iter()
            .map(|x| x.max_over_mean)
            .fold(0.0, f64::max),
        preemptions: outcome.preemptions,
        adapter_loads: outcome.adapter_loads,
        kv_events_applied: applied,
        index_gaps_repaired: gaps,
        ttft_cdf_ms: ttft.cdf_ms(),
        inflight_imbalance_max_minus_min_series: imb
            .iter()
            .map(|x| (x.secs, x.max_minus_min))
            .collect(),
        inflight_imbalance_max_over_mean_series: imb
            .iter()
            .map(|x| (x.secs, x.max_over_mean))
            .collect(),
        experiment,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imbalance_samples_give_max_minus_min_and_max_over_mean() {
        let mut s = Stats::default();
        s.sample_imbalance(500_000, &[1, 0, 0, 0]);
        s.sample_imbalance(1_000_000, &[0, 0, 0, 0]); // nothing in flight: skipped
        s.sample_imbalance(1_500_000, &[5, 2, 3, 2]);
        let got: Vec<_> = s
            .imbalance
            .iter()
            .map(|x| (x.secs, x.max_minus_min, x.max_over_mean))
            .collect();
        assert_eq!(got, [(0.5, 1, 4.0), (1.5, 3, 5.0 / 3.0)]);
    }
}
