//! `tandem planner`: flags → [`tandem_planner::run`] with a local or a Kubernetes actuator.
//!
//! Flags read `TANDEM_PLANNER_*` variables (not plain `TANDEM_*`), so that the local mode's
//! worker processes, which inherit the planner's environment, cannot mistake a planner
//! setting for one of theirs.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use tandem_planner::{
    Actuator, DecideConfig, Hysteresis, Kubernetes, KubernetesConfig, Local, LocalConfig,
    PoolConfig, RunConfig,
};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Start and stop `tandem prefill` / `tandem decode` processes on this machine.
    Local,
    /// Set `spec.replicas` of two Deployments through their scale subresource.
    Kubernetes,
}

#[derive(Args, Debug)]
pub struct PlannerArgs {
    /// A frontend's admin listener, whose `/metrics` to read (`http://host:port`, its
    /// `--admin-listen`); repeat for every replica.
    #[arg(
        long = "frontend-url",
        env = "TANDEM_PLANNER_FRONTEND_URLS",
        value_delimiter = ',',
        required = true
    )]
    frontend_urls: Vec<String>,
    /// The frontends' --admin-key, when they have one.
    #[arg(long, env = "TANDEM_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<tandem_planner::AdminKey>,
    /// Seconds between decisions.
    #[arg(long, env = "TANDEM_PLANNER_INTERVAL_S", default_value_t = 10.0)]
    interval_s: f64,
    /// Seconds a scrape may take.
    #[arg(long, env = "TANDEM_PLANNER_SCRAPE_TIMEOUT_S", default_value_t = 2.0)]
    scrape_timeout_s: f64,
    /// SLO: time to first token at `--slo-quantile`.
    #[arg(long, env = "TANDEM_PLANNER_SLO_TTFT_MS", default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    /// SLO: inter-token latency at `--slo-quantile`.
    #[arg(long, env = "TANDEM_PLANNER_SLO_ITL_MS", default_value_t = 25.0)]
    slo_itl_ms: f64,
    /// The quantile the SLOs are set at (0.9: p90).
    #[arg(long, env = "TANDEM_PLANNER_SLO_QUANTILE", default_value_t = 0.9)]
    slo_quantile: f64,
    /// Prompt tokens (not cached) one prefill worker computes per second within the TTFT
    /// SLO: the prefill pool's goodput at the SLO over its workers, from `tandem size` /
    /// `tandem sim --prefill-workers P --sweep-rate …` (rate × ISL × (1 − hit rate) / P at the
    /// highest rate that meets the SLO), or measured with `tandem bench`.
    #[arg(long, env = "TANDEM_PLANNER_PREFILL_CAPACITY")]
    prefill_capacity: f64,
    /// Tokens one decode worker generates per second within the ITL SLO (rate × OSL / D at
    /// the highest rate that meets the SLO, as for `--prefill-capacity`).
    #[arg(long, env = "TANDEM_PLANNER_DECODE_CAPACITY")]
    decode_capacity: f64,
    #[arg(long, env = "TANDEM_PLANNER_MIN_PREFILL", default_value_t = 1)]
    min_prefill: u32,
    #[arg(long, env = "TANDEM_PLANNER_MAX_PREFILL", default_value_t = 8)]
    max_prefill: u32,
    #[arg(long, env = "TANDEM_PLANNER_MIN_DECODE", default_value_t = 1)]
    min_decode: u32,
    #[arg(long, env = "TANDEM_PLANNER_MAX_DECODE", default_value_t = 8)]
    max_decode: u32,
    /// Scale a pool up after this many consecutive intervals wanting more.
    #[arg(long, env = "TANDEM_PLANNER_SCALE_UP_AFTER", default_value_t = 2)]
    scale_up_after: u32,
    /// Scale a pool down after this many consecutive intervals in which the smaller pool
    /// would stay under the margin.
    #[arg(long, env = "TANDEM_PLANNER_SCALE_DOWN_AFTER", default_value_t = 3)]
    scale_down_after: u32,
    /// Scale down only while the survivors would run at most this fraction of their
    /// capacity and the latency is at most this fraction of its SLO.
    #[arg(long, env = "TANDEM_PLANNER_SCALE_DOWN_MARGIN", default_value_t = 0.8)]
    scale_down_margin: f64,
    /// No scale-down of a pool this long after its last change.
    #[arg(long, env = "TANDEM_PLANNER_COOLDOWN_S", default_value_t = 30.0)]
    cooldown_s: f64,
    #[arg(long, env = "TANDEM_PLANNER_MAX_STEP_UP", default_value_t = 2)]
    max_step_up: u32,
    #[arg(long, env = "TANDEM_PLANNER_MAX_STEP_DOWN", default_value_t = 1)]
    max_step_down: u32,
    /// How long a change may take to show in the frontends' worker counts before the planner
    /// decides again anyway.
    #[arg(long, env = "TANDEM_PLANNER_SETTLE_TIMEOUT_S", default_value_t = 120.0)]
    settle_timeout_s: f64,
    /// The lowest the latency correction may take a rated capacity (fraction).
    #[arg(long, env = "TANDEM_PLANNER_MIN_CORRECTION", default_value_t = 0.25)]
    min_correction: f64,
    /// Holt's α: weight of the newest interval in the load forecast (1: the last interval).
    #[arg(long, env = "TANDEM_PLANNER_SMOOTHING", default_value_t = 0.5)]
    smoothing: f64,
    /// Holt's β: weight of the newest slope in the request-rate trend (0: no trend).
    #[arg(long, env = "TANDEM_PLANNER_TREND", default_value_t = 0.2)]
    trend: f64,
    /// Append every decision as a JSON line to this file.
    #[arg(long, env = "TANDEM_PLANNER_DECISIONS_OUT")]
    decisions_out: Option<PathBuf>,
    #[arg(long, env = "TANDEM_PLANNER_MODE", value_enum, default_value_t = Mode::Local)]
    mode: Mode,
    /// Local: the `tandem` binary the workers run (default: this one).
    #[arg(long, env = "TANDEM_PLANNER_WORKER_BIN")]
    worker_bin: Option<PathBuf>,
    /// Local: flags of every worker, split at whitespace (no quoting), e.g. `--etcd-endpoints
    /// http://127.0.0.1:2379 --nats-url nats://127.0.0.1:4222 --namespace prod`.
    #[arg(
        long,
        env = "TANDEM_PLANNER_WORKER_ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    worker_args: String,
    /// Local: more flags of the prefill workers.
    #[arg(
        long,
        env = "TANDEM_PLANNER_PREFILL_ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    prefill_args: String,
    /// Local: more flags of the decode workers.
    #[arg(
        long,
        env = "TANDEM_PLANNER_DECODE_ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    decode_args: String,
    /// Local: each worker's output in `<dir>/<role>-<n>.log` (default: the planner's).
    #[arg(long, env = "TANDEM_PLANNER_WORKER_LOG_DIR")]
    worker_log_dir: Option<PathBuf>,
    /// Local: seconds a worker may drain after SIGTERM before it is killed.
    #[arg(
        long,
        env = "TANDEM_PLANNER_WORKER_DRAIN_TIMEOUT_S",
        default_value_t = 60
    )]
    worker_drain_timeout_s: u64,
    /// Kubernetes: the API's base URL, plain HTTP (`kubectl proxy` in a sidecar).
    #[arg(
        long,
        env = "TANDEM_PLANNER_KUBE_API",
        default_value = "http://127.0.0.1:8001"
    )]
    kube_api: String,
    #[arg(long, env = "TANDEM_PLANNER_KUBE_NAMESPACE", default_value = "default")]
    kube_namespace: String,
    #[arg(
        long,
        env = "TANDEM_PLANNER_PREFILL_DEPLOYMENT",
        default_value = "tandem-prefill"
    )]
    prefill_deployment: String,
    #[arg(
        long,
        env = "TANDEM_PLANNER_DECODE_DEPLOYMENT",
        default_value = "tandem-decode"
    )]
    decode_deployment: String,
    /// One JSON object per log line.
    #[arg(long, env = "TANDEM_LOG_JSON", default_value_t = false)]
    log_json: bool,
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

