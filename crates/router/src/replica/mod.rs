//! [`RoutingReplica`]: everything one router replica knows and decides, as one sans-IO state
//! machine shared by the frontend and `tandem sim` — so the simulator runs the production
//! router, not a copy of it.
//!
//! It owns the KV index with its feed rules ([`FedIndex`]), the active-sequence tracker, the
//! policy and the pool rules, the random generator, the pools' members and their latest load
//! reports. The shell feeds it with [`RoutingReplica::apply`] (membership changes, KV events
//! and repair answers, load reports, peers' sync messages) and performs the [`Repair`]s that
//! returns; per request it calls [`RoutingReplica::route`] (or [`RoutingReplica::decide`] then
//! [`RoutingReplica::commit`], when something may change its mind in between), then
//! [`RoutingReplica::first_token`] and [`RoutingReplica::finish`], publishing the
//! [`SyncMessage`]s each returns to the other replicas.
//!
//! # Tracking a request
//! A request occupies its decode worker under its own id, and, when prefilled remotely, its
//! prefill worker under the id with the top bit set (the tracker keys one worker per id). The
//! decode entry carries the prompt tokens the decode worker must compute (none when the prefill
//! is remote); the prefill entry carries those of the prefill worker and leaves at the first
//! token, or earlier when the caller knows the prefill worker is done
//! ([`RoutingReplica::prefill_finished`]). The per-request state lives with the caller, in the
//! [`InFlight`] of the [`Plan`], so the replica holds nothing per request beyond the tracker
//! (and, for approximate workers, the approximate index below).
//!
//! # Where overlap comes from: [`KvSource`]
//! Each worker joins with a KV source. An [`KvSource::Events`] worker publishes KV events: it
//! is a member of the [`IndexFeed`] (dumped at join, repaired at gaps, its load reports'
//! `last_kv_event_id` checked for trailing loss) and its overlap comes from the exact index —
//! or from a standalone indexer when [`RouteInput::overlap`] is given. An
//! [`KvSource::Approximate`] worker (a plain OpenAI-compatible server) publishes none: it is
//! never a feed member, so it is never asked for a dump or a repair, its events (should any
//! come) are dropped and its reports' event ids ignored. Instead the replica remembers its own
//! decisions in an [`ApproxIndex`]: a committed request's prompt blocks count as cached on its
//! approximate decode worker (and on its approximate prefill worker when prefilled remotely)
//! for [`RoutingConfig::approx`]'s TTL, all on Device, under its entry cap. A policy sees one
//! overlap per candidate, taken from the index of that candidate's source, so pools may mix
//! both kinds. A worker that leaves, or re-joins (a restart: its cache is new), loses its
//! approximate entries.

mod admit;
mod answer;
mod candidates;
mod config;
mod fed_index;

use std::collections::BTreeMap;
use std::sync::Arc;

use tandem_indexer::{ApproxIndex, FeedError, IndexFeed, OverlapScores, Repair, RepairReply};
use tandem_protocol::{
    AdapterId, Distance, KvEvent, LoadReport, Placement, RequestId, SequenceHash, WorkerId,
    WorkerRole,
};

pub use config::{ReplicaConfig, RoutingConfig};
pub use fed_index::FedIndex;

use crate::adapters::Adapters;
use crate::breaker::{BreakerState, Breakers, RetryBudget};
use crate::capacity::Capacity;
use crate::disagg::{self, DisaggDecision, DisaggReason};
use crate::error::{ConfigError, RouteError};
use crate::pool::{Router, RouterConfig};
use crate::rng::Rng;
use crate::sessions::{SessionKey, SessionOutcome, Sessions};
use crate::tracker::{ActiveSequences, NewSequence, SyncMessage};
use crate::view::{Decision, RouteRequest, Rule};
use answer::{Answer, Overlaps};

/// Tracker ids of a request's prefill part: the request id with the top bit set.
const PREFILL_BIT: u64 = 1 << 63;

/// How the replica learns what a worker caches (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvSource {
    /// The worker publishes numbered KV events: the exact index, fed by [`IndexFeed`].
    #[default]
    Events,
    /// The worker publishes no KV events: the replica records its own decisions for it, with
    /// a TTL ([`tandem_indexer::ApproxIndex`]).
    Approximate,
}

