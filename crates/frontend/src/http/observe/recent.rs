//! The last minute of latency, for the status page ([`RecentLatency`]): time to first token
//! and inter-token latency in a ring of [`SLOTS`] slots of [`SLOT`] each, one HDR histogram
//! per slot and metric (microseconds, two significant digits). A slot older than the window
//! is cleared when its place in the ring comes round again, so memory is fixed (about 24
//! histograms of ~12 KiB) whatever the traffic.
//!
//! The Prometheus histograms in `metrics.rs` are cumulative since start; this window is what
//! "now" looks like. The clock is injectable (`*_at` variants) so tests are deterministic.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use serde::Serialize;

/// The width of one slot.
pub const SLOT: Duration = Duration::from_secs(5);
/// Slots in the window: 12 × 5 s = the last minute.
pub const SLOTS: usize = 12;
/// Recorded values are clamped to this (µs): 10 minutes.
const MAX_US: u64 = 600_000_000;

/// A rolling last-minute window of TTFT and ITL. Cheap to share (`Arc`), safe to record from
/// any thread.
#[derive(Debug)]
pub struct RecentLatency {
    start: Instant,
    ring: Mutex<Ring>,
}

#[derive(Debug)]
struct Ring {
    slots: Vec<Slot>,
}

#[derive(Debug)]
struct Slot {
    /// The slot number (time since `start` / [`SLOT`]) this slot holds, or `None` if unused.
    epoch: Option<u64>,
    ttft: Histogram<u32>,
    itl: Histogram<u32>,
}

fn new_histogram() -> Histogram<u32> {
    // 1 µs .. 10 min at two significant digits: constant, valid bounds (low ≥ 1, high ≥ 2 ×
    // low, sigfig ≤ 5), the only way `new_with_bounds` fails.
    Histogram::new_with_bounds(1, MAX_US, 2).expect("constant histogram bounds are valid")
}

#[derive(Clone, Copy)]
enum Metric {
    Ttft,
    Itl,
}

impl Slot {
    fn hist(&mut self, m: Metric) -> &mut Histogram<u32> {
        match m {
            Metric::Ttft => &mut self.ttft,
            Metric::Itl => &mut self.itl,
        }
    }
}

/// Percentiles of one metric over some span, in milliseconds; `None` without samples.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// One slot of the window, for a sparkline point.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SlotPoint {
    /// How long ago the slot started, in seconds (the newest slot is `0`).
    pub age_s: u64,
    pub ttft: Percentiles,
    pub itl: Percentiles,
}

/// The window as the status page shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatencySnapshot {
    /// The window's length in seconds.
    pub window_s: u64,
    /// One slot's length in seconds.
    pub slot_s: u64,
    /// Over the whole window.
    pub ttft: Percentiles,
    pub itl: Percentiles,
    /// [`SLOTS`] points, oldest first, the current (partial) slot last; empty slots have
    /// `count: 0`.
    pub slots: Vec<SlotPoint>,
}

fn percentiles(h: &Histogram<u32>) -> Percentiles {
    let count = h.len();
    if count == 0 {
        return Percentiles::default();
    }
    let ms = |q: f64| Some(h.value_at_quantile(q) as f64 / 1000.0);
    Percentiles {
        count,
        p50_ms: ms(0.5),
        p90_ms: ms(0.9),
        p99_ms: ms(0.99),
    }
}

impl Default for RecentLatency {
    fn default() -> Self {
        Self::new()
    }
}

impl RecentLatency {
    /// An empty window starting now.
    pub fn new() -> Self {
        Self::starting_at(Instant::now())
    }

    /// An empty window whose slot boundaries count from `start` (tests).
    pub fn starting_at(start: Instant) -> Self {
        let slots = (0..SLOTS)
            .map(|_| Slot {
                epoch: None,
                ttft: new_histogram(),
                itl: new_histogram(),
            })
            .collect();
        RecentLatency {
            start,
            ring: Mutex::new(Ring { slots }),
        }
    }

    /// Records a time to first token now.
    pub fn record_ttft(&self, d: Duration) {
        self.record_ttft_at(Instant::now(), d);
    }

