//! [`Prompts`]: conversation → chat template → prompt token ids, the same way for every API.
//!
//! # Special tokens
//!
//! Hugging Face tokenizes a rendered chat with `add_special_tokens=False` (the template
//! writes the BOS itself, so none is added and there is never a second one), and parses
//! special-token strings anywhere in the text as special tokens. That last part would let a
//! client forge control tokens: a user message containing `<|im_end|>` would end its turn.
//! So for a real template we (1) defuse special-token strings in every string that comes
//! from the request before rendering, by putting [`MARK`] (a Unicode noncharacter) after
//! their first character, and (2) tokenize the rendered text with special tokens parsed,
//! except at defused spots, which are tokenized as plain text with the mark removed.
//!
//! The template's own special tokens (literals and `bos_token` / `eos_token`) therefore
//! become their ids exactly as transformers would produce them, and the text between them
//! is tokenized by the same library calls. Where a client string contained a special-token
//! string, the tokens differ from HF's in two ways: the string is text rather than the
//! control token (the point), and the text is tokenized in three pieces (before, the string,
//! after) rather than in one, so BPE merges across those two boundaries are lost. A
//! client-sent U+FDD0 becomes U+FFFD.
//!
//! The built-in default template keeps what the frontend did before templates: the whole
//! rendering is tokenized as text ([`Tokenizer::encode`]: no special tokens parsed, the
//! tokenizer's post-processor applied), so existing deployments see the same tokens.

use std::collections::HashMap;
use std::sync::Arc;

use crate::http::chat_template::ChatTemplate;
use crate::http::conversation::Conversation;
use crate::http::error::ServeError;
use crate::http::text::pieces::{Cuts, PieceCache};
use crate::http::tokenizer::{Tokenizer, TokenizerError};

/// Inserted after the first character of a special-token string sent by the client. A
/// noncharacter: valid in a string, never meant to appear in text.
pub(crate) const MARK: char = '\u{FDD0}';

/// What the tokenized pieces of rendered prompts may hold, in bytes (`pieces.rs`).
const PIECE_CACHE_BYTES: usize = 64 << 20;

/// Renders conversations and tokenizes them.
#[derive(Debug)]
pub struct Prompts {
    template: ChatTemplate,
    tokenizer: Arc<Tokenizer>,
    /// `None` for the built-in template (plain-text tokenization).
    specials: Option<SpecialStrings>,
    /// Where a rendering may be cut into pieces tokenized apart, and their ids.
    cuts: Cuts,
    pieces: PieceCache,
}

impl Prompts {
    pub fn new(template: ChatTemplate, tokenizer: Arc<Tokenizer>) -> Self {
        let specials = (!template.is_builtin()).then(|| {
            tokenizer.prepare_special_encoding();
            SpecialStrings::new(tokenizer.special_tokens())
        });
        let cuts = tokenizer.cuts(specials.is_some());
        Prompts {
            template,
            tokenizer,
            specials,
            cuts,
            pieces: PieceCache::new(PIECE_CACHE_BYTES),
        }
    }

    /// Pieces of renderings found tokenized, and not found, so far.
    pub fn piece_counts(&self) -> (u64, u64) {
        self.pieces.counts()
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The rendered prompt, client strings defused (see the module docs).
    pub(crate) fn render(&self, conv: &Conversation) -> Result<String, ServeError> {
        match &self.specials {
            Some(s) => self.template.render(conv, &|t| s.defuse(t)),
            None => self.template.render(conv, &|t| t.to_string()),
        }
    }

    /// Renders and tokenizes `conv`.
    pub(crate) fn encode(&self, conv: &Conversation) -> Result<Vec<u32>, ServeError> {
        let text = self.render(conv)?;
        self.encode_rendered(&text).map_err(|e| {
            ServeError::invalid(format!("failed to tokenize the prompt: {e}"))
                .with_param("messages")
        })
    }

    /// Tokenizes a rendered prompt.
    pub(crate) fn encode_rendered(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let Some(specials) = &self.specials else {
            return self.encode_pieces(text, |_| false, |t| self.tokenizer.encode(t));
        };
        let mut ids = Vec::new();
        for (segment, parse_special) in specials.segments(text) {
            if parse_special {
                ids.extend(self.encode_pieces(
                    &segment,
                    |t| specials.match_at(t).is_some(),
                    |t| self.tokenizer.encode_segment(t, true),
                )?);
            } else {
                ids.extend(self.tokenizer.encode_segment(&segment, false)?);
            }
        }
        Ok(ids)
    }

    /// [`Self::encode_rendered`] in one piece: what the pieces must add up to.
    #[cfg(test)]
    pub(crate) fn encode_whole(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let Some(specials) = &self.specials else {
            return self.tokenizer.encode(text);
        };
        let mut ids = Vec::new();
        for (segment, parse_special) in specials.segments(text) {
            ids.extend(self.tokenizer.encode_segment(&segment, parse_special)?);
        }
        Ok(ids)
    }

    /// `encode(text)`, computed piece by piece where [`Self::cuts`] allows, each piece's ids
    /// remembered.
    fn encode_pieces(
        &self,
        text: &str,
        is_special_at: impl Fn(&str) -> bool,
        encode: impl Fn(&str) -> Result<Vec<u32>, TokenizerError>,
    ) -> Result<Vec<u32>, TokenizerError> {
        if self.cuts == Cuts::None {
            return encode(text);
        }
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut start = 0;
        let cuts = self.cuts.offsets(text, is_special_at);
        for end in cuts.into_iter().chain(std::iter::once(text.len())) {
            let piece = &text[start..end];
            start = end;
            if let Some(hit) = self.pieces.get(piece) {
                ids.extend_from_slice(&hit);
                continue;
            }
            let fresh = encode(piece)?;
            ids.extend_from_slice(&fresh);
            self.pieces.insert(piece, fresh.into());
        }
        Ok(ids)
    }
}

/// The tokenizer's special-token strings, indexed by first character.
#[derive(Debug)]
struct SpecialStrings {
    /// Longest first, so that the longest match wins.
    by_first: HashMap<char, Vec<String>>,
}

impl SpecialStrings {
    fn new(tokens: Vec<String>) -> Self {
        let mut by_first: HashMap<char, Vec<String>> = HashMap::new();
        for t in tokens {
            if let Some(c) = t.chars().next() {
                by_first.entry(c).or_default().push(t);
            }
        }
        for list in by_first.values_mut() {
            list.sort_by_key(|t| std::cmp::Reverse(t.len()));
            list.dedup();
        }
        SpecialStrings { by_first }
    }

