//! Backend groups at the edge: the IO around `tandem_router::groups`, which decides. A model
//! named in the groups file (`--groups FILE`, TOML) is served by its groups in priority
//! order: this process's own pool (the usual path: tokenization, KV-aware routing, the
//! workers) or OpenAI-compatible endpoints tandem proxies to as they are — the request's JSON
//! sent on (its `model` replaced by the endpoint's where the file says, its API key as a
//! bearer token), the answer streamed back byte for byte.
//!
//! A request goes to the first group that can take it. If an endpoint answers with an error
//! that spills (429, 500, 503, or a 400 that says the context is too long), or cannot be
//! reached, the request goes on: to another endpoint of the same group for a connection
//! failure, to the next group for a spilling status; any other error is the client's and is
//! passed back as is. Nothing spills once the answer's head has gone out. The response says
//! where it went: `x-tandem-group`, and after a spill `x-tandem-spillover-from` (the group
//! passed over) and `x-tandem-spillover-error` (the status it answered, or why it was passed
//! over: `unavailable`, `over-limits`, `context`, `tried`).
//!
//! The file is polled ([`GroupsOptions::reload_interval`], 2 s) by [`watch_groups`]; a
//! changed file that reads, parses and validates replaces the groups whole (the endpoints'
//! cooldowns and counts start afresh; requests in flight finish where they are), and a bad
//! one is refused with the reason in the log while the old groups stay. A file that fails at
//! start stops the process.
//!
//! An endpoint has 5 s to accept a connection ([`GroupsOptions::connect_timeout`]) and the
//! edge's request timeout for its whole answer, stream included; past either it counts as
//! unreachable (before the head) or as a broken stream (after).
//!
//! Prompt tokens for the endpoints' TPM limits and context pre-check are estimated as the
//! body's bytes / 4 (OpenAI's rule of thumb for English); the endpoint's own count is what
//! its `usage` says.

mod budget;
mod cascade;
mod experiment;
mod gate;
mod proxy;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use tandem_router::groups::{
    Ask, EndpointRef, NoRoute, Outcome, Pick, Skip, is_context_error, spills,
};

pub(crate) use budget::{Bill, Caller, Payer};
#[cfg(test)]
pub(crate) use cascade::verdict as verdict_of;
pub(crate) use gate::GroupGate;
pub use gate::{EnvLookup, GroupsError, GroupsOptions, watch_groups};
use proxy::{Reporting, mark, mark_spill, passed_back, read_limited, with_model};

use crate::http::backend::Endpoint;
use crate::http::error::ServeError;

/// Why a group was passed over, as `x-tandem-spillover-error` says it.
fn skip_word(skip: Skip) -> &'static str {
    match skip {
        Skip::Unavailable => "unavailable",
        Skip::OverLimits => "over-limits",
        Skip::ContextTooShort => "context",
        Skip::Tried => "tried",
    }
}

/// The first group passed over, and why.
#[derive(Clone, Debug)]
struct Spill {
    from: String,
    error: String,
}

/// Where [`serve`] sent a request for a model the groups serve.
pub(crate) enum Routed {
    /// Answered (by an endpoint, or with an error): the response to send.
    Done(Response),
    /// This process's pool takes it: the caller runs the usual path on `body` and puts
    /// `marks` on its response.
    Pool { body: Bytes, marks: Marks },
}

/// The groups' headers for a response the pool gives, and where to go on if the pool
/// refuses the request.
#[derive(Debug)]
pub(crate) struct Marks {
    group: String,
    spill: Option<Spill>,
    model: String,
    /// The pool group's index, and whether a group follows it.
    index: usize,
    more: bool,
    /// The request's body as the client sent it.
    original: Bytes,
    /// Who pays, and the pool group's prices.
    caller: Caller,
    cost: Option<tandem_router::groups::Cost>,
}

impl Marks {
    /// Puts the groups' headers on the pool's response, and counts it.
    pub(crate) fn apply(&self, gate: &GroupGate, response: &mut Response) {
        mark(response, &self.group, self.spill.as_ref());
        if self.caller.demoted {
            mark_demoted(response);
        }
        let outcome = if response.status().is_success() {
            "ok"
        } else {
            "error"
        };
        gate.count(&self.model, &self.group, outcome);
    }

    /// Whether a refusal by the pool may go on to a later group.
    pub(crate) fn can_spill(&self) -> bool {
        self.more
    }

    /// The bill of the pool's answer, at the pool group's prices.
    pub(crate) fn bill(&self, gate: &Arc<GroupGate>) -> Bill {
        gate.bill(self.caller.payer.clone(), self.cost)
    }
}

/// Says on a response that its request was over a budget and went to a batch group.
pub(crate) fn mark_demoted(response: &mut Response) {
    response.headers_mut().insert(
        "x-tandem-budget",
        axum::http::HeaderValue::from_static("demoted"),
    );
}

/// Where a request resumes after a group refused it, and who it is for.
struct Resume {
    from_group: usize,
    spill: Option<Spill>,
    caller: Caller,
}

