//! An engine's answer read into what tandem uses of it: the typed shape of a vLLM or
//! OpenAI-style completion or chat answer (whole, or one streamed chunk), and the delta made
//! of it. Only the fields read here are built while parsing; the rest (the prompt's own token
//! ids, ids, timestamps, fingerprints) are skipped unbuilt, which a `serde_json::Value` of the
//! whole answer would not do.

use serde::Deserialize;
use serde_json::Value;

use super::logprobs::vllm_logprobs;
use super::{EngineDelta, EngineError, EngineFinish};

/// The fields of a vLLM / OpenAI answer that tandem reads. Where the servers differ in shape,
/// the field stays a [`Value`] and is read as before; a field set to `null` is as absent.
#[derive(Debug, Default, Deserialize)]
pub(super) struct VllmAnswer {
    #[serde(default)]
    choices: Option<Vec<VllmChoice>>,
    #[serde(default)]
    usage: Option<Usage>,
    /// llama.cpp's server: what its prompt cache served.
    #[serde(default)]
    timings: Option<Value>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
    /// An error sent in place of a chunk.
    #[serde(default)]
    pub(super) error: Option<Value>,
}

/// The counts of an answer's usage read here; each a [`Value`], read by [`count`] (a count
/// that is not a `u32` is as absent).
#[derive(Debug, Default, Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Value,
    #[serde(default)]
    completion_tokens: Value,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Default, Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Value,
}

#[derive(Debug, Deserialize)]
struct VllmChoice {
    /// `None` where absent or `null`.
    #[serde(default, deserialize_with = "token_ids")]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    text: Option<Value>,
    /// A streamed chat chunk's.
    #[serde(default)]
    delta: Option<Value>,
    /// A whole chat answer's.
    #[serde(default)]
    message: Option<Value>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    finish_reason: Option<Value>,
}

/// A choice's `token_ids` (or `null`), into a list made with room for a short answer's ids:
/// serde's own list grows from empty, four reallocations for a few dozen ids.
fn token_ids<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
    struct Ids;
    impl<'de> serde::de::Visitor<'de> for Ids {
        type Value = Option<Vec<u32>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of token ids or null")
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).clamp(32, 4096));
            while let Some(id) = seq.next_element()? {
                ids.push(id);
            }
            Ok(Some(ids))
        }
    }
    d.deserialize_any(Ids)
}

/// Parses a vLLM / OpenAI-style answer (whole, or one streamed chunk). vLLM echoes the
/// prompt's token ids when asked for the sampled ones (`prompt_token_ids` beside
/// `token_ids`, vllm/entrypoints/openai/protocol.py, `CompletionResponseChoice`): hundreds to
/// thousands of integers tandem sent and does not read, which cost serde more than the rest
/// of the answer. Each such list is cut out by a byte scan before parsing (it holds numbers
/// only, so its end is its first `]`); an answer the cut leaves unparsable (a list of another
/// shape) is parsed as sent.
///
/// The body's UTF-8 is checked once, whole, and the text parsed as a `str`: parsed from
/// bytes, serde_json checks each string on its own (a call per key and value, 19 in a short
/// answer). JSON is UTF-8 (RFC 8259 §8.1), so a body that is not is refused either way.
pub(super) fn parse_answer(body: &[u8]) -> serde_json::Result<VllmAnswer> {
    let text = std::str::from_utf8(body).map_err(|e| {
        <serde_json::Error as serde::de::Error>::custom(format_args!(
            "the answer is not UTF-8: {e}"
        ))
    })?;
    parse_answer_str(text)
}

/// [`parse_answer`] of an answer already known to be text (a streamed event's data).
pub(super) fn parse_answer_str(body: &str) -> serde_json::Result<VllmAnswer> {
    if let Some(cut) = without_prompt_ids(body)
        && let Ok(a) = serde_json::from_str(&cut)
    {
        return Ok(a);
    }
    serde_json::from_str(body)
}

