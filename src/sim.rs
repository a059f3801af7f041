//! `tandem sim`: flags → [`SimConfig`], then `tandem_sim::run` (or `sweep`) and the outputs.

use clap::{ArgAction, Args};
use tandem_sim::{
    EngineSettings, EventPlaneConfig, SimConfig, Slo, TopologyConfig, TransferConfig,
};
use tandem_workload::plot::write_json;

use tandem_workload::parse_rates;

use crate::args::workload::ms_to_us;

#[derive(Args, Debug)]
pub struct SimArgs {
    #[command(flatten)]
    workload: crate::args::workload::WorkloadArgs,
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
    routing: crate::args::routing::RoutingArgs,
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
    /// LoRA adapter slots per worker (vLLM's `--max-loras`); 0: not limited, no load modelled.
    #[arg(long, env = "TANDEM_SIM_MAX_LORAS", default_value_t = 0)]
    max_loras: usize,
    /// Time a step spends loading an adapter it does not hold.
    #[arg(long, env = "TANDEM_SIM_ADAPTER_LOAD_MS", default_value_t = 20.0)]
    adapter_load_ms: f64,
    /// Per-worker speed factors, cycled over the workers (decode first, then prefill): e.g.
    /// `1,2` makes every other worker twice as fast.
    #[arg(long, env = "TANDEM_SIM_WORKER_SPEEDUPS", value_delimiter = ',')]
    worker_speedups: Vec<f64>,
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
    /// Prefill → decode bandwidth, GB/s (within a rack when --racks is set).
    #[arg(long, env = "TANDEM_SIM_TRANSFER_GBPS", default_value_t = 25.0)]
    transfer_gbps: f64,
    /// Prefill → decode bandwidth between racks, GB/s.
    #[arg(long, env = "TANDEM_SIM_CROSS_RACK_GBPS", default_value_t = 12.5)]
    cross_rack_gbps: f64,
    /// Spread the workers over this many racks (worker w in rack w mod N, each its own host),
    /// registered as their placements (0: none).
    #[arg(long, env = "TANDEM_SIM_RACKS", default_value_t = 0)]
    racks: u32,
    /// SLO: time to first token.
    #[arg(long, env = "TANDEM_SIM_SLO_TTFT_MS", default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    /// SLO: a request's mean inter-token latency (its TPOT; `--slo-tpot-ms` as in `tandem
    /// bench`).
    #[arg(
        long,
        visible_alias = "slo-tpot-ms",
        env = "TANDEM_SIM_SLO_ITL_MS",
        default_value_t = 25.0
    )]
    slo_itl_ms: f64,
    /// A rate meets the SLO when this fraction of requests do.
    #[arg(long, env = "TANDEM_SIM_SLO_ATTAINMENT", default_value_t = 0.9)]
    slo_attainment: f64,
    /// Interval of the in-flight load-imbalance samples (`inflight_imbalance_*`).
    #[arg(long, env = "TANDEM_SIM_SAMPLE_INTERVAL_MS", default_value_t = 1000.0)]
    sample_interval_ms: f64,
    /// A groups file (README "Backend groups") whose `[experiment]` splits the requests
    /// between two arms as the frontend would (by session, else by the prompt's start): the
    /// report gives each arm's TTFT, hit rate and goodput side by side.
    #[arg(long, env = "TANDEM_SIM_EXPERIMENT")]
    experiment: Option<std::path::PathBuf>,
    /// A model cascade: this share of the requests (0–1) is escalated from the simulated
    /// cluster (the small model's pool) to a large model's pool, arriving there when the
    /// small model's answer is done; the report gives both pools and the burstiness of
    /// what each is sent.
    #[arg(long, env = "TANDEM_SIM_CASCADE_ESCALATION_RATE")]
    cascade_escalation_rate: Option<f64>,
    /// How much a prompt's length decides whether it escalates (0: at random; 1: the longest
    /// prompts): escalations are the harder requests.
    #[arg(long, env = "TANDEM_SIM_CASCADE_CORRELATION", default_value_t = 0.7)]
    cascade_correlation: f64,
    /// Workers of the large model's pool (default: --workers).
    #[arg(long, env = "TANDEM_SIM_CASCADE_LARGE_WORKERS")]
    cascade_large_workers: Option<u32>,
    /// The large model's engine speed relative to the small one's.
    #[arg(long, env = "TANDEM_SIM_CASCADE_LARGE_SPEED", default_value_t = 0.5)]
    cascade_large_speed: f64,
    #[command(flatten)]
    pub(crate) out: crate::args::workload::OutputArgs,
}

