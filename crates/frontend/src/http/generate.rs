//! The two generation endpoints: admission (drain check, bounded body, validation,
//! tokenization), the wait for the backend's first chunk, then an SSE stream or a whole
//! response.
//!
//! The response head is sent only after the first chunk, so that the `x-tandem-cached-tokens`
//! header carries the worker's report and a failure before the first token gets its own
//! status code (429, 503, …) even when streaming. After the head, a backend error ends the
//! stream with `data: {"error": {...}}` and then `data: [DONE]` (what vLLM does; clients that
//! only look for `[DONE]` still terminate). A backend stream that ends without a finish reason
//! is reported the same way, as an internal error.
//!
//! Dropping is cancelling: the backend stream is dropped when a stop string matches, when
//! `max_tokens` is reached, when the finish arrives, and when the client goes away (hyper
//! drops the handler future or the response body, which own it).

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use futures::stream::BoxStream;

use super::backend::{Endpoint, FinishReason, RouteInfo, TokenChunk, ValidRequest};
use super::error::ServeError;
use super::ids::unix_now;
use super::metrics::RequestRecord;
use super::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, CompletionChoice, Delta, ResponseObject, Usage,
    UsageField,
};
use super::output::Output;
use super::state::HttpState;
use super::validate::{self, Checked};

pub(crate) async fn chat_completions(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, Endpoint::Chat, headers, body).await
}

pub(crate) async fn completions(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, Endpoint::Completion, headers, body).await
}

async fn handle(state: HttpState, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let mut record = RequestRecord::start(state.metrics().clone(), endpoint);
    let req = match admit(&state, endpoint, &headers, body).await {
        Ok(req) => req,
        Err(e) => {
            record.status(e.status().as_u16());
            return e.into_response();
        }
    };
    tracing::debug!(
        id = req.id,
        endpoint = endpoint.as_str(),
        prompt_tokens = req.prompt_tokens.len(),
        max_tokens = req.max_tokens,
        stream = req.stream,
        "admitted"
    );
    respond(&state, req, record).await
}

/// Everything before the backend: drain check, body, validation, tokenization.
async fn admit(
    state: &HttpState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
) -> Result<ValidRequest, ServeError> {
    if state.is_draining() {
        return Err(
            ServeError::unavailable("the server is draining; retry on another replica")
                .with_code("draining"),
        );
    }
    let config = state.config();
    let bytes = read_body(headers, body, config.max_body_bytes).await?;
    let checked = match endpoint {
        Endpoint::Chat => validate::check_chat(validate::parse_json(&bytes)?, config)?,
        Endpoint::Completion => validate::check_completion(validate::parse_json(&bytes)?, config)?,
    };
    drop(bytes);
    let tokens = tokenize(state, &checked).await?;
    let ids = state.ids().next(endpoint);
    checked.into_valid(tokens, config, ids, unix_now())
}

async fn tokenize(state: &HttpState, checked: &Checked) -> Result<Vec<u32>, ServeError> {
    if !checked.is_large() {
        return checked.tokenize(state.tokenizer());
    }
    // Long prompts take milliseconds to tokenize: keep them off the async threads. The
    // blocking task is awaited right here, so it has an owner; if the client leaves, it runs
    // to completion and its result is dropped.
    let tokenizer = state.tokenizer().clone();
    let prompt = match &checked.prompt {
        validate::PromptInput::Text(t) => t.clone(),
        validate::PromptInput::Tokens(_) => return checked.tokenize(&tokenizer),
    };
    tokio::task::spawn_blocking(move || tokenizer.encode(&prompt))
        .await
        .map_err(|e| ServeError::internal(format!("tokenizer task failed: {e}")))?
        .map_err(|e| ServeError::invalid(format!("failed to tokenize the prompt: {e}")))
}

/// Reads at most `limit` bytes of body; more is a 413.
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ServeError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ServeError::payload_too_large(limit));
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    while let Some(piece) = stream.next().await {
        let piece = piece
            .map_err(|e| ServeError::invalid(format!("failed to read the request body: {e}")))?;
        if buf.len() + piece.len() > limit {
            return Err(ServeError::payload_too_large(limit));
        }
        buf.extend_from_slice(&piece);
    }
    Ok(Bytes::from(buf))
}

/// What every response object of one request shares.
#[derive(Debug)]
struct Meta {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Meta {
    /// `usage` on a streamed chunk: absent, or `null` when the client asked for usage.
    fn chunk_usage(&self) -> Option<Option<Usage>> {
        self.include_usage.then_some(None)
    }

