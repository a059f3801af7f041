//! What a bench run measured: latency percentiles, throughput, goodput under the SLO, the
//! prefix-cache hit rate the endpoint reported; as Markdown and JSON.
//!
//! A [`Collector`] takes each request as it ends: its latencies go into histograms (bounded
//! memory, however long the run) and its [`Record`], without its inter-token gaps, is kept
//! for the report's `records`.

use serde::Serialize;
use tandem_workload::{LatencyHistogram, LatencySummary, Slo};

use crate::client::{Record, Timed};

/// The requests of one rate, as they end.
#[derive(Debug, Default)]
pub(crate) struct Collector {
    records: Vec<Record>,
    ttft: LatencyHistogram,
    tpot: LatencyHistogram,
    itl: LatencyHistogram,
    e2e: LatencyHistogram,
}

impl Collector {
    /// Takes one finished request (failed ones only count, they have no latencies).
    pub(crate) fn add(&mut self, t: Timed) {
        let r = t.record;
        if r.ok {
            r.ttft_ms.into_iter().for_each(|v| self.ttft.record_ms(v));
            r.tpot_ms().into_iter().for_each(|v| self.tpot.record_ms(v));
            r.e2e_ms.into_iter().for_each(|v| self.e2e.record_ms(v));
            t.itl_ms.into_iter().for_each(|v| self.itl.record_ms(v));
        }
        self.records.push(r);
    }
}

/// One run at one offered rate.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub url: String,
    /// Requests per second offered (synthetic), or the trace's arrival speedup.
    pub rate: f64,
    /// What every prompt of the run started with (`--salt`).
    pub salt: String,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// The first few distinct failure reasons with their counts.
    pub failures: Vec<(String, usize)>,
    /// From the first send to the last response's end.
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    /// Cached prompt tokens / prompt tokens, as the endpoint reported them.
    pub cache_hit_rate: f64,
    pub slo: Slo,
    /// Requests within the SLO.
    pub slo_attainment: f64,
    /// Whether `slo_attainment` reaches the SLO's attainment.
    pub meets_slo: bool,
    /// Requests within the SLO per second.
    pub goodput: f64,
    /// Nearest-rank percentiles within 0.1 % (`tandem_workload::LatencyHistogram`); count,
    /// mean and max exact. TPOT counts requests with two tokens or more; ITL is every gap
    /// between two chunks with text.
    pub ttft_ms: LatencySummary,
    pub tpot_ms: LatencySummary,
    pub itl_ms: LatencySummary,
    pub e2e_ms: LatencySummary,
    /// TTFT at each percent 0, 1, …, 100 (the CDF, for plots).
    pub ttft_cdf_ms: Vec<f64>,
    /// Every request, in send order.
    pub records: Vec<Record>,
    /// Where the endpoint ran an A/B experiment (`x-tandem-experiment` on its answers): each
    /// arm's requests side by side, in the arms' order. Empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub arms: Vec<BenchArm>,
}

/// One experiment arm's requests, as the endpoint placed them.
#[derive(Clone, Debug, Serialize)]
pub struct BenchArm {
    /// As the endpoint named it: `EXPERIMENT/ARM`.
    pub arm: String,
    pub requests: usize,
    pub completed: usize,
    pub ttft_ms: LatencySummary,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub cache_hit_rate: f64,
    pub slo_attainment: f64,
    /// Its requests within the SLO per second of the whole run.
    pub goodput: f64,
}