/// Something the replica learns from the cluster.
#[derive(Clone, Debug)]
pub enum Input<'a> {
    /// A worker appeared in discovery, or re-registered with a new record (most likely a
    /// restart: its cache is new, so it is dumped again, or its approximate entries dropped).
    Joined {
        worker: WorkerId,
        role: WorkerRole,
        /// Where its overlap comes from; a re-join may change it.
        kv: KvSource,
        /// Its GPU tier's capacity in blocks (its record's `kv_capacity`; 0 when unknown),
        /// which the exact index reserves room for.
        device_blocks: u64,
    },
    /// A worker left discovery (deregistered, lease lapsed): purged from index and pools.
    Left {
        worker: WorkerId,
    },
    /// A batch of KV events from the event plane.
    KvEvents(&'a [KvEvent]),
    /// A worker's answer to a [`Repair`].
    Repaired {
        worker: WorkerId,
        reply: RepairReply,
    },
    /// A [`Repair`] that could not be made; asked again at the next gap or report.
    RepairFailed {
        worker: WorkerId,
    },
    LoadReport(&'a LoadReport),
    /// Where a member runs (from its record), for the KV transfer cost of a remote prefill;
    /// given after its `Joined` (ignored for a worker that is not a member). Unknown until
    /// given: every pair then counts as [`tandem_protocol::Distance::Other`].
    Placed {
        worker: WorkerId,
        placement: &'a Placement,
    },
    /// A peer replica's tracker change (our own, echoed back, are ignored).
    PeerSync(&'a SyncMessage),
}

/// One request, as the replica routes it.
#[derive(Clone, Copy, Debug)]
pub struct RouteInput<'a> {
    /// The caller's id for the request, unique among this replica's requests in flight, top
    /// bit clear. A request routed again (a retry, a migration) needs a fresh one.
    pub request: RequestId,
    pub route: RouteRequest,
    /// Sequence hashes of the prompt's full blocks.
    pub hashes: &'a [SequenceHash],
    /// Output tokens expected (e.g. `max_tokens`): counted as KV the request will hold.
    pub expected_output_tokens: u64,
    /// Overlap per worker from a standalone indexer; `None`: the replica's own index. Used
    /// for [`KvSource::Events`] workers only: approximate workers' overlap always comes from
    /// the replica's own decisions.
    pub overlap: Option<&'a OverlapScores>,
    /// The session the request belongs to: pinned to its last worker while that one can take
    /// it ([`crate::sessions`]).
    pub session: Option<SessionKey>,
}

/// A request's place in the tracker, held by whoever owns the request until it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    request: RequestId,
    remote: bool,
    /// The prefill entry still counts on the prefill worker.
    prefill_booked: bool,
    first_token: bool,
    session: Option<SessionKey>,
    /// Its LoRA adapter and the workers it runs on, for the adapter table.
    adapter: Option<AdapterId>,
    decode_worker: WorkerId,
    prefill_worker: Option<WorkerId>,
}

impl InFlight {
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// Prefilled on a prefill worker.
    pub fn is_remote(&self) -> bool {
        self.remote
    }

    fn prefill_id(&self) -> RequestId {
        RequestId(self.request.0 | PREFILL_BIT)
    }
}

/// Where a request goes, why, and what to tell the other replicas.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub decision: DisaggDecision,
    pub flight: InFlight,
    pub sync: Vec<SyncMessage>,
    /// For a request with a session: what routing did with it.
    pub session: Option<SessionOutcome>,
}

impl Plan {
    pub fn decode_worker(&self) -> WorkerId {
        self.decision.decode_worker()
    }

    pub fn prefill_worker(&self) -> Option<WorkerId> {
        self.decision.prefill_worker()
    }
}

/// A pool member: what the replica keeps of a worker itself. Joining is one insert into its
/// pool, leaving one remove; the structures that keep their own per-worker state by id (the
/// tracker, the index, breakers, sessions, capacity, adapters, the load order and the
/// saturated set) are cleared in one place ([`RoutingReplica::forget_process`],
/// [`RoutingReplica::apply`]'s `Left`).
#[derive(Clone, Debug)]
struct Member {
    /// When the worker joined, for warm-up.
    joined_ms: u64,
    kv: KvSource,
    /// Its latest load report, and how many of its requests the tracker had seen end then.
    report: Option<LoadReport>,
    ended_at_report: u64,
    /// Where it runs (from its record), for the KV transfer cost of a remote prefill.
    placement: Option<Placement>,
}

