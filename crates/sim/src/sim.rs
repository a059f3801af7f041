//! The simulation proper: workers, router replicas and the event plane, driven by one event
//! queue in virtual microseconds.
//!
//! Worker ids: the aggregated (or decode) workers are `0 .. workers`, the prefill workers
//! follow; every replica learns them as members at time 0. Request `i` is `RequestId(i)`
//! everywhere (its routing replica tracks its prefill half itself).

use std::rc::Rc;

use std::collections::BTreeMap as Map;
use tandem_engine::{
    BlockPoolConfig, EngineRequest, ErrorClass, KvShape, MockEngine, MockEngineConfig,
    MockerConfig, RequestOutput, SchedulerConfig,
};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{
    AdapterId, BlockSize, HashSeed, LoadReport, RequestId, SequenceHash, WorkerId, WorkerRole,
};
use tandem_router::groups::Arm;
use tandem_router::{
    InFlight, Input, KvSource, RepairReply, RouteInput, RoutingReplica, SessionKey, SyncMessage,
};

use crate::config::SimConfig;
use crate::error::SimError;
use crate::queue::EventQueue;
use crate::replica::{KvPayload, deliver};
use crate::stats::{Outcome, RequestTimes, Stats, arm_index};
use crate::workload::RequestSpec;
use tandem_workload::AdapterMix;

#[derive(Debug)]
enum Ev {
    Arrival(u32),
    StepDone(u32),
    /// KV events (or a dump) of one worker reaching one router.
    Kv {
        router: u32,
        worker: u32,
        payload: Rc<KvPayload>,
    },
    Sync {
        router: u32,
        msg: Rc<SyncMessage>,
    },
    /// Router's snapshot timer: gather events and reports now, deliver them after the delay.
    SnapshotTick(u32),
    Reports {
        router: u32,
        reports: Vec<LoadReport>,
    },
    /// The KV of request `i` is in its decode worker's blocks; `first_token` came from the
    /// prefill worker.
    TransferDone {
        i: u32,
        first_token: u32,
    },
    Sample,
    /// Streaming mode with capacity weights on: every worker's load report to every router.
    ReportTick,
}

/// Worker `w`'s placement when the topology has racks: its own host and process, rack
/// `w % racks`.
fn placement(t: &crate::config::TopologyConfig, w: u32) -> Option<tandem_protocol::Placement> {
    (t.racks > 0).then(|| tandem_protocol::Placement {
        process: format!("p{w}"),
        host: format!("h{w}"),
        rack: format!("r{}", w % t.racks),
    })
}

/// How often workers report their load in streaming mode (when the routers use the reports:
/// capacity weights, LoRA slots), as a live worker's `--load-interval-ms` default.
const REPORT_INTERVAL_US: u64 = 500_000;

struct Worker {
    engine: MockEngine,
    busy: bool,
    /// Last event id taken from the engine for streaming delivery.
    published: u64,
    routed: u64,
}

/// One request's progress.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReqState {
    pub arrival_us: u64,
    pub router: u32,
    pub worker: u32,
    pub remote: bool,
    pub first_token_us: Option<u64>,
    pub last_token_us: u64,
    pub tokens: u32,
    pub done: bool,
    pub rejected: bool,
    /// Its arm, in an experiment.
    pub arm: Option<Arm>,
    /// Its place in its router's tracker, from routing to its end.
    pub flight: Option<InFlight>,
}

