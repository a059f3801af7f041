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
//! workers, not on half the pool. Nor is every member of such a group looked up: a large
//! group's least loaded are found by walking the load order from its start (about
//! pool / group steps), and its idle members, when many tie, drawn from the idle list.
//!
//! One exception: when more than 64 members are idle (nothing in flight: they all tie on
//! the least load), or more than 64 holders of one overlap tie on their least load, 4 of
//! them drawn uniformly at random are scored instead of all. Idle
//! workers tie exactly, so the pick among them stays uniform; only a holder whose cost ties
//! theirs to the last bit — practically never — would be picked more often than a full scan
//! would pick it. (Scoring more of them would only repeat one cost: a sample of 16 made a
//! decision at 1,000 workers 1.7× slower, BENCHMARKS.md.)
//!
//! The shortcut is taken only where that argument holds ([`RoutingReplica::shortcut`]):
//! `kv` over one pool (no prefill pool), temperature 0, no decay (it compares every backlog
//! with the least), no capacity weights, loads from the tracker alone, standard decode
//! weight, no adapter, no busy thresholds, and either every member warming up or none. Any
//! other request is scored over every member, as before.

use std::collections::BTreeSet;

use hashbrown::HashMap;
use tandem_indexer::{Extent, OverlapScores, TierCounts};
use tandem_protocol::{AdapterId, WorkerId};

use super::answer::{Answer, Overlaps};
use super::{KvSource, Member, Pool, RouteInput, RoutingReplica};
use crate::pool::PoolConfig;
use crate::registry::PolicyKind;
use crate::view::{WorkerLoad, WorkerView};

/// Above this many idle members, a decision scores [`IDLE_SAMPLE`] of them drawn at random
/// instead of every one (they all cost the same).
const IDLE_TIE_LIMIT: usize = 64;
const IDLE_SAMPLE: usize = 4;
/// The most draws a sample makes before the decision falls back to a walk (the sample's
/// members may be a small part of the idle list).
const IDLE_DRAWS: usize = 128;

/// A group of holders this small is looked up member by member; a larger one is found from
/// the load order. Small in unit tests, so that their small pools take both ways.
const FEW_HOLDERS: usize = if cfg!(test) { 2 } else { 8 };

/// Above this many distinct overlaps the holders are grouped by sorting them.
const MAX_GROUPS: usize = 16;

/// A holder candidate: its overlap, its key in the load order, its id.
type Holder = (TierCounts, f64, WorkerId);

/// `id`'s overlap in `answer`, searched from `*at` when `id` is not below the entry there
/// (ids looked up in ascending order cost a step or two each); `*at` is left at the entry
/// found or where it would be.
fn overlap_from(answer: &OverlapScores, at: &mut usize, id: WorkerId) -> Option<TierCounts> {
    let s = &answer.scores;
    if s.get(*at).is_none_or(|e| e.0 > id) {
        *at = 0;
    }
    // A few steps forward, then a binary search of the rest.
    let mut i = *at;
    while i < s.len() && i < *at + 4 && s[i].0 < id {
        i += 1;
    }
    if i < s.len() && s[i].0 < id {
        i += s[i..].partition_point(|e| e.0 < id);
    }
    *at = i;
    s.get(i).filter(|e| e.0 == id).map(|e| e.1)
}

/// Every holder in `answer` with its overlap.
fn holders_of(answer: Answer<'_>) -> impl Iterator<Item = (WorkerId, TierCounts)> {
    let mut all = Vec::new();
    answer.for_each(|id, overlap| all.push((id, overlap)));
    all.into_iter()
}

/// How a walk of the load order for a group's least loaded ended.
enum Walk {
    Found,
    TooFar,
    ManyIdle,
}

/// Holders of one overlap from one source, as the answer lists them.
struct Group<'a> {
    source: KvSource,
    overlap: TierCounts,
    /// The first [`FEW_HOLDERS`] members.
    few: [WorkerId; FEW_HOLDERS],
    count: usize,
    /// The index's group, when the answer is grouped.
    extent: Option<Extent<'a>>,
}

impl<'a> Group<'a> {
    fn new(source: KvSource, overlap: TierCounts, id: WorkerId) -> Self {
        let mut g = Group::empty(source, overlap, None);
        g.add(id);
        g
    }

