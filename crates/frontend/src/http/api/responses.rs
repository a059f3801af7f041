//! `POST /v1/responses`: the OpenAI Responses API, shapes as in openai-python
//! (`src/openai/types/responses/`: `response_create_params.py`, `response.py`,
//! `response_output_message.py`, `response_function_tool_call.py`, `response_usage.py`,
//! `response_stream_event.py` and the event types it lists).
//!
//! Served: `input` (a string, or items: messages with `role` user / system / developer /
//! assistant and content as a string or `input_text` / `output_text` parts,
//! `function_call`, `function_call_output`; `reasoning` items are skipped), `instructions`
//! (a system message, not carried over by `previous_response_id`, as OpenAI documents),
//! `max_output_tokens`, `temperature`, `top_p`, `stream`, `store` (default true),
//! `previous_response_id` (the stored conversation goes first; an unknown id is 400
//! `previous_response_not_found`), function `tools`, `tool_choice` `auto` / `none`,
//! `parallel_tool_calls` and `metadata` (echoed), `text.format` `text`. Refused with 400:
//! other input types (images, files, item references), other tools (web search, …), forcing
//! a tool, other text formats. Ignored: `user`, `include`, `reasoning`, `truncation`, any
//! unknown field.
//!
//! The output is one `message` item with one `output_text` part (when there is text, or
//! nothing at all), and one `function_call` item per parsed tool call. Streams send typed
//! events, each `event: <type>` + `data: {"type", "sequence_number", …}`:
//! `response.created`, `response.in_progress`, then per item `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done` (a function call:
//! `response.output_item.added`, `response.function_call_arguments.delta` with all the
//! arguments, `response.function_call_arguments.done`, `response.output_item.done`), and
//! `response.completed` (or `response.incomplete` when `max_output_tokens` cut it). A backend
//! error after the head sends `error` and `response.failed`.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::backend::{FinishReason, ValidRequest};
use crate::http::conversation::{Content, Conversation, Message, ToolCall};
use crate::http::error::ServeError;
use crate::http::format::{End, Format, sse_event};
use crate::http::hints::HintFields;
use crate::http::logprobs::Rendered;
use crate::http::openai::TextOr;
use crate::http::pyjson::Json;
use crate::http::responses_store::{ResponseStore, StoredTurn};
use crate::http::state::HttpState;
use crate::http::tool_calls::Piece;
use crate::http::validate::{self, Checked, Common, PromptInput};

/// `POST /v1/responses` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    model: Option<String>,
    input: Option<Input>,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    stream: Option<bool>,
    store: Option<bool>,
    previous_response_id: Option<String>,
    tools: Option<Vec<Json>>,
    tool_choice: Option<Json>,
    parallel_tool_calls: Option<bool>,
    metadata: Option<Json>,
    text: Option<Json>,
    cache_salt: Option<String>,
    priority: Option<crate::http::openai::PriorityField>,
    service_tier: Option<String>,
    timeout: Option<f64>,
    tandem: Option<crate::http::hints::TandemField>,
    user: Option<String>,
    reasoning: Option<Json>,
}

/// `input`: a string (one user message), or a list of items.
type Input = TextOr<Json>;

/// What the response needs besides the [`ValidRequest`]: echoed fields and what to store.
#[derive(Debug)]
pub(crate) struct ResponsesContext {
    /// This request's input as conversation messages (instructions excluded), to store.
    turn: Vec<Message>,
    parent: Option<Arc<StoredTurn>>,
    store: bool,
    previous_response_id: Option<String>,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: f64,
    top_p: f64,
    tools: Vec<Json>,
    tool_choice: Json,
    parallel_tool_calls: bool,
    metadata: Json,
}

