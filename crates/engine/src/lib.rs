//! The engine: a worker's KV memory and the scheduling of its work, as sans-IO state machines.
//!
//! - [`pool`]: the paged KV block pool with a prefix cache, reference counts, LRU eviction
//!   and optional host and disk tiers; it numbers every change as a KV event and can dump its
//!   state. It keeps each tier prefix-closed, which the global index relies on.
//! - [`arena`]: per tier one contiguous, block-major byte region (possibly GPU memory, which
//!   it names to the model: [`ArenaStorage::device`]).
//! - [`disk`]: the disk tier's storage, [`DiskStore`], with an in-memory twin; the workers'
//!   file store lives in `tandem-worker`, so the pool itself does no I/O.
//! - [`scheduler`]: continuous batching over the pool (vLLM v1 style): a token budget per
//!   step, chunked prefill, FCFS admission on the cached prefix, preemption by recompute under
//!   memory pressure. It plans a step; a model computes it; the scheduler completes it. The
//!   decode side of a remote prefill reserves destination blocks, then continues the request
//!   as if prefilled locally, or falls back to a local prefill.
//! - [`Model`] ([`model`]): what computes a step: the plan's rows in, K/V written into the
//!   arena through the block tables, sampled tokens out. [`Engine`] ties pool, scheduler and a
//!   model together (prefix cache, export, remote prefill and KV events are the engine's,
//!   whatever the model); the simulator and the worker services drive it.
//! - [`mocker`]: a model without a GPU: polynomial step timing, deterministic KV bytes, and
//!   tokens derived from the KV read back from the arena. [`MockEngine`] is the engine with it.
//!
//! Nothing here does I/O, reads a clock or spawns: callers pass time in and drive the steps.
//! Time is always `u64` microseconds (`now_us`); only the mocker's step durations are given
//! in `f64` milliseconds (with [`PlannedStep::duration_us`] for virtual clocks). Everything is
//! deterministic: the same calls in the same order give the same tokens, events and stats.

pub mod arena;
pub mod disk;
mod engine;
mod event_log;
mod lru;
pub mod mocker;
pub mod model;
pub mod pool;
pub mod scheduler;

pub use arena::{ArenaSizeMismatch, ArenaStorage, DeviceMemory, KvArena, KvShape};
pub use disk::{DiskBlock, DiskStore, MemoryDiskStore};
pub use engine::{
    DynEngine, Engine, EngineConfig, EngineError, ExportedBlock, MockEngine, MockEngineConfig,
    PlannedStep,
};
pub use event_log::EventsTooOld;
pub use mocker::{Mocker, MockerConfig, TimingModel};
pub use model::Model;
pub use pool::{BlockPool, BlockPoolConfig, PoolError, PoolStats, PrefixHit};
pub use scheduler::{
    EngineRequest, ErrorClass, FinishReason, ModelView, RemotePrefill, RequestOutput, RequestPhase,
    SampledToken, SamplingParams, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerError,
    SchedulerStats, Sequence, StepKind, StepPlan, TokenLogprobs,
};
