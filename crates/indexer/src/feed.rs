//! [`IndexFeed`]: the rules that keep a [`KvIndex`] true to the workers it mirrors
//! (docs/ARCHITECTURE.md §4), as a sans-IO state machine. The shell (the frontend's event-plane
//! subscriber, the standalone indexer, the simulator) hands it what arrives — membership
//! changes, KV event batches, load reports — and performs the [`Repair`]s it asks for
//! (a range of events from the worker's ring, or a dump), handing the answer back with
//! [`IndexFeed::repaired`].
//!
//! # Rules
//! - A worker that joins is dumped, and its index entries replaced by the dump.
//! - Events are applied in id order per worker. A gap (a lost batch, a restarted event plane)
//!   is never applied past: the worker is asked for the events after the last applied one.
//!   Events that arrive for a worker while it is being repaired are dropped: the repair's answer
//!   covers them or a later gap shows them.
//! - A worker that numbers from 1 again (an event 1 that the index already has) restarted under
//!   the same id: its old blocks are gone, so it is dumped.
//! - A lost *trailing* batch shows no gap by itself: each load report carries the worker's
//!   last event id, and when the index is still behind the id of the *previous* report (one
//!   report of slack for events still in flight), the worker is repaired.
//! - A worker that leaves is purged. Events and reports of non-members are dropped: the dump at
//!   join covers them.
//! - At most one repair per worker is outstanding.

use tandem_protocol::{KvDump, KvEvent, SequenceHash, WorkerId};

use crate::error::IndexError;
use crate::hash::MixMap;
use crate::index::{ApplyOutcome, Extents, KvIndex, OverlapScores};

/// What the shell must fetch from `worker` to bring the index back in step: its events after
/// `after`, or (when `dump`) its whole state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repair {
    pub worker: WorkerId,
    pub after: u64,
    pub dump: bool,
}

/// A worker's answer to a [`Repair`].
#[derive(Clone, Debug, PartialEq)]
pub enum RepairReply {
    /// Events after the requested id, in order.
    Events(Vec<KvEvent>),
    /// The worker's whole state.
    Dump(KvDump),
}

/// Why a repair answer was not applied. The worker stays as it was; the next gap or load
/// report asks again.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    #[error("the repair range of worker {0} has a gap")]
    RangeGap(WorkerId),
    #[error("asked worker {asked} for a dump, got worker {got}'s")]
    WrongDump { asked: WorkerId, got: WorkerId },
    #[error(transparent)]
    Index(#[from] IndexError),
}

/// Counters of the feed, for `/metrics`, tests and the simulator's report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedStats {
    pub events_applied: u64,
    pub gaps: u64,
    pub repairs: u64,
    pub dumps_applied: u64,
    pub workers_purged: u64,
}

/// Troubles within this many of a worker's applied events make its stream troubled.
const TROUBLE_WINDOW: u64 = 10_000;
/// Troubles that many within [`TROUBLE_WINDOW`] events.
const TROUBLES: usize = 3;

/// How one worker's event stream has fared, for the cache health: a stream that keeps
/// losing events leaves the index behind the worker's cache, each time until a repair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamHealth {
    /// Its events applied (streamed or replayed by a repair).
    pub applied: u64,
    /// Gaps in its events: batches lost or reordered on the event plane (a restart, which
    /// numbers from 1 again, is not one).
    pub gaps: u64,
    /// Load reports that found the index behind the events the worker had published: a
    /// trailing batch lost, or events slower than its reports.
    pub behind: u64,
    /// Repairs the worker did not answer.
    pub failed_repairs: u64,
    /// `applied` at each of the last [`TROUBLES`] troubles, oldest first.
    recent: [u64; TROUBLES],
    /// Troubles recorded in `recent` (at most [`TROUBLES`]).
    recorded: usize,
}

