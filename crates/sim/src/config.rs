//! [`SimConfig`]: everything a run is made from, as plain data, validated once by
//! [`SimConfig::validate`] before anything is built. The workload and the SLO are
//! `tandem-workload`'s types, validated by that crate.

use tandem_router::groups::ExperimentConfig;
use tandem_router::{ReplicaConfig, RouterId, RoutingConfig};
use tandem_workload::{Slo, SyntheticConfig, WorkloadConfig};

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
    pub slo: Slo,
    /// How often the requests in flight per (decode) worker are sampled for the
    /// `inflight_imbalance_*` figures (µs).
    pub sample_interval_us: u64,
    /// Each request's arrival is moved later by an offset drawn uniformly from
    /// `[0, arrival_jitter_us)` µs (trace and synthetic workloads alike), in virtual time after
    /// `arrival_speedup` / `rate` are applied. Breaks up the Mooncake trace's 3-second buckets,
    /// whose ~10 requests would otherwise be routed at one instant, before any sync message or
    /// KV event can arrive. 0 (the default): arrivals as generated, no draw made.
    pub arrival_jitter_us: u64,
    /// Per-worker speed factors (on top of [`EngineSettings::speedup_ratio`]): worker `w` runs
    /// `worker_speedups[w % len]` times as fast. Empty: every worker alike. For unequal
    /// clusters (capacity weights).
    pub worker_speedups: Vec<f64>,
    /// An A/B experiment (the groups file's `[experiment]`): every request is placed in an
    /// arm by its session (else its prompt's start) as the frontend places it, and the arm's
    /// knobs override the `kv` policy's for it; the report gives each arm's figures. `None`:
    /// no split.
    pub experiment: Option<ExperimentConfig>,
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
                racks: 0,
            },
            engine: EngineSettings::default(),
            routing: RoutingConfig::default(),
            event_plane: EventPlaneConfig::default(),
            transfer: TransferConfig::default(),
            slo: Slo::default(),
            sample_interval_us: 1_000_000,
            arrival_jitter_us: 0,
            worker_speedups: Vec::new(),
            experiment: None,
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
        if let Some(e) = &self.experiment
            && let Err(why) = e.check()
        {
            return bad(&format!("experiment: {why}"));
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
        if !positive(self.transfer.cross_rack_gbps) {
            return bad("--cross-rack-gbps must be > 0");
        }
        if !positive(self.transfer.transfer_gbps) {
            return bad("--transfer-gbps must be a positive number");
        }
        if let Some(f) = self
            .worker_speedups
            .iter()
            .find(|f| !(f.is_finite() && **f > 0.0))
        {
            return bad(&format!("--worker-speedups must all be > 0, got {f}"));
        }
        if self.sample_interval_us == 0 {
            return bad("the load sample interval must be positive");
        }
        self.slo.validate()?;
        self.workload.validate()?;
        self.routing
            .policy
            .build()
            .map_err(|e| SimError::InvalidConfig(format!("policy: {e}")))?;
        if let Some(f) = self.routing.disagg.isl_max_local_fraction
            && !(f.is_finite() && (0.0..=1.0).contains(&f))
        {
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

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
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
    /// Racks the workers are spread over (worker `w` in rack `w % racks`, each on its own
    /// host), registered as the workers' placements: a remote prefill's KV moves at
    /// [`TransferConfig::transfer_gbps`] within a rack and
    /// [`TransferConfig::cross_rack_gbps`] across. 0: no placements (every transfer at
    /// `transfer_gbps`, and the router sees no distances).
    pub racks: u32,
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
    /// LoRA adapter slots per worker (0: not limited, no load modelled) and the time a step
    /// spends loading one ([`tandem_engine::scheduler::SchedulerConfig::max_loras`],
    /// [`tandem_engine::MockerConfig::adapter_load_ms`]).
    pub max_loras: usize,
    pub adapter_load_ms: f64,
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
            max_loras: 0,
            adapter_load_ms: 20.0,
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
    /// Between racks ([`TopologyConfig::racks`]), GB/s.
    pub cross_rack_gbps: f64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        // An 8B Llama in fp16: 32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes.
        TransferConfig {
            kv_bytes_per_token: 131_072,
            transfer_gbps: 25.0,
            cross_rack_gbps: 12.5,
        }
    }
}