/// Validates a Responses request into a [`Checked`] and the response's context.
pub(crate) fn check(
    req: ResponsesRequest,
    state: &HttpState,
) -> Result<(Checked, ResponsesContext), ServeError> {
    let config = state.config();
    if let Some(format) = req.text.as_ref().and_then(|t| t.get("format"))
        && format.get("type").and_then(Json::as_str) != Some("text")
    {
        return Err(validate::unsupported(
            "text.format",
            "only text.format {\"type\": \"text\"} is supported",
        ));
    }
    let echo_tools = req.tools.clone().unwrap_or_default();
    let tools = convert_tools(req.tools)?;
    let tool_choice_none = validate::check_tool_choice(req.tool_choice.as_ref())?;
    let parent = match &req.previous_response_id {
        None => None,
        Some(id) => Some(state.responses_store().get(id).ok_or_else(|| {
            ServeError::invalid(format!("Previous response with id '{id}' not found."))
                .with_param("previous_response_id")
                .with_code("previous_response_not_found")
        })?),
    };
    let turn = match req.input {
        None => {
            return Err(ServeError::invalid("input is required").with_param("input"));
        }
        Some(TextOr::Text(t)) => vec![Message::text("user", t)],
        Some(TextOr::List(items)) => input_messages(items)?,
    };
    if turn.is_empty() {
        return Err(ServeError::invalid("input must not be empty").with_param("input"));
    }
    let mut messages = Vec::new();
    if let Some(instructions) = req.instructions.clone().filter(|i| !i.is_empty()) {
        messages.push(Message::text("system", instructions));
    }
    if let Some(parent) = &parent {
        messages.extend(parent.conversation());
    }
    messages.extend(turn.iter().cloned());
    let conversation = Conversation { messages, tools };
    let wants_tool_calls = conversation.tools.is_some() && !tool_choice_none;
    let mut common = Common::new(
        req.model,
        req.max_output_tokens.map(|v| (v, "max_output_tokens")),
    );
    common.temperature = req.temperature;
    common.top_p = req.top_p;
    common.stream = req.stream;
    common.cache_salt = req.cache_salt;
    common.priority = req.priority;
    common.service_tier = req.service_tier;
    common.timeout = req.timeout;
    common.hints = HintFields {
        tandem: req.tandem,
        reasoning_effort: req
            .reasoning
            .as_ref()
            .and_then(|r| r.get("effort"))
            .and_then(|e| e.as_str())
            .map(str::to_string),
        session_field: req.user,
    };
    let model = crate::http::models::resolve_model(common.model.as_deref(), config)?;
    let mut checked = validate::finish_common(
        common,
        model,
        crate::http::backend::Endpoint::Responses,
        PromptInput::Chat(conversation),
        "input",
        config,
    )?;
    checked.wants_tool_calls = wants_tool_calls;
    let context = ResponsesContext {
        turn,
        parent,
        store: req.store.unwrap_or(true),
        previous_response_id: req.previous_response_id,
        instructions: req.instructions,
        max_output_tokens: req.max_output_tokens,
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        tools: echo_tools,
        tool_choice: req.tool_choice.unwrap_or(Json::Str("auto".into())),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        metadata: req.metadata.unwrap_or(Json::Object(Vec::new())),
    };
    Ok((checked, context))
}

/// Responses function tools (`{"type": "function", "name", "description", "parameters",
/// "strict"}`) as chat completions spells them, which is what templates expect.
fn convert_tools(tools: Option<Vec<Json>>) -> Result<Option<Vec<Json>>, ServeError> {
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.into_iter().enumerate() {
        let is_function = tool.get("type").and_then(Json::as_str) == Some("function");
        let named = tool
            .get("name")
            .and_then(Json::as_str)
            .is_some_and(|n| !n.is_empty());
        let Json::Object(entries) = tool else {
            return Err(bad_tool(i));
        };
        if !is_function || !named {
            return Err(bad_tool(i));
        }
        let function: Vec<(String, Json)> =
            entries.into_iter().filter(|(k, _)| k != "type").collect();
        out.push(Json::Object(vec![
            ("type".to_string(), Json::Str("function".to_string())),
            ("function".to_string(), Json::Object(function)),
        ]));
    }
    Ok(Some(out))
}