fn seconds(what: &str, s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("{what} must be a positive number of seconds"))
}

pub async fn run(args: PlannerArgs) -> anyhow::Result<()> {
    let _telemetry = tandem_runtime::telemetry::init(tandem_runtime::telemetry::TelemetryConfig {
        json: args.log_json,
        filter: None,
        otlp: None,
    })?;
    let decide = DecideConfig {
        prefill: PoolConfig {
            min: args.min_prefill,
            max: args.max_prefill,
            capacity: args.prefill_capacity,
            slo_s: args.slo_ttft_ms / 1e3,
        },
        decode: PoolConfig {
            min: args.min_decode,
            max: args.max_decode,
            capacity: args.decode_capacity,
            slo_s: args.slo_itl_ms / 1e3,
        },
        hysteresis: Hysteresis {
            up_after: args.scale_up_after,
            down_after: args.scale_down_after,
            down_margin: args.scale_down_margin,
            cooldown_s: args.cooldown_s,
            max_step_up: args.max_step_up,
            max_step_down: args.max_step_down,
            settle_timeout_s: args.settle_timeout_s,
            min_correction: args.min_correction,
        },
        smoothing: args.smoothing,
        trend: args.trend,
    };
    let cfg = RunConfig {
        frontends: args.frontend_urls.clone(),
        admin_key: args.admin_key.clone(),
        interval: seconds("--interval-s", args.interval_s)?,
        scrape_timeout: seconds("--scrape-timeout-s", args.scrape_timeout_s)?,
        slo_quantile: args.slo_quantile,
        decide,
        decisions_out: args.decisions_out.clone(),
    };
    let actuator: Box<dyn Actuator> = match args.mode {
        Mode::Local => Box::new(Local::new(LocalConfig {
            program: match &args.worker_bin {
                Some(p) => p.clone(),
                None => std::env::current_exe()?,
            },
            common_args: words(&args.worker_args),
            prefill_args: words(&args.prefill_args),
            decode_args: words(&args.decode_args),
            log_dir: args.worker_log_dir.clone(),
            drain_timeout: Duration::from_secs(args.worker_drain_timeout_s),
        })),
        Mode::Kubernetes => Box::new(Kubernetes::new(KubernetesConfig {
            api: args.kube_api.clone(),
            namespace: args.kube_namespace.clone(),
            prefill_deployment: args.prefill_deployment.clone(),
            decode_deployment: args.decode_deployment.clone(),
            timeout: Duration::from_secs(10),
        })?),
    };
    // The first SIGTERM / SIGINT stops deciding and drains the local workers.
    let root = tandem_runtime::shutdown::Shutdown::new();
    tandem_runtime::shutdown::shutdown_on_signals(root.clone());
    let stop = CancellationToken::new();
    let on_drain = stop.clone();
    tokio::spawn(async move {
        root.draining().await;
        on_drain.cancel();
    });
    tracing::info!(mode = ?args.mode, frontends = ?args.frontend_urls, "planner starting");
    tandem_planner::run(cfg, actuator, stop).await?;
    Ok(())
}
