//! The worker record registered in discovery and the periodic load report.

use serde::{Deserialize, Serialize};

use crate::hashing::BlockSize;
use crate::ids::WorkerId;

/// What a worker does in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WorkerRole {
    /// Computes prompt KV and ships it to decode workers.
    Prefill,
    /// Generates tokens; prefills locally when the router says so.
    Decode,
    /// Does both, with no disaggregation.
    Aggregated,
}

/// KV capacity in blocks per memory tier (0 = the tier is absent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCapacity {
    pub device_blocks: u64,
    pub host_blocks: u64,
    pub disk_blocks: u64,
}

/// Where to reach a worker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerAddresses {
    /// Request plane (gRPC), `host:port`.
    pub grpc: String,
    /// KV transfer endpoint, when the worker receives or sends KV.
    pub kv_transfer: Option<String>,
    /// Its Prometheus metrics (`GET /metrics`), `host:port`, when it serves them.
    pub metrics: Option<String>,
    /// The OpenAI-compatible HTTP endpoint that serves this worker's requests, `host:port`
    /// (an external engine behind a sidecar): what a gateway sends a request to when the
    /// endpoint picker (`tandem epp`) chooses this worker. None: not pickable by it.
    pub http: Option<String>,
}

/// Where a worker runs, for the cost of moving KV between two workers: the same process
/// (an in-process transfer), the same host, the same rack, or farther. Empty fields are
/// unknown (never equal to anything).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Placement {
    /// The worker's process, unique per run (e.g. host, pid and start time).
    pub process: String,
    /// Its host (by default the address it advertises).
    pub host: String,
    /// A topology label: rack, NVLink domain, zone — whatever shares the fast network.
    pub rack: String,
}

/// How far apart two placements are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Distance {
    SameProcess,
    SameHost,
    SameRack,
    /// Different racks, or unknown.
    Other,
}

impl Placement {
    /// This process on `host`, in `rack`: the process is named by its id and start time, so
    /// two runs never share one.
    pub fn here(host: &str, rack: &str) -> Placement {
        static STARTED: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
        let started = STARTED.get_or_init(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        });
        Placement {
            process: format!("{host}/{}/{started}", std::process::id()),
            host: host.to_string(),
            rack: rack.to_string(),
        }
    }

    pub fn distance(&self, other: &Placement) -> Distance {
        let same = |a: &str, b: &str| !a.is_empty() && a == b;
        if same(&self.process, &other.process) {
            Distance::SameProcess
        } else if same(&self.host, &other.host) {
            Distance::SameHost
        } else if same(&self.rack, &other.rack) {
            Distance::SameRack
        } else {
            Distance::Other
        }
    }
}

/// A worker as registered in discovery.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub id: WorkerId,
    pub role: WorkerRole,
    pub model: String,
    pub block_size: BlockSize,
    pub kv_capacity: TierCapacity,
    pub addresses: WorkerAddresses,
    /// Whether the worker publishes KV events. False for a worker in front of an engine
    /// whose events are not relayed: the router then remembers its own decisions for it
    /// (approximate KV).
    pub kv_events: bool,
    /// Where it runs (KV transfer cost between workers).
    pub placement: Placement,
    /// The engine takes its prompt as text, not token ids (a plain OpenAI-compatible server
    /// that refuses token prompts, found out by its sidecar at start): requests to it carry
    /// the client's prompt text or chat messages (`GenerateRequest.text`).
    pub takes_text: bool,
}

/// The LoRA adapters a worker holds, for LoRA-aware routing. vLLM reports the same in its
/// `vllm:lora_requests_info` gauge (labels `max_lora`, `running_lora_adapters`,
/// `waiting_lora_adapters`; `vllm/v1/metrics/loggers.py`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterLoad {
    /// Adapters it can hold at once (vLLM's `max_loras`); 0: unknown or no LoRA support.
    pub max_loaded: u32,
    /// Adapters loaded now, or being loaded for a waiting request: a request on one of them
    /// starts without a load.
    pub resident: Vec<String>,
}

/// A worker's load, published periodically on the event plane.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    pub worker_id: WorkerId,
    /// Worker clock, milliseconds.
    pub timestamp_ms: u64,
    /// Requests being computed (prefill or decode).
    pub running_requests: u32,
    /// Requests accepted but not yet scheduled.
    pub waiting_requests: u32,
    /// Prompt tokens accepted but not yet prefilled.
    pub pending_prefill_tokens: u64,
    /// Device KV blocks in use by running requests.
    pub kv_active_blocks: u64,
    /// Device KV blocks in total.
    pub kv_total_blocks: u64,
    /// Id of the worker's latest KV event: lets a consumer notice a lost trailing event
    /// (a gap that no later event would reveal).
    pub last_kv_event_id: u64,
    /// Prompt tokens the engine computed since it started (recomputation included).
    pub prefill_tokens_total: u64,
    /// Tokens the engine generated since it started.
    pub decode_tokens_total: u64,
    /// Time the engine spent computing steps since it started, microseconds (0: unknown).
    /// With the token totals, its speed while busy: the router's capacity weights.
    pub busy_us_total: u64,
    /// Its LoRA adapters.
    pub adapters: AdapterLoad,
}

impl LoadReport {
    /// Fraction of device KV blocks in use, 0 when the worker reports no capacity.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_total_blocks == 0 {
            0.0
        } else {
            self.kv_active_blocks as f64 / self.kv_total_blocks as f64
        }
    }
}
