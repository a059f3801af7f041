//! Flow control's side of the replica: routing a request that has not started yet only to
//! workers that are not saturated, and the saturation checks themselves.

use tandem_protocol::WorkerId;

use super::{Plan, RouteInput, RoutingReplica};
use crate::error::RouteError;

impl RoutingReplica {
    /// [`RoutingReplica::route`] for a request that has not started yet, under flow control:
    /// saturated decode workers ([`crate::RoutingConfig::saturation`]) are left out, and when every
    /// one left is saturated the answer is [`RouteError::Saturated`] (the request should wait
    /// for capacity). Retries and migrations of started requests use `route`.
    pub fn route_admitted(
        &mut self,
        input: &RouteInput<'_>,
        excluded: &[WorkerId],
        now_ms: u64,
    ) -> Result<Plan, RouteError> {
        self.tracker.expire(now_ms);
        self.sync_loads();
        // Decode members that cannot take it: excluded, refused by their breaker (left out by
        // `decide`), or saturated — the last two kept as sets, so this does not pass over
        // every member.
        let mut out: Vec<WorkerId> = excluded.to_vec();
        let mut blocked: Vec<WorkerId> = excluded
            .iter()
            .copied()
            .chain(self.breakers.refused(now_ms))
            .filter(|w| self.decode.contains_key(w))
            .collect();
        blocked.sort_unstable();
        blocked.dedup();
        let mut saturated = 0usize;
        for &id in &self.saturated {
            if blocked.binary_search(&id).is_err() {
                out.push(id);
                saturated += 1;
            }
        }
        let free = self.decode.len() - blocked.len() - saturated;
        if free == 0 && out.len() > excluded.len() {
            return Err(RouteError::Saturated);
        }
        // Saturated prefill workers are left out too; when all of them are, the request
        // waits unless the rule would prefill it locally anyway.
        let saturated_prefill: Vec<WorkerId> = self
            .prefill
            .keys()
            .copied()
            .filter(|id| !excluded.contains(id) && self.is_prefill_saturated(*id))
            .collect();
        let all_prefill_saturated = !saturated_prefill.is_empty()
            && saturated_prefill.len()
                == self
                    .prefill
                    .keys()
                    .filter(|id| !excluded.contains(id))
                    .count();
        if all_prefill_saturated {
            let decision = self.decide(input, &out, now_ms)?;
            if decision.prefill.is_some() {
                return Err(RouteError::Saturated);
            }
            return self.commit(input, decision, now_ms);
        }
        out.extend(saturated_prefill);
        self.route(input, &out, now_ms)
    }

    /// Whether a prefill worker is saturated now ([`crate::RoutingConfig::saturation`]).
    pub fn is_prefill_saturated(&self, worker: WorkerId) -> bool {
        let load = self.tracker.load(worker).to_worker_load();
        self.config.routing.saturation.is_prefill_saturated(&load)
    }

    /// Whether a member is saturated now ([`crate::RoutingConfig::saturation`]).
    pub fn is_saturated(&self, worker: WorkerId) -> bool {
        let load = self.tracker.load(worker).to_worker_load();
        let ended = self.tracker.ended(worker);
        let (capacity, waiting) = self.pool_of(worker).map_or((0, 0), |m| {
            m.report.as_ref().map_or((0, 0), |r| {
                let since = ended.saturating_sub(m.ended_at_report);
                let waiting = waiting_now(r.waiting_requests, since);
                (r.kv_total_blocks, waiting)
            })
        });
        self.config
            .routing
            .saturation
            .is_saturated(&load, capacity, waiting)
    }

    /// Brings what is kept per worker load up to date with the tracker: the decode members
    /// that are saturated, and the load order's workers to re-key.
    pub(super) fn sync_loads(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        self.tracker.take_dirty(&mut dirty);
        for &w in &dirty {
            self.member_changed(w);
        }
        dirty.clear();
        self.dirty = dirty;
    }

    /// Derives what the replica keeps across its members from `worker`'s record and load, in
    /// this one place: its key in the decode pool's load order (re-keyed at the next use; out
    /// of it when it is not a decode member) and its place in the saturated set. Called when a
    /// member joins, leaves, reports, or its tracked load moves.
    pub(super) fn member_changed(&mut self, worker: WorkerId) {
        if self.decode.contains_key(&worker) {
            self.order.touch(worker);
        } else {
            self.order.remove(worker);
        }
        if self.decode.contains_key(&worker) && self.is_saturated(worker) {
            self.saturated.insert(worker);
        } else {
            self.saturated.remove(&worker);
        }
    }

    /// Whether some decode worker could take a request now: at least one member, not every
    /// one saturated.
    pub fn has_capacity(&self) -> bool {
        self.decode.keys().any(|&id| !self.is_saturated(id))
    }
}

/// The requests waiting in a worker's engine now, from its latest report's count: each of
/// its requests that ended since made room for one of them. (The report lags by its
/// interval; read as it was, a count caught while requests were arriving between two of the
/// engine's steps held the worker saturated until the next report, however many ended
/// meanwhile: the most requests a second through one stand-in server fell by 30 %, measured
/// with `scripts/bench-gateways.sh`'s.) Requests routed there since are not counted: the next
/// report says whether they wait (the KV threshold counts them at once).
fn waiting_now(reported: u32, ended_since: u64) -> u32 {
    let left = u64::from(reported).saturating_sub(ended_since);
    u32::try_from(left).unwrap_or(u32::MAX)
}
