//! Backend groups, sans-IO: a model name maps to groups in priority order — this process's
//! own pool (routed by KV and load elsewhere) or endpoints tandem cannot see into (another
//! cluster, a reserved deployment, a hosted API) — and [`Groups::pick`] says where a request
//! goes.
//!
//! - **Across groups, priority order** (Azure API Management's priority pools): a lower
//!   group is used only when no endpoint of every higher group can take the request — each
//!   cooling down, at its `max_parallel_requests`, over its RPM or TPM in the last minute, or
//!   too short a context for it — or when the request itself failed there with an error
//!   that spills ([`spills`]: 429, 500, 503, and 400 for a context the group cannot take,
//!   Azure's spillover conditions); the caller then asks again from the next group.
//!   [`Pick::skipped`] says which groups were passed over and why, for the response's
//!   `x-tandem-spillover-from`.
//! - **Inside a group**, by its [`Strategy`]: weighted at random (the seeded [`Rng`]), least
//!   busy, or lowest moving average of time to first token.
//! - **Cooldowns per endpoint** (LiteLLM's rules): at once on 429, 401, 404 and 408; when
//!   more than [`CooldownConfig::failure_ratio`] of the last minute's outcomes (at least
//!   [`CooldownConfig::min_requests`] of them) failed; for [`CooldownConfig::seconds`], or as
//!   long as the endpoint's `Retry-After` asks (up to [`CooldownConfig::max_seconds`]).
//!
//! Time is milliseconds passed in; nothing here sleeps, reads a clock or does IO.

mod budgets;
mod config;
mod experiment;

use std::collections::VecDeque;

pub use budgets::{BudgetConfig, BudgetScope, Budgets, Charge, Exceeded};
pub use config::{
    CascadeConfig, CooldownConfig, Cost, EndpointConfig, GroupConfig, GroupsConfig,
    GroupsConfigError, ModelGroups, Strategy,
};
pub use experiment::{Arm, ArmConfig, ExperimentConfig};
use tandem_protocol::Rng;

/// The window of the failure ratio and of the RPM and TPM limits.
const MINUTE_MS: u64 = 60_000;

/// Weight of a new sample in an endpoint's moving average of time to first token.
const TTFT_ALPHA: f64 = 0.3;

/// One endpoint of one group of one model: indices into the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EndpointRef {
    pub model: usize,
    pub group: usize,
    pub endpoint: usize,
}

/// Where [`Groups::pick`] sends a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    /// The model's index in the config.
    pub model: usize,
    /// The group's index among the model's groups.
    pub group: usize,
    /// `None`: the group is this process's pool (its router picks the worker).
    pub endpoint: Option<EndpointRef>,
    /// The groups above `group` (from the one asked for) that could not take it, and why.
    pub skipped: Vec<(usize, Skip)>,
}

/// Why a group was passed over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Every endpoint cooling down (or the pool unavailable: no workers, or all shed).
    Unavailable,
    /// Every endpoint that is up at its parallel, RPM or TPM limit.
    OverLimits,
    /// No endpoint's context takes the prompt and its `max_tokens`.
    ContextTooShort,
    /// Every endpoint already tried by this request.
    Tried,
}

/// What a request asks of [`Groups::pick`].
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub model: &'a str,
    pub prompt_tokens: u32,
    /// The completion tokens asked for, if the request says.
    pub max_tokens: Option<u32>,
    /// The first group to consider (0; after an error that spills, the next group).
    pub from_group: usize,
    /// Endpoints this request was already sent to.
    pub tried: &'a [EndpointRef],
    /// Whether this process's pool can take a request now.
    pub pool_open: bool,
    /// Over its budget: only the model's batch groups take it (and take nothing else).
    pub demoted: bool,
}

/// No group of the model can take the request.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum NoRoute {
    #[error("no backend group serves model {0:?}")]
    UnknownModel(String),
    /// Every group from the one asked for was passed over; `retry_after_ms`: when the first
    /// cooldown among them ends, if one does.
    #[error("every backend group of the model is unavailable, at its limits or too short")]
    Exhausted {
        skipped: Vec<(usize, Skip)>,
        retry_after_ms: Option<u64>,
    },
}

