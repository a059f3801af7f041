//! The candidates of a decision: every member's view, or — where the outcome cannot differ —
//! only the workers that hold part of the prompt plus the least loaded of the rest, so that a
//! decision's cost does not grow with workers that hold nothing of the prompt.
//!
//! # The shortcut
//!
//! Under `kv` at temperature 0 a worker that holds none of the prompt costs
//! `s·(backlog + prompt)/bs + decode + a·requests` (docs/ARCHITECTURE.md §5; no credit, speed 1, no
//! transfer or adapter term), which orders those workers by their load alone, the same for
//! every request with the same `s`, `a` and block size. [`LoadOrder`] keeps the members in
//! that order, re-keying only the workers whose tracked load changed since the last decision
//! ([`crate::ActiveSequences::take_dirty`]). A decision then scores the holders (from the
//! index's answer) and the non-holders whose load is within rounding of the least loaded
//! one: the minimum over that set is the minimum over all members, and every worker tied
//! with it is in the set, in the same (id) order, so the pick — ties broken by the same
//! draw — is the one the full scan makes. Only the explanation is shorter: it lists the
//! candidates scored.
//!
//! Holders are pruned the same way: with credit weights of at most 1 no credit exceeds the
//! prompt's own term, so two holders of the same overlap (per tier) differ in cost by their
//! key alone, and only the least loaded of each such group (with those tied with it) is
//! scored. A prompt whose first blocks half the pool holds is then scored on a handful of
//! workers, not on half the pool.
//!
//! One exception: when more than 64 members are idle (nothing in flight: they all tie on
//! the least load), or more than 64 holders of one overlap tie on their least load, 16 of
//! them drawn uniformly at random are scored instead of all. Idle
//! workers tie exactly, so the pick among them stays uniform; only a holder whose cost ties
//! theirs to the last bit — practically never — would be picked more often than a full scan
//! would pick it.
//!
//! The shortcut is taken only where that argument holds ([`RoutingReplica::shortcut`]):
//! `kv` over one pool (no prefill pool), temperature 0, no decay (it compares every backlog
//! with the least), no capacity weights, loads from the tracker alone, standard decode
//! weight, no adapter, no busy thresholds, and either every member warming up or none. Any
//! other request is scored over every member, as before.

use std::collections::BTreeSet;

use hashbrown::HashMap;
use tandem_protocol::{AdapterId, WorkerId};

use super::{KvSource, Member, Overlaps, Pool, RouteInput, RoutingReplica};
use crate::pool::PoolConfig;
use crate::registry::PolicyKind;
use crate::view::{WorkerLoad, WorkerView};

/// Above this many idle members, a decision scores [`IDLE_SAMPLE`] of them drawn at random
/// instead of every one (they all cost the same).
const IDLE_TIE_LIMIT: usize = 64;
const IDLE_SAMPLE: usize = 16;

/// Pools this small are scored whole: the shortcut's bookkeeping costs more than it saves
/// (measured at 64 workers, BENCHMARKS.md). The crate's unit tests take it at every size.
const SHORTCUT_MIN_POOL: usize = if cfg!(test) { 0 } else { 128 };

/// The weights a [`LoadOrder`]'s keys were computed with.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Weights {
    block_size: u32,
    prefill_scale: f64,
    request_weight: f64,
    /// No credit exceeds its prompt term (credit weights ≤ 1), so among holders of equal
    /// overlap the cost is the key plus a constant ([`RoutingReplica::decode_views`]).
    unclamped: bool,
}

impl Weights {
    /// A non-holder's cost less the prompt's own term (the same for every worker).
    fn key(&self, load: &WorkerLoad) -> f64 {
        self.prefill_scale * load.active_prefill_tokens as f64 / f64::from(self.block_size)
            + load.potential_decode_blocks as f64
            + self.request_weight * load.active_requests as f64
    }
}

/// The decode pool's members by their non-holder cost (see the module docs).
#[derive(Debug, Default)]
pub(super) struct LoadOrder {
    weights: Option<Weights>,
    /// Non-negative keys as their bit patterns (which order as the values do), by worker.
    keys: HashMap<WorkerId, u64>,
    order: BTreeSet<(u64, WorkerId)>,
    /// Workers to re-key before the next use (joined, or load changed).
    stale: Vec<WorkerId>,
    /// The members with nothing in flight (key 0), indexable for a uniform draw.
    idle: Vec<WorkerId>,
    idle_at: HashMap<WorkerId, usize>,
}

