//! `tandem bench`: open-loop load against any OpenAI-compatible endpoint.
//!
//! # Job
//!
//! [`run`] takes a [`BenchConfig`] (endpoint, model, API, a `tandem-workload` workload and
//! [`Slo`], the rates to run at) and returns a [`BenchSweep`]: one [`BenchReport`] per rate,
//! with TTFT, TPOT, ITL and E2E percentiles, throughput, goodput under the SLO and the
//! prefix-cache hit rate the endpoint reported. The workload is the one `tandem sim` runs, so
//! a simulated cluster and a real one can be compared request for request. Every request is
//! sent at its arrival time whether or not earlier ones have finished (open loop; a
//! concurrency cap makes later arrivals wait), streamed, and timed.
//!
//! # Layout
//!
//! - `lib.rs`: [`BenchConfig`], [`BenchError`], [`run`] / [`run_with`]: the endpoint check
//!   (`GET /v1/models`) and the rates, one after another.
//! - `load.rs`: one rate: requests sent on schedule, collected as they end, the progress
//!   line.
//! - `client.rs`: one streamed request ([`Api`]: completions or chat) and its [`Record`];
//!   server-sent events from arbitrary chunks.
//! - `text.rs`: prompts as text (token `t` → a common English word), so token prefixes stay
//!   text prefixes.
//! - `report.rs`: [`BenchReport`], [`BenchSweep`], as Markdown and JSON.
//!
//! # Invariants
//!
//! - Memory is bounded by the requests in flight plus one small [`Record`] per request:
//!   latencies go into [`tandem_workload::LatencyHistogram`]s as requests end, and finished
//!   requests are collected while later ones are still being sent.
//! - Every prompt of a rate starts with `<salt>-<rate index>`, so runs and rates do not hit
//!   the endpoint's prefix cache with each other's prompts.
//! - No environment variables and no flags here: the binary parses those into a
//!   [`BenchConfig`]. The progress line goes to stderr, only when asked for and only when
//!   stderr is a terminal.

mod client;
mod load;
mod report;
mod text;

use std::time::Duration;

pub use client::{Api, Record};
pub use report::{BenchReport, BenchSweep};
pub use tandem_workload::{Slo, WorkloadConfig};

/// Everything one `tandem bench` invocation does.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Base URL of the endpoint (its `/v1/...` paths are appended; a trailing `/` is dropped).
    pub url: String,
    /// Model name sent with every request (must be one the endpoint lists).
    pub model: String,
    pub api: Api,
    /// Bearer token for the endpoint, if it wants one.
    pub api_key: Option<String>,
    /// Ask for exactly the workload's output lengths (`ignore_eos`).
    pub ignore_eos: bool,
    /// At most this many requests in flight (None: unbounded, open loop).
    pub max_concurrency: Option<usize>,
    /// Per-request deadline.
    pub timeout: Duration,
    pub slo: Slo,
    pub workload: WorkloadConfig,
    /// Seeds the workload.
    pub seed: u64,
    /// Each arrival moved later by a seeded offset in `[0, arrival_jitter_us)` µs.
    pub arrival_jitter_us: u64,
    /// Run at each of these rates (requests per second, or a trace's arrival speedups), in
    /// order; empty: once, at the workload's own rate.
    pub rates: Vec<f64>,
    /// What every prompt starts with (then `-<rate index>`); None: random per run.
    pub salt: Option<String>,
    /// Show a progress line on stderr (when it is a terminal).
    pub progress: bool,
}

impl BenchConfig {
    /// A config for `workload` against `url` with every other setting at the CLI's default.
    pub fn new(url: impl Into<String>, workload: WorkloadConfig) -> Self {
        BenchConfig {
            url: url.into(),
            model: "mocker".into(),
            api: Api::Completions,
            api_key: None,
            ignore_eos: true,
            max_concurrency: None,
            timeout: Duration::from_secs(600),
            slo: Slo::default(),
            workload,
            seed: 0,
            arrival_jitter_us: 0,
            rates: Vec::new(),
            salt: None,
            progress: false,
        }
    }