/// How a request sent to an endpoint ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    /// Answered; `ttft_ms`: its first token's latency, where it streamed one.
    Ok { ttft_ms: Option<u64>, tokens: u64 },
    /// `status`: the HTTP status (`None`: no answer — refused, reset, timed out);
    /// `retry_after_ms`: the answer's `Retry-After`.
    Failed {
        status: Option<u16>,
        retry_after_ms: Option<u64>,
    },
    /// The client went away first: says nothing of the endpoint.
    Cancelled,
}

/// Whether a request that failed with `status` goes on to the next group (Azure's spillover
/// conditions): quota (429), the server's own failures (500, 503), and a 400 that says the
/// context is too long for this group ([`is_context_error`]), which a larger one may take.
/// Any other status is the client's own error and is answered as is.
pub fn spills(status: u16, context_error: bool) -> bool {
    matches!(status, 429 | 500 | 503) || (status == 400 && context_error)
}

/// Whether an error body says the prompt does not fit the model's context: OpenAI's code
/// `context_length_exceeded`, or vLLM's and SGLang's "maximum context length" message
/// (vllm/entrypoints/openai/serving_engine.py, `_validate_input`).
pub fn is_context_error(body: &str) -> bool {
    body.contains("context_length_exceeded") || body.contains("maximum context length")
}

#[derive(Debug, Default)]
struct EndpointState {
    cooling_until_ms: u64,
    in_flight: u32,
    /// (when, failed) of the outcomes of the last minute.
    outcomes: VecDeque<(u64, bool)>,
    /// When each request of the last minute was sent, and its tokens.
    sent: VecDeque<(u64, u64)>,
    ttft_ewma_ms: Option<f64>,
}

impl EndpointState {
    fn forget_before(&mut self, now_ms: u64) {
        let since = now_ms.saturating_sub(MINUTE_MS);
        while self.outcomes.front().is_some_and(|&(t, _)| t < since) {
            self.outcomes.pop_front();
        }
        while self.sent.front().is_some_and(|&(t, _)| t < since) {
            self.sent.pop_front();
        }
    }

    fn cooling(&self, now_ms: u64) -> bool {
        now_ms < self.cooling_until_ms
    }

    /// Whether one more request of `tokens` keeps within `cfg`'s limits.
    fn within_limits(&self, cfg: &EndpointConfig, tokens: u64) -> bool {
        let parallel = cfg.max_parallel_requests.is_none_or(|m| self.in_flight < m);
        let rpm = cfg
            .rpm
            .is_none_or(|m| (self.sent.len() as u64) < u64::from(m));
        let used: u64 = self.sent.iter().map(|&(_, t)| t).sum();
        // A request alone above the TPM limit could never go: it goes when the minute is empty.
        let tpm = cfg
            .tpm
            .is_none_or(|m| used + tokens <= m || self.sent.is_empty());
        parallel && rpm && tpm
    }
}

/// The groups of every model and what each endpoint has done lately.
#[derive(Debug)]
pub struct Groups {
    cfg: GroupsConfig,
    /// `[model][group][endpoint]`.
    state: Vec<Vec<Vec<EndpointState>>>,
    rng: Rng,
}

impl Groups {
    /// Groups for a config that passed [`GroupsConfig::validate`]; `seed` makes the weighted
    /// draws reproducible.
    pub fn new(cfg: GroupsConfig, seed: u64) -> Result<Groups, GroupsConfigError> {
        cfg.validate()?;
        let Ok(state) =
            cfg.per_endpoint(|_, _| Ok::<_, std::convert::Infallible>(EndpointState::default()));
        Ok(Groups {
            cfg,
            state,
            rng: Rng::seed_from_u64(seed),
        })
    }

    pub fn config(&self) -> &GroupsConfig {
        &self.cfg
    }

    /// An endpoint's config.
    pub fn endpoint(&self, e: EndpointRef) -> &EndpointConfig {
        &self.cfg.models[e.model].groups[e.group].endpoints[e.endpoint]
    }

    fn cooldown(&self, model: usize, group: usize) -> CooldownConfig {
        self.cfg.models[model].groups[group]
            .cooldown
            .unwrap_or(self.cfg.cooldown)
    }