/// The arms of `records` (those that name one), over a run of `duration_s`.
fn arms_of(records: &[Record], slo: &Slo, duration_s: f64) -> Vec<BenchArm> {
    let mut names: Vec<&str> = records.iter().filter_map(|r| r.arm.as_deref()).collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|name| {
            let mine: Vec<&Record> = records
                .iter()
                .filter(|r| r.arm.as_deref() == Some(name))
                .collect();
            let mut ttft = LatencyHistogram::default();
            let ok: Vec<&&Record> = mine.iter().filter(|r| r.ok).collect();
            ok.iter()
                .filter_map(|r| r.ttft_ms)
                .for_each(|t| ttft.record_ms(t));
            let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
            let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
            let within = mine.iter().filter(|r| met_by(slo, r)).count();
            BenchArm {
                arm: name.to_string(),
                requests: mine.len(),
                completed: ok.len(),
                ttft_ms: ttft.summary(),
                prompt_tokens: prompt,
                cached_tokens: cached,
                cache_hit_rate: cached as f64 / prompt.max(1) as f64,
                slo_attainment: within as f64 / mine.len().max(1) as f64,
                goodput: within as f64 / duration_s,
            }
        })
        .collect()
}

impl BenchReport {
    /// The report of the requests `c` took at `rate`.
    pub(crate) fn new(url: &str, rate: f64, slo: Slo, salt: String, c: Collector) -> BenchReport {
        let mut records = c.records;
        records.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
        let ok: Vec<&Record> = records.iter().filter(|r| r.ok).collect();
        let end_ms = records
            .iter()
            .map(|r| r.sent_ms + r.e2e_ms.unwrap_or(0.0))
            .fold(0.0, f64::max);
        let start_ms = records.first().map_or(0.0, |r| r.sent_ms);
        let duration_s = ((end_ms - start_ms) / 1000.0).max(1e-9);
        let sum = |f: fn(&Record) -> u64| ok.iter().map(|r| f(r)).sum::<u64>();
        let (prompt, completion, cached) = (
            sum(|r| r.prompt_tokens),
            sum(|r| r.completion_tokens),
            sum(|r| r.cached_tokens),
        );
        let mut failures: Vec<(String, usize)> = Vec::new();
        for e in records.iter().filter_map(|r| r.error.as_ref()) {
            if let Some((_, n)) = failures.iter_mut().find(|(m, _)| m == e) {
                *n += 1;
            } else if failures.len() < 5 {
                failures.push((e.clone(), 1));
            }
        }
        let within = records.iter().filter(|r| met_by(&slo, r)).count();
        let arms = arms_of(&records, &slo, duration_s);
        let slo_attainment = within as f64 / records.len().max(1) as f64;
        BenchReport {
            url: url.to_string(),
            rate,
            salt,
            requests: records.len(),
            completed: ok.len(),
            failed: records.len() - ok.len(),
            failures,
            duration_s,
            request_throughput: ok.len() as f64 / duration_s,
            output_token_throughput: completion as f64 / duration_s,
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: cached,
            cache_hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            slo,
            slo_attainment,
            meets_slo: slo.attained(slo_attainment),
            goodput: within as f64 / duration_s,
            ttft_ms: c.ttft.summary(),
            tpot_ms: c.tpot.summary(),
            itl_ms: c.itl.summary(),
            e2e_ms: c.e2e.summary(),
            ttft_cdf_ms: c.ttft.cdf_ms(),
            records,
            arms,
        }
    }

