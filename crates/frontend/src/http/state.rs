//! [`HttpConfig`] and [`HttpState`], what every handler shares.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::registry::Registry;

use super::auth::{Access, AccessConfig, AccessError};
use super::backend::Backend;
use super::chat_template::{ChatTemplate, ChatTemplateError, ChatTemplateSpec};
use super::groups::{GroupGate, GroupsError, GroupsOptions};
use super::ids::{RequestIds, unix_now};
use super::metrics::HttpMetrics;
use super::prompt::Prompts;
use super::responses_store::{ResponseStore, ResponsesStoreConfig};
use super::tls::{TlsConfig, TlsError};
use super::tokenizer::Tokenizer;
use super::tool_calls::ToolCallParser;

/// Settings of the HTTP edge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpConfig {
    /// The one model name served: `GET /v1/models` lists it, requests naming another get 404.
    /// A request without `model` is served by it.
    pub served_model_name: String,
    /// LoRA adapters served on top of it, by name: a request whose `model` names one runs on
    /// that adapter (its KV blocks are hashed apart from the base model's and it is routed
    /// to workers holding it); `GET /v1/models` lists them with the base model as `parent`.
    /// Names are non-empty, without whitespace, distinct and not the served name. Default:
    /// none.
    pub lora_adapters: Vec<String>,
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
    /// The chat template of chat completions, Responses and Messages. Default: the built-in
    /// ChatML template.
    pub chat_template: ChatTemplateSpec,
    /// How tool calls are parsed out of generated text. Default: [`ToolCallParser::Auto`].
    pub tool_call_parser: ToolCallParser,
    /// Bounds of the Responses API's store (`previous_response_id`).
    pub responses_store: ResponsesStoreConfig,
    /// The most a request may take, queueing included; a request's own `timeout` may only
    /// shorten it. Default 600 s.
    pub request_timeout: Duration,
    /// API keys and tenants (`auth.rs`). Default: no keys, every request served.
    pub access: AccessConfig,
    /// TLS on the listener ([`super::serve_state`]); None: plain HTTP.
    pub tls: Option<TlsConfig>,
    /// The body field that names a request's session (for session affinity), besides the
    /// `x-session-id` header and `tandem.session_id`. Default: `user`.
    pub session_field: super::SessionField,
    /// The semantic cache (`semantic_cache.rs`). Default: off.
    pub semantic_cache: super::SemanticCacheConfig,
    /// Threads with a single-threaded runtime each that serve the plain-HTTP connections
    /// ([`tandem_runtime::serving::ServingThreads`], [`super::serve_state`]); 0: the calling
    /// runtime serves them. Default: 0.
    pub serving_threads: usize,
}