    /// Where `ask` goes: the first group, from `ask.from_group` on, with an endpoint that can
    /// take it, and the endpoint its strategy picks there.
    pub fn pick(&mut self, ask: &Ask<'_>, now_ms: u64) -> Result<Pick, NoRoute> {
        let Some(m) = self.cfg.models.iter().position(|m| m.name == ask.model) else {
            return Err(NoRoute::UnknownModel(ask.model.to_string()));
        };
        let need = u64::from(ask.prompt_tokens) + u64::from(ask.max_tokens.unwrap_or(0));
        let context = ask
            .prompt_tokens
            .saturating_add(ask.max_tokens.unwrap_or(0));
        let mut skipped = Vec::new();
        let mut retry_after: Option<u64> = None;
        for g in ask.from_group..self.cfg.models[m].groups.len() {
            let group = &self.cfg.models[m].groups[g];
            if group.batch != ask.demoted {
                continue;
            }
            if group.pool {
                if ask.pool_open {
                    return Ok(Pick {
                        model: m,
                        group: g,
                        endpoint: None,
                        skipped,
                    });
                }
                skipped.push((g, Skip::Unavailable));
                continue;
            }
            let mut open = Vec::new();
            let (mut any_up, mut any_fits, mut any_untried) = (false, false, false);
            for (i, cfg) in group.endpoints.iter().enumerate() {
                let e = EndpointRef {
                    model: m,
                    group: g,
                    endpoint: i,
                };
                let st = &mut self.state[m][g][i];
                st.forget_before(now_ms);
                if ask.tried.contains(&e) {
                    continue;
                }
                any_untried = true;
                if cfg.context_length.is_some_and(|c| context > c) {
                    continue;
                }
                any_fits = true;
                if st.cooling(now_ms) {
                    let end = st.cooling_until_ms - now_ms;
                    retry_after = Some(retry_after.map_or(end, |r| r.min(end)));
                    continue;
                }
                any_up = true;
                if st.within_limits(cfg, need) {
                    open.push(i);
                }
            }
            if let Some(i) = self.choose(m, g, &open) {
                return Ok(Pick {
                    model: m,
                    group: g,
                    endpoint: Some(EndpointRef {
                        model: m,
                        group: g,
                        endpoint: i,
                    }),
                    skipped,
                });
            }
            let why = if !any_untried {
                Skip::Tried
            } else if !any_fits {
                Skip::ContextTooShort
            } else if !any_up {
                Skip::Unavailable
            } else {
                Skip::OverLimits
            };
            skipped.push((g, why));
        }
        Err(NoRoute::Exhausted {
            skipped,
            retry_after_ms: retry_after,
        })
    }

    /// One of `open` (endpoint indices of group `g`) by the group's strategy.
    fn choose(&mut self, m: usize, g: usize, open: &[usize]) -> Option<usize> {
        let group = &self.cfg.models[m].groups[g];
        let state = &self.state[m][g];
        let at_random = |rng: &mut Rng, among: &[usize]| among[rng.below(among.len())];
        match (open, group.strategy) {
            ([], _) => None,
            ([only], _) => Some(*only),
            (_, Strategy::Weighted) => {
                let weight = |i: usize| {
                    let e = &group.endpoints[i];
                    e.weight
                        .or(e.rpm.map(f64::from))
                        .or(e.tpm.map(|t| t as f64))
                        .unwrap_or(1.0)
                };
                let total: f64 = open.iter().map(|&i| weight(i)).sum();
                let mut x = self.rng.unit_f64() * total;
                for &i in open {
                    x -= weight(i);
                    if x < 0.0 {
                        return Some(i);
                    }
                }
                open.last().copied()
            }
            (_, Strategy::LeastBusy) => {
                let least = open.iter().map(|&i| state[i].in_flight).min()?;
                let ties: Vec<usize> = open
                    .iter()
                    .copied()
                    .filter(|&i| state[i].in_flight == least)
                    .collect();
                Some(at_random(&mut self.rng, &ties))
            }
            (_, Strategy::Latency) => {
                let unknown: Vec<usize> = open
                    .iter()
                    .copied()
                    .filter(|&i| state[i].ttft_ewma_ms.is_none())
                    .collect();
                if !unknown.is_empty() {
                    return Some(at_random(&mut self.rng, &unknown));
                }
                open.iter().copied().min_by(|&a, &b| {
                    let (x, y) = (state[a].ttft_ewma_ms, state[b].ttft_ewma_ms);
                    x.unwrap_or(f64::MAX).total_cmp(&y.unwrap_or(f64::MAX))
                })
            }
        }
    }