type Pool = BTreeMap<WorkerId, Member>;

/// `worker`'s record in whichever pool holds it.
fn member_of<'a>(decode: &'a Pool, prefill: &'a Pool, worker: WorkerId) -> Option<&'a Member> {
    decode.get(&worker).or_else(|| prefill.get(&worker))
}

/// One router replica (see the module docs).
#[derive(Debug)]
pub struct RoutingReplica {
    config: ReplicaConfig,
    router: Router,
    /// The exact index and its feed rules; a decision holds a second handle while it reads
    /// the index's grouped answer (which borrows the index), and nothing else does.
    index: Arc<FedIndex>,
    /// The decisions committed to [`KvSource::Approximate`] members, and only those.
    approx: ApproxIndex,
    tracker: ActiveSequences,
    rng: Rng,
    /// Decode and aggregated workers, by id.
    decode: Pool,
    prefill: Pool,
    breakers: Breakers,
    retry_budget: RetryBudget,
    sessions: Sessions,
    /// Speed estimates of the decode (aggregated) pool and of the prefill pool.
    capacity_decode: Capacity,
    capacity_prefill: Capacity,
    adapters: Adapters,
    /// The decode pool by load, for decisions that need not score every member
    /// ([`candidates`]).
    order: candidates::LoadOrder,
    joins: candidates::Joins,
    /// Decode members saturated now (kept up to date by `sync_loads` and the reports).
    saturated: std::collections::BTreeSet<WorkerId>,
    /// Scratch for the tracker's changed workers.
    dirty: Vec<WorkerId>,
    /// How long the latest decision's exact-index lookup took (zero when the overlap was
    /// given): the router's overhead by phase, for the shells' metrics. Measured only,
    /// never decided on.
    last_lookup: std::time::Duration,
}

impl RoutingReplica {
    pub fn new(config: ReplicaConfig) -> Result<Self, ConfigError> {
        let r = &config.routing;
        r.validate()?;
        let router = Router::new(RouterConfig {
            policy: r.policy,
            pool: r.pool,
        })?;
        Ok(RoutingReplica {
            router,
            index: Arc::new(FedIndex::new()),
            approx: ApproxIndex::new(r.approx),
            tracker: ActiveSequences::new(config.router_id, r.tracker),
            rng: Rng::seed_from_u64(config.seed),
            decode: Pool::new(),
            prefill: Pool::new(),
            breakers: Breakers::new(r.breaker),
            retry_budget: RetryBudget::new(r.retry_budget),
            sessions: Sessions::new(r.sessions),
            capacity_decode: Capacity::new(r.capacity),
            capacity_prefill: Capacity::new(r.capacity),
            adapters: Adapters::new(r.adapters),
            order: candidates::LoadOrder::default(),
            joins: candidates::Joins::default(),
            saturated: std::collections::BTreeSet::new(),
            dirty: Vec::new(),
            last_lookup: std::time::Duration::ZERO,
            config,
        })
    }

    pub fn config(&self) -> &ReplicaConfig {
        &self.config
    }

