//! Text ↔ tokens at the edge: the tokenizer ([`Tokenizer`], from a [`TokenizerSpec`]) and
//! incremental detokenization ([`Detokenizer`]). Chat prompts are rendered by the chat
//! template and tokenized piecewise by `prompt.rs` (`Tokenizer::encode_segment`).
//!
//! Invariants: [`Tokenizer::encode`] treats special-token strings as plain text (a prompt
//! cannot forge `<|endoftext|>`); only `prompt.rs` asks for special tokens to be parsed, on
//! template text it has checked. Decoding never panics, whatever the token ids (the mocker
//! emits arbitrary ids < 32000, which may form invalid UTF-8 or be outside the vocabulary).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::http::text::pieces::Cuts;

/// Which tokenizer the frontend uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSpec {
    /// A tiktoken encoding built into the binary: `cl100k_base` (the default) or `o200k_base`.
    Tiktoken(String),
    /// A Hugging Face `tokenizer.json` file.
    HuggingFace(PathBuf),
    /// The tokenizer a GGUF model file describes (`tokenizer.ggml.*`): the same one the
    /// native engine's workers use, so frontend and engine tokenize alike.
    Gguf(PathBuf),
}

impl Default for TokenizerSpec {
    fn default() -> Self {
        TokenizerSpec::Tiktoken("cl100k_base".to_string())
    }
}

impl FromStr for TokenizerSpec {
    type Err = TokenizerError;

    /// `cl100k_base` / `o200k_base` (or `tiktoken:<name>`) name a tiktoken encoding; a path
    /// ending in `.gguf` is a GGUF model's tokenizer; anything else is a path to a
    /// `tokenizer.json` (an optional `hf:` prefix is stripped).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(name) = s.strip_prefix("tiktoken:") {
            return Ok(TokenizerSpec::Tiktoken(name.to_string()));
        }
        if TIKTOKEN_NAMES.contains(&s) {
            return Ok(TokenizerSpec::Tiktoken(s.to_string()));
        }
        if s.ends_with(".gguf") {
            return Ok(TokenizerSpec::Gguf(PathBuf::from(s)));
        }
        let path = s.strip_prefix("hf:").unwrap_or(s);
        if path.is_empty() {
            return Err(TokenizerError::UnknownEncoding(s.to_string()));
        }
        Ok(TokenizerSpec::HuggingFace(PathBuf::from(path)))
    }
}

const TIKTOKEN_NAMES: [&str; 2] = ["cl100k_base", "o200k_base"];

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("unknown tiktoken encoding {0:?}; valid: cl100k_base, o200k_base")]
    UnknownEncoding(String),
    #[error("failed to build tiktoken encoding {name}: {message}")]
    Tiktoken { name: String, message: String },
    #[error("failed to load tokenizer {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("failed to encode text: {0}")]
    Encode(String),
}

enum Inner {
    Tiktoken(tiktoken_rs::CoreBPE),
    HuggingFace {
        /// Special-token strings are text (`encode_special_tokens` set).
        plain: Box<tokenizers::Tokenizer>,
        /// The same tokenizer parsing special tokens, built on first use (templated prompts).
        specials: OnceLock<Box<tokenizers::Tokenizer>>,
    },
}

/// A loaded tokenizer. Cheap to share behind an `Arc`; safe to use from many threads.
pub struct Tokenizer {
    name: String,
    inner: Inner,
    /// tiktoken: every token's bytes, looked up per streamed token (empty for Hugging Face).
    table: TokenTable,
}

/// The bytes of every token of a tiktoken vocabulary, end to end, and where each starts: a
/// lookup instead of a hash probe and an allocation per decoded token. No token is empty,
/// so an empty range is an id outside the vocabulary.
#[derive(Default)]
struct TokenTable {
    bytes: Vec<u8>,
    /// `starts[id]..starts[id + 1]`.
    starts: Vec<u32>,
}

