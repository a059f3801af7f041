//! tandem's global KV-block index (docs/ARCHITECTURE.md §4): which worker holds which KV block in which
//! memory tier, fed by the workers' numbered KV events, asked by the router how much of a
//! prompt each worker already holds.
//!
//! # Job
//!
//! - [`KvIndex`]: the single-threaded core. [`KvIndex::apply`] takes one event and applies it
//!   only if it is the next one of its worker (duplicates are ignored, a gap is reported and
//!   nothing past it is applied); [`KvIndex::replace_worker`] installs a worker's dump;
//!   [`KvIndex::find_matches`] returns per worker how many leading blocks of a prompt it holds
//!   and in which tier ([`OverlapScores`], [`TierCounts`]); [`KvIndex::find_extents`] returns
//!   the same grouped by shared extent ([`Extents`]: a few groups of workers with equal counts,
//!   built without a cost per matching worker, for a scorer that prices a group once).
//! - [`ShardedIndex`]: the same API for concurrent readers and writers, sharded by worker; one
//!   shard (a read-write lock) by default, which the benchmarks found best for one subscriber.
//! - [`ApproxIndex`]: approximate mode for routers without events, fed with the router's own
//!   decisions and expiring them after a TTL.
//! - [`IndexFeed`]: the rules that keep an index true to the workers it mirrors (dump at
//!   join, never past a gap, repair a range or dump, purge at leave, trailing loss shown by
//!   load reports), sans-IO: the shell performs the [`Repair`]s it asks for.
//! - [`Resequencer`]: a bounded per-worker reorder buffer in front of the index for transports
//!   that may reorder events, and the trigger for repairs (replay or dump).
//!
//! The crate is synchronous, deterministic and I/O-free: no async runtime, no clock (time is a
//! `u64` of milliseconds passed in), no environment. The standalone service and the event-plane
//! subscriber are shells around it.
//!
//! # Layout
//!
//! - `index/`: [`KvIndex`]. `block_map.rs` is the block hash → holders table (open addressing,
//!   16-byte slots); `holders.rs` packs (worker slot, tier) pairs into sorted `u32`s, two
//!   inline in the block map's 8-byte value and longer lists in a side arena (shared copy on
//!   write between blocks with equal lists); `tier_log.rs` is the per-worker, per-tier log of
//!   stored blocks; `matches.rs` is `find_matches`; `extent_search.rs` is `find_extents` and
//!   `extents.rs` its answer.
//! - `feed.rs`: [`IndexFeed`]. `sharded.rs`, `approx.rs`, `reseq.rs`: the wrappers above.
//! - `hash.rs`: the hasher for keys that are already xxh3 hashes.
//! - `error.rs`: [`IndexError`].
//!
//! # Invariants and assumptions
//!
//! - Per worker, events are applied in id order 1, 2, 3, … with no holes; a dump resets the
//!   worker to exactly its contents and its `last_event_id`.
//! - The block → holders map is the truth about who holds what; every holder is also in its
//!   worker's log for that tier, whose live count matches the map; no block is kept with zero
//!   holders.
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
//! Applying a block event is one operation on the block map (a `Stored` event also looks up
//! its parent once, for the closure check) plus an append to, or a counter decrement of, the
//! worker's tier log; compacting the logs adds at most two map lookups per removal, amortized
//! and done in batches. The block map is far larger than the caches, so each operation is a
//! cache miss: the event path loads the slots of the next 128 blocks of an event together
//! before applying them (see `index/block_map.rs`), and is bound by how many misses the
//! machine overlaps.
//!
//! `find_matches` costs a few lookups per position where holders change plus one step per
//! matching worker; `find_extents` the same lookups and nothing per worker that shares a
//! prefix with others (`index/extents.rs`). Either is bound, on a cold index, by the lookups it
//! makes one after the other, each a cache and TLB miss.
//!
//! Resident state, per entry when most blocks have one holder (an entry is a
//! (block, worker, tier) triple):
//! - block map: a 16-byte slot (8-byte hash, 8-byte holder list) in a power-of-two table at
//!   most 3/4 full: 16 / (3/4) = 21.3 bytes per block just before the table doubles,
//!   16 / (3/8) = 42.7 just after;
//! - tier logs: 8 bytes per logged hash; in a steady state (a store per removal) a log's
//!   capacity is at most 2.25 × its live entries plus 72 (see `index/tier_log.rs`): up to
//!   18 bytes per entry, less while a worker is still filling up;
//! - blocks with more than two holders also point at a spilled list: 40 bytes of arena slot
//!   plus 4 bytes per holder (capacity), one list per chain of blocks with equal holders as
//!   long as they change together.
//!
//! That is about 39 bytes per entry at best and 61 at worst. Measured on the Mooncake trace
//! replay (`cargo bench -p tandem-indexer --bench trace_replay -- --passes 2`: 1,000 workers ×
//! 8,192 blocks, 7.48 M entries over 7.42 M blocks, map at 44 % load; 2-core AMD EPYC VM,
//! 2026-12-01): 49.7 bytes per entry by [`KvIndex::heap_bytes`], and the same by the
//! allocator's allocated − deallocated bytes (51.9 with the previous hashbrown map). A worker
//! that shrinks without storing keeps a log of up to 2.25 × (2 × live + 64) hashes until its
//! next store or until it is empty.

mod approx;
mod error;
mod feed;
mod hash;
mod index;
mod reseq;
mod sharded;

pub use approx::{ApproxConfig, ApproxIndex};
pub use error::IndexError;
pub use feed::{FeedError, FeedStats, IndexFeed, Repair, RepairReply, StreamHealth};
pub use index::{
    ApplyOutcome, Extent, Extents, KvIndex, MAX_RESERVED_BLOCKS, OverlapScores, TierCounts,
    WorkerBlocks,
};
pub use reseq::{Resequencer, ResequencerConfig};
pub use sharded::ShardedIndex;
