//! `tandem sim`: flags → [`SimConfig`], then `tandem_sim::run` (or `sweep`) and the outputs.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{ArgAction, Args, ValueEnum};
use tandem_sim::{
    ArrivalProcess, EngineSettings, EventPlaneConfig, LengthDist, PromptShape, SimConfig,
    SloConfig, SyntheticConfig, TopologyConfig, TraceWorkload, TransferConfig, WorkloadConfig,
};

#[derive(Args, Debug)]
pub struct SimArgs {
    /// Replay this Mooncake trace (JSONL) instead of a synthetic workload.
    #[arg(long, env = "TANDEM_SIM_TRACE")]
    trace: Option<PathBuf>,
    /// Trace: divide inter-arrival times by this.
    #[arg(long, env = "TANDEM_SIM_ARRIVAL_SPEEDUP", default_value_t = 1.0)]
    arrival_speedup: f64,
    /// Trace: only the first N requests.
    #[arg(long, env = "TANDEM_SIM_LIMIT")]
    limit: Option<usize>,
    /// Move each arrival later by a seeded offset uniform in [0, J) ms (µs resolution), so
    /// requests sharing a trace timestamp no longer reach the routers at one instant. Applies
    /// to synthetic workloads too. 0: arrivals as generated.
    #[arg(long, env = "TANDEM_SIM_ARRIVAL_JITTER_MS", default_value_t = 0.0)]
    arrival_jitter_ms: f64,
    /// Synthetic prompt shape.
    #[arg(long, env = "TANDEM_SIM_WORKLOAD", value_enum, default_value_t = Shape::Random)]
    workload: Shape,
    /// Synthetic: number of requests.
    #[arg(long, env = "TANDEM_SIM_REQUESTS", default_value_t = 1000)]
    requests: usize,
    /// Synthetic: mean arrival rate, requests per second.
    #[arg(long, env = "TANDEM_SIM_RATE", default_value_t = 10.0)]
    rate: f64,
    /// Synthetic: arrival process.
    #[arg(long, env = "TANDEM_SIM_ARRIVAL", value_enum, default_value_t = Arrival::Poisson)]
    arrival: Arrival,
    /// Gamma arrivals: shape k (< 1 burstier than Poisson; CV = 1/sqrt(k)).
    #[arg(long, env = "TANDEM_SIM_BURSTINESS", default_value_t = 0.5)]
    burstiness: f64,
    /// Synthetic: input tokens (multi-turn: new tokens per turn), mean.
    #[arg(long, env = "TANDEM_SIM_ISL", default_value_t = 1024)]
    isl: u32,
    /// Input length drawn uniformly within ±this fraction of the mean (0: fixed).
    #[arg(long, env = "TANDEM_SIM_ISL_SPREAD", default_value_t = 0.0)]
    isl_spread: f64,
    /// Synthetic: output tokens, mean.
    #[arg(long, env = "TANDEM_SIM_OSL", default_value_t = 128)]
    osl: u32,
    /// Output length drawn uniformly within ±this fraction of the mean (0: fixed).
    #[arg(long, env = "TANDEM_SIM_OSL_SPREAD", default_value_t = 0.0)]
    osl_spread: f64,
    /// Shared-prefix: number of prefix groups.
    #[arg(long, env = "TANDEM_SIM_PREFIX_GROUPS", default_value_t = 8)]
    prefix_groups: u32,
    /// Shared-prefix: prefix tokens (the suffix is --isl long).
    #[arg(long, env = "TANDEM_SIM_PREFIX_LEN", default_value_t = 2048)]
    prefix_len: u32,
    /// Multi-turn: turns per session.
    #[arg(long, env = "TANDEM_SIM_TURNS", default_value_t = 4)]
    turns: u32,
    /// Multi-turn: time between two turns of a session.
    #[arg(long, env = "TANDEM_SIM_THINK_TIME_MS", default_value_t = 10_000.0)]
    think_time_ms: f64,
    /// Aggregated workers, or decode workers with --prefill-workers.
    #[arg(long, env = "TANDEM_SIM_WORKERS", default_value_t = 8)]
    workers: u32,
    /// Prefill workers (0: aggregated topology).
    #[arg(long, env = "TANDEM_SIM_PREFILL_WORKERS", default_value_t = 0)]
    prefill_workers: u32,
    /// Router replicas; requests are assigned round-robin.
    #[arg(long, env = "TANDEM_SIM_ROUTERS", default_value_t = 1)]
    routers: u32,
    /// Replicas share active-sequence deltas (`--replica-sync false` to turn off).
    #[arg(long, env = "TANDEM_SIM_REPLICA_SYNC", default_value_t = true, action = ArgAction::Set)]
    replica_sync: bool,
    #[command(flatten)]
    routing: crate::serve::RoutingArgs,
    /// Device KV blocks per worker.
    #[arg(long, env = "TANDEM_SIM_DEVICE_BLOCKS", default_value_t = 16_384)]
    device_blocks: u32,
    /// Host KV blocks per worker (0: none).
    #[arg(long, env = "TANDEM_SIM_HOST_BLOCKS", default_value_t = 0)]
    host_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, env = "TANDEM_SIM_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// Tokens per engine step.
    #[arg(long, env = "TANDEM_SIM_MAX_BATCHED_TOKENS", default_value_t = 8192)]
    max_batched_tokens: usize,
    /// Running requests per engine at most.
    #[arg(long, env = "TANDEM_SIM_MAX_NUM_SEQS", default_value_t = 256)]
    max_num_seqs: usize,
    /// Divide every mocker step time by this.
    #[arg(long, env = "TANDEM_SIM_SPEEDUP_RATIO", default_value_t = 1.0)]
    speedup_ratio: f64,
    /// KV events, load reports and sync messages reach routers this much later.
    #[arg(long, env = "TANDEM_SIM_EVENT_DELAY_MS", default_value_t = 0.0)]
    event_delay_ms: f64,
    /// Routers get KV state and load reports only as snapshots every T ms (0: streamed).
    #[arg(long, env = "TANDEM_SIM_SNAPSHOT_INTERVAL_MS", default_value_t = 0.0)]
    snapshot_interval_ms: f64,
    /// Spread the routers' snapshot phases over the interval.
    #[arg(long, env = "TANDEM_SIM_SNAPSHOT_STAGGER")]
    snapshot_stagger: bool,
    /// KV bytes per token moved by a remote prefill (default: 8B model, fp16).
    #[arg(long, env = "TANDEM_SIM_KV_BYTES_PER_TOKEN", default_value_t = 131_072)]
    kv_bytes_per_token: u64,
    /// Prefill → decode bandwidth, GB/s.
    #[arg(long, env = "TANDEM_SIM_TRANSFER_GBPS", default_value_t = 25.0)]
    transfer_gbps: f64,
    /// SLO: time to first token.
    #[arg(long, env = "TANDEM_SIM_SLO_TTFT_MS", default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    /// SLO: a request's mean inter-token latency.
    #[arg(long, env = "TANDEM_SIM_SLO_ITL_MS", default_value_t = 25.0)]
    slo_itl_ms: f64,
    /// A rate meets the SLO when this fraction of requests do.
    #[arg(long, env = "TANDEM_SIM_SLO_ATTAINMENT", default_value_t = 0.9)]
    slo_attainment: f64,
    /// Interval of the in-flight load-imbalance samples (`inflight_imbalance_*`).
    #[arg(long, env = "TANDEM_SIM_SAMPLE_INTERVAL_MS", default_value_t = 1000.0)]
    sample_interval_ms: f64,
    /// Seed of every random draw.
    #[arg(long, env = "TANDEM_SIM_SEED", default_value_t = 0)]
    seed: u64,
    /// Run at each of these rates (req/s, or arrival speedups with --trace): `a,b,c` or
    /// `start:end:step`.
    #[arg(long, env = "TANDEM_SIM_SWEEP_RATE")]
    sweep_rate: Option<String>,
    /// Write the report as JSON here.
    #[arg(long, env = "TANDEM_SIM_JSON")]
    json: Option<PathBuf>,
    /// Write SVG plots (TTFT CDF; goodput vs rate when sweeping) into this directory.
    #[arg(long, env = "TANDEM_SIM_PLOT_DIR")]
    plot_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Shape {
    Random,
    SharedPrefix,
    MultiTurn,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Arrival {
    Poisson,
    Gamma,
    Constant,
}

fn ms_to_us(name: &str, ms: f64) -> anyhow::Result<u64> {
    if !(ms.is_finite() && ms >= 0.0) {
        bail!("{name} must be a non-negative number of milliseconds");
    }
    Ok((ms * 1000.0).round() as u64)
}

/// `a,b,c` or `start:end:step` (inclusive).
fn parse_rates(s: &str) -> anyhow::Result<Vec<f64>> {
    let num = |x: &str| -> anyhow::Result<f64> {
        let v: f64 = x
            .trim()
            .parse()
            .with_context(|| format!("--sweep-rate: {x:?}"))?;
        if !(v.is_finite() && v > 0.0) {
            bail!("--sweep-rate: rates must be positive, got {v}");
        }
        Ok(v)
    };
    let parts: Vec<&str> = s.split(':').collect();
    if let [a, b, step] = parts[..] {
        let (a, b, step) = (num(a)?, num(b)?, num(step)?);
        if b < a || (b - a) / step > 1000.0 {
            bail!("--sweep-rate start:end:step needs start ≤ end and at most 1000 steps");
        }
        let n = ((b - a) / step + 1e-9).floor() as usize;
        return Ok((0..=n).map(|k| a + step * k as f64).collect());
    }
    if parts.len() != 1 {
        bail!("--sweep-rate is `a,b,c` or `start:end:step`");
    }
    s.split(',').map(num).collect()
}

impl SimArgs {
    fn config(&self) -> anyhow::Result<SimConfig> {
        let workload = match &self.trace {
            Some(path) => WorkloadConfig::Trace(TraceWorkload {
                path: path.clone(),
                arrival_speedup: self.arrival_speedup,
                limit: self.limit,
            }),
            None => WorkloadConfig::Synthetic(SyntheticConfig {
                requests: self.requests,
                rate: self.rate,
                arrival: match self.arrival {
                    Arrival::Poisson => ArrivalProcess::Poisson,
                    Arrival::Gamma => ArrivalProcess::Gamma {
                        shape: self.burstiness,
                    },
                    Arrival::Constant => ArrivalProcess::Constant,
                },
                isl: LengthDist {
                    mean: self.isl,
                    spread: self.isl_spread,
                },
                osl: LengthDist {
                    mean: self.osl,
                    spread: self.osl_spread,
                },
                shape: match self.workload {
                    Shape::Random => PromptShape::Random,
                    Shape::SharedPrefix => PromptShape::SharedPrefix {
                        groups: self.prefix_groups,
                        prefix_len: self.prefix_len,
                    },
                    Shape::MultiTurn => PromptShape::MultiTurn {
                        turns: self.turns,
                        think_time_us: ms_to_us("--think-time-ms", self.think_time_ms)?,
                    },
                },
            }),
        };
        let (router, disagg) = self.routing.configs()?;
        let policy = router.policy;
        Ok(SimConfig {
            seed: self.seed,
            workload,
            topology: TopologyConfig {
                workers: self.workers,
                prefill_workers: self.prefill_workers,
                routers: self.routers,
                replica_sync: self.replica_sync,
            },
            engine: EngineSettings {
                device_blocks: self.device_blocks,
                host_blocks: self.host_blocks,
                block_size: self.block_size,
                max_num_batched_tokens: self.max_batched_tokens,
                max_num_seqs: self.max_num_seqs,
                speedup_ratio: self.speedup_ratio,
            },
            policy,
            disagg,
            event_plane: EventPlaneConfig {
                delay_us: ms_to_us("--event-delay-ms", self.event_delay_ms)?,
                snapshot_interval_us: ms_to_us(
                    "--snapshot-interval-ms",
                    self.snapshot_interval_ms,
                )?,
                snapshot_stagger: self.snapshot_stagger,
            },
            transfer: TransferConfig {
                kv_bytes_per_token: self.kv_bytes_per_token,
                transfer_gbps: self.transfer_gbps,
            },
            slo: SloConfig {
                ttft_ms: self.slo_ttft_ms,
                itl_ms: self.slo_itl_ms,
                attainment: self.slo_attainment,
            },
            sample_interval_us: ms_to_us("--sample-interval-ms", self.sample_interval_ms)?,
            arrival_jitter_us: ms_to_us("--arrival-jitter-ms", self.arrival_jitter_ms)?,
        })
    }
}

fn write_plot(dir: &std::path::Path, name: &str, svg: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(name);
    std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    if let Some(rates) = &args.sweep_rate {
        let rates = parse_rates(rates)?;
        let sweep = tandem_sim::sweep(&config, &rates)?;
        print!("{}", sweep.to_markdown());
        if let Some(path) = &args.json {
            tandem_sim::write_json(path, &sweep)?;
        }
        if let Some(dir) = &args.plot_dir {
            write_plot(
                dir,
                "goodput_vs_rate.svg",
                &tandem_sim::svg::goodput_curve(&sweep),
            )?;
            let labels: Vec<String> = sweep.points.iter().map(|p| format!("{}", p.rate)).collect();
            let runs: Vec<(&str, &tandem_sim::SimReport)> = labels
                .iter()
                .zip(&sweep.points)
                .map(|(l, p)| (l.as_str(), &p.report))
                .collect();
            write_plot(dir, "ttft_cdf.svg", &tandem_sim::svg::ttft_cdf(&runs))?;
        }
        return Ok(());
    }
    let report = tandem_sim::run(config)?;
    print!("{}", report.to_markdown());
    if let Some(path) = &args.json {
        tandem_sim::write_json(path, &report)?;
    }
    if let Some(dir) = &args.plot_dir {
        let svg = tandem_sim::svg::ttft_cdf(&[(report.policy.as_str(), &report)]);
        write_plot(dir, "ttft_cdf.svg", &svg)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_rates;

    #[test]
    fn rates_parse_as_lists_and_ranges() {
        assert_eq!(parse_rates("1,2.5,4").unwrap(), [1.0, 2.5, 4.0]);
        assert_eq!(parse_rates("2:4:1").unwrap(), [2.0, 3.0, 4.0]);
        assert!(parse_rates("1,-2").is_err());
        assert!(parse_rates("4:2:1").is_err());
        assert!(parse_rates("1:2").is_err());
    }
}