    fn empty(source: KvSource, overlap: TierCounts, extent: Option<Extent<'a>>) -> Self {
        Group {
            source,
            overlap,
            few: [WorkerId(0); FEW_HOLDERS],
            count: 0,
            extent,
        }
    }

    /// The index's group as a group: its first members read, its size known without
    /// walking it (beyond the first few, which also stand for it when the index's count
    /// falls short of them).
    fn of_extent(source: KvSource, e: Extent<'a>) -> Self {
        let mut g = Group::empty(source, e.counts(), Some(e));
        e.workers().take(FEW_HOLDERS + 1).for_each(|id| g.add(id));
        g.count = g.count.max(e.len());
        g
    }

    /// Whether `id` is a member, given `answer`, the answer `self` was made from (`at`: as
    /// for [`overlap_from`]).
    fn holds(&self, answer: Answer<'_>, at: &mut usize, id: WorkerId) -> bool {
        match (self.extent, answer) {
            (Some(e), _) => e.contains(id),
            (None, Answer::Listed(s)) => overlap_from(s, at, id) == Some(self.overlap),
            (None, Answer::Grouped(x)) => x.get(id) == Some(self.overlap),
        }
    }

    /// Every member (from `answer`, the answer `self` was made from).
    fn members(&self, answer: Answer<'_>, out: &mut Vec<(WorkerId, TierCounts)>) {
        match self.extent {
            Some(e) => out.extend(e.workers().map(|id| (id, self.overlap))),
            None => answer.for_each(|id, o| {
                if o == self.overlap {
                    out.push((id, o));
                }
            }),
        }
    }

