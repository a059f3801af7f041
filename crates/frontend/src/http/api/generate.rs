//! The generation endpoints: admission (drain check, bounded body, validation, the chat
//! template and tokenization), the wait for the backend's first chunk, then an SSE stream
//! or a whole response, in the shape of the API the request came through ([`Format`]:
//! `format_chat.rs`, `responses.rs`, `messages.rs`).
//!
//! The response head is sent only after the first chunk, so that the `x-tandem-cached-tokens`
//! header carries the worker's report and a failure before the first token gets its own
//! status code (429, 503, …) even when streaming, in the API's error shape. After the head,
//! a backend error ends the stream with the API's error event ([`Format::stream_error`]). A
//! backend stream that ends without a finish reason is reported the same way, as an internal
//! error.
//!
//! Output goes backend chunks → [`Output`] (detokenization, `max_tokens`, stop strings) →
//! the tool-call parser when the request has tools and the server parses them
//! (`tool_calls.rs`) → the format.
//!
//! Dropping is cancelling: the backend stream is dropped when a stop string matches, when
//! `max_tokens` is reached, when the finish arrives, and when the client goes away (hyper
//! drops the handler future or the response body, which own it).

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use futures::stream::BoxStream;
use tracing::Instrument as _;

use crate::http::backend::{
    Endpoint, EngineReport, FinishReason, RouteInfo, TokenChunk, ValidRequest,
};
use crate::http::error::ServeError;
use crate::http::format::{End, Format};
use crate::http::format_chat::ChatFormat;
use crate::http::groups;
use crate::http::hints;
use crate::http::ids::unix_now;
use crate::http::logprobs::Rendered;
use crate::http::messages;
use crate::http::metrics::RequestRecord;
use crate::http::openai::Usage;
use crate::http::output::Output;
use crate::http::responses;
use crate::http::semantic_cache::{self, Lookup};
use crate::http::state::HttpState;
use crate::http::tool_calls::{Piece, ToolCallStream};
use crate::http::trace;
use crate::http::validate::{self, Checked};

pub(crate) async fn chat_completions(State(state): State<HttpState>, request: Request) -> Response {
    handle(state, Endpoint::Chat, request).await
}

pub(crate) async fn completions(State(state): State<HttpState>, request: Request) -> Response {
    handle(state, Endpoint::Completion, request).await
}

pub(crate) async fn responses(State(state): State<HttpState>, request: Request) -> Response {
    handle(state, Endpoint::Responses, request).await
}

pub(crate) async fn messages(State(state): State<HttpState>, request: Request) -> Response {
    handle(state, Endpoint::Messages, request).await
}

/// A request ready for the backend, with the format of its response.
struct Admitted {
    req: ValidRequest,
    format: Box<dyn Format>,
    parse_tool_calls: bool,
}

/// The request is taken whole and its head's headers moved out: axum's `HeaderMap`
/// extractor clones them. [`crate::http::Front`] calls it without the router for
/// `POST /v1/chat/completions` and `POST /v1/completions`.
pub(crate) async fn handle(state: HttpState, endpoint: Endpoint, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    let span = trace::request_span(endpoint, &headers);
    let record = RequestRecord::start(state.metrics().clone(), endpoint).traced(span.clone());
    serve(state, endpoint, headers, body, record)
        .instrument(span)
        .await
}

