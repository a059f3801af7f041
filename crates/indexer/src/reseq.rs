//! [`Resequencer`]: a bounded per-worker reorder buffer between the event plane and the index.
//!
//! Most transports deliver one worker's events in order, but a reconnect or a redelivery can
//! shuffle a few. The resequencer holds up to `window` early events per worker and hands them
//! out as soon as they are contiguous with what the index has applied. When the window
//! overflows, or a gap stays open longer than `deadline_ms`, the worker needs repair: replay
//! from its ring starting at the first missing id, or a dump. The index's last applied id is
//! the single source of truth and is passed in with every call, so the two cannot drift.
//!
//! Memory: at most `window` events per worker with a gap, nothing for workers in order. Call
//! [`Resequencer::remove_worker`] when a worker leaves.

use std::collections::BTreeMap;

use tandem_protocol::{KvEvent, WorkerId};

use crate::hash::MixMap;

/// Settings of [`Resequencer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResequencerConfig {
    /// Most early events held per worker.
    pub window: usize,
    /// How long a gap may stay open before the worker needs repair, in milliseconds.
    pub deadline_ms: u64,
}

impl Default for ResequencerConfig {
    fn default() -> Self {
        ResequencerConfig {
            window: 64,
            deadline_ms: 1_000,
        }
    }
}

/// A worker with a gap.
#[derive(Debug)]
struct Pending {
    /// The id the index expects next, as of the last call.
    next: u64,
    /// Early events by id.
    early: BTreeMap<u64, KvEvent>,
    /// When the current gap (at `next`) was first seen.
    gap_since_ms: u64,
    /// The highest id dropped because the window was full: repair needed until `next` passes it.
    dropped_up_to: Option<u64>,
    /// The gap outlived the deadline (set by `poll`, cleared when the gap closes).
    overdue: bool,
}

impl Pending {
    fn needs_repair(&self) -> bool {
        self.overdue || self.dropped_up_to.is_some_and(|d| self.next <= d)
    }
}

/// Per-worker reorder buffer (see the module doc).
#[derive(Debug, Default)]
pub struct Resequencer {
    config: ResequencerConfig,
    pending: MixMap<WorkerId, Pending>,
}

impl Resequencer {
    pub fn new(config: ResequencerConfig) -> Self {
        Resequencer {
            config,
            pending: MixMap::default(),
        }
    }

    /// Takes one event given the index's last applied id for its worker and returns the events
    /// now ready to apply, in order (empty if the event is early or already applied).
    pub fn push(&mut self, event: KvEvent, last_applied: u64, now_ms: u64) -> Vec<KvEvent> {
        let mut out = Vec::new();
        self.push_into(event, last_applied, now_ms, &mut out);
        out
    }

    /// [`Resequencer::push`] appending to `out`, to reuse one buffer on the hot path.
    pub fn push_into(
        &mut self,
        event: KvEvent,
        last_applied: u64,
        now_ms: u64,
        out: &mut Vec<KvEvent>,
    ) {
        let next = last_applied.saturating_add(1);
        if event.event_id < next {
            return;
        }
        let worker = event.worker_id;
        let Some(p) = self.pending.get_mut(&worker) else {
            if event.event_id == next {
                // The common case: in order, nothing buffered, no state touched.
                out.push(event);
            } else {
                let mut early = BTreeMap::new();
                early.insert(event.event_id, event);
                let p = Pending {
                    next,
                    early,
                    gap_since_ms: now_ms,
                    dropped_up_to: None,
                    overdue: false,
                };
                self.pending.insert(worker, p);
            }
            return;
        };
        Self::advance_to(p, next, now_ms);
        if event.event_id == p.next {
            out.push(event);
            p.next += 1;
            Self::release(p, now_ms, out);
        } else {
            p.early.insert(event.event_id, event);
            if p.early.len() > self.config.window {
                // Keep the lowest ids: they are the ones that become usable first.
                if let Some((id, _)) = p.early.pop_last() {
                    p.dropped_up_to = Some(p.dropped_up_to.map_or(id, |d| d.max(id)));
                }
            }
        }
        if p.early.is_empty() && !p.needs_repair() {
            self.pending.remove(&worker);
        }
    }

