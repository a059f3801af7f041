//! `tandem bench`: flags → [`tandem_bench::BenchConfig`], then [`tandem_bench::run_with`] and
//! the outputs (each rate's table as it ends, the sweep's table, JSON, SVG plots).

use clap::{Args, ValueEnum};
use tandem_bench::{Api, BenchConfig, Slo};
use tandem_workload::plot::write_json;

use tandem_workload::parse_rates;

use crate::args::workload::{OutputArgs, WorkloadArgs};

/// Which API the prompts go to (`tandem_bench::Api`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ApiArg {
    /// `/v1/completions` with the prompt as text: exact prefixes.
    Completions,
    /// `/v1/chat/completions` with the prompt as one user message (the endpoint's chat
    /// template goes around it).
    Chat,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Base URL of the endpoint (its `/v1/...` paths are appended).
    #[arg(
        long,
        env = "TANDEM_BENCH_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    url: String,
    /// Model name sent with every request (must be one the endpoint lists).
    #[arg(long, env = "TANDEM_BENCH_MODEL", default_value = "mocker")]
    model: String,
    /// Which API the prompts go to.
    #[arg(long, env = "TANDEM_BENCH_API", value_enum, default_value_t = ApiArg::Completions)]
    api: ApiArg,
    /// Bearer token for the endpoint, if it wants one.
    #[arg(long, env = "TANDEM_BENCH_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Ask for exactly the workload's output lengths (`ignore_eos`; `--ignore-eos false` for
    /// endpoints that refuse the field).
    #[arg(long, env = "TANDEM_BENCH_IGNORE_EOS", default_value_t = true, action = clap::ArgAction::Set)]
    ignore_eos: bool,
    /// At most this many requests in flight; later arrivals wait (then the load is no
    /// longer open-loop). Default: unbounded.
    #[arg(long, env = "TANDEM_BENCH_MAX_CONCURRENCY")]
    max_concurrency: Option<usize>,
    /// Per-request deadline.
    #[arg(long, env = "TANDEM_BENCH_TIMEOUT_S", default_value_t = 600)]
    timeout_s: u64,
    /// SLO: time to first token.
    #[arg(long, env = "TANDEM_BENCH_SLO_TTFT_MS", default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    /// SLO: mean time per output token after the first.
    #[arg(long, env = "TANDEM_BENCH_SLO_TPOT_MS", default_value_t = 25.0)]
    slo_tpot_ms: f64,
    /// A rate meets the SLO when this fraction of requests do (the report's `meets_slo`).
    #[arg(long, env = "TANDEM_BENCH_SLO_ATTAINMENT", default_value_t = 0.9)]
    slo_attainment: f64,
    /// Every prompt of a run starts with `<salt>-<sweep point>`, so that runs and sweep
    /// points do not hit the endpoint's prefix cache with each other's prompts (prompts of one
    /// run still share what the workload shares). Default: random per invocation.
    #[arg(long, env = "TANDEM_BENCH_SALT")]
    salt: Option<String>,
    /// No progress line on stderr.
    #[arg(long, env = "TANDEM_BENCH_QUIET")]
    quiet: bool,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    out: OutputArgs,
}

impl BenchArgs {
    fn config(&self) -> anyhow::Result<BenchConfig> {
        Ok(BenchConfig {
            url: self.url.clone(),
            model: self.model.clone(),
            api: match self.api {
                ApiArg::Completions => Api::Completions,
                ApiArg::Chat => Api::Chat,
            },
            api_key: self.api_key.clone(),
            ignore_eos: self.ignore_eos,
            max_concurrency: self.max_concurrency,
            timeout: std::time::Duration::from_secs(self.timeout_s),
            slo: Slo {
                ttft_ms: self.slo_ttft_ms,
                tpot_ms: self.slo_tpot_ms,
                attainment: self.slo_attainment,
            },
            workload: self.workload.config()?,
            seed: self.workload.seed,
            arrival_jitter_us: self.workload.jitter_us()?,
            rates: match &self.out.sweep_rate {
                Some(r) => parse_rates(r)?,
                None => Vec::new(),
            },
            salt: self.salt.clone(),
            progress: !self.quiet,
        })
    }
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let sweep = tandem_bench::run_with(&config, |r| print!("{}", r.to_markdown())).await?;
    if sweep.points.len() > 1 {
        print!("\n{}", sweep.to_markdown());
    }
    if let Some(path) = &args.out.json {
        match sweep.points.as_slice() {
            [one] => write_json(path, one)?,
            _ => write_json(path, &sweep)?,
        }
    }
    if let Some(dir) = &args.out.plot_dir {
        sweep.figures().write(dir)?;
    }
    Ok(())
}
