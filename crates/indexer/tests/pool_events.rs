//! Cross-crate property: several engines' block pools run random operations; their KV events
//! travel over a faulty "network" (duplicates, bounded reordering, lost events) into a
//! [`Resequencer`] in front of a [`KvIndex`], gaps being repaired from the pools' event rings or
//! by dumps. At every checkpoint the index holds exactly what the pools hold, tier by tier, and
//! `find_matches` (and `find_extents`) agrees with each pool's own `lookup`.
//!
//! The pools' event rings are small, so that a gap open long enough must be repaired by a dump,
//! and a single pool operation can even outrun the ring before it is published (the publisher
//! then loses its oldest events: one more gap). [`fixed_seed_run_exercises_every_path`] checks
//! on a fixed seed that the random cases really reach every repair path.

use std::collections::{BTreeSet, HashMap, VecDeque};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use tandem_engine::pool::sequence_hashes;
use tandem_engine::{BlockPool, BlockPoolConfig};
use tandem_indexer::{ApplyOutcome, KvIndex, Resequencer, ResequencerConfig, TierCounts};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{
    BlockHashes, BlockSize, HashSeed, KvEvent, LoadReport, RequestId, StorageTier, WorkerId,
};

const WORKERS: usize = 3;
const BLOCK_TOKENS: u32 = 4;
/// Resequencer settings: a small window so that reordering and gaps overflow it.
const WINDOW: usize = 4;
const DEADLINE_MS: u64 = 50;
/// Pool operations and deliveries between two full comparisons.
const CHECKPOINT_EVERY: usize = 40;
/// Delivered events kept per worker for the network to deliver again.
const REDELIVERY_MEMORY: usize = 32;
/// Finished prompts kept per worker to probe `find_matches` with (their blocks are the ones
/// that get evicted to host).
const FINISHED_MEMORY: usize = 8;

fn block_size() -> BlockSize {
    BlockSize::new(BLOCK_TOKENS).expect("non-zero")
}

fn hashes(tokens: &[u32]) -> Vec<BlockHashes> {
    compute_block_hashes(tokens, block_size(), HashSeed::UNSALTED)
}

/// Prompts of one family share their first 12 tokens (3 blocks), so prefixes overlap across
/// sequences and workers at varying depths (as in the pool's own property test).
fn family_tokens(family: u8, len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if i < 12 {
                u32::from(family) * 1000 + i
            } else {
                salt * 7 + i
            }
        })
        .collect()
}

/// Sizes of one pool.
#[derive(Clone, Copy, Debug)]
struct PoolSize {
    device: u32,
    host: u32,
    ring: usize,
}

#[derive(Clone, Debug)]
enum Op {
    /// Start a sequence on pool `w` (nothing if `id` is live there).
    Start {
        w: usize,
        id: u8,
        family: u8,
        len: u8,
        salt: u32,
    },
    /// Grow a live sequence by `extra` tokens and commit its new full blocks.
    Grow {
        w: usize,
        id: u8,
        extra: u8,
    },
    Finish {
        w: usize,
        id: u8,
    },
    Clear {
        w: usize,
    },
    /// Deliver the next in-flight event of worker `w`.
    Deliver {
        w: usize,
    },
    /// Deliver again an event of worker `w` that was delivered already.
    Duplicate {
        w: usize,
        pick: usize,
    },
    /// Swap two adjacent in-flight events among the first `WINDOW + 1`.
    Swap {
        w: usize,
        pos: usize,
    },
    /// Lose an in-flight event.
    Drop {
        w: usize,
        pos: usize,
    },
    /// Advance virtual time and poll the resequencer for overdue gaps.
    Tick {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..WORKERS;
    prop_oneof![
        5 => (w.clone(), 0u8..5, 0u8..4, 1u8..40, 0u32..3)
            .prop_map(|(w, id, family, len, salt)| Op::Start { w, id, family, len, salt }),
        3 => (w.clone(), 0u8..5, 1u8..9).prop_map(|(w, id, extra)| Op::Grow { w, id, extra }),
        4 => (w.clone(), 0u8..5).prop_map(|(w, id)| Op::Finish { w, id }),
        1 => w.clone().prop_map(|w| Op::Clear { w }),
        8 => w.clone().prop_map(|w| Op::Deliver { w }),
        2 => (w.clone(), any::<usize>()).prop_map(|(w, pick)| Op::Duplicate { w, pick }),
        4 => (w.clone(), any::<usize>()).prop_map(|(w, pos)| Op::Swap { w, pos }),
        2 => (w, any::<usize>()).prop_map(|(w, pos)| Op::Drop { w, pos }),
        2 => (1u64..60).prop_map(|ms| Op::Tick { ms }),
    ]
}

fn pool_size() -> impl Strategy<Value = PoolSize> {
    (2u32..16, prop_oneof![Just(0u32), 1u32..8], 3usize..12)
        .prop_map(|(device, host, ring)| PoolSize { device, host, ring })
}

/// One generated case: pool sizes, operations, and prompts (family, len, salt) to probe
/// `find_matches` with at checkpoints (besides live and recently finished sequences).
type Case = (Vec<PoolSize>, Vec<Op>, Vec<(u8, u8, u32)>);

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec(pool_size(), WORKERS),
        proptest::collection::vec(op(), 20..200),
        proptest::collection::vec((0u8..4, 1u8..48, 0u32..3), 1..4),
    )
}