    /// A request of `tokens` (prompt and expected completion) was sent to `e`.
    pub fn started(&mut self, e: EndpointRef, tokens: u64, now_ms: u64) {
        let st = &mut self.state[e.model][e.group][e.endpoint];
        st.forget_before(now_ms);
        st.in_flight += 1;
        st.sent.push_back((now_ms, tokens));
    }

    /// A request sent to `e` ended with `outcome`; the cooldown rules apply.
    pub fn finished(&mut self, e: EndpointRef, outcome: Outcome, now_ms: u64) {
        let cooldown = self.cooldown(e.model, e.group);
        let st = &mut self.state[e.model][e.group][e.endpoint];
        st.forget_before(now_ms);
        st.in_flight = st.in_flight.saturating_sub(1);
        let (failed, at_once, retry_after) = match outcome {
            Outcome::Cancelled => return,
            Outcome::Ok { ttft_ms, .. } => {
                if let Some(t) = ttft_ms {
                    let t = t as f64;
                    st.ttft_ewma_ms = Some(
                        st.ttft_ewma_ms
                            .map_or(t, |avg| avg + TTFT_ALPHA * (t - avg)),
                    );
                }
                (false, false, None)
            }
            Outcome::Failed {
                status,
                retry_after_ms,
            } => (
                true,
                matches!(status, Some(429 | 401 | 404 | 408)),
                retry_after_ms,
            ),
        };
        st.outcomes.push_back((now_ms, failed));
        let failures = st.outcomes.iter().filter(|&&(_, f)| f).count();
        let n = st.outcomes.len();
        let ratio_rule = n >= cooldown.min_requests as usize
            && failures as f64 > cooldown.failure_ratio * n as f64;
        if failed && (at_once || ratio_rule) {
            let ms = retry_after.map_or(cooldown.seconds * 1000.0, |r| {
                (r as f64).min(cooldown.max_seconds * 1000.0)
            });
            st.cooling_until_ms = st.cooling_until_ms.max(now_ms + ms as u64);
        }
    }

    /// Whether `e` is cooling down at `now_ms`, and until when.
    pub fn cooling_until(&self, e: EndpointRef, now_ms: u64) -> Option<u64> {
        let st = &self.state[e.model][e.group][e.endpoint];
        st.cooling(now_ms).then_some(st.cooling_until_ms)
    }

    /// Requests in flight at `e`.
    pub fn in_flight(&self, e: EndpointRef) -> u32 {
        self.state[e.model][e.group][e.endpoint].in_flight
    }

    /// What `e` has done lately, as of `now_ms` (for the status page).
    pub fn endpoint_status(&self, e: EndpointRef, now_ms: u64) -> EndpointStatus {
        let st = &self.state[e.model][e.group][e.endpoint];
        let since = now_ms.saturating_sub(MINUTE_MS);
        let recent = st.outcomes.iter().filter(|&&(t, _)| t >= since);
        EndpointStatus {
            in_flight: st.in_flight,
            cooling_ms: st.cooling(now_ms).then(|| st.cooling_until_ms - now_ms),
            sent_last_minute: st.sent.iter().filter(|&&(t, _)| t >= since).count() as u32,
            failed_last_minute: recent.clone().filter(|&&(_, f)| f).count() as u32,
            ended_last_minute: recent.count() as u32,
            ttft_ewma_ms: st.ttft_ewma_ms,
        }
    }
}

/// One endpoint's state, for display.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EndpointStatus {
    pub in_flight: u32,
    /// How long its cooldown still lasts; `None`: not cooling down.
    pub cooling_ms: Option<u64>,
    pub sent_last_minute: u32,
    pub failed_last_minute: u32,
    pub ended_last_minute: u32,
    pub ttft_ewma_ms: Option<f64>,
}