impl LoadOrder {
    /// `worker` joined the pool, or its load changed.
    pub(super) fn touch(&mut self, worker: WorkerId) {
        self.stale.push(worker);
    }

    /// `worker` left the pool.
    pub(super) fn remove(&mut self, worker: WorkerId) {
        if let Some(k) = self.keys.remove(&worker) {
            self.order.remove(&(k, worker));
        }
        self.set_idle(worker, false);
    }

    fn set(&mut self, worker: WorkerId, key: f64) {
        let bits = key.max(0.0).to_bits();
        if let Some(old) = self.keys.insert(worker, bits) {
            self.order.remove(&(old, worker));
        }
        self.order.insert((bits, worker));
        self.set_idle(worker, bits == 0);
    }

    fn set_idle(&mut self, worker: WorkerId, idle: bool) {
        match (idle, self.idle_at.get(&worker).copied()) {
            (true, None) => {
                self.idle_at.insert(worker, self.idle.len());
                self.idle.push(worker);
            }
            (false, Some(i)) => {
                self.idle.swap_remove(i);
                self.idle_at.remove(&worker);
                if let Some(&moved) = self.idle.get(i) {
                    self.idle_at.insert(moved, i);
                }
            }
            _ => {}
        }
    }

    fn clear(&mut self) {
        self.keys.clear();
        self.order.clear();
        self.idle.clear();
        self.idle_at.clear();
    }
}

impl RoutingReplica {
    /// The view of one member (see [`RoutingReplica::views`]).
    pub(super) fn view_of(
        &self,
        id: WorkerId,
        m: &Member,
        cfg: &PoolConfig,
        scores: Overlaps<'_>,
        adapter: Option<AdapterId>,
        now_ms: u64,
    ) -> WorkerView {
        let scores = match m.kv {
            KvSource::Events => scores.exact,
            KvSource::Approximate => scores.approx,
        };
        let overlap = scores.get(id).unwrap_or_default();
        self.view_with(id, m, cfg, overlap, adapter, now_ms)
    }

    /// [`RoutingReplica::view_of`] with the worker's overlap already looked up.
    fn view_with(
        &self,
        id: WorkerId,
        m: &Member,
        cfg: &PoolConfig,
        overlap: tandem_indexer::TierCounts,
        adapter: Option<AdapterId>,
        now_ms: u64,
    ) -> WorkerView {
        let mut load = self.tracker.load(id).to_worker_load();
        if let Some(r) = &m.report {
            if self.config.routing.merge_load_reports {
                load.merge_report(r);
            } else {
                load.kv_usage = r.kv_usage();
            }
        }
        let capacity = if self.prefill.contains_key(&id) {
            &self.capacity_prefill
        } else {
            &self.capacity_decode
        };
        WorkerView {
            id,
            overlap,
            load,
            warming_up: cfg.is_warming_up(m.joined_ms, now_ms),
            speed: capacity.weight(id),
            extra_cost: 0.0,
            adapter_cost: self.adapters.cost(id, adapter, now_ms),
        }
    }

    /// The candidate views of a pool's members not in `excluded`.
    pub(super) fn views(
        &self,
        pool: &Pool,
        cfg: &PoolConfig,
        scores: Overlaps<'_>,
        (excluded, adapter): (&[WorkerId], Option<AdapterId>),
        now_ms: u64,
    ) -> Vec<WorkerView> {
        pool.iter()
            .filter(|(id, _)| !excluded.contains(id))
            .map(|(&id, m)| self.view_of(id, m, cfg, scores, adapter, now_ms))
            .collect()
    }

