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
//! Prompt tokens for the endpoints' TPM limits and context pre-check are estimated as the
//! body's bytes / 4 (OpenAI's rule of thumb for English); the endpoint's own count is what
//! its `usage` says.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tandem_router::groups::{
    Ask, EndpointRef, Groups, GroupsConfig, GroupsConfigError, NoRoute, Outcome, Pick, Skip,
    is_context_error, spills,
};

use crate::http::backend::Endpoint;
use crate::http::error::ServeError;

/// Looks up an environment variable: the binary passes the process's environment (the
/// library reads none itself, docs/CONVENTIONS.md §8); tests pass their own.
pub type EnvLookup = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Where the groups come from.
#[derive(Clone)]
pub struct GroupsOptions {
    /// The TOML file (`[[model]]` tables, each with its `[[model.group]]`s).
    pub file: PathBuf,
    /// How often the file is checked for changes.
    pub reload_interval: Duration,
    /// Seeds the weighted draws.
    pub seed: u64,
    /// How long an endpoint may take to accept a connection.
    pub connect_timeout: Duration,
    /// Where `api_key_env` variables are read.
    pub env: EnvLookup,
}

impl std::fmt::Debug for GroupsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupsOptions")
            .field("file", &self.file)
            .field("reload_interval", &self.reload_interval)
            .field("seed", &self.seed)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

