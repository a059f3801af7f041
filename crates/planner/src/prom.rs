//! The frontend's `/metrics` text, read back (the samples parsed by
//! `tandem_protocol::exposition`), and [`Scrape`], the figures the planner uses out of one
//! frontend's page: counters, cumulative histograms and their quantiles.
//! The tandem names are those of `crates/frontend/src/http/observe/metrics.rs` and
//! `crates/frontend/src/cluster/metrics.rs`.

use std::collections::BTreeMap;

use crate::Pool;
use crate::error::PlannerError;

pub use tandem_protocol::exposition::Sample;
use tandem_protocol::exposition::parse_value;

/// Every sample of a page, in order (tandem-protocol's exposition parser); the first
/// malformed line is an error.
pub fn parse(text: &str) -> Result<Vec<Sample>, PlannerError> {
    tandem_protocol::exposition::parse(text).map_err(|e| PlannerError::Metrics {
        line: e.line,
        why: e.why,
    })
}

/// A cumulative histogram: `(upper bound, observations ≤ bound)`, bounds ascending, the last
/// one `+Inf`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    fn from_samples<'a>(samples: impl Iterator<Item = &'a Sample>) -> Self {
        let mut buckets: Vec<(f64, f64)> = samples
            .filter_map(|s| Some((parse_value(s.label("le")?).ok()?, s.value)))
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram { buckets }
    }

    /// Observations in all.
    pub fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |b| b.1)
    }

    /// `self − earlier`, bucket by bucket: the observations in between. A histogram whose
    /// bounds changed or whose counts fell (the frontend restarted) is taken whole.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let same_bounds = self.buckets.len() == earlier.buckets.len()
            && self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .all(|(a, b)| a.0 == b.0 && a.1 >= b.1);
        if !same_bounds {
            return self.clone();
        }
        Histogram {
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(a, b)| (a.0, a.1 - b.1))
                .collect(),
        }
    }

    /// Adds `other`'s counts (same bounds; a histogram with other bounds is ignored).
    pub fn add(&mut self, other: &Histogram) {
        if self.buckets.is_empty() {
            self.buckets = other.buckets.clone();
        } else if self.buckets.len() == other.buckets.len()
            && self
                .buckets
                .iter()
                .zip(&other.buckets)
                .all(|(a, b)| a.0 == b.0)
        {
            for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
                a.1 += b.1;
            }
        }
    }

    /// The `q`-quantile (0–1), interpolated linearly inside its bucket as Prometheus'
    /// `histogram_quantile` does (the first bucket starts at 0; a rank in the `+Inf` bucket
    /// answers the highest finite bound). None without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(bound, cum) in &self.buckets {
            if cum >= rank && cum > below {
                if bound.is_infinite() {
                    return Some(lower);
                }
                return Some(lower + (bound - lower) * (rank - below) / (cum - below));
            }
            if bound.is_finite() {
                lower = bound;
            }
            below = cum;
        }
        Some(lower)
    }
}

/// What the planner reads from one frontend's `/metrics` at one instant (counters are
/// totals since the frontend started).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    /// `tandem_http_requests_total`, all endpoints: status 200, and any other status.
    pub requests_ok: f64,
    pub requests_failed: f64,
    /// `tandem_http_requests_in_flight`: arrivals = finished + the change of this.
    pub in_flight: f64,
    pub prompt_tokens: f64,
    pub completion_tokens: f64,
    pub cached_tokens: f64,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// `tandem_workers{role}`.
    pub prefill_workers: f64,
    pub decode_workers: f64,
    /// `tandem_worker_waiting_requests{worker,role}`, by `(role, worker)`.
    pub waiting: BTreeMap<(Pool, String), f64>,
    /// `tandem_frontend_queue_depth`, all bands.
    pub queue_depth: f64,
}

impl Scrape {
    pub fn from_text(text: &str) -> Result<Scrape, PlannerError> {
        Ok(Scrape::from_samples(&parse(text)?))
    }

    pub fn from_samples(samples: &[Sample]) -> Scrape {
        let mut s = Scrape {
            ttft: Histogram::from_samples(
                samples
                    .iter()
                    .filter(|x| x.name == "tandem_http_time_to_first_token_seconds_bucket"),
            ),
            itl: Histogram::from_samples(
                samples
                    .iter()
                    .filter(|x| x.name == "tandem_http_inter_token_latency_seconds_bucket"),
            ),
            ..Scrape::default()
        };
        for x in samples {
            let role = || x.label("role").and_then(Pool::from_role);
            match x.name.as_str() {
                "tandem_http_requests_total" => match x.label("status") {
                    Some("200") => s.requests_ok += x.value,
                    _ => s.requests_failed += x.value,
                },
                "tandem_http_requests_in_flight" => s.in_flight += x.value,
                "tandem_http_prompt_tokens_total" => s.prompt_tokens += x.value,
                "tandem_http_completion_tokens_total" => s.completion_tokens += x.value,
                "tandem_http_cached_tokens_total" => s.cached_tokens += x.value,
                "tandem_workers" => match role() {
                    Some(Pool::Prefill) => s.prefill_workers = x.value,
                    Some(Pool::Decode) => s.decode_workers = x.value,
                    None => {}
                },
                "tandem_worker_waiting_requests" => {
                    if let (Some(pool), Some(w)) = (role(), x.label("worker")) {
                        s.waiting.insert((pool, w.to_string()), x.value);
                    }
                }
                "tandem_frontend_queue_depth" => s.queue_depth += x.value,
                _ => {}
            }
        }
        s
    }

