//! The numbered event stream of one worker's cache: changes are staged while a pool operation
//! runs (consecutive changes of the same kind and tier merged into one event), then numbered and
//! appended to a bounded ring of recent events that publishers and resyncing indexers read.

use std::collections::VecDeque;

use tandem_protocol::{KvEvent, KvEventKind, SequenceHash, StorageTier, StoredBlock, WorkerId};

/// The asked-for events have left the ring; the consumer needs a full dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("events after {requested} are gone: the oldest kept event is {oldest_kept}")]
pub struct EventsTooOld {
    pub requested: u64,
    pub oldest_kept: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct EventLog {
    worker_id: WorkerId,
    capacity: usize,
    ring: VecDeque<KvEvent>,
    last_id: u64,
    staged: Vec<(StorageTier, KvEventKind)>,
}

impl EventLog {
    pub(crate) fn new(worker_id: WorkerId, capacity: usize) -> Self {
        EventLog {
            worker_id,
            capacity: capacity.max(1),
            ring: VecDeque::with_capacity(capacity.clamp(1, 1 << 16)),
            last_id: 0,
            staged: Vec::new(),
        }
    }

    pub(crate) fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    pub(crate) fn last_id(&self) -> u64 {
        self.last_id
    }

    /// Stages a stored block. Extends the previous staged `Stored` of the same tier when this
    /// block's parent is that event's last block, so a chain stays one event.
    pub(crate) fn stored(
        &mut self,
        tier: StorageTier,
        parent: Option<SequenceHash>,
        block: StoredBlock,
    ) {
        if let Some((t, KvEventKind::Stored { blocks, .. })) = self.staged.last_mut()
            && *t == tier
            && parent.is_some()
            && blocks.last().map(|b| b.sequence_hash) == parent
        {
            blocks.push(block);
            return;
        }
        self.staged.push((
            tier,
            KvEventKind::Stored {
                parent,
                blocks: vec![block],
            },
        ));
    }

    /// Stages a removed block, merged into the previous staged `Removed` of the same tier.
    pub(crate) fn removed(&mut self, tier: StorageTier, hash: SequenceHash) {
        if let Some((t, KvEventKind::Removed { blocks })) = self.staged.last_mut()
            && *t == tier
        {
            blocks.push(hash);
            return;
        }
        self.staged
            .push((tier, KvEventKind::Removed { blocks: vec![hash] }));
    }

    pub(crate) fn cleared(&mut self, tier: StorageTier) {
        self.staged.push((tier, KvEventKind::Cleared));
    }

    /// Numbers the staged changes and appends them to the ring, dropping the oldest events
    /// beyond capacity.
    pub(crate) fn flush(&mut self) {
        for (tier, kind) in self.staged.drain(..) {
            self.last_id += 1;
            if self.ring.len() == self.capacity {
                self.ring.pop_front();
            }
            self.ring.push_back(KvEvent {
                worker_id: self.worker_id,
                event_id: self.last_id,
                tier,
                kind,
            });
        }
    }

    /// Events with ids greater than `after`, in order; empty when `after` is the latest.
    pub(crate) fn since(&self, after: u64) -> Result<Vec<KvEvent>, EventsTooOld> {
        if after >= self.last_id {
            return Ok(Vec::new());
        }
        let oldest_kept = self.ring.front().map_or(self.last_id + 1, |e| e.event_id);
        if after + 1 < oldest_kept {
            return Err(EventsTooOld {
                requested: after,
                oldest_kept,
            });
        }
        let skip = (after + 1 - oldest_kept) as usize;
        Ok(self.ring.iter().skip(skip).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use tandem_protocol::LocalBlockHash;

    use super::*;

    fn sb(h: u64) -> StoredBlock {
        StoredBlock {
            sequence_hash: SequenceHash(h),
            local_hash: LocalBlockHash(h),
        }
    }

    #[test]
    fn chains_merge_and_ids_are_contiguous() {
        let mut log = EventLog::new(WorkerId(1), 3);
        log.stored(StorageTier::Device, None, sb(1));
        log.stored(StorageTier::Device, Some(SequenceHash(1)), sb(2));
        log.stored(StorageTier::Device, Some(SequenceHash(9)), sb(3)); // not a chain: new event
        log.removed(StorageTier::Host, SequenceHash(5));
        log.removed(StorageTier::Host, SequenceHash(6));
        log.flush();
        let all = log.since(0).unwrap();
        assert_eq!(
            all.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert!(matches!(&all[0].kind, KvEventKind::Stored { blocks, .. } if blocks.len() == 2));
        assert!(matches!(&all[2].kind, KvEventKind::Removed { blocks } if blocks.len() == 2));
        assert_eq!(log.since(3).unwrap(), vec![]);
        assert_eq!(log.since(2).unwrap().len(), 1);
        // One more event pushes id 1 out of the ring.
        log.cleared(StorageTier::Device);
        log.flush();
        assert_eq!(
            log.since(0),
            Err(EventsTooOld {
                requested: 0,
                oldest_kept: 2
            })
        );
        assert_eq!(log.since(1).unwrap().len(), 3);
    }
}