impl TokenTable {
    /// Ids are dense but for a few gaps before the special tokens: the table ends after
    /// 1,000 unknown ids in a row.
    fn of(bpe: &tiktoken_rs::CoreBPE) -> TokenTable {
        let mut t = TokenTable {
            bytes: Vec::new(),
            starts: vec![0],
        };
        let (mut id, mut known_len, mut misses) = (0u32, 1, 0);
        while misses < 1_000 {
            match bpe.decode_bytes(&[id]) {
                Ok(b) => {
                    t.bytes.extend_from_slice(&b);
                    misses = 0;
                }
                Err(_) => misses += 1,
            }
            t.starts.push(t.bytes.len() as u32);
            if misses == 0 {
                known_len = t.starts.len();
            }
            id += 1;
        }
        t.starts.truncate(known_len);
        t
    }

    fn get(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (start, end) = (*self.starts.get(i)?, *self.starts.get(i + 1)?);
        (end > start).then(|| &self.bytes[start as usize..end as usize])
    }

    /// Appends token `id`'s bytes to `out` (U+FFFD for an unknown id).
    fn push_bytes(&self, id: u32, out: &mut Vec<u8>) {
        out.extend_from_slice(self.get(id).unwrap_or(REPLACEMENT.as_bytes()));
    }
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads the tokenizer `spec` names (reads the file for Hugging Face).
    pub fn load(spec: &TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        match spec {
            TokenizerSpec::Tiktoken(name) => {
                let built = match name.as_str() {
                    "cl100k_base" => tiktoken_rs::cl100k_base(),
                    "o200k_base" => tiktoken_rs::o200k_base(),
                    other => return Err(TokenizerError::UnknownEncoding(other.to_string())),
                };
                let bpe = built.map_err(|e| TokenizerError::Tiktoken {
                    name: name.clone(),
                    message: e.to_string(),
                })?;
                Ok(Tokenizer {
                    name: name.clone(),
                    table: TokenTable::of(&bpe),
                    inner: Inner::Tiktoken(bpe),
                })
            }
            TokenizerSpec::HuggingFace(path) => {
                let tok =
                    tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
                        path: path.clone(),
                        message: e.to_string(),
                    })?;
                Ok(Self::hugging_face(path, tok))
            }
            TokenizerSpec::Gguf(path) => {
                let load = |e: tandem_native::Error| TokenizerError::Load {
                    path: path.clone(),
                    message: e.to_string(),
                };
                let file = tandem_native::GgufFile::read(path).map_err(load)?;
                let tok = tandem_native::tokenizer::from_gguf(&file).map_err(load)?;
                Ok(Self::hugging_face(path, tok))
            }
        }
    }

    fn hugging_face(path: &std::path::Path, mut tok: tokenizers::Tokenizer) -> Tokenizer {
        // Special-token strings in user text stay plain text.
        tok.set_encode_special_tokens(true);
        Tokenizer {
            name: path.display().to_string(),
            table: TokenTable::default(),
            inner: Inner::HuggingFace {
                plain: Box::new(tok),
                specials: OnceLock::new(),
            },
        }
    }

    /// The encoding name or the file path.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tokenizes `text`, treating special-token strings as plain text. For a Hugging Face
    /// tokenizer the file's post-processor applies (e.g. a leading BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.inner {
            Inner::Tiktoken(bpe) => Ok(bpe.encode_ordinary(text)),
            Inner::HuggingFace { plain, .. } => hf_encode(plain, text, true),
        }
    }

    /// Tokenizes a piece of a rendered chat prompt as Hugging Face does for chats: no
    /// post-processor (`add_special_tokens=False`: the template writes BOS itself) and, when
    /// `parse_special`, special-token strings become their ids. Only `prompt.rs` calls this,
    /// with `parse_special` on template text alone.
    pub(crate) fn encode_segment(
        &self,
        text: &str,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        match &self.inner {
            Inner::Tiktoken(bpe) if parse_special => Ok(bpe.encode_with_special_tokens(text)),
            Inner::Tiktoken(bpe) => Ok(bpe.encode_ordinary(text)),
            Inner::HuggingFace { plain, specials } => {
                let tok = if parse_special {
                    hf_specials(plain, specials)
                } else {
                    plain
                };
                hf_encode(tok, text, false)
            }
        }
    }

    /// Builds the special-token-parsing twin of a Hugging Face tokenizer now rather than on
    /// the first request (it is a copy of the vocabulary).
    pub(crate) fn prepare_special_encoding(&self) {
        if let Inner::HuggingFace { plain, specials } = &self.inner {
            let _ = hf_specials(plain, specials);
        }
    }

    /// The special-token strings of the vocabulary (Hugging Face: added tokens marked
    /// special; tiktoken: its special tokens).
    pub(crate) fn special_tokens(&self) -> Vec<String> {
        match &self.inner {
            Inner::Tiktoken(bpe) => bpe
                .special_tokens()
                .into_iter()
                .map(str::to_string)
                .collect(),
            Inner::HuggingFace { plain, .. } => plain
                .get_added_tokens_decoder()
                .into_values()
                .filter(|t| t.special)
                .map(|t| t.content)
                .collect(),
        }
    }

    /// Where a rendered prompt may be cut and its pieces tokenized apart (`pieces.rs`):
    /// `templated` for a real template's rendering, whose special tokens are parsed.
    pub(crate) fn cuts(&self, templated: bool) -> Cuts {
        match &self.inner {
            Inner::Tiktoken(_) => Cuts::AfterNewline,
            Inner::HuggingFace { plain, .. } if templated => {
                let independent = plain
                    .get_added_tokens_decoder()
                    .values()
                    .filter(|t| t.special)
                    .all(|t| !t.lstrip && !t.single_word && !t.normalized);
                if independent {
                    Cuts::BeforeSpecial
                } else {
                    Cuts::None
                }
            }
            // The whole text goes through the post-processor (a BOS at its start).
            Inner::HuggingFace { .. } => Cuts::None,
        }
    }

    /// Whether `id` is a token of this vocabulary (prompts given as ids are checked).
    pub fn is_valid_token(&self, id: u32) -> bool {
        match &self.inner {
            Inner::Tiktoken(_) => self.table.get(id).is_some(),
            Inner::HuggingFace { plain, .. } => plain.id_to_token(id).is_some(),
        }
    }

    /// Decodes `ids` in one go, lossily (invalid UTF-8 and unknown ids become U+FFFD for
    /// tiktoken; unknown ids are skipped for Hugging Face).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.inner {
            Inner::Tiktoken(_) => {
                let mut bytes = Vec::new();
                for &id in ids {
                    self.table.push_bytes(id, &mut bytes);
                }
                drain_utf8(&mut bytes, true)
            }
            Inner::HuggingFace { plain, .. } => Tokenizer::hf_decode(plain, ids),
        }
    }

    /// The bytes token `id` stands for on its own (what OpenAI's logprobs call `bytes`):
    /// tiktoken's bytes; for a byte-level BPE file the token's string mapped back through
    /// GPT-2's byte-to-character table; otherwise its decoded text. An unknown id: U+FFFD.
    pub fn bytes_of(&self, id: u32) -> Vec<u8> {
        match &self.inner {
            Inner::Tiktoken(_) => {
                let mut out = Vec::new();
                self.table.push_bytes(id, &mut out);
                out
            }
            Inner::HuggingFace { plain, .. } => {
                let byte_level = matches!(
                    plain.get_decoder(),
                    Some(tokenizers::DecoderWrapper::ByteLevel(_))
                );
                let added = plain.get_added_tokens_decoder().contains_key(&id);
                match plain.id_to_token(id) {
                    Some(piece) if byte_level && !added => byte_level_bytes(&piece),
                    Some(_) => Tokenizer::hf_decode(plain, &[id]).into_bytes(),
                    None => REPLACEMENT.as_bytes().to_vec(),
                }
            }
        }
    }

    fn hf_decode(tok: &tokenizers::Tokenizer, ids: &[u32]) -> String {
        // Unknown ids are skipped by the library; an error (none known) shows as nothing.
        tok.decode(ids, true).unwrap_or_default()
    }
}

