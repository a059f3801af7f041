//! The groups file and what it configures: reading, validating and reloading it, the
//! endpoints' keys, the live groups, the metrics and the status page's view.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::http::HeaderValue;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tandem_router::groups::{EndpointRef, Groups, GroupsConfig, GroupsConfigError, Outcome};

use super::budget::{Bill, BudgetBook, Payer};
use super::experiment::ExperimentBook;
use super::{Spill, now_ms};
use crate::http::ValidRequest;
use crate::http::error::ServeError;
use crate::http::metrics::EndHook;

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
struct CascadeLabels {
    cascade: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SpillLabels {
    model: String,
    from: String,
    to: String,
}

/// The groups in force, with their endpoints' keys (`[model][group][endpoint]`).
pub(super) struct Live {
    pub(super) groups: Groups,
    pub(super) keys: Vec<Vec<Vec<Option<String>>>>,
    /// Bumped at every reload: outcomes of requests picked under older groups are dropped.
    pub(super) generation: u64,
}

type Stamp = (Option<SystemTime>, u64);

/// The live groups of an [`crate::http::HttpState`].
pub(crate) struct GroupGate {
    options: GroupsOptions,
    pub(super) live: Mutex<Live>,
    /// The stamp of the file last read, and the last refusal (reported once).
    seen: Mutex<(Option<Stamp>, Option<String>)>,
    pub(super) client: reqwest::Client,
    requests: Family<GroupLabels, Counter>,
    spillovers: Family<SpillLabels, Counter>,
    cascades: Family<CascadeLabels, Counter>,
    /// The budgets' counts (kept across reloads) and the spend per tenant.
    budget: Arc<BudgetBook>,
    /// The A/B experiment's arms, counted.
    experiment: Arc<ExperimentBook>,
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
    let keys = cfg.per_endpoint(|_, e| key(path, e, &options.env))?;
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
    /// `timeout`: the most a proxied request may take, its answer's stream included (the
    /// edge's request timeout).
    pub(crate) fn load(
        options: GroupsOptions,
        timeout: Duration,
        registry: &mut Registry,
    ) -> Result<GroupGate, GroupsError> {
        let seen = stamp(&options.file).ok();
        let live = read(&options)?;
        let client = reqwest::Client::builder()
            .connect_timeout(options.connect_timeout)
            .timeout(timeout)
            .build()
            .map_err(|e| GroupsError::Client(e.to_string()))?;
        let requests = Family::<GroupLabels, Counter>::default();
        let spillovers = Family::<SpillLabels, Counter>::default();
        let cascades = Family::<CascadeLabels, Counter>::default();
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
        registry.register(
            "tandem_cascade_requests",
            "Requests for a model cascade, by who answered (small: the small model, sure enough; escalated: the large model, after the small one was unsure or failed; asked: the large model, as the client asked)",
            cascades.clone(),
        );
        let budget = Arc::new(BudgetBook::register(
            &live.groups.config().budgets,
            registry,
        ));
        log_loaded(&options.file, live.groups.config(), "backend groups loaded");
        let experiment = Arc::new(ExperimentBook::register(registry));
        Ok(GroupGate {
            budget,
            experiment,
            options,
            live: Mutex::new(live),
            seen: Mutex::new((seen, None)),
            client,
            requests,
            spillovers,
            cascades,
        })
    }

    /// Whether `model` is served by groups.
    pub(crate) fn serves(&self, model: &str) -> bool {
        let live = self.live.lock();
        let cfg = live.groups.config();
        cfg.model(model).is_some() || cfg.cascade(model).is_some()
    }

    /// Whether `model` has a batch group (over-budget requests are demoted to it).
    fn has_batch_group(&self, model: &str) -> bool {
        let live = self.live.lock();
        live.groups
            .config()
            .model(model)
            .is_some_and(|m| m.groups.iter().any(|g| g.batch))
    }

    /// Whether a request for `model` charged to `payer` may go: `Ok(false)` as it is,
    /// `Ok(true)` demoted to the model's batch group, `Err` refused (`budget.rs`).
    pub(crate) fn check_budget(
        &self,
        payer: &Payer,
        model: Option<&str>,
    ) -> Result<bool, ServeError> {
        let can_demote = model.is_some_and(|m| self.has_batch_group(m));
        self.budget.check(payer, can_demote)
    }

    /// A bill for a request charged to `payer`, answered at `cost`.
    pub(crate) fn bill(&self, payer: Payer, cost: Option<tandem_router::groups::Cost>) -> Bill {
        self.budget.bill(payer, cost)
    }

    /// Places a request the pool serves in an arm of the experiment, if one runs
    /// (`experiment.rs`).
    pub(crate) fn assign_arm(&self, req: &mut ValidRequest) -> Option<(HeaderValue, EndHook)> {
        let experiment = self.live.lock().groups.config().experiment.clone()?;
        self.experiment.assign(experiment, req)
    }

    /// The cascade named `name`, if the file has one.
    pub(super) fn cascade(&self, name: &str) -> Option<tandem_router::groups::CascadeConfig> {
        self.live.lock().groups.config().cascade(name).cloned()
    }

    /// A request for cascade `cascade` answered by `outcome` (small, escalated, asked).
    pub(super) fn count_cascade(&self, cascade: &str, outcome: &'static str) {
        self.cascades
            .get_or_create(&CascadeLabels {
                cascade: cascade.to_string(),
                outcome,
            })
            .inc();
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
                self.budget.reconfigure(&live.groups.config().budgets);
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

    pub(super) fn finished(&self, generation: u64, e: EndpointRef, outcome: Outcome) {
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
        serde_json::json!({ "models": models, "experiment": self.experiment.status() })
    }

    /// How many groups model `m` has.
    pub(super) fn groups_of(&self, m: usize) -> usize {
        self.live.lock().groups.config().models[m].groups.len()
    }

    /// A request answered by group `to` (`"none"`: by no group) after `spill`.
    pub(super) fn spilled(&self, model: &str, spill: Option<&Spill>, to: &str) {
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

    pub(super) fn count(&self, model: &str, group: &str, outcome: &'static str) {
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

/// Polls the groups file until `shutdown` (see the module docs).
pub async fn watch_groups(
    state: crate::http::HttpState,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let Some(gate) = state.groups() else {
        return;
    };
    crate::http::state::poll_until(gate.options.reload_interval, &shutdown, || {
        if let Some(Err(e)) = gate.reload_if_changed() {
            tracing::error!(
                error = %e,
                "the groups file was refused; the previous groups stay in force"
            );
        }
    })
    .await;
}
