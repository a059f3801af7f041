//! [`Engine`]: pool + scheduler + a [`Model`] behind a two-call step; [`MockEngine`] is the
//! engine with the mocker as its model.

use hashbrown::HashMap;
use tandem_protocol::{KvDump, KvEvent, LoadReport, RequestId};

use crate::event_log::EventsTooOld;
use crate::mocker::{Mocker, MockerConfig};
use crate::model::Model;
use crate::pool::{BlockPool, BlockPoolConfig, PoolError};
use crate::scheduler::{
    EngineRequest, RemotePrefill, RequestOutput, SampledToken, Scheduler, SchedulerConfig,
    SchedulerError, SchedulerStats, StepPlan, TokenLogprobs,
};

/// An engine whose model is the mocker: the simulator's and the mocker workers' engine.
pub type MockEngine = Engine<Mocker>;

/// An engine whose model is chosen at run time: what a worker hosts.
pub type DynEngine = Engine<Box<dyn Model>>;

/// Everything a mock engine is made from.
#[derive(Clone, Debug)]
pub struct MockEngineConfig {
    /// Its `bytes_per_block` is derived from `mocker.kv_shape` and the block size; the value
    /// given here is ignored.
    pub pool: BlockPoolConfig,
    pub scheduler: SchedulerConfig,
    pub mocker: MockerConfig,
}

/// Everything an engine is made from besides its model.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Its `bytes_per_block` is derived from the model's KV shape and the block size; the
    /// value given here is ignored.
    pub pool: BlockPoolConfig,
    pub scheduler: SchedulerConfig,
}

impl MockEngineConfig {
    /// The given pool with the default scheduler and mocker settings.
    pub fn new(pool: BlockPoolConfig) -> Self {
        MockEngineConfig {
            pool,
            scheduler: SchedulerConfig::default(),
            mocker: MockerConfig::default(),
        }
    }
}

/// Why an engine could not be made.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine config: {0}")]
    InvalidConfig(&'static str),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
}

/// Summary of a planned step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlannedStep {
    /// Modelled duration of the step, milliseconds: the mocker's timing, or 0 for a model
    /// whose steps take the time their compute takes.
    pub duration_ms: f64,
    pub step: u64,
    /// Requests computing in the step.
    pub num_requests: usize,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// KV tokens attended over (see [`StepPlan::kv_tokens`]).
    pub kv_tokens: usize,
    /// Requests preempted while planning it.
    pub num_preempted: usize,
}

impl PlannedStep {
    /// Whether the model does not time its steps (they take what their compute takes: the
    /// native engine), as opposed to a timed step that rounds to nothing (a mocker sped up
    /// to answer at once).
    pub fn is_untimed(&self) -> bool {
        self.duration_ms == 0.0
    }

    /// The duration in whole microseconds (rounded), for virtual clocks.
    pub fn duration_us(&self) -> u64 {
        (self.duration_ms * 1000.0).round() as u64
    }
}

/// One exported prompt block: `index` 0 is the block holding the export's first token;
/// `block` is where it lives in the device arena. `bytes` is a copy of it, or empty for an
/// export by reference ([`Engine::export_kv_by_reference`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedBlock {
    pub index: usize,
    pub block: u32,
    pub bytes: Vec<u8>,
}

/// Export progress of one request (see [`Engine::export_kv`]).
#[derive(Debug)]
struct KvExport {
    first_block: usize,
    /// Next prompt block (absolute index) to copy.
    next_block: usize,
    ready: Vec<ExportedBlock>,
    finished: bool,
    /// Report block ids only (no copies): the blocks are pinned until released.
    by_reference: bool,
}

impl KvExport {
    /// Copies the prompt blocks complete once the request's KV reaches `end` tokens: whole
    /// blocks, and the partial last block when the prompt is done. Blocks are copied once;
    /// a preempted request recomputes identical bytes (KV is a function of the token prefix).
    fn copy_ready(
        &mut self,
        arena: &crate::arena::KvArena,
        table: &[u32],
        end: usize,
        prompt_len: usize,
        bs: usize,
    ) {
        let upto = Self::ready_upto(end, prompt_len, bs);
        while self.next_block < upto {
            let Some(&block) = table.get(self.next_block) else {
                return;
            };
            self.ready.push(ExportedBlock {
                index: self.next_block - self.first_block,
                block,
                bytes: if self.by_reference {
                    Vec::new()
                } else {
                    arena.block_bytes(block)
                },
            });
            self.next_block += 1;
        }
    }
}