const REPLACEMENT: &str = "\u{FFFD}";

/// A byte-level BPE token's string → its bytes. GPT-2's table (`bytes_to_unicode` in its
/// `encoder.py`) shows the printable bytes `!`..=`~`, `¡`..=`¬` and `®`..=`ÿ` as
/// themselves and the other 68 bytes, in order, as U+0100 onwards; a character outside
/// the table (none in a byte-level vocabulary) is kept as its UTF-8.
fn byte_level_bytes(piece: &str) -> Vec<u8> {
    let shown_as_itself = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut out = Vec::with_capacity(piece.len());
    for c in piece.chars() {
        let code = u32::from(c);
        if code < 0x100 && shown_as_itself(code) {
            out.push(code as u8);
        } else if let Some(b) = code.checked_sub(0x100).and_then(|n| {
            (0u32..=0xFF)
                .filter(|&b| !shown_as_itself(b))
                .nth(n as usize)
        }) {
            out.push(b as u8);
        } else {
            let mut buf = [0; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
    out
}

/// Turns a stream of token ids into text deltas that only ever contain complete UTF-8
/// characters; what is incomplete waits for the next tokens, and [`Detokenizer::finish`]
/// flushes the rest lossily.
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    /// tiktoken: bytes of an incomplete UTF-8 character (at most 3).
    pending: Vec<u8>,
    /// Hugging Face: ids from `prefix` on; text of `ids[..read]` was already emitted.
    ids: Vec<u32>,
    read: usize,
}

impl fmt::Debug for Detokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detokenizer")
            .field("pending", &self.pending)
            .field("ids", &self.ids.len())
            .finish_non_exhaustive()
    }
}