pub(crate) struct Sim<'a> {
    cfg: &'a SimConfig,
    specs: &'a [RequestSpec],
    block_size: BlockSize,
    workers: Vec<Worker>,
    /// Aggregated / decode workers: `0 .. n_decode`.
    n_decode: u32,
    replicas: Vec<RoutingReplica>,
    /// Repairs made for the replicas (a gap after an event ring overflowed), all replicas.
    gaps_repaired: u64,
    /// Per router, per worker: last event id sent in a snapshot.
    snap_sent: Vec<Vec<u64>>,
    queue: EventQueue<Ev>,
    pub reqs: Vec<ReqState>,
    /// Remote prefills in flight: prompt tokens the decode worker does not cache, whose KV
    /// travels once the prefill is done.
    pending: Map<u32, u64>,
    outstanding: usize,
    pub stats: Stats,
    /// Every prompt block routed so far (up to [`SEEN_CAP`]), for the miss breakdown.
    seen: hashbrown::HashSet<SequenceHash>,
}

/// Distinct blocks remembered for the miss breakdown at most (~256 MB).
const SEEN_CAP: usize = 16 << 20;

impl<'a> Sim<'a> {
    pub fn new(cfg: &'a SimConfig, specs: &'a [RequestSpec]) -> Result<Self, SimError> {
        let block_size = BlockSize::new(cfg.engine.block_size)
            .map_err(|e| SimError::InvalidConfig(format!("--block-size: {e}")))?;
        let total = (cfg.topology.workers + cfg.topology.prefill_workers) as usize;
        let mut workers = Vec::with_capacity(total);
        for w in 0..total {
            let mut pool = BlockPoolConfig::new(WorkerId(w as u64), cfg.engine.device_blocks);
            pool.block_size = block_size;
            pool.host_blocks = cfg.engine.host_blocks;
            let ecfg = MockEngineConfig {
                pool,
                scheduler: SchedulerConfig {
                    max_num_batched_tokens: cfg.engine.max_num_batched_tokens,
                    max_num_seqs: cfg.engine.max_num_seqs,
                    max_loras: cfg.engine.max_loras,
                    ..SchedulerConfig::default()
                },
                mocker: MockerConfig {
                    kv_shape: KvShape::TIMING_ONLY,
                    speedup_ratio: cfg.engine.speedup_ratio
                        * cfg
                            .worker_speedups
                            .get(w % cfg.worker_speedups.len().max(1))
                            .copied()
                            .unwrap_or(1.0),
                    adapter_load_ms: cfg.engine.adapter_load_ms,
                    ..MockerConfig::default()
                },
            };
            workers.push(Worker {
                engine: MockEngine::new(ecfg)?,
                busy: false,
                published: 0,
                routed: 0,
            });
        }
        let routers = cfg.topology.routers;
        let mut replicas = Vec::with_capacity(routers as usize);
        for r in 0..routers {
            let mut rep = RoutingReplica::new(cfg.replica_config(r))?;
            for (w, worker) in workers.iter().enumerate() {
                let role = if w < cfg.topology.workers as usize {
                    if cfg.topology.prefill_workers > 0 {
                        WorkerRole::Decode
                    } else {
                        WorkerRole::Aggregated
                    }
                } else {
                    WorkerRole::Prefill
                };
                let id = WorkerId(w as u64);
                // A joining worker is dumped: empty at time 0.
                for _ in rep.apply(
                    Input::Joined {
                        worker: id,
                        role,
                        kv: KvSource::Events,
                        // No reservation: a short simulation of a large cluster would hold
                        // every replica's index at full size for caches it never fills (the
                        // reservation changes no decision).
                        device_blocks: 0,
                    },
                    0,
                )? {
                    let reply = RepairReply::Dump(worker.engine.dump());
                    rep.apply(Input::Repaired { worker: id, reply }, 0)?;
                }
                if let Some(placement) = placement(&cfg.topology, w as u32) {
                    rep.apply(
                        Input::Placed {
                            worker: id,
                            placement: &placement,
                        },
                        0,
                    )?;
                }
            }
            replicas.push(rep);
        }
        Ok(Sim {
            cfg,
            specs,
            block_size,
            workers,
            n_decode: cfg.topology.workers,
            replicas,
            gaps_repaired: 0,
            snap_sent: vec![vec![0; total]; routers as usize],
            queue: EventQueue::new(),
            reqs: vec![ReqState::default(); specs.len()],
            pending: Map::new(),
            outstanding: specs.len(),
            stats: Stats::default(),
            seen: hashbrown::HashSet::new(),
        })
    }

