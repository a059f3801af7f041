//! What the sidecar asks an engine besides generation: whether it is alive, what it takes as a
//! prompt, its Prometheus text and (SGLang) its server arguments.
//!
//! Liveness is the first of these the engine has, chosen the first time it answers and kept
//! (said once in the log): `GET /health` (vLLM, SGLang, llama.cpp's C++ server); `GET
//! /v1/models`, which every OpenAI-compatible server has (llama.cpp's Python server, Ollama,
//! LM Studio and hosted APIs answer `/health` with 404); a one-token completion, for a server
//! that has neither.
//!
//! Prompts: vLLM and SGLang take token ids. An `openai` server may not: llama.cpp's Python
//! server (llama-cpp-python 0.3.36) validates `prompt` as text, and its route handler turns
//! the validation error into a 500 (`llama_cpp/server/errors.py`, `RouteErrorHandler`:
//! `{"error": {"message": "… validation errors …", "type": "internal_server_error"}}`); other
//! servers answer 400 or 422. So the answer's status says little: the sidecar asks once,
//! at start ([`EngineApi::probe_prompts`]); a server that refuses ids and takes text gets
//! every prompt as text from then on (the frontend sends the client's prompt or messages to a
//! worker whose record says so), and renders chats with its own template.

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};

use super::{EngineApi, EngineError, EngineKind, check_status};

/// How liveness is asked, in the order tried (the value kept in `EngineApi::liveness`).
const HEALTH: u8 = 0;
const MODELS: u8 = 1;
const COMPLETION: u8 = 2;

fn health_path_of(way: u8) -> &'static str {
    match way {
        HEALTH => "GET /health",
        MODELS => "GET /v1/models",
        _ => "POST /v1/completions (one token)",
    }
}

impl EngineApi {
    /// Whether the engine is up: the first of `GET /health`, `GET /v1/models` and a one-token
    /// completion that it has answers 2xx (a 404 moves to the next; from the first that
    /// answers on, only that one is asked).
    pub async fn health(&self, timeout: Duration) -> Result<(), EngineError> {
        let mut way = self.liveness.load(Ordering::Relaxed);
        loop {
            let result = match way {
                HEALTH => self.get_ok("/health", timeout).await,
                MODELS => self.get_ok("/v1/models", timeout).await,
                _ => self.tiny_completion(timeout).await,
            };
            match result {
                Err(EngineError::Refused { status: 404, .. }) if way < COMPLETION => way += 1,
                Ok(()) => {
                    if way != HEALTH && self.liveness.swap(way, Ordering::Relaxed) != way {
                        tracing::info!(
                            url = %self.base,
                            "the engine has no GET /health (404): its liveness is {}",
                            health_path_of(way)
                        );
                    }
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Liveness is the engine's own `GET /health`, not a request of its API (which some
    /// servers let interrupt the one they are serving).
    pub fn has_health_route(&self) -> bool {
        self.liveness.load(Ordering::Relaxed) == HEALTH
    }

    /// The way [`health`](Self::health) asks now.
    pub fn health_path(&self) -> &'static str {
        health_path_of(self.liveness.load(Ordering::Relaxed))
    }

    /// `GET path`: Ok when the engine answers 2xx.
    async fn get_ok(&self, path: &str, timeout: Duration) -> Result<(), EngineError> {
        let resp = self
            .http
            .get(format!("{}{path}", self.base))
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| EngineError::Unreachable(e.to_string()))?;
        check_status(resp).await.map(|_| ())
    }

    /// A one-token completion of `prompt` (token ids or text), answered 2xx.
    async fn one_token(&self, prompt: Value, timeout: Duration) -> Result<(), EngineError> {
        let resp = self
            .http
            .post(format!("{}/v1/completions", self.base))
            .timeout(timeout)
            .json(&json!({
                "model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            }))
            .send()
            .await
            .map_err(|e| EngineError::Unreachable(e.to_string()))?;
        check_status(resp).await.map(|_| ())
    }

    async fn tiny_completion(&self, timeout: Duration) -> Result<(), EngineError> {
        self.one_token(json!("Hi"), timeout).await
    }

    /// Finds out, once, whether an `openai` engine takes token ids: a one-token completion of
    /// a token-id prompt; refused (any 4xx or 5xx but 429 and 503), the same as text. Ids
    /// refused and text taken: every prompt goes as text from here on
    /// ([`takes_text`](Self::takes_text)). Both refused: an error naming both answers (the
    /// engine cannot serve). vLLM and SGLang take ids; an engine that cannot be asked
    /// (unreachable, overloaded) is taken to take ids, with a warning.
    pub async fn probe_prompts(&self, timeout: Duration) -> Result<(), EngineError> {
        if self.kind != EngineKind::Openai {
            return Ok(());
        }
        let ids = match self.one_token(json!([1]), timeout).await {
            Ok(()) => return Ok(()),
            Err(EngineError::Refused { status, body } | EngineError::Failed { status, body }) => {
                format!("{status}: {body}")
            }
            Err(e) => {
                tracing::warn!(
                    url = %self.base, error = %e,
                    "could not ask the engine whether it takes token ids: sending ids"
                );
                return Ok(());
            }
        };
        match self.tiny_completion(timeout).await {
            Ok(()) => {
                self.takes_text.store(true, Ordering::Relaxed);
                tracing::info!(
                    url = %self.base,
                    refused = %ids,
                    "the engine refuses token-id prompts: prompts go to it as text (chats as \
                     their messages, rendered by its own template)"
                );
                Ok(())
            }
            Err(e) => Err(EngineError::Protocol(format!(
                "the engine refused a one-token completion both as token ids ({ids}) and as \
                 text ({e})"
            ))),
        }
    }

    /// The engine takes its prompts as text (found by [`probe_prompts`](Self::probe_prompts)).
    pub fn takes_text(&self) -> bool {
        self.takes_text.load(Ordering::Relaxed)
    }

    /// `GET /metrics`: the engine's Prometheus text.
    pub async fn metrics(&self, timeout: Duration) -> Result<String, EngineError> {
        let resp = self
            .http
            .get(format!("{}/metrics", self.base))
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| EngineError::Unreachable(e.to_string()))?;
        check_status(resp)
            .await?
            .text()
            .await
            .map_err(|e| EngineError::Unreachable(e.to_string()))
    }

    /// SGLang's `GET /get_server_info` (its server args: `page_size`, `max_total_num_tokens`,
    /// `disaggregation_bootstrap_port`, …); None for other engines or when it does not answer.
    pub async fn server_info(&self, timeout: Duration) -> Option<Value> {
        if self.kind != EngineKind::Sglang {
            return None;
        }
        let resp = self
            .http
            .get(format!("{}/get_server_info", self.base))
            .timeout(timeout)
            .send()
            .await
            .ok()?;
        check_status(resp).await.ok()?.json().await.ok()
    }
}
