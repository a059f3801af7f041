//! [`SimConfig`]: everything a run is made from, as plain data, validated once by
//! [`SimConfig::validate`] before anything is built.

use std::path::PathBuf;

use tandem_router::{ReplicaConfig, RouterId, RoutingConfig};

use crate::error::SimError;

/// A whole simulation: workload, topology, routing, event plane, transfer and SLO.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seeds every random draw (workload, policies); same seed, same output.
    pub seed: u64,
    pub workload: WorkloadConfig,
    pub topology: TopologyConfig,
    pub engine: EngineSettings,
    /// How every router replica routes: the frontend's own configuration type (policy of the
    /// aggregated pool, disaggregation rule and thresholds for `prefill_workers > 0`, pool rules,
    /// tracker, whether load reports are merged).
    pub routing: RoutingConfig,
    pub event_plane: EventPlaneConfig,
    pub transfer: TransferConfig,
    pub slo: SloConfig,
    /// How often the requests in flight per (decode) worker are sampled for the
    /// `inflight_imbalance_*` figures (µs).
    pub sample_interval_us: u64,
    /// Each request's arrival is moved later by an offset drawn uniformly from
    /// `[0, arrival_jitter_us)` µs (trace and synthetic workloads alike), in virtual time after
    /// `arrival_speedup` / `rate` are applied. Breaks up the Mooncake trace's 3-second buckets,
    /// whose ~10 requests would otherwise be routed at one instant, before any sync message or
    /// KV event can arrive. 0 (the default): arrivals as generated, no draw made.
    pub arrival_jitter_us: u64,
}

impl SimConfig {
    /// A synthetic workload on `workers` aggregated workers with every other setting at its
    /// default.
    pub fn synthetic(workers: u32, synthetic: SyntheticConfig) -> Self {
        SimConfig {
            seed: 0,
            workload: WorkloadConfig::Synthetic(synthetic),
            topology: TopologyConfig {
                workers,
                prefill_workers: 0,
                routers: 1,
                replica_sync: true,
            },
            engine: EngineSettings::default(),
            routing: RoutingConfig::default(),
            event_plane: EventPlaneConfig::default(),
            transfer: TransferConfig::default(),
            slo: SloConfig::default(),
            sample_interval_us: 1_000_000,
            arrival_jitter_us: 0,
        }
    }

    /// Checks every field; the first problem comes back as [`SimError::InvalidConfig`].
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |what: &str| Err(SimError::InvalidConfig(what.to_owned()));
        let t = &self.topology;
        if t.workers == 0 {
            return bad("--workers must be at least 1");
        }
        if t.routers == 0 {
            return bad("--routers must be at least 1");
        }
        if self.engine.device_blocks == 0 {
            return bad("--device-blocks must be at least 1");
        }
        if self.engine.block_size == 0 {
            return bad("--block-size must be at least 1");
        }
        if !(self.engine.speedup_ratio.is_finite() && self.engine.speedup_ratio > 0.0) {
            return bad("--speedup-ratio must be a positive number");
        }
        if !positive(self.transfer.transfer_gbps) {
            return bad("--transfer-gbps must be a positive number");
        }
        if self.sample_interval_us == 0 {
            return bad("the load sample interval must be positive");
        }
        let s = &self.slo;
        if !(positive(s.ttft_ms) && positive(s.itl_ms)) {
            return bad("--slo-ttft-ms and --slo-itl-ms must be positive numbers");
        }
        if !(s.attainment > 0.0 && s.attainment <= 1.0) {
            return bad("--slo-attainment must be in (0, 1]");
        }
        match &self.workload {
            WorkloadConfig::Trace(tr) => {
                if !positive(tr.arrival_speedup) {
                    return bad("--arrival-speedup must be a positive number");
                }
            }
            WorkloadConfig::Synthetic(sy) => sy.validate()?,
        }
        self.routing
            .policy
            .build()
            .map_err(|e| SimError::InvalidConfig(format!("policy: {e}")))?;
        let f = self.routing.disagg.isl_max_local_fraction;
        if !(f.is_finite() && (0.0..=1.0).contains(&f)) {
            return Err(SimError::InvalidConfig(format!(
                "--isl-max-local-fraction must be a fraction of the prompt in [0, 1], got {f}"
            )));
        }
        self.routing
            .validate()
            .map_err(|e| SimError::InvalidConfig(format!("routing: {e}")))?;
        Ok(())
    }

    /// The configuration of router replica `r`: the same routing for every replica, each
    /// with its own id and seed.
    pub fn replica_config(&self, r: u32) -> ReplicaConfig {
        ReplicaConfig {
            router_id: RouterId(u64::from(r)),
            seed: self.seed ^ 0x524f_5554_4552_0000 ^ u64::from(r),
            routing: self.routing,
        }
    }
}

pub(crate) fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Where requests come from.
#[derive(Clone, Debug)]
pub enum WorkloadConfig {
    Trace(TraceWorkload),
    Synthetic(SyntheticConfig),
}

