//! Requests to a server that takes its prompt as text (an `openai` engine that refused token
//! ids at start, `probe.rs`): a completions prompt to `POST /v1/completions`, a chat's
//! messages to `POST /v1/chat/completions`, where the server renders them with its own
//! template. The body holds only fields of OpenAI's own API (`openai/types/completion_create_params.py`
//! and `chat/completion_create_params.py`: `model`, `prompt` / `messages`, `tools`,
//! `max_tokens`, `temperature`, `top_p`, `seed`, `stream`, `stream_options.include_usage`),
//! and the sampling cuts llama.cpp's and vLLM's servers take beside them (`top_k`, `min_p`)
//! when set; vLLM's token-id extensions stay out. The answer's text comes back as the text of
//! the chunks (`choices[].text`, or a chat's `delta.content` / `message.content`), tokenized
//! by the frontend.

use serde_json::{Value, json};

use super::{EngineApi, EngineGenerate};
use tandem_protocol::grpc::{PromptText, prompt_text::Kind};

/// A prompt as text.
#[derive(Clone, Debug, PartialEq)]
pub enum TextPrompt {
    /// A completions prompt.
    Completion(String),
    /// A conversation: chat completions' `messages` list and its `tools` (None: none).
    Chat {
        messages: Value,
        tools: Option<Value>,
    },
}

impl TextPrompt {
    /// From the request plane's form; a conversation whose JSON does not parse, or is not a
    /// list, is refused with why.
    pub fn from_proto(text: &PromptText) -> Result<Option<TextPrompt>, String> {
        let list = |what: &str, json: &str| -> Result<Value, String> {
            match serde_json::from_str::<Value>(json) {
                Ok(v) if v.is_array() => Ok(v),
                Ok(_) => Err(format!("the chat's {what} are not a JSON list")),
                Err(e) => Err(format!("the chat's {what} are not JSON: {e}")),
            }
        };
        Ok(match &text.kind {
            None => None,
            Some(Kind::Completion(p)) => Some(TextPrompt::Completion(p.clone())),
            Some(Kind::Chat(c)) => Some(TextPrompt::Chat {
                messages: list("messages", &c.messages_json)?,
                tools: match c.tools_json.as_str() {
                    "" => None,
                    json => Some(list("tools", json)?),
                },
            }),
        })
    }
}

impl EngineApi {
    /// The body of a text request.
    pub(super) fn text_body(&self, req: &EngineGenerate, text: &TextPrompt, stream: bool) -> Value {
        let model = req.lora_adapter.as_deref().unwrap_or(&self.model);
        let mut b = json!({
            "model": model,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "stream": stream,
        });
        match text {
            TextPrompt::Completion(p) => b["prompt"] = json!(p),
            TextPrompt::Chat { messages, tools } => {
                b["messages"] = messages.clone();
                if let Some(t) = tools {
                    b["tools"] = t.clone();
                }
            }
        }
        super::openai_sampling(&mut b, req, stream);
        if req.ignore_eos {
            b["ignore_eos"] = json!(true);
        }
        b
    }
}
