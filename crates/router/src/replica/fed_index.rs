//! [`FedIndex`]: the exact KV index with its feed rules, fed by the same [`Input`]s as a
//! replica. A [`RoutingReplica`](super::RoutingReplica) holds one for its exact overlap; a
//! standalone indexer holds only this (it routes nothing, so it needs none of the rest).

use tandem_indexer::{FeedError, IndexFeed, Repair};

use super::{Input, KvSource};

/// The exact index and the rules that keep it true: an [`KvSource::Events`] worker is dumped
/// at join, repaired at a gap in its events or behind its load reports' `last_kv_event_id`,
/// and purged at leave; an [`KvSource::Approximate`] one is never a member (its events, should
/// any come, are dropped, and its reports say nothing).
#[derive(Debug, Default)]
pub struct FedIndex {
    feed: IndexFeed,
}

impl FedIndex {
    pub fn new() -> Self {
        FedIndex::default()
    }

    pub fn feed(&self) -> &IndexFeed {
        &self.feed
    }

    /// Applies what the cluster says; returns the repairs the index needs. Inputs that say
    /// nothing about what workers cache (placements, peers' tracker changes) change nothing.
    pub fn apply(&mut self, input: Input<'_>) -> Result<Vec<Repair>, FeedError> {
        Ok(match input {
            Input::Joined {
                worker,
                kv,
                device_blocks,
                ..
            } => match kv {
                // A (re-)join is a new cache: dumped again.
                KvSource::Events => self.feed.join(worker, device_blocks).into_iter().collect(),
                KvSource::Approximate => {
                    // Not (or no longer) a member: no dump, no repairs, and the blocks it had
                    // as an event worker leave the index.
                    self.feed.leave(worker);
                    Vec::new()
                }
            },
            Input::Left { worker } => {
                self.feed.leave(worker);
                Vec::new()
            }
            Input::KvEvents(batch) => self.feed.apply(batch),
            Input::Repaired { worker, reply } => {
                self.feed.repaired(worker, reply)?;
                Vec::new()
            }
            Input::RepairFailed { worker } => {
                self.feed.repair_failed(worker);
                Vec::new()
            }
            // Only members' event ids are checked: an approximate worker's says nothing.
            Input::LoadReport(r) => self
                .feed
                .report(r.worker_id, r.last_kv_event_id)
                .into_iter()
                .collect(),
            Input::Placed { .. } | Input::PeerSync(_) => Vec::new(),
        })
    }
}