impl Detokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Detokenizer {
            tokenizer,
            pending: Vec::new(),
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Adds tokens; returns the newly complete text (maybe empty).
    pub fn push(&mut self, tokens: &[u32]) -> String {
        match &self.tokenizer.inner {
            Inner::Tiktoken(_) => {
                // A token is a few bytes: room for most pushes in one allocation.
                self.pending.reserve(tokens.len() * 8);
                for &id in tokens {
                    self.tokenizer.table.push_bytes(id, &mut self.pending);
                }
                drain_utf8(&mut self.pending, false)
            }
            Inner::HuggingFace { plain: tok, .. } => {
                if tokens.is_empty() {
                    return String::new();
                }
                self.ids.extend_from_slice(tokens);
                // Decode with the already-emitted tokens as context (byte-level and
                // sentencepiece decoders depend on neighbours), emit the difference, and wait
                // while the tail is an incomplete character.
                let before = Tokenizer::hf_decode(tok, &self.ids[..self.read]);
                let after = Tokenizer::hf_decode(tok, &self.ids);
                // Bounded wait: a token that decodes to U+FFFD on its own must not hold the
                // text back forever.
                if after.ends_with(REPLACEMENT) && self.ids.len() - self.read < HF_MAX_PENDING {
                    return String::new();
                }
                let delta = text_after(&before, &after).to_string();
                // Keep a few tokens of context only, so memory and work stay bounded.
                let keep_from = self.ids.len().saturating_sub(HF_CONTEXT_TOKENS);
                self.ids.drain(..keep_from);
                self.read = self.ids.len();
                delta
            }
        }
    }

    /// Flushes what is left (incomplete bytes become U+FFFD). Call once, at the end.
    pub fn finish(&mut self) -> String {
        match &self.tokenizer.inner {
            Inner::Tiktoken(_) => drain_utf8(&mut self.pending, true),
            Inner::HuggingFace { plain: tok, .. } => {
                if self.read == self.ids.len() {
                    return String::new();
                }
                let before = Tokenizer::hf_decode(tok, &self.ids[..self.read]);
                let after = Tokenizer::hf_decode(tok, &self.ids);
                self.read = self.ids.len();
                text_after(&before, &after).to_string()
            }
        }
    }
}

/// Tokens of already-emitted context kept for Hugging Face incremental decoding.
const HF_CONTEXT_TOKENS: usize = 6;
/// Most tokens held back waiting for a character to complete (UTF-8 needs at most 4 bytes).
const HF_MAX_PENDING: usize = 4;

/// `after` minus its prefix shared with `before` (at a character boundary).
fn text_after<'a>(before: &str, after: &'a str) -> &'a str {
    if let Some(rest) = after.strip_prefix(before) {
        return rest;
    }
    let common: usize = before
        .chars()
        .zip(after.chars())
        .take_while(|(a, b)| a == b)
        .map(|(a, _)| a.len_utf8())
        .sum();
    &after[common..]
}