/// `body` with every `"prompt_token_ids":[…]` written `"prompt_token_ids":null`; None when it
/// has none. A quote inside a JSON string is escaped, so the key with its quotes is only
/// ever a key. Every place cut at is an ASCII byte, so a char boundary.
pub(super) fn without_prompt_ids(body: &str) -> Option<String> {
    const KEY: &str = "\"prompt_token_ids\":[";
    // Built once: a finder's set-up (its rare bytes, its fallback searcher) costs more than
    // a search of a short answer.
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(KEY));
    let bytes = body.as_bytes();
    let mut at = FINDER.find(bytes)?;
    let mut out = String::with_capacity(body.len());
    let mut from = 0;
    loop {
        let list = at + KEY.len() - 1;
        let end = list + memchr::memchr(b']', &bytes[list..])? + 1;
        out.push_str(&body[from..list]);
        out.push_str("null");
        from = end;
        match FINDER.find(&bytes[from..]) {
            Some(next) => at = from + next,
            None => break,
        }
    }
    out.push_str(&body[from..]);
    Some(out)
}

pub(super) fn ids(v: &Value) -> Result<Vec<u32>, EngineError> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(a) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| EngineError::Protocol(format!("bad token id {t}")))
            })
            .collect(),
        other => Err(EngineError::Protocol(format!(
            "token ids are not a list: {other}"
        ))),
    }
}

pub(super) fn count(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// One vLLM completion chunk (or whole answer). `text_ok`: a plain OpenAI server's chunk
/// without token ids passes its text on. `top`: the alternatives asked for with logprobs
/// (`None`: no logprobs asked, none read).
/// The answer is taken whole so that its token ids move into the delta, not copied.
pub(super) fn vllm_delta(
    v: VllmAnswer,
    text_ok: bool,
    top: Option<u32>,
) -> Result<EngineDelta, EngineError> {
    let mut d = EngineDelta::default();
    for c in v.choices.into_iter().flatten() {
        let toks = c.token_ids.as_deref();
        // A chat answer's text is its message's (streamed: its delta's) `content`.
        let text = c
            .text
            .as_ref()
            .or_else(|| c.delta.as_ref().and_then(|d| d.get("content")))
            .or_else(|| c.message.as_ref().and_then(|m| m.get("content")))
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty());
        if toks.is_none()
            && let Some(text) = text
        {
            if !text_ok {
                return Err(EngineError::Protocol(
                    "the engine returned text without token ids: it does not support \
                     `return_token_ids` (vLLM ≥ 0.10.2 does); use --engine openai (or \
                     --backend-engine openai) for servers that answer text only"
                        .into(),
                ));
            }
            d.text.get_or_insert_with(String::new).push_str(text);
        }
        let new = c.token_ids.unwrap_or_default();
        if let Some(n) = top
            && !new.is_empty()
        {
            d.logprobs
                .extend(vllm_logprobs(c.logprobs.as_ref(), &new, n)?);
        }
        if d.tokens.is_empty() {
            d.tokens = new;
        } else {
            d.tokens.extend(new);
        }
        d.finish = match c.finish_reason.as_ref().and_then(Value::as_str) {
            Some("length") => Some(EngineFinish::Length),
            Some(_) => Some(EngineFinish::Stop),
            None => d.finish,
        };
    }
    if let Some(u) = &v.usage {
        d.prompt_tokens = count(&u.prompt_tokens);
        d.completion_tokens = count(&u.completion_tokens);
        d.cached_tokens = u
            .prompt_tokens_details
            .as_ref()
            .and_then(|p| count(&p.cached_tokens));
    }
    // llama.cpp's server says what its prompt cache served in `timings` (its
    // `result_timings::to_json`: `cache_n` tokens reused, `prompt_n` evaluated, `predicted_n`
    // generated), on the last chunk, whether or not the usage has the details.
    if let Some(t) = v.timings.as_ref().filter(|t| t.is_object()) {
        let (cache, evaluated) = (
            t.get("cache_n").and_then(count),
            t.get("prompt_n").and_then(count),
        );
        d.cached_tokens = d.cached_tokens.or(cache);
        if let (None, Some(c), Some(e)) = (d.prompt_tokens, cache, evaluated) {
            d.prompt_tokens = Some(c.saturating_add(e));
        }
        d.completion_tokens = d.completion_tokens.or(t.get("predicted_n").and_then(count));
    }
    d.kv_transfer_params = v.kv_transfer_params;
    Ok(d)
}
