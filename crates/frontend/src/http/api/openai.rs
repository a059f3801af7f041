//! OpenAI wire format: request bodies as sent (loosely typed where a value must be range
//! checked, so that `max_tokens: -1` is a 400 naming the field rather than a 422), and the
//! response objects, serialized from borrowed data.
//!
//! Unknown request fields are ignored (as vLLM does; OpenAI itself refuses them).

use serde::{Deserialize, Serialize};

use crate::http::logprobs::{ChatLogprobs, CompletionLogprobs};
use crate::http::pyjson::Json;

// ---------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------

/// `POST /v1/chat/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    /// Tool definitions, passed to the chat template as given (order kept).
    pub tools: Option<Vec<Json>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", …}`.
    pub tool_choice: Option<Json>,
    pub response_format: Option<serde_json::Value>,
    pub cache_salt: Option<String>,
    pub priority: Option<PriorityField>,
    pub service_tier: Option<String>,
    pub timeout: Option<f64>,
    pub tandem: Option<crate::http::hints::TandemField>,
    pub user: Option<String>,
    pub reasoning_effort: Option<String>,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ChatToolCall>>,
    pub tool_call_id: Option<String>,
}

/// A tool call of an assistant message: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, `arguments` a JSON string (an object is accepted too).
#[derive(Debug, Deserialize)]
pub(crate) struct ChatToolCall {
    pub id: Option<String>,
    pub function: ChatFunctionCall,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ChatFunctionCall {
    pub name: String,
    pub arguments: Option<Json>,
}

/// A message's content: a string, or a list of parts of which only `text` parts are served.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    pub cache_salt: Option<String>,
    pub priority: Option<PriorityField>,
    pub service_tier: Option<String>,
    pub timeout: Option<f64>,
    pub tandem: Option<crate::http::hints::TandemField>,
    pub user: Option<String>,
}

/// `priority`: a band name (`interactive`, `standard`, `batch`, or a synonym), or an integer
/// as vLLM's `priority` means it (lower first).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum PriorityField {
    Name(String),
    Int(i64),
}

/// A completions `prompt`: text, token ids, or a batch of one of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

// ---------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------

/// Token accounting, as in every OpenAI response.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub(crate) struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub(crate) struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl Usage {
    pub(crate) fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// What every response object has around its choices: `chat.completion`,
/// `chat.completion.chunk`, `text_completion` (whole or as a chunk).
#[derive(Debug, Serialize)]
pub(crate) struct ResponseObject<'a, C, U: UsageField> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: C,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: U,
}

/// `usage` of a response object: always there on a whole response ([`Usage`]); on a chunk
/// (`Option<Option<Usage>>`) absent unless `include_usage`, then `null` on every chunk but
/// the last, which has no choices.
pub(crate) trait UsageField: Serialize {
    fn is_absent(&self) -> bool;
}

impl UsageField for Usage {
    fn is_absent(&self) -> bool {
        false
    }
}

impl UsageField for Option<Option<Usage>> {
    fn is_absent(&self) -> bool {
        self.is_none()
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatChoice<'a> {
    pub index: u32,
    pub message: AssistantMessage<'a>,
    pub logprobs: Option<ChatLogprobs<'a>>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub(crate) struct AssistantMessage<'a> {
    pub role: &'static str,
    /// `null` when the message is only tool calls.
    pub content: Option<&'a str>,
    pub refusal: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut<'a>>>,
}

/// A tool call of an assistant message.
#[derive(Debug, Serialize)]
pub(crate) struct ToolCallOut<'a> {
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut<'a>,
}

#[derive(Debug, Serialize)]
pub(crate) struct FunctionOut<'a> {
    pub name: &'a str,
    /// A JSON string.
    pub arguments: &'a str,
}

/// A tool call in a streamed delta: with its position among the message's calls.
#[derive(Debug, Serialize)]
pub(crate) struct ToolCallDelta<'a> {
    pub index: usize,
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut<'a>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<ChatLogprobs<'a>>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

#[derive(Debug, Serialize)]
pub(crate) struct CompletionChoice<'a> {
    pub text: &'a str,
    pub index: u32,
    pub logprobs: Option<CompletionLogprobs<'a>>,
    pub finish_reason: Option<&'static str>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<Model<'a>>,
}

/// A model object, as vLLM's `ModelCard` (`vllm/entrypoints/openai/protocol.py`): OpenAI's
/// fields, then `root`, `parent` (the base model of a LoRA adapter, else null) and
/// `max_model_len` (the base model's context, null for adapters).
#[derive(Debug, Serialize)]
pub(crate) struct Model<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: &'a str,
    pub parent: Option<&'a str>,
    pub max_model_len: Option<u32>,
}
