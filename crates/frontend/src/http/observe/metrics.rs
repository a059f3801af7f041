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
//! - `tandem_http_inter_token_latency_seconds`: the gap between consecutive output tokens,
//!   one observation per token after those of the first chunk (a chunk of `n` tokens `t`
//!   after the previous one counts `n` gaps of `t / n`); vLLM's
//!   `vllm:inter_token_latency_seconds` observes once per engine step instead.
//! - `tandem_http_time_per_output_token_seconds`: per completed request with at least two
//!   tokens, (last token − first token) / (tokens − 1), as vLLM's
//!   `vllm:request_time_per_output_token_seconds`.
//! - `tandem_http_{prompt,completion,cached}_tokens_total`: over requests that got a 200.
//! - `tandem_http_stream_errors_total{endpoint}`: streams ended by a backend error after the
//!   head was sent.
//! - `tandem_http_client_disconnects_total{endpoint}`: streams the client dropped early.
//! - `tandem_frontend_prompt_token_mismatch_total`: requests whose prompt length, as the
//!   engine reported it ([`crate::http::EngineReport`]), differs from the number of tokens the
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

use crate::http::backend::{Endpoint, EngineReport};
use crate::http::recent::RecentLatency;

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
    itl: Histogram,
    tpot: Histogram,
    prompt_tokens: Counter,
    completion_tokens: Counter,
    cached_tokens: Counter,
    stream_errors: Family<EndpointLabels, Counter>,
    client_disconnects: Family<EndpointLabels, Counter>,
    prompt_token_mismatch: Counter,
    /// TTFT and ITL over the last minute, for the status page.
    recent: Arc<RecentLatency>,
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
            // 0.5 ms .. 16 s.
            itl: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            tpot: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            stream_errors: Family::default(),
            client_disconnects: Family::default(),
            prompt_token_mismatch: Counter::default(),
            recent: Arc::new(RecentLatency::new()),
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
        r.register(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens, one observation per token after the first \
             chunk",
            m.itl.clone(),
        );
        r.register(
            "time_per_output_token_seconds",
            "Per completed request: (last token - first token) / (output tokens - 1)",
            m.tpot.clone(),
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

    /// TTFT and ITL over the last minute.
    pub fn recent(&self) -> &Arc<RecentLatency> {
        &self.recent
    }

    /// Prompt tokens and, of those, tokens served from cache, over requests that got a 200.
    pub fn prompt_and_cached_tokens(&self) -> (u64, u64) {
        (self.prompt_tokens.get(), self.cached_tokens.get())
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

/// Distinct tenant labels on `/metrics` at most; later tenants are counted as `other`.
const MAX_TENANT_LABELS: usize = 1000;

/// The `tenant` label of the series counted per tenant: a tenant's name, for the first
/// [`MAX_TENANT_LABELS`] tenants seen, then `other` (the series stay bounded whatever the
/// keys file holds).
#[derive(Debug, Default)]
pub(crate) struct TenantLabels(parking_lot::Mutex<hashbrown::HashSet<Arc<str>>>);

impl TenantLabels {
    pub(crate) fn label(&self, tenant: &Arc<str>) -> String {
        let mut labels = self.0.lock();
        // Copied as a `str`: `to_string` on an `Arc<str>` goes through `Display`.
        if labels.contains(tenant) {
            return String::from(&**tenant);
        }
        if labels.len() < MAX_TENANT_LABELS {
            labels.insert(tenant.clone());
            return String::from(&**tenant);
        }
        "other".to_string()
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
    /// When the first backend chunk arrived (the time to first token).
    first_chunk_at: Option<Instant>,
    /// When the first and the latest output tokens arrived.
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// `(id, tokens sent, engine report)` until the engine's prompt length was checked.
    prompt_check: Option<(u64, usize, EngineReport)>,
    /// The request's server span ([`crate::http::trace`]): its usage and status are recorded
    /// there too, and it ends when the record drops (the response's last byte).
    span: tracing::Span,
    /// Told how the request went when the record ends (the budgets' charge, an
    /// experiment's arm).
    on_end: Vec<EndHook>,
}

/// How a request went, as its record ends.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ended {
    /// The response's status (499: the client left before it was decided).
    pub(crate) status: u16,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) ttft: Option<std::time::Duration>,
}

/// What a record tells how its request went when it ends.
pub(crate) struct EndHook(pub(crate) Box<dyn FnOnce(&Ended) + Send + Sync>);

impl std::fmt::Debug for EndHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EndHook")
    }
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
            first_chunk_at: None,
            first_token: None,
            last_token: None,
            prompt_check: None,
            span: tracing::Span::none(),
            on_end: Vec::new(),
        }
    }

    /// `hook` is told how the request went when the record ends.
    pub(crate) fn on_end(&mut self, hook: EndHook) {
        self.on_end.push(hook);
    }

    /// The record's request is traced in `span`.
    pub(crate) fn traced(mut self, span: tracing::Span) -> Self {
        self.span = span;
        self
    }

    pub(crate) fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The response's finish reason (`gen_ai.response.finish_reasons`).
    pub(crate) fn finish_reason(&self, reason: &str) {
        tandem_runtime::telemetry::set_string_array(
            &self.span,
            "gen_ai.response.finish_reasons",
            &[reason],
        );
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
        let now = Instant::now();
        self.first_chunk_at = Some(now);
        let ttft = now.saturating_duration_since(self.start);
        self.metrics.ttft.observe(ttft.as_secs_f64());
        self.metrics.recent.record_ttft(ttft);
        self.prompt_tokens = prompt_tokens.into();
        self.cached_tokens = cached_tokens.into();
        self.span
            .record("gen_ai.usage.input_tokens", i64::from(prompt_tokens));
        self.span
            .record("gen_ai.server.time_to_first_token", ttft.as_secs_f64());
        self.span
            .record("tandem.cached_tokens", i64::from(cached_tokens));
        self.check_prompt_tokens();
    }

    /// The request's prompt and cached tokens, for a request that produces no tokens (its
    /// latency is not a time to first token): `/v1/embeddings`.
    pub(crate) fn counted(&mut self, prompt_tokens: u64, cached_tokens: u64) {
        self.prompt_tokens = prompt_tokens;
        self.cached_tokens = cached_tokens;
        let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.span
            .record("gen_ai.usage.input_tokens", as_i64(prompt_tokens));
        self.span
            .record("tandem.cached_tokens", as_i64(cached_tokens));
    }

    /// The response head is decided.
    pub(crate) fn status(&mut self, status: u16) {
        self.status = Some(status);
    }

    /// `n` output tokens so far: the new ones since the last call are timed (inter-token
    /// latency).
    pub(crate) fn completion_tokens(&mut self, n: u32) {
        self.tokens_at(u64::from(n), Instant::now());
    }

    fn tokens_at(&mut self, n: u64, now: Instant) {
        let new = n.saturating_sub(self.completion_tokens);
        self.completion_tokens = self.completion_tokens.max(n);
        if new == 0 {
            return;
        }
        match self.last_token {
            Some(last) => {
                let gap = now.saturating_duration_since(last) / new.try_into().unwrap_or(u32::MAX);
                for _ in 0..new {
                    self.metrics.itl.observe(gap.as_secs_f64());
                    self.metrics.recent.record_itl(gap);
                }
            }
            // The first chunk's tokens are timed by TTFT.
            None => self.first_token = Some(now),
        }
        self.last_token = Some(now);
    }

    /// The response ended as it should (a mid-stream error event counts as an end too).
    pub(crate) fn completed(&mut self) {
        self.completed = true;
        self.span.record(
            "gen_ai.usage.output_tokens",
            i64::try_from(self.completion_tokens).unwrap_or(i64::MAX),
        );
        self.metrics.e2e.observe(self.start.elapsed().as_secs_f64());
        if let (Some(first), Some(last)) = (self.first_token, self.last_token)
            && self.completion_tokens > 1
        {
            let span = last.saturating_duration_since(first).as_secs_f64();
            self.metrics
                .tpot
                .observe(span / (self.completion_tokens - 1) as f64);
        }
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
        if !self.on_end.is_empty() {
            let ended = Ended {
                status: self.status.unwrap_or(499),
                prompt_tokens: self.prompt_tokens,
                cached_tokens: self.cached_tokens,
                completion_tokens: self.completion_tokens,
                ttft: self
                    .first_chunk_at
                    .map(|t| t.saturating_duration_since(self.start)),
            };
            for hook in self.on_end.drain(..) {
                (hook.0)(&ended);
            }
        }
        let m = &self.metrics;
        let endpoint = self.endpoint.as_str();
        let status = self.status.unwrap_or(499);
        self.span
            .record("http.response.status_code", i64::from(status));
        if status >= 500 {
            self.span.record("otel.status_code", "ERROR");
        }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn scrape(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).expect("encodes");
        text
    }

    fn sample(text: &str, name: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in\n{text}"))
    }

    #[test]
    fn inter_token_latency_and_tpot_follow_the_chunks() {
        let mut registry = Registry::default();
        let metrics = Arc::new(HttpMetrics::register(&mut registry));
        let mut record = RequestRecord::start(metrics.clone(), Endpoint::ALL[0]);
        let t0 = Instant::now();
        // First chunk: 2 tokens (timed by TTFT), then 4 tokens 40 ms later (4 gaps of
        // 10 ms), then 1 token 30 ms later; a repeated count adds nothing.
        record.tokens_at(2, t0);
        record.tokens_at(6, t0 + Duration::from_millis(40));
        record.tokens_at(6, t0 + Duration::from_millis(50));
        record.tokens_at(7, t0 + Duration::from_millis(70));
        record.completed();
        drop(record);
        let text = scrape(&registry);
        assert_eq!(
            sample(&text, "tandem_http_inter_token_latency_seconds_count"),
            5.0
        );
        let itl_sum = sample(&text, "tandem_http_inter_token_latency_seconds_sum");
        assert!((itl_sum - 0.070).abs() < 1e-9, "{itl_sum}");
        assert_eq!(
            sample(&text, "tandem_http_time_per_output_token_seconds_count"),
            1.0
        );
        // (70 ms) / (7 - 1) tokens.
        let tpot = sample(&text, "tandem_http_time_per_output_token_seconds_sum");
        assert!((tpot - 0.070 / 6.0).abs() < 1e-9, "{tpot}");
    }

    #[test]
    fn a_single_token_has_no_gaps() {
        let mut registry = Registry::default();
        let metrics = Arc::new(HttpMetrics::register(&mut registry));
        let mut record = RequestRecord::start(metrics, Endpoint::ALL[0]);
        record.tokens_at(1, Instant::now());
        record.completed();
        drop(record);
        let text = scrape(&registry);
        assert_eq!(
            sample(&text, "tandem_http_inter_token_latency_seconds_count"),
            0.0
        );
        assert_eq!(
            sample(&text, "tandem_http_time_per_output_token_seconds_count"),
            0.0
        );
    }
}
