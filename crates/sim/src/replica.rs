//! One router replica: its own KV index (fed by the simulated event plane), its own
//! active-sequence tracker (its decisions, plus its peers' when replica sync is on), the
//! workers' latest load reports it has received, its policy and its random generator.

use tandem_indexer::{ApplyOutcome, KvIndex, OverlapScores};
use tandem_protocol::{KvDump, KvEvent, LoadReport, WorkerId};
use tandem_router::{
    ActiveSequences, Rng, Router, RouterConfig, RouterId, TrackerConfig, WorkerLoad, WorkerView,
};

use crate::config::SimConfig;
use crate::error::SimError;

/// What a replica received from one worker in one delivery.
#[derive(Debug)]
pub(crate) enum KvPayload {
    Events(Vec<KvEvent>),
    Dump(KvDump),
}

#[derive(Debug)]
pub(crate) struct Replica {
    pub index: KvIndex,
    pub tracker: ActiveSequences,
    /// The aggregated pool's policy (unused with a prefill pool: `disagg::decide` picks).
    pub router: Router,
    pub rng: Rng,
    /// Latest load report per worker (snapshot mode only).
    pub reports: Vec<Option<LoadReport>>,
    pub events_applied: u64,
    /// Deliveries that did not follow on from what the index had; repaired with a dump.
    pub gaps_repaired: u64,
}

impl Replica {
    pub fn new(cfg: &SimConfig, id: u32, total_workers: usize) -> Result<Self, SimError> {
        let router = Router::new(RouterConfig {
            policy: cfg.policy,
            pool: tandem_router::PoolConfig::default(),
        })?;
        let seed = cfg.seed ^ 0x524f_5554_4552_0000 ^ u64::from(id);
        Ok(Replica {
            index: KvIndex::new(),
            tracker: ActiveSequences::new(RouterId(u64::from(id)), TrackerConfig::default()),
            router,
            rng: Rng::seed_from_u64(seed),
            reports: vec![None; total_workers],
            events_applied: 0,
            gaps_repaired: 0,
        })
    }

    /// Applies one worker's delivery. A batch that does not follow on from the index (a gap:
    /// only possible when the engine's event ring overflowed between two snapshots) is
    /// replaced by `dump_now`, the worker's current state, as the indexer would ask for.
    pub fn apply(
        &mut self,
        payload: &KvPayload,
        dump_now: impl FnOnce() -> KvDump,
    ) -> Result<(), SimError> {
        match payload {
            KvPayload::Dump(d) => {
                self.index.replace_worker(d)?;
                self.gaps_repaired += 1;
            }
            KvPayload::Events(evs) => {
                for ev in evs {
                    match self.index.apply(ev) {
                        ApplyOutcome::Applied => self.events_applied += 1,
                        ApplyOutcome::Duplicate => {}
                        ApplyOutcome::Gap { .. } => {
                            self.index.replace_worker(&dump_now())?;
                            self.gaps_repaired += 1;
                            return Ok(());
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The candidate views of `workers` for a prompt with overlap `scores`.
    pub fn views(&self, workers: std::ops::Range<u32>, scores: &OverlapScores) -> Vec<WorkerView> {
        workers
            .map(|w| {
                let id = WorkerId(u64::from(w));
                let mut load: WorkerLoad = self.tracker.load(id).to_worker_load();
                if let Some(r) = &self.reports[w as usize] {
                    load.merge_report(r);
                }
                let mut v = WorkerView::new(id, load);
                v.overlap = scores.get(id).unwrap_or_default();
                v
            })
            .collect()
    }
}