async fn serve(
    state: HttpState,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
    mut record: RequestRecord,
) -> Response {
    let marks;
    let admitted = match receive(&state, &headers, body).await.and_then(|received| {
        let caller = caller(&state, &headers, &received)?;
        Ok((received, caller))
    }) {
        Ok((received, caller)) => {
            let demoted = caller.as_ref().is_some_and(|c| c.demoted);
            let received = match route_groups(&state, endpoint, caller.clone(), received).await {
                Grouped::Done(mut response) => {
                    if demoted {
                        groups::mark_demoted(&mut response);
                    }
                    record.status(response.status().as_u16());
                    return response;
                }
                Grouped::Pool(received, m) => {
                    marks = m;
                    received
                }
            };
            // The pool's answer is charged to the caller's budgets when its record ends.
            if let Some(gate) = state.groups() {
                let bill = match (&marks, caller) {
                    (Some(m), _) => Some(m.bill(gate)),
                    (None, Some(c)) => Some(gate.bill(c.payer, None)),
                    (None, None) => None,
                };
                if let Some(bill) = bill {
                    record.on_end(crate::http::metrics::EndHook(Box::new(move |end| {
                        if end.prompt_tokens + end.completion_tokens > 0 {
                            bill.settle(end.prompt_tokens, end.completion_tokens);
                        }
                    })));
                }
            }
            admit(&state, endpoint, &headers, received).await
        }
        Err(e) => {
            marks = None;
            Err(e)
        }
    };
    let (admitted, arm) = match admitted {
        Ok(mut a) => {
            // An A/B experiment places the request in an arm, and counts it there.
            let arm = state.groups().and_then(|g| g.assign_arm(&mut a.req));
            let arm = arm.map(|(header, hook)| {
                record.on_end(hook);
                header
            });
            (a, arm)
        }
        Err(e) => {
            let mut response = error_response(endpoint, e);
            if let (Some(m), Some(gate)) = (&marks, state.groups()) {
                m.apply(gate, &mut response);
            }
            record.status(response.status().as_u16());
            return response;
        }
    };
    let req = &admitted.req;
    trace::record_request(record.span(), req);
    tracing::debug!(
        id = req.id,
        endpoint = endpoint.as_str(),
        prompt_tokens = req.prompt_tokens.len(),
        max_tokens = req.max_tokens,
        stream = req.stream,
        "admitted"
    );
    let spill = marks.as_deref().is_some_and(groups::Marks::can_spill);
    // Before routing: an answer the semantic cache holds for a request that means the same.
    let cached = match state.semantic_cache() {
        Some(cache) => semantic_cache::look_up(&state, cache, &admitted.req, &headers).await,
        None => Lookup::Skip,
    };
    let said = cached.header();
    let answered = respond(&state, admitted, record, spill, cached).await;
    let (mut response, marks) = match (answered, marks) {
        (Ok(response), marks) => (response, marks),
        (Err((e, mut record)), Some(marks)) => {
            // The pool refused before anything went out: the groups may go on.
            let status = e.status().as_u16();
            let backend = state.backend();
            let try_retry = move || backend.try_retry();
            if let Some(gate) = state.groups() {
                let served = &state.config().served_model_name;
                if let Some(response) =
                    groups::after_pool_refusal(gate, endpoint, served, *marks, status, &try_retry)
                        .await
                {
                    record.status(response.status().as_u16());
                    return response;
                }
            }
            let response = error_response(endpoint, e);
            record.status(response.status().as_u16());
            return response;
        }
        (Err((e, mut record)), None) => {
            let response = error_response(endpoint, e);
            record.status(response.status().as_u16());
            return response;
        }
    };
    if let (Some(m), Some(gate)) = (&marks, state.groups()) {
        m.apply(gate, &mut response);
    }
    if let Some(arm) = arm {
        response.headers_mut().insert("x-tandem-experiment", arm);
    }
    semantic_cache::mark(&mut response, said);
    response
}

/// A request's body, read after its key and the drain were checked.
pub(crate) struct Received {
    pub(crate) tenant: Option<crate::http::auth::Tenant>,
    pub(crate) arrived: std::time::Instant,
    pub(crate) bytes: Bytes,
}

/// Where the backend groups sent a request (`groups.rs`).
enum Grouped {
    Done(Response),
    /// The usual path (no groups for its model, or its pool group), with the groups'
    /// headers where they chose the pool.
    Pool(Received, Option<Box<groups::Marks>>),
}