    pub fn workers(&self, pool: Pool) -> f64 {
        match pool {
            Pool::Prefill => self.prefill_workers,
            Pool::Decode => self.decode_workers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page as the frontend writes it (trimmed).
    const PAGE: &str = r#"# HELP tandem_workers Workers in discovery.
# TYPE tandem_workers gauge
tandem_workers{role="prefill"} 1
tandem_workers{role="decode"} 2
# TYPE tandem_worker_waiting_requests gauge
tandem_worker_waiting_requests{worker="1",role="prefill"} 3
tandem_worker_waiting_requests{worker="2",role="decode"} 0
tandem_frontend_queue_depth{band="interactive"} 1
tandem_frontend_queue_depth{band="standard"} 2
# TYPE tandem_http_requests counter
tandem_http_requests_total{endpoint="chat",status="200"} 10
tandem_http_requests_total{endpoint="completion",status="200"} 5
tandem_http_requests_total{endpoint="chat",status="429"} 2
tandem_http_requests_in_flight 6
tandem_http_time_to_first_token_seconds_sum 1.5
tandem_http_time_to_first_token_seconds_count 4
tandem_http_time_to_first_token_seconds_bucket{le="0.1"} 1
tandem_http_time_to_first_token_seconds_bucket{le="0.2"} 3
tandem_http_time_to_first_token_seconds_bucket{le="0.4"} 4
tandem_http_time_to_first_token_seconds_bucket{le="+Inf"} 4
tandem_http_prompt_tokens_total 1000
tandem_http_completion_tokens_total 300
tandem_http_cached_tokens_total 250
# EOF
"#;

    #[test]
    fn a_frontend_page_reads_back() {
        let s = Scrape::from_text(PAGE).unwrap();
        assert_eq!(
            (s.requests_ok, s.requests_failed, s.in_flight),
            (15.0, 2.0, 6.0)
        );
        assert_eq!(
            (s.prompt_tokens, s.completion_tokens, s.cached_tokens),
            (1000.0, 300.0, 250.0)
        );
        assert_eq!((s.prefill_workers, s.decode_workers), (1.0, 2.0));
        assert_eq!(s.waiting[&(Pool::Prefill, "1".to_string())], 3.0);
        assert_eq!(s.queue_depth, 3.0);
        assert_eq!(s.ttft.buckets.len(), 4);
        assert_eq!(s.ttft.count(), 4.0);
        assert!(s.itl.buckets.is_empty());
    }

    #[test]
    fn labels_with_escapes_timestamps_and_special_values() {
        let v =
            parse("m{a=\"x\\\"y\\\\z\\n\", b = \"2\",} +Inf 1700000000\nn -Inf\no NaN\n").unwrap();
        assert_eq!(v[0].label("a"), Some("x\"y\\z\n"));
        assert_eq!(v[0].label("b"), Some("2"));
        assert_eq!(v[0].value, f64::INFINITY);
        assert_eq!(v[1].value, f64::NEG_INFINITY);
        assert!(v[2].value.is_nan());
        assert!(parse("m{a=\"x} 1").is_err());
        assert!(parse("m 1x").is_err());
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket() {
        let h = Scrape::from_text(PAGE).unwrap().ttft;
        // 4 observations: 1 ≤ 0.1, 2 in (0.1, 0.2], 1 in (0.2, 0.4].
        // p50: rank 2, in the second bucket, half of its 2 → 0.1 + 0.1 × (2 − 1) / 2 = 0.15.
        assert!((h.quantile(0.5).unwrap() - 0.15).abs() < 1e-12);
        // p25: rank 1, the whole first bucket → 0.1; p100 → 0.4.
        assert!((h.quantile(0.25).unwrap() - 0.1).abs() < 1e-12);
        assert!((h.quantile(1.0).unwrap() - 0.4).abs() < 1e-12);
        assert_eq!(Histogram::default().quantile(0.5), None);
        // A rank that lands in +Inf answers the highest finite bound.
        let tail = Histogram {
            buckets: vec![(0.1, 1.0), (f64::INFINITY, 3.0)],
        };
        assert_eq!(tail.quantile(0.9), Some(0.1));
    }

    #[test]
    fn deltas_between_scrapes_and_resets() {
        let a = Histogram {
            buckets: vec![(0.1, 1.0), (0.2, 3.0), (f64::INFINITY, 3.0)],
        };
        let b = Histogram {
            buckets: vec![(0.1, 1.0), (0.2, 5.0), (f64::INFINITY, 6.0)],
        };
        let d = b.since(&a);
        assert_eq!(
            d.buckets,
            vec![(0.1, 0.0), (0.2, 2.0), (f64::INFINITY, 3.0)]
        );
        // Counts that fell: a restart; the new totals are the delta.
        assert_eq!(a.since(&b), a);
        let mut sum = d.clone();
        sum.add(&d);
        assert_eq!(sum.count(), 6.0);
    }
}