    /// Applies what the cluster says; returns the repairs the index needs.
    pub fn apply(&mut self, input: Input<'_>, now_ms: u64) -> Result<Vec<Repair>, FeedError> {
        Ok(match input {
            Input::Joined {
                worker,
                role,
                kv,
                device_blocks,
            } => {
                let kv = if self.config.routing.approximate_kv {
                    KvSource::Approximate
                } else {
                    kv
                };
                // A re-join keeps when it first joined, its latest report and its placement.
                let old = self
                    .decode
                    .remove(&worker)
                    .or_else(|| self.prefill.remove(&worker));
                let member = match old {
                    Some(m) => Member { kv, ..m },
                    None => Member {
                        joined_ms: now_ms,
                        kv,
                        report: None,
                        ended_at_report: 0,
                        placement: None,
                    },
                };
                let joined_ms = member.joined_ms;
                match role {
                    WorkerRole::Prefill => {
                        self.prefill.insert(worker, member);
                    }
                    WorkerRole::Decode | WorkerRole::Aggregated => {
                        self.decode.insert(worker, member);
                        self.joins.joined(joined_ms);
                    }
                }
                self.member_changed(worker);
                self.forget_process(worker);
                self.index_mut().apply(Input::Joined {
                    worker,
                    role,
                    kv,
                    device_blocks,
                })?
            }
            Input::Left { worker } => {
                self.decode.remove(&worker);
                self.prefill.remove(&worker);
                self.forget_process(worker);
                self.member_changed(worker);
                self.tracker.remove_worker(worker);
                self.index_mut().apply(input)?
            }
            Input::KvEvents(_) | Input::Repaired { .. } | Input::RepairFailed { .. } => {
                self.index_mut().apply(input)?
            }
            Input::LoadReport(r) => {
                if self.pool_of(r.worker_id).is_none() {
                    return Ok(Vec::new());
                }
                self.adapters.report(r.worker_id, &r.adapters);
                let ended = self.tracker.ended(r.worker_id);
                if let Some(m) = self.member_mut(r.worker_id) {
                    m.report = Some((*r).clone());
                    m.ended_at_report = ended;
                }
                self.member_changed(r.worker_id);
                if self.prefill.contains_key(&r.worker_id) {
                    self.capacity_prefill.report(r);
                } else {
                    self.capacity_decode.report(r);
                }
                self.index_mut().apply(input)?
            }
            Input::Placed { worker, placement } => {
                if let Some(m) = self.member_mut(worker) {
                    m.placement = Some(placement.clone());
                }
                Vec::new()
            }
            Input::PeerSync(msg) => {
                // A peer's request on a worker that is not (or no longer) a member: after
                // `Left` it would be load on a worker that is gone, lingering until the TTL
                // and landing on the worker if it rejoins under the same id. Under-counting
                // a worker we have not yet seen join is the smaller error (it lasts only
                // that request's life).
                let stray = matches!(msg, SyncMessage::Add { worker, .. } if self.pool_of(*worker).is_none());
                if !stray {
                    self.tracker.apply(msg, now_ms);
                }
                Vec::new()
            }
        })
    }

    /// How long the latest decision's lookup in this replica's exact index took; zero when
    /// the decision was given its overlap ([`RouteInput::overlap`]).
    pub fn last_index_lookup(&self) -> std::time::Duration {
        self.last_lookup
    }

    /// Decides where a request goes and records it: [`RoutingReplica::decide`] then
    /// [`RoutingReplica::commit`].
    pub fn route(
        &mut self,
        input: &RouteInput<'_>,
        excluded: &[WorkerId],
        now_ms: u64,
    ) -> Result<Plan, RouteError> {
        let decision = self.decide(input, excluded, now_ms)?;
        self.commit(input, decision, now_ms)
    }

