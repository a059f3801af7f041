//! The workload flags `tandem sim` and `tandem bench` share (a Mooncake trace, or a synthetic
//! workload: prompt shape, lengths, arrivals), and their output flags (rate sweeps, JSON,
//! plots). They fill `tandem-workload`'s types, which both commands' libraries take.

use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, ValueEnum};
use tandem_workload::{
    AdapterMix, ArrivalProcess, LengthDist, PromptShape, SyntheticConfig, TraceWorkload,
    WorkloadConfig,
};

/// What requests to make, and when.
#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// Replay this Mooncake trace (JSONL) instead of a synthetic workload.
    #[arg(long, env = "TANDEM_WORKLOAD_TRACE")]
    pub trace: Option<PathBuf>,
    /// Trace: divide inter-arrival times by this.
    #[arg(long, env = "TANDEM_WORKLOAD_ARRIVAL_SPEEDUP", default_value_t = 1.0)]
    pub arrival_speedup: f64,
    /// Trace: only the first N requests.
    #[arg(long, env = "TANDEM_WORKLOAD_LIMIT")]
    pub limit: Option<usize>,
    /// Move each arrival later by a seeded offset uniform in [0, J) ms (µs resolution), so
    /// requests sharing a trace timestamp no longer reach the routers at one instant. Applies
    /// to synthetic workloads too. 0: arrivals as generated.
    #[arg(long, env = "TANDEM_WORKLOAD_ARRIVAL_JITTER_MS", default_value_t = 0.0)]
    pub arrival_jitter_ms: f64,
    /// Synthetic prompt shape.
    #[arg(long, env = "TANDEM_WORKLOAD_WORKLOAD", value_enum, default_value_t = Shape::Random)]
    pub workload: Shape,
    /// Synthetic: number of requests.
    #[arg(long, env = "TANDEM_WORKLOAD_REQUESTS", default_value_t = 1000)]
    pub requests: usize,
    /// Synthetic: mean arrival rate, requests per second.
    #[arg(long, env = "TANDEM_WORKLOAD_RATE", default_value_t = 10.0)]
    pub rate: f64,
    /// Synthetic: arrival process.
    #[arg(long, env = "TANDEM_WORKLOAD_ARRIVAL", value_enum, default_value_t = Arrival::Poisson)]
    pub arrival: Arrival,
    /// Gamma arrivals: shape k (< 1 burstier than Poisson; CV = 1/sqrt(k)).
    #[arg(long, env = "TANDEM_WORKLOAD_BURSTINESS", default_value_t = 0.5)]
    pub burstiness: f64,
    /// Synthetic: input tokens (multi-turn: new tokens per turn), mean.
    #[arg(long, env = "TANDEM_WORKLOAD_ISL", default_value_t = 1024)]
    pub isl: u32,
    /// Input length drawn uniformly within ±this fraction of the mean (0: fixed).
    #[arg(long, env = "TANDEM_WORKLOAD_ISL_SPREAD", default_value_t = 0.0)]
    pub isl_spread: f64,
    /// Synthetic: output tokens, mean.
    #[arg(long, env = "TANDEM_WORKLOAD_OSL", default_value_t = 128)]
    pub osl: u32,
    /// Output length drawn uniformly within ±this fraction of the mean (0: fixed).
    #[arg(long, env = "TANDEM_WORKLOAD_OSL_SPREAD", default_value_t = 0.0)]
    pub osl_spread: f64,
    /// Shared-prefix: number of prefix groups.
    #[arg(long, env = "TANDEM_WORKLOAD_PREFIX_GROUPS", default_value_t = 8)]
    pub prefix_groups: u32,
    /// Shared-prefix: prefix tokens (the suffix is --isl long).
    #[arg(long, env = "TANDEM_WORKLOAD_PREFIX_LEN", default_value_t = 2048)]
    pub prefix_len: u32,
    /// Multi-turn: turns per session.
    #[arg(long, env = "TANDEM_WORKLOAD_TURNS", default_value_t = 4)]
    pub turns: u32,
    /// Multi-turn: time between two turns of a session.
    #[arg(
        long,
        env = "TANDEM_WORKLOAD_THINK_TIME_MS",
        default_value_t = 10_000.0
    )]
    pub think_time_ms: f64,
    /// Synthetic: LoRA adapters the requests run on (`lora-0` … `lora-{N-1}`, Zipf-drawn,
    /// one per session); 0: the base model only.
    #[arg(long, env = "TANDEM_WORKLOAD_ADAPTERS", default_value_t = 0)]
    pub adapters: u32,
    /// Synthetic: Zipf exponent of adapter popularity (0: uniform).
    #[arg(long, env = "TANDEM_WORKLOAD_ADAPTER_SKEW", default_value_t = 1.0)]
    pub adapter_skew: f64,
    /// Seed of every random draw.
    #[arg(long, env = "TANDEM_WORKLOAD_SEED", default_value_t = 0)]
    pub seed: u64,
}

/// Rate sweeps and outputs.
#[derive(Args, Debug, Clone)]
pub struct OutputArgs {
    /// Run at each of these rates (req/s, or arrival speedups with --trace): `a,b,c` or
    /// `start:end:step`.
    #[arg(long, env = "TANDEM_SWEEP_RATE")]
    pub sweep_rate: Option<String>,
    /// Write the report as JSON here.
    #[arg(long, env = "TANDEM_JSON")]
    pub json: Option<PathBuf>,
    /// Write SVG plots (TTFT CDF; goodput vs rate when sweeping) into this directory.
    #[arg(long, env = "TANDEM_PLOT_DIR")]
    pub plot_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Shape {
    Random,
    SharedPrefix,
    MultiTurn,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Arrival {
    Poisson,
    Gamma,
    Constant,
}

pub fn ms_to_us(name: &str, ms: f64) -> anyhow::Result<u64> {
    if !(ms.is_finite() && ms >= 0.0) {
        bail!("{name} must be a non-negative number of milliseconds");
    }
    Ok((ms * 1000.0).round() as u64)
}

impl WorkloadArgs {
    /// The workload these flags describe.
    pub fn config(&self) -> anyhow::Result<WorkloadConfig> {
        Ok(match &self.trace {
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
                adapters: AdapterMix {
                    count: self.adapters,
                    skew: self.adapter_skew,
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
        })
    }

    /// `--arrival-jitter-ms` in µs.
    pub fn jitter_us(&self) -> anyhow::Result<u64> {
        ms_to_us("--arrival-jitter-ms", self.arrival_jitter_ms)
    }
}
