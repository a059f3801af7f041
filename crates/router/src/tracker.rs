//! The active-sequence tracker: per worker, what the routers have sent it that is not
//! finished (docs/ARCHITECTURE.md §5), shared between router replicas by [`SyncMessage`]s.
//!
//! # What it counts
//!
//! - `active_prefill_tokens`: prompt tokens routed and not yet prefilled. The caller passes the
//!   tokens the worker must compute (prompt minus what it has cached), since cached tokens
//!   cost no prefill time. They leave at the first token ([`ActiveSequences::prefill_done`]).
//! - `potential_decode_blocks`: the KV blocks the worker's in-flight requests hold or will hold:
//!   their distinct full prompt blocks — a block shared by several requests on one worker is
//!   one block in its pool, so it is counted once (see [Distinct blocks](#distinct-blocks)) — plus
//!   each request's *private* blocks: its trailing partial prompt block and the blocks its
//!   expected output will fill ([`NewSequence::private_blocks_for`]). Counting the expected
//!   output is deliberate: a long generation holds its KV until the end, and a worker full of
//!   them is about to preempt or stall. A caller with no estimate passes 0 expected tokens.
//! - `active_requests`: requests added and not freed, queued ones included.
//!
//! # Distinct blocks
//!
//! Sequence hashes chain (each names its whole prefix, docs/ARCHITECTURE.md §2), so two
//! prompts share exactly their longest common prefix of hashes. A worker's prompts in flight
//! are kept sorted; the distinct blocks among them are the sum of their lengths less the
//! common prefix of each sorted neighbour pair (the nodes of their trie). A request that joins
//! or leaves changes the count by its length less its longer common prefix with its two
//! neighbours: a few comparisons of hashes it shares, not a reference count per block, which
//! at 256 blocks a prompt over hundreds of workers' cold maps was most of a routing
//! decision's booking (crates/router/BENCHMARKS.md). For hash lists that do not chain (a
//! malformed peer message) the same sum counts their distinct prefixes: still bounded by
//! their lengths, and the same whatever order the messages come in.
//!
//! # Replica sync
//!
//! Every local change returns the [`SyncMessage`] to publish; peers feed theirs to
//! [`ActiveSequences::apply`]. A sequence's state only moves up a lattice — unknown → added →
//! prefill done → freed, where "prefill done" and "freed" may arrive before the add — and an
//! add's content is fixed by the first add seen. Applying messages is therefore idempotent,
//! commutative and associative: duplicates, replays and reorderings yield the same loads as
//! applying each message once in order. A freed sequence is kept as a tombstone (without its
//! blocks) for [`TrackerConfig::tombstone_ms`] so that a late or replayed add cannot resurrect it; hence a request routed again (a retry, a
//! migration) must be tracked under a fresh request id. A replica ignores its own messages
//! coming back from the event plane.
//!
//! # Expiry
//!
//! A sequence whose end was never seen (a lost free, a crashed peer) expires one TTL after it
//! was first seen, and becomes a tombstone like a freed one. Time is passed in; a clock that
//! goes backwards is treated as the latest time seen.

use std::cmp::Ordering;
use std::collections::{BTreeSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Bound;
use std::sync::Arc;

use hashbrown::HashMap;

use serde::{Deserialize, Serialize};
use tandem_protocol::{BlockSize, Envelope, MessageKind, RequestId, SequenceHash, WorkerId};

use crate::view::WorkerLoad;

/// A router replica's identity, unique among the replicas sharing one view.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct RouterId(pub u64);

/// One change of the shared view, published on the event plane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyncMessage {
    /// A request was routed to `worker`.
    Add {
        router: RouterId,
        request: RequestId,
        worker: WorkerId,
        blocks: Vec<SequenceHash>,
        prefill_tokens: u64,
        private_blocks: u64,
    },
    /// The request's first token arrived: its prefill load is gone.
    PrefillDone {
        router: RouterId,
        request: RequestId,
    },
    /// The request ended (finished, cancelled, failed): all its load is gone.
    Free {
        router: RouterId,
        request: RequestId,
    },
}

