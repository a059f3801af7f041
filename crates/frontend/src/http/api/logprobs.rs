//! Logprobs in OpenAI's shapes: the backend's per-token [`TokenLogprob`] rendered with the
//! tokenizer ([`Rendered`]: each token's text and bytes), then serialized as chat's
//! `logprobs.content[]` or completions' `{tokens, token_logprobs, top_logprobs,
//! text_offset}` (OpenAI's API reference; vLLM's `ChatCompletionLogProbs` and
//! `CompletionLogProbs` in `vllm/entrypoints/openai/protocol.py` have the same fields).

use serde::Serialize;
use serde::ser::SerializeMap;

use crate::http::backend::TokenLogprob;
use crate::http::tokenizer::Tokenizer;

/// What OpenAI and vLLM show for a token with no probability (JSON has no -infinity).
const FLOOR: f32 = -9999.0;

fn finite(l: f32) -> f32 {
    if l.is_nan() { FLOOR } else { l.max(FLOOR) }
}

/// One token (or alternative) as shown: its text (lossy for a token that is part of a
/// character), its bytes and log-probability.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Shown {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

impl Shown {
    fn of(tokenizer: &Tokenizer, id: u32, logprob: f32) -> Shown {
        let bytes = tokenizer.bytes_of(id);
        Shown {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob: finite(logprob),
        }
    }
}

/// A generated token with its alternatives, most likely first.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Rendered {
    pub chosen: Shown,
    pub top: Vec<Shown>,
}

impl Rendered {
    pub(crate) fn of(tokenizer: &Tokenizer, token: u32, l: &TokenLogprob) -> Rendered {
        Rendered {
            chosen: Shown::of(tokenizer, token, l.logprob),
            top: l
                .top
                .iter()
                .map(|&(t, lp)| Shown::of(tokenizer, t, lp))
                .collect(),
        }
    }
}

/// Chat's `choices[].logprobs`: `{"content": [...]}`.
#[derive(Debug, Serialize)]
pub(crate) struct ChatLogprobs<'a> {
    pub content: Vec<ChatToken<'a>>,
}

/// A generated token: its own fields, then its alternatives'.
#[derive(Debug, Serialize)]
pub(crate) struct ChatToken<'a> {
    #[serde(flatten)]
    pub chosen: ChatAlternative<'a>,
    pub top_logprobs: Vec<ChatAlternative<'a>>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatAlternative<'a> {
    pub token: &'a str,
    pub logprob: f32,
    pub bytes: &'a [u8],
}

impl<'a> ChatLogprobs<'a> {
    pub(crate) fn of(entries: &'a [Rendered]) -> Self {
        let alt = |s: &'a Shown| ChatAlternative {
            token: &s.token,
            logprob: s.logprob,
            bytes: &s.bytes,
        };
        ChatLogprobs {
            content: entries
                .iter()
                .map(|e| ChatToken {
                    chosen: alt(&e.chosen),
                    top_logprobs: e.top.iter().map(alt).collect(),
                })
                .collect(),
        }
    }
}

/// Completions' `choices[].logprobs`. `text_offset` counts characters of the completion
/// text from its start (across a stream's chunks).
#[derive(Debug, Serialize)]
pub(crate) struct CompletionLogprobs<'a> {
    pub tokens: Vec<&'a str>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<TopMap<'a>>,
    pub text_offset: Vec<usize>,
}

/// `{token: logprob}` of a completions token: the alternatives and the chosen token, most
/// likely first; a string two tokens share keeps the first (likelier) one's.
#[derive(Debug)]
pub(crate) struct TopMap<'a>(Vec<(&'a str, f32)>);

impl Serialize for TopMap<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'a> CompletionLogprobs<'a> {
    /// The entries of one response (or chunk); `offset` is the completion's length in
    /// characters before them, advanced past them.
    pub(crate) fn of(entries: &'a [Rendered], offset: &mut usize) -> Self {
        let mut out = CompletionLogprobs {
            tokens: Vec::with_capacity(entries.len()),
            token_logprobs: Vec::with_capacity(entries.len()),
            top_logprobs: Vec::with_capacity(entries.len()),
            text_offset: Vec::with_capacity(entries.len()),
        };
        for e in entries {
            out.tokens.push(&e.chosen.token);
            out.token_logprobs.push(e.chosen.logprob);
            let mut top: Vec<(&str, f32)> = Vec::with_capacity(e.top.len() + 1);
            let candidates = e.top.iter().chain(std::iter::once(&e.chosen));
            for s in candidates {
                if !top.iter().any(|(k, _)| *k == s.token) {
                    top.push((&s.token, s.logprob));
                }
            }
            out.top_logprobs.push(TopMap(top));
            out.text_offset.push(*offset);
            *offset += e.chosen.token.chars().count();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tests::cl100k;

    fn rendered() -> Vec<Rendered> {
        let tok = cl100k();
        let ids = tok.encode("Hello world").unwrap();
        let hello = TokenLogprob {
            logprob: -0.5,
            top: vec![(ids[0], -0.5), (ids[1], -1.25)],
        };
        let world = TokenLogprob {
            logprob: f32::NEG_INFINITY,
            top: vec![],
        };
        vec![
            Rendered::of(&tok, ids[0], &hello),
            Rendered::of(&tok, ids[1], &world),
        ]
    }

    #[test]
    fn chat_entries_carry_text_bytes_and_alternatives() {
        let r = rendered();
        let v = serde_json::to_value(ChatLogprobs::of(&r)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"content": [
                {"token": "Hello", "logprob": -0.5, "bytes": [72, 101, 108, 108, 111],
                 "top_logprobs": [
                    {"token": "Hello", "logprob": -0.5, "bytes": [72, 101, 108, 108, 111]},
                    {"token": " world", "logprob": -1.25,
                     "bytes": [32, 119, 111, 114, 108, 100]}]},
                {"token": " world", "logprob": -9999.0, "bytes": [32, 119, 111, 114, 108, 100],
                 "top_logprobs": []}
            ]})
        );
    }

    #[test]
    fn completion_entries_have_offsets_across_chunks_and_one_key_per_string() {
        let r = rendered();
        let mut offset = 3;
        let v = serde_json::to_value(CompletionLogprobs::of(&r, &mut offset)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "tokens": ["Hello", " world"],
                "token_logprobs": [-0.5, -9999.0],
                "top_logprobs": [{"Hello": -0.5, " world": -1.25}, {" world": -9999.0}],
                "text_offset": [3, 8],
            })
        );
        assert_eq!(offset, 14);
    }
}
