//! The worker's `GET /metrics`: its counters ([`WorkerMetrics`]) and the engine's state read
//! under its lock at every scrape, vLLM's names where the meaning is the same (the table in
//! `metrics.rs`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tandem_protocol::StorageTier;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::WorkerError;
use crate::host::EngineHost;
use crate::metrics::WorkerMetrics;

/// The registry of a worker: its counters, and the engine read at every scrape.
pub fn registry(
    metrics: &Arc<WorkerMetrics>,
    host: EngineHost,
    model: &str,
    draining: Arc<AtomicBool>,
) -> Registry {
    let mut registry = Registry::default();
    registry.register(
        "tandem_worker_kv_events_published",
        "KV events the worker put on the event plane",
        metrics.events_published.clone(),
    );
    registry.register(
        "tandem_worker_kv_transfer_bytes",
        "KV bytes moved by remote prefills: sent (prefill worker) or received (decode \
         worker)",
        metrics.transfer_bytes.clone(),
    );
    registry.register(
        "tandem_worker_kv_transfer_blocks",
        "Prompt blocks of a decode worker's completed remote prefills: moved (sent by the \
         prefill worker) or held (cached here, not sent)",
        metrics.transfer_blocks.clone(),
    );
    registry.register(
        "tandem_worker_kv_transfer_seconds",
        "A decode worker's remote prefill, from the request to the KV in place and checked",
        metrics.transfer_seconds.clone(),
    );
    registry.register(
        "tandem_worker_kv_transfer_early_bytes",
        "KV bytes a prefill worker sent while the step computing their block still ran \
         (its first layers, as each was computed)",
        metrics.transfer_early_bytes.clone(),
    );
    registry.register(
        "tandem_worker_kv_transfer_fallbacks",
        "Remote prefills that failed and were computed locally",
        metrics.transfer_fallbacks.clone(),
    );
    registry.register(
        "tandem_worker_transfer_fences",
        "Blocks of abandoned transfers released, by how the fence ended",
        metrics.fences.clone(),
    );
    registry.register(
        "tandem_worker_step_tokens",
        "Tokens computed in each engine step (prompt and generated): the batch in tokens",
        metrics.steps.tokens.clone(),
    );
    registry.register(
        "tandem_worker_step_requests",
        "Requests computed in each engine step: the batch in sequences",
        metrics.steps.requests.clone(),
    );
    registry.register_collector(Box::new(EngineSeries {
        host,
        metrics: metrics.clone(),
        model: model.to_string(),
        draining,
    }));
    registry
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// The engine's state, read under its lock at scrape time.
#[derive(Debug)]
struct EngineSeries {
    host: EngineHost,
    /// The step meter's token rates.
    metrics: Arc<WorkerMetrics>,
    model: String,
    draining: Arc<AtomicBool>,
}

/// One scrape's reading of the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Reading {
    running: u32,
    waiting: u32,
    device_usage: f64,
    host_usage: f64,
    disk_usage: f64,
    queried: u64,
    hits: u64,
    preemptions: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
}

impl EngineSeries {
    fn read(&self) -> Reading {
        let now = self.host.now_us();
        self.host.with_engine(|e| {
            let report = e.load_report(now);
            let stats = e.stats();
            let pool = e.pool();
            let usage = |tier| match pool.tier_capacity(tier) {
                0 => 0.0,
                n => pool.cached_count(tier) as f64 / n as f64,
            };
            Reading {
                running: report.running_requests,
                waiting: report.waiting_requests,
                device_usage: report.kv_usage(),
                host_usage: usage(StorageTier::Host),
                disk_usage: usage(StorageTier::Disk),
                queried: stats.queried_tokens,
                hits: stats.cached_tokens,
                preemptions: stats.preemptions,
                prompt_tokens: stats.prefill_tokens,
                generation_tokens: stats.decode_tokens,
            }
        })
    }
}

impl Collector for EngineSeries {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let r = self.read();
        let model = ModelLabel {
            model_name: self.model.clone(),
        };
        let gauges: [(&str, &str, f64); 3] = [
            (
                "vllm:num_requests_running",
                "Requests in the engine's running batch",
                f64::from(r.running),
            ),
            (
                "vllm:num_requests_waiting",
                "Requests queued in the engine",
                f64::from(r.waiting),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "Fraction of device KV blocks in use (1 = full)",
                r.device_usage,
            ),
        ];
        for (name, help, value) in gauges {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(value).encode(m.encode_family(&model)?)?;
        }
        let counters: [(&str, &str, u64); 5] = [
            (
                "vllm:prefix_cache_queries",
                "Tokens looked up in the prefix cache at admission",
                r.queried,
            ),
            (
                "vllm:prefix_cache_hits",
                "Tokens found in the prefix cache at admission",
                r.hits,
            ),
            (
                "vllm:num_preemptions",
                "Requests preempted by the engine",
                r.preemptions,
            ),
            (
                "vllm:prompt_tokens",
                "Prompt tokens computed (recomputation included)",
                r.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Tokens generated",
                r.generation_tokens,
            ),
        ];
        for (name, help, value) in counters {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(value).encode(m.encode_family(&model)?)?;
        }
        let mut usage = encoder.encode_descriptor(
            "tandem_worker_kv_usage_ratio",
            "Fraction of a KV tier in use: device blocks referenced, host blocks holding \
             cached KV",
            None,
            MetricType::Gauge,
        )?;
        for (tier, value) in [
            ("device", r.device_usage),
            ("host", r.host_usage),
            ("disk", r.disk_usage),
        ] {
            ConstGauge::new(value).encode(usage.encode_family(&TierLabel { tier })?)?;
        }
        let rates = self.metrics.steps.rates(self.host.now_us());
        let mut speed = encoder.encode_descriptor(
            "tandem_worker_tokens_per_second",
            "Prompt tokens computed and tokens generated per second, over the last 10 s",
            None,
            MetricType::Gauge,
        )?;
        for (kind, value) in [("prompt", rates.prompt), ("generation", rates.generation)] {
            ConstGauge::new(value).encode(speed.encode_family(&KindLabel { kind })?)?;
        }
        let draining = f64::from(u8::from(self.draining.load(Ordering::Acquire)));
        let d = encoder.encode_descriptor(
            "tandem_worker_draining",
            "1 while the worker drains (out of discovery, finishing its requests)",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(draining).encode(d)?;
        Ok(())
    }
}

/// Serves `registry` at `GET /metrics` on `listener` until `stop`.
pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    stop: CancellationToken,
) -> Result<(), WorkerError> {
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(scrape))
        .with_state(Arc::new(registry));
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
        .map_err(|e| WorkerError::Internal(format!("metrics server: {e}")))
}

/// Binds the metrics listener (`host:port`; port 0 picks one).
pub async fn bind(addr: &str) -> Result<(TcpListener, SocketAddr), WorkerError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| WorkerError::Internal(format!("binding the metrics address {addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| WorkerError::Internal(format!("metrics listener address: {e}")))?;
    Ok((listener, local))
}

async fn scrape(State(registry): State<Arc<Registry>>) -> Response {
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics: {e}"),
        )
            .into_response();
    }
    let content_type =
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8");
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}
