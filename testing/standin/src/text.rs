//! The stand-in's text. It has no tokenizer of the model's: token `t` reads ` t<t>` (a plain
//! server's text, for clients that take text only; logprobs' text offsets count it too). A
//! stand-in that takes prompts as text (`text_prompts`, as llama.cpp's Python server) reads
//! them, and every stand-in reads chats, with a tokenizer and a chat template of its own, which
//! are not the frontend's: each byte of the text is a token, and a chat renders as `<|role|>\ncontent\n` per message, then
//! `<|assistant|>\n`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// The text of `tokens`.
pub(crate) fn token_text(tokens: &[u32]) -> String {
    tokens.iter().map(|t| format!(" t{t}")).collect()
}

/// The stand-in's own tokens of a text prompt: its bytes.
pub(crate) fn tokenize(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// A chat's `messages` rendered with the stand-in's template; refused (as [`not_a_string`])
/// when they are not a non-empty list of `{role, content}` with text content (a string, or
/// `{"type": "text", "text"}` parts).
pub(crate) fn render_chat(messages: Option<&Value>) -> Result<String, Box<Response>> {
    let invalid = |msg: &str| Box::new(validation_error("messages", msg, messages));
    let list = messages
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| invalid("Input should be a non-empty list of messages"))?;
    let mut out = String::new();
    for m in list {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("every message needs a role"))?;
        let content = match m.get("content") {
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            None | Some(Value::Null) => String::new(),
            Some(_) => return Err(invalid("content should be a string or a list of parts")),
        };
        out.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    out.push_str("<|assistant|>\n");
    Ok(out)
}

/// What llama.cpp's Python server (llama-cpp-python 0.3.36) answers a prompt of token ids: it
/// validates `prompt` as text (pydantic), and its route handler wraps the validation error
/// as an internal error (`llama_cpp/server/errors.py`, `RouteErrorHandler`): 500 and
/// `{"error": {"message", "type": "internal_server_error", "param": null, "code": null}}`.
pub(crate) fn not_a_string(prompt: Option<&Value>) -> Response {
    validation_error("prompt", "Input should be a valid string", prompt)
}

fn validation_error(field: &str, msg: &str, input: Option<&Value>) -> Response {
    let detail = json!({
        "type": "string_type", "loc": ["body", field], "msg": msg,
        "input": input.cloned().unwrap_or(Value::Null),
    });
    let error = json!({
        "message": format!("1 validation error:\n  {detail}\n"),
        "type": "internal_server_error", "param": null, "code": null,
    });
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        axum::Json(json!({ "error": error })),
    )
        .into_response()
}