/// Who a request is for and what its budgets allow, where the groups file is in force:
/// over a budget, demoted to its model's batch group or refused.
fn caller(
    state: &HttpState,
    headers: &HeaderMap,
    received: &Received,
) -> Result<Option<groups::Caller>, ServeError> {
    let Some(gate) = state.groups() else {
        return Ok(None);
    };
    // The one read of the body before it is validated (the groups route on its model).
    let field = hints::session_member(&state.config().session_field);
    let head = hints::head_of(&received.bytes, field);
    let payer = groups::Payer::of(received.tenant.as_ref(), headers, &head);
    let demoted = gate.check_budget(&payer, head.model.as_deref())?;
    // A client may send a cascade's request to its large model at once.
    let escalate = headers
        .get("x-tandem-escalate")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes"));
    Ok(Some(groups::Caller {
        payer,
        demoted,
        escalate,
        model: head.model,
        max_tokens: head.max_tokens,
    }))
}

async fn route_groups(
    state: &HttpState,
    endpoint: Endpoint,
    caller: Option<groups::Caller>,
    received: Received,
) -> Grouped {
    let (Some(gate), Some(caller)) = (state.groups(), caller) else {
        return Grouped::Pool(received, None);
    };
    if !caller.model.as_deref().is_some_and(|m| gate.serves(m)) {
        return Grouped::Pool(received, None);
    }
    let pool_open = state.backend().ready();
    let served = &state.config().served_model_name;
    let backend = state.backend();
    let try_retry = move || backend.try_retry();
    let routed = groups::serve(
        gate,
        endpoint,
        pool_open,
        served,
        received.bytes.clone(),
        caller,
        &try_retry,
    )
    .await;
    match routed {
        groups::Routed::Done(response) => Grouped::Done(response),
        groups::Routed::Pool { body, marks } => Grouped::Pool(
            Received {
                bytes: body,
                ..received
            },
            Some(Box::new(marks)),
        ),
    }
}

/// An error response in the shape of `endpoint`'s API.
pub(crate) fn error_response(endpoint: Endpoint, e: ServeError) -> Response {
    match endpoint {
        Endpoint::Messages => e.into_anthropic_response(),
        _ => e.into_response(),
    }
}

/// The API key, the drain check and the body: what comes before anything is parsed.
pub(crate) async fn receive(
    state: &HttpState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Received, ServeError> {
    // First, before the body is even read: a client without a valid key costs nothing.
    let tenant = state.access().authenticate(headers)?;
    if state.is_draining() {
        return Err(
            ServeError::unavailable("the server is draining; retry on another replica")
                .with_code("draining"),
        );
    }
    let arrived = std::time::Instant::now();
    let bytes = read_body(headers, body, state.config().max_body_bytes).await?;
    Ok(Received {
        tenant,
        arrived,
        bytes,
    })
}

/// Everything else before the backend: validation, tokenization, the tenant and its cache
/// salt.
async fn admit(
    state: &HttpState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    received: Received,
) -> Result<Admitted, ServeError> {
    let Received {
        tenant,
        arrived,
        bytes,
    } = received;
    let config = state.config();
    let mut context = None;
    let checked = match endpoint {
        Endpoint::Chat => validate::check_chat(validate::parse_json(&bytes)?, config)?,
        Endpoint::Completion => validate::check_completion(validate::parse_json(&bytes)?, config)?,
        Endpoint::Responses => {
            let (checked, ctx) = responses::check(validate::parse_json(&bytes)?, state)?;
            context = Some(ctx);
            checked
        }
        Endpoint::Messages => messages::check(validate::parse_json(&bytes)?, config)?,
        // (Embeddings have their own admission, one request per input: `embeddings.rs`.)
        Endpoint::Embeddings => {
            return Err(ServeError::internal(
                "an embeddings request reached the generation path",
            ));
        }
    };
    let custom_session = match &config.session_field {
        crate::http::SessionField::Field(name) => hints::session_from_body(&bytes, name),
        _ => None,
    };
    drop(bytes);
    let (checked, tokens) = tokenize(state, checked)
        .instrument(tracing::info_span!("tokenize"))
        .await?;
    let parse_tool_calls = state.parses_tool_calls() && checked.wants_tool_calls;
    let ids = state.ids().next(endpoint);
    // The deadline counts from arrival, tokenization included.
    let mut req = checked.into_valid(tokens, config, ids, (unix_now(), arrived))?;
    crate::http::body::finish(&mut req, headers, config, arrived, custom_session, tenant)?;
    let format: Box<dyn Format> = match (endpoint, context) {
        (Endpoint::Responses, Some(ctx)) => Box::new(responses::ResponsesFormat::new(
            &req,
            ctx,
            state.responses_store().clone(),
        )),
        (Endpoint::Messages, _) => Box::new(messages::MessagesFormat::new(&req)),
        _ => Box::new(ChatFormat::new(&req)),
    };
    Ok(Admitted {
        req,
        format,
        parse_tool_calls,
    })
}

/// Tokenizes (through the chat template for conversations). Long prompts take milliseconds:
/// they go to a blocking thread, awaited right here so it has an owner; if the client
/// leaves, it runs to completion and its result is dropped.
pub(crate) async fn tokenize(
    state: &HttpState,
    checked: Checked,
) -> Result<(Checked, Vec<u32>), ServeError> {
    if !checked.is_large() {
        let tokens = checked.tokenize(state.tokenizer(), state.prompts())?;
        return Ok((checked, tokens));
    }
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        let tokens = checked.tokenize(state.tokenizer(), state.prompts())?;
        Ok((checked, tokens))
    })
    .await
    .map_err(|e| ServeError::internal(format!("tokenizer task failed: {e}")))?
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
    let read = async {
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(|e| {
                ServeError::invalid(format!("failed to read the request body: {e}"))
            })?;
            if buf.len() + piece.len() > limit {
                return Err(ServeError::payload_too_large(limit));
            }
            buf.extend_from_slice(&piece);
        }
        Ok(())
    };
    // A client trickling its body would hold the request (counted in flight, delaying a
    // drain) for as long as it likes.
    tokio::time::timeout(BODY_READ_TIMEOUT, read)
        .await
        .map_err(|_| ServeError::request_timeout(BODY_READ_TIMEOUT))??;
    Ok(Bytes::from(buf))
}

