//! The OpenAI- and Anthropic-compatible HTTP edge of the frontend (docs/ARCHITECTURE.md §1,
//! §9, §10). It turns HTTP requests into [`ValidRequest`]s, hands them to a [`Backend`] (the routing glue
//! that talks to workers), and turns the backend's token chunks into responses and SSE
//! streams in the shape of the API the request came through.
//!
//! # Endpoints ([`app`])
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`: streaming (`stream: true`, SSE
//!   `data: {chunk}` … `data: [DONE]`) and whole responses, OpenAI's shapes.
//! - `POST /v1/responses`: the OpenAI Responses API (typed SSE events, `previous_response_id`
//!   over a bounded store); see `responses.rs` for what is served.
//! - `POST /v1/messages`: the Anthropic Messages API (its SSE events and error shape); see
//!   `messages.rs`.
//! - `GET /v1/models`, `GET /v1/models/{model}`: the served model and its LoRA adapters
//!   (`models.rs`).
//! - `GET /health`: 200 when the backend is ready and we are not draining, else 503.
//! - `GET /live`: 200 while the process serves HTTP at all.
//!
//! On the admin listener ([`admin_app`]; on the public one only to the admin key), with
//! `/health` and `/live`:
//! - `GET /metrics`: Prometheus (OpenMetrics text), see `metrics.rs`.
//! - `GET /`, `GET /status`: a live status page (one self-contained HTML file); `GET
//!   /status.json`: the data it polls (pools, workers, latency over the last minute, recent
//!   routing decisions with their cost terms, migrations, rejections), see `status.rs`.
//!
//! # Tenants, keys and TLS (`access/`)
//!
//! With API keys configured ([`HttpConfig::access`]: a keys file reloaded on change, and/or
//! a fixed list), the generation endpoints and `GET /v1/models…` need
//! `Authorization: Bearer <key>` or `x-api-key: <key>`, else 401; `/health` and `/live` stay
//! open for probes, and the operator's surfaces are the admin listener's (`auth.rs`, "The
//! operator's surfaces"). The key names the request's tenant; without
//! keys, `x-tandem-tenant` may (a gateway authenticated the user). A tenant's requests are
//! salted with its `cache_salt` or its name, narrowed by the request's `cache_salt`, so two
//! tenants never share KV blocks unless configured to. [`serve_state`] serves over TLS when
//! [`HttpConfig::tls`] names a certificate and key, and keeps the keys file reloaded.
//!
//! Response headers of generation requests: `x-request-id` (the response `id`),
//! `x-tandem-decode-worker`, `x-tandem-prefill-worker` (only when prefill was remote),
//! `x-tandem-cached-tokens`. The head waits for the backend's first chunk (see
//! `generate.rs`).
//!
//! # Chat templates and tokens
//!
//! Chat completions, Responses and Messages all become one conversation (`conversation.rs`)
//! and go through the same chat template ([`HttpConfig::chat_template`]: the built-in ChatML
//! default, a template file, or a `tokenizer_config.json`), rendered with Hugging Face's
//! semantics (`chat_template.rs`) and tokenized as Hugging Face does for chats, except that
//! special-token strings sent by clients stay text (`prompt.rs`). The same conversation gives
//! the same prompt tokens through any of the three APIs. Tool definitions reach the template
//! as `tools`; tool calls in the output (Hermes / Qwen `<tool_call>` blocks,
//! [`HttpConfig::tool_call_parser`], on by default when the template mentions `<tool_call>`)
//! come back as each API's tool calls (`tool_calls.rs`). A prompt length reported by the
//! engine ([`EngineReport`]) that differs from the tokens sent is counted in
//! `tandem_frontend_prompt_token_mismatch_total`.
//!
//! # Request fields (chat completions and completions)
//!
//! Served: `model` (optional: the served model name, or one of
//! [`HttpConfig::lora_adapters`] to run on that LoRA adapter; another name is 404),
//! `messages` (content as a string or a list of `{"type": "text", "text"}` parts; roles
//! `system`, `developer` (as system), `user`, `assistant` (with `tool_calls`), `tool` (with
//! `tool_call_id`); `name`), `tools`
//! (`{"type": "function", "function": {…}}`, passed to the template as given), `tool_choice`
//! (`auto`, `none`: tools are shown, calls not parsed), `prompt` (string, token ids, or a
//! one-element list of either), `max_tokens` / `max_completion_tokens` (the latter wins),
//! `temperature` (0..=2, default 1), `top_p` (0..=1, default 1), `top_k` (vLLM's: -1 or 0
//! is off), `min_p` (0..=1), `seed`, `stop` (string or list; text-level, see below),
//! `ignore_eos`, `stream`, `stream_options.include_usage`, `cache_salt`, `n` (must be 1),
//! and logprobs in OpenAI's shapes: chat `logprobs: true` with `top_logprobs` 0..=20
//! (`choices[].logprobs.content[]`: `token`, `logprob`, `bytes`, `top_logprobs`), completions
//! `logprobs` 0..=5 (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); streamed,
//! each chunk carries its tokens' entries. The log-probabilities are the model's before
//! temperature and the sampling cuts, as vLLM reports them.
//! Refused with 400 `unsupported_parameter`: `n` ≠ 1, `tool_choice` `required` or a named function, `response_format` other than text, `echo`,
//! `best_of` ≠ 1, `suffix`. Ignored: penalties, `user`, `logit_bias`, `parallel_tool_calls`,
//! and any unknown field. `Content-Type` is not checked (the body is parsed as JSON whatever
//! it says). Without `max_tokens`, a request gets [`HttpConfig::default_max_tokens`] lowered
//! to what fits in the context.
//!
//! Stop strings are matched on the generated text: the text is cut before the first match,
//! `finish_reason` is `stop`, and the backend stream is dropped so the workers stop. Empty
//! stop strings are ignored. `completion_tokens` counts the tokens received up to the match.
//!
//! # Status codes (one place: `error.rs`)
//!
//! | case                                                        | status | `code`                    |
//! |-------------------------------------------------------------|--------|---------------------------|
//! | API keys configured, and no key or an unknown one           | 401    | `invalid_api_key`         |
//! | malformed JSON                                              | 400    | `invalid_json`            |
//! | JSON of the wrong shape or types (`"max_tokens": "x"`)      | 422    | `invalid_type`            |
//! | unknown model                                               | 404    | `model_not_found`         |
//! | empty/missing `messages` or `prompt`, bad role, part, tool  | 400    | `null`                    |
//! | `x-tandem-tenant` not a valid tenant name (no keys configured) | 400 | `null` (`param` set)      |
//! | `max_tokens` ≤ 0, a sampling value or `top_logprobs` out of range, stop limits | 400 | `null` (`param` set) |
//! | unsupported parameter (`n` = 2, `echo`, `tool_choice: required`, …) | 400 | `unsupported_parameter` |
//! | the chat template's `raise_exception`, or a template failure | 400   | `chat_template_error`     |
//! | unknown `previous_response_id` (Responses)                  | 400    | `previous_response_not_found` |
//! | prompt ≥ context, or prompt + `max_tokens` > context        | 400    | `context_length_exceeded` |
//! | body over `max_body_bytes`                                  | 413    | `request_too_large`       |
//! | unknown path / wrong method                                 | 404 / 405 | `not_found` / `method_not_allowed` |
//! | draining                                                    | 503    | `draining`                |
//! | backend: overloaded                                         | 429 + `Retry-After` | `overloaded` |
//! | backend: unavailable (no workers)                           | 503    | `unavailable`             |
//! | backend: cancelled                                          | 499    | `cancelled`               |
//! | backend: internal, or a stream that ends before any output  | 500    | `internal_error`          |
//!
//! `/v1/messages` answers the same cases in Anthropic's error shape, with 400 for wrong
//! shapes, 401 `authentication_error` for keys, and 529 for overload (see `error.rs`). A backend error after the response head
//! (streaming) is sent as the API's error event: `data: {"error": …}` then `data: [DONE]`
//! (chat, completions), `error` then `response.failed` (Responses), `error` (Messages).
//! Non-streaming responses are sent whole, so a backend error at any point gets its own
//! status.
//!
//! # Layout
//!
//! Four groups around the shared core, each module also reachable by its own name here
//! (`crate::http::generate`):
//! - The core: `backend.rs` ([`Backend`], [`ValidRequest`], [`Generation`], [`TokenChunk`],
//!   [`EngineReport`]), `error.rs` ([`ServeError`], [`ErrorKind`], the status mapping, OpenAI
//!   and Anthropic), `state.rs` ([`HttpConfig`], [`HttpState`]; draining lives here).
//! - `api/`, the APIs and their formats: `generate.rs` (the generation handlers, the output
//!   pipeline, SSE); `validate.rs` (chat and completions bodies → [`ValidRequest`]),
//!   `body.rs`, `hints.rs` (routing hints), `openai.rs` (wire types), `format.rs`,
//!   `format_chat.rs`, `output.rs` (tokens → text with `max_tokens` and stop strings),
//!   `stop.rs`, `logprobs.rs`, `tool_calls.rs` ([`ToolCallParser`], the Hermes parser);
//!   `responses.rs` (+ `responses_store.rs`), `messages.rs` (the Responses and Messages
//!   APIs); `models.rs` (what a request's `model` names); `pyjson.rs` (order-keeping JSON
//!   and Python's `json.dumps`); `ids.rs` (request ids); `groups/` (backend groups: a model
//!   served by this pool and endpoints proxied to, in priority order, with spillover;
//!   [`GroupsOptions`], [`watch_groups`]).
//! - `text/`, templates and tokens: `conversation.rs` (the internal conversation),
//!   `chat_template.rs` ([`ChatTemplate`]) with `strftime.rs`, `prompt.rs` ([`Prompts`]:
//!   rendering and special-token-safe tokenization), `tokenizer.rs` ([`Tokenizer`],
//!   [`Detokenizer`]).
//! - `access/`, who may use the edge: `auth.rs` ([`AccessConfig`], the key table, tenants,
//!   their cache salts, the admin key, [`watch_api_keys`]), `tls.rs` ([`TlsConfig`]).
//! - `observe/`, what the operator sees: `metrics.rs` ([`HttpMetrics`]), `recent.rs`
//!   (latency over the last minute), `status.rs` with `status.html` (the status page and
//!   `/status.json`), `trace.rs` (spans).