fn bad_tool(i: usize) -> ServeError {
    ServeError::invalid(
        "only function tools {\"type\": \"function\", \"name\": ..., \"parameters\": ...} are \
         supported",
    )
    .with_param(format!("tools[{i}]"))
    .with_code("unsupported_parameter")
}

/// Input items → conversation messages. A `function_call` joins the assistant message
/// before it (as chat completions puts text and tool calls in one message), else starts one.
fn input_messages(items: Vec<Json>) -> Result<Vec<Message>, ServeError> {
    let mut out: Vec<Message> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let param = |field: &str| format!("input[{i}]{field}");
        let kind =
            item.get("type")
                .and_then(Json::as_str)
                .unwrap_or(if item.get("role").is_some() {
                    "message"
                } else {
                    ""
                });
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Json::as_str) {
                    Some("user") => "user",
                    Some("system") | Some("developer") => "system",
                    Some("assistant") => "assistant",
                    other => {
                        return Err(ServeError::invalid(format!(
                            "unknown role {other:?}: expected user, system, developer or \
                             assistant"
                        ))
                        .with_param(param(".role")));
                    }
                };
                let content = message_content(item.get("content"), &param(".content"))?;
                out.push(Message {
                    role,
                    content,
                    name: None,
                    tool_calls: None,
                    tool_call_id: None,
                });
            }
            "function_call" => {
                let field = |name: &str| {
                    item.get(name)
                        .and_then(Json::as_str)
                        .ok_or_else(|| {
                            ServeError::invalid(format!("function_call items need a string {name}"))
                                .with_param(param(&format!(".{name}")))
                        })
                        .map(str::to_string)
                };
                let call =
                    ToolCall::from_text(field("call_id")?, field("name")?, &field("arguments")?);
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => {
                        m.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => out.push(Message {
                        role: "assistant",
                        content: Content::Text(String::new()),
                        name: None,
                        tool_calls: Some(vec![call]),
                        tool_call_id: None,
                    }),
                }
            }
            "function_call_output" => {
                let call_id = item
                    .get("call_id")
                    .and_then(Json::as_str)
                    .map(str::to_string);
                let content = message_content(item.get("output"), &param(".output"))?;
                out.push(Message {
                    role: "tool",
                    content,
                    name: None,
                    tool_calls: None,
                    tool_call_id: call_id,
                });
            }
            // Reasoning of an earlier turn: nothing a chat template renders.
            "reasoning" => {}
            other => {
                return Err(ServeError::invalid(format!(
                    "input items of type {other:?} are not supported; use messages, \
                     function_call and function_call_output"
                ))
                .with_param(param(".type"))
                .with_code("unsupported_parameter"));
            }
        }
    }
    Ok(out)
}

/// A string, or a list of `input_text` / `output_text` (/ `text`, `refusal`) parts.
fn message_content(content: Option<&Json>, param: &str) -> Result<Content, ServeError> {
    match content {
        None | Some(Json::Null) => Ok(Content::Text(String::new())),
        Some(Json::Str(s)) => Ok(Content::Text(s.clone())),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let text = match part.get("type").and_then(Json::as_str) {
                    Some("input_text" | "output_text" | "text") => part.get("text"),
                    Some("refusal") => part.get("refusal"),
                    _ => None,
                };
                match text.and_then(Json::as_str) {
                    Some(t) => texts.push(t.to_string()),
                    None => {
                        return Err(ServeError::invalid(
                            "only text content parts (input_text, output_text) are supported",
                        )
                        .with_param(format!("{param}[{j}]"))
                        .with_code("unsupported_parameter"));
                    }
                }
            }
            Ok(Content::Parts(texts))
        }
        Some(_) => Err(
            ServeError::invalid("content must be a string or a list of parts")
                .with_param(param.to_string()),
        ),
    }
}

