//! [`SaturationConfig`]: when a decode worker cannot usefully take another request, so that
//! the frontend holds new requests in its queue ([`crate::flow`]) instead of piling them onto
//! the worker's own queue, where priorities and tenants no longer count.
//!
//! A worker is saturated when it has at least one request in flight and any threshold set is
//! reached:
//! - `kv_fraction`: the KV its in-flight requests hold or will hold (the tracker's potential
//!   blocks: prompts and expected outputs, shared prefixes once) is at least this fraction of
//!   its device blocks (from its load reports). Lag-free: the tracker counts a request the
//!   moment it is routed.
//! - `prefill_tokens`: prompt tokens routed to it and not yet prefilled (its time to first
//!   token grows with them).
//! - `requests`: requests in flight.
//! - `waiting`: requests its engine reports as waiting to be scheduled, less those of its
//!   requests that ended since the report (each made room for one; the report lags by its
//!   interval): the engine's own word that it is full.
//!
//! A prefill worker is saturated when the prompt tokens routed to it and not yet prefilled
//! reach `prefill_pool_tokens` (its queue is that many tokens of prefill time long).
//!
//! A worker with nothing in flight is never saturated: one request always gets through, even
//! one larger than every threshold.

use crate::error::{ConfigError, non_negative};
use crate::view::WorkerLoad;

/// Saturation thresholds (see the module docs); `None` disables one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SaturationConfig {
    pub kv_fraction: Option<f64>,
    pub prefill_tokens: Option<u64>,
    pub requests: Option<u64>,
    pub waiting: Option<u32>,
    /// Prefill workers: pending prompt tokens.
    pub prefill_pool_tokens: Option<u64>,
}

impl Default for SaturationConfig {
    /// KV at 100 % of the device blocks, and any request waiting in the engine beyond 4: the
    /// point past which a request only queues on the worker.
    fn default() -> Self {
        SaturationConfig {
            kv_fraction: Some(1.0),
            prefill_tokens: None,
            requests: None,
            waiting: Some(4),
            prefill_pool_tokens: Some(65_536),
        }
    }
}

impl SaturationConfig {
    /// No thresholds: no worker is ever saturated (flow control then only rate-limits).
    pub const OFF: SaturationConfig = SaturationConfig {
        kv_fraction: None,
        prefill_tokens: None,
        requests: None,
        waiting: None,
        prefill_pool_tokens: None,
    };

    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(f) = self.kv_fraction {
            non_negative("saturation KV fraction", f)?;
        }
        Ok(())
    }

    /// Whether a prefill worker with `load` (tracked) is saturated.
    pub fn is_prefill_saturated(&self, load: &WorkerLoad) -> bool {
        load.active_requests > 0
            && self
                .prefill_pool_tokens
                .is_some_and(|t| load.active_prefill_tokens >= t)
    }

    /// Whether a worker with `load` (tracked), `capacity_blocks` device blocks (0: unknown)
    /// and `waiting` requests reported waiting is saturated.
    pub fn is_saturated(&self, load: &WorkerLoad, capacity_blocks: u64, waiting: u32) -> bool {
        if load.active_requests == 0 {
            return false;
        }
        let kv = self.kv_fraction.is_some_and(|f| {
            capacity_blocks > 0 && load.potential_decode_blocks as f64 >= f * capacity_blocks as f64
        });
        kv || self
            .prefill_tokens
            .is_some_and(|t| load.active_prefill_tokens >= t)
            || self.requests.is_some_and(|r| load.active_requests >= r)
            || self.waiting.is_some_and(|w| waiting >= w)
    }
}
