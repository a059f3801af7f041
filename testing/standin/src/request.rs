//! What the stand-in's handlers share: a parsed completion request, the follower of its
//! outputs (usage, the blocks it fills), vLLM's error body and the clock.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tandem_engine::FinishReason;

use crate::Shared;

/// vLLM's error body (`ErrorResponse`: `object`, `message`, `type`, `param`, `code`).
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = json!({
        "object": "error",
        "message": message.into(),
        "type": if status.is_client_error() { "BadRequestError" } else { "InternalServerError" },
        "param": null,
        "code": status.as_u16(),
    });
    (status, axum::Json(body)).into_response()
}

pub(crate) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A parsed `/v1/completions` request.
pub(crate) struct Completion {
    pub(crate) prompt: Vec<u32>,
    pub(crate) max_tokens: u32,
    pub(crate) seed: u64,
    pub(crate) stop_token: Option<u32>,
    pub(crate) ignore_eos: bool,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) return_token_ids: bool,
    pub(crate) cache_salt: Option<String>,
    pub(crate) kv: Option<Value>,
    /// The LoRA adapter `model` names (vLLM's `_maybe_get_adapters`); None: the base model.
    pub(crate) lora: Option<String>,
    /// `logprobs`: the completions API's count of alternatives per token.
    pub(crate) logprobs: Option<u8>,
    /// `return_tokens_as_token_ids`: logprobs name tokens `token_id:<id>`.
    pub(crate) tokens_as_ids: bool,
    /// Came in as a chat: answered in chat completions' shape.
    pub(crate) chat: bool,
}

/// Follows a request's outputs, learning the blocks its generated tokens fill.
pub(crate) struct Follow {
    pub(crate) s: Arc<Shared>,
    pub(crate) all: Vec<u32>,
    pub(crate) salt: Option<String>,
    pub(crate) lora: Option<String>,
    pub(crate) prompt_len: usize,
    pub(crate) cached: Option<usize>,
    pub(crate) completion: u32,
    /// Bytes of text answered so far (`text_offset`).
    pub(crate) text_len: usize,
}

impl Follow {
    pub(crate) fn new(s: Arc<Shared>, c: &Completion) -> Self {
        Follow {
            s,
            all: c.prompt.clone(),
            salt: c.cache_salt.clone(),
            lora: c.lora.clone(),
            prompt_len: c.prompt.len(),
            cached: None,
            completion: 0,
            text_len: 0,
        }
    }

    /// Takes one token output; returns (token, finish).
    pub(crate) fn token(&mut self, o: &tandem_engine::RequestOutput) -> Option<&'static str> {
        if self.cached.is_none() {
            self.cached = Some(o.cached_tokens);
            let c = &self.s.counters;
            c.prompt_tokens
                .fetch_add(self.prompt_len as u64, Ordering::Relaxed);
            c.cached_tokens
                .fetch_add(o.cached_tokens as u64, Ordering::Relaxed);
        }
        self.completion = o.completion_tokens;
        self.all.push(o.token);
        let bs = self.s.config.block_size as usize;
        if self.all.len().is_multiple_of(bs) {
            self.s
                .registry
                .lock()
                .learn(&self.all, self.salt.as_deref(), self.lora.as_deref());
        }
        let finish = o.finish.map(|f| match f {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        });
        if finish.is_some() {
            self.s.counters.finished.fetch_add(1, Ordering::Relaxed);
        }
        finish
    }

    pub(crate) fn usage(&self) -> Value {
        let p = self.prompt_len as u64;
        let c = u64::from(self.completion);
        json!({
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": self.cached.unwrap_or(0)},
        })
    }
}