//! # Invariants
//!
//! - Nothing past `generate::admit` sees a request that is not a [`ValidRequest`].
//! - Every error path answers with the API's error JSON; no handler panics on any input.
//! - Every stream ends with the API's last event (`data: [DONE]`, `response.completed` /
//!   `response.incomplete` / `response.failed`, `message_stop` / `error`), or is dropped by
//!   the client; dropping the response (or the handler future) drops the backend stream.
//! - Client text cannot become a special token of the model (`prompt.rs`).
//! - Memory per request is bounded: body by `max_body_bytes`, held-back stop text by
//!   `max_stop_bytes`, a held-back tool call by 1 MiB, pending UTF-8 by 4 bytes (tiktoken) or
//!   4 tokens (Hugging Face); the Responses store by [`ResponsesStoreConfig`].

mod access;
mod api;
mod observe;
mod text;

// The groups' modules, by their own names (`crate::http::generate`, …).
use access::{auth, tls};
use api::{
    body, embeddings, format, format_chat, generate, groups, hints, ids, logprobs, messages,
    models, openai, output, pyjson, responses, responses_store, semantic_cache, stop, tool_calls,
    validate,
};
use observe::{metrics, recent, status, trace};
pub use text::tokenizer;
use text::{chat_template, conversation, prompt, strftime};
mod backend;
mod error;
mod state;

