//! Unit tests of the crate, one file per module under test, sharing the builders below.

mod adapters;
mod approx;
mod disagg;
mod fed_index;
mod flow;
mod groups;
mod kv;
mod policies;
mod pool;
mod replica;
mod sessions;
mod shortcut;
mod tracker;

use tandem_indexer::TierCounts;
use tandem_protocol::{BlockSize, WorkerId};

use crate::{KvOverrides, RouteRequest, WorkerLoad, WorkerView};

pub(crate) fn bs(n: u32) -> BlockSize {
    BlockSize::new(n).unwrap()
}

pub(crate) fn req(prompt_tokens: u64, block_size: u32) -> RouteRequest {
    RouteRequest {
        prompt_tokens,
        block_size: bs(block_size),
        prefix_key: 0,
        overrides: KvOverrides::default(),
        priority: crate::Priority::Standard,
        adapter: None,
        local_prefill: false,
    }
}

pub(crate) fn tiers(device: u32, host: u32, disk: u32) -> TierCounts {
    TierCounts { device, host, disk }
}

/// A worker with overlap `(device, host, disk)`, pending prefill tokens, decode blocks and
/// active requests.
pub(crate) fn view(
    id: u64,
    overlap: TierCounts,
    prefill_tokens: u64,
    decode_blocks: u64,
    active: u64,
) -> WorkerView {
    WorkerView {
        id: WorkerId(id),
        overlap,
        load: WorkerLoad {
            active_prefill_tokens: prefill_tokens,
            potential_decode_blocks: decode_blocks,
            active_requests: active,
            kv_usage: 0.0,
        },
        speed: 1.0,
        extra_cost: 0.0,
        adapter_cost: 0.0,
        warming_up: false,
    }
}

/// A worker known only by its active-request count.
pub(crate) fn loaded(id: u64, active: u64) -> WorkerView {
    view(id, TierCounts::default(), 0, 0, active)
}

pub(crate) fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}
