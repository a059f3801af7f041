//! [`KvIndex`]: the single-threaded core of the global KV index.
//!
//! Layout:
//! - `blocks`: sequence hash → [`Holders`] (sorted, packed (worker slot, tier) pairs; two
//!   inline in the 16-byte slot of an open-addressing table, `block_map.rs`, more in the
//!   `spills` arena, shared between blocks with equal lists). The holder lists are the source
//!   of truth: "does worker w hold block h in tier t" is a lookup in `blocks`, and they are
//!   what `find_matches` and `find_extents` (`extent_search.rs`, answer type in `extents.rs`)
//!   read.
//! - `slots`: dense worker slots. Each worker's state keeps its last applied event id, one
//!   [`TierLog`] per tier (an append-only list of the block hashes it stored there, so that
//!   `Cleared`, `remove_worker` and `replace_worker` cost O(the worker's blocks), not
//!   O(all blocks)) and the `non_closed` flag.
//! - `slot_of` / `by_id`: worker id → slot, and the workers sorted by id for ordered output.
//!
//! Invariants: no holder list in `blocks` is empty; `pack(w, t)` is in `blocks[h]` only if `h`
//! is in `slots[w].tiers[t]`'s log, and that log's `live` count is the number of blocks whose
//! list holds `pack(w, t)`. Log entries whose holder is gone are stale and skipped.
//!
//! Per block event, `apply` touches the block map once (plus the parent's holder list once per
//! `Stored` event for the closure check), and the end of one log, which is in cache. The block
//! map being far larger than the caches, that touch is a cache miss, and the event path is
//! bound by how many of them overlap: the slots of the next [`AHEAD`] blocks of an event are
//! loaded together (independent loads) before the blocks are applied one by one, about 1.7× on
//! the trace replay (`BENCHMARKS.md`, 2026-12-01).

mod block_map;
mod extent_search;
mod extents;
mod holders;
mod matches;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_extents;
mod tier_log;

use std::collections::BTreeSet;

use tandem_protocol::{KvDump, KvEvent, KvEventKind, SequenceHash, StorageTier, WorkerId};

use crate::error::IndexError;
use crate::hash::MixMap;
use block_map::{AHEAD, BlockMap, Probe};
pub use extents::{Extent, Extents};
use holders::{Holders, MAX_SLOTS, Removal, Spills, level_in, pack};
pub use matches::{OverlapScores, TierCounts};
use tier_log::TierLog;

/// The most blocks [`KvIndex::reserve`] makes room for ahead of use: 2^24 (2,000 GPUs of
/// 8,192 blocks each), a block map of 512 MiB at most; beyond it the map grows with use.
pub const MAX_RESERVED_BLOCKS: usize = 1 << 24;

/// What [`KvIndex::apply`] did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// The event was the next one for its worker and is now reflected in the index.
    Applied,
    /// The event id was not above the worker's last applied id: already seen, ignored.
    Duplicate,
    /// Events between the last applied one and this one are missing. Nothing was applied; the
    /// caller must repair (replay `expected..got` from the worker's ring, or take a dump).
    Gap { expected: u64, got: u64 },
}

/// The blocks one worker holds, per tier (for tests and debugging; O(the worker's blocks)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerBlocks {
    pub device: BTreeSet<SequenceHash>,
    pub host: BTreeSet<SequenceHash>,
    pub disk: BTreeSet<SequenceHash>,
}

impl WorkerBlocks {
    /// The blocks of one tier.
    pub fn tier(&self, tier: StorageTier) -> &BTreeSet<SequenceHash> {
        match tier {
            StorageTier::Device => &self.device,
            StorageTier::Host => &self.host,
            StorageTier::Disk => &self.disk,
        }
    }

    fn tier_mut(&mut self, tier: StorageTier) -> &mut BTreeSet<SequenceHash> {
        match tier {
            StorageTier::Device => &mut self.device,
            StorageTier::Host => &mut self.host,
            StorageTier::Disk => &mut self.disk,
        }
    }
}

/// Everything known about one worker.
#[derive(Debug)]
struct WorkerState {
    id: WorkerId,
    last_event_id: u64,
    /// The blocks held per tier index, as logs to enumerate them (membership is the holder
    /// lists' job).
    tiers: [TierLog; 3],
    /// The worker's stream broke prefix closure at least once since its last clean dump (or
    /// since it last held nothing): `find_matches` walks it linearly instead of bisecting.
    non_closed: bool,
}