#[cfg(test)]
mod tests;

pub(crate) use auth::ANONYMOUS;
pub use auth::{AccessConfig, AccessError, Listener};
pub use backend::{
    Backend, Endpoint, EngineReport, FinishReason, Generation, PromptSource, RouteInfo, TokenChunk,
    TokenLogprob, ValidRequest,
};
pub use body::{BodyCheck, endpoint_of};
pub use chat_template::{ChatTemplate, ChatTemplateError, ChatTemplateSpec, Clock};
pub use error::{ErrorKind, ServeError};
pub use groups::{EnvLookup, GroupsError, GroupsOptions, watch_groups};
pub use hints::{RoutingHints, SessionField};
pub use metrics::HttpMetrics;
pub(crate) use metrics::TenantLabels;
pub use prompt::Prompts;
pub use recent::{LatencySnapshot, Percentiles, RecentLatency, SlotPoint};
pub use responses_store::ResponsesStoreConfig;
pub use semantic_cache::{ApiKey, SemanticCache, SemanticCacheConfig, SemanticCacheError};
pub use state::AdapterNameError;
pub use state::watch_api_keys;
pub use state::{HttpConfig, HttpState, HttpStateBuilder, StateError};
pub use tls::{TlsConfig, TlsError};
pub use tokenizer::{Detokenizer, Tokenizer, TokenizerError, TokenizerSpec};
pub use tool_calls::ToolCallParser;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tandem_runtime::serving::ServingThreads;
use tokio_util::sync::CancellationToken;

/// The public listener's routes, ready to [`serve`]: the APIs, `/health` and `/live`; the
/// operator's surfaces only to the admin key (`auth.rs`, "The operator's surfaces").
pub fn app(state: HttpState) -> Router {
    routes(state, Listener::Public)
}

/// The admin listener's routes: the status page, `/status.json` and `/metrics` (behind the
/// admin key when there is one), `/health` and `/live`.
pub fn admin_app(state: HttpState) -> Router {
    routes(state, Listener::Admin)
}

