//! OpenAI chat completions and completions output ([`ChatFormat`]): `chat.completion`,
//! `chat.completion.chunk` and `text_completion` objects, SSE as `data: {chunk}` …
//! `data: [DONE]`.
//!
//! Tool calls (chat only): a whole response has `message.tool_calls` (`content` null when
//! there is no text) and `finish_reason: "tool_calls"`; a stream sends each call in one
//! chunk, `delta.tool_calls: [{"index", "id", "type": "function", "function": {"name",
//! "arguments"}}]`, arguments complete (see `tool_calls.rs` for why calls are never partial).

use crate::http::backend::{Endpoint, FinishReason, ValidRequest};
use crate::http::error::ServeError;
use crate::http::format::{End, Format, sse_data, to_json};
use crate::http::logprobs::{ChatLogprobs, CompletionLogprobs, Rendered};
use crate::http::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, CompletionChoice, Delta, FunctionOut,
    ResponseObject, ToolCallDelta, ToolCallOut, Usage, UsageField,
};
use crate::http::tool_calls::Piece;

const SSE_DONE: &str = "data: [DONE]\n\n";

/// Chat completions or completions output of one request.
#[derive(Debug)]
pub(crate) struct ChatFormat {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Tool calls sent so far in a stream (their `index`).
    calls: usize,
    /// The request asked for logprobs.
    logprobs: bool,
    /// Completions: characters of text sent so far (the next token's `text_offset`).
    offset: usize,
}

impl ChatFormat {
    pub(crate) fn new(req: &ValidRequest) -> Self {
        ChatFormat {
            endpoint: req.endpoint,
            id: req.response_id.clone(),
            created: req.created,
            model: req.model.clone(),
            include_usage: req.include_usage,
            calls: 0,
            logprobs: req.logprobs.is_some(),
            offset: 0,
        }
    }

    /// `usage` on a streamed chunk: absent, or `null` when the client asked for usage.
    fn chunk_usage(&self) -> Option<Option<Usage>> {
        self.include_usage.then_some(None)
    }

    fn object<C: serde::Serialize, U: UsageField>(
        &self,
        object: &'static str,
        choices: C,
        usage: U,
    ) -> String {
        to_json(&ResponseObject {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }

    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Completion => "text_completion",
            _ => "chat.completion.chunk",
        }
    }

    fn chat_chunk(
        &self,
        delta: Delta<'_>,
        logprobs: &[Rendered],
        finish_reason: Option<&'static str>,
    ) -> String {
        let choice = ChatChunkChoice {
            index: 0,
            delta,
            logprobs: (!logprobs.is_empty()).then(|| ChatLogprobs::of(logprobs)),
            finish_reason,
        };
        sse_data(&self.object(self.chunk_object(), [choice], self.chunk_usage()))
    }

    /// A content chunk with the logprobs of the tokens it carries (if any); an empty `text`
    /// is sent as an empty delta.
    fn content_chunk(
        &mut self,
        text: &str,
        logprobs: &[Rendered],
        finish: Option<&'static str>,
    ) -> String {
        match self.endpoint {
            Endpoint::Completion => {
                let logprobs = (!logprobs.is_empty())
                    .then(|| CompletionLogprobs::of(logprobs, &mut self.offset));
                let choice = CompletionChoice {
                    text,
                    index: 0,
                    logprobs,
                    finish_reason: finish,
                };
                sse_data(&self.object(self.chunk_object(), [choice], self.chunk_usage()))
            }
            _ => {
                let delta = Delta {
                    content: (!text.is_empty()).then_some(text),
                    ..Delta::default()
                };
                self.chat_chunk(delta, logprobs, finish)
            }
        }
    }

    fn finish_reason(&self, end: &End) -> &'static str {
        match end.finish {
            FinishReason::Stop if end.tool_calls => "tool_calls",
            f => f.as_str(),
        }
    }
}