impl HttpConfig {
    /// A request's time budget: its own `timeout` (seconds) capped by
    /// [`Self::request_timeout`].
    pub fn timeout_for(&self, asked_s: Option<f64>) -> Duration {
        match asked_s {
            Some(s) if s.is_finite() && s > 0.0 => Duration::try_from_secs_f64(s)
                .map_or(self.request_timeout, |d| d.min(self.request_timeout)),
            _ => self.request_timeout,
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            served_model_name: "tandem".to_string(),
            lora_adapters: Vec::new(),
            context_length: 32_768,
            default_max_tokens: 256,
            max_body_bytes: 8 * 1024 * 1024,
            max_stop_sequences: 16,
            max_stop_bytes: 1024,
            chat_template: ChatTemplateSpec::Default,
            tool_call_parser: ToolCallParser::Auto,
            responses_store: ResponsesStoreConfig::default(),
            request_timeout: Duration::from_secs(600),
            access: AccessConfig::default(),
            tls: None,
            session_field: super::SessionField::User,
            semantic_cache: super::SemanticCacheConfig::default(),
            serving_threads: 0,
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
    prompts: Prompts,
    /// Whether tool calls are parsed out of the output (the parser resolved against the
    /// template).
    parse_tool_calls: bool,
    responses: Arc<ResponseStore>,
    metrics: Arc<HttpMetrics>,
    registry: Registry,
    draining: AtomicBool,
    ids: RequestIds,
    started: u64,
    /// The live API key table.
    access: Access,
    /// The listener's TLS, loaded from `config.tls`.
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    /// The backend groups, when a groups file was given.
    groups: Option<Arc<GroupGate>>,
    /// The semantic cache, when on.
    semantic_cache: Option<Arc<super::SemanticCache>>,
}

/// Why an [`HttpState`] could not be made (at startup: each should stop the process).
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error(transparent)]
    Access(#[from] AccessError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Adapters(#[from] AdapterNameError),
    #[error(transparent)]
    Groups(#[from] GroupsError),
    #[error(transparent)]
    SemanticCache(#[from] super::SemanticCacheError),
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

/// Builds an [`HttpState`] (docs/CONVENTIONS.md §8): a backend, the config and the
/// tokenizer, then optionally the metrics registry it joins and an already compiled chat
/// template.
pub struct HttpStateBuilder {
    backend: Arc<dyn Backend>,
    config: HttpConfig,
    tokenizer: Arc<Tokenizer>,
    registry: Registry,
    template: Option<ChatTemplate>,
    groups: Option<GroupsOptions>,
}

impl fmt::Debug for HttpStateBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpStateBuilder")
            .field("config", &self.config)
            .field(
                "template",
                &self.template.as_ref().map(ChatTemplate::origin),
            )
            .finish_non_exhaustive()
    }
}

impl HttpStateBuilder {
    /// Registers the edge's metrics into `registry` (which may already hold the rest of the
    /// process's metrics); `GET /metrics` serves all of it. Default: a registry of its own.
    pub fn registry(mut self, registry: Registry) -> Self {
        self.registry = registry;
        self
    }

    /// Backend groups from a file (`--groups`): models served by groups of endpoints and
    /// this process's pool in priority order (`http/api/groups/`).
    pub fn groups(mut self, options: GroupsOptions) -> Self {
        self.groups = Some(options);
        self
    }

    /// An already compiled chat template, in place of loading `config.chat_template` (tests
    /// use it to pin the template's clock).
    pub fn template(mut self, template: ChatTemplate) -> Self {
        self.template = Some(template);
        self
    }

    /// The state; an error when the chat template cannot be loaded or compiled, the API
    /// keys or TLS files cannot be used, or the LoRA adapter names are not valid
    /// ([`HttpConfig::lora_adapters`]): call it at startup, where each should stop the
    /// process. The backend is told the tenants' limits ([`Backend::set_tenants`]) before
    /// this returns.
    pub fn build(self) -> Result<HttpState, StateError> {
        let HttpStateBuilder {
            backend,
            config,
            tokenizer,
            mut registry,
            template,
            groups,
        } = self;
        let template = match template {
            Some(t) => t,
            None => ChatTemplate::load(&config.chat_template)?,
        };
        check_adapters(&config)?;
        let access = Access::load(&config.access)?;
        let tls = config.tls.as_ref().map(super::tls::load).transpose()?;
        backend.set_tenants(access.tenant_limits());
        let metrics = Arc::new(HttpMetrics::register(&mut registry));
        let groups = groups
            .map(|g| GroupGate::load(g, config.request_timeout, &mut registry).map(Arc::new))
            .transpose()?;
        let parse_tool_calls = config
            .tool_call_parser
            .enabled(template.mentions_tool_call());
        tracing::debug!(
            template = template.origin(),
            parse_tool_calls,
            "chat template loaded"
        );
        let prompts = Prompts::new(template, tokenizer.clone());
        let responses = Arc::new(ResponseStore::new(config.responses_store));
        config.semantic_cache.validate()?;
        if config.semantic_cache.enabled && config.semantic_cache.embeddings_url.is_none() {
            tracing::warn!(
                "the semantic cache embeds with the pool's own model: a chat model tells \
                 paraphrases from look-alike questions poorly (false hits; BENCHMARKS.md); \
                 --semantic-cache-embeddings-url names an embedding model"
            );
        }
        let semantic_cache = config.semantic_cache.enabled.then(|| {
            Arc::new(super::SemanticCache::new(
                config.semantic_cache.clone(),
                &mut registry,
            ))
        });
        Ok(HttpState {
            inner: Arc::new(Inner {
                backend,
                config,
                tokenizer,
                prompts,
                parse_tool_calls,
                responses,
                metrics,
                registry,
                draining: AtomicBool::new(false),
                ids: RequestIds::new(),
                started: unix_now(),
                access,
                tls,
                groups,
                semantic_cache,
            }),
        })
    }
}

impl HttpState {
    /// A builder of the state: `backend`, `config` and `tokenizer`, then the options of
    /// [`HttpStateBuilder`].
    pub fn builder(
        backend: Arc<dyn Backend>,
        config: HttpConfig,
        tokenizer: Arc<Tokenizer>,
    ) -> HttpStateBuilder {
        HttpStateBuilder {
            backend,
            config,
            tokenizer,
            registry: Registry::default(),
            template: None,
            groups: None,
        }
    }

    /// `builder(…).build()` for tests and tools whose configuration is known good.
    ///
    /// # Panics
    ///
    /// Where [`HttpStateBuilder::build`] fails.
    pub fn new(backend: Arc<dyn Backend>, config: HttpConfig, tokenizer: Arc<Tokenizer>) -> Self {
        match Self::builder(backend, config, tokenizer).build() {
            Ok(state) => state,
            Err(e) => panic!("invalid HTTP state: {e}"),
        }
    }

    /// From now on `GET /health` answers 503 and new generation requests get 503
    /// (`code: "draining"`); requests in flight finish. Not reversible.
    pub fn start_draining(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
    }

    pub(crate) fn groups(&self) -> Option<&Arc<GroupGate>> {
        self.inner.groups.as_ref()
    }

    pub(crate) fn semantic_cache(&self) -> Option<&Arc<super::SemanticCache>> {
        self.inner.semantic_cache.as_ref()
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

    /// The chat template and prompt tokenization.
    pub fn prompts(&self) -> &Prompts {
        &self.inner.prompts
    }

    /// Whether tool calls are parsed out of generated text.
    pub fn parses_tool_calls(&self) -> bool {
        self.inner.parse_tool_calls
    }

    pub(crate) fn responses_store(&self) -> &Arc<ResponseStore> {
        &self.inner.responses
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

    /// The API key table.
    pub(crate) fn access(&self) -> &Access {
        &self.inner.access
    }

    /// The listener's TLS, when configured.
    pub(crate) fn tls(&self) -> Option<&Arc<tokio_rustls::rustls::ServerConfig>> {
        self.inner.tls.as_ref()
    }

    pub(crate) fn ids(&self) -> &RequestIds {
        &self.inner.ids
    }

    /// Unix time the state was created (the `created` of the model object).
    pub(crate) fn started(&self) -> u64 {
        self.inner.started
    }
}

/// Keeps `state`'s keys file in force until `shutdown`: polls it, reloads it when it
/// changes, tells the backend the tenants' limits after each reload, and logs a refused
/// file as an error (the old table stays). Returns at once when there is no keys file.
pub async fn watch_api_keys(state: HttpState, shutdown: tokio_util::sync::CancellationToken) {
    let access = state.access();
    if access.config.api_keys_file.is_none() {
        return;
    }
    poll_until(access.config.reload_interval, &shutdown, || {
        // Reading a small file; a blocking thread is not worth it.
        match access.reload_if_changed() {
            None => {}
            Some(Ok(())) => state.backend().set_tenants(access.tenant_limits()),
            Some(Err(e)) => tracing::error!(
                error = %e,
                "the API keys file was refused; the previous keys stay in force"
            ),
        }
    })
    .await;
}

/// Calls `poll` every `interval` (10 ms at the least; a late tick is not made up with a burst)
/// until `shutdown`: the loop of each watched file (the API keys, the groups).
pub(crate) async fn poll_until(
    interval: Duration,
    shutdown: &tokio_util::sync::CancellationToken,
    mut poll: impl FnMut(),
) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = shutdown.cancelled() => return,
        }
        poll();
    }
}

/// Why a list of adapter names cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterNameError {
    #[error("a LoRA adapter name is empty")]
    Empty,
    #[error("LoRA adapter {0:?} has the served model's name")]
    BaseName(String),
    #[error("LoRA adapter {0:?} is listed twice")]
    Duplicate(String),
    #[error("LoRA adapter name {0:?} has whitespace or control characters")]
    BadCharacters(String),
}

/// Checks [`HttpConfig::lora_adapters`]: names non-empty, without whitespace or control
/// characters (they travel in HTTP bodies, gRPC strings and Prometheus labels), none the
/// served model's, none twice.
pub(crate) fn check_adapters(config: &HttpConfig) -> Result<(), AdapterNameError> {
    let mut seen = hashbrown::HashSet::new();
    for name in &config.lora_adapters {
        if name.is_empty() {
            return Err(AdapterNameError::Empty);
        }
        if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(AdapterNameError::BadCharacters(name.clone()));
        }
        if *name == config.served_model_name {
            return Err(AdapterNameError::BaseName(name.clone()));
        }
        if !seen.insert(name.as_str()) {
            return Err(AdapterNameError::Duplicate(name.clone()));
        }
    }
    Ok(())
}