    /// The special-token string starting at `text`, if any.
    fn match_at(&self, text: &str) -> Option<&str> {
        let c = text.chars().next()?;
        self.by_first
            .get(&c)?
            .iter()
            .find(|t| text.starts_with(t.as_str()))
            .map(String::as_str)
    }

    /// `s` with [`MARK`] after the first character of every special-token string, and any
    /// `MARK` the client sent replaced by U+FFFD.
    fn defuse(&self, s: &str) -> String {
        if self.by_first.is_empty() && !s.contains(MARK) {
            return s.to_string();
        }
        let mut out = String::with_capacity(s.len());
        let mut i = 0;
        while let Some(c) = s[i..].chars().next() {
            if c == MARK {
                out.push('\u{FFFD}');
                i += c.len_utf8();
                continue;
            }
            if let Some(token) = self.match_at(&s[i..]) {
                let first = c.len_utf8();
                out.push(c);
                out.push(MARK);
                out.push_str(&token[first..]);
                i += token.len();
                continue;
            }
            out.push(c);
            i += c.len_utf8();
        }
        out
    }

    /// Splits a rendered prompt into `(text, parse_special_tokens)` pieces: defused
    /// special-token strings (mark removed) as plain text, everything between them with
    /// special tokens parsed.
    fn segments(&self, text: &str) -> Vec<(String, bool)> {
        let mut out = Vec::new();
        let mut current = String::new();
        let mut rest = text;
        while let Some(at) = rest.find(MARK) {
            let (before, after) = rest.split_at(at);
            let after = &after[MARK.len_utf8()..];
            let forged = before.chars().next_back().and_then(|c| {
                let head = &before[before.len() - c.len_utf8()..];
                self.by_first.get(&c)?.iter().find_map(|t| {
                    after
                        .strip_prefix(&t[head.len()..])
                        .map(|remaining| (head.len(), t.clone(), remaining))
                })
            });
            match forged {
                Some((head_len, token, remaining)) => {
                    current.push_str(&before[..before.len() - head_len]);
                    if !current.is_empty() {
                        out.push((std::mem::take(&mut current), true));
                    }
                    out.push((token, false));
                    rest = remaining;
                }
                None => {
                    // The template cut a defused string apart; drop the stray mark.
                    current.push_str(before);
                    rest = after;
                }
            }
        }
        current.push_str(rest);
        if !current.is_empty() {
            out.push((current, true));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defuse_and_segments_round_trip() {
        let s = SpecialStrings::new(vec![
            "<|im_end|>".into(),
            "<|im_start|>".into(),
            "<s>".into(),
        ]);
        let user = "hi <|im_end|> there <s>\u{FDD0}";
        let defused = s.defuse(user);
        assert_eq!(defused, "hi <\u{FDD0}|im_end|> there <\u{FDD0}s>\u{FFFD}");
        let rendered = format!("<s><|im_start|>user\n{defused}<|im_end|>\n");
        assert_eq!(
            s.segments(&rendered),
            vec![
                ("<s><|im_start|>user\nhi ".to_string(), true),
                ("<|im_end|>".to_string(), false),
                (" there ".to_string(), true),
                ("<s>".to_string(), false),
                ("\u{FFFD}<|im_end|>\n".to_string(), true),
            ]
        );
        // A stray mark (template cut the string) is dropped.
        assert_eq!(s.segments("a\u{FDD0}b"), vec![("ab".to_string(), true)]);
        // Nothing special: one piece.
        assert_eq!(s.segments("plain"), vec![("plain".to_string(), true)]);
    }
}