    /// After a repair (a replayed range or a dump applied to the index), tells the resequencer
    /// where the index now stands; returns the held events that follow on from it. Clears the
    /// worker's repair state; a gap that remains starts a fresh deadline.
    pub fn resync(&mut self, worker: WorkerId, last_applied: u64, now_ms: u64) -> Vec<KvEvent> {
        let mut out = Vec::new();
        let Some(p) = self.pending.get_mut(&worker) else {
            return out;
        };
        p.dropped_up_to = None;
        p.overdue = false;
        p.gap_since_ms = now_ms;
        Self::advance_to(p, last_applied.saturating_add(1), now_ms);
        Self::release(p, now_ms, &mut out);
        if p.early.is_empty() {
            self.pending.remove(&worker);
        }
        out
    }

    /// The first missing event id of a worker that needs repair (window overflowed, or its gap
    /// was found overdue by [`Resequencer::poll`]).
    pub fn needs_repair(&self, worker: WorkerId) -> Option<u64> {
        self.pending
            .get(&worker)
            .filter(|p| p.needs_repair())
            .map(|p| p.next)
    }

    /// Marks gaps older than the deadline and returns every worker needing repair with its first
    /// missing id, sorted by worker. A worker stays listed until its gap closes or it is
    /// resynced, so the caller deduplicates repairs already in flight.
    pub fn poll(&mut self, now_ms: u64) -> Vec<(WorkerId, u64)> {
        let deadline = self.config.deadline_ms;
        let mut out: Vec<(WorkerId, u64)> = self
            .pending
            .iter_mut()
            .filter_map(|(&w, p)| {
                if now_ms.saturating_sub(p.gap_since_ms) >= deadline {
                    p.overdue = true;
                }
                p.needs_repair().then_some((w, p.next))
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Number of early events held for a worker.
    pub fn held(&self, worker: WorkerId) -> usize {
        self.pending.get(&worker).map_or(0, |p| p.early.len())
    }

    /// Drops a worker's held events and repair state.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.pending.remove(&worker);
    }

    /// Moves `p.next` up to `next` if the index got ahead (through a repair), dropping held
    /// events it has already applied.
    fn advance_to(p: &mut Pending, next: u64, now_ms: u64) {
        if next > p.next {
            p.next = next;
            p.overdue = false;
            p.gap_since_ms = now_ms;
            p.early = p.early.split_off(&next);
        }
    }

    /// Hands out held events contiguous with `p.next`.
    fn release(p: &mut Pending, now_ms: u64, out: &mut Vec<KvEvent>) {
        let before = p.next;
        while let Some(e) = p.early.remove(&p.next) {
            out.push(e);
            p.next += 1;
        }
        if p.next != before {
            // The old gap closed; any remaining one is new.
            p.overdue = false;
            p.gap_since_ms = now_ms;
        }
    }
}

#[cfg(test)]
mod tests {
    use tandem_protocol::{KvEventKind, StorageTier};

    use super::*;

    fn ev(w: u64, id: u64) -> KvEvent {
        KvEvent {
            worker_id: WorkerId(w),
            event_id: id,
            tier: StorageTier::Device,
            kind: KvEventKind::Cleared,
        }
    }

    fn ids(events: &[KvEvent]) -> Vec<u64> {
        events.iter().map(|e| e.event_id).collect()
    }

    /// Feeds events through the resequencer into a counter standing in for the index.
    struct Harness {
        r: Resequencer,
        last: u64,
    }

    impl Harness {
        fn push(&mut self, id: u64, now: u64) -> Vec<u64> {
            let out = self.r.push(ev(1, id), self.last, now);
            if let Some(e) = out.last() {
                self.last = e.event_id;
            }
            ids(&out)
        }
    }

    #[test]
    fn reorders_within_the_window() {
        let mut h = Harness {
            r: Resequencer::default(),
            last: 0,
        };
        assert_eq!(h.push(1, 0), vec![1]);
        assert!(h.r.pending.is_empty(), "in-order events keep no state");
        assert!(h.push(3, 0).is_empty());
        assert!(h.push(4, 0).is_empty());
        assert_eq!(h.r.held(WorkerId(1)), 2);
        assert!(h.push(1, 0).is_empty(), "already applied");
        assert!(h.push(3, 0).is_empty(), "already held");
        assert_eq!(h.push(2, 0), vec![2, 3, 4]);
        assert!(h.r.pending.is_empty());
        assert_eq!(h.r.needs_repair(WorkerId(1)), None);
    }

    #[test]
    fn overflow_needs_repair_from_the_first_missing_id() {
        let mut h = Harness {
            r: Resequencer::new(ResequencerConfig {
                window: 3,
                deadline_ms: 1_000,
            }),
            last: 0,
        };
        h.push(1, 0);
        for id in [3, 4, 6, 5] {
            assert!(h.push(id, 0).is_empty());
        }
        assert_eq!(h.r.held(WorkerId(1)), 3, "bounded by the window");
        assert_eq!(h.r.needs_repair(WorkerId(1)), Some(2));
        assert_eq!(h.r.poll(0), vec![(WorkerId(1), 2)]);
        // Event 2 arrives, 3..5 follow; 6 was dropped, so repair is still needed from 6.
        assert_eq!(h.push(2, 1), vec![2, 3, 4, 5]);
        assert_eq!(h.r.needs_repair(WorkerId(1)), Some(6));
        // The repair replays 6 and 7 into the index directly, then resyncs.
        h.last = 7;
        assert!(h.r.resync(WorkerId(1), 7, 2).is_empty());
        assert_eq!(h.r.needs_repair(WorkerId(1)), None);
        assert!(h.r.pending.is_empty());
    }

    #[test]
    fn overdue_gaps_are_polled_and_resync_releases() {
        let mut r = Resequencer::new(ResequencerConfig {
            window: 8,
            deadline_ms: 100,
        });
        assert!(r.push(ev(2, 2), 0, 1_000).is_empty());
        assert!(r.push(ev(1, 5), 3, 1_050).is_empty());
        assert!(r.push(ev(1, 6), 3, 1_060).is_empty());
        assert!(r.poll(1_099).is_empty());
        assert_eq!(r.needs_repair(WorkerId(2)), None);
        assert_eq!(r.poll(1_100), vec![(WorkerId(2), 1)]);
        assert_eq!(r.poll(1_150), vec![(WorkerId(1), 4), (WorkerId(2), 1)]);
        assert_eq!(r.needs_repair(WorkerId(1)), Some(4));
        // Worker 1's repair brought the index to 4: 5 and 6 follow on.
        assert_eq!(ids(&r.resync(WorkerId(1), 4, 1_200)), vec![5, 6]);
        assert_eq!(r.needs_repair(WorkerId(1)), None);
        // Worker 2 got a dump up to 10: its held event 2 is stale and dropped.
        assert!(r.resync(WorkerId(2), 10, 1_200).is_empty());
        assert_eq!(r.held(WorkerId(2)), 0);
        assert!(r.poll(5_000).is_empty());
    }

    #[test]
    fn a_gap_closing_resets_the_deadline_for_the_next_one() {
        let mut r = Resequencer::new(ResequencerConfig {
            window: 8,
            deadline_ms: 100,
        });
        assert!(r.push(ev(1, 2), 0, 0).is_empty());
        assert!(r.push(ev(1, 4), 0, 0).is_empty());
        assert_eq!(ids(&r.push(ev(1, 1), 0, 90)), vec![1, 2]);
        assert!(r.poll(150).is_empty(), "the gap at 3 opened at 90");
        assert_eq!(r.poll(190), vec![(WorkerId(1), 3)]);
        // The index moved on by itself (a replay applied elsewhere): the next push catches up.
        assert_eq!(ids(&r.push(ev(1, 5), 4, 200)), vec![5]);
        assert_eq!(r.needs_repair(WorkerId(1)), None);
        r.remove_worker(WorkerId(1));
        assert_eq!(r.held(WorkerId(1)), 0);
    }
}
