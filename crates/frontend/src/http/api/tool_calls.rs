//! Tool calls in generated text: [`ToolCallParser`] (the config) and [`ToolCallStream`], the
//! Hermes / Qwen 2.5 parser, which splits the text into plain text and tool calls as it
//! streams.
//!
//! The format (Hermes 2 Pro, Qwen 2.5; vLLM's `hermes` parser,
//! `vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`):
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! Streaming: text is released as soon as it cannot be the start of `<tool_call>`; from an
//! opening tag on, text is held back until `</tool_call>`, then the block is parsed and
//! emitted as one tool call. So a client sees a tool call whole, never partial arguments.
//! Between and after tool calls, whitespace-only text is dropped. A block that does not
//! parse (not JSON, no `name`) is released as text, tags included; so is an unclosed block at
//! the end that does not parse without its closing tag. The same parser runs on whole
//! (non-streaming) responses, so both give the same result. Held text is bounded by
//! [`MAX_BLOCK_BYTES`]: a longer block is released as text.

use std::str::FromStr;

use crate::http::conversation::ToolCall;
use crate::http::pyjson::Json;

/// Which tool-call syntax to parse out of the generated text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ToolCallParser {
    /// Hermes when the chat template mentions `<tool_call>` (the built-in default and Qwen
    /// 2.5's do), else none.
    #[default]
    Auto,
    /// Never parse tool calls: the text is returned as generated.
    Disabled,
    /// `<tool_call>{"name": …, "arguments": …}</tool_call>` blocks (Hermes, Qwen 2.5).
    Hermes,
}

impl FromStr for ToolCallParser {
    type Err = String;

    /// `auto`, `none` (or `disabled`, `off`), `hermes` (or `qwen`, `qwen2.5`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ToolCallParser::Auto),
            "none" | "disabled" | "off" => Ok(ToolCallParser::Disabled),
            "hermes" | "qwen" | "qwen2.5" | "qwen25" => Ok(ToolCallParser::Hermes),
            other => Err(format!(
                "unknown tool-call parser {other:?}; valid: auto, none, hermes"
            )),
        }
    }
}

impl ToolCallParser {
    /// Whether tool calls are parsed, given whether the template mentions `<tool_call>`.
    pub fn enabled(self, template_mentions_tool_call: bool) -> bool {
        match self {
            ToolCallParser::Auto => template_mentions_tool_call,
            ToolCallParser::Disabled => false,
            ToolCallParser::Hermes => true,
        }
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// The longest tool-call block held back; a longer one is released as text.
pub(crate) const MAX_BLOCK_BYTES: usize = 1 << 20;

/// What the parser released.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Splits streamed text into text and tool calls (see the module docs).
#[derive(Debug)]
pub(crate) struct ToolCallStream {
    /// Text not yet released: a possible opening-tag prefix, or a block after its tag.
    held: String,
    in_block: bool,
    calls: usize,
    /// Makes tool-call ids: `call_<prefix><n>`.
    id_prefix: String,
}

impl ToolCallStream {
    /// `id_prefix` makes the ids of this response's calls unique.
    pub(crate) fn new(id_prefix: String) -> Self {
        ToolCallStream {
            held: String::new(),
            in_block: false,
            calls: 0,
            id_prefix,
        }
    }

    /// Tool calls released so far.
    pub(crate) fn calls(&self) -> usize {
        self.calls
    }

    /// Adds text; returns what can be released now.
    pub(crate) fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        self.held.push_str(text);
        loop {
            if self.in_block {
                let Some(end) = self.held.find(CLOSE) else {
                    if self.held.len() > MAX_BLOCK_BYTES {
                        let held = std::mem::take(&mut self.held);
                        self.in_block = false;
                        self.text(&mut out, format!("{OPEN}{held}"));
                    }
                    return out;
                };
                let body: String = self.held[..end].to_string();
                self.held.drain(..end + CLOSE.len());
                self.in_block = false;
                match self.parse(&body) {
                    Some(call) => out.push(Piece::Call(call)),
                    None => self.text(&mut out, format!("{OPEN}{body}{CLOSE}")),
                }
                continue;
            }
            if let Some(start) = self.held.find(OPEN) {
                let before: String = self.held[..start].to_string();
                self.text(&mut out, before);
                self.held.drain(..start + OPEN.len());
                self.in_block = true;
                continue;
            }
            // Keep a tail that may still become the opening tag.
            let keep = partial_suffix(&self.held, OPEN);
            let release = self.held.len() - keep;
            let released: String = self.held.drain(..release).collect();
            self.text(&mut out, released);
            return out;
        }
    }

    /// The end of the text: flushes what is held.
    pub(crate) fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        if self.in_block {
            self.in_block = false;
            match self.parse(&held) {
                Some(call) => out.push(Piece::Call(call)),
                None => self.text(&mut out, format!("{OPEN}{held}")),
            }
        } else {
            self.text(&mut out, held);
        }
        out
    }