impl WorkerState {
    fn new(id: WorkerId) -> Self {
        WorkerState {
            id,
            last_event_id: 0,
            tiers: Default::default(),
            non_closed: false,
        }
    }

    fn is_empty(&self) -> bool {
        self.tiers.iter().all(|t| t.live() == 0)
    }
}

/// The global KV index: which worker holds which block in which tier.
///
/// Synchronous and I/O-free. Shared between threads, one index behind a read-write lock
/// serves a frontend (one event subscriber) best: [`crate::ShardedIndex`] with more than one
/// shard made every query 4–5× slower at a realistic event rate and pays off only with
/// several writer threads (crates/indexer/BENCHMARKS.md).
#[derive(Debug, Default)]
pub struct KvIndex {
    blocks: BlockMap,
    /// Holder lists of blocks with more than two holders.
    spills: Spills,
    slots: Vec<Option<WorkerState>>,
    free_slots: Vec<u32>,
    slot_of: MixMap<WorkerId, u32>,
    /// All workers sorted by id, so results come out ordered without sorting them per query.
    by_id: Vec<(WorkerId, u32)>,
    /// Resident (block, worker, tier) entries.
    entries: usize,
    /// Slots of the workers flagged `non_closed`, ascending; when empty (the normal case)
    /// queries skip the per-worker flag check, which would touch every candidate's state.
    non_closed_slots: Vec<u32>,
    /// Scratch map for counting a log's removals while compacting it; empty between calls.
    scratch: MixMap<u64, u32>,
}

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index with room for `blocks` distinct blocks before its block map grows. A frontend
    /// knows the cluster's KV capacity from the worker records (the sum of their blocks per
    /// tier bounds what can be resident); reserving it up front spares the event path the
    /// rehashes (and the page faults of each new table) while the cluster warms up.
    pub fn with_capacity(blocks: usize) -> Self {
        KvIndex {
            blocks: BlockMap::with_capacity(blocks),
            ..Self::default()
        }
    }

    /// Makes room for `blocks` distinct blocks in all (not `blocks` more): grows the block map
    /// now if it would grow before holding that many; never shrinks it. A table larger than
    /// [`MAX_RESERVED_BLOCKS`] is left to grow with what is really held.
    pub fn reserve(&mut self, blocks: usize) {
        self.blocks.reserve(blocks.min(MAX_RESERVED_BLOCKS));
    }

    /// Applies one event if it is the next one for its worker (see [`ApplyOutcome`]).
    ///
    /// A worker unknown to the index has last event id 0, so its first event must be 1.
    pub fn apply(&mut self, event: &KvEvent) -> ApplyOutcome {
        let slot = self.slot_of.get(&event.worker_id).copied();
        let last = slot.map_or(0, |s| self.worker(s).last_event_id);
        if event.event_id <= last {
            return ApplyOutcome::Duplicate;
        }
        // `last < event_id` here, so `last + 1` cannot overflow.
        if event.event_id - last != 1 {
            return ApplyOutcome::Gap {
                expected: last + 1,
                got: event.event_id,
            };
        }
        let slot = match slot {
            Some(s) => s,
            None => self.add_worker(event.worker_id),
        };
        self.apply_kind(slot, event.tier, &event.kind, true);
        self.worker_mut(slot).last_event_id = event.event_id;
        ApplyOutcome::Applied
    }

    /// Replaces everything known about `dump.worker_id` with the dump's contents and sets its
    /// last event id to `dump.last_event_id` (even if that is lower than the current one: the
    /// dump is authoritative). The dump is checked for prefix closure as a whole, so its events
    /// may come in any tier order; the worker's `non_closed` flag is reset to that result.
    ///
    /// Fails without changing anything if an event in the dump names another worker.
    pub fn replace_worker(&mut self, dump: &KvDump) -> Result<(), IndexError> {
        if let Some(e) = dump.events.iter().find(|e| e.worker_id != dump.worker_id) {
            return Err(IndexError::ForeignEvent {
                dump: dump.worker_id,
                event: e.worker_id,
            });
        }
        let slot = match self.slot_of.get(&dump.worker_id) {
            Some(&s) => {
                self.clear_worker(s);
                s
            }
            None => self.add_worker(dump.worker_id),
        };
        for e in &dump.events {
            self.apply_kind(slot, e.tier, &e.kind, false);
        }
        let closed = dump.events.iter().all(|e| match &e.kind {
            KvEventKind::Stored {
                parent: Some(p), ..
            } => self.holds_at_or_below(slot, p.0, e.tier.index()),
            _ => true,
        });
        self.set_non_closed(slot, !closed);
        self.worker_mut(slot).last_event_id = dump.last_event_id;
        Ok(())
    }

    /// Forgets a worker entirely (blocks and last event id); returns whether it was known.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let Some(slot) = self.slot_of.remove(&worker) else {
            return false;
        };
        self.clear_worker(slot);
        self.slots[slot as usize] = None;
        self.free_slots.push(slot);
        if let Ok(i) = self.by_id.binary_search(&(worker, slot)) {
            self.by_id.remove(i);
        }
        true
    }

    /// The last applied event id of a worker, `None` if the index does not know it.
    pub fn last_event_id(&self, worker: WorkerId) -> Option<u64> {
        self.slot_of
            .get(&worker)
            .map(|&s| self.worker(s).last_event_id)
    }

    /// Whether the worker's stream broke prefix closure (it is then matched by a linear walk).
    pub fn is_non_closed(&self, worker: WorkerId) -> bool {
        self.slot_of
            .get(&worker)
            .is_some_and(|&s| self.worker(s).non_closed)
    }

    /// Known workers, sorted by id.
    pub fn workers(&self) -> impl ExactSizeIterator<Item = WorkerId> + '_ {
        self.by_id.iter().map(|&(id, _)| id)
    }

    /// The blocks a worker holds per tier, `None` if the index does not know it.
    pub fn worker_blocks(&self, worker: WorkerId) -> Option<WorkerBlocks> {
        let slot = *self.slot_of.get(&worker)?;
        let w = self.worker(slot);
        let mut out = WorkerBlocks::default();
        for tier in StorageTier::ALL {
            let t = tier.index();
            let holder = pack(slot, t);
            let live = w.tiers[t]
                .entries()
                .iter()
                .filter(|&&h| self.holds(holder, h))
                .map(|&h| SequenceHash(h));
            // The set drops repeated log entries.
            out.tier_mut(tier).extend(live);
        }
        Some(out)
    }

    /// Resident (block, worker, tier) entries. A block a worker holds in two tiers counts twice
    /// (it costs two holders), otherwise this is the number of (block, worker) pairs.
    pub fn num_entries(&self) -> usize {
        self.entries
    }

    /// Distinct blocks held by at least one worker.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Estimated heap bytes owned by the index, from table and vector capacities
    /// (O(workers + spilled lists)). Divide by [`KvIndex::num_entries`] for the per-entry cost.
    pub fn heap_bytes(&self) -> usize {
        let logs: usize = self
            .slots
            .iter()
            .flatten()
            .flat_map(|w| w.tiers.iter())
            .map(TierLog::heap_bytes)
            .sum();
        self.blocks.heap_bytes()
            + self.spills.heap_bytes()
            + logs
            + table_bytes(self.scratch.capacity(), size_of::<(u64, u32)>())
            + table_bytes(self.slot_of.capacity(), size_of::<(WorkerId, u32)>())
            + self.slots.capacity() * size_of::<Option<WorkerState>>()
            + self.by_id.capacity() * size_of::<(WorkerId, u32)>()
            + (self.free_slots.capacity() + self.non_closed_slots.capacity()) * size_of::<u32>()
    }

    /// Adds `hash` to the worker's `tier` without an event (approximate mode). Creates the
    /// worker if needed; does not touch its event id or closure flag.
    pub(crate) fn insert_raw(&mut self, worker: WorkerId, tier: StorageTier, hash: u64) {
        let slot = match self.slot_of.get(&worker) {
            Some(&s) => s,
            None => self.add_worker(worker),
        };
        self.insert_entry(slot, tier.index(), hash);
    }

    /// Removes `hash` from the worker's `tier` without an event (approximate mode).
    pub(crate) fn remove_raw(&mut self, worker: WorkerId, tier: StorageTier, hash: u64) {
        if let Some(&slot) = self.slot_of.get(&worker) {
            self.remove_entry(slot, tier.index(), hash);
        }
    }

    /// The sorted holder list of a block (empty when nobody holds it).
    #[inline(always)]
    fn holders(&self, hash: u64) -> &[u32] {
        self.blocks
            .get(hash)
            .map_or(&[], |hs| hs.as_slice(&self.spills))
    }

    /// The sorted holder list of a block and its workers per tier of their first entry.
    #[inline(always)]
    fn holders_counted(&self, hash: u64) -> (&[u32], [u32; 3]) {
        self.blocks.get(hash).map_or((&[], [0; 3]), |hs| {
            (hs.as_slice(&self.spills), hs.first_tiers(&self.spills))
        })
    }

    /// Whether the block's holder list contains `holder`.
    #[inline]
    fn holds(&self, holder: u32, hash: u64) -> bool {
        self.blocks
            .get(hash)
            .is_some_and(|hs| hs.contains(holder, &self.spills))
    }

    /// Whether the worker holds `hash` at level `tier` or better.
    #[inline]
    fn holds_at_or_below(&self, slot: u32, hash: u64, tier: usize) -> bool {
        usize::from(level_in(self.holders(hash), slot)) <= tier
    }

    #[inline(always)]
    fn worker(&self, slot: u32) -> &WorkerState {
        self.slots[slot as usize]
            .as_ref()
            .expect("slot maps to a live worker")
    }

    #[inline(always)]
    fn worker_mut(&mut self, slot: u32) -> &mut WorkerState {
        self.slots[slot as usize]
            .as_mut()
            .expect("slot maps to a live worker")
    }

    fn add_worker(&mut self, id: WorkerId) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                // 2^30 workers would need hundreds of GiB of worker state first.
                assert!(self.slots.len() < MAX_SLOTS, "more than 2^30 workers");
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[slot as usize] = Some(WorkerState::new(id));
        self.slot_of.insert(id, slot);
        let i = self.by_id.partition_point(|&(w, _)| w < id);
        self.by_id.insert(i, (id, slot));
        slot
    }

    /// Applies an event's effect. `check_closure` is false for dumps, which are checked as a
    /// whole afterwards because their tiers may come in any order.
    #[inline]
    fn apply_kind(&mut self, slot: u32, tier: StorageTier, kind: &KvEventKind, check: bool) {
        let t = tier.index();
        match kind {
            KvEventKind::Stored { parent, blocks } => {
                if let (true, Some(p)) = (check, parent) {
                    // The parent's slot loads along with the first blocks'.
                    let first = blocks.iter().take(AHEAD).map(|b| b.sequence_hash.0);
                    self.touch(first.chain([p.0]));
                    if !self.holds_at_or_below(slot, p.0, t) {
                        self.set_non_closed(slot, true);
                    }
                }
                for chunk in blocks.chunks(AHEAD) {
                    self.touch(chunk.iter().map(|b| b.sequence_hash.0));
                    for b in chunk {
                        self.insert_entry(slot, t, b.sequence_hash.0);
                    }
                }
            }
            KvEventKind::Removed { blocks } => {
                for chunk in blocks.chunks(AHEAD) {
                    self.touch(chunk.iter().map(|b| b.0));
                    for b in chunk {
                        self.remove_entry(slot, t, b.0);
                    }
                }
                self.reset_flag_if_empty(slot);
            }
            KvEventKind::Cleared => {
                self.clear_tier(slot, t);
                self.reset_flag_if_empty(slot);
            }
        }
    }

    /// Loads the block-map slots of `hashes` (a few, see [`AHEAD`]) before they are used: the
    /// loads are independent, so their cache misses overlap instead of following each other.
    #[inline(always)]
    fn touch(&self, hashes: impl Iterator<Item = u64>) {
        let mut acc = 0;
        for h in hashes {
            acc ^= self.blocks.touch(h);
        }
        std::hint::black_box(acc);
    }

    /// An empty worker is trivially prefix-closed, so it can leave the linear-walk path.
    fn reset_flag_if_empty(&mut self, slot: u32) {
        let w = self.worker(slot);
        if w.non_closed && w.is_empty() {
            self.set_non_closed(slot, false);
        }
    }

    fn set_non_closed(&mut self, slot: u32, flag: bool) {
        let w = self.worker_mut(slot);
        if w.non_closed != flag {
            w.non_closed = flag;
            let list = &mut self.non_closed_slots;
            match (list.binary_search(&slot), flag) {
                (Err(i), true) => list.insert(i, slot),
                (Ok(i), false) => {
                    list.remove(i);
                }
                _ => debug_assert!(false, "flag list out of step"),
            }
        }
    }

    /// Adds (slot, t) to the block's holders, and the block to the worker's log if it was not
    /// there.
    #[inline]
    fn insert_entry(&mut self, slot: u32, t: usize, hash: u64) {
        let holder = pack(slot, t);
        self.blocks.reserve_one();
        match self.blocks.find_slot(hash) {
            Probe::Found(i) => {
                if !self.blocks.at_mut(i).insert(holder, &mut self.spills) {
                    return;
                }
            }
            Probe::Vacant(i) => self.blocks.fill(i, hash, Holders::one(holder)),
        }
        self.entries += 1;
        let log = &mut self.slots[slot as usize]
            .as_mut()
            .expect("slot maps to a live worker")
            .tiers[t];
        log.push(hash, &mut self.scratch);
    }

    /// Removes (slot, t) from the block's holders and marks the worker's log entry stale; a
    /// holder that is not there is a no-op.
    #[inline]
    fn remove_entry(&mut self, slot: u32, t: usize, hash: u64) {
        if !self.unlink(slot, t, hash) {
            return;
        }
        let log = &mut self.slots[slot as usize]
            .as_mut()
            .expect("slot maps to a live worker")
            .tiers[t];
        log.removed(hash, &mut self.scratch);
    }

    /// Removes the holder from `blocks` without touching the worker's log; returns whether it
    /// was there.
    #[inline]
    fn unlink(&mut self, slot: u32, t: usize, hash: u64) -> bool {
        if self.blocks.len() == 0 {
            return false;
        }
        let Probe::Found(i) = self.blocks.find_slot(hash) else {
            return false;
        };
        match self
            .blocks
            .at_mut(i)
            .remove(pack(slot, t), &mut self.spills)
        {
            Removal::Absent => return false,
            Removal::Removed => {}
            Removal::Emptied => self.blocks.remove_at(i),
        }
        self.entries -= 1;
        true
    }

    /// Drops every block of one tier of a worker. Stale and repeated log entries unlink
    /// nothing.
    fn clear_tier(&mut self, slot: u32, t: usize) {
        let (hashes, live) = self.worker_mut(slot).tiers[t].take();
        let mut unlinked = 0;
        for h in hashes {
            unlinked += usize::from(self.unlink(slot, t, h));
        }
        debug_assert_eq!(unlinked, live, "log and holder lists disagree");
    }

    /// Drops every block of a worker, keeping its slot.
    fn clear_worker(&mut self, slot: u32) {
        for t in 0..3 {
            self.clear_tier(slot, t);
        }
        self.set_non_closed(slot, false);
    }
}

