//! `tandem size`'s search: how many workers a load needs to meet its SLO, aggregated and split
//! into prefill and decode pools, found by simulating candidate clusters.
//!
//! Aggregated: the fewest workers (1 to `max_workers`) whose run meets the SLO, by bisection
//! (more workers never hurt in the model, so meeting the SLO is monotone in the count).
//! Disaggregated: for each total from 2 up, every split into prefill + decode workers; the
//! first total with a split that meets the SLO, and its best split (highest attainment, then
//! goodput). Every run uses the same workload, seed and engine settings.

use serde::Serialize;

use crate::config::SimConfig;
use crate::error::SimError;
use crate::metrics::SimReport;

/// Which kinds of cluster to plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topologies {
    Aggregated,
    Disaggregated,
    Both,
}

/// One candidate cluster and how it did.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub prefill_workers: u32,
    pub decode_workers: u32,
    pub meets_slo: bool,
    pub slo_attainment: f64,
    pub goodput_rps: f64,
    pub ttft_p99_ms: f64,
    pub tpot_p99_ms: f64,
}

impl Candidate {
    fn of(r: &SimReport, meets_slo: bool) -> Candidate {
        Candidate {
            prefill_workers: r.prefill_workers,
            decode_workers: r.workers,
            meets_slo,
            slo_attainment: r.slo_attainment,
            goodput_rps: r.goodput_rps,
            ttft_p99_ms: r.ttft_ms.p99,
            tpot_p99_ms: r.tpot_ms.p99,
        }
    }

    fn total(&self) -> u32 {
        self.prefill_workers + self.decode_workers
    }
}

/// What the plan found: the smallest cluster of each kind meeting the SLO (None: none up to
/// the limit does), and every candidate run.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub max_workers: u32,
    pub aggregated: Option<Candidate>,
    pub disaggregated: Option<Candidate>,
    pub disagg_mode: String,
    pub runs: Vec<Candidate>,
}

impl Plan {
    pub fn to_markdown(&self) -> String {
        let mut s = String::from(
            "| prefill | decode | meets SLO | attainment % | goodput req/s | TTFT p99 ms | \
             TPOT p99 ms |\n|---:|---:|:---:|---:|---:|---:|---:|\n",
        );
        for c in &self.runs {
            s.push_str(&format!(
                "| {} | {} | {} | {:.1} | {:.2} | {:.0} | {:.1} |\n",
                c.prefill_workers,
                c.decode_workers,
                if c.meets_slo { "yes" } else { "no" },
                100.0 * c.slo_attainment,
                c.goodput_rps,
                c.ttft_p99_ms,
                c.tpot_p99_ms
            ));
        }
        let line = |what: &str, c: &Option<Candidate>| match c {
            Some(c) if c.prefill_workers == 0 => {
                format!("\n{what}: {} workers\n", c.decode_workers)
            }
            Some(c) => format!(
                "\n{what}: {} workers ({} prefill + {} decode, `--disagg {}`)\n",
                c.total(),
                c.prefill_workers,
                c.decode_workers,
                self.disagg_mode
            ),
            None => format!(
                "\n{what}: none up to {} workers meets the SLO\n",
                self.max_workers
            ),
        };
        s.push_str(&line("aggregated", &self.aggregated));
        s.push_str(&line("disaggregated", &self.disaggregated));
        s
    }
}

/// Runs the candidates of `base` (its topology replaced) up to `max_workers`.
pub fn plan(base: &SimConfig, max_workers: u32, topologies: Topologies) -> Result<Plan, SimError> {
    if max_workers == 0 {
        return Err(SimError::InvalidConfig(
            "--workers must be at least 1".into(),
        ));
    }
    let mut runs = Vec::new();
    let mut run = |prefill: u32, decode: u32| -> Result<Candidate, SimError> {
        let mut cfg = base.clone();
        cfg.topology.workers = decode;
        cfg.topology.prefill_workers = prefill;
        let report = crate::run(cfg)?;
        let c = Candidate::of(&report, report.meets_slo(&base.slo));
        runs.push(c.clone());
        Ok(c)
    };
    let mut aggregated = None;
    if topologies != Topologies::Disaggregated {
        // Bisection for the fewest workers that meet the SLO.
        let (mut lo, mut hi) = (1, max_workers);
        let top = run(0, hi)?;
        if top.meets_slo {
            let mut best = top;
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                let c = run(0, mid)?;
                if c.meets_slo {
                    hi = mid;
                    best = c;
                } else {
                    lo = mid + 1;
                }
            }
            aggregated = Some(best);
        }
    }
    let mut disaggregated = None;
    if topologies != Topologies::Aggregated {
        // No more workers than the aggregated answer needs, when there is one: a bigger
        // split would not be the cheaper cluster.
        let limit = aggregated.as_ref().map_or(max_workers, Candidate::total);
        'totals: for total in 2..=limit.max(2).min(max_workers) {
            let mut best: Option<Candidate> = None;
            for prefill in 1..total {
                let c = run(prefill, total - prefill)?;
                let better = best.as_ref().is_none_or(|b| {
                    (c.slo_attainment, c.goodput_rps) > (b.slo_attainment, b.goodput_rps)
                });
                if c.meets_slo && better {
                    best = Some(c);
                }
            }
            if best.is_some() {
                disaggregated = best;
                break 'totals;
            }
        }
    }
    Ok(Plan {
        max_workers,
        aggregated,
        disaggregated,
        disagg_mode: base.routing.disagg.mode.name().to_string(),
        runs,
    })
}