impl Resume {
    /// From the first group.
    fn start(caller: Caller) -> Resume {
        Resume {
            from_group: 0,
            spill: None,
            caller,
        }
    }
}

/// The pool refused a request the groups sent it, with `status` and before anything went
/// out (its queue full, its workers gone): the request goes on to the next group, as for an
/// endpoint's refusal. `None`: it cannot (the retry budget is spent, or only another pool
/// is left); the caller answers with the pool's refusal.
pub(crate) async fn after_pool_refusal(
    gate: &Arc<GroupGate>,
    endpoint: Endpoint,
    served_model: &str,
    marks: Marks,
    status: u16,
    try_retry: &(dyn Fn() -> bool + Send + Sync),
) -> Option<Response> {
    if !marks.more || !spills(status, false) || !try_retry() {
        return None;
    }
    gate.count(&marks.model, &marks.group, "spilled");
    tracing::info!(
        model = marks.model,
        group = marks.group,
        status,
        "the pool refused: spilling to the next backend group"
    );
    let spill = marks.spill.or_else(|| {
        Some(Spill {
            from: marks.group.clone(),
            error: status.to_string(),
        })
    });
    let resume = Resume {
        from_group: marks.index + 1,
        spill,
        caller: marks.caller,
    };
    match serve_from(
        gate,
        endpoint,
        false,
        served_model,
        marks.original,
        try_retry,
        resume,
    )
    .await
    {
        Routed::Done(response) => Some(response),
        Routed::Pool { .. } => None,
    }
}

/// Routes a request for a model the groups serve (see the module docs); `served_model`: the
/// name the pool serves, put in the body when the pool takes it.
pub(crate) async fn serve(
    gate: &Arc<GroupGate>,
    endpoint: Endpoint,
    pool_open: bool,
    served_model: &str,
    body: Bytes,
    caller: Caller,
    try_retry: &(dyn Fn() -> bool + Send + Sync),
) -> Routed {
    if let Some(cascade) = caller.model.as_deref().and_then(|m| gate.cascade(m)) {
        let response = cascade::serve(gate, endpoint, cascade, body, &caller, try_retry).await;
        return Routed::Done(response);
    }
    let start = Resume::start(caller);
    serve_from(
        gate,
        endpoint,
        pool_open,
        served_model,
        body,
        try_retry,
        start,
    )
    .await
}

