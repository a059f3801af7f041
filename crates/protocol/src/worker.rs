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
}

/// A worker's load, published periodically on the event plane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
