//! The HTTP side of an external engine: generation over its API, streamed token ids out, its
//! health and its Prometheus text.
//!
//! Token ids go in and come out, so the engine prefills exactly the tokens the router hashed
//! and the frontend detokenizes what the engine sampled:
//!
//! - **vLLM** (and `openai`, any server speaking vLLM's extensions): `POST /v1/completions`
//!   with `prompt` as a list of token ids and `return_token_ids: true`; every streamed
//!   choice then carries the ids it adds (`token_ids`). Fields follow vLLM's
//!   `vllm/entrypoints/openai/protocol.py` (`CompletionRequest`: `stop_token_ids`,
//!   `ignore_eos`, `seed`, `top_p`, `top_k`, `min_p`, `cache_salt`, `kv_transfer_params`, `return_token_ids`,
//!   `stream_options.include_usage`; `CompletionResponseStreamChoice.token_ids`; the final
//!   usage chunk's `prompt_tokens_details.cached_tokens`, present when vLLM runs with
//!   `--enable-prompt-tokens-details`; `kv_transfer_params` on the response). llama.cpp's
//!   server reports its prompt cache in `timings` instead (`cache_n`, `prompt_n`,
//!   `predicted_n`), read where the usage lacks them.
//! - **SGLang**: its native `POST /generate` (`python/sglang/srt/managers/io_struct.py`,
//!   `GenerateReqInput`: `input_ids`, `sampling_params` with `max_new_tokens`, `temperature`,
//!   `top_p`, `top_k`, `min_p`, `stop_token_ids`, `ignore_eos`; `bootstrap_host`, `bootstrap_port`,
//!   `bootstrap_room` for disaggregation). Each streamed object has `output_ids` — all ids so
//!   far unless the server runs with `--incremental-streaming-output` — and `meta_info`
//!   (`prompt_tokens`, `completion_tokens`, `cached_tokens`, `finish_reason.type`).
//!
//! Logprobs are asked in each engine's own terms and come back as token ids:
//!
//! - **vLLM**: `logprobs: N` (the completions API's count of alternatives) with
//!   `return_tokens_as_token_ids: true`, so every token in the answer is named
//!   `token_id:<id>` (`vllm/entrypoints/openai/serving_engine.py`, `_get_decoded_token`).
//!   Each streamed choice then has `logprobs` (`CompletionLogProbs`: `token_logprobs`, one
//!   per `token_ids` entry, and `top_logprobs`, one map of token to log-probability per
//!   token, holding the sampled token and the `N` most likely; `-9999.0` stands for
//!   minus infinity).
//! - **SGLang**: `return_logprob: true`, `top_logprobs_num: N` and `logprob_start_len: -1`
//!   (output tokens only). `meta_info.output_token_logprobs` has one `[logprob, id, text]`
//!   per output token and `output_top_logprobs` one list of them per token (or null), both
//!   cumulative like `output_ids` unless the server streams increments
//!   (`python/sglang/srt/managers/tokenizer_manager.py`: `detokenize_logprob_tokens`,
//!   `_slice_streaming_output_meta_info`).
//!
//! A plain OpenAI server (`openai`) names its alternatives by text, which tandem cannot turn
//! back into ids: a request for logprobs through one is refused (400).
//!
//! Dropping the stream drops the HTTP response, which closes the connection: both engines
//! abort a request whose client disconnected.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};

#[cfg(test)]
use answer::without_prompt_ids;
use answer::{count, ids, parse_answer, parse_answer_str, vllm_delta};
use client::{Answer, Poster, Target};
use logprobs::sglang_logprobs;
use tandem_protocol::grpc::TokenLogprobs;
pub use text::TextPrompt;

/// Which API the engine speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    Vllm,
    Sglang,
    /// An OpenAI-compatible server with vLLM's `return_token_ids` extension.
    Openai,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Openai => "openai",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm" => Ok(EngineKind::Vllm),
            "sglang" => Ok(EngineKind::Sglang),
            "openai" => Ok(EngineKind::Openai),
            other => Err(format!(
                "unknown external engine {other:?}; valid: vllm, sglang, openai"
            )),
        }
    }
}