    /// A response object of this request.
    fn object<C: serde::Serialize, U: UsageField>(
        &self,
        object: &'static str,
        choices: C,
        usage: U,
    ) -> String {
        to_json(&ResponseObject {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }

    /// The `object` of this request's chunks.
    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        }
    }

    /// The chat chunk that opens a stream: `delta: {"role": "assistant", "content": ""}`.
    fn role_chunk(&self) -> String {
        let choice = ChatChunkChoice {
            index: 0,
            delta: Delta {
                role: Some("assistant"),
                content: Some(""),
            },
            logprobs: None,
            finish_reason: None,
        };
        self.object("chat.completion.chunk", [choice], self.chunk_usage())
    }

    /// A content chunk; an empty `text` with a finish is sent as an empty delta.
    fn content_chunk(&self, text: &str, finish: Option<FinishReason>) -> String {
        let finish_reason = finish.map(FinishReason::as_str);
        let usage = self.chunk_usage();
        match self.endpoint {
            Endpoint::Chat => {
                let choice = ChatChunkChoice {
                    index: 0,
                    delta: Delta {
                        role: None,
                        content: (!text.is_empty()).then_some(text),
                    },
                    logprobs: None,
                    finish_reason,
                };
                self.object(self.chunk_object(), [choice], usage)
            }
            Endpoint::Completion => {
                let choice = CompletionChoice {
                    text,
                    index: 0,
                    logprobs: None,
                    finish_reason,
                };
                self.object(self.chunk_object(), [choice], usage)
            }
        }
    }

    /// The last chunk when `include_usage`: no choices, the usage.
    fn usage_chunk(&self, usage: Usage) -> String {
        self.object(self.chunk_object(), [(); 0], Some(Some(usage)))
    }

