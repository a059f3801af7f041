//! The semantic cache: an answer served again for a request that means the same as one
//! answered before, looked up before routing and stored after a successful answer.
//!
//! # What is compared
//!
//! A chat's last [`SemanticCacheConfig::last_messages`] messages (system messages dropped
//! unless [`SemanticCacheConfig::include_system`]), as `role: text` lines, or a completion's
//! prompt text, embedded by the pool's own model (`/v1/embeddings`' path: one one-token request
//! through the same routing and flow control, billed to the same tenant). Two requests match
//! when the cosine distance (1 − cosine similarity) of their embeddings is at most
//! [`SemanticCacheConfig::threshold`] — Azure API Management's score threshold: 0.05
//! recommended, false hits grow above 0.2.
//!
//! Requests with tools, with logprobs, with token-id prompts, or on the Responses API are
//! neither looked up nor stored; nor is an answer that did not end by itself (a stop string
//! or the edge's `max_tokens` cut it), or that came as an engine's text without token ids.
//!
//! # Never between tenants
//!
//! Answers live in partitions keyed by the tenant, the request's cache salt (a client's
//! `cache_salt`, which keeps its KV apart, keeps its answers apart too), the model (and
//! adapter), and the values of the [`SemanticCacheConfig::vary_by`] headers; a lookup searches its own partition's index
//! only, so one tenant's answer never reaches another, whatever the prompts.
//!
//! # Bounds
//!
//! Entries expire [`SemanticCacheConfig::ttl`] after they were stored and the oldest go first
//! beyond [`SemanticCacheConfig::max_entries`] (all partitions together). The vector index is
//! `hnsw_rs`'s HNSW per partition, searched with a filter for live entries; a partition whose
//! dead entries outnumber its live ones is rebuilt from them.
//!
//! # A hit
//!
//! The answer's tokens go through the same output path as a backend's (the request's own
//! `max_tokens` and stop strings, its format, streamed as SSE when asked), with
//! `x-tandem-semantic-cache: hit` and the distance in `x-tandem-semantic-cache-distance`. A
//! miss says `miss` and goes on to the pool: its per-tenant limits apply to it as to any
//! request, so a cold or failing cache cannot overload the pool; an embedding that fails is a
//! miss.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue};
use futures::StreamExt;
use hashbrown::HashMap;
use hnsw_rs::prelude::{DistCosine, Hnsw};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::http::backend::{
    Endpoint, FinishReason, Generation, PromptSource, RouteInfo, TokenChunk, ValidRequest,
};
use crate::http::embeddings;
use crate::http::error::ServeError;
use crate::http::state::HttpState;

/// The most an embeddings endpoint may take to answer a lookup (a miss after it).
const EMBEDDING_TIMEOUT: Duration = Duration::from_secs(5);

/// The cache's knobs (`HttpConfig::semantic_cache`).
#[derive(Clone, Debug, PartialEq)]
pub struct SemanticCacheConfig {
    /// Off by default.
    pub enabled: bool,
    /// Largest cosine distance that is a hit (0.05).
    pub threshold: f32,
    /// How long an answer is served (1 hour).
    pub ttl: Duration,
    /// Most answers held, all partitions together (10,000).
    pub max_entries: usize,
    /// A chat's last this many messages are compared (4).
    pub last_messages: usize,
    /// Compare system messages too (no: an assistant's instructions rarely change what was
    /// asked, and would dominate a short question's embedding).
    pub include_system: bool,
    /// Request headers whose values partition the cache too (lower case), beside the tenant
    /// and the model, which always do.
    pub vary_by: Vec<String>,
    /// An OpenAI-compatible embeddings endpoint (the whole URL, `…/v1/embeddings`) to embed
    /// with instead of the pool's own model: an embedding model separates meanings far better
    /// than a small chat model's last hidden state (README, "Semantic cache").
    pub embeddings_url: Option<String>,
    /// The `model` sent to it.
    pub embeddings_model: Option<String>,
    /// Its API key (sent as a bearer token).
    pub embeddings_key: Option<ApiKey>,
}

/// An API key, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

/// (The threshold is never NaN: [`SemanticCacheConfig::validate`] refuses it.)
impl Eq for SemanticCacheConfig {}