/// Paths of the delivery and repair machinery a case can take; counted to check coverage.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// A gap repaired by replaying the pool's ring.
    RangeRepair,
    /// A gap repaired by a dump (the ring no longer had the events).
    DumpRepair,
    /// Repair triggered by the resequencer's window overflowing.
    OverflowRepair,
    /// Repair triggered by a gap outliving the deadline.
    DeadlineRepair,
    /// A trailing gap found by comparing with the load report's last event id.
    TrailingRepair,
    /// The index answered `Duplicate` to a redelivered event.
    Duplicate,
    /// Two in-flight events swapped.
    Reorder,
    /// The resequencer released events it had held back.
    ReleasedEarly,
    /// A host-tier event applied from the stream.
    HostEvent,
    /// The publisher found its ring overrun by one pool operation and lost events.
    PublisherLoss,
    /// `find_matches` reported host blocks for some worker.
    HostMatch,
}

const PATHS: [Path; 11] = [
    Path::RangeRepair,
    Path::DumpRepair,
    Path::OverflowRepair,
    Path::DeadlineRepair,
    Path::TrailingRepair,
    Path::Duplicate,
    Path::Reorder,
    Path::ReleasedEarly,
    Path::HostEvent,
    Path::PublisherLoss,
    Path::HostMatch,
];

/// Per path, how often it was taken.
#[derive(Clone, Copy, Debug, Default)]
struct Coverage([u64; PATHS.len()]);

impl Coverage {
    fn hit(&mut self, p: Path) {
        self.0[p as usize] += 1;
    }
}

/// One engine: its pool, its live sequences, and its events in flight on the network.
struct Engine {
    id: WorkerId,
    pool: BlockPool,
    live: HashMap<u8, Vec<u32>>,
    /// Recently finished sequences' tokens.
    finished: VecDeque<Vec<u32>>,
    /// Id of the last event handed to the network.
    published: u64,
    in_flight: VecDeque<KvEvent>,
    /// Recently delivered events, for redelivery.
    delivered: VecDeque<KvEvent>,
}

/// Why a worker is being repaired.
#[derive(Clone, Copy, Debug)]
enum Trigger {
    Overflow,
    Deadline,
    Trailing,
}

struct Cluster {
    engines: Vec<Engine>,
    index: KvIndex,
    reseq: Resequencer,
    now_ms: u64,
    cov: Coverage,
}

type Res = Result<(), TestCaseError>;

