//! The body of a generation call to a vLLM or OpenAI-style engine, written straight from the
//! request: a `serde_json::Value` built first cost a node per prompt token and a sorted map
//! per call, about 3 % of `tandem frontend --backend-url`'s CPU per request.
//!
//! Fields as vLLM's `CompletionRequest` names them (`vllm/entrypoints/openai/protocol.py`);
//! an unset option is left out, so that the engine applies its own default.

use serde::Serialize;
use serde_json::Value;

use super::EngineGenerate;

#[derive(Serialize)]
pub(super) struct CompletionBody<'a> {
    model: &'a str,
    prompt: &'a [u32],
    max_tokens: u32,
    temperature: f32,
    ignore_eos: bool,
    return_token_ids: bool,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_token_ids: Option<[u32; 1]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_transfer_params: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<u32>,
    /// With logprobs: each token named by its id (`token_id:123`), not its text.
    #[serde(skip_serializing_if = "Option::is_none")]
    return_tokens_as_token_ids: Option<bool>,
}

/// Asks a streamed answer to end with its usage (OpenAI's `stream_options`).
#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

impl<'a> CompletionBody<'a> {
    /// `req`'s body for `model` (the adapter's name on a LoRA request).
    pub(super) fn new(model: &'a str, req: &'a EngineGenerate, stream: bool) -> Self {
        CompletionBody {
            model: req.lora_adapter.as_deref().unwrap_or(model),
            prompt: &req.prompt,
            max_tokens: req.max_tokens,
            temperature: req.temperature,
            ignore_eos: req.ignore_eos,
            return_token_ids: true,
            stream,
            stream_options: stream.then_some(StreamOptions {
                include_usage: true,
            }),
            top_p: req.top_p,
            top_k: req.top_k,
            min_p: req.min_p,
            seed: req.seed,
            stop_token_ids: req.stop_token.map(|t| [t]),
            cache_salt: req.cache_salt.as_deref(),
            kv_transfer_params: req.kv_transfer_params.as_ref(),
            logprobs: req.logprobs,
            return_tokens_as_token_ids: req.logprobs.map(|_| true),
        }
    }
}
