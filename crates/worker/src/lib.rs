//! What every tandem worker shares, whatever computes its answers: one lifecycle and one
//! `tandem.v1.Worker` service ([`served`]: register, serve, load reports, health, drain), for
//! tandem's own engine in this process (the mocker or the native model, stepped in real time
//! by [`host::EngineHost`], its KV events on the event plane) and for an external engine
//! behind the sidecar (the `tandem-external` crate). The role crates (`tandem-prefill-worker`,
//! `tandem-decode-worker`) add their request handlers on top of [`WorkerContext`].
//!
//! Layout: `served.rs` (the engine interfaces, the gRPC service, the lifecycle), `host/`
//! (engine driver, event publisher, request handles), `context.rs` (config, the in-process
//! engine's side of the lifecycle), `metrics.rs` (the worker's own
//! `/metrics`, vLLM's names where the meaning is the same), `arena.rs` (the engine's arena in a
//! transport region or GPU memory), `disk.rs` (the engine's disk tier in a file),
//! `error.rs` (typed errors → gRPC status), `digest.rs` (the checksum of transferred KV).
//!
//! Invariants: the engine is touched only under the host's lock, in short synchronous
//! sections; KV events are published by one task, in id order; a request handle that is
//! dropped before its last token aborts the request and frees its blocks; a draining worker
//! is out of discovery before it refuses its first request.

pub mod arena;
pub mod context;
pub mod digest;
pub mod disk;
pub mod error;
pub mod host;
pub mod metrics;
pub mod sampling;
pub mod scrape;
pub mod served;
pub mod trace;

pub use arena::{KvMemory, RegionStorage, digest_block, digest_blocks, region_digest};
pub use context::{ExposedArena, NativeEngine, WorkerConfig, WorkerContext, WorkerDeps};
pub use digest::KvDigest;
pub use disk::{FileDiskStore, KvDiskConfig};
pub use error::WorkerError;
pub use host::{EngineHost, HostOutput, HostPublishing, RequestHandle, cpu_bound};
pub use metrics::WorkerMetrics;
pub use sampling::{WireSampling, logprobs_from_wire, logprobs_to_wire, sampling_params};
pub use served::{Availability, ChunkStream, ServedEngine, WorkerCalls, WorkerService};
