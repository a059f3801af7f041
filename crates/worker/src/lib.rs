//! What tandem's prefill and decode workers share: a mock engine stepped in real time
//! ([`host::EngineHost`]), its KV events and load reports on the event plane, the worker
//! record in discovery, the `KvEvents` and `Health` handlers, and the lifecycle (serve,
//! register, drain on shutdown). The role crates (`tandem-prefill-worker`,
//! `tandem-decode-worker`) add their request handlers on top.
//!
//! Layout: `host.rs` (engine driver, event publisher, load reporter, request handles),
//! `context.rs` (config, shared handlers, serve/drain), `metrics.rs` (the worker's own
//! `/metrics`, vLLM's names where the meaning is the same), `arena.rs` (the engine's arena in a
//! transport region or GPU memory), `error.rs` (typed errors → gRPC
//! status), `digest.rs` (the checksum of transferred KV).
//!
//! Invariants: the engine is touched only under the host's lock, in short synchronous
//! sections; KV events are published by one task, in id order; a request handle that is
//! dropped before its last token aborts the request and frees its blocks; a draining worker
//! is out of discovery before it refuses its first request.

pub mod arena;
pub mod context;
pub mod digest;
pub mod error;
pub mod external;
pub mod host;
pub mod metrics;
pub mod sampling;
pub mod scrape;
pub mod trace;

pub use arena::{KvMemory, RegionStorage, digest_block, region_digest};
pub use context::{ExposedArena, NativeEngine, WorkerConfig, WorkerContext, WorkerDeps};
pub use digest::KvDigest;
pub use error::WorkerError;
pub use host::{EngineHost, HostOutput, HostPublishing, RequestHandle, cpu_bound};
pub use metrics::WorkerMetrics;
pub use sampling::sampling_params;