async fn serve_from(
    gate: &Arc<GroupGate>,
    endpoint: Endpoint,
    pool_open: bool,
    served_model: &str,
    body: Bytes,
    try_retry: &(dyn Fn() -> bool + Send + Sync),
    start: Resume,
) -> Routed {
    let Some(model) = start.caller.model.clone() else {
        return Routed::Done(ServeError::invalid("`model` is required").into_response());
    };
    let path = match endpoint {
        Endpoint::Chat => "/chat/completions",
        Endpoint::Completion => "/completions",
        Endpoint::Responses | Endpoint::Messages | Endpoint::Embeddings => {
            return Routed::Done(
                ServeError::invalid(format!(
                    "model {model:?} is served by backend groups, which take \
                     /v1/chat/completions and /v1/completions"
                ))
                .into_response(),
            );
        }
    };
    let max_tokens = start.caller.max_tokens;
    let prompt_tokens = u32::try_from(body.len() / 4).unwrap_or(u32::MAX);
    let mut tried: Vec<EndpointRef> = Vec::new();
    let mut from_group = start.from_group;
    let mut spill: Option<Spill> = start.spill;
    let caller = start.caller;
    // The last spilling answer: what the client gets if no group is left.
    let mut last_error: Option<(StatusCode, HeaderMap, Bytes, String)> = None;
    loop {
        let ask = Ask {
            model: &model,
            prompt_tokens,
            max_tokens,
            from_group,
            tried: &tried,
            pool_open,
            demoted: caller.demoted,
        };
        let (pick, generation, group_name, cost, target) = {
            let mut live = gate.live.lock();
            let now = now_ms();
            match live.groups.pick(&ask, now) {
                Ok(pick) => {
                    let cfg = live.groups.config();
                    let name = cfg.models[pick.model].groups[pick.group].name.clone();
                    let cost = cfg.models[pick.model].groups[pick.group].cost;
                    let target = pick.endpoint.map(|e| {
                        let ec = live.groups.endpoint(e);
                        let key = live.keys[e.model][e.group][e.endpoint].clone();
                        (e, ec.url.clone(), ec.model.clone(), key)
                    });
                    if let Some((e, ..)) = &target {
                        let need = u64::from(prompt_tokens) + u64::from(max_tokens.unwrap_or(0));
                        live.groups.started(*e, need, now);
                    }
                    (pick, live.generation, name, cost, target)
                }
                Err(NoRoute::UnknownModel(m)) => {
                    return Routed::Done(ServeError::model_not_found(&m).into_response());
                }
                Err(NoRoute::Exhausted {
                    retry_after_ms,
                    skipped,
                }) => {
                    gate.spilled(&model, spill.as_ref(), "none");
                    if let Some((status, headers, bytes, group)) = last_error {
                        return Routed::Done(passed_back(
                            status,
                            &headers,
                            bytes,
                            Some(&group),
                            spill.as_ref(),
                        ));
                    }
                    let why: Vec<&str> = skipped.iter().map(|&(_, s)| skip_word(s)).collect();
                    let e = ServeError::overloaded(
                        format!(
                            "no backend group of model {model:?} can take the request now ({})",
                            why.join(", ")
                        ),
                        Duration::from_millis(retry_after_ms.unwrap_or(1_000).max(1_000)),
                    )
                    .with_code("groups_exhausted");
                    let mut response = e.into_response();
                    if let Some(s) = &spill {
                        mark_spill(&mut response, s);
                    }
                    return Routed::Done(response);
                }
            }
        };
        note_skips(gate, &pick, &mut spill);
        let Some((e, url, endpoint_model, key)) = target else {
            gate.spilled(&model, spill.as_ref(), &group_name);
            let more = pick.group + 1 < gate.groups_of(pick.model);
            return Routed::Pool {
                body: with_model(&body, Some(served_model)),
                marks: Marks {
                    group: group_name,
                    spill,
                    model: model.clone(),
                    index: pick.group,
                    more,
                    original: body,
                    caller,
                    cost,
                },
            };
        };
        let sent = Instant::now();
        let request = gate
            .client
            .post(format!("{}{path}", url.trim_end_matches('/')))
            .header(header::CONTENT_TYPE, "application/json")
            .body(with_model(&body, endpoint_model.as_deref()));
        let request = match &key {
            Some(k) => request.bearer_auth(k),
            None => request,
        };
        let answer = match request.send().await {
            Ok(a) => a,
            Err(err) => {
                tracing::warn!(model, group = group_name, url, error = %err, "backend group endpoint unreachable");
                gate.count(&model, &group_name, "unreachable");
                if !try_retry() {
                    let mut response = ServeError::unavailable(format!(
                        "backend group {group_name:?} could not be reached and the retry budget is spent"
                    ))
                    .with_code("retry_budget_exhausted")
                    .into_response();
                    mark(&mut response, &group_name, spill.as_ref());
                    return Routed::Done(response);
                }
                gate.finished(
                    generation,
                    e,
                    Outcome::Failed {
                        status: None,
                        retry_after_ms: None,
                    },
                );
                tried.push(e);
                continue;
            }
        };
        let status = answer.status();
        if status.is_success() {
            gate.count(&model, &group_name, "ok");
            gate.spilled(&model, spill.as_ref(), &group_name);
            let headers = answer.headers().clone();
            let stream = Reporting {
                gate: gate.clone(),
                generation,
                endpoint: e,
                sent,
                first: None,
                inner: answer.bytes_stream().boxed(),
                done: false,
                bill: Some((gate.bill(caller.payer.clone(), cost), prompt_tokens.into())),
                usage: Default::default(),
            };
            return Routed::Done(passed_back(
                status,
                &headers,
                Body::from_stream(stream),
                Some(&group_name),
                spill.as_ref(),
            ));
        }
        let headers = answer.headers().clone();
        let retry_after_ms = headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| (s * 1000.0) as u64);
        let bytes = read_limited(answer).await;
        gate.finished(
            generation,
            e,
            Outcome::Failed {
                status: Some(status.as_u16()),
                retry_after_ms,
            },
        );
        let context = is_context_error(&String::from_utf8_lossy(&bytes));
        let spilling = spills(status.as_u16(), context);
        // A spill takes a retry from the budget; a spent budget answers with the refusal.
        if !(spilling && try_retry()) {
            if spilling {
                tracing::warn!(
                    model,
                    group = group_name,
                    "retry budget spent: not spilling"
                );
            }
            gate.count(&model, &group_name, "error");
            gate.spilled(&model, spill.as_ref(), &group_name);
            return Routed::Done(passed_back(
                status,
                &headers,
                bytes,
                Some(&group_name),
                spill.as_ref(),
            ));
        }
        gate.count(&model, &group_name, "spilled");
        tracing::info!(
            model,
            group = group_name,
            url,
            status = status.as_u16(),
            "spilling to the next backend group"
        );
        if spill.is_none() {
            spill = Some(Spill {
                from: group_name.clone(),
                error: status.as_u16().to_string(),
            });
        }
        last_error = Some((status, headers, bytes, group_name));
        tried.push(e);
        from_group = pick.group + 1;
    }
}

/// Remembers the first group `pick` passed over, if none was yet.
fn note_skips(gate: &GroupGate, pick: &Pick, spill: &mut Option<Spill>) {
    if spill.is_some() {
        return;
    }
    if let Some(&(g, why)) = pick.skipped.first() {
        let live = gate.live.lock();
        *spill = Some(Spill {
            from: live.groups.config().models[pick.model].groups[g]
                .name
                .clone(),
            error: skip_word(why).to_string(),
        });
    }
}

/// Milliseconds on a monotonic clock (the groups' cooldowns and windows).
fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}
