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

    /// The conversation in chat completions' own JSON, for an engine that applies its own
    /// template: the `messages` list (`content` a string, or `{"type": "text", "text"}`
    /// parts as sent; `tool_calls` with `arguments` as a string, as OpenAI spells it) and
    /// the `tools` list (empty when the request has none). Client text goes as written.
    pub(crate) fn chat_json(&self) -> (String, String) {
        let messages: Vec<serde_json::Value> = self.messages.iter().map(message_json).collect();
        let tools = match &self.tools {
            Some(tools) => {
                let items: Vec<String> = tools.iter().map(Json::to_compact).collect();
                format!("[{}]", items.join(","))
            }
            None => String::new(),
        };
        (serde_json::Value::Array(messages).to_string(), tools)
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

fn message_json(m: &Message) -> serde_json::Value {
    let mut o = serde_json::Map::new();
    o.insert("role".into(), m.role.into());
    let content = match &m.content {
        Content::Text(t) => serde_json::Value::from(t.as_str()),
        Content::Parts(parts) => parts
            .iter()
            .map(|p| serde_json::json!({"type": "text", "text": p}))
            .collect(),
    };
    o.insert("content".into(), content);
    if let Some(name) = &m.name {
        o.insert("name".into(), name.as_str().into());
    }
    if let Some(calls) = &m.tool_calls {
        let calls = calls
            .iter()
            .map(|c| {
                serde_json::json!({
                    "id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_text()},
                })
            })
            .collect();
        o.insert("tool_calls".into(), serde_json::Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        o.insert("tool_call_id".into(), id.as_str().into());
    }
    serde_json::Value::Object(o)
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// What an engine that applies its own template gets: chat completions' JSON, the client's
    /// text as written, tool calls' arguments as strings.
    #[test]
    fn a_conversation_goes_as_chat_completions_json() {
        let city = Json::Object(vec![("city".into(), Json::Str("Paris".into()))]);
        let conversation = Conversation {
            messages: vec![
                Message::text("system", "<|im_start|>Be brief."),
                Message {
                    content: Content::Parts(vec!["Weather?".into(), "In Paris.".into()]),
                    name: Some("ann".into()),
                    ..Message::text("user", "")
                },
                Message {
                    tool_calls: Some(vec![ToolCall {
                        id: "call_1".into(),
                        name: "weather".into(),
                        arguments: city.clone(),
                    }]),
                    ..Message::text("assistant", "")
                },
                Message {
                    tool_call_id: Some("call_1".into()),
                    ..Message::text("tool", "sunny")
                },
            ],
            tools: Some(vec![Json::Object(vec![
                ("type".into(), Json::Str("function".into())),
                ("name".into(), Json::Str("weather".into())),
            ])]),
        };
        let (messages, tools) = conversation.chat_json();
        let messages: serde_json::Value = serde_json::from_str(&messages).unwrap();
        assert_eq!(
            messages,
            json!([
                {"role": "system", "content": "<|im_start|>Be brief."},
                {"role": "user", "name": "ann", "content": [
                    {"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Paris."},
                ]},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            ])
        );
        // Tools keep their keys in the order sent.
        assert_eq!(tools, r#"[{"type":"function","name":"weather"}]"#);
        let none = Conversation {
            tools: None,
            ..conversation
        };
        assert_eq!(none.chat_json().1, "");
    }
}
