//! What an operator writes: per model name, its groups in priority order, each group's
//! strategy and endpoints with their limits. Deserialized from any serde format (the
//! frontend reads TOML), then [`GroupsConfig::validate`]d before a single request sees it:
//! a bad file is refused whole, with the first thing wrong in it.

use serde::Deserialize;

/// Every model name's groups.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GroupsConfig {
    /// Cooldowns when a group does not set its own.
    #[serde(default)]
    pub cooldown: CooldownConfig,
    #[serde(default, rename = "model")]
    pub models: Vec<ModelGroups>,
    /// Model names answered by a small model, escalated to a large one when it is unsure.
    #[serde(default, rename = "cascade")]
    pub cascades: Vec<CascadeConfig>,
    /// Token budgets per tenant, session or task (`super::budgets`).
    #[serde(default, rename = "budget")]
    pub budgets: Vec<super::budgets::BudgetConfig>,
    /// An A/B split of the pool's requests between two routing configurations.
    #[serde(default)]
    pub experiment: Option<super::experiment::ExperimentConfig>,
}

/// A model cascade: requests for `name` go to the `small` model's groups first; when its
/// answer's mean token log-probability is below `min_mean_logprob`, or the `verifier` model
/// does not judge it right (or it fails, or the client asks), the conversation goes unchanged
/// to the `large` model's groups.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CascadeConfig {
    /// The name clients ask for.
    pub name: String,
    /// A model of this file whose groups answer first.
    pub small: String,
    /// A model of this file whose groups take what the small one is unsure of.
    pub large: String,
    /// The mean log-probability per answer token below which the answer is escalated
    /// (e.g. −0.5: a geometric mean probability of 0.61).
    #[serde(default)]
    pub min_mean_logprob: Option<f64>,
    /// A model of this file asked whether the small model's answer is right (a judge: the
    /// conversation, the answer, then [`verifier_prompt`](Self::verifier_prompt); it answers
    /// yes or no).
    #[serde(default)]
    pub verifier: Option<String>,
    /// The verifier's probability of "yes" below which the answer is escalated.
    #[serde(default = "default_verifier_score")]
    pub min_verifier_score: f64,
    /// What the verifier is asked after the answer.
    #[serde(default = "default_verifier_prompt")]
    pub verifier_prompt: String,
}

fn default_verifier_score() -> f64 {
    0.5
}

fn default_verifier_prompt() -> String {
    "Is the assistant's last answer correct and complete? Reply with yes or no only.".into()
}

/// One model name and the groups that serve it, highest priority first.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelGroups {
    /// The name clients ask for (`model` in the request).
    pub name: String,
    #[serde(rename = "group")]
    pub groups: Vec<GroupConfig>,
}

/// One group: tandem's own pool, or a list of endpoints tandem cannot see into.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// The name responses and metrics use (`x-tandem-group`).
    pub name: String,
    /// `true`: this process's own workers (discovery, KV-aware routing); no endpoints.
    #[serde(default)]
    pub pool: bool,
    /// How an endpoint of the group is chosen (pools route by KV and load instead).
    #[serde(default)]
    pub strategy: Strategy,
    /// This group's cooldowns (default: the file's `[cooldown]`).
    #[serde(default)]
    pub cooldown: Option<CooldownConfig>,
    #[serde(default, rename = "endpoint")]
    pub endpoints: Vec<EndpointConfig>,
    /// A group only requests over their budget go to (demoted there instead of refused);
    /// other requests pass it by.
    #[serde(default)]
    pub batch: bool,
    /// What the group's tokens cost, for the spend per tenant in the metrics.
    #[serde(default)]
    pub cost: Option<Cost>,
}

/// Prices per million tokens, in whatever currency the operator keeps accounts in.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Cost {
    pub prompt_per_million: f64,
    pub completion_per_million: f64,
}

impl Cost {
    /// The cost of a request's tokens.
    pub fn of(&self, prompt_tokens: u64, completion_tokens: u64) -> f64 {
        (prompt_tokens as f64 * self.prompt_per_million
            + completion_tokens as f64 * self.completion_per_million)
            / 1e6
    }
}

/// How a group of endpoints picks one (LiteLLM's routing strategies).
#[derive(Clone, Copy, Debug, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// At random in proportion to each endpoint's `weight` (else its `rpm`, else its `tpm`,
    /// else 1): LiteLLM's `simple-shuffle`.
    #[default]
    Weighted,
    /// The fewest requests in flight (ties at random): LiteLLM's `least-busy`.
    LeastBusy,
    /// The lowest moving average of time to first token; an endpoint with no sample yet is
    /// tried first: LiteLLM's `latency-based-routing`.
    Latency,
}