/// Sync messages travel in the event plane's versioned envelope.
impl Envelope for SyncMessage {
    const KIND: MessageKind = MessageKind::RouterSync;
}

/// A replica's presence, on the companion subject of the sync messages: a replica publishes
/// its [`SyncMessage`]s only while it hears peers (the frontend's `cluster/sync.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncHello {
    pub router: RouterId,
    /// An answer to another replica's hello (answers are not answered).
    pub answer: bool,
}

impl Envelope for SyncHello {
    const KIND: MessageKind = MessageKind::RouterHello;
}

impl SyncMessage {
    /// The replica that made the change.
    pub fn router(&self) -> RouterId {
        match self {
            SyncMessage::Add { router, .. }
            | SyncMessage::PrefillDone { router, .. }
            | SyncMessage::Free { router, .. } => *router,
        }
    }

    pub fn request(&self) -> RequestId {
        match self {
            SyncMessage::Add { request, .. }
            | SyncMessage::PrefillDone { request, .. }
            | SyncMessage::Free { request, .. } => *request,
        }
    }
}

/// A request just routed, as the local router records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewSequence {
    pub request: RequestId,
    pub worker: WorkerId,
    /// Sequence hashes of the prompt's full blocks.
    pub blocks: Vec<SequenceHash>,
    /// Prompt tokens the worker must compute (not cached there).
    pub prefill_tokens: u64,
    /// Blocks only this request uses ([`NewSequence::private_blocks_for`]).
    pub private_blocks: u64,
}

impl NewSequence {
    /// Blocks of a request beyond its full prompt blocks: the partial last prompt block and
    /// the blocks `expected_output_tokens` will fill.
    pub fn private_blocks_for(
        prompt_tokens: u64,
        expected_output_tokens: u64,
        block_size: BlockSize,
    ) -> u64 {
        let bs = u64::from(block_size.get());
        (prompt_tokens + expected_output_tokens).div_ceil(bs) - prompt_tokens / bs
    }
}

/// Knobs of the tracker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrackerConfig {
    /// How long a sequence may stay without its free before it is dropped, in
    /// milliseconds. Longer than any request should live.
    pub ttl_ms: u64,
    /// How long a freed sequence is remembered (without its blocks), so that a late or
    /// replayed add cannot resurrect it: longer than messages can be delayed on the event
    /// plane, far shorter than `ttl_ms` — every request served in this time is held.
    pub tombstone_ms: u64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            ttl_ms: 600_000,
            tombstone_ms: 30_000,
        }
    }
}

/// One worker's tracked load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackedLoad {
    pub active_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
}

impl TrackedLoad {
    /// As a [`WorkerLoad`] with no report folded in yet.
    pub fn to_worker_load(self) -> WorkerLoad {
        WorkerLoad {
            active_prefill_tokens: self.active_prefill_tokens,
            potential_decode_blocks: self.potential_decode_blocks,
            active_requests: self.active_requests,
            kv_usage: 0.0,
        }
    }
}

type Key = (RouterId, RequestId);