/// The `[experiment]` table of a groups file.
fn experiment_of(path: &std::path::Path) -> anyhow::Result<tandem_sim::ExperimentConfig> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--experiment: reading {}", path.display()))?;
    let mut table: toml::Table = toml::from_str(&text)
        .with_context(|| format!("--experiment: {} is not TOML", path.display()))?;
    let experiment = table
        .remove("experiment")
        .with_context(|| format!("--experiment: {} has no [experiment]", path.display()))?;
    experiment
        .try_into()
        .with_context(|| format!("--experiment: {}: [experiment]", path.display()))
}

impl SimArgs {
    /// The model cascade the `--cascade-*` flags describe, if `--cascade-escalation-rate` is
    /// set.
    pub(crate) fn cascade(&self) -> Option<tandem_sim::CascadeConfig> {
        Some(tandem_sim::CascadeConfig {
            escalation_rate: self.cascade_escalation_rate?,
            correlation: self.cascade_correlation,
            large_workers: self.cascade_large_workers.unwrap_or(self.workers),
            large_speed: self.cascade_large_speed,
        })
    }

    pub(crate) fn config(&self) -> anyhow::Result<SimConfig> {
        let workload = self.workload.config()?;
        let routing = self.routing.config()?;
        Ok(SimConfig {
            seed: self.workload.seed,
            workload,
            topology: TopologyConfig {
                workers: self.workers,
                prefill_workers: self.prefill_workers,
                routers: self.routers,
                replica_sync: self.replica_sync,
                racks: self.racks,
            },
            engine: EngineSettings {
                device_blocks: self.device_blocks,
                host_blocks: self.host_blocks,
                block_size: self.block_size,
                max_num_batched_tokens: self.max_batched_tokens,
                max_num_seqs: self.max_num_seqs,
                speedup_ratio: self.speedup_ratio,
                max_loras: self.max_loras,
                adapter_load_ms: self.adapter_load_ms,
            },
            routing,
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
                cross_rack_gbps: self.cross_rack_gbps,
            },
            slo: Slo {
                ttft_ms: self.slo_ttft_ms,
                tpot_ms: self.slo_itl_ms,
                attainment: self.slo_attainment,
            },
            sample_interval_us: ms_to_us("--sample-interval-ms", self.sample_interval_ms)?,
            arrival_jitter_us: self.workload.jitter_us()?,
            worker_speedups: self.worker_speedups.clone(),
            experiment: self.experiment.as_deref().map(experiment_of).transpose()?,
        })
    }
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let (json, plots) = (&args.out.json, &args.out.plot_dir);
    if let Some(rates) = &args.out.sweep_rate {
        let sweep = tandem_sim::sweep(&config, &parse_rates(rates)?)?;
        print!("{}", sweep.to_markdown());
        json.as_ref().map(|p| write_json(p, &sweep)).transpose()?;
        plots
            .as_ref()
            .map(|d| sweep.figures().write(d))
            .transpose()?;
        return Ok(());
    }
    if let Some(cascade) = args.cascade() {
        let report = tandem_sim::run_cascade(config, &cascade)?;
        print!("{}", report.to_markdown());
        json.as_ref().map(|p| write_json(p, &report)).transpose()?;
        return Ok(());
    }
    let report = tandem_sim::run(config)?;
    print!("{}", report.to_markdown());
    json.as_ref().map(|p| write_json(p, &report)).transpose()?;
    plots
        .as_ref()
        .map(|d| report.figures().write(d))
        .transpose()?;
    Ok(())
}
