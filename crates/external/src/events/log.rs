//! [`RelayLog`]: numbers the mirror's changes as tandem events and keeps the recent ones.
//! Sans-IO.
//!
//! Event ids start at 1 and increase by one per event with no holes (docs/ARCHITECTURE.md §4), whatever
//! the engine's stream did: engine gaps and restarts show up as `Cleared` events, never as
//! holes in tandem's numbering. The ring is bounded by events and by blocks, so a consumer
//! that falls behind further than it holds gets `None` from [`RelayLog::since`] and asks for
//! a dump instead.

use std::collections::VecDeque;

use tandem_protocol::{KvDump, KvEvent, KvEventKind, StorageTier, WorkerId};

use super::mirror::KvMirror;

/// Default bound on the blocks the ring's events may carry together (about 16 MiB).
pub const DEFAULT_RING_BLOCKS: usize = 1 << 20;

/// The numbered tandem event stream of one relayed engine.
#[derive(Debug)]
pub struct RelayLog {
    worker_id: WorkerId,
    last_id: u64,
    ring: VecDeque<KvEvent>,
    capacity: usize,
    max_blocks: usize,
    ring_blocks: usize,
}

impl RelayLog {
    /// A log whose ring keeps the last `capacity` events (at least 1).
    pub fn new(worker_id: WorkerId, capacity: usize) -> Self {
        RelayLog {
            worker_id,
            last_id: 0,
            ring: VecDeque::new(),
            capacity: capacity.max(1),
            max_blocks: DEFAULT_RING_BLOCKS,
            ring_blocks: 0,
        }
    }

    /// Also bounds the blocks the ring's events carry together (at least 1); the newest
    /// event is always kept.
    pub fn with_max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks.max(1);
        self
    }

    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// Id of the latest event (0 before any).
    pub fn last_id(&self) -> u64 {
        self.last_id
    }

    /// Numbers `changes` (next ids, in order), keeps them in the ring and returns them.
    pub fn push(&mut self, changes: Vec<(StorageTier, KvEventKind)>) -> Vec<KvEvent> {
        let mut out = Vec::with_capacity(changes.len());
        for (tier, kind) in changes {
            self.last_id += 1;
            let event = KvEvent {
                worker_id: self.worker_id,
                event_id: self.last_id,
                tier,
                kind,
            };
            self.ring_blocks += event.block_count();
            self.ring.push_back(event.clone());
            out.push(event);
        }
        while self.ring.len() > self.capacity
            || (self.ring_blocks > self.max_blocks && self.ring.len() > 1)
        {
            if let Some(old) = self.ring.pop_front() {
                self.ring_blocks -= old.block_count();
            }
        }
        out
    }

    /// The events after `after`, in order (empty when `after` is the latest or beyond: the
    /// caller compares with [`RelayLog::last_id`] to tell), or `None` when the ring no longer
    /// holds them all.
    pub fn since(&self, after: u64) -> Option<Vec<KvEvent>> {
        if after >= self.last_id {
            return Some(Vec::new());
        }
        let oldest = self.ring.front().map_or(self.last_id + 1, |e| e.event_id);
        if after + 1 < oldest {
            return None;
        }
        let skip = usize::try_from(after + 1 - oldest).ok()?;
        Some(self.ring.iter().skip(skip).cloned().collect())
    }

    /// The mirror's whole state as of the latest event; the dump's events carry that id.
    pub fn dump(&self, mirror: &KvMirror) -> KvDump {
        let events = mirror
            .dump()
            .into_iter()
            .map(|(tier, kind)| KvEvent {
                worker_id: self.worker_id,
                event_id: self.last_id,
                tier,
                kind,
            })
            .collect();
        KvDump {
            worker_id: self.worker_id,
            last_event_id: self.last_id,
            events,
        }
    }
}