impl Default for SemanticCacheConfig {
    fn default() -> Self {
        SemanticCacheConfig {
            enabled: false,
            threshold: 0.05,
            ttl: Duration::from_secs(3600),
            max_entries: 10_000,
            last_messages: 4,
            include_system: false,
            vary_by: Vec::new(),
            embeddings_url: None,
            embeddings_model: None,
            embeddings_key: None,
        }
    }
}

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SemanticCacheError {
    #[error("--semantic-cache-threshold must be in [0, 2], got {0}")]
    Threshold(f32),
    #[error("--semantic-cache-max-entries must be at least 1")]
    MaxEntries,
    #[error("--semantic-cache-messages must be at least 1")]
    Messages,
    #[error("--semantic-cache-embeddings-url {0:?}: {1}")]
    Url(String, String),
}

impl SemanticCacheConfig {
    pub fn validate(&self) -> Result<(), SemanticCacheError> {
        if !(0.0..=2.0).contains(&self.threshold) {
            return Err(SemanticCacheError::Threshold(self.threshold));
        }
        if self.max_entries == 0 {
            return Err(SemanticCacheError::MaxEntries);
        }
        if self.last_messages == 0 {
            return Err(SemanticCacheError::Messages);
        }
        if let Some(url) = &self.embeddings_url {
            let parsed = reqwest::Url::parse(url)
                .map_err(|e| SemanticCacheError::Url(url.clone(), e.to_string()))?;
            if !matches!(parsed.scheme(), "http" | "https") {
                return Err(SemanticCacheError::Url(url.clone(), "not http(s)".into()));
            }
        }
        if let Some(key) = &self.embeddings_key
            && HeaderValue::from_str(&format!("Bearer {}", key.0)).is_err()
        {
            return Err(SemanticCacheError::Url(
                self.embeddings_url.clone().unwrap_or_default(),
                "its API key is not a valid header value".into(),
            ));
        }
        Ok(())
    }
}

/// An answer kept: its tokens and how it ended.
#[derive(Debug)]
pub(crate) struct CachedAnswer {
    tokens: Vec<u32>,
    finish: FinishReason,
}

/// One stored answer of a partition.
struct Stored {
    embedding: Vec<f32>,
    answer: Arc<CachedAnswer>,
    at: Instant,
}

/// The answers of one partition, and their index (data id = position in `entries`).
struct Partition {
    index: Hnsw<'static, f32, DistCosine>,
    entries: Vec<Option<Stored>>,
    live: usize,
    dim: usize,
}

impl Partition {
    fn new(dim: usize, expected: usize) -> Self {
        Partition {
            // 16 links a node, 16 layers at most, 64 candidates while building: hnsw_rs's
            // usual settings for a few thousand points.
            index: Hnsw::new(16, expected.max(16), 16, 64, DistCosine {}),
            entries: Vec::new(),
            live: 0,
            dim,
        }
    }

    fn insert(&mut self, stored: Stored) -> usize {
        let id = self.entries.len();
        self.index.insert_slice((&stored.embedding, id));
        self.entries.push(Some(stored));
        self.live += 1;
        id
    }

    /// The nearest live entry to `v` and its distance.
    fn nearest(&self, v: &[f32]) -> Option<(usize, f32)> {
        let live = |id: &usize| self.entries.get(*id).is_some_and(Option::is_some);
        let found = self.index.search_filter(v, 1, 32, Some(&live));
        found.first().map(|n| (n.d_id, n.distance))
    }

    /// A new index over the live entries alone (their ids renumbered).
    fn rebuilt(self) -> Partition {
        let mut fresh = Partition::new(self.dim, self.live);
        for stored in self.entries.into_iter().flatten() {
            fresh.insert(stored);
        }
        fresh
    }
}

/// What the cache says of a request.
pub(crate) enum Lookup {
    /// Not eligible, or the cache is off: the request goes on as it would.
    Skip,
    /// A hit: the answer and its distance.
    Hit(Arc<CachedAnswer>, f32),
    /// A miss: after a successful answer, store it under this key and embedding.
    Miss(Box<StoreKey>),
}

impl Lookup {
    /// What the response says of it: `x-tandem-semantic-cache` and the hit's distance.
    pub(crate) fn header(&self) -> Option<(&'static str, Option<f32>)> {
        match self {
            Lookup::Skip => None,
            Lookup::Hit(_, d) => Some(("hit", Some(*d))),
            Lookup::Miss(_) => Some(("miss", None)),
        }
    }
}

