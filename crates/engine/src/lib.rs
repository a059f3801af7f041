//! The engine: a worker's KV memory and the scheduling of its work, as sans-IO state machines.
//!
//! - [`pool`]: the paged KV block pool with a prefix cache, reference counts, LRU eviction
//!   and an optional host tier; it numbers every change as a KV event and can dump its state.
//!   It keeps each tier prefix-closed, which the global index relies on.
//! - [`arena`]: per tier one contiguous, block-major byte region.
//!
//! Nothing here does I/O, reads a clock or spawns: callers pass time in and drive the steps.

#![doc = ""]

pub mod arena;
mod event_log;
mod lru;
pub mod pool;

pub use arena::{KvArena, KvShape};
pub use event_log::EventsTooOld;
pub use pool::{BlockPool, BlockPoolConfig, PoolError, PoolStats, PrefixHit};
