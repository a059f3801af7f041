//! The frontend's flow-control flags (`tandem frontend`, `tandem up`): the queue, its bands'
//! starvation guard, fairness weights, default tenant limits, saturation thresholds and the
//! request timeout. They fill [`tandem_router::FlowConfig`],
//! [`tandem_router::SaturationConfig`] and [`tandem_frontend::http::HttpConfig`]'s timeout.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tandem_frontend::FrontendConfig;
use tandem_frontend::cluster::HedgeConfig;
use tandem_router::{BreakerConfig, FlowConfig, RetryBudgetConfig, SaturationConfig, TenantLimits};

/// Overload handling at the frontend.
#[derive(Args, Debug, Clone)]
pub struct FlowArgs {
    /// Seconds a request may take at most, queueing included; a request's `timeout` field or
    /// `x-tandem-timeout` header may only shorten it.
    #[arg(long, env = "TANDEM_REQUEST_TIMEOUT", default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Requests waiting at most in the frontend's queue while every decode worker is
    /// saturated (0: refuse at once with 429).
    #[arg(long, env = "TANDEM_QUEUE_MAX", default_value_t = FlowConfig::default().max_queued)]
    pub queue_max: usize,
    /// Seconds a request may wait in the queue at most (then 429 with Retry-After), whatever
    /// its deadline.
    #[arg(long, env = "TANDEM_QUEUE_TIMEOUT", default_value_t = 10.0)]
    pub queue_timeout: f64,
    /// Milliseconds after which a lower band's oldest request counts as starving.
    #[arg(long, env = "TANDEM_QUEUE_STARVATION_MS", default_value_t = FlowConfig::default().starvation_ms)]
    pub queue_starvation_ms: u64,
    /// A starving band gets one dispatch after this many went to the bands above it.
    #[arg(long, env = "TANDEM_QUEUE_STARVATION_EVERY", default_value_t = FlowConfig::default().starvation_every)]
    pub queue_starvation_every: u32,
    /// Fairness between tenants (VTC): charge per prompt token.
    #[arg(long, env = "TANDEM_FAIR_INPUT_WEIGHT", default_value_t = FlowConfig::default().input_weight)]
    pub fair_input_weight: f64,
    /// Fairness between tenants (VTC): charge per generated token.
    #[arg(long, env = "TANDEM_FAIR_OUTPUT_WEIGHT", default_value_t = FlowConfig::default().output_weight)]
    pub fair_output_weight: f64,
    /// Requests per minute per tenant, for tenants the API keys file gives no limit (unset:
    /// none).
    #[arg(long, env = "TANDEM_TENANT_REQUESTS_PER_MINUTE")]
    pub tenant_requests_per_minute: Option<u64>,
    /// Prompt + max_tokens tokens per minute per tenant, for tenants the API keys file gives
    /// no limit (unset: none).
    #[arg(long, env = "TANDEM_TENANT_TOKENS_PER_MINUTE")]
    pub tenant_tokens_per_minute: Option<u64>,
    /// A decode worker is saturated when its in-flight requests will hold this fraction of
    /// its device KV blocks (0: off).
    #[arg(long, env = "TANDEM_SATURATION_KV_FRACTION", default_value_t = 1.0)]
    pub saturation_kv_fraction: f64,
    /// … or when its engine reports this many requests waiting, less those of its requests
    /// that ended since the report (0: off).
    #[arg(long, env = "TANDEM_SATURATION_WAITING", default_value_t = 4)]
    pub saturation_waiting: u32,
    /// … or when this many prompt tokens routed to it are not prefilled yet (0: off).
    #[arg(long, env = "TANDEM_SATURATION_PREFILL_TOKENS", default_value_t = 0)]
    pub saturation_prefill_tokens: u64,
    /// … or when it has this many requests in flight (0: off).
    #[arg(long, env = "TANDEM_SATURATION_REQUESTS", default_value_t = 0)]
    pub saturation_requests: u64,
    /// A prefill worker is saturated with this many prompt tokens routed to it and not yet
    /// prefilled (0: off); when every one is, requests that would prefill remotely wait.
    #[arg(
        long,
        env = "TANDEM_SATURATION_PREFILL_POOL_TOKENS",
        default_value_t = 65_536
    )]
    pub saturation_prefill_pool_tokens: u64,
    /// Decode workers tried per request before its first token (the first included).
    #[arg(long, env = "TANDEM_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,
    /// Times a request may move to another decode worker after its first token.
    #[arg(long, env = "TANDEM_MAX_MIGRATIONS", default_value_t = 3)]
    pub max_migrations: u32,
    /// Retries (and hedges) allowed per recent success (0.1: one per ten).
    #[arg(long, env = "TANDEM_RETRY_BUDGET", default_value_t = RetryBudgetConfig::default().ratio)]
    pub retry_budget: f64,
    /// Retries allowed in every 10 s whatever the successes.
    #[arg(long, env = "TANDEM_RETRY_BUDGET_MIN", default_value_t = RetryBudgetConfig::default().min_per_window)]
    pub retry_budget_min: u32,
    /// Milliseconds of backoff before the first retry (doubled per retry, full jitter).
    #[arg(long, env = "TANDEM_RETRY_BACKOFF_MS", default_value_t = 25)]
    pub retry_backoff_ms: u64,
    /// A worker's circuit breaker opens after this many failures in a row (0: off).
    #[arg(long, env = "TANDEM_BREAKER_FAILURES", default_value_t = BreakerConfig::default().consecutive_failures)]
    pub breaker_failures: u32,
    /// … or when this fraction of its outcomes in the window failed (above 1: off).
    #[arg(long, env = "TANDEM_BREAKER_FAILURE_RATIO", default_value_t = BreakerConfig::default().window_failure_ratio)]
    pub breaker_failure_ratio: f64,
    /// The failure-ratio window, in seconds.
    #[arg(long, env = "TANDEM_BREAKER_WINDOW_S", default_value_t = 30)]
    pub breaker_window_s: u64,
    /// Outcomes in the window before the failure ratio counts.
    #[arg(long, env = "TANDEM_BREAKER_WINDOW_MIN_REQUESTS", default_value_t = BreakerConfig::default().window_min_requests)]
    pub breaker_window_min_requests: u32,
    /// Milliseconds an opened breaker stays open before a probe (doubled on a failed probe).
    #[arg(long, env = "TANDEM_BREAKER_OPEN_MS", default_value_t = BreakerConfig::default().open_ms)]
    pub breaker_open_ms: u64,
    /// The longest open period, in milliseconds.
    #[arg(long, env = "TANDEM_BREAKER_MAX_OPEN_MS", default_value_t = BreakerConfig::default().max_open_ms)]
    pub breaker_max_open_ms: u64,
    /// Hedge requests: one with no first token after the p95 TTFT of its size is started on
    /// a second worker too (within the retry budget); the first to stream wins.
    #[arg(long, env = "TANDEM_HEDGE", default_value_t = false)]
    pub hedge: bool,
    /// The TTFT quantile hedging waits for.
    #[arg(long, env = "TANDEM_HEDGE_QUANTILE", default_value_t = HedgeConfig::default().quantile)]
    pub hedge_quantile: f64,
    /// Never hedge sooner than this many milliseconds.
    #[arg(long, env = "TANDEM_HEDGE_MIN_DELAY_MS", default_value_t = HedgeConfig::default().min_delay_ms)]
    pub hedge_min_delay_ms: u64,
    /// Concurrent requests per session at most (0: no cap): more wait for the session's own
    /// requests to end, up to the queue timeout, then get 429 `session_limit`.
    #[arg(long, env = "TANDEM_SESSION_MAX_CONCURRENT", default_value_t = 0)]
    pub session_max_concurrent: u32,
}