    /// Records an inter-token latency now.
    pub fn record_itl(&self, d: Duration) {
        self.record_itl_at(Instant::now(), d);
    }

    /// Records a time to first token observed at `now`.
    pub fn record_ttft_at(&self, now: Instant, d: Duration) {
        self.record(now, Metric::Ttft, d);
    }

    /// Records an inter-token latency observed at `now`.
    pub fn record_itl_at(&self, now: Instant, d: Duration) {
        self.record(now, Metric::Itl, d);
    }

    /// The last minute as of now.
    pub fn snapshot(&self) -> LatencySnapshot {
        self.snapshot_at(Instant::now())
    }

    fn epoch(&self, now: Instant) -> u64 {
        // An instant before `start` (a caller's clock) counts as slot 0.
        let since = now.saturating_duration_since(self.start);
        (since.as_nanos() / SLOT.as_nanos()) as u64
    }

    fn record(&self, now: Instant, m: Metric, d: Duration) {
        let epoch = self.epoch(now);
        let us = u64::try_from(d.as_micros())
            .unwrap_or(MAX_US)
            .clamp(1, MAX_US);
        let mut ring = self.ring.lock();
        let slot = &mut ring.slots[(epoch % SLOTS as u64) as usize];
        match slot.epoch {
            Some(e) if e == epoch => {}
            // A sample older than what this place holds (a caller's late clock): drop it
            // rather than mix it into a newer slot.
            Some(e) if e > epoch => return,
            _ => {
                slot.ttft.reset();
                slot.itl.reset();
                slot.epoch = Some(epoch);
            }
        }
        // Clamped into the bounds above, so this cannot fail; a failure would only lose one
        // sample.
        let _ = slot.hist(m).record(us);
    }