    pub fn to_markdown(&self) -> String {
        let mut s = format!(
            "## tandem bench: {} at {} ({} requests)\n\n\
             | | |\n|---|---:|\n\
             | completed / failed | {} / {} |\n\
             | duration | {:.2} s |\n\
             | request throughput | {:.2} req/s |\n\
             | output token throughput | {:.1} tok/s |\n\
             | prompt / completion tokens | {} / {} |\n\
             | prefix-cache hit rate | {:.1} % |\n\
             | SLO (TTFT ≤ {} ms, TPOT ≤ {} ms) attainment | {:.1} % |\n\
             | goodput | {:.2} req/s |\n\n\
             | ms | mean | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|---:|\n",
            self.url,
            self.rate,
            self.requests,
            self.completed,
            self.failed,
            self.duration_s,
            self.request_throughput,
            self.output_token_throughput,
            self.prompt_tokens,
            self.completion_tokens,
            100.0 * self.cache_hit_rate,
            self.slo.ttft_ms,
            self.slo.tpot_ms,
            100.0 * self.slo_attainment,
            self.goodput,
        );
        for (name, p) in [
            ("TTFT", &self.ttft_ms),
            ("TPOT", &self.tpot_ms),
            ("ITL", &self.itl_ms),
            ("E2E", &self.e2e_ms),
        ] {
            s.push_str(&format!(
                "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                p.mean, p.p50, p.p90, p.p99, p.max
            ));
        }
        if !self.arms.is_empty() {
            s.push_str(
                "\n| arm | requests | TTFT p50 | TTFT p99 | hit % | SLO % | goodput |\n\
                 |---|---:|---:|---:|---:|---:|---:|\n",
            );
            for a in &self.arms {
                s.push_str(&format!(
                    "| {} | {}/{} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |\n",
                    a.arm,
                    a.completed,
                    a.requests,
                    a.ttft_ms.p50,
                    a.ttft_ms.p99,
                    100.0 * a.cache_hit_rate,
                    100.0 * a.slo_attainment,
                    a.goodput
                ));
            }
        }
        for (why, n) in &self.failures {
            s.push_str(&format!("\nfailed ×{n}: {why}"));
        }
        if !self.failures.is_empty() {
            s.push('\n');
        }
        s
    }
}

/// A successful request within both bounds (TPOT counts only with two tokens or more).
fn met_by(slo: &Slo, r: &Record) -> bool {
    r.ok && r.ttft_ms.is_some_and(|t| slo.met(t, r.tpot_ms()))
}

/// Runs at several rates.
#[derive(Clone, Debug, Serialize)]
pub struct BenchSweep {
    pub points: Vec<BenchReport>,
}

