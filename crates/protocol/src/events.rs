//! KV events: what a worker announces about its cache (docs/ARCHITECTURE.md §4).
//!
//! Every worker numbers its events from 1 upward, one per event, with no holes; event id 0
//! means "nothing yet". A consumer that sees a hole must repair it (a range from the worker's
//! ring, or a full [`KvDump`]) and never apply past it.

use serde::{Deserialize, Serialize};

use crate::ids::{LocalBlockHash, SequenceHash, StorageTier, WorkerId};

/// One block in a `Stored` event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    pub sequence_hash: SequenceHash,
    pub local_hash: LocalBlockHash,
}

/// What happened to the worker's cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEventKind {
    /// Blocks now held in the event's tier. `blocks` is a chain: `blocks[0]`'s parent is
    /// `parent` (None for a first block), `blocks[i]`'s parent is `blocks[i-1]`.
    Stored {
        parent: Option<SequenceHash>,
        blocks: Vec<StoredBlock>,
    },
    /// Blocks no longer held in the event's tier.
    Removed { blocks: Vec<SequenceHash> },
    /// Every block of the event's tier is gone.
    Cleared,
}

/// One numbered event from one worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    pub worker_id: WorkerId,
    /// Per-worker, starts at 1, increases by exactly one per event.
    pub event_id: u64,
    pub tier: StorageTier,
    pub kind: KvEventKind,
}

impl KvEvent {
    /// Number of blocks this event touches (`Cleared` counts as one).
    pub fn block_count(&self) -> usize {
        match &self.kind {
            KvEventKind::Stored { blocks, .. } => blocks.len(),
            KvEventKind::Removed { blocks } => blocks.len(),
            KvEventKind::Cleared => 1,
        }
    }
}

/// A worker's whole cache state as of `last_event_id`: `Stored` events, parents before
/// children within each tier. Applying it replaces whatever a consumer knew of the worker, and
/// the consumer then expects event `last_event_id + 1`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvDump {
    pub worker_id: WorkerId,
    pub last_event_id: u64,
    pub events: Vec<KvEvent>,
}