    /// The weights of the shortcut when `input` may take it now (module docs), else None.
    fn shortcut(&self, input: &RouteInput<'_>, now_ms: u64) -> Option<Weights> {
        let cfg = &self.config.routing;
        let kv = &cfg.policy.kv;
        let route = &input.route;
        let o = &route.overrides;
        let warmup = cfg.pool.warmup_ms;
        let none_warming = now_ms.saturating_sub(self.joins.latest_ms) >= warmup;
        let all_warming = now_ms.saturating_sub(self.joins.earliest_ms) < warmup;
        let applies = cfg.policy.kind == PolicyKind::Kv
            && self.decode.len() > SHORTCUT_MIN_POOL
            && self.prefill.is_empty()
            && o.temperature.unwrap_or(kv.temperature) == 0.0
            && kv.decay == 0.0
            && !cfg.capacity.enabled
            && !cfg.merge_load_reports
            && route.adapter.is_none()
            && kv.decode_weight(route.priority) == 1.0
            && cfg.pool.busy_kv_usage.is_none()
            && cfg.pool.busy_prefill_tokens.is_none()
            && (none_warming || all_warming);
        let credit = o.overlap_credit.unwrap_or(kv.overlap_credit);
        applies.then(|| Weights {
            block_size: route.block_size.get(),
            prefill_scale: o.prefill_load_scale.unwrap_or(kv.prefill_load_scale),
            request_weight: kv.active_request_weight,
            unclamped: credit <= 1.0 && kv.host_weight <= 1.0 && kv.disk_weight <= 1.0,
        })
    }

    /// Brings the load order up to date for `weights`: re-keys what changed, or everything
    /// when the weights did.
    fn refresh_order(&mut self, weights: Weights) {
        // (`sync_loads` has moved the tracker's changed workers into `stale`.)
        let mut stale = std::mem::take(&mut self.order.stale);
        let keyed = |w: &Weights| Weights {
            unclamped: false,
            ..*w
        };
        if self.order.weights.as_ref().map(keyed) != Some(keyed(&weights)) {
            self.order.weights = Some(weights);
            self.order.clear();
            stale.clear();
            stale.extend(self.decode.keys().copied());
        }
        for &w in &stale {
            if self.decode.contains_key(&w) {
                let key = weights.key(&self.tracker.load(w).to_worker_load());
                self.order.set(w, key);
            } else {
                self.order.remove(w);
            }
        }
        stale.clear();
        self.order.stale = stale;
    }

    /// Keeps the order's backlog of stale workers bounded while the shortcut is not taken.
    pub(super) fn bound_order(&mut self) {
        if self.order.stale.len() > 2 * self.decode.len() + 64 {
            self.order.stale.clear();
            self.order.weights = None; // rebuilt whole at the next use
        }
    }