    /// Runs every request to its end; returns the virtual time of the last event.
    pub fn run(&mut self) -> Result<u64, SimError> {
        for (i, s) in self.specs.iter().enumerate() {
            self.queue.push(s.arrival_us, Ev::Arrival(i as u32));
        }
        let ep = self.cfg.event_plane;
        if ep.snapshot_interval_us > 0 {
            let r_n = u64::from(self.cfg.topology.routers);
            for r in 0..self.cfg.topology.routers {
                let phase = if ep.snapshot_stagger {
                    ep.snapshot_interval_us * u64::from(r) / r_n
                } else {
                    0
                };
                self.queue.push(phase, Ev::SnapshotTick(r));
            }
        }
        self.queue.push(0, Ev::Sample);
        // Reports matter to the routers for capacity weights and LoRA slots; without either
        // they change nothing, and the timer would only cost time.
        let reports_used = self.cfg.routing.capacity.enabled || self.cfg.engine.max_loras > 0;
        if ep.snapshot_interval_us == 0 && reports_used {
            self.queue.push(REPORT_INTERVAL_US, Ev::ReportTick);
        }
        let mut end = 0;
        while let Some((now, ev)) = self.queue.pop() {
            let timer = matches!(ev, Ev::SnapshotTick(_) | Ev::Sample | Ev::ReportTick);
            if self.outstanding == 0 && timer {
                continue; // periodic timers stop once every request has ended
            }
            end = now;
            self.handle(now, ev)?;
        }
        Ok(end)
    }

    fn handle(&mut self, now: u64, ev: Ev) -> Result<(), SimError> {
        match ev {
            Ev::Arrival(i) => self.arrive(i, now)?,
            Ev::StepDone(w) => {
                self.workers[w as usize].busy = false;
                let outs = self.workers[w as usize].engine.finish_step(now);
                for o in &outs {
                    self.on_output(w, o, now)?;
                }
                self.kick(w, now)?;
            }
            Ev::Kv {
                router,
                worker,
                payload,
            } => {
                let engine = &self.workers[worker as usize].engine;
                let rep = &mut self.replicas[router as usize];
                self.gaps_repaired += deliver(rep, &payload, now / 1000, || engine.dump())?;
            }
            Ev::Sync { router, msg } => {
                self.replicas[router as usize].apply(Input::PeerSync(&msg), now / 1000)?;
            }
            Ev::SnapshotTick(r) => self.snapshot(r, now)?,
            Ev::Reports { router, reports } => {
                let rep = &mut self.replicas[router as usize];
                for report in &reports {
                    // Reports follow the same snapshot's events: they never show a gap here.
                    for r in rep.apply(Input::LoadReport(report), now / 1000)? {
                        let engine = &self.workers[r.worker.0 as usize].engine;
                        let reply = RepairReply::Dump(engine.dump());
                        rep.apply(
                            Input::Repaired {
                                worker: r.worker,
                                reply,
                            },
                            now / 1000,
                        )?;
                        self.gaps_repaired += 1;
                    }
                }
            }
            Ev::TransferDone { i, first_token } => self.transfer_done(i, first_token, now)?,
            Ev::ReportTick => {
                let at = now + self.cfg.event_plane.delay_us;
                for r in 0..self.cfg.topology.routers {
                    let reports = self.workers.iter().map(|w| w.engine.load_report(now));
                    let reports = reports.collect();
                    self.queue.push(at, Ev::Reports { router: r, reports });
                }
                self.queue.push(now + REPORT_INTERVAL_US, Ev::ReportTick);
            }
            Ev::Sample => {
                let loads: Vec<u64> = self.workers[..self.n_decode as usize]
                    .iter()
                    .map(|w| {
                        let e = &w.engine;
                        (e.num_waiting() + e.num_running() + e.num_awaiting_kv()) as u64
                    })
                    .collect();
                self.stats.sample_imbalance(now, &loads);
                self.queue
                    .push(now + self.cfg.sample_interval_us, Ev::Sample);
            }
        }
        Ok(())
    }