/// Marks `response` with what the cache said (a hit was answered by no worker: no
/// `x-tandem-decode-worker`).
pub(crate) fn mark(
    response: &mut axum::response::Response,
    said: Option<(&'static str, Option<f32>)>,
) {
    let Some((what, distance)) = said else {
        return;
    };
    let h = response.headers_mut();
    h.insert("x-tandem-semantic-cache", HeaderValue::from_static(what));
    if let Some(d) = distance {
        h.remove("x-tandem-decode-worker");
        if let Ok(v) = HeaderValue::from_str(&format!("{d:.4}")) {
            h.insert("x-tandem-semantic-cache-distance", v);
        }
    }
}

/// Where a missed request's answer goes.
pub(crate) struct StoreKey {
    partition: Arc<str>,
    embedding: Vec<f32>,
}

#[derive(Debug, Default)]
struct Metrics {
    lookups: Counter,
    hits: Counter,
    stores: Counter,
    errors: Counter,
    entries: Gauge,
}

/// The cache (module docs).
pub struct SemanticCache {
    config: SemanticCacheConfig,
    inner: Mutex<Inner>,
    metrics: Metrics,
    /// For [`SemanticCacheConfig::embeddings_url`].
    client: reqwest::Client,
}

impl std::fmt::Debug for SemanticCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SemanticCache")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Inner {
    partitions: HashMap<Arc<str>, Partition>,
    /// (stored at, partition, id) of every entry stored, oldest first.
    order: VecDeque<(Instant, Arc<str>, usize)>,
    live: usize,
}

impl SemanticCache {
    /// The cache, its metrics registered under `tandem_frontend_semantic_cache_` in
    /// `registry`.
    pub fn new(config: SemanticCacheConfig, registry: &mut Registry) -> Self {
        let metrics = Metrics::default();
        let r = registry.sub_registry_with_prefix("tandem_frontend_semantic_cache");
        r.register(
            "lookups",
            "Requests looked up in the semantic cache",
            metrics.lookups.clone(),
        );
        r.register(
            "hits",
            "Requests answered from the semantic cache",
            metrics.hits.clone(),
        );
        r.register(
            "stores",
            "Answers stored in the semantic cache",
            metrics.stores.clone(),
        );
        r.register(
            "embedding_errors",
            "Lookups whose embedding failed (served as misses)",
            metrics.errors.clone(),
        );
        r.register(
            "entries",
            "Answers held by the semantic cache",
            metrics.entries.clone(),
        );
        SemanticCache {
            config,
            inner: Mutex::new(Inner::default()),
            metrics,
            client: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .timeout(EMBEDDING_TIMEOUT)
                .build()
                .unwrap_or_default(),
        }
    }

    pub fn config(&self) -> &SemanticCacheConfig {
        &self.config
    }

    /// The text compared for `req`, when it may be cached (module docs).
    pub(crate) fn key_text(&self, req: &ValidRequest) -> Option<String> {
        if !matches!(
            req.endpoint,
            Endpoint::Chat | Endpoint::Completion | Endpoint::Messages
        ) || req.logprobs.is_some()
        {
            return None;
        }
        let source = req.source.as_ref()?;
        if let Some(text) = source.as_completion() {
            return Some(text.to_string());
        }
        {
            {
                let chat = source.conversation()?;
                if chat.tools.is_some() {
                    return None;
                }
                let kept: Vec<_> = chat
                    .messages
                    .iter()
                    .filter(|m| self.config.include_system || m.role != "system")
                    .collect();
                let from = kept.len().saturating_sub(self.config.last_messages);
                let mut text = String::new();
                for m in &kept[from..] {
                    text.push_str(m.role);
                    text.push_str(": ");
                    text.push_str(&m.content.joined());
                    text.push('\n');
                }
                (!text.is_empty()).then_some(text)
            }
        }
    }

    /// The partition of `req`: its tenant, its cache salt (a client's `cache_salt` keeps its
    /// KV apart: its answers too), model and adapter, and the `vary_by` headers.
    pub(crate) fn partition(&self, req: &ValidRequest, headers: &HeaderMap) -> Arc<str> {
        let mut key = String::new();
        key.push_str(req.tenant.as_deref().unwrap_or(""));
        key.push('\u{0}');
        key.push_str(req.cache_salt.as_deref().unwrap_or(""));
        key.push('\u{0}');
        key.push_str(&req.model);
        key.push('\u{0}');
        key.push_str(req.adapter.as_deref().unwrap_or(""));
        for name in &self.config.vary_by {
            key.push('\u{0}');
            for v in headers.get_all(name.as_str()) {
                key.push_str(&String::from_utf8_lossy(v.as_bytes()));
                key.push('\u{1}');
            }
        }
        key.into()
    }