    /// Releases text, dropping whitespace-only text once a tool call was made.
    fn text(&self, out: &mut Vec<Piece>, text: String) {
        if text.is_empty() || (self.calls > 0 && text.trim().is_empty()) {
            return;
        }
        match out.last_mut() {
            Some(Piece::Text(t)) => t.push_str(&text),
            _ => out.push(Piece::Text(text)),
        }
    }

    /// `{"name": …, "arguments": {…}}` (vLLM also accepts `parameters`) → a tool call.
    fn parse(&mut self, body: &str) -> Option<ToolCall> {
        let json = Json::parse(body.trim()).ok()?;
        let name = json.get("name")?.as_str()?.to_string();
        let arguments = json
            .get("arguments")
            .or_else(|| json.get("parameters"))
            .cloned()
            .unwrap_or(Json::Object(Vec::new()));
        // A string of JSON is taken as the arguments it spells.
        let arguments = match arguments {
            Json::Str(s) => Json::parse(&s).unwrap_or(Json::Str(s)),
            other => other,
        };
        self.calls += 1;
        Some(ToolCall {
            id: format!("call_{}{}", self.id_prefix, self.calls),
            name,
            arguments,
        })
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Parses a whole text: `(text, tool calls)`.
#[cfg(test)]
pub(crate) fn parse_all(text: &str, id_prefix: String) -> (String, Vec<ToolCall>) {
    let mut stream = ToolCallStream::new(id_prefix);
    let mut pieces = stream.push(text);
    pieces.extend(stream.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(chunks: &[&str]) -> Vec<Piece> {
        let mut s = ToolCallStream::new("x".into());
        let mut out: Vec<Piece> = Vec::new();
        let pieces: Vec<Piece> = chunks.iter().flat_map(|c| s.push(c)).collect();
        for p in pieces.into_iter().chain(s.finish()) {
            match (out.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => out.push(p),
            }
        }
        out
    }

    fn call(n: usize, name: &str, args: &str) -> Piece {
        Piece::Call(ToolCall {
            id: format!("call_x{n}"),
            name: name.into(),
            arguments: Json::parse(args).unwrap(),
        })
    }

    #[test]
    fn parses_blocks_split_anywhere() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \
                    \"t\", \"arguments\": {}}\n</tool_call>";
        let want = vec![
            Piece::Text("Let me check.\n".into()),
            call(1, "get_weather", r#"{"city": "Paris", "unit": "c"}"#),
            call(2, "t", "{}"),
        ];
        assert_eq!(feed(&[text]), want);
        // One character at a time gives the same pieces.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(
            feed(&chars.iter().map(String::as_str).collect::<Vec<_>>()),
            want
        );
        let (content, calls) = parse_all(text, "x".into());
        assert_eq!(content, "Let me check.\n");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments_text(), r#"{"city":"Paris","unit":"c"}"#);
    }

    #[test]
    fn text_that_only_looks_like_a_tag_is_released() {
        assert_eq!(
            feed(&["a <tool", "_cal", "x> b <"]),
            vec![Piece::Text("a <tool_calx> b <".into())]
        );
        // A block that is not a tool call comes back as text.
        assert_eq!(
            feed(&["<tool_call>not json</tool_call> ok"]),
            vec![Piece::Text("<tool_call>not json</tool_call> ok".into())]
        );
        // Unclosed at the end: parsed if complete, else text.
        assert_eq!(
            feed(&["<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}"]),
            vec![call(1, "f", r#"{"a": 1}"#)]
        );
        assert_eq!(
            feed(&["<tool_call>{\"name\": \"f\", \"argu"]),
            vec![Piece::Text("<tool_call>{\"name\": \"f\", \"argu".into())]
        );
    }

    #[test]
    fn parser_choice() {
        assert_eq!("hermes".parse(), Ok(ToolCallParser::Hermes));
        assert_eq!("none".parse(), Ok(ToolCallParser::Disabled));
        assert!("xml".parse::<ToolCallParser>().is_err());
        assert!(ToolCallParser::Auto.enabled(true));
        assert!(!ToolCallParser::Auto.enabled(false));
        assert!(!ToolCallParser::Disabled.enabled(true));
    }
}