/// Why a call to the engine failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine could not be reached, or the connection broke (it is down or restarting).
    #[error("engine unreachable: {0}")]
    Unreachable(String),
    /// The engine refused the request as invalid (4xx other than 429).
    #[error("engine refused the request ({status}): {body}")]
    Refused { status: u16, body: String },
    /// The engine is overloaded (429, or 503 with a body saying so).
    #[error("engine overloaded ({status}): {body}")]
    Overloaded { status: u16, body: String },
    /// The engine failed (5xx).
    #[error("engine failed ({status}): {body}")]
    Failed { status: u16, body: String },
    /// The engine answered something that is not its protocol.
    #[error("engine answered out of protocol: {0}")]
    Protocol(String),
}

impl EngineError {
    pub fn class(&self) -> tandem_protocol::ErrorClass {
        use tandem_protocol::ErrorClass;
        match self {
            EngineError::Unreachable(_) => ErrorClass::Unavailable,
            EngineError::Refused { .. } => ErrorClass::InvalidRequest,
            EngineError::Overloaded { .. } => ErrorClass::Overloaded,
            EngineError::Failed { .. } | EngineError::Protocol(_) => ErrorClass::Internal,
        }
    }
}

/// One request to the engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineGenerate {
    /// Sent to the engine as its request id where its API takes one (`rid` on SGLang; vLLM
    /// takes `X-Request-Id`).
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: Option<f32>,
    /// vLLM's and SGLang's `top_k` and `min_p` (vLLM takes them on its OpenAI endpoints as
    /// extra sampling parameters, `vllm/entrypoints/openai/protocol.py`; SGLang in
    /// `sampling_params`, `python/sglang/srt/sampling/sampling_params.py`).
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop_token: Option<u32>,
    pub ignore_eos: bool,
    /// vLLM's `cache_salt`: the engine's prefix cache separates salts as the router does.
    pub cache_salt: Option<String>,
    /// The LoRA adapter to run on (`None`: the base model). vLLM serves an adapter under its
    /// name (`--lora-modules NAME=PATH`), so it is sent as the request's `model`
    /// (`vllm/entrypoints/openai/serving_engine.py`: `_check_model` accepts a LoRA's name,
    /// `_maybe_get_adapters` picks the adapter by it); SGLang's native
    /// `/generate` takes it as `lora_path`, which names an adapter loaded with
    /// `--lora-paths NAME=PATH` (`python/sglang/srt/managers/io_struct.py`,
    /// `GenerateReqInput.lora_path`).
    pub lora_adapter: Option<String>,
    /// vLLM's connector handshake, sent as given.
    pub kv_transfer_params: Option<Value>,
    /// SGLang's disaggregation fields: `bootstrap_host`, `bootstrap_port`, `bootstrap_room`.
    pub bootstrap: Option<SglangBootstrap>,
    /// Report each token's log-probability and this many most likely alternatives'
    /// (OpenAI's `top_logprobs`); `None`: none.
    pub logprobs: Option<u32>,
    /// The prompt as text, for an engine that takes no token ids (`openai` only): sent in
    /// place of `prompt`, a chat to `/v1/chat/completions`.
    pub text: Option<TextPrompt>,
}

/// Where an SGLang decode engine meets its prefill engine for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SglangBootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
}

/// Why the engine stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineFinish {
    Length,
    Stop,
}

/// One piece of the engine's answer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineDelta {
    /// Token ids generated since the previous delta.
    pub tokens: Vec<u32>,
    pub finish: Option<EngineFinish>,
    /// Prompt tokens as the engine counted them (usage), when it says.
    pub prompt_tokens: Option<u32>,
    /// Prompt tokens the engine served from its prefix cache, when it says.
    pub cached_tokens: Option<u32>,
    /// vLLM's `kv_transfer_params` on the answer (a prefill run with `do_remote_decode`).
    pub kv_transfer_params: Option<Value>,
    /// A plain OpenAI server's text, when it gives no token ids (`openai` engines only).
    pub text: Option<String>,
    /// Completion tokens as the engine counted them (usage), when it says.
    pub completion_tokens: Option<u32>,
    /// When the request asked for logprobs: one per entry of `tokens`.
    pub logprobs: Vec<TokenLogprobs>,
}

