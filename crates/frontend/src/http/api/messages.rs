//! `POST /v1/messages`: the Anthropic Messages API, shapes as in anthropic-sdk-python
//! (`src/anthropic/types/`: `message_create_params.py`, `message.py`, `usage.py`,
//! `text_block.py`, `tool_use_block.py`, `raw_message_stream_event.py` and the `raw_*_event`
//! types, `shared/error_response.py`).
//!
//! Served: `model`, `max_tokens` (required), `system` (a string or text blocks), `messages`
//! (`user` / `assistant`, content a string or blocks: `text`, `tool_use` (assistant),
//! `tool_result` (user; its content a string or text blocks); `thinking` blocks are
//! skipped), `temperature` (0..=1, Anthropic's range), `top_p`, `top_k`, `stop_sequences`, `stream`,
//! `tools` (`{name, description, input_schema}`), `tool_choice` `auto` / `none`. Refused
//! with 400: other blocks (images, documents), server tools, forcing a tool (`any`,
//! `tool`), extended thinking. Ignored: `metadata`, `service_tier`, unknown fields.
//!
//! Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens not read from
//! the prefix cache, `cache_read_input_tokens` those that were.
//!
//! Streams: `message_start`, `ping`, then per block `content_block_start`,
//! `content_block_delta` (`text_delta`; a tool call's whole input as one `input_json_delta`),
//! `content_block_stop`, then `message_delta` (`stop_reason`, `stop_sequence`,
//! `usage.output_tokens`) and `message_stop`. A backend error after the head sends an
//! `error` event. `stop_reason`: `end_turn`, `max_tokens`, `stop_sequence` (with the string),
//! `tool_use`.

use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::backend::{Endpoint, FinishReason, ValidRequest};
use crate::http::conversation::{Content, Conversation, Message, ToolCall};
use crate::http::error::ServeError;
use crate::http::format::{End, Format, sse_event};
use crate::http::logprobs::Rendered;
use crate::http::openai::{Stop, TextOr};
use crate::http::pyjson::Json;
use crate::http::state::HttpConfig;
use crate::http::tool_calls::Piece;
use crate::http::validate::{self, Checked, Common, PromptInput};

/// `POST /v1/messages` body.
#[derive(Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    model: Option<String>,
    max_tokens: Option<i64>,
    messages: Option<Vec<AnthropicMessage>>,
    system: Option<BlocksOrText>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    tools: Option<Vec<Json>>,
    tool_choice: Option<Json>,
    thinking: Option<Json>,
    priority: Option<crate::http::openai::PriorityField>,
    timeout: Option<f64>,
    tandem: Option<crate::http::hints::TandemField>,
    metadata: Option<Json>,
}

#[derive(Debug, Deserialize)]
struct AnthropicMessage {
    role: String,
    content: BlocksOrText,
}

/// A system prompt or a message's content: a string, or a list of content blocks.
type BlocksOrText = TextOr<Json>;