impl KvExport {
    /// Prompt blocks (absolute indices `..upto`) complete once the request's KV reaches `end`
    /// tokens: whole blocks, and the partial last one when the prompt is done.
    fn ready_upto(end: usize, prompt_len: usize, bs: usize) -> usize {
        let end = end.min(prompt_len);
        if end == prompt_len {
            prompt_len.div_ceil(bs)
        } else {
            end / bs
        }
    }

    /// The blocks [`copy_ready`](Self::copy_ready) will report by reference once the KV
    /// reaches `end` tokens, without taking them.
    fn upcoming(
        &self,
        table: &[u32],
        end: usize,
        prompt_len: usize,
        bs: usize,
    ) -> Vec<ExportedBlock> {
        let upto = Self::ready_upto(end, prompt_len, bs).min(table.len());
        (self.next_block.min(upto)..upto)
            .map(|i| ExportedBlock {
                index: i - self.first_block,
                block: table[i],
                bytes: Vec::new(),
            })
            .collect()
    }
}

/// A worker's engine: its block pool and scheduler, and the model that computes the steps.
/// Drive it with `begin_step` and, after the step's duration, `finish_step`; `add_request` and
/// `abort` may come at any time.
#[derive(Debug)]
pub struct Engine<M> {
    sched: Scheduler,
    model: M,
    /// KV capacity in tokens, the denominator of the decode timing's KV usage.
    kv_capacity_tokens: usize,
    /// Requests whose prompt KV is copied out as it is computed (prefill workers).
    exports: HashMap<RequestId, KvExport>,
    // Reused from step to step.
    sampled: Vec<SampledToken>,
    /// The in-flight step's model work is done (`sampled` holds its tokens).
    computed: bool,
    /// The in-flight step's duration, µs (0: none), and the steps' total so far.
    step_us: u64,
    busy_us: u64,
}

impl MockEngine {
    pub fn new(cfg: MockEngineConfig) -> Result<Self, EngineError> {
        Self::build_mock(cfg, None)
    }

    /// An engine whose device arena lives in `storage` (memory registered with a KV
    /// transport), of exactly `device_blocks ×` [`MockEngine::bytes_per_block`] bytes.
    pub fn with_device_storage(
        cfg: MockEngineConfig,
        storage: Box<dyn crate::arena::ArenaStorage>,
    ) -> Result<Self, EngineError> {
        Self::build_mock(cfg, Some(storage))
    }

    /// Bytes of one KV block for `cfg`: what a device arena must hold per block.
    pub fn bytes_per_block(cfg: &MockEngineConfig) -> usize {
        cfg.mocker
            .kv_shape
            .bytes_per_block(cfg.pool.block_size.tokens())
    }

    fn build_mock(
        cfg: MockEngineConfig,
        storage: Option<Box<dyn crate::arena::ArenaStorage>>,
    ) -> Result<Self, EngineError> {
        let MockEngineConfig {
            pool,
            scheduler,
            mocker,
        } = cfg;
        if !(mocker.speedup_ratio.is_finite() && mocker.speedup_ratio > 0.0) {
            return Err(EngineError::InvalidConfig(
                "speedup_ratio must be finite and positive",
            ));
        }
        if mocker.vocab_size == 0 {
            return Err(EngineError::InvalidConfig("vocab_size must be at least 1"));
        }
        if !(mocker.adapter_load_ms.is_finite() && mocker.adapter_load_ms >= 0.0) {
            return Err(EngineError::InvalidConfig(
                "adapter_load_ms must be finite and not negative",
            ));
        }
        let model = Mocker::new(mocker, pool.block_size.tokens());
        Engine::build(EngineConfig { pool, scheduler }, model, storage)
    }