/// A Mooncake trace replayed (see `shared/traces/README.md`).
#[derive(Clone, Debug)]
pub struct TraceWorkload {
    pub path: PathBuf,
    /// Inter-arrival times are divided by this.
    pub arrival_speedup: f64,
    /// Only the first N requests (None: all).
    pub limit: Option<usize>,
}

/// A generated workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticConfig {
    pub requests: usize,
    /// Mean arrival rate, requests per second.
    pub rate: f64,
    pub arrival: ArrivalProcess,
    /// Prompt length (for multi-turn: the new user text of each turn).
    pub isl: LengthDist,
    pub osl: LengthDist,
    pub shape: PromptShape,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            requests: 1000,
            rate: 10.0,
            arrival: ArrivalProcess::Poisson,
            isl: LengthDist::fixed(1024),
            osl: LengthDist::fixed(128),
            shape: PromptShape::Random,
        }
    }
}

impl SyntheticConfig {
    fn validate(&self) -> Result<(), SimError> {
        let bad = |what: &str| Err(SimError::InvalidConfig(what.to_owned()));
        if self.requests == 0 {
            return bad("--requests must be at least 1");
        }
        if !positive(self.rate) {
            return bad("--rate must be a positive number");
        }
        if let ArrivalProcess::Gamma { shape } = self.arrival
            && !positive(shape)
        {
            return bad("--burstiness (gamma shape) must be a positive number");
        }
        for (name, d) in [("--isl", self.isl), ("--osl", self.osl)] {
            if d.mean == 0 || !(0.0..=1.0).contains(&d.spread) {
                return Err(SimError::InvalidConfig(format!(
                    "{name} must be at least 1 and its spread in [0, 1]"
                )));
            }
        }
        match self.shape {
            PromptShape::SharedPrefix { groups: 0, .. } => {
                bad("--prefix-groups must be at least 1")
            }
            PromptShape::MultiTurn { turns: 0, .. } => bad("--turns must be at least 1"),
            _ => Ok(()),
        }
    }
}

/// Inter-arrival times.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ArrivalProcess {
    /// Exponential gaps.
    Poisson,
    /// Gamma gaps with this shape (< 1: burstier than Poisson; 1: Poisson).
    Gamma { shape: f64 },
    /// Equal gaps.
    Constant,
}

/// A length: `mean`, drawn uniformly from `[mean·(1−spread), mean·(1+spread)]` (at least 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LengthDist {
    pub mean: u32,
    pub spread: f64,
}

impl LengthDist {
    pub const fn fixed(mean: u32) -> Self {
        LengthDist { mean, spread: 0.0 }
    }
}

/// How synthetic prompts relate to each other.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PromptShape {
    /// Every prompt unique.
    Random,
    /// Each request picks one of `groups` shared prefixes of `prefix_len` tokens uniformly,
    /// followed by its own ISL-long suffix.
    SharedPrefix { groups: u32, prefix_len: u32 },
    /// Sessions of `turns` requests; turn k's prompt is the whole conversation so far (earlier
    /// user texts and answers) plus a new ISL-long text, sent `think_time_us` after the
    /// previous turn was sent (open loop). Sessions start at the arrival process's times.
    MultiTurn { turns: u32, think_time_us: u64 },
}

/// Workers and routers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopologyConfig {
    /// Aggregated workers, or decode workers when `prefill_workers > 0`.
    pub workers: u32,
    pub prefill_workers: u32,
    /// Router replicas; request i goes to replica i mod R.
    pub routers: u32,
    /// Replicas share their active-sequence deltas (after the event delay).
    pub replica_sync: bool,
}

/// Every worker's engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineSettings {
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub block_size: u32,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// Divides every mocker step time.
    pub speedup_ratio: f64,
}

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings {
            device_blocks: 16_384,
            host_blocks: 0,
            block_size: 16,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            speedup_ratio: 1.0,
        }
    }
}

/// How KV events and load reports reach the routers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EventPlaneConfig {
    /// Every KV event, load report and sync message arrives this much later (µs).
    pub delay_us: u64,
    /// 0: KV events stream (each step's events sent at once) and no load reports are used.
    /// T > 0: every T each router gets a snapshot (all KV events since its last one and every
    /// worker's load report), after `delay_us`.
    pub snapshot_interval_us: u64,
    /// Snapshot phases spread over the interval (router r at r·T/R) instead of aligned.
    pub snapshot_stagger: bool,
}

/// KV transfer between a prefill and a decode worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransferConfig {
    pub kv_bytes_per_token: u64,
    /// GB/s (10⁹ bytes per second).
    pub transfer_gbps: f64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        // An 8B Llama in fp16: 32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes.
        TransferConfig {
            kv_bytes_per_token: 131_072,
            transfer_gbps: 25.0,
        }
    }
}

/// The service-level objective behind goodput.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SloConfig {
    pub ttft_ms: f64,
    /// Bound on a request's mean inter-token latency (its TPOT).
    pub itl_ms: f64,
    /// A rate meets the SLO when at least this fraction of its requests do (sweeps, capacity).
    pub attainment: f64,
}

impl Default for SloConfig {
    fn default() -> Self {
        SloConfig {
            ttft_ms: 2000.0,
            itl_ms: 25.0,
            attainment: 0.9,
        }
    }
}
