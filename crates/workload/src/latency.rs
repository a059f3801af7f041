//! [`LatencyHistogram`]: latency samples in bounded memory, and the [`LatencySummary`] of
//! them that every report prints (`tandem sim`, `tandem bench`, the crates' benches).
//!
//! Samples go into an HdrHistogram (the `hdrhistogram` crate) at 3 significant digits, in
//! integer ticks of the chosen [`Resolution`] (µs by default): below 2,048 ticks every value
//! has its own bucket, above it a bucket spans at most 1/1,024 of its values. So a histogram
//! is a few tens of KB however many samples it holds, and a percentile is within 0.1 % of the
//! exact one. Count, mean, min and max are kept exactly beside it (the mean by compensated
//! summation: its rounding error stays near one ulp, whatever the number and order of the
//! samples).
//!
//! Percentiles are nearest-rank: the value at rank `⌈q·n⌉` (at least 1) of the sorted
//! samples, reported as the highest value of its bucket (an upper bound, as HdrHistogram
//! reports it), then clamped into `[min, max]`, so `p100` is the exact max.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Significant decimal digits the histogram keeps (HdrHistogram's precision setting).
const SIGFIG: u8 = 3;

/// The smallest time step a histogram tells apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Resolution {
    /// 1 µs: request latencies (TTFT, ITL, E2E, transfers).
    #[default]
    Micros,
    /// 1 ns: sub-microsecond operations (index look-ups, routing decisions).
    Nanos,
}

impl Resolution {
    fn ticks_per_ms(self) -> f64 {
        match self {
            Resolution::Micros => 1e3,
            Resolution::Nanos => 1e6,
        }
    }
}

/// Latency samples: an HdrHistogram for the percentiles, exact count, mean, min and max.
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    /// None only where hdrhistogram cannot be built (a `usize` too small for its index,
    /// under 32 bits); then percentiles fall back to the exact max.
    hist: Option<Histogram<u64>>,
    resolution: Resolution,
    ticks_per_ms: f64,
    count: u64,
    sum: CompensatedSum,
    min_ms: f64,
    max_ms: f64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram::new(Resolution::Micros)
    }
}

impl LatencyHistogram {
    /// An empty histogram at this resolution.
    pub fn new(resolution: Resolution) -> Self {
        LatencyHistogram {
            // Auto-resizing: any value up to u64::MAX ticks can be recorded.
            hist: Histogram::new(SIGFIG).ok(),
            resolution,
            ticks_per_ms: resolution.ticks_per_ms(),
            count: 0,
            sum: CompensatedSum::default(),
            min_ms: f64::INFINITY,
            max_ms: 0.0,
        }
    }

    /// Records one sample in ms. Negative or NaN samples count as 0; the histogram holds the
    /// sample rounded to the resolution, count, mean, min and max the sample itself.
    pub fn record_ms(&mut self, ms: f64) {
        let ms = if ms > 0.0 { ms } else { 0.0 };
        // `as` saturates: a sample beyond u64::MAX ticks is recorded as u64::MAX.
        self.record(ms, (ms * self.ticks_per_ms).round() as u64);
    }

    /// Records one sample of a whole number of µs (exact at [`Resolution::Micros`]).
    pub fn record_us(&mut self, us: u64) {
        let ticks = match self.resolution {
            Resolution::Micros => us,
            Resolution::Nanos => us.saturating_mul(1000),
        };
        self.record(us as f64 / 1000.0, ticks);
    }

    /// Records one sample.
    pub fn record_duration(&mut self, d: Duration) {
        self.record_ms(d.as_secs_f64() * 1e3);
    }

    fn record(&mut self, ms: f64, ticks: u64) {
        if let Some(h) = &mut self.hist
            && h.record(ticks).is_err()
        {
            // Only when the histogram cannot grow to `ticks`: keep it at the top.
            h.saturating_record(ticks);
        }
        self.count += 1;
        self.sum.add(ms);
        self.min_ms = self.min_ms.min(ms);
        self.max_ms = self.max_ms.max(ms);
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Exact mean, ms; 0 for none.
    pub fn mean_ms(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum.total() / self.count as f64
        }
    }

    /// Exact max, ms; 0 for none.
    pub fn max_ms(&self) -> f64 {
        self.max_ms
    }

    /// Exact min, ms; 0 for none.
    pub fn min_ms(&self) -> f64 {
        if self.count == 0 { 0.0 } else { self.min_ms }
    }

    /// The nearest-rank `q` quantile (`q` in [0, 1]), ms, within 0.1 % (see the module docs);
    /// 0 for none.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let Some(h) = &self.hist else {
            return self.max_ms;
        };
        let v = h.value_at_quantile(q) as f64 / self.ticks_per_ms;
        v.max(self.min_ms()).min(self.max_ms)
    }

    /// The value at each percent 0, 1, …, 100 (the CDF, for plots); empty for none.
    pub fn cdf_ms(&self) -> Vec<f64> {
        if self.count == 0 {
            return Vec::new();
        }
        (0..=100)
            .map(|p| self.quantile_ms(f64::from(p) / 100.0))
            .collect()
    }

    /// The figures every report prints.
    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count,
            mean: self.mean_ms(),
            p50: self.quantile_ms(0.50),
            p90: self.quantile_ms(0.90),
            p95: self.quantile_ms(0.95),
            p99: self.quantile_ms(0.99),
            max: self.max_ms,
        }
    }
}