impl FlowArgs {
    /// These flags as a `tandem frontend` process takes them (`tandem up --processes`): every
    /// field (src/up.rs tests).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--request-timeout={}", self.request_timeout),
            format!("--queue-max={}", self.queue_max),
            format!("--queue-timeout={}", self.queue_timeout),
            format!("--queue-starvation-ms={}", self.queue_starvation_ms),
            format!("--queue-starvation-every={}", self.queue_starvation_every),
            format!("--fair-input-weight={}", self.fair_input_weight),
            format!("--fair-output-weight={}", self.fair_output_weight),
            format!("--saturation-kv-fraction={}", self.saturation_kv_fraction),
            format!("--saturation-waiting={}", self.saturation_waiting),
            format!(
                "--saturation-prefill-tokens={}",
                self.saturation_prefill_tokens
            ),
            format!("--saturation-requests={}", self.saturation_requests),
            format!(
                "--saturation-prefill-pool-tokens={}",
                self.saturation_prefill_pool_tokens
            ),
            format!("--max-attempts={}", self.max_attempts),
            format!("--max-migrations={}", self.max_migrations),
            format!("--retry-budget={}", self.retry_budget),
            format!("--retry-budget-min={}", self.retry_budget_min),
            format!("--retry-backoff-ms={}", self.retry_backoff_ms),
            format!("--breaker-failures={}", self.breaker_failures),
            format!("--breaker-failure-ratio={}", self.breaker_failure_ratio),
            format!("--breaker-window-s={}", self.breaker_window_s),
            format!(
                "--breaker-window-min-requests={}",
                self.breaker_window_min_requests
            ),
            format!("--breaker-open-ms={}", self.breaker_open_ms),
            format!("--breaker-max-open-ms={}", self.breaker_max_open_ms),
            format!("--hedge-quantile={}", self.hedge_quantile),
            format!("--hedge-min-delay-ms={}", self.hedge_min_delay_ms),
            format!("--session-max-concurrent={}", self.session_max_concurrent),
        ];
        if let Some(n) = self.tenant_requests_per_minute {
            a.push(format!("--tenant-requests-per-minute={n}"));
        }
        if let Some(n) = self.tenant_tokens_per_minute {
            a.push(format!("--tenant-tokens-per-minute={n}"));
        }
        if self.hedge {
            a.push("--hedge".into());
        }
        a
    }

    /// Sets the frontend's flow control from these flags.
    pub fn apply(&self, cfg: &mut FrontendConfig) -> anyhow::Result<()> {
        let timeout = Duration::try_from_secs_f64(self.request_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .context("--request-timeout must be a number of seconds > 0")?;
        cfg.http.request_timeout = timeout;
        if !(self.queue_timeout.is_finite() && self.queue_timeout >= 0.0) {
            anyhow::bail!("--queue-timeout must be a number of seconds >= 0");
        }
        let flow = FlowConfig {
            max_queued: self.queue_max,
            max_wait_ms: (self.queue_timeout * 1000.0).round() as u64,
            starvation_ms: self.queue_starvation_ms,
            starvation_every: self.queue_starvation_every,
            input_weight: self.fair_input_weight,
            output_weight: self.fair_output_weight,
            limits: TenantLimits {
                requests_per_minute: self.tenant_requests_per_minute,
                tokens_per_minute: self.tenant_tokens_per_minute,
                weight: 1.0,
            },
            ..FlowConfig::default()
        };
        flow.validate().context("flow-control flags")?;
        cfg.backend.flow = flow;
        let off_u64 = |v: u64| (v > 0).then_some(v);
        let saturation = SaturationConfig {
            kv_fraction: (self.saturation_kv_fraction > 0.0).then_some(self.saturation_kv_fraction),
            prefill_tokens: off_u64(self.saturation_prefill_tokens),
            requests: off_u64(self.saturation_requests),
            waiting: (self.saturation_waiting > 0).then_some(self.saturation_waiting),
            prefill_pool_tokens: off_u64(self.saturation_prefill_pool_tokens),
        };
        saturation.validate().context("--saturation-* flags")?;
        cfg.backend.routing.saturation = saturation;
        cfg.backend.session_cap =
            (self.session_max_concurrent > 0).then_some(self.session_max_concurrent);
        cfg.backend.max_attempts = self.max_attempts.max(1);
        cfg.backend.max_migrations = self.max_migrations;
        cfg.backend.routing.retry_budget = RetryBudgetConfig {
            ratio: self.retry_budget,
            min_per_window: self.retry_budget_min,
            ..RetryBudgetConfig::default()
        };
        cfg.backend.retry_backoff = Duration::from_millis(self.retry_backoff_ms);
        cfg.backend.routing.breaker = BreakerConfig {
            consecutive_failures: self.breaker_failures,
            window_ms: self.breaker_window_s.max(1) * 1000,
            window_min_requests: self.breaker_window_min_requests,
            window_failure_ratio: self.breaker_failure_ratio,
            open_ms: self.breaker_open_ms,
            max_open_ms: self.breaker_max_open_ms,
        };
        cfg.backend
            .routing
            .validate()
            .context("retry and breaker flags")?;
        if self.hedge {
            if !(0.0..=1.0).contains(&self.hedge_quantile) {
                anyhow::bail!("--hedge-quantile must be in [0, 1]");
            }
            cfg.backend.hedge = Some(HedgeConfig {
                quantile: self.hedge_quantile,
                min_delay_ms: self.hedge_min_delay_ms,
                ..HedgeConfig::default()
            });
        }
        Ok(())
    }
}