/// How long a client may take to send its request body.
const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Backend chunks → text and tool calls.
#[derive(Debug)]
struct Pipeline {
    output: Output,
    tools: Option<ToolCallStream>,
    /// Logprobs of tokens whose text has not been released yet: they go out with it.
    logprobs: Vec<Rendered>,
}

/// What one chunk released.
struct Fed {
    pieces: Vec<Piece>,
    /// The logprobs of the tokens behind `pieces` (and any held back before).
    logprobs: Vec<Rendered>,
    /// Set when the output is over: the reason and the stop string that matched.
    finish: Option<(FinishReason, Option<String>)>,
}

impl Pipeline {
    fn feed(&mut self, chunk: &TokenChunk) -> Fed {
        let step = self.output.feed(chunk);
        let mut pieces = match &mut self.tools {
            Some(tools) => tools.push(&step.text),
            None if step.text.is_empty() => Vec::new(),
            None => vec![Piece::Text(step.text)],
        };
        if step.finish.is_some()
            && let Some(tools) = &mut self.tools
        {
            pieces.extend(tools.finish());
        }
        self.logprobs.extend(step.logprobs);
        let release = !pieces.is_empty() || step.finish.is_some();
        Fed {
            pieces,
            logprobs: if release {
                std::mem::take(&mut self.logprobs)
            } else {
                Vec::new()
            },
            finish: step.finish.map(|f| (f, step.stop_sequence)),
        }
    }

    fn tool_calls(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| t.calls() > 0)
    }

    fn completion_tokens(&self) -> u32 {
        self.output.completion_tokens()
    }
}

/// Tool-call ids of a response: `call_<response id's letters and digits>_<n>`.
fn call_id_prefix(response_id: &str) -> String {
    let mut prefix: String = response_id
        .split(['-', '_'])
        .skip(1)
        .collect::<Vec<_>>()
        .concat();
    prefix.push('_');
    prefix
}