impl StreamHealth {
    /// Whether troubles keep coming: [`TROUBLES`] of them within its last
    /// [`TROUBLE_WINDOW`] applied events. An occasional loss, repaired, is not a finding.
    pub fn troubled(&self) -> bool {
        self.recorded == TROUBLES && self.applied - self.recent[0] <= TROUBLE_WINDOW
    }

    fn trouble(&mut self) {
        if self.recorded == TROUBLES {
            self.recent.rotate_left(1);
            self.recent[TROUBLES - 1] = self.applied;
        } else {
            self.recent[self.recorded] = self.applied;
            self.recorded += 1;
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Member {
    repairing: bool,
    health: StreamHealth,
    /// Capacity of its GPU tier, as its record says.
    device_blocks: u64,
    /// `last_kv_event_id` of the worker's previous load report.
    reported: Option<u64>,
}

/// An index and the rules that feed it (see the module docs).
#[derive(Debug, Default)]
pub struct IndexFeed {
    index: KvIndex,
    members: MixMap<WorkerId, Member>,
    stats: FeedStats,
}

impl IndexFeed {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    pub fn stats(&self) -> FeedStats {
        self.stats
    }

    pub fn is_member(&self, worker: WorkerId) -> bool {
        self.members.contains_key(&worker)
    }

    /// How a member's event stream has fared since it joined.
    pub fn stream_health(&self, worker: WorkerId) -> Option<StreamHealth> {
        self.members.get(&worker).map(|m| m.health)
    }

    /// The members whose streams are troubled ([`StreamHealth::troubled`]), by worker id.
    pub fn troubled_streams(&self) -> Vec<(WorkerId, StreamHealth)> {
        let mut out: Vec<(WorkerId, StreamHealth)> = self
            .members
            .iter()
            .filter(|(_, m)| m.health.troubled())
            .map(|(w, m)| (*w, m.health))
            .collect();
        out.sort_unstable_by_key(|(w, _)| *w);
        out
    }

    /// Per worker, the leading blocks of `hashes` it holds, by tier.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        self.index.find_matches(hashes)
    }

    /// The same answer grouped by shared extent ([`KvIndex::find_extents`]).
    pub fn find_extents(&self, hashes: &[SequenceHash]) -> Extents<'_> {
        self.index.find_extents(hashes)
    }

    /// A worker joined, or re-joined with a new record (a restart: its cache is new too):
    /// it is dumped. `device_blocks` is its GPU tier's capacity (its record's `kv_capacity`,
    /// 0 when unknown): the index reserves room for the members' GPU blocks together, so that
    /// its block map grows while workers join rather than under their first flood of events
    /// (crates/indexer/BENCHMARKS.md, 2026-12-06: 1.7× the apply rate at 1,000 workers).
    /// Host and disk tiers, often far larger and rarely full, grow the map as they fill.
    pub fn join(&mut self, worker: WorkerId, device_blocks: u64) -> Option<Repair> {
        self.members.entry(worker).or_default().device_blocks = device_blocks;
        let total: u64 = self.members.values().map(|m| m.device_blocks).sum();
        self.index
            .reserve(usize::try_from(total).unwrap_or(usize::MAX));
        self.start_repair(worker, true)
    }

    /// A worker left: its blocks leave the index. Returns whether it was a member.
    pub fn leave(&mut self, worker: WorkerId) -> bool {
        self.index.remove_worker(worker);
        let was = self.members.remove(&worker).is_some();
        if was {
            self.stats.workers_purged += 1;
        }
        was
    }

    /// Applies a batch of events (any workers, each worker's in id order); returns the repairs
    /// the batch showed to be needed.
    pub fn apply(&mut self, batch: &[KvEvent]) -> Vec<Repair> {
        let mut repairs: Vec<Repair> = Vec::new();
        for ev in batch {
            let w = ev.worker_id;
            let Some(m) = self.members.get_mut(&w).filter(|m| !m.repairing) else {
                continue;
            };
            let dump = match self.index.apply(ev) {
                ApplyOutcome::Applied => {
                    self.stats.events_applied += 1;
                    m.health.applied += 1;
                    continue;
                }
                ApplyOutcome::Duplicate if ev.event_id == 1 => true,
                ApplyOutcome::Duplicate => continue,
                ApplyOutcome::Gap { .. } => {
                    m.health.gaps += 1;
                    m.health.trouble();
                    false
                }
            };
            self.stats.gaps += 1;
            repairs.extend(self.start_repair(w, dump));
        }
        repairs
    }

    /// A load report of `worker` saying its last published event is `last_kv_event_id`.
    pub fn report(&mut self, worker: WorkerId, last_kv_event_id: u64) -> Option<Repair> {
        let m = self.members.get_mut(&worker)?;
        let previous = m.reported.replace(last_kv_event_id);
        let applied = self.index.last_event_id(worker).unwrap_or(0);
        if previous.is_some_and(|p| p > applied) {
            // Reports that find it behind while a repair runs are the same trouble.
            if !m.repairing {
                m.health.behind += 1;
                m.health.trouble();
            }
            self.stats.gaps += 1;
            return self.start_repair(worker, false);
        }
        None
    }

    /// Applies a worker's answer to a repair (or a dump it sent unasked) and ends its repair.
    pub fn repaired(&mut self, worker: WorkerId, reply: RepairReply) -> Result<(), FeedError> {
        let Some(m) = self.members.get_mut(&worker) else {
            return Ok(()); // left meanwhile: nothing to keep
        };
        m.repairing = false;
        match reply {
            RepairReply::Events(events) => {
                for ev in events.iter().filter(|e| e.worker_id == worker) {
                    match self.index.apply(ev) {
                        ApplyOutcome::Applied => {
                            self.stats.events_applied += 1;
                            m.health.applied += 1;
                        }
                        ApplyOutcome::Duplicate => {}
                        ApplyOutcome::Gap { .. } => return Err(FeedError::RangeGap(worker)),
                    }
                }
            }
            RepairReply::Dump(dump) => {
                if dump.worker_id != worker {
                    return Err(FeedError::WrongDump {
                        asked: worker,
                        got: dump.worker_id,
                    });
                }
                self.index.replace_worker(&dump)?;
                self.stats.dumps_applied += 1;
            }
        }
        self.stats.repairs += 1;
        Ok(())
    }

    /// The repair of `worker` could not be made (timeout, worker unreachable): left for the
    /// next gap or load report to ask again.
    pub fn repair_failed(&mut self, worker: WorkerId) {
        if let Some(m) = self.members.get_mut(&worker) {
            m.repairing = false;
            m.health.failed_repairs += 1;
            m.health.trouble();
        }
    }

    fn start_repair(&mut self, worker: WorkerId, dump: bool) -> Option<Repair> {
        let m = self.members.get_mut(&worker)?;
        if m.repairing {
            return None;
        }
        m.repairing = true;
        let after = self.index.last_event_id(worker).unwrap_or(0);
        Some(Repair {
            worker,
            after,
            dump: dump || after == 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use tandem_protocol::{KvEventKind, LocalBlockHash, StorageTier, StoredBlock};

    use super::*;

    fn stored(worker: u64, id: u64, hash: u64) -> KvEvent {
        KvEvent {
            worker_id: WorkerId(worker),
            event_id: id,
            tier: StorageTier::Device,
            kind: KvEventKind::Stored {
                parent: None,
                blocks: vec![StoredBlock {
                    sequence_hash: SequenceHash(hash),
                    local_hash: LocalBlockHash(hash),
                }],
            },
        }
    }

    fn dump(worker: u64, events: Vec<KvEvent>) -> KvDump {
        KvDump {
            worker_id: WorkerId(worker),
            last_event_id: events.last().map_or(0, |e| e.event_id),
            events,
        }
    }

    fn joined(feed: &mut IndexFeed, worker: u64) {
        let r = feed
            .join(WorkerId(worker), 0)
            .expect("a join asks for a dump");
        assert!(r.dump);
        feed.repaired(WorkerId(worker), RepairReply::Dump(dump(worker, vec![])))
            .expect("empty dump");
    }

    /// `n` events of worker `w` in order, its next id in `next`.
    fn flow(feed: &mut IndexFeed, next: &mut u64, w: u64, n: u64) {
        for _ in 0..n {
            assert!(feed.apply(&[stored(w, *next, *next * 10 + w)]).is_empty());
            *next += 1;
        }
    }

    /// One batch of worker `w` lost on the way: the next shows the gap, and a replay from the
    /// worker (`answered`) or no answer ends the repair.
    fn lose(feed: &mut IndexFeed, next: &mut u64, w: u64, answered: bool) {
        let lost = stored(w, *next, *next * 10 + w);
        let shown = stored(w, *next + 1, (*next + 1) * 10 + w);
        *next += 2;
        assert_eq!(feed.apply(std::slice::from_ref(&shown)).len(), 1);
        if answered {
            feed.repaired(WorkerId(w), RepairReply::Events(vec![lost, shown]))
                .expect("replayed");
        } else {
            feed.repair_failed(WorkerId(w));
        }
    }

    #[test]
    fn a_stream_that_keeps_losing_events_is_troubled_and_an_occasional_loss_is_not() {
        let mut feed = IndexFeed::new();
        joined(&mut feed, 1);
        joined(&mut feed, 2);
        // Worker 1 loses a batch now and then, far apart, each repaired: never troubled.
        let mut next1 = 1;
        for _ in 0..4 {
            lose(&mut feed, &mut next1, 1, true);
            flow(&mut feed, &mut next1, 1, TROUBLE_WINDOW);
        }
        let h = feed.stream_health(WorkerId(1)).unwrap();
        assert_eq!((h.gaps, h.failed_repairs), (4, 0));
        assert_eq!(h.applied, next1 - 1, "replayed events count as applied");
        assert!(!h.troubled(), "{h:?}");
        // Worker 2 loses three batches within a few events: troubled; a repair that fails
        // counts as a trouble of its own.
        let mut next2 = 1;
        flow(&mut feed, &mut next2, 2, 5);
        lose(&mut feed, &mut next2, 2, true);
        flow(&mut feed, &mut next2, 2, 5);
        lose(&mut feed, &mut next2, 2, true);
        assert!(!feed.stream_health(WorkerId(2)).unwrap().troubled());
        lose(&mut feed, &mut next2, 2, false);
        let h = feed.stream_health(WorkerId(2)).unwrap();
        assert_eq!((h.gaps, h.failed_repairs), (3, 1));
        assert!(h.troubled(), "{h:?}");
        assert_eq!(
            feed.troubled_streams()
                .iter()
                .map(|(w, _)| *w)
                .collect::<Vec<_>>(),
            [WorkerId(2)]
        );
        // A report that finds the index behind counts too; a second one while its repair
        // runs does not.
        let mut feed = IndexFeed::new();
        joined(&mut feed, 3);
        assert_eq!(feed.report(WorkerId(3), 5), None);
        assert!(feed.report(WorkerId(3), 6).is_some());
        assert_eq!(feed.report(WorkerId(3), 7), None);
        assert_eq!(feed.stream_health(WorkerId(3)).unwrap().behind, 1);
    }

    #[test]
    fn joining_workers_reserve_room_for_their_gpu_blocks_together() {
        let mut feed = IndexFeed::new();
        assert_eq!(feed.index().heap_bytes(), 0);
        for w in 0..4 {
            feed.join(WorkerId(w), 10_000);
        }
        // 16-byte slots, at most 3/4 full: room for the 40,000 blocks of the four.
        let reserved = feed.index().heap_bytes();
        assert!(reserved >= 40_000 * 16 * 4 / 3, "{reserved}");
        // A worker leaving keeps the table; one whose record says nothing reserves nothing.
        feed.leave(WorkerId(3));
        feed.join(WorkerId(9), 0);
        assert_eq!(feed.index().heap_bytes(), reserved);
    }

    #[test]
    fn a_gap_asks_for_the_range_and_drops_events_until_repaired() {
        let mut feed = IndexFeed::new();
        joined(&mut feed, 1);
        assert!(feed.apply(&[stored(1, 1, 10)]).is_empty());
        let repairs = feed.apply(&[stored(1, 3, 30), stored(1, 4, 40)]);
        assert_eq!(
            repairs,
            [Repair {
                worker: WorkerId(1),
                after: 1,
                dump: false
            }]
        );
        // While repairing, even the next event in order is dropped.
        assert!(feed.apply(&[stored(1, 2, 20)]).is_empty());
        assert_eq!(feed.index().last_event_id(WorkerId(1)), Some(1));
        let range = vec![stored(1, 2, 20), stored(1, 3, 30), stored(1, 4, 40)];
        feed.repaired(WorkerId(1), RepairReply::Events(range))
            .expect("contiguous range");
        assert_eq!(feed.index().last_event_id(WorkerId(1)), Some(4));
        let s = feed.stats();
        assert_eq!((s.gaps, s.repairs, s.events_applied), (1, 2, 4));
    }

    #[test]
    fn non_members_are_ignored_and_leavers_purged() {
        let mut feed = IndexFeed::new();
        assert!(feed.apply(&[stored(9, 1, 10)]).is_empty());
        assert_eq!(feed.index().last_event_id(WorkerId(9)), None);
        assert_eq!(feed.report(WorkerId(9), 5), None);
        joined(&mut feed, 2);
        feed.apply(&[stored(2, 1, 10)]);
        assert!(feed.leave(WorkerId(2)));
        assert!(!feed.leave(WorkerId(2)));
        assert_eq!(feed.index().num_entries(), 0);
        assert_eq!(feed.stats().workers_purged, 1);
        // A late answer for a worker that left changes nothing.
        feed.repaired(
            WorkerId(2),
            RepairReply::Dump(dump(2, vec![stored(2, 1, 1)])),
        )
        .expect("ignored");
        assert_eq!(feed.index().num_entries(), 0);
    }

    #[test]
    fn a_restart_numbering_from_one_is_dumped() {
        let mut feed = IndexFeed::new();
        joined(&mut feed, 3);
        feed.apply(&[stored(3, 1, 10), stored(3, 2, 20)]);
        let r = feed.apply(&[stored(3, 1, 99)]);
        assert_eq!(r.len(), 1);
        assert!(r[0].dump, "{r:?}");
    }

    #[test]
    fn a_lost_trailing_batch_shows_at_the_next_report() {
        let mut feed = IndexFeed::new();
        joined(&mut feed, 4);
        feed.apply(&[stored(4, 1, 10)]);
        // Event 2 was published and lost; the report saying so gets one report of slack.
        assert_eq!(feed.report(WorkerId(4), 2), None);
        let r = feed
            .report(WorkerId(4), 2)
            .expect("behind the previous report");
        assert_eq!((r.after, r.dump), (1, false));
        // One repair at a time.
        assert_eq!(feed.report(WorkerId(4), 2), None);
        feed.repair_failed(WorkerId(4));
        assert!(feed.report(WorkerId(4), 2).is_some());
    }

    #[test]
    fn bad_answers_are_refused() {
        let mut feed = IndexFeed::new();
        joined(&mut feed, 5);
        feed.apply(&[stored(5, 1, 10), stored(5, 3, 30)]);
        let gap = feed.repaired(WorkerId(5), RepairReply::Events(vec![stored(5, 3, 30)]));
        assert_eq!(gap, Err(FeedError::RangeGap(WorkerId(5))));
        let wrong = feed.repaired(WorkerId(5), RepairReply::Dump(dump(6, vec![])));
        assert!(matches!(wrong, Err(FeedError::WrongDump { .. })));
        assert_eq!(feed.index().last_event_id(WorkerId(5)), Some(1));
    }
}