    /// Routes request `i` through its replica and hands it to the engine(s).
    fn arrive(&mut self, i: u32, now: u64) -> Result<(), SimError> {
        let specs = self.specs;
        let spec = &specs[i as usize];
        let tokens = spec.prompt.tokens();
        let adapter = spec.adapter.map(AdapterMix::name);
        let seed = HashSeed::for_request(None, adapter.as_deref());
        let hashes = compute_block_hashes(&tokens, self.block_size, seed);
        let seq: Vec<SequenceHash> = hashes.iter().map(|h| h.sequence).collect();
        let r = i % self.cfg.topology.routers;
        let now_ms = now / 1000;
        let mut route = self
            .cfg
            .routing
            .route_request(&tokens, self.block_size, seed);
        route.adapter = adapter.as_deref().map(AdapterId::of);
        // An experiment's arm, as the frontend picks it: by the session (a client sends the
        // conversation's id as text), else by the prompt's start.
        let arm = self.cfg.experiment.as_ref().map(|e| {
            let session = spec.session.map(|s| s.to_string());
            let arm = e.arm_of(session.as_deref(), &tokens);
            route.overrides = e.arm(arm).overrides();
            arm
        });
        let engine_request = |tokens: Vec<u32>, max_tokens: u32| EngineRequest {
            hash_seed: seed,
            adapter: adapter.clone(),
            ..EngineRequest::new(RequestId(u64::from(i)), tokens, max_tokens)
        };
        let input = RouteInput {
            request: RequestId(u64::from(i)),
            route,
            hashes: &seq,
            expected_output_tokens: u64::from(spec.max_tokens),
            overlap: None,
            session: spec.session.map(SessionKey),
        };
        let mut decision = self.replicas[r as usize].decide(&input, &[], now_ms)?;
        let dw = decision.decode_worker().0 as u32;
        // The decode worker reserves blocks for the KV it does not cache, now; when it cannot,
        // the request is prefilled locally there instead.
        let mut transfer_tokens = 0;
        if decision.is_remote() {
            let req = engine_request(tokens.clone(), spec.max_tokens);
            match self.workers[dw as usize]
                .engine
                .begin_remote_prefill(req, now)
            {
                Ok(rp) => transfer_tokens = rp.transfer().len() as u64,
                Err(e) => match e.class() {
                    ErrorClass::Overloaded => {
                        self.stats.transfer_fallbacks += 1;
                        decision.prefill_locally();
                    }
                    // Refused as a local request too, by `submit`.
                    ErrorClass::InvalidRequest => decision.prefill_locally(),
                    ErrorClass::Unavailable | ErrorClass::Cancelled | ErrorClass::Internal => {
                        return Err(SimError::Internal(format!("request {i}: {e}")));
                    }
                },
            }
        }
        let plan = self.replicas[r as usize].commit(&input, decision, now_ms)?;
        let prompt = tokens.len() as u64;
        // What the index predicted the prefilling engine would find cached: the overlap it
        // reported for that worker at routing, of which the engine can reuse all but the block
        // holding the last prompt token (always computed).
        let prefiller = plan
            .decision
            .prefill
            .as_ref()
            .unwrap_or(&plan.decision.decode);
        let overlap = prefiller
            .chosen_terms()
            .map_or(0, |t| u64::from(t.overlap.total()));
        let bs = u64::from(self.block_size.get());
        let reusable = prompt.saturating_sub(1) / bs;
        self.stats.predicted_cached_tokens += overlap.min(reusable) * bs;
        // The miss breakdown: the most any candidate of that pool held, and how much of the
        // prompt was ever computed before.
        let best = prefiller
            .explain
            .iter()
            .map(|t| u64::from(t.overlap.total()))
            .max()
            .unwrap_or(0)
            .min(reusable);
        let ever = (seq.iter().take_while(|h| self.seen.contains(*h)).count() as u64).min(reusable);
        let ever = ever.max(best);
        self.stats.reusable_tokens += reusable * bs;
        self.stats.miss_cold_tokens += (reusable - ever) * bs;
        self.stats.miss_evicted_tokens += (ever - best) * bs;
        self.stats.miss_escaped_tokens += (best - overlap.min(reusable)) * bs;
        for h in &seq {
            if self.seen.len() >= SEEN_CAP {
                break;
            }
            self.seen.insert(*h);
        }
        let st = &mut self.reqs[i as usize];
        st.arm = arm;
        st.arrival_us = now;
        st.router = r;
        st.worker = dw;
        st.remote = plan.flight.is_remote();
        st.flight = Some(plan.flight);
        self.workers[dw as usize].routed += 1;
        let target = if let Some(pw) = plan.prefill_worker() {
            let pw = pw.0 as u32;
            self.workers[pw as usize].routed += 1;
            self.stats.remote_prefills += 1;
            self.pending.insert(i, transfer_tokens);
            (pw, engine_request(tokens, 1))
        } else {
            self.stats.local_prefills += 1;
            (dw, engine_request(tokens, spec.max_tokens))
        };
        for m in plan.sync {
            self.sync(r, m, now);
        }
        self.stats.prompt_tokens += prompt;
        if let Some(arm) = arm {
            self.stats.arm_tokens[arm_index(arm)].0 += prompt;
        }
        self.submit(i, target.0, target.1, now)
    }

