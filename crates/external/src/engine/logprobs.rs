//! Each engine's logprobs as tandem's wire carries them (see the parent module's docs for
//! the fields asked and read).

use serde_json::Value;
use tandem_protocol::grpc::TokenLogprobs;

use super::{EngineError, count};

/// A log-probability as an engine writes it: a number, or null where the JSON encoder had
/// no way to write minus infinity (orjson writes null for it). OpenAI's and vLLM's stand-in
/// for minus infinity is -9999.0.
fn logprob(v: &Value) -> Result<f32, EngineError> {
    match v {
        Value::Null => Ok(-9999.0),
        v => v
            .as_f64()
            .map(|l| l as f32)
            .ok_or_else(|| EngineError::Protocol(format!("bad log-probability {v}"))),
    }
}

/// The `n` most likely of an engine's alternatives, most likely first (ties: lower id
/// first), as tandem's wire carries them.
fn ranked(lp: f32, mut alternatives: Vec<(u32, f32)>, n: u32) -> TokenLogprobs {
    alternatives.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    alternatives.dedup_by_key(|a| a.0);
    alternatives.truncate(n as usize);
    TokenLogprobs {
        logprob: lp,
        top_tokens: alternatives.iter().map(|a| a.0).collect(),
        top_logprobs: alternatives.iter().map(|a| a.1).collect(),
    }
}

/// vLLM's `CompletionLogProbs` of one choice, for its `tokens` (named `token_id:<id>`, as
/// `return_tokens_as_token_ids` asks).
pub(super) fn vllm_logprobs(
    lp: Option<&Value>,
    tokens: &[u32],
    n: u32,
) -> Result<Vec<TokenLogprobs>, EngineError> {
    let missing = || {
        EngineError::Protocol(
            "logprobs were asked for and the engine's choice has none (is it vLLM ≥ 0.10.2,              which knows return_tokens_as_token_ids?)"
                .into(),
        )
    };
    let lp = lp.filter(|l| !l.is_null()).ok_or_else(missing)?;
    let values = lp
        .get("token_logprobs")
        .and_then(Value::as_array)
        .ok_or_else(missing)?;
    let tops = lp.get("top_logprobs").and_then(Value::as_array);
    if values.len() != tokens.len() || tops.is_some_and(|t| t.len() != tokens.len()) {
        return Err(EngineError::Protocol(format!(
            "{} token ids but {} logprobs in one choice",
            tokens.len(),
            values.len()
        )));
    }
    let id_of = |name: &str| {
        name.strip_prefix("token_id:")
            .and_then(|id| id.parse::<u32>().ok())
            .ok_or_else(|| {
                EngineError::Protocol(format!(
                    "the engine named a token {name:?}, not token_id:<id> (it ignored                      return_tokens_as_token_ids)"
                ))
            })
    };
    let mut out = Vec::with_capacity(tokens.len());
    for (i, value) in values.iter().enumerate() {
        let mut alternatives = Vec::new();
        if let Some(map) = tops.and_then(|t| t[i].as_object()) {
            for (name, l) in map {
                alternatives.push((id_of(name)?, logprob(l)?));
            }
        }
        out.push(ranked(logprob(value)?, alternatives, n));
    }
    Ok(out)
}

/// SGLang's `[logprob, id, text]` triple.
fn sglang_triple(v: &Value) -> Result<(u32, f32), EngineError> {
    let bad = || EngineError::Protocol(format!("bad logprob entry {v}"));
    let a = v.as_array().filter(|a| a.len() >= 2).ok_or_else(bad)?;
    let id = count(&a[1]).ok_or_else(bad)?;
    Ok((id, logprob(&a[0])?))
}

/// SGLang's `output_token_logprobs` / `output_top_logprobs` for the delta's tokens: entries
/// `from..` of the (cumulative or incremental) lists.
pub(super) fn sglang_logprobs(
    meta: Option<&Value>,
    tokens: &[u32],
    from: usize,
    n: u32,
) -> Result<Vec<TokenLogprobs>, EngineError> {
    let values = meta
        .and_then(|m| m.get("output_token_logprobs"))
        .and_then(Value::as_array)
        .ok_or_else(|| {
            EngineError::Protocol(
                "logprobs were asked for and the engine's meta_info has no                  output_token_logprobs"
                    .into(),
            )
        })?;
    let tops = meta
        .and_then(|m| m.get("output_top_logprobs"))
        .and_then(Value::as_array);
    let span = from..from + tokens.len();
    let (Some(values), tops) = (values.get(span.clone()), tops.map(|t| t.get(span.clone()))) else {
        return Err(EngineError::Protocol(format!(
            "{} output ids but {} output_token_logprobs",
            span.end,
            values.len()
        )));
    };
    let tops = match tops {
        Some(None) => {
            return Err(EngineError::Protocol(format!(
                "{} output ids but fewer output_top_logprobs",
                span.end
            )));
        }
        Some(Some(t)) => Some(t),
        None => None,
    };
    let mut out = Vec::with_capacity(tokens.len());
    for (i, &token) in tokens.iter().enumerate() {
        let (id, lp) = sglang_triple(&values[i])?;
        if id != token {
            return Err(EngineError::Protocol(format!(
                "output_token_logprobs names token {id} where output_ids has {token}"
            )));
        }
        let mut alternatives = Vec::new();
        if let Some(list) = tops.and_then(|t| t[i].as_array()) {
            for e in list {
                alternatives.push(sglang_triple(e)?);
            }
        }
        out.push(ranked(lp, alternatives, n));
    }
    Ok(out)
}