impl ChatFormat {
    /// A whole answer of text alone (no tool calls, no logprobs), a `chat.completion` or a
    /// `text_completion` as the endpoint is: the bytes serde writes for its
    /// [`ResponseObject`] (a test holds them equal), with the fixed parts written a piece at
    /// a time, not key by key (serde_json escapes each key as it writes it, and makes a call
    /// per comma and colon: a third of a short answer's cost).
    fn text_whole(&self, content: &str, finish_reason: &'static str, usage: Usage) -> String {
        let chat = self.endpoint != Endpoint::Completion;
        let mut out =
            String::with_capacity(300 + self.id.len() + self.model.len() + content.len() * 5 / 4);
        let mut digits = itoa::Buffer::new();
        out.push_str("{\"id\":");
        push_json_str(&mut out, &self.id);
        out.push_str(if chat {
            ",\"object\":\"chat.completion\",\"created\":"
        } else {
            ",\"object\":\"text_completion\",\"created\":"
        });
        out.push_str(digits.format(self.created));
        out.push_str(",\"model\":");
        push_json_str(&mut out, &self.model);
        if chat {
            out.push_str(
                ",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":",
            );
            push_json_str(&mut out, content);
            out.push_str(",\"refusal\":null},\"logprobs\":null,\"finish_reason\":");
        } else {
            out.push_str(",\"choices\":[{\"text\":");
            push_json_str(&mut out, content);
            out.push_str(",\"index\":0,\"logprobs\":null,\"finish_reason\":");
        }
        push_json_str(&mut out, finish_reason);
        out.push_str("}],\"usage\":{\"prompt_tokens\":");
        out.push_str(digits.format(usage.prompt_tokens));
        out.push_str(",\"completion_tokens\":");
        out.push_str(digits.format(usage.completion_tokens));
        out.push_str(",\"total_tokens\":");
        out.push_str(digits.format(usage.total_tokens));
        out.push_str(",\"prompt_tokens_details\":{\"cached_tokens\":");
        out.push_str(digits.format(usage.prompt_tokens_details.cached_tokens));
        out.push_str("}}}");
        out
    }
}