    /// The whole (non-streaming) response.
    fn full(&self, text: &str, finish: FinishReason, usage: Usage) -> String {
        match self.endpoint {
            Endpoint::Chat => {
                let choice = ChatChoice {
                    index: 0,
                    message: AssistantMessage {
                        role: "assistant",
                        content: text,
                        refusal: None,
                    },
                    logprobs: None,
                    finish_reason: finish.as_str(),
                };
                self.object("chat.completion", [choice], usage)
            }
            Endpoint::Completion => {
                let choice = CompletionChoice {
                    text,
                    index: 0,
                    logprobs: None,
                    finish_reason: Some(finish.as_str()),
                };
                self.object("text_completion", [choice], Some(Some(usage)))
            }
        }
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    // Our response types hold only strings, numbers and options: serializing cannot fail.
    serde_json::to_string(value).unwrap_or_else(|e| {
        ServeError::internal(format!("failed to serialize a response: {e}")).to_json()
    })
}

fn sse_event(json: &str) -> String {
    format!("data: {json}\n\n")
}

const SSE_DONE: &str = "data: [DONE]\n\n";

/// Runs an admitted request to its response.
async fn respond(state: &HttpState, req: ValidRequest, mut record: RequestRecord) -> Response {
    let meta = Meta {
        endpoint: req.endpoint,
        id: req.response_id.clone(),
        created: req.created,
        model: req.model.clone(),
        include_usage: req.include_usage,
    };
    let prompt_tokens = u32::try_from(req.prompt_tokens.len()).unwrap_or(u32::MAX);
    let stream = req.stream;
    let output = Output::new(state.tokenizer().clone(), req.stop.clone(), req.max_tokens);

    let generation = match state.backend().generate(req).await {
        Ok(g) => g,
        Err(e) => return fail(e, &meta.id, &mut record),
    };
    let route = generation.route;
    let mut chunks = generation.chunks;
    let first = match chunks.next().await {
        Some(Ok(chunk)) => chunk,
        Some(Err(e)) => return fail(e, &meta.id, &mut record),
        None => {
            let e = ServeError::internal("the backend ended the request before any output");
            return fail(e, &meta.id, &mut record);
        }
    };
    let cached_tokens = first.cached_tokens;
    record.first_chunk(prompt_tokens, cached_tokens);
    let mut headers = head(&meta.id, route, cached_tokens);

    if stream {
        record.status(200);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        headers.insert(
            HeaderName::from_static("x-accel-buffering"),
            HeaderValue::from_static("no"),
        );
        let sse = Sse {
            meta,
            chunks: Some(chunks),
            first: Some(first),
            output,
            usage: Usage::new(prompt_tokens, 0, cached_tokens),
            record,
            phase: Phase::Start,
        };
        let body = futures::stream::unfold(sse, |mut sse| async move {
            let bytes = sse.next_bytes().await?;
            Some((Ok::<_, std::convert::Infallible>(bytes), sse))
        });
        return (headers, Body::from_stream(body)).into_response();
    }

    let mut output = output;
    let mut text = String::new();
    let mut next = Some(first);
    let finish = loop {
        let chunk = match next.take() {
            Some(c) => c,
            None => match chunks.next().await {
                Some(Ok(c)) => c,
                Some(Err(e)) => return fail(e, &meta.id, &mut record),
                None => return fail(unfinished(), &meta.id, &mut record),
            },
        };
        let step = output.feed(&chunk);
        text.push_str(&step.text);
        if let Some(finish) = step.finish {
            break finish;
        }
    };
    // Cancel whatever the workers might still do (after a stop string or max_tokens).
    drop(chunks);
    let completion_tokens = output.completion_tokens();
    record.completion_tokens(completion_tokens);
    record.status(200);
    record.completed();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let usage = Usage::new(prompt_tokens, completion_tokens, cached_tokens);
    (headers, meta.full(&text, finish, usage)).into_response()
}

fn unfinished() -> ServeError {
    ServeError::internal("the backend ended the request without a finish reason")
}

/// An error response before the head, with the request id.
fn fail(e: ServeError, id: &str, record: &mut RequestRecord) -> Response {
    tracing::debug!(id, error = %e, kind = ?e.kind(), "request failed before the response head");
    record.status(e.status().as_u16());
    let mut response = e.into_response();
    if let Ok(v) = HeaderValue::from_str(id) {
        response.headers_mut().insert(X_REQUEST_ID, v);
    }
    response
}

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `x-request-id` and the `x-tandem-*` route headers.
fn head(id: &str, route: RouteInfo, cached_tokens: u32) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(id) {
        h.insert(X_REQUEST_ID, v);
    }
    h.insert(
        HeaderName::from_static("x-tandem-decode-worker"),
        HeaderValue::from(route.decode_worker),
    );
    if let Some(p) = route.prefill_worker {
        h.insert(
            HeaderName::from_static("x-tandem-prefill-worker"),
            HeaderValue::from(p),
        );
    }
    h.insert(
        HeaderName::from_static("x-tandem-cached-tokens"),
        HeaderValue::from(cached_tokens),
    );
    h
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing sent yet (chat sends the role chunk first).
    Start,
    /// Content chunks.
    Content,
    /// `[DONE]` sent.
    Done,
}

/// The streaming body's state. Owns the backend stream: dropping the body (client gone)
/// drops it, which cancels the request on the workers.
struct Sse {
    meta: Meta,
    chunks: Option<BoxStream<'static, Result<TokenChunk, ServeError>>>,
    first: Option<TokenChunk>,
    output: Output,
    usage: Usage,
    record: RequestRecord,
    phase: Phase,
}

impl Sse {
    /// The next piece of the body; `None` after `[DONE]`.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        if self.phase == Phase::Start {
            self.phase = Phase::Content;
            if self.meta.endpoint == Endpoint::Chat {
                return Some(Bytes::from(sse_event(&self.meta.role_chunk())));
            }
        }
        if self.phase == Phase::Done {
            return None;
        }
        loop {
            let item = match self.first.take() {
                Some(chunk) => Some(Ok(chunk)),
                None => match self.chunks.as_mut() {
                    Some(s) => s.next().await,
                    None => None,
                },
            };
            let chunk = match item {
                Some(Ok(chunk)) => chunk,
                Some(Err(e)) => return Some(self.end_with_error(e)),
                None => return Some(self.end_with_error(unfinished())),
            };
            let step = self.output.feed(&chunk);
            self.record
                .completion_tokens(self.output.completion_tokens());
            if step.text.is_empty() && step.finish.is_none() {
                continue;
            }
            let mut out = sse_event(&self.meta.content_chunk(&step.text, step.finish));
            if step.finish.is_some() {
                self.chunks = None;
                if self.meta.include_usage {
                    self.usage.completion_tokens = self.output.completion_tokens();
                    self.usage.total_tokens = self
                        .usage
                        .prompt_tokens
                        .saturating_add(self.usage.completion_tokens);
                    out.push_str(&sse_event(&self.meta.usage_chunk(self.usage)));
                }
                out.push_str(SSE_DONE);
                self.phase = Phase::Done;
                self.record.completed();
            }
            return Some(Bytes::from(out));
        }
    }

    fn end_with_error(&mut self, e: ServeError) -> Bytes {
        tracing::debug!(id = %self.meta.id, error = %e, "stream ended by a backend error");
        self.chunks = None;
        self.phase = Phase::Done;
        self.record.stream_error();
        self.record.completed();
        Bytes::from(format!("{}{SSE_DONE}", sse_event(&e.to_json())))
    }
}