fn routes(state: HttpState, listener: Listener) -> Router {
    let admin = Router::new()
        .route("/metrics", get(metrics))
        .route("/", get(status::page))
        .route("/status", get(status::page))
        .route("/status.json", get(status::data))
        .route_layer(axum::middleware::from_fn_with_state(
            (state.clone(), listener),
            admin_only,
        ));
    let router = match listener {
        Listener::Public => Router::new()
            .route("/v1/chat/completions", post(generate::chat_completions))
            .route("/v1/completions", post(generate::completions))
            .route("/v1/responses", post(generate::responses))
            .route("/v1/messages", post(generate::messages))
            .route("/v1/embeddings", post(embeddings::embeddings))
            .route("/v1/models", get(models::models))
            .route("/v1/models/{*model}", get(models::model)),
        Listener::Admin => Router::new(),
    };
    router
        .route("/health", get(health))
        .route("/live", get(live))
        .merge(admin)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are bounded by `max_body_bytes` in the handlers (to answer 413 in JSON): they
        // take the body as a stream (`axum::body::Body`), which axum's default body limit does
        // not touch, so no `DefaultBodyLimit` layer is needed (one would add a boxed future and
        // a request extension to every request).
        .with_state(state)
}

/// Lets a request through to an operator's surface only as `auth.rs` allows.
async fn admin_only(
    State((state, listener)): State<(HttpState, Listener)>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = request.uri().path().to_string();
    match state
        .access()
        .authorize_admin(request.headers(), listener, &path)
    {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then stops accepting, closes
/// idle connections and waits for responses in flight (streams included) to finish. Call
/// [`HttpState::start_draining`] first to turn new requests away while the load balancer
/// notices `/health`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: impl Into<Front>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_listener(with_nodelay(listener), app.into(), shutdown).await
}

/// Without TCP_NODELAY a small write (an SSE event, the tail of a body) waits behind the
/// previous unacknowledged one for the client's delayed ACK: tens of milliseconds a token.
fn with_nodelay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream> {
    use axum::serve::ListenerExt;
    listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set");
        }
    })
}

/// How long a client may take to send its request head; then its connection is closed.
/// (A client trickling a head byte by byte would otherwise hold a connection, and a file
/// descriptor, forever: slowloris.)
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// HTTP/1.1 connections served by hyper with a timer (so [`HEADER_READ_TIMEOUT`] applies).
fn http1() -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    builder
}

/// What a connection serves: a router, and on the public listener the generation
/// endpoints called straight, ahead of it.
#[derive(Clone, Debug)]
pub struct Front {
    app: Router,
    /// Set on the public listener ([`Front::public`]).
    direct: Option<HttpState>,
}

impl From<Router> for Front {
    fn from(app: Router) -> Self {
        Front { app, direct: None }
    }
}

impl Front {
    /// [`app`]`(state)`, with `POST /v1/chat/completions` and `POST /v1/completions` (the
    /// hot path) given to their handler without the router: the router's path match, the
    /// two extensions it inserts in every request and the box of its handler future cost a
    /// request about 4 % of a short chat's instructions. The handler is the same one the
    /// router calls (no layers are on these routes), so the answers are too.
    pub fn public(state: HttpState) -> Self {
        Front {
            app: app(state.clone()),
            direct: Some(state),
        }
    }
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Front {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures::future::Either<
        axum::routing::future::RouteFuture<std::convert::Infallible>,
        std::pin::Pin<Box<dyn Future<Output = Result<Response, std::convert::Infallible>> + Send>>,
    >;

    fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        use futures::future::Either;
        use tower_service::Service as _;
        if let Some(state) = &self.direct
            && req.method() == axum::http::Method::POST
        {
            let endpoint = match req.uri().path() {
                "/v1/chat/completions" => Some(Endpoint::Chat),
                "/v1/completions" => Some(Endpoint::Completion),
                _ => None,
            };
            if let Some(endpoint) = endpoint {
                let state = state.clone();
                let req = req.map(axum::body::Body::new);
                return Either::Right(Box::pin(async move {
                    Ok(generate::handle(state, endpoint, req).await)
                }));
            }
        }
        Either::Left(self.app.clone().call(req))
    }
}

