//! Model cascades: a request for a cascade's name goes to its small model's groups first,
//! asked for token log-probabilities and for the whole answer at once; if the answer's mean
//! log-probability per token is at least the cascade's threshold it is the client's (streamed
//! as one chunk if the client asked for a stream, log-probabilities removed unless asked
//! for), else the request goes, as the client sent it, to the large model's groups. A small
//! model that fails, or does not report log-probabilities, is escalated too; a client may ask
//! for the large model at once (`x-tandem-escalate: 1`).
//!
//! With a `verifier`, an answer sure enough is also put to that model (a judge: the
//! conversation, the answer, and a question it answers yes or no), and escalated unless its
//! probability of "yes" reaches `min_verifier_score`; a verifier that fails escalates too.
//!
//! The response says which answered: `x-tandem-cascade` (`small`, `escalated`, or
//! `asked`), `x-tandem-cascade-confidence` (the mean log-probability, where there was one)
//! and `x-tandem-cascade-verifier-score` (where the verifier judged).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};
use tandem_router::groups::CascadeConfig;

use super::{Caller, GroupGate, Resume, Routed, serve_from};
use crate::http::backend::Endpoint;
use crate::http::error::ServeError;

/// The most of the small model's answer read to judge it.
const ANSWER_LIMIT: usize = 8 << 20;

/// Serves a request for cascade `cascade` (see the module docs).
pub(super) async fn serve(
    gate: &Arc<GroupGate>,
    endpoint: Endpoint,
    cascade: CascadeConfig,
    body: Bytes,
    caller: &Caller,
    try_retry: &(dyn Fn() -> bool + Send + Sync),
) -> Response {
    let Ok(request) = serde_json::from_slice::<Map<String, Value>>(&body) else {
        return ServeError::invalid("the body is not a JSON object").into_response();
    };
    let chat = endpoint == Endpoint::Chat;
    if caller.escalate {
        gate.count_cascade(&cascade.name, "asked");
        return large(
            gate,
            endpoint,
            &cascade,
            request,
            caller,
            try_retry,
            ("asked", None),
        )
        .await;
    }
    let mut small = request.clone();
    small.insert("model".into(), cascade.small.clone().into());
    small.insert("stream".into(), false.into());
    small.remove("stream_options");
    if chat {
        small.insert("logprobs".into(), true.into());
    } else if !small.get("logprobs").is_some_and(Value::is_u64) {
        small.insert("logprobs".into(), 1.into());
    }
    let answer = ask(gate, endpoint, &small, caller, try_retry).await;
    let judged = match answer {
        Some((response, Ok(v))) if response.status().is_success() => {
            let mean = mean_logprob(&v, chat);
            let sure = match cascade.min_mean_logprob {
                Some(threshold) => mean.is_some_and(|m| m >= threshold),
                None => true,
            };
            let score = match (&cascade.verifier, sure) {
                (Some(_), true) => {
                    verify(gate, &cascade, &request, &v, chat, caller, try_retry).await
                }
                _ => None,
            };
            let verified = cascade.verifier.is_none()
                || score.is_some_and(|s| s >= cascade.min_verifier_score);
            if sure && verified {
                gate.count_cascade(&cascade.name, "small");
                let mut response = answered_small(response, v, &request, chat, mean);
                mark_score(&mut response, score);
                return response;
            }
            (mean, score)
        }
        _ => (None, None),
    };
    gate.count_cascade(&cascade.name, "escalated");
    let mut response = large(
        gate,
        endpoint,
        &cascade,
        request,
        caller,
        try_retry,
        ("escalated", judged.0),
    )
    .await;
    mark_score(&mut response, judged.1);
    response
}

/// `caller` for a request the cascade wrote: its `model` and `max_tokens` are the body's.
fn for_body(caller: &Caller, body: &Map<String, Value>) -> Caller {
    let count = |key: &str| {
        body.get(key)
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
    };
    Caller {
        model: body
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string),
        max_tokens: count("max_tokens").or_else(|| count("max_completion_tokens")),
        ..caller.clone()
    }
}