    pub fn config(&self) -> &MockerConfig {
        self.model.config()
    }
}

impl<M: Model> Engine<M> {
    /// An engine computing its steps with `model`.
    pub fn new_with_model(cfg: EngineConfig, model: M) -> Result<Self, EngineError> {
        Self::build(cfg, model, None)
    }

    /// An engine computing its steps with `model`, its device arena in `storage` (memory
    /// registered with a KV transport) of exactly `device_blocks ×` the block's bytes.
    pub fn with_model_and_storage(
        cfg: EngineConfig,
        model: M,
        storage: Box<dyn crate::arena::ArenaStorage>,
    ) -> Result<Self, EngineError> {
        Self::build(cfg, model, Some(storage))
    }

    fn build(
        cfg: EngineConfig,
        model: M,
        storage: Option<Box<dyn crate::arena::ArenaStorage>>,
    ) -> Result<Self, EngineError> {
        let EngineConfig {
            mut pool,
            scheduler,
        } = cfg;
        let bs = pool.block_size.tokens();
        pool.bytes_per_block = model.kv_shape().bytes_per_block(bs);
        let kv_capacity_tokens = pool.device_blocks as usize * bs;
        let pool = match storage {
            Some(storage) => BlockPool::with_device_storage(pool, storage)?,
            None => BlockPool::new(pool)?,
        };
        let sched = Scheduler::new(scheduler, pool)?;
        Ok(Engine {
            sched,
            model,
            kv_capacity_tokens,
            exports: HashMap::new(),
            sampled: Vec::new(),
            computed: false,
            step_us: 0,
            busy_us: 0,
        })
    }

    /// Validates and queues a request (`now_us`: arrival time).
    pub fn add_request(&mut self, req: EngineRequest, now_us: u64) -> Result<(), SchedulerError> {
        self.sched.add_request(req, now_us)
    }

    /// Starts the decode side of a remote prefill (see [`Scheduler::begin_remote_prefill`]):
    /// the caller has the prefill worker write the prompt's KV from
    /// [`RemotePrefill::transfer`] on into [`RemotePrefill::blocks`] of this engine's device
    /// arena, then calls `finish_remote_prefill` or `fail_remote_prefill`.
    pub fn begin_remote_prefill(
        &mut self,
        req: EngineRequest,
        now_us: u64,
    ) -> Result<RemotePrefill, SchedulerError> {
        let id = req.id;
        let rp = self.sched.begin_remote_prefill(req, now_us)?;
        // A fresh KV state: the model reads the received blocks from the arena at its first
        // decode step, exactly as blocks it computed or reused from the cache.
        self.model.forget(id);
        Ok(rp)
    }

    /// The transferred KV is in place: the request continues with the prefill worker's
    /// `first_token` (see [`Scheduler::finish_remote_prefill`]).
    pub fn finish_remote_prefill(
        &mut self,
        id: RequestId,
        first_token: u32,
        logprobs: Option<Box<TokenLogprobs>>,
        now_us: u64,
    ) -> Result<RequestOutput, SchedulerError> {
        let out = self
            .sched
            .finish_remote_prefill(id, first_token, logprobs, now_us)?;
        if out.finish.is_some() {
            self.model.forget(id);
        }
        Ok(out)
    }

    /// The transfer failed: the request prefills here instead (see
    /// [`Scheduler::fail_remote_prefill`]).
    pub fn fail_remote_prefill(
        &mut self,
        id: RequestId,
        now_us: u64,
    ) -> Result<(), SchedulerError> {
        self.sched.fail_remote_prefill(id, now_us)?;
        self.model.forget(id);
        Ok(())
    }

