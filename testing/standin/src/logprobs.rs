//! The logprobs of the stand-in's completions, in vLLM's shape.

use serde_json::{Value, json};

use crate::text::token_text;

/// vLLM's `CompletionLogProbs` for one token (`text_offset` into the choice's text so far):
/// the sampled token's log-probability, and a map holding it and the most likely
/// alternatives (`vllm/entrypoints/openai/serving_completion.py`,
/// `_create_completion_logprobs`), tokens named `token_id:<id>` under
/// `return_tokens_as_token_ids`.
pub(crate) fn completion_logprobs(
    logprobs: Option<u8>,
    tokens_as_ids: bool,
    outs: &[&tandem_engine::RequestOutput],
    mut text_offset: usize,
) -> Value {
    if logprobs.is_none() {
        return Value::Null;
    }
    let name = |t: u32| {
        if tokens_as_ids {
            format!("token_id:{t}")
        } else {
            token_text(&[t])
        }
    };
    let (mut offsets, mut values, mut names, mut tops) = (vec![], vec![], vec![], vec![]);
    for o in outs {
        let (lp, top) = o
            .logprobs
            .as_deref()
            .map_or((0.0, Vec::new()), |l| (l.logprob, l.top.clone()));
        offsets.push(text_offset);
        text_offset += token_text(&[o.token]).len();
        values.push(lp);
        names.push(name(o.token));
        let mut map = serde_json::Map::new();
        map.insert(name(o.token), json!(lp));
        for (t, l) in top {
            map.insert(name(t), json!(l));
        }
        tops.push(Value::Object(map));
    }
    json!({"text_offset": offsets, "token_logprobs": values, "tokens": names, "top_logprobs": tops})
}