    /// Looks `embedding` up in `partition` at `now`.
    pub(crate) fn find(&self, partition: Arc<str>, embedding: Vec<f32>, now: Instant) -> Lookup {
        self.metrics.lookups.inc();
        let mut inner = self.inner.lock();
        self.expire(&mut inner, now);
        let hit = inner
            .partitions
            .get(&partition)
            .filter(|p| p.dim == embedding.len())
            .and_then(|p| {
                let (id, distance) = p.nearest(&embedding)?;
                let stored = p.entries.get(id)?.as_ref()?;
                (distance <= self.config.threshold).then(|| (stored.answer.clone(), distance))
            });
        match hit {
            Some((answer, distance)) => {
                self.metrics.hits.inc();
                Lookup::Hit(answer, distance)
            }
            None => Lookup::Miss(Box::new(StoreKey {
                partition,
                embedding,
            })),
        }
    }

    /// `text`'s embedding from the configured endpoint (OpenAI's embeddings API).
    async fn embed_remote(&self, url: &str, text: &str) -> Result<Vec<f32>, ServeError> {
        let fail = |why: String| ServeError::unavailable(format!("the embeddings endpoint: {why}"));
        let mut body = serde_json::json!({"input": text, "encoding_format": "float"});
        if let Some(model) = &self.config.embeddings_model {
            body["model"] = serde_json::json!(model);
        }
        let mut asked = self.client.post(url).json(&body);
        if let Some(key) = &self.config.embeddings_key {
            asked = asked.bearer_auth(&key.0);
        }
        let answer = asked.send().await.map_err(|e| fail(e.to_string()))?;
        let status = answer.status();
        if !status.is_success() {
            return Err(fail(format!("HTTP {status}")));
        }
        #[derive(serde::Deserialize)]
        struct Answer {
            data: Vec<Datum>,
        }
        #[derive(serde::Deserialize)]
        struct Datum {
            embedding: Vec<f32>,
        }
        let answer: Answer = answer.json().await.map_err(|e| fail(e.to_string()))?;
        let mut vector = answer
            .data
            .into_iter()
            .next()
            .map(|d| d.embedding)
            .filter(|v| !v.is_empty() && v.iter().all(|x| x.is_finite()))
            .ok_or_else(|| fail("no embedding in its answer".into()))?;
        // Cosine distance does not need it, but a zero vector would match nothing.
        let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        if norm == 0.0 {
            return Err(fail("a zero embedding".into()));
        }
        vector.iter_mut().for_each(|x| *x /= norm);
        Ok(vector)
    }

    /// Counts a lookup whose embedding failed.
    pub(crate) fn embedding_failed(&self) {
        self.metrics.lookups.inc();
        self.metrics.errors.inc();
    }

    /// Stores `answer` under `key` at `now`.
    fn store(&self, key: StoreKey, answer: CachedAnswer, now: Instant) {
        let mut inner = self.inner.lock();
        self.expire(&mut inner, now);
        let dim = key.embedding.len();
        let expected = self.config.max_entries.min(4096);
        let partition = inner
            .partitions
            .entry(key.partition.clone())
            .or_insert_with(|| Partition::new(dim, expected));
        if partition.dim != dim {
            // Another model's embeddings (a restart with another model): start again.
            *partition = Partition::new(dim, expected);
        }
        let id = partition.insert(Stored {
            embedding: key.embedding,
            answer: Arc::new(answer),
            at: now,
        });
        inner.order.push_back((now, key.partition, id));
        inner.live += 1;
        while inner.live > self.config.max_entries {
            let Some((at, p, id)) = inner.order.pop_front() else {
                break;
            };
            Self::drop_entry(&mut inner, &p, id, at);
        }
        self.metrics.stores.inc();
        self.metrics.entries.set(inner.live as i64);
    }

    /// Drops every entry older than the TTL at `now`.
    fn expire(&self, inner: &mut Inner, now: Instant) {
        while let Some((at, _, _)) = inner.order.front() {
            if now.saturating_duration_since(*at) < self.config.ttl {
                break;
            }
            let Some((at, p, id)) = inner.order.pop_front() else {
                break;
            };
            Self::drop_entry(inner, &p, id, at);
        }
        self.metrics.entries.set(inner.live as i64);
    }

    /// Drops entry `id` of partition `p` stored at `at` (if a rebuild has not renumbered
    /// it: then it is found by its time), rebuilding or removing the partition as it thins.
    fn drop_entry(inner: &mut Inner, p: &Arc<str>, id: usize, at: Instant) {
        let Some(part) = inner.partitions.get_mut(p) else {
            return;
        };
        let slot = match part.entries.get(id) {
            Some(Some(s)) if s.at == at => Some(id),
            // Renumbered by a rebuild: the oldest entry stored at `at`.
            _ => part
                .entries
                .iter()
                .position(|e| e.as_ref().is_some_and(|s| s.at == at)),
        };
        let Some(slot) = slot else {
            return;
        };
        part.entries[slot] = None;
        part.live -= 1;
        inner.live -= 1;
        if part.live == 0 {
            inner.partitions.remove(p);
        } else if part.entries.len() > 2 * part.live + 64
            && let Some(old) = inner.partitions.remove(p)
        {
            let fresh = old.rebuilt();
            // The queue's ids of this partition now point at renumbered entries: found
            // again by their time when they leave (above).
            inner.partitions.insert(p.clone(), fresh);
        }
    }