    /// Drops a request wherever it is, freeing its blocks; false when unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.model.forget(id);
        self.exports.remove(&id);
        self.sched.abort(id)
    }

    /// Plans the next step and says how long it takes; None when there is nothing to compute.
    /// While a step is in flight it describes that step again.
    pub fn begin_step(&mut self, now_us: u64) -> Option<PlannedStep> {
        let mut plan = self.sched.schedule(now_us);
        if plan.is_empty() && !plan.preempted.is_empty() {
            // Everything runnable was preempted: the freed blocks let the queue head in now.
            plan = self.sched.schedule(now_us);
        }
        if plan.is_empty() {
            return None;
        }
        let duration_ms = self.model.step_duration_ms(plan, self.kv_capacity_tokens);
        self.step_us = (duration_ms * 1000.0).round() as u64;
        Some(PlannedStep {
            duration_ms,
            step: plan.step,
            num_requests: plan.entries.len(),
            prefill_tokens: plan.prefill_tokens,
            decode_tokens: plan.decode_tokens,
            kv_tokens: plan.kv_tokens,
            num_preempted: plan.preempted.len(),
        })
    }

    /// Runs the in-flight step's model work — K/V into the arena, the sampled tokens, the
    /// export copies — without completing the step: who runs and which blocks are held
    /// change at [`finish_step`](Self::finish_step) only. A real-time host computes at the
    /// step's start and completes it at its modelled end, so that its load reports and KV
    /// events follow the modelled time. Once per step; `finish_step` runs it if nobody did.
    pub fn compute_step(&mut self) {
        self.compute_step_with(&crate::scheduler::NO_PROGRESS)
    }

    /// [`compute_step`](Self::compute_step), telling `progress` how many layers' K/V the
    /// step has written as they complete (a model that computes layer by layer does; see
    /// [`ModelView::progress`](crate::scheduler::ModelView::progress)).
    pub fn compute_step_with(&mut self, progress: &(dyn Fn(u32) + Sync)) {
        if self.computed {
            return;
        }
        let bs = self.sched.pool().block_size().tokens();
        let Some(mut view) = self.sched.model_view() else {
            return;
        };
        view.progress = progress;
        self.computed = true;
        self.sampled.clear();
        self.model.compute(view, &mut self.sampled);
        if !self.exports.is_empty()
            && let Some(view) = self.sched.model_view()
        {
            for (entry, table) in view.plan.iter() {
                let (Some(export), Some(seq)) = (
                    self.exports.get_mut(&entry.id),
                    view.sequences.get(entry.id),
                ) else {
                    continue;
                };
                // Before `complete_step`: a request that finishes now frees its blocks there.
                export.copy_ready(view.arena, table, entry.tokens().end, seq.prompt_len(), bs);
            }
        }
    }

    /// For every request exported by reference that the in-flight step computes, the blocks
    /// that step completes (what [`take_exported`](Self::take_exported) reports once it
    /// ends), named where they live; empty without a step in flight. A host sends their
    /// layers while the step computes them.
    pub fn step_exports(&self) -> Vec<(RequestId, Vec<ExportedBlock>)> {
        if !self.sched.in_flight() || self.exports.is_empty() {
            return Vec::new();
        }
        let bs = self.sched.pool().block_size().tokens();
        let mut out = Vec::new();
        for (entry, table) in self.sched.plan().iter() {
            let (Some(export), Some(seq)) =
                (self.exports.get(&entry.id), self.sched.sequence(entry.id))
            else {
                continue;
            };
            if !export.by_reference {
                continue;
            }
            let blocks = export.upcoming(table, entry.tokens().end, seq.prompt_len(), bs);
            if !blocks.is_empty() {
                out.push((entry.id, blocks));
            }
        }
        out
    }

    /// Runs the in-flight step's model work (unless [`compute_step`](Self::compute_step) did)
    /// and completes it. Empty when no step is in flight.
    pub fn finish_step(&mut self, now_us: u64) -> Vec<RequestOutput> {
        self.busy_us += std::mem::take(&mut self.step_us);
        if !self.sched.in_flight() {
            return Vec::new();
        }
        self.compute_step();
        self.computed = false;
        let outputs = self
            .sched
            .complete_step(&self.sampled, now_us)
            .expect("a model samples exactly the plan's sampling entries (Model::compute)");
        for o in &outputs {
            if o.finish.is_some() {
                self.model.forget(o.id);
                if let Some(export) = self.exports.get_mut(&o.id) {
                    export.finished = true;
                }
            }
        }
        outputs
    }

    /// Copies the prompt KV of request `id` out of the arena as it is computed, from token
    /// `from_token` (rounded down to a block) on: after every step, each prompt block that
    /// became complete (or was found in the cache), and at the end of the prompt its partial
    /// last block. Collect them with [`take_exported`](Self::take_exported). Call right after
    /// `add_request`. This is the prefill worker's side of a remote prefill: the bytes are
    /// exactly what a decode engine's [`begin_remote_prefill`](Self::begin_remote_prefill)
    /// blocks must receive.
    pub fn export_kv(&mut self, id: RequestId, from_token: usize) {
        self.start_export(id, from_token, false);
    }

    /// Like [`export_kv`](Self::export_kv), without copies: the exported blocks are named by
    /// their place in the device arena, and the request's blocks stay pinned (unchanged, not
    /// reused) after it finishes, until [`release_export`](Self::release_export) — the
    /// caller reads them there (a transport sending straight from the arena).
    pub fn export_kv_by_reference(&mut self, id: RequestId, from_token: usize) {
        self.start_export(id, from_token, true);
        self.sched.pin_when_finished(id);
    }

    /// Ends an export by reference: the finished request's pinned blocks are released (no-op
    /// when none are).
    pub fn release_export(&mut self, id: RequestId) {
        self.sched.release_pinned(id);
    }

    fn start_export(&mut self, id: RequestId, from_token: usize, by_reference: bool) {
        let bs = self.sched.pool().block_size().tokens();
        self.exports.insert(
            id,
            KvExport {
                first_block: from_token / bs,
                next_block: from_token / bs,
                ready: Vec::new(),
                finished: false,
                by_reference,
            },
        );
    }

    /// The blocks exported since the last call, in prompt order, and whether the request has
    /// finished (then its export is forgotten and later calls return None).
    pub fn take_exported(&mut self, id: RequestId) -> Option<(Vec<ExportedBlock>, bool)> {
        let export = self.exports.get_mut(&id)?;
        let blocks = std::mem::take(&mut export.ready);
        let finished = export.finished;
        if finished {
            self.exports.remove(&id);
        }
        Some((blocks, finished))
    }

    /// Whether any request is tracked (waiting, running, or in a remote prefill).
    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// The in-flight plan, or the last one planned.
    pub fn plan(&self) -> &StepPlan {
        self.sched.plan()
    }

    pub fn pool(&self) -> &BlockPool {
        self.sched.pool()
    }

    /// Mutable pool, for KV transfers into and out of the arena (and tests that corrupt it).
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        self.sched.pool_mut()
    }

    /// The model computing the steps.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The same engine, its model behind a `dyn Model`.
    pub fn into_dyn(self) -> DynEngine
    where
        M: 'static,
    {
        Engine {
            sched: self.sched,
            model: Box::new(self.model),
            kv_capacity_tokens: self.kv_capacity_tokens,
            exports: self.exports,
            sampled: self.sampled,
            computed: self.computed,
            step_us: self.step_us,
            busy_us: self.busy_us,
        }
    }

    pub fn stats(&self) -> SchedulerStats {
        self.sched.stats()
    }

    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }

    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }

    /// Requests awaiting KV from a remote prefill.
    pub fn num_awaiting_kv(&self) -> usize {
        self.sched.num_awaiting_kv()
    }

    /// KV events after `after` (see [`BlockPool::events_since`]).
    pub fn events_since(&self, after: u64) -> Result<Vec<KvEvent>, EventsTooOld> {
        self.sched.pool().events_since(after)
    }

    /// The whole cache as a dump (see [`BlockPool::dump`]).
    pub fn dump(&self) -> KvDump {
        self.sched.pool().dump()
    }

    /// The scheduler's report with the time spent in steps.
    pub fn load_report(&self, now_us: u64) -> LoadReport {
        LoadReport {
            busy_us_total: self.busy_us,
            ..self
                .sched
                .load_report(self.sched.pool().worker_id(), now_us)
        }
    }

    /// Time spent in finished steps, µs.
    pub fn busy_us(&self) -> u64 {
        self.busy_us
    }
}
