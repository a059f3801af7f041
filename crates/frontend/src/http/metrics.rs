//! Prometheus metrics of the HTTP edge ([`HttpMetrics`]), and the per-request record that
//! keeps them right on every path, including a client that goes away mid-request.
//!
//! Metrics (OpenMetrics text at `GET /metrics`):
//!
//! - `tandem_http_requests_total{endpoint,status}`: generation requests by endpoint (`chat`,
//!   `completion`, `responses`, `messages`) and HTTP status; `499` when the client left
//!   before the response head.
//! - `tandem_http_requests_in_flight`: generation requests being served.
//! - `tandem_http_time_to_first_token_seconds`: arrival → first backend chunk.
//! - `tandem_http_request_duration_seconds`: arrival → last byte, completed requests only.
//! - `tandem_http_{prompt,completion,cached}_tokens_total`: over requests that got a 200.
//! - `tandem_http_stream_errors_total{endpoint}`: streams ended by a backend error after the
//!   head was sent.
//! - `tandem_http_client_disconnects_total{endpoint}`: streams the client dropped early.
//! - `tandem_frontend_prompt_token_mismatch_total`: requests whose prompt length, as the
//!   engine reported it ([`super::EngineReport`]), differs from the number of tokens the
//!   frontend sent: the router's tokenization (and so its prefix-cache view) disagrees with
//!   the engine's. Each is also logged, rate-limited: the 1st, 2nd, 4th, … 1024th, then every
//!   1024th.

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::Notify;

use super::backend::{Endpoint, EngineReport};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabels {
    endpoint: &'static str,
}

/// The HTTP edge's metrics. Registered once into a [`Registry`].
#[derive(Debug)]
pub struct HttpMetrics {
    requests: Family<RequestLabels, Counter>,
    in_flight: Gauge,
    ttft: Histogram,
    e2e: Histogram,
    prompt_tokens: Counter,
    completion_tokens: Counter,
    cached_tokens: Counter,
    stream_errors: Family<EndpointLabels, Counter>,
    client_disconnects: Family<EndpointLabels, Counter>,
    prompt_token_mismatch: Counter,
    /// Notified when `in_flight` drops to zero.
    idle: Notify,
}

impl HttpMetrics {
    /// Creates the metrics and registers them under `tandem_http_` in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = HttpMetrics {
            requests: Family::default(),
            in_flight: Gauge::default(),
            // 1 ms .. 65 s and 10 ms .. 164 s.
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            e2e: Histogram::new(exponential_buckets(0.01, 2.0, 15)),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            stream_errors: Family::default(),
            client_disconnects: Family::default(),
            prompt_token_mismatch: Counter::default(),
            idle: Notify::new(),
        };
        registry.register(
            "tandem_frontend_prompt_token_mismatch",
            "Requests whose prompt token count reported by the engine differs from the tokens \
             the frontend sent",
            m.prompt_token_mismatch.clone(),
        );
        let r = registry.sub_registry_with_prefix("tandem_http");
        r.register(
            "requests",
            "Generation requests by endpoint and HTTP status",
            m.requests.clone(),
        );
        r.register(
            "requests_in_flight",
            "Generation requests being served",
            m.in_flight.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Time from request arrival to the first backend chunk",
            m.ttft.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from request arrival to the end of the response, completed requests",
            m.e2e.clone(),
        );
        r.register("prompt_tokens", "Prompt tokens", m.prompt_tokens.clone());
        r.register(
            "completion_tokens",
            "Generated tokens",
            m.completion_tokens.clone(),
        );
        r.register(
            "cached_tokens",
            "Prompt tokens served from cache, as the workers report",
            m.cached_tokens.clone(),
        );
        r.register(
            "stream_errors",
            "Streams ended by a backend error after the response head",
            m.stream_errors.clone(),
        );
        r.register(
            "client_disconnects",
            "Streams the client dropped before the end",
            m.client_disconnects.clone(),
        );
        // Zero series from the start, so rates and alerts see them before the first event.
        for endpoint in Endpoint::ALL {
            let labels = EndpointLabels {
                endpoint: endpoint.as_str(),
            };
            let _ = m.stream_errors.get_or_create(&labels);
            let _ = m.client_disconnects.get_or_create(&labels);
        }
        m
    }

    /// Compares the prompt length the engine reported (if it did) with the `sent` tokens;
    /// a difference is counted and logged (rate-limited).
    pub(crate) fn check_prompt_tokens(&self, id: u64, sent: usize, reported: Option<u32>) {
        let Some(reported) = reported else {
            return;
        };
        if u64::from(reported) == sent as u64 {
            return;
        }
        let n = self.prompt_token_mismatch.inc() + 1;
        if n.is_power_of_two() && n <= 1024 || n.is_multiple_of(1024) {
            tracing::warn!(
                id,
                sent,
                reported,
                mismatches = n,
                "the engine counted a different number of prompt tokens than the frontend \
                 sent: tokenizers or chat templates disagree (logged for the 1st, 2nd, 4th, … \
                 mismatch)"
            );
        }
    }

    /// Prompt-token mismatches so far.
    pub fn prompt_token_mismatches(&self) -> u64 {
        self.prompt_token_mismatch.get()
    }

    /// Generation requests being served now.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.get()
    }

    /// Waits until no generation request is in flight.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.in_flight.get() <= 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One generation request's accounting; its `Drop` settles the metrics whatever the path.