impl Cluster {
    fn new(sizes: &[PoolSize]) -> Self {
        let engines = sizes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let id = WorkerId(i as u64 + 1);
                let mut cfg = BlockPoolConfig::new(id, s.device);
                cfg.block_size = block_size();
                cfg.host_blocks = s.host;
                cfg.bytes_per_block = 8;
                cfg.event_ring = s.ring;
                Engine {
                    id,
                    pool: BlockPool::new(cfg).expect("device blocks >= 2"),
                    live: HashMap::new(),
                    finished: VecDeque::new(),
                    published: 0,
                    in_flight: VecDeque::new(),
                    delivered: VecDeque::new(),
                }
            })
            .collect();
        Cluster {
            engines,
            index: KvIndex::new(),
            reseq: Resequencer::new(ResequencerConfig {
                window: WINDOW,
                deadline_ms: DEADLINE_MS,
            }),
            now_ms: 0,
            cov: Coverage::default(),
        }
    }

    fn last_applied(&self, w: usize) -> u64 {
        self.index.last_event_id(self.engines[w].id).unwrap_or(0)
    }

    fn step(&mut self, op: &Op) -> Res {
        match *op {
            Op::Start { w, .. } | Op::Grow { w, .. } | Op::Finish { w, .. } | Op::Clear { w } => {
                self.pool_op(op).map_err(|e| {
                    TestCaseError::fail(format!("worker {w}: pool refused {op:?}: {e}"))
                })?;
                let e = &mut self.engines[w];
                if let Err(msg) = e.pool.check_invariants() {
                    return Err(TestCaseError::fail(format!("worker {w}: {msg}")));
                }
                self.publish(w);
            }
            Op::Deliver { w } => {
                if let Some(ev) = self.engines[w].in_flight.pop_front() {
                    self.deliver(w, ev)?;
                }
            }
            Op::Duplicate { w, pick } => {
                let e = &self.engines[w];
                if e.delivered.is_empty() {
                    return Ok(());
                }
                let ev = e.delivered[pick % e.delivered.len()].clone();
                if ev.event_id <= self.last_applied(w) {
                    let out = self.index.apply(&ev);
                    prop_assert_eq!(out, ApplyOutcome::Duplicate, "redelivered {:?}", ev);
                    self.cov.hit(Path::Duplicate);
                }
                self.deliver(w, ev)?;
            }
            Op::Swap { w, pos } => {
                let q = &mut self.engines[w].in_flight;
                if q.len() >= 2 {
                    let i = pos % (q.len() - 1).min(WINDOW);
                    q.swap(i, i + 1);
                    self.cov.hit(Path::Reorder);
                }
            }
            Op::Drop { w, pos } => {
                let q = &mut self.engines[w].in_flight;
                if !q.is_empty() {
                    q.remove(pos % q.len());
                }
            }
            Op::Tick { ms } => {
                self.now_ms += ms;
                for (worker, _) in self.reseq.poll(self.now_ms) {
                    let w = (worker.0 - 1) as usize;
                    self.repair(w, Trigger::Deadline)?;
                }
            }
        }
        Ok(())
    }

    /// Drives a pool the way the pool's own property test does.
    fn pool_op(&mut self, op: &Op) -> Result<(), tandem_engine::PoolError> {
        match *op {
            Op::Start {
                w,
                id,
                family,
                len,
                salt,
            } => {
                let e = &mut self.engines[w];
                if e.live.contains_key(&id) {
                    return Ok(());
                }
                let tokens = family_tokens(family, usize::from(len), salt);
                let hs = hashes(&tokens);
                let seq = RequestId(u64::from(id));
                e.pool.acquire_prefix(seq, &hs, hs.len())?;
                if e.pool.allocate(seq, tokens.len()).is_err() {
                    e.pool.free(seq)?;
                } else {
                    e.pool.commit(seq, &hs)?;
                    e.live.insert(id, tokens);
                }
            }
            Op::Grow { w, id, extra } => {
                let e = &mut self.engines[w];
                if let Some(tokens) = e.live.get_mut(&id) {
                    let start = tokens.len() as u32;
                    let seq = RequestId(u64::from(id));
                    let new_len = tokens.len() + usize::from(extra);
                    if e.pool.allocate(seq, new_len).is_ok() {
                        tokens.extend(start..start + u32::from(extra));
                        e.pool.commit(seq, &hashes(tokens))?;
                    }
                }
            }
            Op::Finish { w, id } => {
                let e = &mut self.engines[w];
                if let Some(tokens) = e.live.remove(&id) {
                    e.pool.free(RequestId(u64::from(id)))?;
                    if e.finished.len() == FINISHED_MEMORY {
                        e.finished.pop_front();
                    }
                    e.finished.push_back(tokens);
                }
            }
            Op::Clear { w } => self.engines[w].pool.clear_cache(),
            _ => unreachable!("not a pool operation"),
        }
        Ok(())
    }

    /// Hands the pool's new events to the network. If one operation produced more events than
    /// the ring keeps, the oldest are lost before they could be published: a gap.
    fn publish(&mut self, w: usize) {
        let e = &mut self.engines[w];
        let events = match e.pool.events_since(e.published) {
            Ok(evs) => evs,
            Err(too_old) => {
                self.cov.hit(Path::PublisherLoss);
                e.pool
                    .events_since(too_old.oldest_kept - 1)
                    .expect("the ring holds its oldest event")
            }
        };
        e.published = e.pool.last_event_id();
        e.in_flight.extend(events);
    }

    /// One event arrives at the subscriber: through the resequencer into the index.
    fn deliver(&mut self, w: usize, ev: KvEvent) -> Res {
        let e = &mut self.engines[w];
        if e.delivered.len() == REDELIVERY_MEMORY {
            e.delivered.pop_front();
        }
        e.delivered.push_back(ev.clone());
        let id = e.id;
        let released = self.reseq.push(ev, self.last_applied(w), self.now_ms);
        if released.len() > 1 {
            self.cov.hit(Path::ReleasedEarly);
        }
        self.apply_released(released)?;
        if self.reseq.needs_repair(id).is_some() {
            self.repair(w, Trigger::Overflow)?;
        }
        Ok(())
    }

    /// Applies what the resequencer released: contiguous events, so never a gap.
    fn apply_released(&mut self, events: Vec<KvEvent>) -> Res {
        for ev in events {
            match self.index.apply(&ev) {
                ApplyOutcome::Applied => {
                    if ev.tier == StorageTier::Host {
                        self.cov.hit(Path::HostEvent);
                    }
                }
                ApplyOutcome::Duplicate => {}
                gap @ ApplyOutcome::Gap { .. } => {
                    return Err(TestCaseError::fail(format!(
                        "the resequencer released {} of worker {} into a gap: {gap:?}",
                        ev.event_id, ev.worker_id.0
                    )));
                }
            }
        }
        Ok(())
    }

    /// Brings the index up to the pool's latest event: a replay from the ring if it still has
    /// everything after the index's last id, else a dump; then resyncs the resequencer.
    fn repair(&mut self, w: usize, why: Trigger) -> Res {
        self.cov.hit(match why {
            Trigger::Overflow => Path::OverflowRepair,
            Trigger::Deadline => Path::DeadlineRepair,
            Trigger::Trailing => Path::TrailingRepair,
        });
        let last = self.last_applied(w);
        let e = &self.engines[w];
        match e.pool.events_since(last) {
            Ok(events) => {
                self.cov.hit(Path::RangeRepair);
                for ev in events {
                    let out = self.index.apply(&ev);
                    prop_assert_eq!(out, ApplyOutcome::Applied, "replaying {:?}", ev);
                }
            }
            Err(_) => {
                self.cov.hit(Path::DumpRepair);
                self.index
                    .replace_worker(&e.pool.dump())
                    .map_err(|err| TestCaseError::fail(format!("dump refused: {err}")))?;
            }
        }
        let (id, latest) = (e.id, e.pool.last_event_id());
        prop_assert_eq!(self.last_applied(w), latest, "worker {} after {:?}", w, why);
        let released = self.reseq.resync(id, latest, self.now_ms);
        prop_assert!(
            released.is_empty(),
            "nothing follows the pool's latest event, yet resync released {:?}",
            released
        );
        prop_assert_eq!(self.reseq.needs_repair(id), None);
        Ok(())
    }

    /// Delivers everything in flight, repairs trailing gaps as a subscriber would from load
    /// reports, then compares the index with the pools.
    fn checkpoint(&mut self, probes: &[(u8, u8, u32)]) -> Res {
        for w in 0..WORKERS {
            while let Some(ev) = self.engines[w].in_flight.pop_front() {
                self.deliver(w, ev)?;
            }
            let e = &self.engines[w];
            let report = LoadReport {
                worker_id: e.id,
                last_kv_event_id: e.pool.last_event_id(),
                ..LoadReport::default()
            };
            if self.last_applied(w) < report.last_kv_event_id {
                self.repair(w, Trigger::Trailing)?;
            }
            let e = &self.engines[w];
            prop_assert_eq!(self.last_applied(w), e.pool.last_event_id());
            prop_assert_eq!(self.reseq.held(e.id), 0);
            let blocks = self.index.worker_blocks(e.id).unwrap_or_default();
            for tier in StorageTier::ALL {
                let pool: BTreeSet<_> = e.pool.cached_hashes(tier).into_iter().collect();
                prop_assert_eq!(blocks.tier(tier), &pool, "worker {} {}", w, tier);
            }
        }
        let mut prompts: Vec<Vec<u32>> = probes
            .iter()
            .map(|&(family, len, salt)| family_tokens(family, usize::from(len), salt))
            .collect();
        for e in &self.engines {
            prompts.extend(e.live.values().chain(&e.finished).cloned());
        }
        for tokens in &prompts {
            let hs = sequence_hashes(&hashes(tokens));
            let scores = self.index.find_matches(&hs);
            let mut expected = Vec::new();
            for e in &self.engines {
                let hit = e.pool.lookup(&hs);
                if hit.total() > 0 {
                    let counts = TierCounts {
                        device: hit.device as u32,
                        host: hit.host as u32,
                        disk: 0,
                    };
                    expected.push((e.id, counts));
                }
            }
            if expected.iter().any(|(_, c)| c.host > 0) {
                self.cov.hit(Path::HostMatch);
            }
            prop_assert_eq!(&scores.scores, &expected, "prompt {:?}", tokens);
            // The grouped answer says the same.
            prop_assert_eq!(self.index.find_extents(&hs).to_scores(), scores);
        }
        Ok(())
    }
}