impl FromIterator<f64> for LatencyHistogram {
    /// A µs-resolution histogram of samples in ms.
    fn from_iter<I: IntoIterator<Item = f64>>(samples: I) -> Self {
        let mut h = LatencyHistogram::default();
        for ms in samples {
            h.record_ms(ms);
        }
        h
    }
}

/// Count, mean, p50, p90, p95, p99 and max of one latency, in ms (all 0 for no samples).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl LatencySummary {
    /// Every figure but the count multiplied by `factor` (e.g. 1000 for µs).
    pub fn scaled(self, factor: f64) -> LatencySummary {
        LatencySummary {
            count: self.count,
            mean: self.mean * factor,
            p50: self.p50 * factor,
            p90: self.p90 * factor,
            p95: self.p95 * factor,
            p99: self.p99 * factor,
            max: self.max * factor,
        }
    }
}

/// Neumaier's compensated sum: error near one ulp of the total instead of growing with the
/// number of terms.
#[derive(Clone, Copy, Debug, Default)]
struct CompensatedSum {
    sum: f64,
    compensation: f64,
}

impl CompensatedSum {
    fn add(&mut self, x: f64) {
        let t = self.sum + x;
        self.compensation += if self.sum.abs() >= x.abs() {
            (self.sum - t) + x
        } else {
            (x - t) + self.sum
        };
        self.sum = t;
    }

    fn total(&self) -> f64 {
        self.sum + self.compensation
    }
}

#[cfg(test)]
mod tests {
    use tandem_protocol::Rng;

    use super::*;

    /// Exact nearest-rank percentile of sorted samples (what the histogram approximates).
    fn exact(sorted: &[f64], q: f64) -> f64 {
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        sorted[rank - 1]
    }

    #[test]
    fn nearest_rank_on_small_samples_is_exact() {
        // Below 2,048 µs every µs has its own bucket.
        let h: LatencyHistogram = [0.5, 0.1, 0.4, 0.2, 0.3].into_iter().collect();
        let s = h.summary();
        assert_eq!((s.count, s.p50, s.p90, s.max), (5, 0.3, 0.5, 0.5));
        assert!((s.mean - 0.3).abs() < 1e-15);
        assert_eq!(h.min_ms(), 0.1);
        // Above, a percentile is the top of its bucket: 3,000 µs shares one with 3,001.
        let h: LatencyHistogram = [5.0, 1.0, 4.0, 2.0, 3.0].into_iter().collect();
        let s = h.summary();
        assert_eq!(
            (s.count, s.p50, s.p90, s.max, s.mean),
            (5, 3.001, 5.0, 5.0, 3.0)
        );
        let mut h = LatencyHistogram::default();
        for us in 1..=100 {
            h.record_us(us);
        }
        assert_eq!((h.quantile_ms(0.5), h.quantile_ms(0.99)), (0.05, 0.099));
        let cdf = h.cdf_ms();
        assert_eq!((cdf.len(), cdf[0], cdf[100]), (101, 0.001, 0.1));
    }

    #[test]
    fn nothing_recorded_is_all_zero() {
        let h = LatencyHistogram::default();
        assert!(h.is_empty());
        assert_eq!(h.summary(), LatencySummary::default());
        assert_eq!((h.min_ms(), h.quantile_ms(0.5)), (0.0, 0.0));
        assert!(h.cdf_ms().is_empty());
    }

    #[test]
    fn percentiles_are_within_a_thousandth_and_the_rest_is_exact() {
        let mut rng = Rng::seed_from_u64(3);
        let mut h = LatencyHistogram::default();
        let mut xs = Vec::new();
        for _ in 0..50_000 {
            // Log-uniform over 10 µs … 100 s, µs resolution.
            let us = (10.0 * 1e7f64.powf(rng.unit_f64())).round() as u64;
            h.record_us(us);
            xs.push(us as f64 / 1000.0);
        }
        xs.sort_by(f64::total_cmp);
        for p in 0..=100 {
            let q = f64::from(p) / 100.0;
            let (got, want) = (h.quantile_ms(q), exact(&xs, q));
            assert!(got >= want && got <= want * 1.001, "p{p}: {got} vs {want}");
        }
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((h.mean_ms() - mean).abs() <= 1e-12 * mean);
        assert_eq!((h.max_ms(), h.min_ms()), (xs[xs.len() - 1], xs[0]));
        assert_eq!(h.count(), 50_000);
    }

    #[test]
    fn nanosecond_resolution_tells_sub_microsecond_samples_apart() {
        let mut h = LatencyHistogram::new(Resolution::Nanos);
        for ns in [250u64, 500, 750, 1000] {
            h.record_duration(Duration::from_nanos(ns));
        }
        let us = h.summary().scaled(1000.0);
        assert!((us.p50 - 0.5).abs() < 1e-9, "{us:?}");
        assert!((us.max - 1.0).abs() < 1e-9);
        let mut coarse = LatencyHistogram::new(Resolution::Micros);
        coarse.record_ms(0.0004);
        assert_eq!(
            coarse.quantile_ms(0.5),
            0.0004,
            "clamped to the exact min and max"
        );
    }

    #[test]
    fn odd_samples_do_not_panic() {
        let mut h = LatencyHistogram::default();
        for ms in [f64::NAN, -1.0, f64::INFINITY, 1e300, 0.0] {
            h.record_ms(ms);
        }
        assert_eq!(h.count(), 5);
        assert!(h.quantile_ms(0.5) >= 0.0);
    }
}
