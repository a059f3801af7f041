//! [`Conversation`]: the one internal form of a chat, whichever API it came through (chat
//! completions, Responses, Anthropic Messages). Each API converts its request into it; the
//! chat template renders it. Two requests that mean the same conversation build equal
//! `Conversation`s, hence the same prompt tokens (and the same prefix-cache hits).
//!
//! The template sees each message as Hugging Face / vLLM pass it: `role`, `content` (a
//! string, or the list of `{"type": "text", "text"}` parts for templates that iterate over
//! content), and only when present `name`, `tool_calls` (`[{"id", "type": "function",
//! "function": {"name", "arguments"}}]`, `arguments` as a JSON object like vLLM parses it),
//! `tool_call_id`.

use minijinja::value::Value;

use crate::http::pyjson::{Json, OrderedMap};

/// A conversation to render: messages, and the tool definitions of the request.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Conversation {
    pub messages: Vec<Message>,
    /// Tool definitions as chat completions spells them (`{"type": "function", "function":
    /// {"name", "description", "parameters"}}`), or `None` when the request has none.
    pub tools: Option<Vec<Json>>,
}

/// One message.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: &'static str,
    pub content: Content,
    pub name: Option<String>,
    /// Assistant messages: the calls it made (`None`: the key is absent).
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Tool messages: the call this answers.
    pub tool_call_id: Option<String>,
}

impl Message {
    pub(crate) fn text(role: &'static str, text: impl Into<String>) -> Self {
        Message {
            role,
            content: Content::Text(text.into()),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A message's content.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Content {
    Text(String),
    /// Text parts, in order.
    Parts(Vec<String>),
}

impl Content {
    /// The parts joined by newlines, as vLLM does for templates that want a string.
    pub(crate) fn joined(&self) -> String {
        match self {
            Content::Text(t) => t.clone(),
            Content::Parts(parts) => parts.join("\n"),
        }
    }
}

/// A tool call made by the assistant (in the input) or parsed from the output.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments object; `Json::Str` when the client sent text that is not JSON.
    pub arguments: Json,
}

impl ToolCall {
    /// From an arguments string, as chat completions and Responses send them.
    pub(crate) fn from_text(id: String, name: String, arguments: &str) -> Self {
        let arguments = Json::parse(arguments).unwrap_or_else(|_| Json::Str(arguments.to_string()));
        ToolCall {
            id,
            name,
            arguments,
        }
    }

    /// The arguments as a JSON string (OpenAI's `arguments` field).
    pub(crate) fn arguments_text(&self) -> String {
        match &self.arguments {
            Json::Str(s) => s.clone(),
            other => other.to_compact(),
        }
    }
}

/// How the template wants `content`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ContentFormat {
    /// A string (text parts joined by newlines).
    String,
    /// A list of `{"type": "text", "text"}` parts (the template iterates over content).
    Parts,
}

impl Conversation {
    /// The `messages` template variable. Every client string goes through `text` (which
    /// defuses special-token strings, see `prompt.rs`).
    pub(crate) fn messages_value(
        &self,
        format: ContentFormat,
        text: &dyn Fn(&str) -> String,
    ) -> Value {
        let messages: Vec<Value> = self
            .messages
            .iter()
            .map(|m| message_value(m, format, text))
            .collect();
        Value::from(messages)
    }

    /// The `tools` template variable: the list, or none (transformers passes `tools=None`
    /// when a request has no tools, so `tools is not none` tests work as in Python).
    pub(crate) fn tools_value(&self, text: &dyn Fn(&str) -> String) -> Value {
        match &self.tools {
            Some(tools) => Value::from(tools.iter().map(|t| t.to_value(text)).collect::<Vec<_>>()),
            None => Value::from(()),
        }
    }
}

fn message_value(m: &Message, format: ContentFormat, text: &dyn Fn(&str) -> String) -> Value {
    let mut entries = vec![
        ("role".to_string(), Value::from(m.role)),
        (
            "content".to_string(),
            content_value(&m.content, format, text),
        ),
    ];
    if let Some(name) = &m.name {
        entries.push(("name".to_string(), Value::from(text(name))));
    }
    if let Some(calls) = &m.tool_calls {
        let calls: Vec<Value> = calls.iter().map(|c| tool_call_value(c, text)).collect();
        entries.push(("tool_calls".to_string(), Value::from(calls)));
    }
    if let Some(id) = &m.tool_call_id {
        entries.push(("tool_call_id".to_string(), Value::from(text(id))));
    }
    OrderedMap::value(entries)
}

fn content_value(content: &Content, format: ContentFormat, text: &dyn Fn(&str) -> String) -> Value {
    match (content, format) {
        (Content::Text(t), ContentFormat::String) => Value::from(text(t)),
        (Content::Parts(_), ContentFormat::String) => Value::from(text(&content.joined())),
        (Content::Text(t), ContentFormat::Parts) => {
            if t.is_empty() {
                Value::from(Vec::<Value>::new())
            } else {
                Value::from(vec![text_part(text(t))])
            }
        }
        (Content::Parts(parts), ContentFormat::Parts) => {
            Value::from(parts.iter().map(|p| text_part(text(p))).collect::<Vec<_>>())
        }
    }
}

fn text_part(text: String) -> Value {
    OrderedMap::value(vec![
        ("type".to_string(), Value::from("text")),
        ("text".to_string(), Value::from(text)),
    ])
}

fn tool_call_value(call: &ToolCall, text: &dyn Fn(&str) -> String) -> Value {
    let function = OrderedMap::value(vec![
        ("name".to_string(), Value::from(text(&call.name))),
        ("arguments".to_string(), call.arguments.to_value(text)),
    ]);
    OrderedMap::value(vec![
        ("id".to_string(), Value::from(text(&call.id))),
        ("type".to_string(), Value::from("function")),
        ("function".to_string(), function),
    ])
}
