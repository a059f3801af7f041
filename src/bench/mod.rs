//! `tandem bench`: open-loop load against any OpenAI-compatible endpoint. The workload (a
//! Mooncake trace, or synthetic prompts with shared prefixes, multi-turn sessions, Poisson,
//! gamma or constant arrivals) is the one `tandem sim` runs, so a simulated cluster and a
//! real one can be compared request for request. Every request is sent at its arrival time,
//! whether or not earlier ones have finished (open loop), streamed, and timed.

mod client;
mod report;
mod text;

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use tandem_sim::WorkloadConfig;
use tokio::sync::Semaphore;

use crate::workload_args::{OutputArgs, WorkloadArgs, parse_rates};
use client::{Api, Call, Record};
use report::{BenchReport, BenchSweep, Slo};

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
    #[arg(long, env = "TANDEM_BENCH_API", value_enum, default_value_t = Api::Completions)]
    api: Api,
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

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let base = args.url.trim_end_matches('/').to_string();
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(1024)
        .build()
        .context("building the HTTP client")?;
    check_endpoint(&http, &base, &args.model, args.api_key.as_deref()).await?;
    let slo = Slo {
        ttft_ms: args.slo_ttft_ms,
        tpot_ms: args.slo_tpot_ms,
    };
    if !(slo.ttft_ms > 0.0 && slo.tpot_ms > 0.0) {
        bail!("--slo-ttft-ms and --slo-tpot-ms must be positive");
    }
    let base_cfg = args.workload.config()?;
    let rates = match &args.out.sweep_rate {
        Some(r) => parse_rates(r)?,
        None => vec![offered_rate(&base_cfg)],
    };
    let salt = args.salt.clone().unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        format!("{:08x}", nanos ^ std::process::id())
    });
    let mut points = Vec::new();
    for (k, rate) in rates.iter().enumerate() {
        let cfg = at_rate(&base_cfg, *rate);
        let salt = format!("{salt}-{k}");
        let records = run_once(&args, &http, &base, &cfg, &salt).await?;
        let mut report = BenchReport::new(&base, *rate, slo, records);
        report.salt = salt;
        if report.completed == 0 {
            let why = report.failures.first().map_or("", |(m, _)| m.as_str());
            bail!("no request succeeded at rate {rate}: {why}");
        }
        print!("{}", report.to_markdown());
        points.push(report);
    }
    let sweep = BenchSweep { points };
    if sweep.points.len() > 1 {
        print!("\n{}", sweep.to_markdown());
    }
    if let Some(path) = &args.out.json {
        let json = if sweep.points.len() == 1 {
            serde_json::to_string_pretty(&sweep.points[0])?
        } else {
            serde_json::to_string_pretty(&sweep)?
        };
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.out.plot_dir {
        write_plots(dir, &sweep)?;
    }
    Ok(())
}

/// Fails early, with the reason, when the endpoint cannot be reached or does not serve the
/// model (`GET /v1/models`).
async fn check_endpoint(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    api_key: Option<&str>,
) -> anyhow::Result<()> {
    let mut req = http.get(format!("{base}/v1/models"));
    if let Some(key) = api_key {
        req = req.bearer_auth(key);
    }
    let resp = req
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .with_context(|| format!("cannot reach {base}"))?;
    if !resp.status().is_success() {
        bail!("{base}/v1/models answered HTTP {}", resp.status().as_u16());
    }
    let models: serde_json::Value = resp.json().await.context("/v1/models is not JSON")?;
    let served: Vec<&str> = models["data"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["id"].as_str()).collect())
        .unwrap_or_default();
    if !served.contains(&model) {
        bail!("{base} does not serve model {model:?} (it serves {served:?}): use --model");
    }
    Ok(())
}

/// The rate a workload offers: its request rate, or a trace's arrival speedup.
fn offered_rate(cfg: &WorkloadConfig) -> f64 {
    match cfg {
        WorkloadConfig::Trace(t) => t.arrival_speedup,
        WorkloadConfig::Synthetic(s) => s.rate,
    }
}