/// Validates a Messages request into a [`Checked`].
pub(crate) fn check(req: MessagesRequest, config: &HttpConfig) -> Result<Checked, ServeError> {
    let Some(max_tokens) = req.max_tokens else {
        return Err(ServeError::invalid("Field required").with_param("max_tokens"));
    };
    if let Some(t) = req.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(
            ServeError::invalid(format!("temperature must be between 0 and 1, got {t}"))
                .with_param("temperature"),
        );
    }
    if req
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Json::as_str)
        .is_some_and(|t| t != "disabled")
    {
        return Err(validate::unsupported(
            "thinking",
            "extended thinking is not supported",
        ));
    }
    let tools = convert_tools(req.tools)?;
    let tool_choice_none = validate::check_tool_choice(req.tool_choice.as_ref())?;
    let messages = req.messages.filter(|m| !m.is_empty()).ok_or_else(|| {
        ServeError::invalid("messages must be a non-empty array").with_param("messages")
    })?;
    let mut conversation = Conversation {
        messages: Vec::with_capacity(messages.len() + 1),
        tools,
    };
    match req.system {
        None => {}
        Some(TextOr::Text(t)) => conversation.messages.push(Message::text("system", t)),
        Some(TextOr::List(blocks)) => {
            let texts = text_blocks(&blocks, "system")?;
            conversation.messages.push(Message {
                content: Content::Parts(texts),
                ..Message::text("system", "")
            });
        }
    }
    for (i, m) in messages.into_iter().enumerate() {
        convert_message(i, m, &mut conversation.messages)?;
    }
    let wants_tool_calls = conversation.tools.is_some() && !tool_choice_none;
    let mut common = Common::new(req.model, Some((max_tokens, "max_tokens")));
    common.temperature = req.temperature;
    common.top_p = req.top_p;
    common.top_k = req.top_k;
    common.stream = req.stream;
    common.stop = req.stop_sequences.map(Stop::Many);
    // Anthropic's `service_tier` (`auto`, `standard_only`) names no band: not read.
    common.priority = req.priority;
    common.timeout = req.timeout;
    common.hints = crate::http::hints::HintFields {
        tandem: req.tandem,
        reasoning_effort: None,
        session_field: req
            .metadata
            .as_ref()
            .and_then(|m| m.get("user_id"))
            .and_then(|u| u.as_str())
            .map(str::to_string),
    };
    let model = crate::http::models::resolve_model(common.model.as_deref(), config)?;
    let mut checked = validate::finish_common(
        common,
        model,
        Endpoint::Messages,
        PromptInput::Chat(conversation),
        "messages",
        config,
    )?;
    checked.wants_tool_calls = wants_tool_calls;
    Ok(checked)
}

/// Anthropic tools (`{name, description, input_schema}`) as chat completions spells them.
fn convert_tools(tools: Option<Vec<Json>>) -> Result<Option<Vec<Json>>, ServeError> {
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.into_iter().enumerate() {
        let custom = matches!(
            tool.get("type").and_then(Json::as_str),
            None | Some("custom")
        );
        let name = tool
            .get("name")
            .and_then(Json::as_str)
            .filter(|n| !n.is_empty());
        let (Some(name), true) = (name, custom) else {
            return Err(ServeError::invalid(
                "only client tools {\"name\", \"description\", \"input_schema\"} are supported",
            )
            .with_param(format!("tools.{i}"))
            .with_code("unsupported_parameter"));
        };
        let mut function = vec![("name".to_string(), Json::Str(name.to_string()))];
        if let Some(d) = tool.get("description") {
            function.push(("description".to_string(), d.clone()));
        }
        if let Some(schema) = tool.get("input_schema") {
            function.push(("parameters".to_string(), schema.clone()));
        }
        out.push(Json::Object(vec![
            ("type".to_string(), Json::Str("function".to_string())),
            ("function".to_string(), Json::Object(function)),
        ]));
    }
    Ok(Some(out))
}

/// The texts of a list of `text` blocks.
fn text_blocks(blocks: &[Json], param: &str) -> Result<Vec<String>, ServeError> {
    blocks
        .iter()
        .enumerate()
        .map(
            |(j, b)| match (b.get("type").and_then(Json::as_str), b.get("text")) {
                (Some("text"), Some(Json::Str(t))) => Ok(t.clone()),
                _ => Err(ServeError::invalid("only text blocks are supported here")
                    .with_param(format!("{param}.{j}"))
                    .with_code("unsupported_parameter")),
            },
        )
        .collect()
}