pub type DeltaStream = Pin<Box<dyn Stream<Item = Result<EngineDelta, EngineError>> + Send>>;

/// Most bytes one SSE event may take before the stream is refused as out of protocol.
const MAX_EVENT_BYTES: usize = 4 << 20;

/// A client of one engine.
#[derive(Clone, Debug)]
pub struct EngineApi {
    kind: EngineKind,
    /// Base URL without a trailing slash, e.g. `http://10.0.0.5:8000`.
    base: String,
    /// The engine's served model name (vLLM's `model` field).
    model: String,
    /// SGLang: `output_ids` are increments (`--incremental-streaming-output`).
    incremental_output: bool,
    /// Health, models and probes (`probe.rs`).
    http: reqwest::Client,
    /// Generations (`client.rs`).
    poster: Poster,
    /// Where generations are posted, parsed once: `[0]` the completions (or SGLang's
    /// `/generate`), `[1]` the chat completions. Shared by the clones.
    urls: Arc<[Target; 2]>,
    /// How liveness is asked (`probe.rs`): `/health`, else `/v1/models`, else a one-token
    /// completion, as the engine has them. Shared by the clones.
    liveness: Arc<AtomicU8>,
    /// The engine refuses token-id prompts and takes text (`probe.rs`). Shared by the clones.
    takes_text: Arc<AtomicBool>,
}