    /// The last minute as of `now`: slots `now`'s slot − 11 ..= `now`'s slot.
    pub fn snapshot_at(&self, now: Instant) -> LatencySnapshot {
        let current = self.epoch(now);
        let mut all_ttft = new_histogram();
        let mut all_itl = new_histogram();
        let mut points = Vec::with_capacity(SLOTS);
        let ring = self.ring.lock();
        for back in (0..SLOTS as u64).rev() {
            let age_s = back * SLOT.as_secs();
            let (ttft, itl) = match current.checked_sub(back) {
                Some(epoch) => {
                    let slot = &ring.slots[(epoch % SLOTS as u64) as usize];
                    if slot.epoch == Some(epoch) {
                        // Same bounds on both sides: `add` cannot fail.
                        let _ = all_ttft.add(&slot.ttft);
                        let _ = all_itl.add(&slot.itl);
                        (percentiles(&slot.ttft), percentiles(&slot.itl))
                    } else {
                        Default::default()
                    }
                }
                None => Default::default(),
            };
            points.push(SlotPoint { age_s, ttft, itl });
        }
        drop(ring);
        LatencySnapshot {
            window_s: SLOT.as_secs() * SLOTS as u64,
            slot_s: SLOT.as_secs(),
            ttft: percentiles(&all_ttft),
            itl: percentiles(&all_itl),
            slots: points,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Within 1% (two significant digits).
    fn close(got: Option<f64>, want: f64) -> bool {
        got.is_some_and(|g| (g - want).abs() <= want * 0.01 + 0.001)
    }

    #[test]
    fn empty_window_has_no_percentiles() {
        let t0 = Instant::now();
        let r = RecentLatency::starting_at(t0);
        let s = r.snapshot_at(t0 + Duration::from_secs(100));
        assert_eq!(s.ttft, Percentiles::default());
        assert_eq!(s.itl.count, 0);
        assert_eq!(s.slots.len(), SLOTS);
        assert_eq!(s.window_s, 60);
        assert_eq!(s.slots.first().map(|p| p.age_s), Some(55));
        assert_eq!(s.slots.last().map(|p| p.age_s), Some(0));
    }

    #[test]
    fn percentiles_over_the_window() {
        let t0 = Instant::now();
        let r = RecentLatency::starting_at(t0);
        // 1..=100 ms spread over the first 50 s; ITL a constant 20 ms.
        for i in 1..=100u64 {
            let at = t0 + Duration::from_millis(i * 500);
            r.record_ttft_at(at, ms(i));
            r.record_itl_at(at, ms(20));
        }
        let s = r.snapshot_at(t0 + Duration::from_secs(55));
        assert_eq!(s.ttft.count, 100);
        assert!(close(s.ttft.p50_ms, 50.0), "{:?}", s.ttft);
        assert!(close(s.ttft.p90_ms, 90.0), "{:?}", s.ttft);
        assert!(close(s.ttft.p99_ms, 99.0), "{:?}", s.ttft);
        assert_eq!(s.itl.count, 100);
        assert!(close(s.itl.p99_ms, 20.0), "{:?}", s.itl);
        // Samples at 0.5..50 s land in slots 0..=10 (of 5 s), the last slot (50..55 s) has
        // the sample at exactly 50 s; slot 11 (55..60 s, the current one) is empty.
        let counts: Vec<u64> = s.slots.iter().map(|p| p.ttft.count).collect();
        assert_eq!(counts, vec![9, 10, 10, 10, 10, 10, 10, 10, 10, 10, 1, 0]);
    }

    #[test]
    fn old_slots_fall_out_of_the_window() {
        let t0 = Instant::now();
        let r = RecentLatency::starting_at(t0);
        r.record_ttft_at(t0 + Duration::from_secs(1), ms(1000));
        r.record_ttft_at(t0 + Duration::from_secs(30), ms(10));
        // At 62 s the window is slots 1..=12: the 1 s sample (slot 0) is gone.
        let s = r.snapshot_at(t0 + Duration::from_secs(62));
        assert_eq!(s.ttft.count, 1);
        assert!(close(s.ttft.p99_ms, 10.0), "{:?}", s.ttft);
        // Much later, nothing is left, even though no slot was overwritten.
        let s = r.snapshot_at(t0 + Duration::from_secs(3600));
        assert_eq!(s.ttft.count, 0);
        assert!(s.slots.iter().all(|p| p.ttft.count == 0));
    }

    #[test]
    fn a_reused_slot_is_cleared_first() {
        let t0 = Instant::now();
        let r = RecentLatency::starting_at(t0);
        r.record_itl_at(t0 + Duration::from_secs(2), ms(500));
        // 60 s later the same ring place is reused for a new slot.
        r.record_itl_at(t0 + Duration::from_secs(62), ms(5));
        let s = r.snapshot_at(t0 + Duration::from_secs(63));
        assert_eq!(s.itl.count, 1);
        assert!(close(s.itl.p50_ms, 5.0), "{:?}", s.itl);
        assert_eq!(s.slots.last().map(|p| p.itl.count), Some(1));
    }

    #[test]
    fn late_and_extreme_samples_do_not_corrupt() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let r = RecentLatency::starting_at(t0);
        // Before the start: slot 0. Zero and huge durations are clamped.
        r.record_ttft_at(t0 - Duration::from_secs(5), Duration::ZERO);
        r.record_ttft_at(t0, Duration::from_secs(100_000));
        r.record_ttft_at(t0 + Duration::from_secs(61), ms(7));
        // A late sample for slot 0, whose place now holds slot 12: dropped.
        r.record_ttft_at(t0 + Duration::from_secs(1), ms(900));
        let s = r.snapshot_at(t0 + Duration::from_secs(61));
        assert_eq!(s.ttft.count, 1);
        assert!(close(s.ttft.p50_ms, 7.0), "{:?}", s.ttft);
        let s = r.snapshot_at(t0 + Duration::from_secs(59));
        // From slot 0's view at 59 s, its place now holds a newer slot: not shown.
        assert_eq!(s.ttft.count, 0);
    }

    #[test]
    fn records_from_many_threads() {
        let r = std::sync::Arc::new(RecentLatency::new());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for _ in 0..250 {
                        r.record_itl(ms(3));
                    }
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().is_ok());
        }
        assert_eq!(r.snapshot().itl.count, 1000);
    }
}