    /// Adds a request to an engine; a refusal ends the request as rejected.
    fn submit(&mut self, i: u32, w: u32, req: EngineRequest, now: u64) -> Result<(), SimError> {
        match self.workers[w as usize].engine.add_request(req, now) {
            Ok(()) => self.kick(w, now),
            Err(e)
                if matches!(
                    e.class(),
                    ErrorClass::InvalidRequest | ErrorClass::Overloaded
                ) =>
            {
                if self.pending.remove(&i).is_some() {
                    // The prefill worker refused: release the decode worker's reservation.
                    let d = self.reqs[i as usize].worker;
                    self.workers[d as usize]
                        .engine
                        .abort(RequestId(u64::from(i)));
                }
                let st = &mut self.reqs[i as usize];
                st.rejected = true;
                let r = st.router;
                self.end_tracking(i, r, now);
                self.outstanding -= 1;
                Ok(())
            }
            Err(e) => Err(SimError::Internal(format!("request {i}: {e}"))),
        }
    }

    /// Ends request `i` in its router's tracker (and tells the peers).
    fn end_tracking(&mut self, i: u32, r: u32, now: u64) {
        let Some(flight) = self.reqs[i as usize].flight.take() else {
            return;
        };
        for m in self.replicas[r as usize].finish(flight, now / 1000) {
            self.sync(r, m, now);
        }
    }

    /// Sends a tracker delta to the other replicas when replica sync is on.
    fn sync(&mut self, from: u32, msg: SyncMessage, now: u64) {
        let routers = self.cfg.topology.routers;
        if routers == 1 || !self.cfg.topology.replica_sync {
            return;
        }
        let msg = Rc::new(msg);
        let at = now + self.cfg.event_plane.delay_us;
        // Before any arrival of that instant: a replica that routed a request at `now` has
        // told its peers before they route the next one (with delay 0, "at once").
        for r in (0..routers).filter(|&r| r != from) {
            self.queue.push_first(
                at,
                Ev::Sync {
                    router: r,
                    msg: Rc::clone(&msg),
                },
            );
        }
    }

