//! [`KvIndex`]: the single-threaded core of the global KV index.
//!
//! Layout:
//! - `blocks`: sequence hash → [`Holders`] (packed (worker slot, tier) pairs). This is what
//!   `find_matches` reads.
//! - `slots`: dense worker slots. Each worker's state keeps its last applied event id, one set of
//!   block hashes per tier (so `Cleared`, `remove_worker` and `replace_worker` cost
//!   O(the worker's blocks), not O(all blocks)) and the `non_closed` flag.
//! - `slot_of` / `by_id`: worker id → slot, and the workers sorted by id for ordered output.
//!
//! Invariant: `(h, w, t)` is in `slots[w].tiers[t]` exactly when `pack(w, t)` is in
//! `blocks[h]`, and no `Holders` in `blocks` is empty. The per-worker sets are the source of
//! truth; `blocks` is their inverted index.

mod holders;
mod matches;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use tandem_protocol::{KvDump, KvEvent, KvEventKind, SequenceHash, StorageTier, WorkerId};

use crate::error::IndexError;
use crate::hash::{MixMap, MixSet};
use holders::{Holders, MAX_SLOTS, pack};
pub use matches::{OverlapScores, TierCounts};

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
    /// Block hashes held per tier index.
    tiers: [MixSet<u64>; 3],
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

    /// Whether the worker holds `hash` at level `tier` or better.
    #[inline]
    fn holds_at_or_below(&self, hash: u64, tier: usize) -> bool {
        self.tiers[..=tier].iter().any(|s| s.contains(&hash))
    }

    fn is_empty(&self) -> bool {
        self.tiers.iter().all(|s| s.is_empty())
    }
}

/// The global KV index: which worker holds which block in which tier.
///
/// Synchronous and I/O-free; wrap it in [`crate::ShardedIndex`] for concurrent use.
#[derive(Debug, Default)]
pub struct KvIndex {
    blocks: MixMap<u64, Holders>,
    slots: Vec<Option<WorkerState>>,
    free_slots: Vec<u32>,
    slot_of: MixMap<WorkerId, u32>,
    /// All workers sorted by id, so results come out ordered without sorting them per query.
    by_id: Vec<(WorkerId, u32)>,
    /// Resident (block, worker, tier) entries.
    entries: usize,
    /// Workers flagged `non_closed`; when zero (the normal case) queries skip the per-worker
    /// flag check, which would touch every candidate's state.
    non_closed_workers: usize,
}

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
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
        let w = self.worker(slot);
        let closed = dump.events.iter().all(|e| match &e.kind {
            KvEventKind::Stored {
                parent: Some(p), ..
            } => w.holds_at_or_below(p.0, e.tier.index()),
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
        let w = self.worker(*self.slot_of.get(&worker)?);
        let mut out = WorkerBlocks::default();
        for tier in StorageTier::ALL {
            out.tier_mut(tier)
                .extend(w.tiers[tier.index()].iter().map(|&h| SequenceHash(h)));
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

    /// Estimated heap bytes owned by the index, from table capacities (O(blocks): it visits
    /// spilled holder sets). Divide by [`KvIndex::num_entries`] for the per-entry cost.
    pub fn heap_bytes(&self) -> usize {
        let spilled: usize = self.blocks.values().map(Holders::heap_bytes).sum();
        let sets: usize = self
            .slots
            .iter()
            .flatten()
            .flat_map(|w| w.tiers.iter())
            .map(|s| table_bytes(s.capacity(), size_of::<u64>()))
            .sum();
        table_bytes(self.blocks.capacity(), size_of::<(u64, Holders)>())
            + spilled
            + sets
            + table_bytes(self.slot_of.capacity(), size_of::<(WorkerId, u32)>())
            + self.slots.capacity() * size_of::<Option<WorkerState>>()
            + self.by_id.capacity() * size_of::<(WorkerId, u32)>()
            + self.free_slots.capacity() * size_of::<u32>()
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
                    if !self.worker(slot).holds_at_or_below(p.0, t) {
                        self.set_non_closed(slot, true);
                    }
                }
                for b in blocks {
                    self.insert_entry(slot, t, b.sequence_hash.0);
                }
            }
            KvEventKind::Removed { blocks } => {
                for b in blocks {
                    self.remove_entry(slot, t, b.0);
                }
                self.reset_flag_if_empty(slot);
            }
            KvEventKind::Cleared => {
                let set = std::mem::take(&mut self.worker_mut(slot).tiers[t]);
                for h in set {
                    self.unlink(slot, t, h);
                }
                self.reset_flag_if_empty(slot);
            }
        }
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
            if flag {
                self.non_closed_workers += 1;
            } else {
                self.non_closed_workers -= 1;
            }
        }
    }

    #[inline]
    fn insert_entry(&mut self, slot: u32, t: usize, hash: u64) {
        let w = self.slots[slot as usize]
            .as_mut()
            .expect("slot maps to a live worker");
        if !w.tiers[t].insert(hash) {
            return;
        }
        let holder = pack(slot, t);
        self.blocks
            .entry(hash)
            .and_modify(|hs| hs.push(holder))
            .or_insert_with(|| Holders::one(holder));
        self.entries += 1;
    }

    #[inline]
    fn remove_entry(&mut self, slot: u32, t: usize, hash: u64) {
        if self.worker_mut(slot).tiers[t].remove(&hash) {
            self.unlink(slot, t, hash);
        }
    }

    /// Removes the holder from `blocks` (the worker's set was already updated).
    #[inline]
    fn unlink(&mut self, slot: u32, t: usize, hash: u64) {
        // No let-chains: the workspace's rust-version (1.85) predates them.
        if let hashbrown::hash_map::Entry::Occupied(mut e) = self.blocks.entry(hash) {
            if e.get_mut().remove(pack(slot, t)) {
                self.entries -= 1;
                if e.get().is_empty() {
                    e.remove();
                }
            }
        }
    }

    /// Drops every block of a worker, keeping its slot.
    fn clear_worker(&mut self, slot: u32) {
        for t in 0..3 {
            let set = std::mem::take(&mut self.worker_mut(slot).tiers[t]);
            for h in set {
                self.unlink(slot, t, h);
            }
        }
        self.set_non_closed(slot, false);
    }
}

#[cfg(test)]
impl KvIndex {
    /// Panics unless the block map is exactly the inverse of the per-worker sets.
    pub(crate) fn check_invariants(&self) {
        let mut expected: std::collections::BTreeMap<u64, Vec<u32>> = Default::default();
        let mut entries = 0;
        let mut flagged = 0;
        for (slot, w) in self.slots.iter().enumerate() {
            let Some(w) = w else { continue };
            assert_eq!(self.slot_of.get(&w.id), Some(&(slot as u32)));
            flagged += usize::from(w.non_closed);
            for (t, set) in w.tiers.iter().enumerate() {
                for &h in set {
                    expected.entry(h).or_default().push(pack(slot as u32, t));
                    entries += 1;
                }
            }
        }
        assert_eq!(entries, self.entries);
        assert_eq!(flagged, self.non_closed_workers);
        assert_eq!(expected.len(), self.blocks.len());
        for (h, mut holders) in expected {
            holders.sort_unstable();
            assert_eq!(self.blocks[&h].as_slice(), &holders[..], "holders of {h}");
        }
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