    /// Checks every field that can be checked before any request; the SLO and the workload
    /// by their own rules.
    pub fn validate(&self) -> Result<(), BenchError> {
        self.slo.validate()?;
        self.workload.validate()?;
        if let Some(r) = self.rates.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
            return Err(BenchError::InvalidConfig(format!(
                "rates must be positive numbers, got {r}"
            )));
        }
        if self.max_concurrency == Some(0) {
            return Err(BenchError::InvalidConfig(
                "--max-concurrency must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// Why a bench run failed. Requests that fail are not errors: they are counted in the report
/// ([`BenchReport::failures`]); only a rate at which none succeeded stops the run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    InvalidConfig(String),
    #[error(transparent)]
    Workload(#[from] tandem_workload::WorkloadError),
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
    #[error("cannot reach {url}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url}/v1/models answered HTTP {status}")]
    ModelsStatus { url: String, status: u16 },
    #[error("{url}/v1/models is not JSON")]
    ModelsNotJson {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} does not serve model {model:?} (it serves {served:?}): use --model")]
    ModelNotServed {
        url: String,
        model: String,
        served: Vec<String>,
    },
    #[error("no request succeeded at rate {rate}: {why}")]
    NoneSucceeded { rate: f64, why: String },
    #[error("a request task failed")]
    Task(#[from] tokio::task::JoinError),
}

impl BenchError {
    /// Whether the caller's input is at fault (a flag, a file, the model name), not the
    /// endpoint or the bench.
    pub fn is_invalid_input(&self) -> bool {
        match self {
            BenchError::InvalidConfig(_) | BenchError::ModelNotServed { .. } => true,
            BenchError::Workload(e) => e.is_invalid_input(),
            _ => false,
        }
    }
}

/// Runs every rate of `config`; see [`run_with`].
pub async fn run(config: &BenchConfig) -> Result<BenchSweep, BenchError> {
    run_with(config, |_| {}).await
}

/// Checks the endpoint, then runs the workload at each rate in turn, handing each rate's
/// report to `on_report` as soon as it is done (the binary prints it) and returning them all.
pub async fn run_with(
    config: &BenchConfig,
    mut on_report: impl FnMut(&BenchReport),
) -> Result<BenchSweep, BenchError> {
    config.validate()?;
    let base = config.url.trim_end_matches('/').to_string();
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(BenchError::Client)?;
    check_endpoint(&http, &base, config).await?;
    let rates = match config.rates.as_slice() {
        [] => vec![config.workload.rate()],
        r => r.to_vec(),
    };
    let salt = config.salt.clone().unwrap_or_else(random_salt);
    let mut points = Vec::with_capacity(rates.len());
    for (k, &rate) in rates.iter().enumerate() {
        let salt = format!("{salt}-{k}");
        let workload = config.workload.with_rate(rate);
        let collected = load::run_rate(config, &http, &base, &workload, &salt).await?;
        let report = BenchReport::new(&base, rate, config.slo, salt, collected);
        if report.completed == 0 {
            let why = report.failures.first().map_or("", |(m, _)| m.as_str());
            return Err(BenchError::NoneSucceeded {
                rate,
                why: why.to_string(),
            });
        }
        on_report(&report);
        points.push(report);
    }
    Ok(BenchSweep { points })
}

/// Per invocation: from the clock's nanoseconds and the process id.
fn random_salt() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{:08x}", nanos ^ std::process::id())
}

/// Fails early, with the reason, when the endpoint cannot be reached or does not serve the
/// model (`GET /v1/models`).
async fn check_endpoint(
    http: &reqwest::Client,
    base: &str,
    config: &BenchConfig,
) -> Result<(), BenchError> {
    let mut req = http.get(format!("{base}/v1/models"));
    if let Some(key) = &config.api_key {
        req = req.bearer_auth(key);
    }
    let resp = req
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|source| BenchError::Unreachable {
            url: base.to_string(),
            source,
        })?;
    if !resp.status().is_success() {
        return Err(BenchError::ModelsStatus {
            url: base.to_string(),
            status: resp.status().as_u16(),
        });
    }
    let models: serde_json::Value =
        resp.json()
            .await
            .map_err(|source| BenchError::ModelsNotJson {
                url: base.to_string(),
                source,
            })?;
    let served: Vec<String> = models["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    if !served.contains(&config.model) {
        return Err(BenchError::ModelNotServed {
            url: base.to_string(),
            model: config.model.clone(),
            served,
        });
    }
    Ok(())
}