    /// Picks the decode worker, and the prefill worker when prefill is remote, among the
    /// members not in `excluded` (workers that already failed this request). Records nothing:
    /// [`RoutingReplica::commit`] does.
    pub fn decide(
        &mut self,
        input: &RouteInput<'_>,
        excluded: &[WorkerId],
        now_ms: u64,
    ) -> Result<DisaggDecision, RouteError> {
        self.tracker.expire(now_ms);
        self.sync_loads();
        self.last_lookup = std::time::Duration::ZERO;
        // A decision that scores only holders and the least loaded reads the grouped answer,
        // one that scores every member the list (`answer.rs`).
        let index = Arc::clone(&self.index);
        let (listed, grouped);
        let exact = match input.overlap {
            Some(s) => Answer::Listed(s),
            None => {
                let started = std::time::Instant::now();
                let answer = if self.takes_shortcut(input, now_ms) {
                    grouped = index.feed().find_extents(input.hashes);
                    Answer::Grouped(&grouped)
                } else {
                    listed = index.feed().find_matches(input.hashes);
                    Answer::Listed(&listed)
                };
                self.last_lookup = started.elapsed();
                answer
            }
        };
        let approx = self.approx_matches(input.hashes, now_ms);
        let scores = Overlaps {
            exact,
            approx: &approx,
        };
        // Workers whose breaker is open are left out like those that failed this request.
        let mut excluded_all = excluded.to_vec();
        let mut open_decode = 0usize;
        for id in self.breakers.refused(now_ms) {
            if self.pool_of(id).is_some() && !excluded.contains(&id) {
                excluded_all.push(id);
                open_decode += usize::from(self.decode.contains_key(&id));
            }
        }
        let excluded = &excluded_all[..];
        self.capacity_decode.refresh(now_ms);
        self.capacity_prefill.refresh(now_ms);
        let cfg = &self.config.routing;
        let adapter = input.route.adapter;
        let prefill = self.views(
            &self.prefill,
            &cfg.disagg.prefill_pool,
            scores,
            (excluded, adapter),
            now_ms,
        );
        let decode_pool = if prefill.is_empty() {
            &cfg.pool
        } else {
            &cfg.disagg.decode_pool
        };
        let decode_pool = *decode_pool;
        let mut decode = self.decode_views(input, &decode_pool, scores, excluded, now_ms);
        // A pinned session whose worker can take it: that worker is the only candidate (the
        // disaggregation rule still decides where to prefill).
        // (The shortcut may have left it out of the candidates: its view is made alone then.)
        let pinned = input
            .session
            .and_then(|key| self.sessions.pinned(key, now_ms))
            .filter(|w| !excluded.contains(w))
            .and_then(|w| {
                decode.iter().find(|v| v.id == w).copied().or_else(|| {
                    let m = self.decode.get(&w)?;
                    Some(self.view_of(w, m, &decode_pool, scores, adapter, now_ms))
                })
            })
            .filter(|v| !decode_pool.is_busy(&v.load) && !self.is_saturated(v.id));
        if let Some(v) = pinned {
            decode = vec![v];
        }
        if decode.is_empty() {
            return Err(if self.decode.is_empty() {
                RouteError::NoWorkers
            } else if open_decode > 0 {
                RouteError::CircuitOpen
            } else {
                RouteError::AllExcluded
            });
        }
        let mut decision = if prefill.is_empty() {
            let d = self.router.select(&input.route, &decode, &mut self.rng)?;
            DisaggDecision {
                decode: d,
                prefill: None,
                why: DisaggReason::NoPrefillPool,
            }
        } else {
            let cfg = &self.config.routing;
            let (decode_pool, prefill_pool) = (&self.decode, &self.prefill);
            let place = |w: WorkerId| member_of(decode_pool, prefill_pool, w)?.placement.as_ref();
            let distance = |a: WorkerId, b: WorkerId| match (place(a), place(b)) {
                (Some(a), Some(b)) => a.distance(b),
                _ => Distance::Other,
            };
            disagg::decide(
                &cfg.disagg,
                &input.route,
                &decode,
                &prefill,
                &distance,
                &mut self.rng,
            )?
        };
        if pinned.is_some() {
            decision.decode.rule = Rule::Session;
        }
        Ok(decision)
    }

    /// Records `decision` for `input` in the tracker, and in the approximate index for the
    /// chosen workers that are [`KvSource::Approximate`] members: the decode worker, and the
    /// prefill worker of a remote prefill.
    pub fn commit(
        &mut self,
        input: &RouteInput<'_>,
        decision: DisaggDecision,
        now_ms: u64,
    ) -> Result<Plan, RouteError> {
        let request = input.request;
        if request.0 & PREFILL_BIT != 0 {
            return Err(RouteError::InvalidRequestId(request));
        }
        self.breakers.on_chosen(decision.decode.worker, now_ms);
        if let Some(p) = &decision.prefill {
            self.breakers.on_chosen(p.worker, now_ms);
        }
        let route = &input.route;
        let bs = u64::from(route.block_size.get());
        let prompt = route.prompt_tokens;
        let overlap = |d: &Decision| d.chosen_terms().map_or(0, |t| u64::from(t.overlap.total()));
        let remote = decision.prefill.is_some();
        let mut sync = Vec::with_capacity(2);
        sync.push(self.tracker.add(
            NewSequence {
                request,
                worker: decision.decode.worker,
                blocks: input.hashes.to_vec(),
                prefill_tokens: if remote {
                    0
                } else {
                    prompt.saturating_sub(overlap(&decision.decode) * bs)
                },
                private_blocks: NewSequence::private_blocks_for(
                    prompt,
                    input.expected_output_tokens,
                    route.block_size,
                ),
            },
            now_ms,
        ));
        let session = input
            .session
            .filter(|_| self.sessions.config().enabled)
            .map(|key| self.sessions.bind(key, decision.decode.worker, now_ms));
        let flight = InFlight {
            request,
            remote,
            prefill_booked: remote,
            first_token: false,
            session: session.and(input.session),
            adapter: route.adapter,
            decode_worker: decision.decode.worker,
            prefill_worker: decision.prefill.as_ref().map(|p| p.worker),
        };
        self.record_approx(decision.decode.worker, input.hashes, now_ms);
        if let Some(a) = route.adapter {
            self.adapters.start(decision.decode.worker, a, now_ms);
            if let Some(p) = &decision.prefill {
                self.adapters.start(p.worker, a, now_ms);
            }
        }
        if let Some(p) = &decision.prefill {
            self.record_approx(p.worker, input.hashes, now_ms);
            sync.push(self.tracker.add(
                NewSequence {
                    request: flight.prefill_id(),
                    worker: p.worker,
                    blocks: input.hashes.to_vec(),
                    prefill_tokens: prompt.saturating_sub(overlap(p) * bs),
                    private_blocks: 1,
                },
                now_ms,
            ));
        }
        Ok(Plan {
            decision,
            flight,
            sync,
            session,
        })
    }