    /// The decode pool's candidates for `input`: the shortcut's when it applies, every
    /// member's otherwise.
    pub(super) fn decode_views(
        &mut self,
        input: &RouteInput<'_>,
        cfg: &PoolConfig,
        scores: Overlaps<'_>,
        excluded: &[WorkerId],
        now_ms: u64,
    ) -> Vec<WorkerView> {
        let Some(weights) = self.shortcut(input, now_ms) else {
            self.bound_order();
            return self.views(
                &self.decode,
                cfg,
                scores,
                (excluded, input.route.adapter),
                now_ms,
            );
        };
        self.refresh_order(weights);
        let is_holder = |id: WorkerId, m: &Member| match m.kv {
            KvSource::Events => scores.exact.get(id).is_some(),
            KvSource::Approximate => scores.approx.get(id).is_some(),
        };
        // The prompt's own term, for the tie tolerance (costs tie within 1e-9 of their size).
        let prompt = weights.prefill_scale * input.route.prompt_blocks();
        let near = |key: f64, least: f64| key - least <= 1e-6 * (least + prompt).max(1.0);
        // The holders, with their overlap from the answer itself (no lookup per worker).
        let exact = scores.exact.iter().map(|e| (e, KvSource::Events));
        let approx = scores.approx.iter().map(|e| (e, KvSource::Approximate));
        let mut holders: Vec<(tandem_indexer::TierCounts, f64, WorkerId)> = exact
            .chain(approx)
            .filter_map(|(&(id, overlap), source)| {
                let m = self.decode.get(&id)?;
                let key = f64::from_bits(*self.order.keys.get(&id)?);
                (m.kv == source && !excluded.contains(&id)).then_some((overlap, key, id))
            })
            .collect();
        if weights.unclamped {
            // Holders of equal overlap differ by their key alone: only each group's least
            // loaded (and those tied with it) can be the pick.
            let tiers = |t: &tandem_indexer::TierCounts| (t.device, t.host, t.disk);
            holders
                .sort_unstable_by(|a, b| tiers(&a.0).cmp(&tiers(&b.0)).then(a.1.total_cmp(&b.1)));
            let mut group: Option<(tandem_indexer::TierCounts, f64)> = None;
            holders.retain(|&(overlap, key, _)| match group {
                Some((o, least)) if o == overlap => near(key, least),
                _ => {
                    group = Some((overlap, key));
                    true
                }
            });
            // A group whose least loaded are many (idle holders of a common prefix): a
            // uniform sample of them, as for idle non-holders.
            let mut start = 0;
            let mut kept = Vec::with_capacity(holders.len());
            while start < holders.len() {
                let end = start
                    + holders[start..]
                        .iter()
                        .take_while(|h| h.0 == holders[start].0)
                        .count();
                let g = &mut holders[start..end];
                if g.len() > IDLE_TIE_LIMIT {
                    for i in 0..IDLE_SAMPLE {
                        let j = i + self.rng.below(g.len() - i);
                        g.swap(i, j);
                    }
                    kept.extend_from_slice(&g[..IDLE_SAMPLE]);
                } else {
                    kept.extend_from_slice(g);
                }
                start = end;
            }
            holders = kept;
        }
        let views: Vec<WorkerView> = holders
            .iter()
            .filter_map(|&(overlap, _, id)| {
                let m = self.decode.get(&id)?;
                Some(self.view_with(id, m, cfg, overlap, None, now_ms))
            })
            .collect();
        let mut ids: Vec<WorkerId> = Vec::new();
        // Many idle workers tie for the least load: score a uniform sample of them.
        if self.order.idle.len() > IDLE_TIE_LIMIT {
            let n = self.order.idle.len();
            for _ in 0..IDLE_SAMPLE {
                let id = self.order.idle[self.rng.below(n)];
                let m = &self.decode[&id];
                if !excluded.contains(&id) && !is_holder(id, m) {
                    ids.push(id);
                }
            }
            if !ids.is_empty() {
                return self.merge_views(views, &mut ids, cfg, now_ms);
            }
            // (Every draw was excluded or a holder: the walk below finds the least.)
        }
        let mut least: Option<f64> = None;
        for &(bits, id) in &self.order.order {
            let Some(m) = self.decode.get(&id) else {
                continue;
            };
            if excluded.contains(&id) || is_holder(id, m) {
                continue;
            }
            let key = f64::from_bits(bits);
            match least {
                None => least = Some(key),
                Some(l) if near(key, l) => {}
                Some(_) => break,
            }
            ids.push(id);
        }
        self.merge_views(views, &mut ids, cfg, now_ms)
    }

    /// The holders' views and those of the non-holders `ids` (no overlap), in id order,
    /// each once.
    fn merge_views(
        &self,
        mut views: Vec<WorkerView>,
        ids: &mut Vec<WorkerId>,
        cfg: &PoolConfig,
        now_ms: u64,
    ) -> Vec<WorkerView> {
        ids.sort_unstable();
        ids.dedup();
        let none = tandem_indexer::TierCounts::default();
        views.extend(
            ids.iter()
                .filter_map(|id| self.decode.get(id).map(|m| (*id, m)))
                .map(|(id, m)| self.view_with(id, m, cfg, none, None, now_ms)),
        );
        views.sort_unstable_by_key(|v| v.id);
        views
    }
}

/// The earliest and latest join among the decode pool's members, for the warm-up condition
/// of the shortcut: kept as members join and never moved back when one leaves, so both err on
/// the side of taking the full scan.
#[derive(Clone, Copy, Debug)]
pub(super) struct Joins {
    pub(super) earliest_ms: u64,
    pub(super) latest_ms: u64,
}

impl Default for Joins {
    fn default() -> Self {
        Joins {
            earliest_ms: u64::MAX,
            latest_ms: 0,
        }
    }
}

impl Joins {
    pub(super) fn joined(&mut self, at_ms: u64) {
        self.earliest_ms = self.earliest_ms.min(at_ms);
        self.latest_ms = self.latest_ms.max(at_ms);
    }
}