/// An OpenAI-compatible server: another tandem, vLLM, SGLang, llama.cpp or a hosted API.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Its base URL, up to and with `/v1`.
    pub url: String,
    /// The model name to send it (default: the name the client asked for).
    #[serde(default)]
    pub model: Option<String>,
    /// The environment variable that holds its API key (sent as a bearer token).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The file that holds its API key (read at start and at each reload).
    #[serde(default)]
    pub api_key_file: Option<String>,
    /// Share of the group's traffic under [`Strategy::Weighted`].
    #[serde(default)]
    pub weight: Option<f64>,
    /// Requests a minute it may be sent (over it: skipped until the minute rolls on).
    #[serde(default)]
    pub rpm: Option<u32>,
    /// Tokens (prompt and completion) a minute it may be sent.
    #[serde(default)]
    pub tpm: Option<u64>,
    /// Requests in flight at once.
    #[serde(default)]
    pub max_parallel_requests: Option<u32>,
    /// Its context length: a request whose prompt and `max_tokens` do not fit skips it.
    #[serde(default)]
    pub context_length: Option<u32>,
}

/// When an endpoint is taken out for a while (LiteLLM's cooldown rules).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CooldownConfig {
    /// How long, in seconds, unless the endpoint's `Retry-After` says otherwise.
    pub seconds: f64,
    /// The failure share over the last minute that cools an endpoint down.
    pub failure_ratio: f64,
    /// Outcomes in the last minute before [`failure_ratio`](Self::failure_ratio) applies.
    pub min_requests: u32,
    /// The longest cooldown a `Retry-After` may ask for, in seconds.
    pub max_seconds: f64,
}

impl Default for CooldownConfig {
    fn default() -> Self {
        CooldownConfig {
            seconds: 5.0,
            failure_ratio: 0.5,
            min_requests: 5,
            max_seconds: 300.0,
        }
    }
}

/// What is wrong with a config, naming where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GroupsConfigError {
    #[error("model {0:?} is configured twice")]
    DuplicateModel(String),
    #[error("model {0:?} has no group (besides batch groups)")]
    NoGroup(String),
    #[error("model {model:?}: group {group:?} is named twice")]
    DuplicateGroup { model: String, group: String },
    #[error("model {model:?}, group {group:?}: {why}")]
    Group {
        model: String,
        group: String,
        why: String,
    },
    #[error("cooldown: {0}")]
    Cooldown(String),
    #[error("cascade {name:?}: {why}")]
    Cascade { name: String, why: String },
    #[error("budget {index}: {why}")]
    Budget { index: usize, why: String },
    #[error("experiment: {0}")]
    Experiment(String),
}

impl GroupsConfig {
    /// Every rule a config must keep, checked before it is used.
    pub fn validate(&self) -> Result<(), GroupsConfigError> {
        check_cooldown(&self.cooldown).map_err(GroupsConfigError::Cooldown)?;
        let mut models = std::collections::HashSet::new();
        for m in &self.models {
            if !models.insert(m.name.as_str()) {
                return Err(GroupsConfigError::DuplicateModel(m.name.clone()));
            }
            // Batch groups take only demoted requests: a model needs another group.
            if m.groups.iter().all(|g| g.batch) {
                return Err(GroupsConfigError::NoGroup(m.name.clone()));
            }
            let mut names = std::collections::HashSet::new();
            for g in &m.groups {
                if !names.insert(g.name.as_str()) {
                    return Err(GroupsConfigError::DuplicateGroup {
                        model: m.name.clone(),
                        group: g.name.clone(),
                    });
                }
                check_group(g).map_err(|why| GroupsConfigError::Group {
                    model: m.name.clone(),
                    group: g.name.clone(),
                    why,
                })?;
            }
        }
        for (index, b) in self.budgets.iter().enumerate() {
            b.check()
                .map_err(|why| GroupsConfigError::Budget { index, why })?;
        }
        if let Some(e) = &self.experiment {
            e.check().map_err(GroupsConfigError::Experiment)?;
        }
        let mut cascades = std::collections::HashSet::new();
        for c in &self.cascades {
            let fail = |why: &str| GroupsConfigError::Cascade {
                name: c.name.clone(),
                why: why.to_string(),
            };
            if !cascades.insert(c.name.as_str()) || models.contains(c.name.as_str()) {
                return Err(fail(
                    "the name is configured twice (as a model or a cascade)",
                ));
            }
            let members = [Some(&c.small), Some(&c.large), c.verifier.as_ref()];
            for member in members.into_iter().flatten() {
                let Some(m) = self.model(member) else {
                    return Err(fail(&format!("{member:?} is not a [[model]] of this file")));
                };
                if m.groups.iter().any(|g| g.pool) {
                    return Err(fail(&format!(
                        "{member:?} has a pool group: a cascade reads its answers whole, which \
                         it does for endpoints only"
                    )));
                }
            }
            if c.small == c.large {
                return Err(fail("small and large are the same model"));
            }
            if let Some(t) = c.min_mean_logprob
                && !(t.is_finite() && t <= 0.0)
            {
                return Err(fail("min_mean_logprob must be a number <= 0"));
            }
            if c.min_mean_logprob.is_none() && c.verifier.is_none() {
                return Err(fail(
                    "no rule escalates: give min_mean_logprob, a verifier, or both",
                ));
            }
            if !(0.0..=1.0).contains(&c.min_verifier_score) {
                return Err(fail("min_verifier_score must be in [0, 1]"));
            }
        }
        Ok(())
    }