#[cfg(test)]
impl KvIndex {
    /// Panics unless the block map, the spill arena and the per-worker logs agree.
    pub(crate) fn check_invariants(&self) {
        let mut live = std::collections::BTreeMap::<u32, usize>::new();
        let mut entries = 0;
        let mut spilled = std::collections::BTreeMap::new();
        for (h, hs) in self.blocks.iter() {
            let list = hs.as_slice(&self.spills);
            assert!(!list.is_empty(), "empty holder list of {h}");
            assert!(list.windows(2).all(|p| p[0] < p[1]), "holders of {h}");
            if let Some(i) = hs.spill_index() {
                *spilled.entry(i).or_insert(0u32) += 1;
            }
            assert_eq!(hs.first_tiers(&self.spills), holders::first_tiers(list));
            entries += list.len();
            for &holder in list {
                let slot = holders::slot_of(holder);
                let t = holders::tier_of(holder) as usize;
                let w = self.slots[slot as usize]
                    .as_ref()
                    .expect("holder is a live worker");
                assert!(
                    w.tiers[t].entries().contains(&h),
                    "{h} missing from its log"
                );
                *live.entry(holder).or_default() += 1;
            }
        }
        assert_eq!(entries, self.entries);
        assert_eq!(spilled.len(), self.spills.len(), "leaked spilled lists");
        for (&i, &blocks) in &spilled {
            assert_eq!(self.spills.refs(i), blocks, "users of spilled list {i}");
        }
        let mut flagged = 0;
        for (slot, w) in self.slots.iter().enumerate() {
            let Some(w) = w else { continue };
            assert_eq!(self.slot_of.get(&w.id), Some(&(slot as u32)));
            flagged += usize::from(w.non_closed);
            for (t, log) in w.tiers.iter().enumerate() {
                let holder = pack(slot as u32, t);
                assert_eq!(log.live(), live.get(&holder).copied().unwrap_or(0));
            }
        }
        assert_eq!(flagged, self.non_closed_slots.len());
        assert!(self.non_closed_slots.windows(2).all(|p| p[0] < p[1]));
        assert!(self.scratch.is_empty());
        let ids: Vec<WorkerId> = self.by_id.iter().map(|&(id, _)| id).collect();
        assert!(ids.windows(2).all(|p| p[0] < p[1]));
        assert_eq!(ids.len(), self.slot_of.len());
    }
}

/// Approximate heap bytes of a hashbrown table with `capacity` usable slots of `entry` bytes:
/// buckets are a power of two at most 7/8 full, with one control byte each.
fn table_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        capacity.next_power_of_two().max(4)
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1)
}
