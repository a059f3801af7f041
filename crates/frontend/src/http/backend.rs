//! The seam between the HTTP edge and the routing glue: [`Backend`] and what crosses it.

use std::sync::Arc;
use std::time::Instant;

use std::sync::atomic::{AtomicU32, Ordering};
use tandem_router::Priority;

use futures::stream::BoxStream;

use super::error::ServeError;

/// Which endpoint a request came in on; decides the response shapes and the id prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`: the prompt is the chat template applied to `messages`.
    Chat,
    /// `POST /v1/completions`: the prompt is `prompt`, as text or token ids.
    Completion,
    /// `POST /v1/responses` (OpenAI Responses): the chat template applied to `input`.
    Responses,
    /// `POST /v1/messages` (Anthropic Messages): the chat template applied to `messages`.
    Messages,
    /// `POST /v1/embeddings`: one request per input, each answering its prompt's embedding
    /// with one token.
    Embeddings,
}

impl Endpoint {
    /// Every endpoint, for metrics that start at zero.
    pub const ALL: [Endpoint; 5] = [
        Endpoint::Chat,
        Endpoint::Completion,
        Endpoint::Responses,
        Endpoint::Messages,
        Endpoint::Embeddings,
    ];

    /// The label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completion",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
            Endpoint::Embeddings => "embeddings",
        }
    }

    /// The prefix of the response id (`chatcmpl-…`, `cmpl-…`, `resp_…`, `msg_…`), as OpenAI
    /// and Anthropic name them.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
            Endpoint::Responses => "resp",
            Endpoint::Messages => "msg",
            Endpoint::Embeddings => "embd",
        }
    }
}

/// A request that passed validation: the only form of a request past the HTTP edge
/// (docs/CONVENTIONS.md §3). Every field is in range: `prompt_tokens` is non-empty, `max_tokens >= 1`
/// and `prompt_tokens.len() + max_tokens <= context_length`, `temperature` in `[0, 2]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRequest {
    /// Unique within this frontend process (a counter); use it for tracking and cancellation.
    pub id: u64,
    /// The id shown to the client (`chatcmpl-<prefix>-<id>` / `cmpl-<prefix>-<id>`), also sent
    /// as `x-request-id`.
    pub response_id: String,
    pub endpoint: Endpoint,
    /// The model name the request asked for, shown in responses: the served model name or
    /// one of its LoRA adapters' (requests naming another model were refused with 404).
    pub model: String,
    /// The LoRA adapter it runs on (one of [`super::HttpConfig::lora_adapters`]); `None`: the
    /// base model. It joins the block-hash seed
    /// ([`tandem_protocol::HashSeed::for_request`]) and the route.
    pub adapter: Option<String>,
    /// The prompt after the chat template and tokenization; never empty.
    pub prompt_tokens: Vec<u32>,
    /// The prompt as the client wrote it (text or a conversation; `None` for token ids), for
    /// a worker whose engine takes text.
    pub source: Option<PromptSource>,
    /// Most tokens to generate, `>= 1`. The edge also enforces it on what the backend sends.
    pub max_tokens: u32,
    /// Sampling temperature in `[0, 2]`; 0 is greedy.
    pub temperature: f32,
    /// Nucleus sampling in `[0, 1]` (1: off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: u32,
    /// Drop tokens less likely than `min_p` times the most likely, in `[0, 1]` (0: none).
    pub min_p: f32,
    /// `Some(n)`: report each generated token's log-probability and the `n` (at most 20)
    /// most likely alternatives' (chat `logprobs` / `top_logprobs`, completions `logprobs`).
    pub logprobs: Option<u8>,
    /// Return the prompt's embedding with the first token ([`TokenChunk::embedding`]):
    /// `/v1/embeddings`.
    pub embed: bool,
    pub seed: Option<u64>,
    /// Stop strings (non-empty ones only). The edge applies them to the text itself and drops
    /// the stream at a match; a worker may use them too but does not have to.
    pub stop: Vec<String>,
    /// Keep generating past the end-of-sequence token (until `max_tokens`).
    pub ignore_eos: bool,
    pub stream: bool,
    /// `stream_options.include_usage` (only ever true when `stream`).
    pub include_usage: bool,
    /// Separates prefix-cache namespaces between tenants: blocks hashed with different salts
    /// never match.
    pub cache_salt: Option<String>,
    /// Unix time in seconds when the request arrived (the `created` field of responses).
    pub created: u64,
    /// Where the backend reports what the engine says about the request (its prompt
    /// length); the edge compares that with `prompt_tokens`.
    pub engine: EngineReport,
    /// Who sent it: the API key's tenant (or the `x-tandem-tenant` header when no keys are
    /// configured); None: anonymous. Flow control's fairness and rate limits are per tenant.
    pub tenant: Option<Arc<str>>,
    /// Its band in the frontend's queue (`priority` / `service_tier` field or the
    /// `x-tandem-priority` header).
    pub priority: Priority,
    /// What the router takes from the request besides its tokens: `kv` knob overrides, the
    /// expected output length, the session (`hints.rs`).
    pub routing: super::RoutingHints,
    /// When it must be done: arrival + its `timeout` (field or `x-tandem-timeout` header),
    /// capped by [`super::HttpConfig::request_timeout`]. Past it the request leaves the queue
    /// (429) or is cancelled on the workers.
    pub deadline: Instant,
}