    /// The request's first token: its prefill load leaves (the prefill worker's entry too).
    pub fn first_token(&mut self, flight: &mut InFlight, now_ms: u64) -> Vec<SyncMessage> {
        if flight.first_token {
            return Vec::new();
        }
        flight.first_token = true;
        let mut sync = vec![self.tracker.prefill_done(flight.request, now_ms)];
        sync.extend(self.release_prefill(flight, now_ms));
        sync
    }

    /// The prefill worker finished its part of a remote prefill (the KV is on its way): its
    /// entry leaves before the first token.
    pub fn prefill_finished(&mut self, flight: &mut InFlight, now_ms: u64) -> Vec<SyncMessage> {
        self.release_prefill(flight, now_ms).into_iter().collect()
    }

    /// The request ended (finished, cancelled, failed, refused): all its load leaves.
    pub fn finish(&mut self, mut flight: InFlight, now_ms: u64) -> Vec<SyncMessage> {
        if let Some(key) = flight.session {
            self.sessions.release(key, now_ms);
        }
        let mut sync = vec![self.tracker.free(flight.request, now_ms)];
        sync.extend(self.release_prefill(&mut flight, now_ms));
        if let Some(a) = flight.adapter {
            self.adapters.end(flight.decode_worker, a, now_ms);
        }
        sync
    }

    fn release_prefill(&mut self, flight: &mut InFlight, now_ms: u64) -> Option<SyncMessage> {
        if !flight.prefill_booked {
            return None;
        }
        flight.prefill_booked = false;
        if let (Some(a), Some(p)) = (flight.adapter, flight.prefill_worker) {
            self.adapters.end(p, a, now_ms);
        }
        Some(self.tracker.free(flight.prefill_id(), now_ms))
    }

    /// A request on `worker` succeeded (for a decode worker: its first token came; for a
    /// prefill worker: its KV arrived). Counts toward the retry budget for decode workers.
    pub fn worker_succeeded(&mut self, worker: WorkerId, now_ms: u64) {
        self.breakers.success(worker, now_ms);
        if self.decode.contains_key(&worker) {
            self.retry_budget.success(now_ms);
        }
    }

    /// A request on `worker` failed for a reason that is the worker's (transport, timeout,
    /// a 5xx-class answer, a stream that died) — never the client's own error. True when
    /// this opened the worker's breaker.
    pub fn worker_failed(&mut self, worker: WorkerId, now_ms: u64) -> bool {
        self.breakers.failure(worker, now_ms)
    }

    /// Takes one retry (or hedge) from the budget; false when it is spent.
    pub fn try_retry(&mut self, now_ms: u64) -> bool {
        self.retry_budget.try_retry(now_ms)
    }

    /// A worker's breaker state.
    pub fn breaker(&self, worker: WorkerId, now_ms: u64) -> BreakerState {
        self.breakers.state(worker, now_ms)
    }

    /// The session table (its counters are the session metrics).
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// What the replica knows of the workers' LoRA adapters.
    pub fn adapters(&self) -> &Adapters {
        &self.adapters
    }