/// Takes the longest valid UTF-8 prefix of `bytes` as text. Invalid sequences become U+FFFD;
/// an incomplete character at the end stays in `bytes` unless `flush`.
fn drain_utf8(bytes: &mut Vec<u8>, flush: bool) -> String {
    // Mostly the bytes are whole characters: they become the text, uncopied.
    let whole = match String::from_utf8(std::mem::take(bytes)) {
        Ok(text) => return text,
        Err(e) => e.into_bytes(),
    };
    *bytes = whole;
    let mut out = String::with_capacity(bytes.len() + REPLACEMENT.len());
    let mut rest: &[u8] = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, tail) = rest.split_at(e.valid_up_to());
                // `valid` is valid UTF-8 by construction.
                out.push_str(&String::from_utf8_lossy(valid));
                match e.error_len() {
                    Some(n) => {
                        out.push_str(REPLACEMENT);
                        rest = &tail[n..];
                    }
                    None if flush => {
                        out.push_str(REPLACEMENT);
                        rest = &[];
                        break;
                    }
                    None => {
                        rest = tail;
                        break;
                    }
                }
            }
        }
    }
    let keep = rest.to_vec();
    *bytes = keep;
    out
}

/// The special-token-parsing twin of `plain`, built once.
fn hf_specials<'a>(
    plain: &tokenizers::Tokenizer,
    specials: &'a OnceLock<Box<tokenizers::Tokenizer>>,
) -> &'a tokenizers::Tokenizer {
    specials.get_or_init(|| {
        let mut tok = plain.clone();
        tok.set_encode_special_tokens(false);
        Box::new(tok)
    })
}