/// The output as it is built: items, the open message, event numbering.
#[derive(Debug)]
pub(crate) struct ResponsesFormat {
    id: String,
    model: String,
    created: u64,
    ctx: ResponsesContext,
    store: Arc<ResponseStore>,
    /// `letters and digits` of the response id, for item ids.
    suffix: String,
    items: Vec<Value>,
    /// The open message item: its output index and text so far.
    open: Option<(usize, String)>,
    text: String,
    calls: Vec<ToolCall>,
    sequence: u64,
}

impl ResponsesFormat {
    pub(crate) fn new(
        req: &ValidRequest,
        ctx: ResponsesContext,
        store: Arc<ResponseStore>,
    ) -> Self {
        let suffix = req.response_id.trim_start_matches("resp_").to_string();
        ResponsesFormat {
            id: req.response_id.clone(),
            model: req.model.clone(),
            created: req.created,
            ctx,
            store,
            suffix,
            items: Vec::new(),
            open: None,
            text: String::new(),
            calls: Vec::new(),
            sequence: 0,
        }
    }

    /// Appends an event (when streaming) with its type and sequence number.
    fn event(&mut self, out: &mut Option<&mut String>, kind: &str, mut data: Value) {
        let Some(out) = out else {
            return;
        };
        if let Value::Object(map) = &mut data {
            map.insert("type".into(), Value::from(kind));
            map.insert("sequence_number".into(), Value::from(self.sequence));
        }
        self.sequence += 1;
        out.push_str(&sse_event(kind, &data.to_string()));
    }

    fn message_id(&self, index: usize) -> String {
        format!("msg_{}{index}", self.suffix)
    }

    fn message_item(&self, index: usize, text: Option<&str>, status: &str) -> Value {
        let content = match text {
            Some(t) => json!([output_text(t)]),
            None => json!([]),
        };
        json!({"id": self.message_id(index), "type": "message", "status": status,
               "role": "assistant", "content": content})
    }