    /// Entries held (all partitions).
    pub fn len(&self) -> usize {
        self.inner.lock().live
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Looks `req` up (module docs): its key text embedded by the pool's model, under the
/// request's own tenant, priority and deadline.
pub(crate) async fn look_up(
    state: &HttpState,
    cache: &SemanticCache,
    req: &ValidRequest,
    headers: &HeaderMap,
) -> Lookup {
    let Some(text) = cache.key_text(req) else {
        return Lookup::Skip;
    };
    let pool_text = text.clone();
    let embedded = async {
        let text = pool_text;
        let tokens = state
            .tokenizer()
            .encode(&text)
            .map_err(|e| ServeError::internal(format!("the cache key: {e}")))?;
        if tokens.is_empty() || tokens.len() >= state.config().context_length as usize {
            return Err(ServeError::invalid(
                "the cache key does not fit the context",
            ));
        }
        let (id, response_id) = state.ids().next(Endpoint::Embeddings);
        let asked = ValidRequest {
            id,
            response_id,
            endpoint: Endpoint::Embeddings,
            prompt_tokens: tokens,
            source: Some(PromptSource::completion(text)),
            max_tokens: 1,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            logprobs: None,
            embed: true,
            stop: Vec::new(),
            ignore_eos: false,
            stream: false,
            include_usage: false,
            engine: Default::default(),
            // The base model embeds for every adapter (the partition keeps them apart).
            model: state.config().served_model_name.clone(),
            adapter: None,
            ..req.clone()
        };
        embeddings::embed_one(state, asked).await.map(|e| e.vector)
    };
    let embedded = async {
        match &cache.config.embeddings_url {
            Some(url) => cache.embed_remote(url, &text).await,
            None => embedded.await,
        }
    };
    match embedded.await {
        Ok(vector) => cache.find(cache.partition(req, headers), vector, Instant::now()),
        Err(e) => {
            tracing::debug!(error = %e, "semantic cache: the embedding failed (a miss)");
            cache.embedding_failed();
            Lookup::Skip
        }
    }
}

/// A hit's answer as a backend's generation: its tokens in one chunk, the whole prompt
/// counted as cached.
pub(crate) fn replay(answer: &CachedAnswer, prompt_tokens: u32) -> Generation {
    let chunk = TokenChunk {
        tokens: answer.tokens.clone(),
        finish: Some(answer.finish),
        cached_tokens: prompt_tokens,
        text: None,
        text_tokens: 0,
        logprobs: Vec::new(),
        embedding: Vec::new(),
    };
    Generation {
        route: RouteInfo {
            decode_worker: 0,
            prefill_worker: None,
        },
        chunks: futures::stream::iter([Ok(chunk)]).boxed(),
    }
}

/// `generation` with its answer stored in `cache` under `key` when it ends by itself (a
/// finish reason), with token ids and no error.
pub(crate) fn storing(
    generation: Generation,
    cache: Arc<SemanticCache>,
    key: Box<StoreKey>,
) -> Generation {
    struct Collect {
        tokens: Vec<u32>,
        ok: bool,
        key: Option<Box<StoreKey>>,
        cache: Arc<SemanticCache>,
    }
    let mut c = Collect {
        tokens: Vec::new(),
        ok: true,
        key: Some(key),
        cache,
    };
    let chunks = generation
        .chunks
        .map(move |item: Result<TokenChunk, ServeError>| {
            match &item {
                Ok(chunk) if c.ok => {
                    if chunk.text.is_some() {
                        c.ok = false;
                    }
                    c.tokens.extend_from_slice(&chunk.tokens);
                    if let Some(finish) = chunk.finish
                        && let Some(key) = c.key.take()
                    {
                        let answer = CachedAnswer {
                            tokens: std::mem::take(&mut c.tokens),
                            finish,
                        };
                        c.cache.store(*key, answer, Instant::now());
                    }
                }
                Ok(_) => {}
                Err(_) => c.ok = false,
            }
            item
        })
        .boxed();
    Generation {
        route: generation.route,
        chunks,
    }
}

#[cfg(test)]
#[path = "semantic_cache_tests.rs"]
mod tests;
