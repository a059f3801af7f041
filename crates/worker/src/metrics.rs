//! A worker's own Prometheus metrics, served at `GET /metrics` on `--metrics-addr` (its
//! address is in the worker's discovery record; the endpoint and the engine's series read
//! at each scrape: `scrape.rs`; the counters the worker's code bumps: here).
//!
//! Where the meaning is the same as one of vLLM's (`vllm/v1/metrics/loggers.py`), the series
//! has vLLM's name and its `model_name` label, so dashboards and autoscaling rules written
//! for vLLM work unchanged:
//!
//! | series | meaning |
//! |---|---|
//! | `vllm:num_requests_running` | requests in the engine's running batch |
//! | `vllm:num_requests_waiting` | requests queued in the engine |
//! | `vllm:kv_cache_usage_perc` | device KV blocks in use, 0–1 |
//! | `vllm:prefix_cache_queries_total` | tokens looked up in the prefix cache at admission |
//! | `vllm:prefix_cache_hits_total` | of those, tokens found |
//! | `vllm:num_preemptions_total` | requests preempted |
//! | `vllm:prompt_tokens_total` | prompt tokens computed (recomputation included) |
//! | `vllm:generation_tokens_total` | tokens generated |
//!
//! tandem's own, for what vLLM has no series of:
//!
//! - `tandem_worker_kv_usage_ratio{tier}`: `device` (as above), `host` and `disk` (the
//!   tier's blocks holding cached KV, over its capacity; 0 without the tier).
//! - `tandem_worker_kv_events_published_total`: KV events put on the event plane.
//! - `tandem_worker_kv_transfer_bytes_total{direction}`: KV bytes a remote prefill moved:
//!   `sent` by a prefill worker, `received` by a decode worker.
//! - `tandem_worker_kv_transfer_blocks_total{kind}`: a decode worker's completed remote
//!   prefills, by prompt block: `moved` (its KV came from the prefill worker) or `held`
//!   (the worker's own cached prefix, not sent: the transfer is paged).
//! - `tandem_worker_kv_transfer_seconds`: a decode worker's remote prefill, asked → KV in
//!   place and checked.
//! - `tandem_worker_kv_transfer_early_bytes_total`: of the bytes a prefill worker sent, those
//!   that left while the step computing their block still ran (its first layers, sent as each
//!   was computed): how much of the transfer overlapped the forward pass.
//! - `tandem_worker_kv_transfer_fallbacks_total`: remote prefills that failed and were done
//!   locally.
//! - `tandem_worker_transfer_fences_total{outcome}`: abandoned transfers' blocks released,
//!   by how the fence ended (`confirmed`, `peer_gone`, `timed_out`).
//! - `tandem_worker_draining`: 1 while the worker drains.
//! - `tandem_worker_step_tokens`, `tandem_worker_step_requests`: histograms of the engine's
//!   steps, tokens computed and requests in each (the batch, in tokens and in sequences).
//! - `tandem_worker_tokens_per_second{kind}`: `prompt` tokens computed and `generation`
//!   tokens produced per second over the last 10 s of the engine's clock (a glance at
//!   `/metrics`; dashboards take `rate()` of the `vllm:*_tokens_total` counters).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use std::collections::VecDeque;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DirectionLabel {
    pub(crate) direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabel {
    pub(crate) kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
    pub(crate) outcome: &'static str,
}

/// The counters the worker's code paths bump; the engine's state is read at scrape time.
#[derive(Debug)]
pub struct WorkerMetrics {
    pub(crate) events_published: Counter,
    pub(crate) transfer_bytes: Family<DirectionLabel, Counter>,
    pub(crate) transfer_blocks: Family<KindLabel, Counter>,
    pub(crate) transfer_seconds: Histogram,
    pub(crate) transfer_fallbacks: Counter,
    pub(crate) transfer_early_bytes: Counter,
    pub(crate) fences: Family<OutcomeLabel, Counter>,
    pub(crate) steps: StepMeter,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        let m = WorkerMetrics {
            events_published: Counter::default(),
            transfer_bytes: Family::default(),
            transfer_blocks: Family::default(),
            // 1 ms .. 65 s.
            transfer_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            transfer_fallbacks: Counter::default(),
            transfer_early_bytes: Counter::default(),
            fences: Family::default(),
            steps: StepMeter::default(),
        };
        // Zero series from the start, so that rates see them before the first event.
        for direction in ["sent", "received"] {
            let _ = m
                .transfer_bytes
                .get_or_create(&DirectionLabel { direction });
        }
        for kind in ["moved", "held"] {
            let _ = m.transfer_blocks.get_or_create(&KindLabel { kind });
        }
        for outcome in ["confirmed", "peer_gone", "timed_out"] {
            let _ = m.fences.get_or_create(&OutcomeLabel { outcome });
        }
        m
    }
}

impl WorkerMetrics {
    /// `n` KV events published.
    pub fn events_published(&self, n: u64) {
        self.events_published.inc_by(n);
    }

    /// KV bytes a prefill worker sent.
    pub fn transfer_sent(&self, bytes: u64) {
        self.transfer_bytes("sent", bytes);
    }

    /// Of those, `bytes` sent while the step computing their blocks still ran.
    pub fn transfer_sent_early(&self, bytes: u64) {
        self.transfer_early_bytes.inc_by(bytes);
    }