impl GroupsOptions {
    /// `file`, checked every 2 s, `env` for the keys it names by variable.
    pub fn new(file: PathBuf, env: EnvLookup) -> GroupsOptions {
        GroupsOptions {
            env,
            file,
            reload_interval: Duration::from_secs(2),
            seed: 0x6772_6f75_7073,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Why a groups file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GroupsError {
    #[error("reading the groups file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the groups file {path} is not valid TOML for groups: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("the groups file {path}: {source}")]
    Invalid {
        path: PathBuf,
        source: GroupsConfigError,
    },
    #[error("the groups file {path}: endpoint {url}: {why}")]
    Key {
        path: PathBuf,
        url: String,
        why: String,
    },
    #[error("building the HTTP client for the groups' endpoints: {0}")]
    Client(String),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLabels {
    model: String,
    group: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SpillLabels {
    model: String,
    from: String,
    to: String,
}

/// The groups in force, with their endpoints' keys (`[model][group][endpoint]`).
struct Live {
    groups: Groups,
    keys: Vec<Vec<Vec<Option<String>>>>,
    /// Bumped at every reload: outcomes of requests picked under older groups are dropped.
    generation: u64,
}

type Stamp = (Option<SystemTime>, u64);

/// The live groups of an [`crate::http::HttpState`].
pub(crate) struct GroupGate {
    options: GroupsOptions,
    live: Mutex<Live>,
    /// The stamp of the file last read, and the last refusal (reported once).
    seen: Mutex<(Option<Stamp>, Option<String>)>,
    client: reqwest::Client,
    requests: Family<GroupLabels, Counter>,
    spillovers: Family<SpillLabels, Counter>,
}

impl std::fmt::Debug for GroupGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupGate")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    let meta = std::fs::metadata(path)?;
    Ok((meta.modified().ok(), meta.len()))
}

/// Reads, parses and validates the file, and reads its endpoints' keys.
fn read(options: &GroupsOptions) -> Result<Live, GroupsError> {
    let path = &options.file;
    let text = std::fs::read_to_string(path).map_err(|source| GroupsError::Read {
        path: path.clone(),
        source,
    })?;
    let cfg: GroupsConfig = toml::from_str(&text).map_err(|e| GroupsError::Parse {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let keys = cfg
        .models
        .iter()
        .map(|m| {
            m.groups
                .iter()
                .map(|g| {
                    g.endpoints
                        .iter()
                        .map(|e| key(path, e, &options.env))
                        .collect()
                })
                .collect()
        })
        .collect::<Result<Vec<Vec<Vec<_>>>, _>>()?;
    let groups = Groups::new(cfg, options.seed).map_err(|source| GroupsError::Invalid {
        path: path.clone(),
        source,
    })?;
    Ok(Live {
        groups,
        keys,
        generation: 0,
    })
}

/// An endpoint's API key, from the variable or file the config names.
fn key(
    path: &Path,
    e: &tandem_router::groups::EndpointConfig,
    env: &EnvLookup,
) -> Result<Option<String>, GroupsError> {
    let fail = |why: String| GroupsError::Key {
        path: path.to_path_buf(),
        url: e.url.clone(),
        why,
    };
    let key = match (&e.api_key_env, &e.api_key_file) {
        (Some(var), _) => {
            env(var).ok_or_else(|| fail(format!("the environment variable {var} is not set")))?
        }
        (None, Some(file)) => std::fs::read_to_string(file)
            .map_err(|err| fail(format!("reading its key file {file}: {err}")))?,
        (None, None) => return Ok(None),
    };
    let key = key.trim().to_string();
    if key.is_empty() || HeaderValue::from_str(&format!("Bearer {key}")).is_err() {
        return Err(fail(
            "its API key is empty or not a valid header value".into(),
        ));
    }
    Ok(Some(key))
}

impl GroupGate {
    /// Loads the file once (an error stops the process at start) and registers the groups'
    /// metrics into `registry`.
    pub(crate) fn load(
        options: GroupsOptions,
        registry: &mut Registry,
    ) -> Result<GroupGate, GroupsError> {
        let seen = stamp(&options.file).ok();
        let live = read(&options)?;
        let client = reqwest::Client::builder()
            .connect_timeout(options.connect_timeout)
            .build()
            .map_err(|e| GroupsError::Client(e.to_string()))?;
        let requests = Family::<GroupLabels, Counter>::default();
        let spillovers = Family::<SpillLabels, Counter>::default();
        registry.register(
            "tandem_group_requests",
            "Requests to each backend group of a model, by outcome (ok; error: answered with an error that does not spill; spilled: passed on to the next group; unreachable: its endpoint could not be reached)",
            requests.clone(),
        );
        registry.register(
            "tandem_group_spillovers",
            "Requests that a backend group of a model passed over (from: the first such group) and the group that answered them (to; none: no group)",
            spillovers.clone(),
        );
        log_loaded(&options.file, live.groups.config(), "backend groups loaded");
        Ok(GroupGate {
            options,
            live: Mutex::new(live),
            seen: Mutex::new((seen, None)),
            client,
            requests,
            spillovers,
        })
    }

    /// Whether `model` is served by groups.
    pub(crate) fn serves(&self, model: &str) -> bool {
        self.live.lock().groups.config().model(model).is_some()
    }

    /// Reads the file again if it changed: `Some(Ok)` when new groups are in force,
    /// `Some(Err)` when it changed and was refused (the old groups stay; reported once),
    /// `None` when nothing changed.
    pub(crate) fn reload_if_changed(&self) -> Option<Result<(), GroupsError>> {
        let path = &self.options.file;
        let now = stamp(path).ok();
        if now.is_some() && self.seen.lock().0 == now {
            return None;
        }
        match read(&self.options) {
            Ok(mut live) => {
                log_loaded(path, live.groups.config(), "backend groups reloaded");
                let mut held = self.live.lock();
                live.generation = held.generation + 1;
                *held = live;
                *self.seen.lock() = (now, None);
                Some(Ok(()))
            }
            Err(e) => {
                let message = e.to_string();
                let mut seen = self.seen.lock();
                seen.0 = now;
                if seen.1.as_deref() == Some(message.as_str()) {
                    return None;
                }
                seen.1 = Some(message);
                Some(Err(e))
            }
        }
    }

    fn finished(&self, generation: u64, e: EndpointRef, outcome: Outcome) {
        let mut live = self.live.lock();
        if live.generation == generation {
            live.groups.finished(e, outcome, now_ms());
        }
    }

    /// The groups as the status page shows them: each model's groups in priority order,
    /// each endpoint's last minute and cooldown.
    pub(crate) fn status(&self) -> serde_json::Value {
        let live = self.live.lock();
        let now = now_ms();
        let models: Vec<serde_json::Value> = live
            .groups
            .config()
            .models
            .iter()
            .enumerate()
            .map(|(m, model)| {
                let groups: Vec<serde_json::Value> = model
                    .groups
                    .iter()
                    .enumerate()
                    .map(|(g, group)| {
                        let endpoints: Vec<serde_json::Value> = group
                            .endpoints
                            .iter()
                            .enumerate()
                            .map(|(i, e)| {
                                let at = EndpointRef {
                                    model: m,
                                    group: g,
                                    endpoint: i,
                                };
                                serde_json::json!({
                                    "url": e.url,
                                    "model": e.model,
                                    "state": live.groups.endpoint_status(at, now),
                                })
                            })
                            .collect();
                        serde_json::json!({
                            "name": group.name,
                            "pool": group.pool,
                            "strategy": group.strategy,
                            "endpoints": endpoints,
                        })
                    })
                    .collect();
                serde_json::json!({"name": model.name, "groups": groups})
            })
            .collect();
        serde_json::json!({ "models": models })
    }

    /// How many groups model `m` has.
    fn groups_of(&self, m: usize) -> usize {
        self.live.lock().groups.config().models[m].groups.len()
    }

    /// A request answered by group `to` (`"none"`: by no group) after `spill`.
    fn spilled(&self, model: &str, spill: Option<&Spill>, to: &str) {
        if let Some(s) = spill {
            self.spillovers
                .get_or_create(&SpillLabels {
                    model: model.to_string(),
                    from: s.from.clone(),
                    to: to.to_string(),
                })
                .inc();
        }
    }

    fn count(&self, model: &str, group: &str, outcome: &'static str) {
        self.requests
            .get_or_create(&GroupLabels {
                model: model.to_string(),
                group: group.to_string(),
                outcome,
            })
            .inc();
    }
}

fn log_loaded(path: &Path, cfg: &GroupsConfig, what: &str) {
    let models: Vec<String> = cfg
        .models
        .iter()
        .map(|m| {
            let groups: Vec<&str> = m.groups.iter().map(|g| g.name.as_str()).collect();
            format!("{} → {}", m.name, groups.join(" > "))
        })
        .collect();
    tracing::info!(file = %path.display(), models = %models.join("; "), "{what}");
}

/// Milliseconds on a monotonic clock (the groups' cooldowns and windows).
fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// Polls the groups file until `shutdown` (see the module docs).
pub async fn watch_groups(
    state: crate::http::HttpState,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let Some(gate) = state.groups() else {
        return;
    };
    let mut tick =
        tokio::time::interval(gate.options.reload_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = shutdown.cancelled() => return,
        }
        if let Some(Err(e)) = gate.reload_if_changed() {
            tracing::error!(
                error = %e,
                "the groups file was refused; the previous groups stay in force"
            );
        }
    }
}

/// What of a request's body the groups look at.
#[derive(serde::Deserialize)]
struct Head {
    model: Option<String>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
}

/// The model a request body names, if it parses that far.
pub(crate) fn model_of(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<Head>(body).ok()?.model
}

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
}

impl Marks {
    /// Puts the groups' headers on the pool's response, and counts it.
    pub(crate) fn apply(&self, gate: &GroupGate, response: &mut Response) {
        mark(response, &self.group, self.spill.as_ref());
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
}

/// Where a request resumes after a group refused it.
struct Resume {
    from_group: usize,
    spill: Option<Spill>,
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
    try_retry: &(dyn Fn() -> bool + Send + Sync),
) -> Routed {
    let start = Resume {
        from_group: 0,
        spill: None,
    };
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
    let Some(model) = model_of(&body) else {
        return Routed::Done(ServeError::invalid("`model` is required").into_response());
    };
    let path = match endpoint {
        Endpoint::Chat => "/chat/completions",
        Endpoint::Completion => "/completions",
        Endpoint::Responses | Endpoint::Messages => {
            return Routed::Done(
                ServeError::invalid(format!(
                    "model {model:?} is served by backend groups, which take \
                     /v1/chat/completions and /v1/completions"
                ))
                .into_response(),
            );
        }
    };
    let head: Option<Head> = serde_json::from_slice(&body).ok();
    let max_tokens = head.and_then(|h| h.max_tokens.or(h.max_completion_tokens));
    let prompt_tokens = u32::try_from(body.len() / 4).unwrap_or(u32::MAX);
    let mut tried: Vec<EndpointRef> = Vec::new();
    let mut from_group = start.from_group;
    let mut spill: Option<Spill> = start.spill;
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
        };
        let (pick, generation, group_name, target) = {
            let mut live = gate.live.lock();
            let now = now_ms();
            match live.groups.pick(&ask, now) {
                Ok(pick) => {
                    let cfg = live.groups.config();
                    let name = cfg.models[pick.model].groups[pick.group].name.clone();
                    let target = pick.endpoint.map(|e| {
                        let ec = live.groups.endpoint(e);
                        let key = live.keys[e.model][e.group][e.endpoint].clone();
                        (e, ec.url.clone(), ec.model.clone(), key)
                    });
                    if let Some((e, ..)) = &target {
                        let need = u64::from(prompt_tokens) + u64::from(max_tokens.unwrap_or(0));
                        live.groups.started(*e, need, now);
                    }
                    (pick, live.generation, name, target)
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
        if !spills(status.as_u16(), context) {
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
        if !try_retry() {
            gate.count(&model, &group_name, "error");
            gate.spilled(&model, spill.as_ref(), &group_name);
            tracing::warn!(
                model,
                group = group_name,
                "retry budget spent: not spilling"
            );
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

/// `body` with its `model` set to `model` (unchanged when `None` or not a JSON object).
fn with_model(body: &Bytes, model: Option<&str>) -> Bytes {
    let Some(model) = model else {
        return body.clone();
    };
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
        Ok(mut map) => {
            map.insert("model".into(), model.into());
            serde_json::to_vec(&map).map_or_else(|_| body.clone(), Bytes::from)
        }
        Err(_) => body.clone(),
    }
}

/// At most 64 KiB of an error answer's body.
async fn read_limited(answer: reqwest::Response) -> Bytes {
    const LIMIT: usize = 64 * 1024;
    let mut out = Vec::new();
    let mut stream = answer.bytes_stream();
    while let Some(Ok(piece)) = stream.next().await {
        let room = LIMIT - out.len();
        out.extend_from_slice(&piece[..piece.len().min(room)]);
        if out.len() >= LIMIT {
            break;
        }
    }
    Bytes::from(out)
}

/// The endpoint's answer, passed back with its status and content type, and the groups'
/// headers.
fn passed_back(
    status: StatusCode,
    headers: &HeaderMap,
    body: impl Into<Body>,
    group: Option<&str>,
    spill: Option<&Spill>,
) -> Response {
    // (`group` is None only where nothing was sent.)
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    for name in [header::CONTENT_TYPE, header::RETRY_AFTER] {
        if let Some(v) = headers.get(&name) {
            response.headers_mut().insert(name, v.clone());
        }
    }
    if let Some(group) = group {
        mark(&mut response, group, spill);
    } else if let Some(s) = spill {
        mark_spill(&mut response, s);
    }
    response
}

fn mark(response: &mut Response, group: &str, spill: Option<&Spill>) {
    if let Ok(v) = HeaderValue::from_str(group) {
        response.headers_mut().insert("x-tandem-group", v);
    }
    if let Some(s) = spill {
        mark_spill(response, s);
    }
}

fn mark_spill(response: &mut Response, spill: &Spill) {
    for (name, value) in [
        ("x-tandem-spillover-from", &spill.from),
        ("x-tandem-spillover-error", &spill.error),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            response.headers_mut().insert(name, v);
        }
    }
}

/// An endpoint's answer body on its way to the client, telling the groups how it went: its
/// first bytes' latency and success at the end, failure if it breaks, nothing if the client
/// leaves first.
struct Reporting {
    gate: Arc<GroupGate>,
    generation: u64,
    endpoint: EndpointRef,
    sent: Instant,
    first: Option<Duration>,
    inner: futures::stream::BoxStream<'static, reqwest::Result<Bytes>>,
    done: bool,
}

impl Reporting {
    fn end(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.gate.finished(self.generation, self.endpoint, outcome);
        }
    }
}

impl futures::Stream for Reporting {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let item = std::task::ready!(self.inner.poll_next_unpin(cx));
        match &item {
            Some(Ok(_)) => {
                if self.first.is_none() {
                    self.first = Some(self.sent.elapsed());
                }
            }
            Some(Err(_)) => self.end(Outcome::Failed {
                status: None,
                retry_after_ms: None,
            }),
            None => {
                let ttft_ms = self.first.map(|d| d.as_millis() as u64);
                self.end(Outcome::Ok { ttft_ms, tokens: 0 });
            }
        }
        std::task::Poll::Ready(item)
    }
}

impl Drop for Reporting {
    fn drop(&mut self) {
        self.end(Outcome::Cancelled);
    }
}