    fn text(&mut self, out: &mut Option<&mut String>, text: &str) {
        let index = match &self.open {
            Some((index, _)) => *index,
            None => {
                let index = self.items.len();
                self.items.push(Value::Null);
                self.open = Some((index, String::new()));
                let item = self.message_item(index, None, "in_progress");
                self.event(
                    out,
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                let item_id = self.message_id(index);
                self.event(
                    out,
                    "response.content_part.added",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0,
                           "part": output_text("")}),
                );
                index
            }
        };
        if let Some((_, t)) = &mut self.open {
            t.push_str(text);
        }
        self.text.push_str(text);
        if text.is_empty() {
            return;
        }
        let item_id = self.message_id(index);
        self.event(
            out,
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                   "delta": text, "logprobs": []}),
        );
    }

    fn close_message(&mut self, out: &mut Option<&mut String>, status: &str) {
        let Some((index, text)) = self.open.take() else {
            return;
        };
        let item_id = self.message_id(index);
        self.event(
            out,
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                   "text": text, "logprobs": []}),
        );
        self.event(
            out,
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                   "part": output_text(&text)}),
        );
        let item = self.message_item(index, Some(&text), status);
        self.items[index] = item.clone();
        self.event(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
    }

    fn call(&mut self, out: &mut Option<&mut String>, call: ToolCall) {
        self.close_message(out, "completed");
        let index = self.items.len();
        let item_id = format!("fc_{}{index}", self.suffix);
        let arguments = call.arguments_text();
        let item = |status: &str, arguments: &str| {
            json!({"id": item_id, "type": "function_call", "status": status,
                   "call_id": call.id, "name": call.name, "arguments": arguments})
        };
        self.event(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": item("in_progress", "")}),
        );
        self.event(
            out,
            "response.function_call_arguments.delta",
            json!({"item_id": item_id, "output_index": index, "delta": arguments}),
        );
        self.event(
            out,
            "response.function_call_arguments.done",
            json!({"item_id": item_id, "output_index": index, "arguments": arguments,
                   "name": call.name}),
        );
        let done = item("completed", &arguments);
        self.event(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        self.items.push(done);
        self.calls.push(call);
    }

    fn pieces(&mut self, out: &mut Option<&mut String>, pieces: Vec<Piece>) {
        for piece in pieces {
            match piece {
                Piece::Text(t) => self.text(out, &t),
                Piece::Call(c) => self.call(out, c),
            }
        }
    }

    /// Closes the output, stores the turn; returns the final response object.
    fn end(&mut self, out: &mut Option<&mut String>, end: &End) -> Value {
        let incomplete = end.finish == FinishReason::Length;
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        if self.items.is_empty() {
            self.text(out, "");
        }
        self.close_message(out, status);
        self.store_turn();
        let usage = json!({
            "input_tokens": end.usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": end.usage.prompt_tokens_details.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": end.usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": end.usage.total_tokens,
        });
        let mut response = self.object(status, Some(usage));
        if incomplete {
            response["incomplete_details"] = json!({"reason": "max_output_tokens"});
        } else {
            response["completed_at"] = json!(crate::http::ids::unix_now());
        }
        response
    }

    fn store_turn(&mut self) {
        if !self.ctx.store {
            return;
        }
        let mut messages = std::mem::take(&mut self.ctx.turn);
        messages.push(Message {
            role: "assistant",
            content: Content::Text(self.text.clone()),
            name: None,
            tool_calls: (!self.calls.is_empty()).then(|| self.calls.clone()),
            tool_call_id: None,
        });
        let turn = StoredTurn::new(messages, self.ctx.parent.take());
        self.store.put(self.id.clone(), turn);
    }

    /// The `response` object (openai-python `types/responses/response.py`).
    fn object(&self, status: &str, usage: Option<Value>) -> Value {
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "instructions": self.ctx.instructions,
            "max_output_tokens": self.ctx.max_output_tokens,
            "model": self.model,
            "output": self.items.iter().filter(|i| !i.is_null()).collect::<Vec<_>>(),
            "parallel_tool_calls": self.ctx.parallel_tool_calls,
            "previous_response_id": self.ctx.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": self.ctx.store,
            "temperature": self.ctx.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": serde_json::to_value(&self.ctx.tool_choice).unwrap_or(Value::Null),
            "tools": serde_json::to_value(&self.ctx.tools).unwrap_or(Value::Null),
            "top_p": self.ctx.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": null,
            "metadata": serde_json::to_value(&self.ctx.metadata).unwrap_or(Value::Null),
        })
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

impl Format for ResponsesFormat {
    fn open(&mut self) -> String {
        let mut buf = String::new();
        let mut out = Some(&mut buf);
        let response = self.object("in_progress", None);
        self.event(&mut out, "response.created", json!({"response": response}));
        self.event(
            &mut out,
            "response.in_progress",
            json!({"response": response}),
        );
        buf
    }

    fn step(&mut self, pieces: Vec<Piece>, _: &[Rendered], end: Option<&End>) -> String {
        let mut buf = String::new();
        let mut out = Some(&mut buf);
        self.pieces(&mut out, pieces);
        if let Some(end) = end {
            let response = self.end(&mut out, end);
            let kind = if response["status"] == "incomplete" {
                "response.incomplete"
            } else {
                "response.completed"
            };
            self.event(&mut out, kind, json!({"response": response}));
        }
        buf
    }

    fn stream_error(&mut self, e: &ServeError) -> String {
        let mut buf = String::new();
        let mut out = Some(&mut buf);
        self.event(
            &mut out,
            "error",
            json!({"code": e.code(), "message": e.message(), "param": e.param()}),
        );
        let mut response = self.object("failed", None);
        response["error"] = json!({"code": "server_error", "message": e.message()});
        self.event(&mut out, "response.failed", json!({"response": response}));
        buf
    }

    fn whole(&mut self, pieces: Vec<Piece>, _: &[Rendered], end: &End) -> String {
        let mut out = None;
        self.pieces(&mut out, pieces);
        self.end(&mut out, end).to_string()
    }
}
