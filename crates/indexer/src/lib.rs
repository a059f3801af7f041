//! tandem's global KV-block index (DESIGN.md §4): which worker holds which KV block in which
//! memory tier, fed by the workers' numbered KV events, asked by the router how much of a
//! prompt each worker already holds.
//!
//! # Job
//!
//! - [`KvIndex`]: the single-threaded core. [`KvIndex::apply`] takes one event and applies it
//!   only if it is the next one of its worker (duplicates are ignored, a gap is reported and
//!   nothing past it is applied); [`KvIndex::replace_worker`] installs a worker's dump;
//!   [`KvIndex::find_matches`] returns per worker how many leading blocks of a prompt it holds
//!   and in which tier ([`OverlapScores`], [`TierCounts`]).
//! - [`ShardedIndex`]: the same API for concurrent readers and writers, sharded by worker.
//! - [`ApproxIndex`]: approximate mode for routers without events, fed with the router's own
//!   decisions and expiring them after a TTL.
//! - [`Resequencer`]: a bounded per-worker reorder buffer in front of the index for transports
//!   that may reorder events, and the trigger for repairs (replay or dump).
//!
//! The crate is synchronous, deterministic and I/O-free: no async runtime, no clock (time is a
//! `u64` of milliseconds passed in), no environment. The standalone service and the event-plane
//! subscriber are shells around it.
//!
//! # Layout
//!
//! - `index/`: [`KvIndex`]. `holders.rs` packs (worker slot, tier) pairs into sorted `u32`s,
//!   inline for up to three holders per block; `matches.rs` is `find_matches`.
//! - `sharded.rs`, `approx.rs`, `reseq.rs`: the wrappers above.
//! - `hash.rs`: the hasher for keys that are already xxh3 hashes.
//! - `error.rs`: [`IndexError`].
//!
//! # Invariants and assumptions
//!
//! - Per worker, events are applied in id order 1, 2, 3, … with no holes; a dump resets the
//!   worker to exactly its contents and its `last_event_id`.
//! - The per-worker block sets and the block → holders map always agree; no block is kept with
//!   zero holders.
//! - **Prefix closure with monotone tiers.** `find_matches` assumes each worker keeps the blocks
//!   it holds on Device prefix-closed (a block's parent is held whenever the block is), and
//!   likewise Device ∪ Host and Device ∪ Host ∪ Disk, as a block pool that evicts leaves first
//!   and offloads parents before children does. A worker's tier is then non-decreasing along a
//!   prompt, and equal holder lists at two positions of the prompt prove that nobody changes
//!   tier between them: `find_matches` bisects for the positions where holders change,
//!   O(changes × log n) lookups instead of n. A worker whose `Stored` events break this
//!   (a parent it did not hold at that tier or better) is flagged and matched by an exact
//!   linear walk until a clean dump (or an empty cache) clears the flag.
//!
//! # Cost
//!
//! Applying a block event is two hash-table operations. Resident state is one 24-byte map entry
//! per block (plus spilled holder lists for blocks with more than three holders) and one 8-byte
//! set entry per (block, worker, tier), plus hash-table slack; [`KvIndex::heap_bytes`] reports
//! the estimate.

mod approx;
mod error;
mod hash;
mod index;
mod reseq;
mod sharded;

pub use approx::{ApproxConfig, ApproxIndex};
pub use error::IndexError;
pub use index::{ApplyOutcome, KvIndex, OverlapScores, TierCounts, WorkerBlocks};
pub use reseq::{Resequencer, ResequencerConfig};
pub use sharded::ShardedIndex;