    /// Starts the worker's next step if it is idle and has work, then publishes its events.
    fn kick(&mut self, w: u32, now: u64) -> Result<(), SimError> {
        let worker = &mut self.workers[w as usize];
        if !worker.busy
            && let Some(step) = worker.engine.begin_step(now)
        {
            worker.busy = true;
            self.queue
                .push(now + step.duration_us().max(1), Ev::StepDone(w));
        }
        self.publish(w, now)
    }

    /// Streams the worker's new KV events to every router (streaming mode only).
    fn publish(&mut self, w: u32, now: u64) -> Result<(), SimError> {
        if self.cfg.event_plane.snapshot_interval_us > 0 {
            return Ok(());
        }
        let worker = &mut self.workers[w as usize];
        let payload = match worker.engine.events_since(worker.published) {
            Ok(evs) if evs.is_empty() => return Ok(()),
            Ok(evs) => {
                worker.published = evs.last().map_or(worker.published, |e| e.event_id);
                KvPayload::Events(evs)
            }
            Err(_) => {
                let d = worker.engine.dump();
                worker.published = d.last_event_id;
                KvPayload::Dump(d)
            }
        };
        let delay = self.cfg.event_plane.delay_us;
        if delay == 0 {
            let engine = &self.workers[w as usize].engine;
            for rep in &mut self.replicas {
                self.gaps_repaired += deliver(rep, &payload, now / 1000, || engine.dump())?;
            }
            return Ok(());
        }
        let payload = Rc::new(payload);
        for r in 0..self.cfg.topology.routers {
            self.queue.push(
                now + delay,
                Ev::Kv {
                    router: r,
                    worker: w,
                    payload: Rc::clone(&payload),
                },
            );
        }
        Ok(())
    }

    /// A router's snapshot: every worker's events since the last one and its load report,
    /// delivered after the event delay.
    fn snapshot(&mut self, r: u32, now: u64) -> Result<(), SimError> {
        let at = now + self.cfg.event_plane.delay_us;
        let mut reports = Vec::with_capacity(self.workers.len());
        for (w, worker) in self.workers.iter().enumerate() {
            let sent = &mut self.snap_sent[r as usize][w];
            let payload = match worker.engine.events_since(*sent) {
                Ok(evs) if evs.is_empty() => None,
                Ok(evs) => {
                    *sent = evs.last().map_or(*sent, |e| e.event_id);
                    Some(KvPayload::Events(evs))
                }
                Err(_) => {
                    let d = worker.engine.dump();
                    *sent = d.last_event_id;
                    Some(KvPayload::Dump(d))
                }
            };
            if let Some(p) = payload {
                self.queue.push(
                    at,
                    Ev::Kv {
                        router: r,
                        worker: w as u32,
                        payload: Rc::new(p),
                    },
                );
            }
            reports.push(worker.engine.load_report(now));
        }
        self.queue.push(at, Ev::Reports { router: r, reports });
        self.queue.push(
            now + self.cfg.event_plane.snapshot_interval_us,
            Ev::SnapshotTick(r),
        );
        Ok(())
    }