/// One Anthropic message → conversation messages: an assistant's text and `tool_use`
/// blocks become one message with tool calls; a user's `tool_result` blocks become tool
/// messages (before the user's text, if any).
fn convert_message(
    i: usize,
    m: AnthropicMessage,
    out: &mut Vec<Message>,
) -> Result<(), ServeError> {
    let role = match m.role.as_str() {
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(ServeError::invalid(format!(
                "unknown role {other:?}: expected user or assistant"
            ))
            .with_param(format!("messages.{i}.role")));
        }
    };
    let blocks = match m.content {
        TextOr::Text(t) => {
            out.push(Message::text(role, t));
            return Ok(());
        }
        TextOr::List(blocks) => blocks,
    };
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for (j, block) in blocks.into_iter().enumerate() {
        let param = format!("messages.{i}.content.{j}");
        let unsupported = |what: &str| {
            ServeError::invalid(format!(
                "{what} blocks are not supported in {role} messages"
            ))
            .with_param(param.clone())
            .with_code("unsupported_parameter")
        };
        match block.get("type").and_then(Json::as_str) {
            Some("text") => match block.get("text") {
                Some(Json::Str(t)) => texts.push(t.clone()),
                _ => return Err(ServeError::invalid("text blocks need a text").with_param(param)),
            },
            Some("tool_use") if role == "assistant" => {
                let id = block.get("id").and_then(Json::as_str);
                let name = block.get("name").and_then(Json::as_str);
                let (Some(id), Some(name)) = (id, name) else {
                    return Err(ServeError::invalid("tool_use blocks need an id and a name")
                        .with_param(param));
                };
                calls.push(ToolCall {
                    id: id.to_string(),
                    name: name.to_string(),
                    arguments: block
                        .get("input")
                        .cloned()
                        .unwrap_or(Json::Object(Vec::new())),
                });
            }
            Some("tool_result") if role == "user" => {
                let content = match block.get("content") {
                    None | Some(Json::Null) => Content::Text(String::new()),
                    Some(Json::Str(s)) => Content::Text(s.clone()),
                    Some(Json::Array(parts)) => {
                        Content::Parts(text_blocks(parts, &format!("{param}.content"))?)
                    }
                    Some(_) => return Err(unsupported("tool_result content of this form")),
                };
                out.push(Message {
                    role: "tool",
                    content,
                    name: None,
                    tool_calls: None,
                    tool_call_id: block
                        .get("tool_use_id")
                        .and_then(Json::as_str)
                        .map(str::to_string),
                });
            }
            Some("thinking" | "redacted_thinking") => {}
            Some(other) => return Err(unsupported(other)),
            None => return Err(ServeError::invalid("content blocks need a type").with_param(param)),
        }
    }
    if role == "assistant" || !texts.is_empty() {
        out.push(Message {
            role,
            content: Content::Parts(texts),
            name: None,
            tool_calls: (!calls.is_empty()).then_some(calls),
            tool_call_id: None,
        });
    }
    Ok(())
}

/// Anthropic output of one request.
#[derive(Debug)]
pub(crate) struct MessagesFormat {
    id: String,
    model: String,
    prompt_tokens: u32,
    /// Index of the next content block.
    blocks: usize,
    /// A text block is open.
    text_open: bool,
    /// `toolu_<letters and digits of the response id>`.
    suffix: String,
}

impl MessagesFormat {
    pub(crate) fn new(req: &ValidRequest) -> Self {
        MessagesFormat {
            id: req.response_id.clone(),
            model: req.model.clone(),
            prompt_tokens: u32::try_from(req.prompt_tokens.len()).unwrap_or(u32::MAX),
            blocks: 0,
            text_open: false,
            suffix: req.response_id.trim_start_matches("msg_").to_string(),
        }
    }

    fn usage(&self, end: Option<&End>) -> Value {
        let (prompt, cached, output) = match end {
            Some(e) => (
                e.usage.prompt_tokens,
                e.usage.prompt_tokens_details.cached_tokens,
                e.usage.completion_tokens,
            ),
            None => (self.prompt_tokens, 0, 0),
        };
        json!({
            "input_tokens": prompt.saturating_sub(cached),
            "output_tokens": output,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        })
    }

    /// Anthropic's tool_use ids: `toolu_…`.
    fn tool_use_id(&self, call: &ToolCall) -> String {
        let n = call.id.rsplit('_').next().unwrap_or_default();
        format!("toolu_{}_{n}", self.suffix)
    }