fn hf_encode(
    tok: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizerError> {
    tok.encode(text, add_special_tokens)
        .map(|enc| enc.get_ids().to_vec())
        .map_err(|e| TokenizerError::Encode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tests::cl100k;

    #[test]
    fn the_token_table_holds_what_tiktoken_decodes_for_every_id() {
        for name in TIKTOKEN_NAMES {
            let tok = Tokenizer::load(&TokenizerSpec::Tiktoken(name.into())).unwrap();
            let Inner::Tiktoken(bpe) = &tok.inner else {
                unreachable!()
            };
            let mut known = 0;
            for id in 0..tok.table.starts.len() as u32 + 2_000 {
                let want = bpe.decode_bytes(&[id]).ok();
                assert_eq!(tok.table.get(id), want.as_deref(), "{name} id {id}");
                known += usize::from(want.is_some());
            }
            assert!(known > 100_000, "{name}: {known} tokens");
            // Special tokens are in it too.
            let eot = bpe.encode_with_special_tokens("<|endoftext|>");
            assert_eq!(tok.table.get(eot[0]), Some(&b"<|endoftext|>"[..]));
        }
    }

    #[test]
    fn special_token_strings_are_plain_text() {
        let tok = cl100k();
        let ids = tok.encode("<|endoftext|>").unwrap();
        assert!(
            ids.len() > 1,
            "encoded as text, not the special token: {ids:?}"
        );
        assert_eq!(tok.decode(&ids), "<|endoftext|>");
    }

    #[test]
    fn round_trip_and_incremental_deltas_are_whole_characters() {
        let tok = cl100k();
        let text = "héllo wörld, 你好 🦀!";
        let ids = tok.encode(text).unwrap();
        let mut d = Detokenizer::new(tok.clone());
        let mut out = String::new();
        for id in &ids {
            let delta = d.push(&[*id]);
            out.push_str(&delta);
        }
        out.push_str(&d.finish());
        assert_eq!(out, text);
    }

    #[test]
    fn arbitrary_ids_never_panic_and_split_characters_wait() {
        let tok = cl100k();
        // "🦀" is 4 bytes; feed its tokens one at a time: no delta until complete.
        let crab = tok.encode("🦀").unwrap();
        assert!(crab.len() > 1);
        let mut d = Detokenizer::new(tok.clone());
        for id in &crab[..crab.len() - 1] {
            assert_eq!(d.push(&[*id]), "");
        }
        assert_eq!(d.push(&crab[crab.len() - 1..]), "🦀");
        // An incomplete character at the end is flushed lossily.
        let mut d = Detokenizer::new(tok.clone());
        assert_eq!(d.push(&crab[..1]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        // Arbitrary ids, including unknown ones.
        let mut d = Detokenizer::new(tok.clone());
        let mut total = String::new();
        for id in (0..32000).step_by(97).chain([100_256, 4_000_000_000]) {
            total.push_str(&d.push(&[id]));
        }
        total.push_str(&d.finish());
        assert!(!total.is_empty());
        assert!(!tok.is_valid_token(4_000_000_000));
        assert!(tok.is_valid_token(31_999));
    }

    #[test]
    fn byte_level_strings_map_back_to_their_bytes() {
        // The hidden bytes are 0x00..=0x20 (33 of them), 0x7F..=0xA0 and 0xAD: space is
        // U+0120 (Ġ), newline U+010A (Ċ), 0x7F U+0121.
        assert_eq!(byte_level_bytes("Ġthe"), b" the");
        assert_eq!(byte_level_bytes("ĊĊ"), b"\n\n");
        assert_eq!(byte_level_bytes("\u{121}"), [0x7F]);
        assert_eq!(byte_level_bytes("\u{100}"), [0x00]);
        // "é" is C3 A9: both bytes are shown as themselves (Ã, ©).
        assert_eq!(byte_level_bytes("Ã©"), "é".as_bytes());
        assert_eq!(byte_level_bytes("<|im_end|>"), b"<|im_end|>");
    }

    #[test]
    fn drain_utf8_replaces_invalid_bytes_and_keeps_incomplete_tail() {
        let mut bytes = vec![b'a', 0xFF, b'b', 0xE4, 0xBD];
        assert_eq!(drain_utf8(&mut bytes, false), "a\u{FFFD}b");
        assert_eq!(bytes, vec![0xE4, 0xBD]);
        bytes.push(0xA0);
        assert_eq!(drain_utf8(&mut bytes, false), "你");
        assert!(bytes.is_empty());
    }

    #[test]
    fn spec_parsing() {
        assert_eq!(
            "o200k_base".parse::<TokenizerSpec>().unwrap(),
            TokenizerSpec::Tiktoken("o200k_base".into())
        );
        assert_eq!(
            "/models/tokenizer.json".parse::<TokenizerSpec>().unwrap(),
            TokenizerSpec::HuggingFace("/models/tokenizer.json".into())
        );
        assert!(matches!(
            Tokenizer::load(&TokenizerSpec::Tiktoken("p99k".into())),
            Err(TokenizerError::UnknownEncoding(_))
        ));
        assert!(matches!(
            Tokenizer::load(&TokenizerSpec::HuggingFace(
                "/nonexistent/tokenizer.json".into()
            )),
            Err(TokenizerError::Load { .. })
        ));
    }

    /// A tiny word-level tokenizer.json, to exercise the Hugging Face path without a download.
    fn tiny_hf() -> Arc<Tokenizer> {
        let json = r#"{
          "version": "1.0",
          "truncation": null,
          "padding": null,
          "added_tokens": [
            {"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true}
          ],
          "normalizer": null,
          "pre_tokenizer": {"type": "Whitespace"},
          "post_processor": null,
          "decoder": null,
          "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "!": 3},
                    "unk_token": "[UNK]"}
        }"#;
        // Read once, by `load`: the directory goes when this returns.
        let dir = tandem_test_support::temp_dir("hf");
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        Arc::new(Tokenizer::load(&TokenizerSpec::HuggingFace(path)).unwrap())
    }

    #[test]
    fn hugging_face_encode_decode_incremental() {
        let tok = tiny_hf();
        assert_eq!(tok.encode("hello world !").unwrap(), vec![1, 2, 3]);
        // "[UNK]" typed by a user is text, not the special token (here: unknown word → 0).
        assert!(tok.is_valid_token(2));
        assert!(!tok.is_valid_token(99));
        let mut d = Detokenizer::new(tok.clone());
        let mut out = d.push(&[1]);
        out.push_str(&d.push(&[2, 99]));
        out.push_str(&d.push(&[3]));
        out.push_str(&d.finish());
        assert_eq!(out, tok.decode(&[1, 2, 99, 3]));
        assert!(out.contains("hello") && out.contains("world"));
    }
}