    fn on_output(&mut self, w: u32, o: &RequestOutput, now: u64) -> Result<(), SimError> {
        let i = o.id.0 as u32;
        let st = &self.reqs[i as usize];
        let r = st.router;
        let now_ms = now / 1000;
        if w >= self.n_decode {
            // The prefill half of a remote prefill: max_tokens 1, so first and last token.
            if o.first_token {
                self.stats.cached(st.arm, o.cached_tokens as u64);
                let rep = &mut self.replicas[r as usize];
                let msgs = match self.reqs[i as usize].flight.as_mut() {
                    Some(f) => rep.prefill_finished(f, now_ms),
                    None => Vec::new(),
                };
                for m in msgs {
                    self.sync(r, m, now);
                }
                self.start_transfer(i, w, o.token, now);
            }
            return Ok(());
        }
        let st = &mut self.reqs[i as usize];
        st.tokens += 1;
        let rep = &mut self.replicas[r as usize];
        let mut msgs = Vec::new();
        if o.first_token {
            st.first_token_us = Some(now);
            // A remote prefill's cache hit is the prefill worker's, counted at its token.
            if !st.remote {
                let arm = st.arm;
                self.stats.cached(arm, o.cached_tokens as u64);
            }
            if let Some(f) = st.flight.as_mut() {
                msgs.extend(rep.first_token(f, now_ms));
            }
        } else {
            self.stats.itl.record_us(now - st.last_token_us);
        }
        st.last_token_us = now;
        if o.finish.is_some() {
            st.done = true;
            self.outstanding -= 1;
            if let Some(f) = st.flight.take() {
                msgs.extend(rep.finish(f, now_ms));
            }
        }
        for m in msgs {
            self.sync(r, m, now);
        }
        Ok(())
    }

    /// The prefill finished: the KV goes to the decode worker, `bytes / bandwidth` later. Only
    /// the blocks the decode worker did not cache when it reserved them travel.
    fn start_transfer(&mut self, i: u32, from: u32, first_token: u32, now: u64) {
        let Some(&tokens) = self.pending.get(&i) else {
            return;
        };
        let t = &self.cfg.transfer;
        let racks = self.cfg.topology.racks;
        let to = self.reqs[i as usize].worker;
        let gbps = if racks > 0 && from % racks != to % racks {
            t.cross_rack_gbps
        } else {
            t.transfer_gbps
        };
        let secs = (tokens * t.kv_bytes_per_token) as f64 / (gbps * 1e9);
        let us = (secs * 1e6).ceil() as u64;
        self.stats.transferred_tokens += tokens;
        self.stats.transfer.record_us(us);
        self.queue
            .push(now + us, Ev::TransferDone { i, first_token });
    }

    /// The KV arrived: the decode worker commits the received blocks to its prefix cache,
    /// takes the prefill worker's first token (TTFT ends here) and decodes on.
    fn transfer_done(&mut self, i: u32, first_token: u32, now: u64) -> Result<(), SimError> {
        if self.pending.remove(&i).is_none() {
            return Ok(());
        }
        let d = self.reqs[i as usize].worker;
        let out = self.workers[d as usize]
            .engine
            .finish_remote_prefill(RequestId(u64::from(i)), first_token, None, now)
            .map_err(|e| SimError::Internal(format!("request {i}: {e}")))?;
        self.on_output(d, &out, now)?;
        self.kick(d, now)
    }

    /// The run's figures, as plain data for the report.
    pub fn outcome(self, end_us: u64) -> Outcome {
        let routed: Vec<u64> = self.workers.iter().map(|w| w.routed).collect();
        let (decode_routed, prefill_routed) = routed.split_at(self.n_decode as usize);
        Outcome {
            requests: self
                .reqs
                .iter()
                .map(|r| RequestTimes {
                    arrival_us: r.arrival_us,
                    first_token_us: r.first_token_us,
                    last_token_us: r.last_token_us,
                    tokens: r.tokens,
                    done: r.done,
                    rejected: r.rejected,
                    arm: r.arm,
                })
                .collect(),
            decode_routed: decode_routed.to_vec(),
            prefill_routed: prefill_routed.to_vec(),
            preemptions: self
                .workers
                .iter()
                .map(|w| w.engine.stats().preemptions)
                .sum(),
            adapter_loads: self
                .workers
                .iter()
                .map(|w| w.engine.stats().adapter_loads)
                .sum(),
            events_applied: self
                .replicas
                .iter()
                .map(|r| r.feed().stats().events_applied)
                .sum(),
            gaps_repaired: self.gaps_repaired,
            stats: self.stats,
            end_us,
        }
    }
}