/// Sends `body` through the groups and reads the answer whole: its head, and its JSON
/// (or why not).
async fn ask(
    gate: &Arc<GroupGate>,
    endpoint: Endpoint,
    body: &Map<String, Value>,
    caller: &Caller,
    try_retry: &(dyn Fn() -> bool + Send + Sync),
) -> Option<(Response<()>, Result<Value, ()>)> {
    let bytes = Bytes::from(serde_json::to_vec(body).ok()?);
    let start = Resume::start(for_body(caller, body));
    let Routed::Done(response) =
        serve_from(gate, endpoint, false, "", bytes, try_retry, start).await
    else {
        return None;
    };
    let (head, answer) = response.into_parts();
    let read = axum::body::to_bytes(answer, ANSWER_LIMIT).await;
    let value = read
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .ok_or(());
    Some((Response::from_parts(head, ()), value))
}

/// The request, unchanged but for its `model`, through the large model's groups; `verdict`:
/// why (`x-tandem-cascade`) and the small model's confidence, where it had one.
async fn large(
    gate: &Arc<GroupGate>,
    endpoint: Endpoint,
    cascade: &CascadeConfig,
    mut request: Map<String, Value>,
    caller: &Caller,
    try_retry: &(dyn Fn() -> bool + Send + Sync),
    (why, confidence): (&'static str, Option<f64>),
) -> Response {
    request.insert("model".into(), cascade.large.clone().into());
    let bytes = Bytes::from(serde_json::to_vec(&request).unwrap_or_default());
    let start = Resume::start(for_body(caller, &request));
    let mut response = match serve_from(gate, endpoint, false, "", bytes, try_retry, start).await {
        Routed::Done(response) => response,
        // A cascade's models have no pool group (the config refuses it).
        Routed::Pool { .. } => {
            ServeError::internal("a cascade's large model was routed to a pool").into_response()
        }
    };
    mark(&mut response, why, confidence);
    response
}

/// The small model's answer as the client asked for it.
fn answered_small(
    head: Response<()>,
    mut v: Value,
    request: &Map<String, Value>,
    chat: bool,
    mean: Option<f64>,
) -> Response {
    let wants_logprobs = match request.get("logprobs") {
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(_)) => true,
        _ => false,
    };
    if !wants_logprobs && let Some(choices) = v["choices"].as_array_mut() {
        for c in choices {
            if let Some(c) = c.as_object_mut() {
                c.remove("logprobs");
            }
        }
    }
    let stream = request.get("stream") == Some(&Value::Bool(true));
    let (parts, ()) = head.into_parts();
    let mut response = if stream {
        let mut r = Response::new(Body::from(as_events(&v, chat)));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r
    } else {
        let mut r = Response::new(Body::from(serde_json::to_vec(&v).unwrap_or_default()));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    };
    *response.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        if name.as_str().starts_with("x-tandem-") || name.as_str() == "x-request-id" {
            response.headers_mut().append(name, value.clone());
        }
    }
    mark(&mut response, "small", mean);
    response
}

/// Asks the cascade's verifier whether the small model's answer `v` to `request` is right:
/// the conversation, the answer, then the verifier's prompt, one token back with its
/// alternatives' log-probabilities. The score is the probability of "yes" against "no"
/// among them (or, with none reported, 1 for an answer that starts with "yes", 0 else);
/// `None`: the verifier failed.
async fn verify(
    gate: &Arc<GroupGate>,
    cascade: &CascadeConfig,
    request: &Map<String, Value>,
    v: &Value,
    chat: bool,
    caller: &Caller,
    try_retry: &(dyn Fn() -> bool + Send + Sync),
) -> Option<f64> {
    let answer = if chat {
        v["choices"][0]["message"]["content"].as_str()?
    } else {
        v["choices"][0]["text"].as_str()?
    };
    let mut messages = if chat {
        request.get("messages")?.as_array()?.clone()
    } else {
        let prompt = request.get("prompt")?.as_str()?;
        vec![serde_json::json!({"role": "user", "content": prompt})]
    };
    messages.push(serde_json::json!({"role": "assistant", "content": answer}));
    messages.push(serde_json::json!({"role": "user", "content": cascade.verifier_prompt}));
    let mut body = Map::new();
    body.insert("model".into(), cascade.verifier.clone()?.into());
    body.insert("messages".into(), messages.into());
    body.insert("max_tokens".into(), 1.into());
    body.insert("temperature".into(), 0.into());
    body.insert("logprobs".into(), true.into());
    body.insert("top_logprobs".into(), 10.into());
    let (head, judged) = ask(gate, Endpoint::Chat, &body, caller, try_retry).await?;
    if !head.status().is_success() {
        return None;
    }
    verdict(&judged.ok()?)
}