impl EngineApi {
    /// A client for the engine at `url` (`http://host:port`, an optional trailing `/v1` is
    /// dropped).
    pub fn new(kind: EngineKind, url: &str, model: &str) -> Result<EngineApi, EngineError> {
        let base = url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base).to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(EngineError::Protocol(format!(
                "--engine-url must be http://host:port, got {url:?}"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(90))
            .build()
            .map_err(|e| EngineError::Protocol(format!("HTTP client: {e}")))?;
        let poster = Poster::for_base(&base, &http);
        let url = |path: &str| poster.target(&format!("{base}{path}"));
        let generate = match kind {
            EngineKind::Vllm | EngineKind::Openai => "/v1/completions",
            EngineKind::Sglang => "/generate",
        };
        let urls = Arc::new([url(generate)?, url("/v1/chat/completions")?]);
        Ok(EngineApi {
            kind,
            base,
            model: model.to_string(),
            incremental_output: false,
            http,
            poster,
            urls,
            liveness: Arc::new(AtomicU8::new(0)),
            takes_text: Arc::new(AtomicBool::new(false)),
        })
    }

    /// SGLang servers started with `--incremental-streaming-output`.
    pub fn with_incremental_output(mut self, on: bool) -> Self {
        self.incremental_output = on;
        self
    }

    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The JSON body sent for `req`.
    pub fn body(&self, req: &EngineGenerate, stream: bool) -> Value {
        if let Some(text) = &req.text {
            return self.text_body(req, text, stream);
        }
        match self.kind {
            EngineKind::Vllm | EngineKind::Openai => {
                // Read back from the bytes `post` sends.
                body::CompletionBody::new(&self.model, req, stream)
                    .to_vec()
                    .and_then(|b| serde_json::from_slice(&b))
                    .unwrap_or_default()
            }
            EngineKind::Sglang => {
                let mut sp = json!({
                    "max_new_tokens": req.max_tokens,
                    "temperature": req.temperature,
                    "ignore_eos": req.ignore_eos,
                });
                if let Some(p) = req.top_p {
                    sp["top_p"] = json!(p);
                }
                if let Some(k) = req.top_k {
                    sp["top_k"] = json!(k);
                }
                if let Some(p) = req.min_p {
                    sp["min_p"] = json!(p);
                }
                if let Some(t) = req.stop_token {
                    sp["stop_token_ids"] = json!([t]);
                }
                if let Some(s) = req.seed {
                    sp["sampling_seed"] = json!(s);
                }
                let mut b = json!({
                    "input_ids": req.prompt,
                    "sampling_params": sp,
                    "stream": stream,
                    "rid": req.request_id,
                });
                if let Some(lora) = &req.lora_adapter {
                    b["lora_path"] = json!(lora);
                }
                if let Some(bs) = &req.bootstrap {
                    b["bootstrap_host"] = json!(bs.host);
                    b["bootstrap_port"] = json!(bs.port);
                    b["bootstrap_room"] = json!(bs.room);
                }
                if let Some(n) = req.logprobs {
                    b["return_logprob"] = json!(true);
                    b["top_logprobs_num"] = json!(n);
                    b["logprob_start_len"] = json!(-1);
                }
                b
            }
        }
    }

    fn generate_url(&self, req: &EngineGenerate) -> &Target {
        match req.text {
            Some(TextPrompt::Chat { .. }) => &self.urls[1],
            _ => &self.urls[0],
        }
    }

    /// The `X-Request-Id` sent: the request id itself to vLLM and SGLang; to a plain server,
    /// a UUID made from it, since some refuse any other form (llama.cpp's Python server
    /// answers 400 with no body: starlette-context's `RequestIdPlugin` validates the header
    /// as a UUID).
    /// Written as a header value at once, copied once: a `String` made a header value is
    /// turned into shared bytes, an allocation more.
    fn request_id_header(
        &self,
        id: &str,
    ) -> Result<reqwest::header::HeaderValue, reqwest::header::InvalidHeaderValue> {
        if self.kind != EngineKind::Openai {
            return reqwest::header::HeaderValue::from_str(id);
        }
        let h = xxhash_rust::xxh3::xxh3_128(id.as_bytes());
        // Version 4, RFC 4122 variant.
        let h = (h & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
        let mut text = uuid::Uuid::encode_buffer();
        reqwest::header::HeaderValue::from_str(
            uuid::Uuid::from_u128(h)
                .hyphenated()
                .encode_lower(&mut text),
        )
    }

    async fn post(&self, req: &EngineGenerate, stream: bool) -> Result<Answer, EngineError> {
        // The engine's spans (vLLM's `--otlp-traces-endpoint`) join the request's trace.
        // Room for the trace context, the id and what the client adds (host, content type and
        // length), so that the map is made once.
        let mut headers = reqwest::header::HeaderMap::with_capacity(8);
        tandem_runtime::telemetry::inject_headers(&tracing::Span::current(), &mut headers);
        let id = self
            .request_id_header(&req.request_id)
            .map_err(|e| EngineError::Protocol(format!("request id as a header: {e}")))?;
        headers.insert(reqwest::header::HeaderName::from_static("x-request-id"), id);
        let body = match (&req.text, self.kind) {
            (None, EngineKind::Vllm | EngineKind::Openai) => {
                body::CompletionBody::new(&self.model, req, stream).to_vec()
            }
            _ => serde_json::to_vec(&self.body(req, stream)),
        }
        .map_err(|e| EngineError::Protocol(format!("request body: {e}")))?;
        let resp = self
            .poster
            .post(self.generate_url(req), headers, body)
            .await?;
        check_answer(resp).await
    }

    /// Starts `req` streaming; the stream yields deltas until one with `finish`.
    pub async fn generate(&self, req: &EngineGenerate) -> Result<DeltaStream, EngineError> {
        let resp = self.post(req, true).await?;
        let kind = self.kind;
        let incremental = self.incremental_output;
        let prompt_len = req.prompt.len();
        let top = req.logprobs;
        let mut events = sse_events(resp.stream());
        let mut seen = 0usize;
        let mut finished = false;
        let s = channel_stream(move |tx| async move {
            while let Some(ev) = events.next().await {
                let data = match ev {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                if data == "[DONE]" {
                    break;
                }
                let delta = match event_delta(&data, kind, incremental, &mut seen, top) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                finished |= delta.finish.is_some();
                if tx.send(Ok(delta)).await.is_err() {
                    return;
                }
            }
            if !finished {
                let _ = tx
                    .send(Err(EngineError::Unreachable(format!(
                        "the engine's stream ended before the request finished ({prompt_len} \
                         prompt tokens)"
                    ))))
                    .await;
            }
        });
        Ok(s)
    }

    /// Runs `req` to its end without streaming (a prefill with `max_tokens: 1`), merging the
    /// answer into one delta.
    pub async fn generate_whole(&self, req: &EngineGenerate) -> Result<EngineDelta, EngineError> {
        let resp = self.post(req, false).await?;
        let body = resp.bytes().await?;
        let bad = |e: serde_json::Error| EngineError::Protocol(format!("bad JSON answer: {e}"));
        let mut d = match self.kind {
            EngineKind::Sglang => {
                let v: Value = serde_json::from_slice(&body).map_err(bad)?;
                sglang_delta(&v, false, &mut 0, req.logprobs)?
            }
            kind => {
                let a = parse_answer(&body).map_err(bad)?;
                vllm_delta(a, kind == EngineKind::Openai, req.logprobs)?
            }
        };
        if d.finish.is_none() {
            d.finish = Some(EngineFinish::Length);
        }
        Ok(d)
    }
}

/// The fields an OpenAI-style body sets only when the request does: the usage with a stream,
/// `top_p`, `top_k`, `min_p`, `seed`.
fn openai_sampling(b: &mut Value, req: &EngineGenerate, stream: bool) {
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    if let Some(p) = req.top_p {
        b["top_p"] = json!(p);
    }
    if let Some(k) = req.top_k {
        b["top_k"] = json!(k);
    }
    if let Some(p) = req.min_p {
        b["min_p"] = json!(p);
    }
    if let Some(s) = req.seed {
        b["seed"] = json!(s);
    }
}

async fn check_answer(resp: Answer) -> Result<Answer, EngineError> {
    if resp.is_success() {
        return Ok(resp);
    }
    let status = resp.status;
    let body = resp.bytes().await.unwrap_or_default();
    Err(status_error(
        status,
        String::from_utf8_lossy(&body).into_owned(),
    ))
}

async fn check_status(resp: reqwest::Response) -> Result<reqwest::Response, EngineError> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    Err(status_error(status, resp.text().await.unwrap_or_default()))
}

/// What an engine's failing status means, with the start of its answer.
fn status_error(status: u16, mut body: String) -> EngineError {
    if body.len() > 1024 {
        let mut end = 1024;
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        body.truncate(end);
    }
    match status {
        429 => EngineError::Overloaded { status, body },
        503 => EngineError::Unreachable(format!("503: {body}")),
        400..=499 => EngineError::Refused { status, body },
        _ => EngineError::Failed { status, body },
    }
}

/// One streamed event's delta (`seen`, `top`: as [`sglang_delta`]'s). An `error` object in
/// place of a chunk is the engine failing the request.
fn event_delta(
    data: &str,
    kind: EngineKind,
    incremental: bool,
    seen: &mut usize,
    top: Option<u32>,
) -> Result<EngineDelta, EngineError> {
    let bad = |e: serde_json::Error| EngineError::Protocol(format!("bad JSON event: {e}"));
    let failed = |err: &Value| EngineError::Failed {
        status: 500,
        body: err.to_string(),
    };
    match kind {
        EngineKind::Sglang => {
            let v: Value = serde_json::from_str(data).map_err(bad)?;
            match v.get("error") {
                Some(err) => Err(failed(err)),
                None => sglang_delta(&v, incremental, seen, top),
            }
        }
        EngineKind::Vllm | EngineKind::Openai => {
            let a = parse_answer_str(data).map_err(bad)?;
            match &a.error {
                Some(err) => Err(failed(err)),
                None => vllm_delta(a, kind == EngineKind::Openai, top),
            }
        }
    }
}

/// One SGLang `/generate` object; `seen` counts ids already delivered (cumulative mode).
fn sglang_delta(
    v: &Value,
    incremental: bool,
    seen: &mut usize,
    top: Option<u32>,
) -> Result<EngineDelta, EngineError> {
    let mut d = EngineDelta::default();
    let out = ids(v.get("output_ids").unwrap_or(&Value::Null))?;
    let from = if incremental { 0 } else { *seen };
    if incremental {
        d.tokens = out;
    } else {
        if out.len() < *seen {
            return Err(EngineError::Protocol(format!(
                "output_ids shrank from {} to {} (is the server running with \
                 --incremental-streaming-output? then pass --engine-incremental-output)",
                *seen,
                out.len()
            )));
        }
        d.tokens = out[*seen..].to_vec();
        *seen = out.len();
    }
    if let Some(n) = top
        && !d.tokens.is_empty()
    {
        d.logprobs = sglang_logprobs(v.get("meta_info"), &d.tokens, from, n)?;
    }
    if let Some(m) = v.get("meta_info") {
        d.prompt_tokens = m.get("prompt_tokens").and_then(count);
        d.cached_tokens = m.get("cached_tokens").and_then(count);
        d.finish = match m.get("finish_reason") {
            None | Some(Value::Null) => None,
            Some(f) => match f.get("type").and_then(Value::as_str).or(f.as_str()) {
                Some("length") => Some(EngineFinish::Length),
                Some("abort") => {
                    let msg = f.get("message").map(Value::to_string).unwrap_or_default();
                    return Err(EngineError::Failed {
                        status: 500,
                        body: format!("aborted by the engine: {msg}"),
                    });
                }
                _ => Some(EngineFinish::Stop),
            },
        };
    }
    Ok(d)
}

/// Splits an SSE byte stream into the `data` of each event (multi-line data joined with
/// `\n`, comments and other fields skipped), bounded per event.
pub fn sse_events(
    body: impl Stream<Item = Result<Bytes, EngineError>> + Send + 'static,
) -> Pin<Box<dyn Stream<Item = Result<String, EngineError>> + Send>> {
    let mut body = Box::pin(body);
    channel_stream(move |tx| async move {
        let mut buf = BytesMut::new();
        loop {
            // Every complete event in the buffer first.
            while let Some((end, skip)) = event_end(&buf) {
                let raw = buf.split_to(end + skip);
                let text = String::from_utf8_lossy(&raw[..end]);
                let mut data = String::new();
                let mut any = false;
                for line in text.lines() {
                    if let Some(rest) = line.strip_prefix("data:") {
                        if any {
                            data.push('\n');
                        }
                        data.push_str(rest.strip_prefix(' ').unwrap_or(rest));
                        any = true;
                    }
                }
                if any && tx.send(Ok(data)).await.is_err() {
                    return;
                }
            }
            if buf.len() > MAX_EVENT_BYTES {
                let _ = tx
                    .send(Err(EngineError::Protocol(format!(
                        "an SSE event over {MAX_EVENT_BYTES} bytes"
                    ))))
                    .await;
                return;
            }
            match body.next().await {
                Some(Ok(b)) => buf.extend_from_slice(&b),
                Some(Err(e)) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
                None => {
                    // A last event without its blank line.
                    let text = String::from_utf8_lossy(&buf);
                    if let Some(rest) = text.trim().strip_prefix("data:") {
                        let _ = tx.send(Ok(rest.trim_start().to_string())).await;
                    }
                    return;
                }
            }
        }
    })
}

/// Where the first event in `buf` ends, and the length of its terminator.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    for i in 0..buf.len() {
        if buf[i..].starts_with(b"\n\n") {
            return Some((i, 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
    }
    None
}

/// A stream fed by a producer future through a channel of one: the producer runs only as
/// the consumer pulls (back-pressure), and dropping the stream drops the producer.
pub(crate) fn channel_stream<T, F, Fut>(producer: F) -> Pin<Box<dyn Stream<Item = T> + Send>>
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let fut = producer(tx);
    let rx = tokio_stream_from(rx);
    Box::pin(
        futures::stream::select(rx.map(Some), futures::stream::once(fut).map(|()| None))
            .filter_map(futures::future::ready),
    )
}

fn tokio_stream_from<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl Stream<Item = T> + Send {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|t| (t, rx)) })
}

mod answer;
mod body;
mod client;
mod logprobs;
mod pool;
mod probe;
#[cfg(test)]
mod tests;
mod text;
