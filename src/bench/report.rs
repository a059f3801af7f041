//! What a bench run measured: latency percentiles, throughput, goodput under the SLO, the
//! prefix-cache hit rate the endpoint reported; as Markdown and JSON.

use serde::Serialize;

use super::client::Record;

/// Latency SLO of one request.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Slo {
    /// A successful request within both bounds (TPOT counts only with two tokens or more).
    pub fn met_by(&self, r: &Record) -> bool {
        r.ok && r.ttft_ms.is_some_and(|t| t <= self.ttft_ms)
            && r.tpot_ms().is_none_or(|t| t <= self.tpot_ms)
    }
}

/// Percentiles of one latency, ms.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(mut values: Vec<f64>) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let q = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
        Percentiles {
            count: values.len(),
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            max: values[values.len() - 1],
        }
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
    /// Requests within the SLO per second.
    pub goodput: f64,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Every request, in send order.
    pub records: Vec<Record>,
}

impl BenchReport {
    pub fn new(url: &str, rate: f64, slo: Slo, mut records: Vec<Record>) -> BenchReport {
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
        let within = records.iter().filter(|r| slo.met_by(r)).count();
        BenchReport {
            url: url.to_string(),
            rate,
            salt: String::new(),
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
            slo_attainment: within as f64 / records.len().max(1) as f64,
            goodput: within as f64 / duration_s,
            ttft_ms: Percentiles::of(ok.iter().filter_map(|r| r.ttft_ms).collect()),
            tpot_ms: Percentiles::of(ok.iter().filter_map(|r| r.tpot_ms()).collect()),
            itl_ms: Percentiles::of(ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect()),
            e2e_ms: Percentiles::of(ok.iter().filter_map(|r| r.e2e_ms).collect()),
            records,
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
        for (why, n) in &self.failures {
            s.push_str(&format!("\nfailed ×{n}: {why}"));
        }
        if !self.failures.is_empty() {
            s.push('\n');
        }
        s
    }
}

/// Runs at several rates.
#[derive(Clone, Debug, Serialize)]
pub struct BenchSweep {
    pub points: Vec<BenchReport>,
}

impl BenchSweep {
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

    fn rec(sent: f64, ttft: f64, e2e: f64, tokens: u64, cached: u64) -> Record {
        Record {
            sent_ms: sent,
            ok: true,
            error: None,
            ttft_ms: Some(ttft),
            e2e_ms: Some(e2e),
            itl_ms: vec![(e2e - ttft) / (tokens - 1) as f64; tokens as usize - 1],
            prompt_tokens: 100,
            completion_tokens: tokens,
            cached_tokens: cached,
        }
    }

    #[test]
    fn a_report_counts_what_happened() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 10.0,
        };
        let failed = Record {
            sent_ms: 500.0,
            error: Some("HTTP 503: no decode worker".into()),
            ..Record::default()
        };
        let r = BenchReport::new(
            "http://x",
            2.0,
            slo,
            vec![
                rec(1000.0, 50.0, 140.0, 10, 50), // within: 10 ms/token
                failed,
                rec(0.0, 150.0, 240.0, 10, 0), // TTFT over
            ],
        );
        assert_eq!((r.requests, r.completed, r.failed), (3, 2, 1));
        assert_eq!(
            r.failures,
            vec![("HTTP 503: no decode worker".to_string(), 1)]
        );
        assert!((r.duration_s - 1.14).abs() < 1e-9, "{}", r.duration_s);
        assert!((r.cache_hit_rate - 0.25).abs() < 1e-9);
        assert!((r.slo_attainment - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(r.ttft_ms.p50, 150.0);
        assert_eq!(r.ttft_ms.count, 2);
        assert_eq!(r.records[0].sent_ms, 0.0, "in send order");
        assert!(r.to_markdown().contains("failed ×1: HTTP 503"));
    }

    #[test]
    fn percentiles_of_nothing_are_zero() {
        assert_eq!(Percentiles::of(vec![]).count, 0);
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p99, p.max), (51.0, 99.0, 100.0));
    }
}
