//! [`HttpConfig`] and [`HttpState`], what every handler shares.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::registry::Registry;

use super::backend::Backend;
use super::ids::{RequestIds, unix_now};
use super::metrics::HttpMetrics;
use super::tokenizer::Tokenizer;

/// Settings of the HTTP edge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpConfig {
    /// The one model name served: `GET /v1/models` lists it, requests naming another get 404.
    /// A request without `model` is served by it.
    pub served_model_name: String,
    /// Most prompt + completion tokens of one request. Default 32768.
    pub context_length: u32,
    /// `max_tokens` when a request sets none, lowered to what fits in the context. Default
    /// 256 — for both endpoints (OpenAI's completions default of 16 is too short to be
    /// useful; "until the context is full" makes an unbounded default cost).
    pub default_max_tokens: u32,
    /// Larger request bodies get 413. Default 8 MiB.
    pub max_body_bytes: usize,
    /// Most stop strings per request (default 16) and most bytes in one (default 1024): they
    /// bound the text held back while matching.
    pub max_stop_sequences: usize,
    pub max_stop_bytes: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            served_model_name: "tandem".to_string(),
            context_length: 32_768,
            default_max_tokens: 256,
            max_body_bytes: 8 * 1024 * 1024,
            max_stop_sequences: 16,
            max_stop_bytes: 1024,
        }
    }
}

/// Shared state of the HTTP edge; cheap to clone.
#[derive(Clone)]
pub struct HttpState {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn Backend>,
    config: HttpConfig,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<HttpMetrics>,
    registry: Registry,
    draining: AtomicBool,
    ids: RequestIds,
    started: u64,
}

impl fmt::Debug for HttpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpState")
            .field("config", &self.inner.config)
            .field("tokenizer", &self.inner.tokenizer)
            .field("draining", &self.is_draining())
            .finish_non_exhaustive()
    }
}

impl HttpState {
    /// State with its own metrics registry, served whole at `GET /metrics`.
    pub fn new(backend: Arc<dyn Backend>, config: HttpConfig, tokenizer: Arc<Tokenizer>) -> Self {
        Self::with_registry(backend, config, tokenizer, Registry::default())
    }

    /// State that registers its metrics into `registry` (which may already hold the rest of
    /// the process's metrics) and serves all of it at `GET /metrics`.
    pub fn with_registry(
        backend: Arc<dyn Backend>,
        config: HttpConfig,
        tokenizer: Arc<Tokenizer>,
        mut registry: Registry,
    ) -> Self {
        let metrics = Arc::new(HttpMetrics::register(&mut registry));
        HttpState {
            inner: Arc::new(Inner {
                backend,
                config,
                tokenizer,
                metrics,
                registry,
                draining: AtomicBool::new(false),
                ids: RequestIds::new(),
                started: unix_now(),
            }),
        }
    }

    /// From now on `GET /health` answers 503 and new generation requests get 503
    /// (`code: "draining"`); requests in flight finish. Not reversible.
    pub fn start_draining(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    /// Generation requests in flight (admitted, response not finished).
    pub fn in_flight(&self) -> i64 {
        self.inner.metrics.in_flight()
    }

    /// Resolves when no generation request is in flight (pair with [`Self::start_draining`]
    /// and a timeout for a graceful drain).
    pub async fn wait_idle(&self) {
        self.inner.metrics.wait_idle().await
    }

    pub fn config(&self) -> &HttpConfig {
        &self.inner.config
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        self.inner.backend.as_ref()
    }

    pub(crate) fn metrics(&self) -> &Arc<HttpMetrics> {
        &self.inner.metrics
    }

    pub(crate) fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    pub(crate) fn ids(&self) -> &RequestIds {
        &self.inner.ids
    }

    /// Unix time the state was created (the `created` of the model object).
    pub(crate) fn started(&self) -> u64 {
        self.inner.started
    }
}