/// The probability of "yes" in a verifier's answer (see [`verify`]).
pub(crate) fn verdict(v: &Value) -> Option<f64> {
    let choice = &v["choices"][0];
    let word = |t: &str| t.trim().to_ascii_lowercase();
    let (mut yes, mut no) = (0.0, 0.0);
    let first = &choice["logprobs"]["content"][0];
    for alt in first["top_logprobs"].as_array().into_iter().flatten() {
        let (Some(t), Some(lp)) = (alt["token"].as_str(), alt["logprob"].as_f64()) else {
            continue;
        };
        match word(t).as_str() {
            "yes" => yes += lp.exp(),
            "no" => no += lp.exp(),
            _ => {}
        }
    }
    if yes + no > 0.0 {
        return Some(yes / (yes + no));
    }
    let text = word(choice["message"]["content"].as_str()?);
    Some(if text.starts_with("yes") { 1.0 } else { 0.0 })
}

fn mark_score(response: &mut Response, score: Option<f64>) {
    if let Some(s) = score
        && let Ok(v) = HeaderValue::from_str(&format!("{s:.4}"))
    {
        response
            .headers_mut()
            .insert("x-tandem-cascade-verifier-score", v);
    }
}

/// A whole answer as the stream of one chunk per choice and `[DONE]` that the client asked
/// for (OpenAI's chunk objects; a completion's `text` as its own chunks carry it).
fn as_events(v: &Value, chat: bool) -> String {
    let mut out = String::new();
    for (i, c) in v["choices"].as_array().into_iter().flatten().enumerate() {
        let choice = if chat {
            serde_json::json!({"index": i, "delta": {"role": "assistant",
                "content": c["message"]["content"]}, "finish_reason": c["finish_reason"]})
        } else {
            serde_json::json!({"index": i, "text": c["text"], "finish_reason": c["finish_reason"]})
        };
        let chunk = serde_json::json!({
            "id": v["id"], "created": v["created"], "model": v["model"],
            "object": if chat { "chat.completion.chunk" } else { "text_completion" },
            "choices": [choice],
        });
        out.push_str(&format!("data: {chunk}\n\n"));
    }
    out.push_str("data: [DONE]\n\n");
    out
}

/// The mean log-probability of an answer's tokens, over every choice: a chat answer's
/// `choices[].logprobs.content[].logprob`, a completion's
/// `choices[].logprobs.token_logprobs[]`. `None` where it reports none.
pub(super) fn mean_logprob(v: &Value, chat: bool) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0u64);
    for c in v["choices"].as_array()? {
        let values: Vec<f64> = if chat {
            c["logprobs"]["content"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["logprob"].as_f64())
                .collect()
        } else {
            c["logprobs"]["token_logprobs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_f64)
                .collect()
        };
        n += values.len() as u64;
        sum += values.iter().sum::<f64>();
    }
    (n > 0).then(|| sum / n as f64)
}

fn mark(response: &mut Response, which: &'static str, confidence: Option<f64>) {
    response
        .headers_mut()
        .insert("x-tandem-cascade", HeaderValue::from_static(which));
    if let Some(c) = confidence
        && let Ok(v) = HeaderValue::from_str(&format!("{c:.4}"))
    {
        response
            .headers_mut()
            .insert("x-tandem-cascade-confidence", v);
    }
}