/// `s` as a JSON string, escaped as serde_json escapes it (serde_json/src/ser.rs,
/// `ESCAPE`): `"` and `\\` with a backslash; backspace, form feed, newline, carriage return
/// and tab by their short forms; other control characters below U+0020 as `\u00xx`, in
/// lower-case hex; everything else (DEL and all non-ASCII included) as it is.
fn push_json_str(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    let bytes = s.as_bytes();
    let mut start = 0;
    // Runs with nothing to escape (most text) go by a plain scan and are copied whole.
    while let Some(run) = bytes[start..]
        .iter()
        .position(|&b| b < 0x20 || b == b'"' || b == b'\\')
    {
        let i = start + run;
        let b = bytes[i];
        let short = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            _ => "",
        };
        // Every byte escaped is ASCII, so `i` is a char boundary.
        out.push_str(&s[start..i]);
        if short.is_empty() {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        } else {
            out.push_str(short);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

impl Format for ChatFormat {
    /// Chat streams open with `delta: {"role": "assistant", "content": ""}`.
    fn open(&mut self) -> String {
        if self.endpoint == Endpoint::Completion {
            return String::new();
        }
        let delta = Delta {
            role: Some("assistant"),
            content: Some(""),
            ..Delta::default()
        };
        self.chat_chunk(delta, &[], None)
    }

    fn step(&mut self, pieces: Vec<Piece>, logprobs: &[Rendered], end: Option<&End>) -> String {
        let mut out = String::new();
        let finish = end.map(|e| self.finish_reason(e));
        let n = pieces.len();
        let mut finish_sent = false;
        // The step's logprobs go with its first text (or, with none, an empty delta).
        let mut logprobs = Some(logprobs).filter(|l| !l.is_empty());
        for (i, piece) in pieces.iter().enumerate() {
            match piece {
                // The last text of the stream carries the finish reason, as before tools.
                Piece::Text(t) if i + 1 == n => {
                    let l = logprobs.take().unwrap_or_default();
                    out.push_str(&self.content_chunk(t, l, finish));
                    finish_sent = finish.is_some();
                }
                Piece::Text(t) => {
                    let l = logprobs.take().unwrap_or_default();
                    out.push_str(&self.content_chunk(t, l, None));
                }
                Piece::Call(call) => {
                    let arguments = call.arguments_text();
                    let delta = Delta {
                        tool_calls: Some(vec![ToolCallDelta {
                            index: self.calls,
                            id: &call.id,
                            kind: "function",
                            function: FunctionOut {
                                name: &call.name,
                                arguments: &arguments,
                            },
                        }]),
                        ..Delta::default()
                    };
                    self.calls += 1;
                    out.push_str(&self.chat_chunk(delta, &[], None));
                }
            }
        }
        let Some(end) = end else {
            if let Some(l) = logprobs {
                out.push_str(&self.content_chunk("", l, None));
            }
            return out;
        };
        if !finish_sent {
            let l = logprobs.unwrap_or_default();
            out.push_str(&self.content_chunk("", l, finish));
        }
        if self.include_usage {
            let usage = self.object(self.chunk_object(), [(); 0], Some(Some(end.usage)));
            out.push_str(&sse_data(&usage));
        }
        out.push_str(SSE_DONE);
        out
    }

    /// `data: {"error": …}` then `data: [DONE]` (what vLLM does; clients that only look for
    /// `[DONE]` still terminate).
    fn stream_error(&mut self, e: &ServeError) -> String {
        format!("{}{SSE_DONE}", sse_data(&e.to_json()))
    }

    fn whole(&mut self, pieces: Vec<Piece>, logprobs: &[Rendered], end: &End) -> String {
        // Sized once: a piece a token would otherwise grow it five times in a short answer.
        let mut text = String::with_capacity(
            pieces
                .iter()
                .map(|p| match p {
                    Piece::Text(t) => t.len(),
                    Piece::Call(_) => 0,
                })
                .sum(),
        );
        let mut calls = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(c) => calls.push(c),
            }
        }
        let usage = end.usage;
        match self.endpoint {
            Endpoint::Completion if !self.logprobs => {
                self.text_whole(&text, end.finish.as_str(), usage)
            }
            Endpoint::Completion => {
                let choice = CompletionChoice {
                    text: &text,
                    index: 0,
                    logprobs: self
                        .logprobs
                        .then(|| CompletionLogprobs::of(logprobs, &mut 0)),
                    finish_reason: Some(end.finish.as_str()),
                };
                self.object("text_completion", [choice], Some(Some(usage)))
            }
            _ => {
                let arguments: Vec<String> = calls.iter().map(|c| c.arguments_text()).collect();
                let tool_calls = (!calls.is_empty()).then(|| {
                    calls
                        .iter()
                        .zip(&arguments)
                        .map(|(c, a)| ToolCallOut {
                            id: &c.id,
                            kind: "function",
                            function: FunctionOut {
                                name: &c.name,
                                arguments: a,
                            },
                        })
                        .collect()
                });
                if tool_calls.is_none() && !self.logprobs {
                    return self.text_whole(&text, self.finish_reason(end), usage);
                }
                let content = (tool_calls.is_none() || !text.is_empty()).then_some(text.as_str());
                let choice = ChatChoice {
                    index: 0,
                    message: AssistantMessage {
                        role: "assistant",
                        content,
                        refusal: None,
                        tool_calls,
                    },
                    logprobs: self.logprobs.then(|| ChatLogprobs::of(logprobs)),
                    finish_reason: self.finish_reason(end),
                };
                self.object("chat.completion", [choice], usage)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format(endpoint: Endpoint, id: &str, model: &str) -> ChatFormat {
        ChatFormat {
            endpoint,
            id: id.into(),
            created: 1_796_689_529,
            model: model.into(),
            include_usage: false,
            calls: 0,
            logprobs: false,
            offset: 0,
        }
    }

    /// What serde writes for the same answer: the shape the hand-written one must match.
    fn by_serde(f: &ChatFormat, content: &str, finish_reason: &'static str, u: Usage) -> String {
        if f.endpoint == Endpoint::Completion {
            let choice = CompletionChoice {
                text: content,
                index: 0,
                logprobs: None,
                finish_reason: Some(finish_reason),
            };
            return f.object("text_completion", [choice], Some(Some(u)));
        }
        let choice = ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant",
                content: Some(content),
                refusal: None,
                tool_calls: None,
            },
            logprobs: None,
            finish_reason,
        };
        f.object("chat.completion", [choice], u)
    }

    #[test]
    fn a_text_answer_is_written_as_serde_writes_it() {
        let every_control: String = (0u8..0x20).map(char::from).collect();
        let contents = [
            "",
            "1. Red\n2. Blue\n3. Green",
            "a \"quoted\" back\\slash / and \u{7f} DEL",
            "héllo — 漢字 🦀 \u{2028}\u{2029}",
            every_control.as_str(),
            "\\u0041 \\\" \\\\",
        ];
        let usages = [
            Usage::new(0, 0, 0),
            Usage::new(150, 16, 32),
            Usage::new(u32::MAX, 1, 7),
        ];
        for (i, content) in contents.iter().enumerate() {
            for endpoint in [Endpoint::Chat, Endpoint::Completion] {
                for (id, model) in [("chatcmpl-1f2e3d4c-42", "mocker"), ("x\"y", "org/m\\1\n")] {
                    let f = format(endpoint, id, model);
                    for finish in ["stop", "length", "tool_calls", "content_filter"] {
                        let u = usages[i % usages.len()];
                        let fast = f.text_whole(content, finish, u);
                        assert_eq!(fast, by_serde(&f, content, finish, u), "{content:?}");
                        let v: serde_json::Value = serde_json::from_str(&fast).unwrap();
                        let text = match endpoint {
                            Endpoint::Completion => &v["choices"][0]["text"],
                            _ => &v["choices"][0]["message"]["content"],
                        };
                        assert_eq!(*text, *content);
                    }
                }
            }
        }
    }
}