/// Runs an admitted request to its response.
/// `spill`: a refusal before the response head (the backend's own error) is handed back
/// unanswered, for the backend groups to send the request on.
async fn respond(
    state: &HttpState,
    admitted: Admitted,
    mut record: RequestRecord,
    spill: bool,
    cached: Lookup,
) -> Result<Response, (ServeError, RequestRecord)> {
    let Admitted {
        req,
        mut format,
        parse_tool_calls,
    } = admitted;
    let endpoint = req.endpoint;
    let id = req.response_id.clone();
    let prompt_tokens = u32::try_from(req.prompt_tokens.len()).unwrap_or(u32::MAX);
    // The usage counts the prompt as the engine did where it says (a server that takes text
    // renders and tokenizes it its own way), else as the frontend did.
    let engine = req.engine.clone();
    let stream = req.stream;
    let mut pipeline = Pipeline {
        output: Output::new(state.tokenizer().clone(), req.stop.clone(), req.max_tokens),
        tools: parse_tool_calls.then(|| ToolCallStream::new(call_id_prefix(&id))),
        logprobs: Vec::new(),
    };
    record.sent(req.id, req.prompt_tokens.len(), req.engine.clone());

    let generation = match cached {
        Lookup::Hit(answer, _) => semantic_cache::replay(&answer, prompt_tokens),
        cached => match state.backend().generate(req).await {
            Ok(g) => match (cached, state.semantic_cache()) {
                (Lookup::Miss(key), Some(cache)) => semantic_cache::storing(g, cache.clone(), key),
                _ => g,
            },
            Err(e) if spill && tandem_router::groups::spills(e.status().as_u16(), false) => {
                return Err((e, record));
            }
            Err(e) => return Ok(fail(endpoint, e, &id, &mut record)),
        },
    };
    let route = generation.route;
    record.span().record(
        "tandem.decode_worker",
        tandem_runtime::telemetry::int(route.decode_worker),
    );
    if let Some(p) = route.prefill_worker {
        record
            .span()
            .record("tandem.prefill_worker", tandem_runtime::telemetry::int(p));
    }
    let mut chunks = generation.chunks;
    let first = match chunks.next().await {
        Some(Ok(chunk)) => chunk,
        Some(Err(e)) => return Ok(fail(endpoint, e, &id, &mut record)),
        None => {
            let e = ServeError::internal("the backend ended the request before any output");
            return Ok(fail(endpoint, e, &id, &mut record));
        }
    };
    let cached_tokens = first.cached_tokens;
    record.first_chunk(prompt_tokens, cached_tokens);
    let mut headers = head(&id, route, cached_tokens);

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
        let stream_span = tracing::info_span!(parent: record.span(), "stream");
        let sse = Sse {
            id,
            format,
            chunks: Some(chunks),
            first: Some(first),
            pipeline,
            prompt_tokens,
            engine,
            record,
            phase: Phase::Start,
            span: stream_span,
        };
        let body = futures::stream::unfold(sse, |mut sse| async move {
            let span = sse.span.clone();
            let bytes = sse.next_bytes().instrument(span).await?;
            Some((Ok::<_, std::convert::Infallible>(bytes), sse))
        });
        return Ok((headers, Body::from_stream(body)).into_response());
    }

    let mut pieces = Vec::new();
    let mut logprobs = Vec::new();
    let usage_cached;
    let mut next = Some(first);
    let (finish, stop_sequence) = loop {
        let chunk = match next.take() {
            Some(c) => c,
            None => match chunks.next().await {
                Some(Ok(c)) => c,
                Some(Err(e)) => return Ok(fail(endpoint, e, &id, &mut record)),
                None => return Ok(fail(endpoint, unfinished(), &id, &mut record)),
            },
        };
        let fed = pipeline.feed(&chunk);
        record.completion_tokens(pipeline.completion_tokens());
        pieces.extend(fed.pieces);
        logprobs.extend(fed.logprobs);
        if let Some(finish) = fed.finish {
            // An external engine's own count comes with its last chunk (its usage); the
            // first chunk's was the worker's estimate (the header keeps that one).
            usage_cached = chunk.cached_tokens;
            record.finish_reason(finish.0.as_str());
            break finish;
        }
    };
    // Cancel whatever the workers might still do (after a stop string or max_tokens).
    drop(chunks);
    let completion_tokens = pipeline.completion_tokens();
    record.completion_tokens(completion_tokens);
    record.status(200);
    record.completed();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let end = End {
        finish,
        stop_sequence,
        usage: Usage::new(
            engine.prompt_tokens().unwrap_or(prompt_tokens),
            completion_tokens,
            usage_cached,
        ),
        tool_calls: pipeline.tool_calls(),
    };
    // The head's map becomes the response's (as a `(headers, body)` pair it would be
    // merged into a second map, made for the body's own content type).
    let mut response = Response::new(Body::from(format.whole(pieces, &logprobs, &end)));
    *response.headers_mut() = headers;
    Ok(response)
}