    pub fn breakers(&self) -> &Breakers {
        &self.breakers
    }

    /// Moves on tracker entries whose time is up (call now and then).
    pub fn expire(&mut self, now_ms: u64) {
        self.tracker.expire(now_ms);
    }

    pub fn feed(&self) -> &IndexFeed {
        self.index.feed()
    }

    /// The approximate index: the decisions committed to approximate workers.
    pub fn approx(&self) -> &ApproxIndex {
        &self.approx
    }

    /// A member's KV source.
    pub fn kv_source(&self, worker: WorkerId) -> Option<KvSource> {
        self.pool_of(worker).map(|m| m.kv)
    }

    /// The overlap the policies see for a prompt, as one map (for shells that serve it, e.g. a
    /// standalone indexer or a debug endpoint): event members' from the exact index,
    /// approximate members' from the approximate index at `now_ms`.
    pub fn overlap(&mut self, hashes: &[SequenceHash], now_ms: u64) -> OverlapScores {
        let exact = self.index.feed().find_matches(hashes);
        let approx = self.approx_matches(hashes, now_ms);
        let is_approx = |w: WorkerId| self.kv_source(w) == Some(KvSource::Approximate);
        let mut scores: Vec<_> = exact
            .iter()
            .filter(|(w, _)| !is_approx(*w))
            .chain(approx.iter().filter(|(w, _)| is_approx(*w)))
            .copied()
            .collect();
        // Disjoint sets of workers, each sorted: the key is unique.
        scores.sort_unstable_by_key(|&(w, _)| w);
        OverlapScores { scores }
    }

    pub fn tracker(&self) -> &ActiveSequences {
        &self.tracker
    }

    /// The latest load report of a member.
    pub fn report(&self, worker: WorkerId) -> Option<&LoadReport> {
        self.pool_of(worker)?.report.as_ref()
    }

    /// Members of the decode (aggregated) pool, by id.
    pub fn decode_workers(&self) -> impl ExactSizeIterator<Item = WorkerId> + '_ {
        self.decode.keys().copied()
    }

    /// Members of the prefill pool, by id.
    pub fn prefill_workers(&self) -> impl ExactSizeIterator<Item = WorkerId> + '_ {
        self.prefill.keys().copied()
    }

    /// Matches in the approximate index (expiring what is due); nothing to look up while it
    /// is empty, which keeps pools of event workers free of its cost.
    fn approx_matches(&mut self, hashes: &[SequenceHash], now_ms: u64) -> OverlapScores {
        if self.approx.is_empty() {
            return OverlapScores::default();
        }
        self.approx.find_matches(hashes, now_ms)
    }

    /// Records a prompt routed to `worker` when it is an approximate member (a decision for a
    /// worker that left meanwhile records nothing, so entries exist only for members).
    fn record_approx(&mut self, worker: WorkerId, hashes: &[SequenceHash], now_ms: u64) {
        if self.kv_source(worker) == Some(KvSource::Approximate) && !hashes.is_empty() {
            self.approx.record(worker, hashes, now_ms);
        }
    }

    /// The index, to change: no decision is in flight while `&mut self` is held, so this is
    /// the only handle.
    fn index_mut(&mut self) -> &mut FedIndex {
        Arc::get_mut(&mut self.index).expect("no decision holds the index between calls")
    }

    fn pool_of(&self, worker: WorkerId) -> Option<&Member> {
        member_of(&self.decode, &self.prefill, worker)
    }

    fn member_mut(&mut self, worker: WorkerId) -> Option<&mut Member> {
        match self.decode.get_mut(&worker) {
            Some(m) => Some(m),
            None => self.prefill.get_mut(&worker),
        }
    }

    /// Forgets what was assumed of a worker's process and cache: at a (re-)join, whatever the
    /// source, the cache is new (its approximate entries go) and so is the process (its
    /// breaker starts closed, its sessions, speed estimates and adapters go); at a leave too.
    fn forget_process(&mut self, worker: WorkerId) {
        self.approx.remove_worker(worker);
        self.breakers.remove(worker);
        self.sessions.remove_worker(worker);
        self.capacity_decode.remove(worker);
        self.capacity_prefill.remove(worker);
        self.adapters.remove(worker);
    }
}