    /// The cascade named `name`, if there is one.
    pub fn cascade(&self, name: &str) -> Option<&CascadeConfig> {
        self.cascades.iter().find(|c| c.name == name)
    }

    /// `f` of every endpoint, in the config's own shape (`[model][group][endpoint]`); the
    /// first error stops it.
    pub fn per_endpoint<T, E>(
        &self,
        mut f: impl FnMut(super::EndpointRef, &EndpointConfig) -> Result<T, E>,
    ) -> Result<Vec<Vec<Vec<T>>>, E> {
        let mut out = Vec::with_capacity(self.models.len());
        for (model, m) in self.models.iter().enumerate() {
            let mut groups = Vec::with_capacity(m.groups.len());
            for (group, g) in m.groups.iter().enumerate() {
                let at = |endpoint| super::EndpointRef {
                    model,
                    group,
                    endpoint,
                };
                let endpoints = g.endpoints.iter().enumerate();
                groups.push(
                    endpoints
                        .map(|(i, e)| f(at(i), e))
                        .collect::<Result<_, E>>()?,
                );
            }
            out.push(groups);
        }
        Ok(out)
    }

    /// The groups of `model`, if it is configured.
    pub fn model(&self, model: &str) -> Option<&ModelGroups> {
        self.models.iter().find(|m| m.name == model)
    }
}

fn check_group(g: &GroupConfig) -> Result<(), String> {
    if g.pool && !g.endpoints.is_empty() {
        return Err("a pool group has no endpoints (its workers come from discovery)".into());
    }
    if !g.pool && g.endpoints.is_empty() {
        return Err("no endpoint (or `pool = true` for this process's workers)".into());
    }
    if let Some(c) = &g.cooldown {
        check_cooldown(c)?;
    }
    if let Some(c) = &g.cost
        && ![c.prompt_per_million, c.completion_per_million]
            .iter()
            .all(|p| p.is_finite() && *p >= 0.0)
    {
        return Err("cost: prices must be numbers >= 0".into());
    }
    for (i, e) in g.endpoints.iter().enumerate() {
        let at = |why: &str| format!("endpoint {i} ({}): {why}", e.url);
        if !(e.url.starts_with("http://") || e.url.starts_with("https://")) {
            return Err(at("the url must start with http:// or https://"));
        }
        if e.api_key_env.is_some() && e.api_key_file.is_some() {
            return Err(at("api_key_env and api_key_file both given: choose one"));
        }
        if let Some(w) = e.weight
            && !(w.is_finite() && w > 0.0)
        {
            return Err(at("weight must be a number > 0"));
        }
        if e.rpm == Some(0) || e.tpm == Some(0) || e.max_parallel_requests == Some(0) {
            return Err(at(
                "rpm, tpm and max_parallel_requests must be > 0 where given",
            ));
        }
        if e.context_length == Some(0) {
            return Err(at("context_length must be > 0"));
        }
    }
    Ok(())
}

fn check_cooldown(c: &CooldownConfig) -> Result<(), String> {
    if !(c.seconds.is_finite() && c.seconds >= 0.0) {
        return Err(format!("seconds must be >= 0, got {}", c.seconds));
    }
    if !(c.max_seconds.is_finite() && c.max_seconds >= c.seconds) {
        return Err(format!(
            "max_seconds must be >= seconds ({}), got {}",
            c.seconds, c.max_seconds
        ));
    }
    if !(c.failure_ratio > 0.0 && c.failure_ratio <= 1.0) {
        return Err(format!(
            "failure_ratio must be in (0, 1], got {}",
            c.failure_ratio
        ));
    }
    Ok(())
}