fn unfinished() -> ServeError {
    ServeError::internal("the backend ended the request without a finish reason")
}

/// An error response before the head, with the request id.
fn fail(endpoint: Endpoint, e: ServeError, id: &str, record: &mut RequestRecord) -> Response {
    tracing::debug!(id, error = %e, kind = ?e.kind(), "request failed before the response head");
    let mut response = error_response(endpoint, e);
    record.status(response.status().as_u16());
    if let Ok(v) = HeaderValue::from_str(id) {
        response.headers_mut().insert(X_REQUEST_ID, v);
    }
    response
}

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `x-request-id` and the `x-tandem-*` route headers.
fn head(id: &str, route: RouteInfo, cached_tokens: u32) -> HeaderMap {
    // Room for these and the content headers a response adds, so that the map never grows.
    let mut h = HeaderMap::with_capacity(8);
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
    /// Nothing sent yet (the format's opening events come first).
    Start,
    /// Content.
    Content,
    /// The stream's last event sent.
    Done,
}

/// The streaming body's state. Owns the backend stream: dropping the body (client gone)
/// drops it, which cancels the request on the workers.
struct Sse {
    id: String,
    format: Box<dyn Format>,
    chunks: Option<BoxStream<'static, Result<TokenChunk, ServeError>>>,
    first: Option<TokenChunk>,
    pipeline: Pipeline,
    prompt_tokens: u32,
    /// What the engine counted of the prompt (the usage's count where it says).
    engine: EngineReport,
    record: RequestRecord,
    phase: Phase,
    /// The response body from the first token to the last.
    span: tracing::Span,
}

impl Sse {
    /// The next piece of the body; `None` after the last event.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        if self.phase == Phase::Start {
            self.phase = Phase::Content;
            let opening = self.format.open();
            if !opening.is_empty() {
                return Some(Bytes::from(opening));
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
            let fed = self.pipeline.feed(&chunk);
            let completion_tokens = self.pipeline.completion_tokens();
            self.record.completion_tokens(completion_tokens);
            if fed.pieces.is_empty() && fed.finish.is_none() {
                continue;
            }
            let Some((finish, stop_sequence)) = fed.finish else {
                return Some(Bytes::from(self.format.step(
                    fed.pieces,
                    &fed.logprobs,
                    None,
                )));
            };
            self.chunks = None;
            self.record.finish_reason(finish.as_str());
            // As in the whole response: the last chunk has the engine's own count.
            let end = End {
                finish,
                stop_sequence,
                usage: Usage::new(
                    self.engine.prompt_tokens().unwrap_or(self.prompt_tokens),
                    completion_tokens,
                    chunk.cached_tokens,
                ),
                tool_calls: self.pipeline.tool_calls(),
            };
            let out = self.format.step(fed.pieces, &fed.logprobs, Some(&end));
            self.phase = Phase::Done;
            self.record.completed();
            return Some(Bytes::from(out));
        }
    }

    fn end_with_error(&mut self, e: ServeError) -> Bytes {
        tracing::debug!(id = %self.id, error = %e, "stream ended by a backend error");
        self.chunks = None;
        self.phase = Phase::Done;
        self.record.stream_error();
        self.record.completed();
        Bytes::from(self.format.stream_error(&e))
    }
}