/// A prompt as the client wrote it, kept (shared, not copied) for an engine that takes text
/// instead of token ids; rendered only when one is asked ([`PromptSource::text`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PromptSource(Arc<Source>);

#[derive(Debug, PartialEq)]
enum Source {
    Completion(String),
    Chat(crate::http::text::conversation::Conversation),
}

impl PromptSource {
    pub(crate) fn completion(text: String) -> Self {
        PromptSource(Arc::new(Source::Completion(text)))
    }

    pub(crate) fn chat(conversation: crate::http::text::conversation::Conversation) -> Self {
        PromptSource(Arc::new(Source::Chat(conversation)))
    }

    /// A completion's prompt text.
    pub(crate) fn as_completion(&self) -> Option<&str> {
        match &*self.0 {
            Source::Completion(t) => Some(t),
            Source::Chat(_) => None,
        }
    }

    /// A chat's conversation.
    pub(crate) fn conversation(&self) -> Option<&crate::http::text::conversation::Conversation> {
        match &*self.0 {
            Source::Chat(c) => Some(c),
            Source::Completion(_) => None,
        }
    }

    /// The prompt as the request plane carries it: a completions prompt as is, a
    /// conversation as chat completions' `messages` and `tools` JSON.
    pub fn text(&self) -> tandem_protocol::grpc::PromptText {
        use tandem_protocol::grpc::{ChatText, prompt_text::Kind};
        let kind = match &*self.0 {
            Source::Completion(t) => Kind::Completion(t.clone()),
            Source::Chat(c) => {
                let (messages_json, tools_json) = c.chat_json();
                Kind::Chat(ChatText {
                    messages_json,
                    tools_json,
                })
            }
        };
        tandem_protocol::grpc::PromptText { kind: Some(kind) }
    }
}

/// What the engine reported about a request, filled in by the backend while it streams (for
/// a worker: `GenerateChunk.prompt_tokens`) and read by the edge: a prompt length different
/// from the tokens the edge sent means the router and the engine tokenize differently
/// (counted in `tandem_frontend_prompt_token_mismatch_total`). Shared, cheap to clone;
/// setting it is optional.
#[derive(Clone, Debug, Default)]
pub struct EngineReport {
    /// 0: not reported.
    prompt_tokens: Arc<AtomicU32>,
}

impl EngineReport {
    /// The number of prompt tokens the engine saw (0 is taken as "not reported").
    pub fn set_prompt_tokens(&self, n: u32) {
        self.prompt_tokens.store(n, Ordering::Relaxed);
    }