    fn stop(end: &End) -> (&'static str, Option<&str>) {
        match (end.finish, &end.stop_sequence) {
            (FinishReason::Length, _) => ("max_tokens", None),
            (FinishReason::Stop, _) if end.tool_calls => ("tool_use", None),
            (FinishReason::Stop, Some(s)) => ("stop_sequence", Some(s.as_str())),
            (FinishReason::Stop, None) => ("end_turn", None),
        }
    }

    fn close_text(&mut self, out: &mut String) {
        if self.text_open {
            self.text_open = false;
            out.push_str(&event(
                "content_block_stop",
                json!({"index": self.blocks - 1}),
            ));
        }
    }

    fn text_delta(&mut self, out: &mut String, text: &str) {
        if !self.text_open {
            self.text_open = true;
            self.blocks += 1;
            out.push_str(&event(
                "content_block_start",
                json!({"index": self.blocks - 1, "content_block": {"type": "text", "text": ""}}),
            ));
        }
        if !text.is_empty() {
            out.push_str(&event(
                "content_block_delta",
                json!({"index": self.blocks - 1, "delta": {"type": "text_delta", "text": text}}),
            ));
        }
    }
}

fn event(kind: &str, mut data: Value) -> String {
    if let Value::Object(map) = &mut data {
        map.insert("type".into(), Value::from(kind));
    }
    sse_event(kind, &data.to_string())
}

impl Format for MessagesFormat {
    fn open(&mut self) -> String {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": null, "stop_sequence": null,
            "usage": self.usage(None),
        });
        let mut out = event("message_start", json!({"message": message}));
        out.push_str(&event("ping", json!({})));
        out
    }

    fn step(&mut self, pieces: Vec<Piece>, _: &[Rendered], end: Option<&End>) -> String {
        let mut out = String::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => self.text_delta(&mut out, &t),
                Piece::Call(call) => {
                    self.close_text(&mut out);
                    let index = self.blocks;
                    self.blocks += 1;
                    let block = json!({"type": "tool_use", "id": self.tool_use_id(&call),
                                       "name": call.name, "input": {}});
                    out.push_str(&event(
                        "content_block_start",
                        json!({"index": index, "content_block": block}),
                    ));
                    let partial = call.arguments.to_compact();
                    out.push_str(&event(
                        "content_block_delta",
                        json!({"index": index, "delta": {"type": "input_json_delta",
                                                         "partial_json": partial}}),
                    ));
                    out.push_str(&event("content_block_stop", json!({"index": index})));
                }
            }
        }
        let Some(end) = end else {
            return out;
        };
        if self.blocks == 0 {
            self.text_delta(&mut out, "");
        }
        self.close_text(&mut out);
        let (stop_reason, stop_sequence) = Self::stop(end);
        let usage = self.usage(Some(end));
        out.push_str(&event(
            "message_delta",
            json!({"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": usage}),
        ));
        out.push_str(&event("message_stop", json!({})));
        out
    }

    fn stream_error(&mut self, e: &ServeError) -> String {
        sse_event("error", &e.to_anthropic_json())
    }

    fn whole(&mut self, pieces: Vec<Piece>, _: &[Rendered], end: &End) -> String {
        let mut text = String::new();
        let mut content = Vec::new();
        let mut calls = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(c) => calls.push(c),
            }
        }
        if !text.is_empty() || calls.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        for call in &calls {
            let input = serde_json::to_value(&call.arguments).unwrap_or(Value::Null);
            // Anthropic's input is always an object.
            let input = if input.is_object() { input } else { json!({}) };
            content.push(json!({"type": "tool_use", "id": self.tool_use_id(call),
                                "name": call.name, "input": input}));
        }
        let (stop_reason, stop_sequence) = Self::stop(end);
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": self.usage(Some(end)),
        })
        .to_string()
    }
}
