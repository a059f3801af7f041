//! tandem's shared vocabulary: what every other crate agrees on.
//!
//! - [`ids`]: `WorkerId`, `RequestId`, block hashes and the memory [`StorageTier`].
//! - [`hashing`]: KV block identity (docs/ARCHITECTURE.md §3). Only full blocks are hashed; a block's
//!   `LocalBlockHash` is xxh3-64 of its token ids (u32 little-endian) and its `SequenceHash`
//!   chains the parent's sequence hash with the local hash, so one sequence hash names a whole
//!   prefix. The seed mixes a fixed constant with the request's cache salt.
//! - [`events`]: KV events (`Stored`, `Removed`, `Cleared`) numbered per worker, and dumps.
//! - [`worker`]: the worker record registered in discovery and the periodic load report.
//! - [`codec`]: the versioned bincode envelope every message on the event plane travels in.
//! - [`exposition`]: the Prometheus text format, parsed (engines' and frontends' `/metrics`).
//! - [`rng`]: [`Rng`], the seeded generator (xoshiro256** through SplitMix64) behind every
//!   random draw of the router, the workloads and the simulator: same seed, same stream, on
//!   every platform and with every dependency version.
//! - [`error`]: [`ErrorClass`], the one classification of errors, and (feature `grpc`) its
//!   mapping to and from gRPC status codes.
//! - [`grpc`] (feature `grpc`): the request plane's messages and services
//!   (proto/tandem.proto), generated.
//!
//! This crate depends on nothing internal (docs/ARCHITECTURE.md §2) and does no I/O.

pub mod codec;
pub mod error;
pub mod events;
pub mod exposition;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod hashing;
pub mod ids;
pub mod rng;
pub mod worker;

pub use codec::{CodecError, Envelope, KvEventBatch, MessageKind};
pub use error::ErrorClass;
pub use events::{KvDump, KvEvent, KvEventKind, StoredBlock};
pub use hashing::{BlockHashes, BlockSize, HashSeed, InvalidBlockSize, TokenBlockHasher};
pub use ids::{AdapterId, LocalBlockHash, RequestId, SequenceHash, StorageTier, WorkerId};
pub use rng::Rng;
pub use worker::{
    AdapterLoad, Distance, LoadReport, Placement, TierCapacity, WorkerAddresses, WorkerRecord,
    WorkerRole,
};