/// Hasher for keys made of u64 words (ids are counters): a multiply-fold per word, for the
/// maps every request and sync message looks up.
#[derive(Default)]
struct WordHasher(u64);

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(w));
        }
    }

    fn write_u64(&mut self, n: u64) {
        let m = u128::from(self.0 ^ n) * 0x9E37_79B9_7F4A_7C15;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

type WordMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;

#[derive(Clone, Debug)]
struct AddInfo {
    worker: WorkerId,
    blocks: Arc<[SequenceHash]>,
    prefill_tokens: u64,
    private_blocks: u64,
}

/// One sequence's place in the lattice.
#[derive(Clone, Debug)]
struct Entry {
    add: Option<AddInfo>,
    prefill_done: bool,
    freed: bool,
    /// When the entry next moves on (live → tombstone → gone); matches its queue item.
    deadline_ms: u64,
}

impl Entry {
    fn active(&self) -> bool {
        self.add.is_some() && !self.freed
    }
}

/// One request's prompt in a worker's sorted set: by its hashes, then by the request.
#[derive(Clone, Debug)]
struct Prompt {
    blocks: Arc<[SequenceHash]>,
    key: Key,
}

impl PartialEq for Prompt {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Prompt {}

impl PartialOrd for Prompt {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Prompt {
    fn cmp(&self, other: &Self) -> Ordering {
        self.blocks[..]
            .cmp(&other.blocks[..])
            .then(self.key.cmp(&other.key))
    }
}

/// The length of the common prefix of two prompts' hashes.
fn common(a: &Prompt, b: &Prompt) -> u64 {
    a.blocks
        .iter()
        .zip(b.blocks.iter())
        .take_while(|(x, y)| x == y)
        .count() as u64
}

#[derive(Clone, Debug, Default)]
struct WorkerState {
    /// The prompts of its requests in flight, sorted (the module docs' *Distinct blocks*).
    prompts: BTreeSet<Prompt>,
    /// The distinct full prompt blocks among them.
    distinct: u64,
    private_blocks: u64,
    prefill_tokens: u64,
    requests: u64,
    /// Requests that have ended on it, ever (a counter, for [`ActiveSequences::ended`]).
    ended: u64,
    /// Listed in [`ActiveSequences::dirty`].
    dirty: bool,
}

impl WorkerState {
    /// The blocks `p` adds to the others' (its length less its longer common prefix with
    /// its neighbours in the sorted set); `p` itself must not be in the set.
    fn own_blocks(&self, p: &Prompt) -> u64 {
        let before = self.prompts.range(..p).next_back();
        let after = self
            .prompts
            .range((Bound::Excluded(p), Bound::Unbounded))
            .next();
        let shared = before
            .map_or(0, |b| common(b, p))
            .max(after.map_or(0, |a| common(p, a)));
        p.blocks.len() as u64 - shared
    }
}

/// A change to one entry, the lattice's join operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Add,
    PrefillDone,
    Free,
}

/// The largest prompt-token or private-block count a peer's `Add` may carry (2^40): far
/// beyond any request, small enough that no sum of live requests overflows.
const PEER_LIMIT: u64 = 1 << 40;

/// The active-sequence tracker of one router replica.
#[derive(Debug)]
pub struct ActiveSequences {
    me: RouterId,
    config: TrackerConfig,
    entries: WordMap<Key, Entry>,
    workers: WordMap<WorkerId, WorkerState>,
    /// (deadline, key) of live sequences, in deadline order since time never goes
    /// backwards inside.
    expiry: VecDeque<(u64, Key)>,
    /// (deadline, key) of tombstones, likewise (a shorter time: its own queue keeps the order).
    tombstones: VecDeque<(u64, Key)>,
    now_ms: u64,
    /// Workers whose load changed since [`ActiveSequences::take_dirty`] last ran, each once
    /// (bounded by the workers).
    dirty: Vec<WorkerId>,
}

impl ActiveSequences {
    pub fn new(me: RouterId, config: TrackerConfig) -> Self {
        ActiveSequences {
            me,
            config,
            entries: WordMap::default(),
            workers: WordMap::default(),
            expiry: VecDeque::new(),
            tombstones: VecDeque::new(),
            now_ms: 0,
            dirty: Vec::new(),
        }
    }

    pub fn router_id(&self) -> RouterId {
        self.me
    }

    /// Records a request routed by this replica; returns the message to publish.
    pub fn add(&mut self, seq: NewSequence, now_ms: u64) -> SyncMessage {
        let msg = SyncMessage::Add {
            router: self.me,
            request: seq.request,
            worker: seq.worker,
            blocks: seq.blocks,
            prefill_tokens: seq.prefill_tokens,
            private_blocks: seq.private_blocks,
        };
        self.merge(&msg, now_ms);
        msg
    }

    /// Records this replica's request's first token; returns the message to publish.
    pub fn prefill_done(&mut self, request: RequestId, now_ms: u64) -> SyncMessage {
        let msg = SyncMessage::PrefillDone {
            router: self.me,
            request,
        };
        self.merge(&msg, now_ms);
        msg
    }

    /// Records the end of this replica's request; returns the message to publish.
    pub fn free(&mut self, request: RequestId, now_ms: u64) -> SyncMessage {
        let msg = SyncMessage::Free {
            router: self.me,
            request,
        };
        self.merge(&msg, now_ms);
        msg
    }

    /// Applies a peer's message. Returns whether the loads changed; our own messages (echoed
    /// by the event plane) are ignored.
    pub fn apply(&mut self, msg: &SyncMessage, now_ms: u64) -> bool {
        if msg.router() == self.me {
            return false;
        }
        // A peer's numbers beyond any real request (a corrupt or hostile message) are
        // dropped: summed over requests they could only make loads meaningless.
        if let SyncMessage::Add {
            prefill_tokens,
            private_blocks,
            ..
        } = msg
            && (*prefill_tokens > PEER_LIMIT || *private_blocks > PEER_LIMIT)
        {
            return false;
        }
        self.merge(msg, now_ms)
    }

    /// A worker's tracked load (zero for a worker with nothing in flight).
    pub fn load(&self, worker: WorkerId) -> TrackedLoad {
        self.workers
            .get(&worker)
            .map_or_else(TrackedLoad::default, |w| TrackedLoad {
                active_prefill_tokens: w.prefill_tokens,
                potential_decode_blocks: w.distinct.saturating_add(w.private_blocks),
                active_requests: w.requests,
            })
    }

    /// How many requests have ended on `worker` (finished, failed, freed by a peer or
    /// expired), counted since it was first tracked: two readings tell how many ended in
    /// between.
    pub fn ended(&self, worker: WorkerId) -> u64 {
        self.workers.get(&worker).map_or(0, |w| w.ended)
    }

    /// Moves the workers whose load changed since the last call into `out` (each once):
    /// for a caller that keeps its own order of the loads up to date.
    pub fn take_dirty(&mut self, out: &mut Vec<WorkerId>) {
        for w in self.dirty.drain(..) {
            if let Some(state) = self.workers.get_mut(&w) {
                state.dirty = false;
            }
            out.push(w);
        }
    }

    /// Requests in flight on all workers.
    pub fn active_requests(&self) -> u64 {
        self.workers.values().map(|w| w.requests).sum()
    }

    /// Items in the expiry queues (memory use).
    pub fn expiry_len(&self) -> usize {
        self.expiry.len() + self.tombstones.len()
    }

    /// Entries held, tombstones included (memory use).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops a worker that left the pool: its sequences become tombstones.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let keys: Vec<Key> = self
            .entries
            .iter()
            .filter(|(_, e)| e.active() && e.add.as_ref().is_some_and(|a| a.worker == worker))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            self.step(k, Step::Free, None);
        }
        if self.workers.remove(&worker).is_some_and(|w| !w.dirty) {
            self.dirty.push(worker);
        }
    }

    /// Moves on every entry whose deadline has passed at `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        while let Some(&(deadline, key)) = self.tombstones.front() {
            if deadline > self.now_ms {
                break;
            }
            self.tombstones.pop_front();
            if self
                .entries
                .get(&key)
                .is_some_and(|e| e.freed && e.deadline_ms == deadline)
            {
                self.entries.remove(&key);
            }
        }
        while let Some(&(deadline, key)) = self.expiry.front() {
            if deadline > self.now_ms {
                break;
            }
            self.expiry.pop_front();
            let Some(e) = self.entries.get(&key) else {
                continue;
            };
            if e.freed || e.deadline_ms != deadline {
                continue; // a tombstone now (its own queue), or a superseded item
            }
            // Also covers a prefill-done whose add never came.
            self.step(key, Step::Free, None);
        }
        // Items of sequences freed before their TTL stay queued until it passes: compacted
        // once they outnumber the entries, so the queue is bounded by what is tracked, not
        // by every request of the last TTL. `retain` keeps the deadline order.
        if self.expiry.len() > 2 * self.entries.len() + 1024 {
            let entries = &self.entries;
            self.expiry.retain(|(d, k)| {
                entries
                    .get(k)
                    .is_some_and(|e| !e.freed && e.deadline_ms == *d)
            });
        }
    }

    fn merge(&mut self, msg: &SyncMessage, now_ms: u64) -> bool {
        self.expire(now_ms);
        let key = (msg.router(), msg.request());
        match msg {
            SyncMessage::Add {
                worker,
                blocks,
                prefill_tokens,
                private_blocks,
                ..
            } => {
                let info = AddInfo {
                    worker: *worker,
                    blocks: Arc::from(&blocks[..]),
                    prefill_tokens: *prefill_tokens,
                    private_blocks: *private_blocks,
                };
                self.step(key, Step::Add, Some(info))
            }
            SyncMessage::PrefillDone { .. } => self.step(key, Step::PrefillDone, None),
            SyncMessage::Free { .. } => self.step(key, Step::Free, None),
        }
    }

    /// Joins one step into an entry and moves the worker counts by the difference.
    fn step(&mut self, key: Key, step: Step, info: Option<AddInfo>) -> bool {
        let deadline = self.now_ms.saturating_add(self.config.ttl_ms);
        let mut fresh = false;
        let e = self.entries.entry(key).or_insert_with(|| {
            fresh = true;
            Entry {
                add: None,
                prefill_done: false,
                freed: false,
                deadline_ms: deadline,
            }
        });
        let (was_active, was_pending) = (e.active(), e.active() && !e.prefill_done);
        let mut tombstone = None;
        match step {
            // A late add of a freed sequence changes nothing, and is not kept.
            Step::Add if e.add.is_none() && !e.freed => e.add = info,
            Step::PrefillDone => e.prefill_done = true,
            Step::Free if !e.freed => {
                e.freed = true;
                // A tombstone lives for the tombstone time from its free.
                let until = self.now_ms.saturating_add(self.config.tombstone_ms);
                e.deadline_ms = until;
                tombstone = Some(until);
                fresh = false;
            }
            _ => {}
        }
        let (now_active, now_pending) = (e.active(), e.active() && !e.prefill_done);
        if fresh {
            self.expiry.push_back((deadline, key));
        }
        if let Some(until) = tombstone {
            self.tombstones.push_back((until, key));
        }
        let changed = was_active != now_active || was_pending != now_pending;
        let Some(add) = e.add.as_ref().filter(|_| changed) else {
            return false;
        };
        let w = self.workers.entry(add.worker).or_default();
        if !w.dirty {
            w.dirty = true;
            self.dirty.push(add.worker);
        }
        if !was_active && now_active {
            let p = Prompt {
                blocks: Arc::clone(&add.blocks),
                key,
            };
            w.distinct = w.distinct.saturating_add(w.own_blocks(&p));
            w.prompts.insert(p);
            w.private_blocks = w.private_blocks.saturating_add(add.private_blocks);
            w.requests += 1;
        }
        if !was_pending && now_pending {
            w.prefill_tokens = w.prefill_tokens.saturating_add(add.prefill_tokens);
        }
        if was_pending && !now_pending {
            w.prefill_tokens = w.prefill_tokens.saturating_sub(add.prefill_tokens);
        }
        if was_active && !now_active {
            let p = Prompt {
                blocks: Arc::clone(&add.blocks),
                key,
            };
            if w.prompts.remove(&p) {
                w.distinct = w.distinct.saturating_sub(w.own_blocks(&p));
            }
            w.private_blocks = w.private_blocks.saturating_sub(add.private_blocks);
            // An idle worker keeps its (empty) state and stays listed: departed workers go
            // through `remove_worker`.
            w.requests -= 1;
            w.ended += 1;
        }
        if !now_active && e.freed {
            // A tombstone needs no content: its blocks would be held for nothing.
            e.add = None;
        }
        true
    }
}
