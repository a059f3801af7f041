//! Rate sweeps: the same workload at several rates (synthetic: requests per second; trace:
//! arrival speedups), the goodput curve, and the capacity: the highest rate whose SLO
//! attainment reaches [`tandem_workload::Slo::attainment`].

use serde::Serialize;

use crate::config::SimConfig;
use crate::error::SimError;
use crate::metrics::SimReport;

/// One rate of a sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepPoint {
    /// Requests per second (synthetic) or arrival speedup (trace).
    pub rate: f64,
    pub meets_slo: bool,
    pub report: SimReport,
}

/// A whole sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepReport {
    /// `requests_per_second` or `arrival_speedup`.
    pub rate_unit: &'static str,
    pub points: Vec<SweepPoint>,
    /// Highest rate meeting the SLO; None when none does.
    pub capacity: Option<f64>,
}

impl SweepReport {
    /// `(rate, goodput, throughput)` of every point, for
    /// [`tandem_workload::plot::goodput_vs_rate`].
    pub fn goodput_points(&self) -> Vec<(f64, f64, f64)> {
        self.points
            .iter()
            .map(|p| (p.rate, p.report.goodput_rps, p.report.throughput_rps))
            .collect()
    }

    /// The sweep's plots: each rate's TTFT CDF, and goodput against the rate.
    pub fn figures(&self) -> tandem_workload::plot::Figures<'_> {
        tandem_workload::plot::Figures {
            ttft_cdfs: self
                .points
                .iter()
                .map(|p| (format!("{}", p.rate), p.report.ttft_cdf_ms.as_slice()))
                .collect(),
            goodput: Some((self.rate_unit, self.goodput_points())),
        }
    }

    pub fn to_markdown(&self) -> String {
        let mut s = format!(
            "| {} | goodput req/s | SLO attainment | TTFT p90 ms | ITL p90 ms | prefix hit rate | meets SLO |\n|---:|---:|---:|---:|---:|---:|---|\n",
            self.rate_unit
        );
        for p in &self.points {
            let r = &p.report;
            s.push_str(&format!(
                "| {} | {:.2} | {:.1} % | {:.1} | {:.1} | {:.1} % | {} |\n",
                p.rate,
                r.goodput_rps,
                100.0 * r.slo_attainment,
                r.ttft_ms.p90,
                r.itl_ms.p90,
                100.0 * r.prefix_hit_rate,
                if p.meets_slo { "yes" } else { "no" }
            ));
        }
        match self.capacity {
            Some(c) => s.push_str(&format!("\ncapacity: {c} {}\n", self.rate_unit)),
            None => s.push_str("\ncapacity: no rate of the sweep meets the SLO\n"),
        }
        s
    }
}

/// Runs `config` once per rate, in the order given.
pub fn sweep(config: &SimConfig, rates: &[f64]) -> Result<SweepReport, SimError> {
    if rates.is_empty() {
        return Err(SimError::InvalidConfig(
            "--sweep-rate needs at least one rate".into(),
        ));
    }
    let rate_unit = config.workload.rate_unit();
    let mut points = Vec::with_capacity(rates.len());
    for &rate in rates {
        let mut cfg = config.clone();
        cfg.workload = config.workload.with_rate(rate);
        let report = crate::run(cfg)?;
        points.push(SweepPoint {
            rate,
            meets_slo: report.meets_slo(&config.slo),
            report,
        });
    }
    let capacity = points
        .iter()
        .filter(|p| p.meets_slo)
        .map(|p| p.rate)
        .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))));
    Ok(SweepReport {
        rate_unit,
        points,
        capacity,
    })
}
