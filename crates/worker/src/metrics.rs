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
//! - `tandem_worker_kv_usage_ratio{tier}`: `device` (as above) and `host` (host-tier blocks
//!   holding cached KV, over the host tier's capacity).
//! - `tandem_worker_kv_events_published_total`: KV events put on the event plane.
//! - `tandem_worker_kv_transfer_bytes_total{direction}`: KV bytes a remote prefill moved:
//!   `sent` by a prefill worker, `received` by a decode worker.
//! - `tandem_worker_kv_transfer_seconds`: a decode worker's remote prefill, asked → KV in
//!   place and checked.
//! - `tandem_worker_kv_transfer_fallbacks_total`: remote prefills that failed and were done
//!   locally.
//! - `tandem_worker_transfer_fences_total{outcome}`: abandoned transfers' blocks released,
//!   by how the fence ended (`confirmed`, `peer_gone`, `timed_out`).
//! - `tandem_worker_draining`: 1 while the worker drains.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DirectionLabel {
    pub(crate) direction: &'static str,
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
    pub(crate) transfer_seconds: Histogram,
    pub(crate) transfer_fallbacks: Counter,
    pub(crate) fences: Family<OutcomeLabel, Counter>,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        let m = WorkerMetrics {
            events_published: Counter::default(),
            transfer_bytes: Family::default(),
            // 1 ms .. 65 s.
            transfer_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            transfer_fallbacks: Counter::default(),
            fences: Family::default(),
        };
        // Zero series from the start, so that rates see them before the first event.
        for direction in ["sent", "received"] {
            let _ = m
                .transfer_bytes
                .get_or_create(&DirectionLabel { direction });
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

    /// A decode worker's remote prefill completed: `bytes` in place after `seconds`.
    pub fn transfer_received(&self, bytes: u64, seconds: f64) {
        self.transfer_bytes("received", bytes);
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