#[derive(Debug)]
pub(crate) struct RequestRecord {
    metrics: Arc<HttpMetrics>,
    endpoint: Endpoint,
    start: Instant,
    status: Option<u16>,
    completed: bool,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
    /// `(id, tokens sent, engine report)` until the engine's prompt length was checked.
    prompt_check: Option<(u64, usize, EngineReport)>,
}

impl RequestRecord {
    pub(crate) fn start(metrics: Arc<HttpMetrics>, endpoint: Endpoint) -> Self {
        metrics.in_flight.inc();
        RequestRecord {
            metrics,
            endpoint,
            start: Instant::now(),
            status: None,
            completed: false,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            prompt_check: None,
        }
    }

    /// The request went to the backend with `sent` prompt tokens; check what the engine
    /// reports (at the first chunk, or at the end if it reports only then).
    pub(crate) fn sent(&mut self, id: u64, sent: usize, engine: EngineReport) {
        self.prompt_check = Some((id, sent, engine));
    }

    fn check_prompt_tokens(&mut self) {
        let reported = match &self.prompt_check {
            Some((_, _, engine)) => engine.prompt_tokens(),
            None => return,
        };
        if reported.is_some()
            && let Some((id, sent, _)) = self.prompt_check.take()
        {
            self.metrics.check_prompt_tokens(id, sent, reported);
        }
    }

    /// The first backend chunk arrived.
    pub(crate) fn first_chunk(&mut self, prompt_tokens: u32, cached_tokens: u32) {
        self.metrics
            .ttft
            .observe(self.start.elapsed().as_secs_f64());
        self.prompt_tokens = prompt_tokens.into();
        self.cached_tokens = cached_tokens.into();
        self.check_prompt_tokens();
    }

    /// The response head is decided.
    pub(crate) fn status(&mut self, status: u16) {
        self.status = Some(status);
    }

    pub(crate) fn completion_tokens(&mut self, n: u32) {
        self.completion_tokens = n.into();
    }

    /// The response ended as it should (a mid-stream error event counts as an end too).
    pub(crate) fn completed(&mut self) {
        self.completed = true;
        self.metrics.e2e.observe(self.start.elapsed().as_secs_f64());
    }

    pub(crate) fn stream_error(&mut self) {
        self.metrics
            .stream_errors
            .get_or_create(&EndpointLabels {
                endpoint: self.endpoint.as_str(),
            })
            .inc();
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.check_prompt_tokens();
        let m = &self.metrics;
        let endpoint = self.endpoint.as_str();
        let status = self.status.unwrap_or(499);
        m.requests
            .get_or_create(&RequestLabels { endpoint, status })
            .inc();
        if status == 200 {
            m.prompt_tokens.inc_by(self.prompt_tokens);
            m.completion_tokens.inc_by(self.completion_tokens);
            m.cached_tokens.inc_by(self.cached_tokens);
            if !self.completed {
                m.client_disconnects
                    .get_or_create(&EndpointLabels { endpoint })
                    .inc();
            }
        }
        if m.in_flight.dec() <= 1 {
            m.idle.notify_waiters();
        }
    }
}