    fn add(&mut self, id: WorkerId) {
        if let Some(slot) = self.few.get_mut(self.count) {
            *slot = id;
        }
        self.count += 1;
    }
}

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
        let overlap = scores.of(m.kv).get(id).unwrap_or_default();
        self.view_with(id, m, cfg, overlap, adapter, now_ms)
    }

    /// [`RoutingReplica::view_of`] with the worker's overlap already looked up.
    fn view_with(
        &self,
        id: WorkerId,
        m: &Member,
        cfg: &PoolConfig,
        overlap: TierCounts,
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

    /// Whether a decision for `input` now scores only holders and the least loaded (module
    /// docs).
    pub(super) fn takes_shortcut(&self, input: &RouteInput<'_>, now_ms: u64) -> bool {
        self.shortcut(input, now_ms).is_some()
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
        let is_holder = |id: WorkerId, m: &Member| scores.of(m.kv).get(id).is_some();
        // The prompt's own term, for the tie tolerance (costs tie within 1e-9 of their size).
        let prompt = weights.prefill_scale * input.route.prompt_blocks();
        let near = |key: f64, least: f64| key - least <= 1e-6 * (least + prompt).max(1.0);
        let holders = if weights.unclamped {
            self.least_holders(scores, excluded, &near)
        } else {
            let mut all = Vec::new();
            for (answer, source) in scores.by_source() {
                self.look_up_holders(holders_of(answer), source, excluded, &mut all);
            }
            all
        };
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
            for _ in 0..IDLE_DRAWS {
                let id = self.order.idle[self.rng.below(n)];
                let m = &self.decode[&id];
                if !excluded.contains(&id) && !is_holder(id, m) && !ids.contains(&id) {
                    ids.push(id);
                    if ids.len() == IDLE_SAMPLE {
                        break;
                    }
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

    /// The holders `members` (id, overlap) of `source` that can be candidates, with their
    /// keys, appended to `out`.
    fn look_up_holders(
        &self,
        members: impl Iterator<Item = (WorkerId, TierCounts)>,
        source: KvSource,
        excluded: &[WorkerId],
        out: &mut Vec<Holder>,
    ) {
        out.extend(members.filter_map(|(id, overlap)| {
            let m = self.decode.get(&id)?;
            let key = f64::from_bits(*self.order.keys.get(&id)?);
            (m.kv == source && !excluded.contains(&id)).then_some((overlap, key, id))
        }));
    }

    /// With credit weights of at most 1, holders of equal overlap differ by their key alone:
    /// of each such group only the least loaded (and those tied with it) can be the pick. A
    /// group of many holders (half the pool holding a common prefix) is found from the load
    /// order, where its least loaded come within a few steps, instead of by looking up every
    /// member; a group whose least loaded are many (idle holders) is sampled uniformly, as
    /// idle non-holders are.
    fn least_holders(
        &mut self,
        scores: Overlaps<'_>,
        excluded: &[WorkerId],
        near: &impl Fn(f64, f64) -> bool,
    ) -> Vec<Holder> {
        let mut groups: Vec<Group<'_>> = Vec::new();
        for (answer, source) in scores.by_source() {
            match answer {
                Answer::Grouped(x) => {
                    groups.extend(x.iter().map(|e| Group::of_extent(source, e)));
                }
                Answer::Listed(s) => {
                    for &(id, overlap) in s.iter() {
                        // Holders come by id: neighbours often share an overlap.
                        match groups
                            .iter_mut()
                            .rev()
                            .find(|g| g.overlap == overlap && g.source == source)
                        {
                            Some(g) => g.add(id),
                            None => groups.push(Group::new(source, overlap, id)),
                        }
                        if groups.len() > MAX_GROUPS {
                            break;
                        }
                    }
                }
            }
            if groups.len() > MAX_GROUPS {
                // Many distinct overlaps: every holder looked up, grouped by sorting.
                return self.least_holders_sorted(scores, excluded, near);
            }
        }
        let mut out = Vec::new();
        for g in &groups {
            let start = out.len();
            if g.count > FEW_HOLDERS {
                let walk = if self.surely_many_idle(g, excluded, near) {
                    Walk::ManyIdle
                } else {
                    self.walk_group(g, scores, excluded, near, &mut out)
                };
                match walk {
                    Walk::Found => continue,
                    Walk::ManyIdle => {
                        out.truncate(start);
                        if self.sample_idle_members(g, scores, excluded, &mut out) {
                            continue;
                        }
                    }
                    Walk::TooFar => {}
                }
            }
            out.truncate(start);
            let mut members = Vec::new();
            if g.count <= FEW_HOLDERS {
                let few = g.few[..g.count].iter().map(|&id| (id, g.overlap));
                self.look_up_holders(few, g.source, excluded, &mut members);
            } else {
                let mut all = Vec::with_capacity(g.count);
                g.members(scores.of(g.source), &mut all);
                self.look_up_holders(all.into_iter(), g.source, excluded, &mut members);
            }
            let Some(least) = members.iter().map(|h| h.1).min_by(f64::total_cmp) else {
                continue;
            };
            members.retain(|h| near(h.1, least));
            self.keep_sample(&mut members);
            out.extend(members);
        }
        out
    }

    /// `g`'s least loaded holders (those tied with the least included), found by walking the
    /// load order: [`Walk::TooFar`], with `out` partly written, when it passes more
    /// non-members than a few per member expected; [`Walk::ManyIdle`] when more than [`IDLE_TIE_LIMIT`]
    /// tie with nothing in flight.
    fn walk_group(
        &self,
        g: &Group<'_>,
        scores: Overlaps<'_>,
        excluded: &[WorkerId],
        near: &impl Fn(f64, f64) -> bool,
        out: &mut Vec<Holder>,
    ) -> Walk {
        let answer = scores.of(g.source);
        let limit = 16 + 4 * self.order.order.len() / g.count;
        let mut least: Option<f64> = None;
        let mut tied = 0;
        // Idle members come in id order, as the answer does: look them up from the last.
        let mut at = 0;
        for (step, &(bits, id)) in self.order.order.iter().enumerate() {
            let key = f64::from_bits(bits);
            if least.is_some_and(|l| !near(key, l)) {
                return Walk::Found;
            }
            if step - tied >= limit {
                return Walk::TooFar;
            }
            let member = g.holds(answer, &mut at, id)
                && !excluded.contains(&id)
                && self.decode.get(&id).is_some_and(|m| m.kv == g.source);
            if member {
                let least = *least.get_or_insert(key);
                out.push((g.overlap, key, id));
                tied += 1;
                if tied > IDLE_TIE_LIMIT {
                    return if least == 0.0 && self.idle_tie_alone(near) {
                        Walk::ManyIdle
                    } else {
                        Walk::TooFar
                    };
                }
            }
        }
        Walk::Found
    }

    /// Idle members tie exactly; unless a loaded worker's key is within the tolerance of
    /// zero (practically never), the tied are the idle members.
    fn idle_tie_alone(&self, near: &impl Fn(f64, f64) -> bool) -> bool {
        let loaded = self.order.order.range((1u64, WorkerId(0))..).next();
        loaded.is_none_or(|&(b, _)| !near(f64::from_bits(b), 0.0))
    }

    /// What [`RoutingReplica::walk_group`] would find to be [`Walk::ManyIdle`], known from
    /// counts alone: `g` has more members than the loaded workers and the excluded can
    /// take from the idle ones by more than [`IDLE_TIE_LIMIT`] (a group of most of a
    /// mostly idle pool: a shared system prompt). The walk would look up those members one
    /// by one to find it out. (A grouped answer's count is exact while the index's workers
    /// keep its contract, see `tandem_indexer::Extents`.)
    fn surely_many_idle(
        &self,
        g: &Group<'_>,
        excluded: &[WorkerId],
        near: &impl Fn(f64, f64) -> bool,
    ) -> bool {
        let idle = self.order.idle.len();
        let loaded = self.order.order.len().saturating_sub(idle);
        idle > IDLE_TIE_LIMIT
            && g.count.saturating_sub(loaded + excluded.len()) > IDLE_TIE_LIMIT
            && self.idle_tie_alone(near)
    }

    /// Whether `id` is a candidate member of `g`.
    fn is_member(
        &self,
        g: &Group<'_>,
        answer: Answer<'_>,
        excluded: &[WorkerId],
        id: WorkerId,
    ) -> bool {
        g.holds(answer, &mut 0, id)
            && !excluded.contains(&id)
            && self.decode.get(&id).is_some_and(|m| m.kv == g.source)
    }

    /// Up to [`IDLE_SAMPLE`] distinct idle members of `g`, drawn uniformly from the idle
    /// members by rejection from all idle workers; false when a bounded number of draws
    /// found none (the group is a small part of the idle pool).
    fn sample_idle_members(
        &mut self,
        g: &Group<'_>,
        scores: Overlaps<'_>,
        excluded: &[WorkerId],
        out: &mut Vec<Holder>,
    ) -> bool {
        let answer = scores.of(g.source);
        let start = out.len();
        let n = self.order.idle.len();
        for _ in 0..IDLE_DRAWS {
            let id = self.order.idle[self.rng.below(n)];
            if self.is_member(g, answer, excluded, id) && !out[start..].iter().any(|h| h.2 == id) {
                out.push((g.overlap, 0.0, id));
                if out.len() - start == IDLE_SAMPLE {
                    break;
                }
            }
        }
        out.len() > start
    }

    /// [`RoutingReplica::least_holders`] by looking up every holder and sorting them.
    fn least_holders_sorted(
        &mut self,
        scores: Overlaps<'_>,
        excluded: &[WorkerId],
        near: &impl Fn(f64, f64) -> bool,
    ) -> Vec<Holder> {
        let mut holders = Vec::new();
        for (answer, source) in scores.by_source() {
            self.look_up_holders(holders_of(answer), source, excluded, &mut holders);
        }
        let tiers = |t: &TierCounts| (t.device, t.host, t.disk);
        holders.sort_unstable_by(|a, b| tiers(&a.0).cmp(&tiers(&b.0)).then(a.1.total_cmp(&b.1)));
        let mut out = Vec::with_capacity(holders.len());
        for g in holders.chunk_by_mut(|a, b| a.0 == b.0) {
            let least = g[0].1;
            let mut members: Vec<Holder> = g.iter().copied().filter(|h| near(h.1, least)).collect();
            self.keep_sample(&mut members);
            out.extend(members);
        }
        out
    }

    /// Keeps [`IDLE_SAMPLE`] of `members` drawn uniformly when more than [`IDLE_TIE_LIMIT`] tie.
    fn keep_sample(&mut self, members: &mut Vec<Holder>) {
        if members.len() > IDLE_TIE_LIMIT {
            for i in 0..IDLE_SAMPLE {
                let j = i + self.rng.below(members.len() - i);
                members.swap(i, j);
            }
            members.truncate(IDLE_SAMPLE);
        }
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
        let none = TierCounts::default();
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