    pub fn prompt_tokens(&self) -> Option<u32> {
        Some(self.prompt_tokens.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }
}

impl PartialEq for EngineReport {
    /// A side channel, not part of what a request is: any two are equal.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// `max_tokens` reached (or the context is full).
    Length,
    /// End-of-sequence token, or a stop string matched.
    Stop,
}

impl FinishReason {
    /// OpenAI's `finish_reason` value.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// One piece of output from the backend.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenChunk {
    /// Newly generated tokens, in order. May be empty (e.g. a chunk that only carries the
    /// finish). Must not contain the end-of-sequence token: these tokens are shown as text.
    pub tokens: Vec<u32>,
    /// Set on the last chunk only; the edge stops reading after it.
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from cache (local prefix cache or transferred), as the worker
    /// reports it. The edge reads the first chunk's for the `x-tandem-cached-tokens` header
    /// and the last chunk's for the usage: a worker in front of an external engine knows the
    /// engine's own count only at the end (its first chunk carries its estimate).
    pub cached_tokens: u32,
    /// The engine's own text, for an engine that answers text and no token ids (a plain
    /// OpenAI-compatible server behind `--backend-url`): shown as is instead of `tokens`
    /// (then empty) detokenized.
    pub text: Option<String>,
    /// With `text`: how many tokens it stands for (the engine's count; 0 when unknown).
    pub text_tokens: u32,
    /// When the request asked for them ([`ValidRequest::logprobs`]): one per entry of
    /// `tokens`; otherwise empty.
    pub logprobs: Vec<TokenLogprob>,
    /// With the first token of a request that asked for it ([`ValidRequest::embed`]): the
    /// prompt's embedding, unit length; otherwise (or from an engine without) empty.
    pub embedding: Vec<f32>,
}

/// A generated token's log-probability and the most likely alternatives', most likely
/// first (the model's distribution before temperature and the sampling cuts).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Where a request went: reported in the `x-tandem-*` response headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteInfo {
    pub decode_worker: u64,
    /// `Some` only when the prompt is prefilled on a separate (remote) worker.
    pub prefill_worker: Option<u64>,
}

/// A started generation: where it runs and its output.
pub struct Generation {
    pub route: RouteInfo,
    /// Output chunks, the last one with `finish` set. An `Err` item ends the generation (the
    /// edge reads nothing after it). Dropping the stream cancels the request on the workers.
    pub chunks: BoxStream<'static, Result<TokenChunk, ServeError>>,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("route", &self.route)
            .finish_non_exhaustive()
    }
}

/// What the HTTP edge needs from the rest of the frontend: route a validated request to
/// workers and stream its tokens back.
///
/// Errors are classified by their [`ServeError::kind`]; one returned by `generate`, or
/// yielded before the first chunk, becomes the HTTP status of the response (e.g.
/// [`ServeError::overloaded`] → 429 with `Retry-After`, [`ServeError::unavailable`] → 503).
/// Retries and re-routing before the first token are the backend's job: the edge does not
/// retry.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Routes and starts the request. Dropping the returned stream cancels it on the workers.
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError>;

    /// Takes one retry from the backend's retry budget, false when it is spent: a request
    /// the backend groups pass on to another endpoint or group draws on the same budget as
    /// the backend's own re-routes, so that retries do not multiply across the two layers.
    /// Backends that keep no budget allow every retry.
    fn try_retry(&self) -> bool {
        true
    }

    /// Whether the backend can take requests now (e.g. at least one decode worker known).
    /// Drives `GET /health`; generation requests are still passed to `generate`, which
    /// answers for itself.
    fn ready(&self) -> bool;

    /// The tenants the operator named (API keys file) and their limits, at start and after
    /// every reload; tenants not named get the backend's defaults. Backends without flow
    /// control ignore it.
    fn set_tenants(&self, tenants: Vec<(Arc<str>, tandem_router::TenantLimits)>) {
        let _ = tenants;
    }

    /// What the status page (`GET /status.json`) shows of the backend: a JSON object, for
    /// the cluster backend its `pools`, `workers`, recent `decisions` (each candidate's cost
    /// terms), `migrations` and `rejections` (see `cluster/status.rs`). `None`: nothing
    /// beyond what the edge knows itself.
    fn status(&self) -> Option<serde_json::Value> {
        None
    }
}