impl BenchSweep {
    /// `(rate, goodput, throughput)` of every point, for
    /// [`tandem_workload::plot::goodput_vs_rate`].
    /// The run's plots: each rate's TTFT CDF, and goodput against the offered rate when more
    /// than one rate ran.
    pub fn figures(&self) -> tandem_workload::plot::Figures<'_> {
        tandem_workload::plot::Figures {
            ttft_cdfs: self
                .points
                .iter()
                .map(|p| (format!("rate {}", p.rate), p.ttft_cdf_ms.as_slice()))
                .collect(),
            goodput: (self.points.len() > 1).then(|| ("offered rate", self.goodput_points())),
        }
    }

    pub fn goodput_points(&self) -> Vec<(f64, f64, f64)> {
        self.points
            .iter()
            .map(|p| (p.rate, p.goodput, p.request_throughput))
            .collect()
    }

    pub fn to_markdown(&self) -> String {
        let mut s = String::from(
            "| rate | completed | req/s | goodput | SLO % | TTFT p50 | TTFT p99 | TPOT p50 | \
             TPOT p99 | hit % |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for p in &self.points {
            s.push_str(&format!(
                "| {} | {}/{} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                p.rate,
                p.completed,
                p.requests,
                p.request_throughput,
                p.goodput,
                100.0 * p.slo_attainment,
                p.ttft_ms.p50,
                p.ttft_ms.p99,
                p.tpot_ms.p50,
                p.tpot_ms.p99,
                100.0 * p.cache_hit_rate,
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(sent: f64, ttft: f64, e2e: f64, tokens: u64, cached: u64) -> Timed {
        Timed {
            record: Record {
                sent_ms: sent,
                ok: true,
                error: None,
                ttft_ms: Some(ttft),
                e2e_ms: Some(e2e),
                prompt_tokens: 100,
                completion_tokens: tokens,
                cached_tokens: cached,
                arm: None,
            },
            itl_ms: vec![(e2e - ttft) / (tokens - 1) as f64; tokens as usize - 1],
        }
    }

    #[test]
    fn a_report_counts_what_happened() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 10.0,
            attainment: 0.3,
        };
        let failed = Record {
            sent_ms: 500.0,
            error: Some("HTTP 503: no decode worker".into()),
            ..Record::default()
        };
        let mut c = Collector::default();
        c.add(rec(1000.0, 50.0, 140.0, 10, 50)); // within: 10 ms/token
        c.add(failed.into());
        c.add(rec(0.0, 150.0, 240.0, 10, 0)); // TTFT over
        let r = BenchReport::new("http://x", 2.0, slo, "s-0".into(), c);
        assert_eq!((r.requests, r.completed, r.failed), (3, 2, 1));
        assert_eq!(
            r.failures,
            vec![("HTTP 503: no decode worker".to_string(), 1)]
        );
        assert!((r.duration_s - 1.14).abs() < 1e-9, "{}", r.duration_s);
        assert!((r.cache_hit_rate - 0.25).abs() < 1e-9);
        assert!((r.slo_attainment - 1.0 / 3.0).abs() < 1e-9);
        assert!(r.meets_slo);
        // Nearest rank: the median of two is the lower (within the histogram's 0.1 %).
        assert!((r.ttft_ms.p50 - 50.0).abs() <= 0.05, "{:?}", r.ttft_ms);
        assert_eq!(r.ttft_ms.max, 150.0);
        assert_eq!(r.ttft_ms.count, 2);
        assert_eq!(r.itl_ms.count, 18);
        assert!((r.itl_ms.mean - 10.0).abs() < 1e-9);
        assert_eq!(r.ttft_cdf_ms.len(), 101);
        assert_eq!(r.records[0].sent_ms, 0.0, "in send order");
        assert_eq!(r.salt, "s-0");
        assert!(r.to_markdown().contains("failed ×1: HTTP 503"));
        let sweep = BenchSweep { points: vec![r] };
        assert_eq!(sweep.goodput_points().len(), 1);
        assert!(sweep.to_markdown().contains("| 2 | 2/3 |"));
        assert!(sweep.points[0].arms.is_empty());
        let json = serde_json::to_string(&sweep.points[0]).unwrap();
        assert!(
            !json.contains("\"arm"),
            "no experiment, no arm keys: {json}"
        );
    }

    #[test]
    fn an_experiments_arms_are_reported_side_by_side() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 10.0,
            attainment: 0.5,
        };
        let arm = |t: Timed, arm: &str| Timed {
            record: Record {
                arm: Some(arm.into()),
                ..t.record
            },
            ..t
        };
        let mut c = Collector::default();
        c.add(arm(rec(0.0, 50.0, 140.0, 10, 80), "softer/a"));
        c.add(arm(rec(100.0, 60.0, 150.0, 10, 60), "softer/a"));
        c.add(arm(rec(200.0, 150.0, 240.0, 10, 0), "softer/b"));
        c.add(Timed::from(Record {
            sent_ms: 300.0,
            error: Some("HTTP 500".into()),
            arm: Some("softer/b".into()),
            ..Record::default()
        }));
        let r = BenchReport::new("http://x", 2.0, slo, "s".into(), c);
        let names: Vec<&str> = r.arms.iter().map(|a| a.arm.as_str()).collect();
        assert_eq!(names, ["softer/a", "softer/b"]);
        let (a, b) = (&r.arms[0], &r.arms[1]);
        assert_eq!(
            (a.requests, a.completed, b.requests, b.completed),
            (2, 2, 2, 1)
        );
        assert!((a.cache_hit_rate - 0.7).abs() < 1e-9);
        assert_eq!(b.cache_hit_rate, 0.0);
        assert_eq!((a.slo_attainment, b.slo_attainment), (1.0, 0.0));
        assert!((a.goodput - 2.0 / r.duration_s).abs() < 1e-9);
        assert!(r.to_markdown().contains("| softer/a | 2/2 |"));
    }

    #[test]
    fn one_token_requests_are_judged_on_ttft_alone() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 1.0,
            attainment: 1.0,
        };
        let one = Record {
            ok: true,
            ttft_ms: Some(20.0),
            e2e_ms: Some(20.0),
            completion_tokens: 1,
            ..Record::default()
        };
        assert!(met_by(&slo, &one));
        assert!(!met_by(&slo, &Record { ok: false, ..one }));
    }
}