    /// The bytes [`transfer_sent_early`](Self::transfer_sent_early) counted so far.
    pub fn transfer_early_bytes(&self) -> u64 {
        self.transfer_early_bytes.get()
    }

    /// A decode worker's remote prefill completed: `moved` blocks (`bytes`) in place after
    /// `seconds`; `held` blocks of the prompt were cached here and not sent.
    pub fn transfer_received(&self, moved: u64, held: u64, bytes: u64, seconds: f64) {
        self.transfer_bytes("received", bytes);
        for (kind, n) in [("moved", moved), ("held", held)] {
            self.transfer_blocks
                .get_or_create(&KindLabel { kind })
                .inc_by(n);
        }
        self.transfer_seconds.observe(seconds);
    }

    fn transfer_bytes(&self, direction: &'static str, bytes: u64) {
        self.transfer_bytes
            .get_or_create(&DirectionLabel { direction })
            .inc_by(bytes);
    }

    /// A remote prefill failed and was done locally.
    pub fn transfer_fallback(&self) {
        self.transfer_fallbacks.inc();
    }

    /// An abandoned transfer's fence ended (`confirmed`, `peer_gone`, `timed_out`).
    pub fn fence(&self, outcome: &'static str) {
        self.fences.get_or_create(&OutcomeLabel { outcome }).inc();
    }
}

/// The window the token rates are taken over, microseconds of the engine's clock.
const RATE_WINDOW_US: u64 = 10_000_000;
/// Most steps kept for the rates (a step of microseconds for ten seconds would be more);
/// older ones beyond it are dropped early, which can only lower the rates.
const MAX_RECENT_STEPS: usize = 16_384;

/// The engine's steps as they complete: histograms of each step's tokens and requests, and
/// the tokens of the steps that ended within the last [`RATE_WINDOW_US`].
#[derive(Debug)]
pub struct StepMeter {
    pub(crate) tokens: Histogram,
    pub(crate) requests: Histogram,
    /// (end, prompt tokens, generated tokens) of recent steps, oldest first.
    recent: parking_lot::Mutex<VecDeque<(u64, u64, u64)>>,
}

impl Default for StepMeter {
    fn default() -> Self {
        StepMeter {
            // 1 .. 16384 tokens, 1 .. 512 requests.
            tokens: Histogram::new(exponential_buckets(1.0, 2.0, 15)),
            requests: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            recent: parking_lot::Mutex::new(VecDeque::new()),
        }
    }
}

/// Tokens per second over the rate window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenRates {
    pub prompt: f64,
    pub generation: f64,
}

impl StepMeter {
    /// A step ended at `end_us` (the engine's clock) having computed `prompt` prompt tokens
    /// and generated `generated` tokens for `requests` requests.
    pub fn step(&self, end_us: u64, prompt: usize, generated: usize, requests: usize) {
        self.tokens.observe((prompt + generated) as f64);
        self.requests.observe(requests as f64);
        let mut recent = self.recent.lock();
        recent.push_back((end_us, prompt as u64, generated as u64));
        let since = end_us.saturating_sub(RATE_WINDOW_US);
        while recent
            .front()
            .is_some_and(|&(end, ..)| end <= since || recent.len() > MAX_RECENT_STEPS)
        {
            recent.pop_front();
        }
    }

    /// The rates at `now_us`: the tokens of the steps that ended in the window before it,
    /// over the window (or over `now_us` itself, for an engine younger than the window).
    pub fn rates(&self, now_us: u64) -> TokenRates {
        let since = now_us.saturating_sub(RATE_WINDOW_US);
        let (mut prompt, mut generation) = (0u64, 0u64);
        for &(end, p, g) in self.recent.lock().iter() {
            if end > since && end <= now_us {
                prompt += p;
                generation += g;
            }
        }
        let seconds = now_us.min(RATE_WINDOW_US) as f64 / 1e6;
        if seconds <= 0.0 {
            return TokenRates::default();
        }
        TokenRates {
            prompt: prompt as f64 / seconds,
            generation: generation as f64 / seconds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_count_the_steps_of_the_last_ten_seconds() {
        let m = StepMeter::default();
        assert_eq!(m.rates(0), TokenRates::default());
        // A 512-token prefill, then a decode step every 50 ms with 4 requests.
        m.step(1_000_000, 512, 1, 1);
        for i in 1..=100u64 {
            m.step(1_000_000 + i * 50_000, 0, 4, 4);
        }
        // At 6 s the engine is younger than the window: over its 6 s.
        let r = m.rates(6_000_000);
        assert_eq!(r.prompt, 512.0 / 6.0);
        assert_eq!(r.generation, 401.0 / 6.0);
        // At 12 s the prefill (at 1 s) has left the window, and so have the decode steps
        // that ended by 2 s.
        let r = m.rates(12_000_000);
        assert_eq!(r.prompt, 0.0);
        assert_eq!(r.generation, (100 - 20) as f64 * 4.0 / 10.0);
        // Idle for longer than the window: nothing.
        assert_eq!(m.rates(30_000_000), TokenRates::default());
        m.step(30_000_000, 0, 1, 1);
        assert_eq!(
            m.recent.lock().len(),
            1,
            "old steps are dropped as new ones come"
        );
    }
}
