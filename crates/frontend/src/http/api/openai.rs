//! OpenAI wire format: request bodies as sent (loosely typed where a value must be range
//! checked, so that `max_tokens: -1` is a 400 naming the field rather than a 422), and the
//! response objects, serialized from borrowed data.
//!
//! Unknown request fields are ignored (as vLLM does; OpenAI itself refuses them).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
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
#[serde(from = "TextOr<ContentPart>")]
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

impl From<TextOr<ContentPart>> for MessageContent {
    fn from(v: TextOr<ContentPart>) -> Self {
        match v {
            TextOr::Text(t) => MessageContent::Text(t),
            TextOr::List(parts) => MessageContent::Parts(parts),
        }
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(from = "TextOr<String>")]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

impl From<TextOr<String>> for Stop {
    fn from(v: TextOr<String>) -> Self {
        match v {
            TextOr::Text(t) => Stop::One(t),
            TextOr::List(v) => Stop::Many(v),
        }
    }
}

/// A string, or a list of `T`: the shape of many OpenAI and Anthropic fields, read in one pass.
/// (`#[serde(untagged)]` would first copy the value into serde's private buffer, every string
/// in it included, and then try each variant on the copy: twice the work for a long prompt.)
#[derive(Debug)]
pub(crate) enum TextOr<T> {
    Text(String),
    List(Vec<T>),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for TextOr<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = TextOr<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(TextOr::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(TextOr::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                extend(Vec::new(), seq).map(TextOr::List)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// `v` followed by the rest of a JSON list, each element a `T`.
fn extend<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(
    mut v: Vec<T>,
    mut seq: A,
) -> Result<Vec<T>, A::Error> {
    while let Some(x) = seq.next_element()? {
        v.push(x);
    }
    Ok(v)
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

/// A completions `prompt`: text, token ids, or a batch of one of either. An empty list is
/// `Tokens` (no ids); a list whose elements are not all of its first one's kind is refused.
#[derive(Debug)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// One element of a prompt list.
enum PromptItem {
    Id(u32),
    Text(String),
    Ids(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (0 to 4294967295), a string or a list of token ids")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
                u32::try_from(n)
                    .map(PromptItem::Id)
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(n), &self))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Self::Value, E> {
                u32::try_from(n)
                    .map(PromptItem::Id)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(n), &self))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                extend(Vec::new(), seq).map(PromptItem::Ids)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a string, a list of token ids, a list of strings or a list of token-id lists",
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(Prompt::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                // The first element says which list this is; the rest are read as its kind.
                Ok(match seq.next_element::<PromptItem>()? {
                    None => Prompt::Tokens(Vec::new()),
                    Some(PromptItem::Id(t)) => Prompt::Tokens(extend(vec![t], seq)?),
                    Some(PromptItem::Text(t)) => Prompt::Texts(extend(vec![t], seq)?),
                    Some(PromptItem::Ids(t)) => Prompt::TokenLists(extend(vec![t], seq)?),
                })
            }
        }
        d.deserialize_any(V)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(json: &str) -> Result<Prompt, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn a_prompt_is_read_as_the_kind_its_first_element_says() {
        assert!(matches!(prompt(r#""a b""#), Ok(Prompt::Text(t)) if t == "a b"));
        assert!(matches!(prompt("[]"), Ok(Prompt::Tokens(t)) if t.is_empty()));
        assert!(
            matches!(prompt("[1, 2, 4294967295]"), Ok(Prompt::Tokens(t)) if t == [1, 2, u32::MAX])
        );
        assert!(matches!(prompt(r#"["a", "b"]"#), Ok(Prompt::Texts(t)) if t == ["a", "b"]));
        assert!(
            matches!(prompt("[[1], [], [2, 3]]"), Ok(Prompt::TokenLists(t)) if t == [vec![1], vec![], vec![2, 3]])
        );
        // Mixed kinds, ids out of range, and other types are refused, each with a message.
        for bad in [
            r#"[1, "a"]"#,
            r#"["a", 1]"#,
            "[[1], 2]",
            "[1, [2]]",
            "[4294967296]",
            "[1, 4294967296]",
            "[-1]",
            "[1.5]",
            "[[1.5]]",
            "[null]",
            "{}",
            "7",
            "null",
        ] {
            let e = prompt(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad} was read"));
            assert!(e.is_data(), "{bad}: {e}");
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn content_and_stop_are_a_string_or_a_list() {
        let content = |json: &str| serde_json::from_str::<MessageContent>(json);
        assert!(matches!(content(r#""hi""#), Ok(MessageContent::Text(t)) if t == "hi"));
        // An escaped string is read as a new one.
        assert!(matches!(content(r#""a\nb""#), Ok(MessageContent::Text(t)) if t == "a\nb"));
        match content(r#"[{"type": "text", "text": "a"}, {"type": "image_url"}]"#) {
            Ok(MessageContent::Parts(p)) => {
                assert_eq!(p.len(), 2);
                assert_eq!(
                    (p[0].kind.as_str(), p[0].text.as_deref()),
                    ("text", Some("a"))
                );
                assert_eq!(
                    (p[1].kind.as_str(), p[1].text.as_deref()),
                    ("image_url", None)
                );
            }
            other => panic!("{other:?}"),
        }
        for bad in ["5", "{}", "[1]", r#"[{"text": "no type"}]"#] {
            assert!(content(bad).is_err(), "{bad}");
        }
        let stop = |json: &str| serde_json::from_str::<Stop>(json);
        assert!(matches!(stop(r#""x""#), Ok(Stop::One(s)) if s == "x"));
        assert!(matches!(stop(r#"["x", "y"]"#), Ok(Stop::Many(s)) if s == ["x", "y"]));
        assert!(stop(r#"["x", 1]"#).is_err());
    }
}