/// Runs one case; returns what it exercised.
fn run_case((sizes, ops, probes): &Case) -> Result<Coverage, TestCaseError> {
    let mut c = Cluster::new(sizes);
    for (i, op) in ops.iter().enumerate() {
        c.step(op)
            .map_err(|e| TestCaseError::fail(format!("op {i} {op:?}: {e}")))?;
        if (i + 1) % CHECKPOINT_EVERY == 0 {
            c.checkpoint(probes)
                .map_err(|e| TestCaseError::fail(format!("checkpoint after op {i}: {e}")))?;
        }
    }
    c.checkpoint(probes)
        .map_err(|e| TestCaseError::fail(format!("final checkpoint: {e}")))?;
    Ok(c.cov)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn index_follows_the_pools_through_a_faulty_network(case in case()) {
        run_case(&case)?;
    }
}

/// The property above is only as good as the paths it reaches: on a fixed seed, every repair
/// path, duplicates, reordering and the host tier must each show up in some cases.
#[test]
fn fixed_seed_run_exercises_every_path() {
    const CASES: usize = 64;
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    );
    let strategy = case();
    // Per path, the number of cases that took it.
    let mut cases_with = [0usize; PATHS.len()];
    for _ in 0..CASES {
        let case = strategy
            .new_tree(&mut runner)
            .expect("strategy generates")
            .current();
        let cov = run_case(&case).unwrap_or_else(|e| panic!("{e}\n{case:?}"));
        for (n, &hits) in cases_with.iter_mut().zip(&cov.0) {
            *n += usize::from(hits > 0);
        }
    }
    let table: Vec<(Path, usize)> = PATHS.iter().copied().zip(cases_with).collect();
    assert!(
        cases_with.iter().all(|&n| n > 0),
        "some path was never taken in {CASES} cases: {table:?}"
    );
}