fn at_rate(cfg: &WorkloadConfig, rate: f64) -> WorkloadConfig {
    let mut cfg = cfg.clone();
    match &mut cfg {
        WorkloadConfig::Trace(t) => t.arrival_speedup = rate,
        WorkloadConfig::Synthetic(s) => s.rate = rate,
    }
    cfg
}

/// Sends every request of `cfg` at its arrival time; their records.
async fn run_once(
    args: &BenchArgs,
    http: &reqwest::Client,
    base: &str,
    cfg: &WorkloadConfig,
    salt: &str,
) -> anyhow::Result<Vec<Record>> {
    let specs = tandem_sim::build_workload(cfg, args.workload.seed, args.workload.jitter_us()?)?;
    let total = specs.len();
    let limit = Arc::new(Semaphore::new(
        args.max_concurrency
            .unwrap_or(Semaphore::MAX_PERMITS)
            .clamp(1, Semaphore::MAX_PERMITS),
    ));
    let done = Arc::new(AtomicUsize::new(0));
    let progress = (!args.quiet && std::io::stderr().is_terminal())
        .then(|| tokio::spawn(show_progress(done.clone(), total)));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for spec in specs {
        tokio::time::sleep_until((start + Duration::from_micros(spec.arrival_us)).into()).await;
        let permit = limit.clone().acquire_owned().await?;
        let call = Call {
            api: args.api,
            model: args.model.clone(),
            prompt: format!("{salt} {}", text::prompt_text(&spec.prompt.tokens())),
            max_tokens: spec.max_tokens,
            ignore_eos: args.ignore_eos,
        };
        let (http, base, key) = (http.clone(), base.to_string(), args.api_key.clone());
        let (done, timeout) = (done.clone(), Duration::from_secs(args.timeout_s));
        let sent_ms = start.elapsed().as_secs_f64() * 1000.0;
        tasks.spawn(async move {
            let r = client::send(&http, &base, key.as_deref(), &call, sent_ms, timeout).await;
            drop(permit);
            done.fetch_add(1, Ordering::Relaxed);
            r
        });
    }
    let mut records = Vec::with_capacity(total);
    while let Some(r) = tasks.join_next().await {
        records.push(r.context("a request task")?);
    }
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }
    Ok(records)
}

async fn show_progress(done: Arc<AtomicUsize>, total: usize) {
    let start = Instant::now();
    loop {
        let n = done.load(Ordering::Relaxed);
        let width = 30;
        let filled = n * width / total.max(1);
        eprint!(
            "\r[{}{}] {n}/{total} done, {:.0} s",
            "#".repeat(filled),
            " ".repeat(width - filled),
            start.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn write_plots(dir: &std::path::Path, sweep: &BenchSweep) -> anyhow::Result<()> {
    use tandem_sim::svg::{Series, line_chart};
    let cdf = |r: &BenchReport| -> Vec<(f64, f64)> {
        let mut t: Vec<f64> = r.records.iter().filter_map(|x| x.ttft_ms).collect();
        t.sort_by(f64::total_cmp);
        let n = t.len() as f64;
        t.iter()
            .enumerate()
            .map(|(i, &v)| (v, (i + 1) as f64 / n))
            .collect()
    };
    let series: Vec<Series> = sweep
        .points
        .iter()
        .map(|p| (format!("rate {}", p.rate), cdf(p)))
        .collect();
    crate::sim::write_plot(
        dir,
        "ttft_cdf.svg",
        &line_chart("TTFT CDF", "TTFT (ms)", "fraction of requests", &series),
    )?;
    if sweep.points.len() > 1 {
        let goodput: Series = (
            "goodput".into(),
            sweep.points.iter().map(|p| (p.rate, p.goodput)).collect(),
        );
        let throughput: Series = (
            "throughput".into(),
            sweep
                .points
                .iter()
                .map(|p| (p.rate, p.request_throughput))
                .collect(),
        );
        crate::sim::write_plot(
            dir,
            "goodput_vs_rate.svg",
            &line_chart(
                "Goodput under the SLO",
                "offered rate",
                "req/s",
                &[goodput, throughput],
            ),
        )?;
    }
    Ok(())
}