/// Serves one connection, watched for a graceful shutdown.
async fn connection<I>(
    http1: hyper::server::conn::http1::Builder,
    io: I,
    front: Front,
    watcher: hyper_util::server::graceful::Watcher,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let conn = http1.serve_connection(hyper_util::rt::TokioIo::new(io), front);
    if let Err(e) = watcher.watch(conn).await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// The accept loop: each connection served on the calling runtime ([`connection`]); at
/// `shutdown`, no more accepts, idle connections close, requests in flight finish.
async fn serve_listener<L>(
    mut listener: L,
    front: Front,
    shutdown: CancellationToken,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let http1 = http1();
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        tokio::spawn(connection(
            http1.clone(),
            io,
            front.clone(),
            graceful.watcher(),
        ));
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// [`serve`], each connection served on one of `threads` (round robin; see
/// `tandem_runtime::serving`): the socket is handed over as it is accepted and registered
/// with that thread's runtime, where the whole connection then runs.
pub async fn serve_on_threads(
    listener: tokio::net::TcpListener,
    app: impl Into<Front>,
    shutdown: CancellationToken,
    threads: &tandem_runtime::serving::ServingThreads,
) -> std::io::Result<()> {
    let front = app.into();
    let mut listener = with_nodelay(listener);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let http1 = http1();
    loop {
        let (io, _) = tokio::select! {
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            () = shutdown.cancelled() => break,
        };
        let tcp = match io.into_std() {
            Ok(tcp) => tcp,
            Err(e) => {
                tracing::debug!(error = %e, "an accepted connection could not be handed over");
                continue;
            }
        };
        let (http1, front, watcher) = (http1.clone(), front.clone(), graceful.watcher());
        threads.spawn(move || async move {
            match tokio::net::TcpStream::from_std(tcp) {
                Ok(io) => connection(http1, io, front, watcher).await,
                Err(e) => tracing::debug!(error = %e, "a connection could not be registered"),
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// [`serve`], over TLS: connections are accepted after their TLS handshake (see `tls.rs`;
/// TCP_NODELAY as in `serve`), with the same graceful shutdown. `tls` comes from
/// [`HttpConfig::tls`] (loaded when the [`HttpState`] was made).
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: impl Into<Front>,
    tls: std::sync::Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_listener(tls::TlsListener::new(listener, tls), app.into(), shutdown).await
}

/// Serves `state`'s routes on `listener` (and the operator's surfaces on `admin`, when
/// given) as its config says: over TLS when [`HttpConfig::tls`] is set ([`serve_tls`]), else
/// plain ([`serve`]); and keeps its API keys file reloaded ([`watch_api_keys`]) while it
/// serves. Until `shutdown`, with `serve`'s graceful shutdown. The admin listener is plain
/// HTTP (loopback by default).
pub async fn serve_state(
    listener: tokio::net::TcpListener,
    admin: Option<tokio::net::TcpListener>,
    state: HttpState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Front::public(state.clone());
    // The watch ends with the server, whichever way the server ends.
    let watch_stop = shutdown.child_token();
    let watch = async {
        tokio::join!(
            watch_api_keys(state.clone(), watch_stop.clone()),
            groups::watch_groups(state.clone(), watch_stop.clone())
        );
    };
    let (admin_state, admin_stop) = (state.clone(), shutdown.clone());
    let admin = async move {
        match admin {
            Some(admin) => serve(admin, admin_app(admin_state), admin_stop).await,
            None => Ok(()),
        }
    };
    let served = async {
        let served = match state.tls() {
            Some(tls) => {
                tracing::info!(addr = ?listener.local_addr().ok(), "serving HTTPS (TLS 1.3)");
                serve_tls(listener, app, tls.clone(), shutdown).await
            }
            None => match state.config().serving_threads {
                0 => serve(listener, app, shutdown).await,
                n => {
                    let threads = ServingThreads::start(n, "tandem-http")?;
                    tracing::info!(threads = n, "HTTP connections served by their own threads");
                    serve_on_threads(listener, app, shutdown, &threads).await
                }
            },
        };
        watch_stop.cancel();
        served
    };
    let (served, admin, ()) = tokio::join!(served, admin, watch);
    served.and(admin)
}

fn json(body: String) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn health(State(state): State<HttpState>) -> Response {
    let (status, why) = if state.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if !state.backend().ready() {
        (StatusCode::SERVICE_UNAVAILABLE, "backend not ready")
    } else {
        (StatusCode::OK, "ok")
    };
    let body = serde_json::json!({ "status": why }).to_string();
    (status, json(body)).into_response()
}

async fn live() -> Response {
    json(r#"{"status":"ok"}"#.to_string())
}

async fn metrics(State(state): State<HttpState>) -> Response {
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, state.registry()) {
        return ServeError::internal(format!("failed to encode metrics: {e}")).into_response();
    }
    let content_type =
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8");
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

async fn not_found(uri: Uri) -> Response {
    ServeError::not_found(uri.path()).into_response()
}

async fn method_not_allowed() -> Response {
    ServeError::method_not_allowed().into_response()
}
