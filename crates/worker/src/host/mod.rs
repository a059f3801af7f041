//! [`EngineHost`]: an in-process engine (the mocker, or any [`tandem_engine::Model`]) driven in
//! real time, shared by the request handlers.
//!
//! One driver task steps the engine: plan a step, compute it, wait out the rest of its
//! modelled duration, hand every output to the request it belongs to. Whoever changes the
//! engine (a step, an admission, an abort, a remote prefill) hands the KV events the change
//! produced, in id order, to a queue as it lets go of the engine ([`Locked`]); a second task
//! publishes that queue, so batches leave in order and coalesce under load, and the publisher
//! never waits for the engine. The load report ([`EngineHost::load_report`]) goes out through
//! the worker's lifecycle ([`crate::served`]).
//!
//! A real model's step holds the engine for its whole forward pass. The tasks that run every
//! step or every few (the publisher, the load report, the count of requests in flight) read
//! what the last holder left instead of waiting for it: a task that waited blocked a runtime
//! thread, and the runtime started another in its place on cores the forward pass fills.
//!
//! Requests are submitted through [`EngineHost::submit`] and friends and answered through a
//! [`RequestHandle`]; dropping the handle before the request ends aborts it, which frees its
//! blocks (a client that goes away costs nothing after the current step).
//!
//! Each request's outputs wait in a bounded channel (`output_buffer` of them, about one per
//! step). A consumer that falls that far behind (a stalled client upstream) has its request
//! aborted, its blocks freed, and its handle ends with [`WorkerError::Overloaded`]: memory per
//! request is bounded by configuration, not by `max_tokens`.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};
use tandem_engine::{
    DynEngine, EngineRequest, ErrorClass, ExportedBlock, RemotePrefill, RequestOutput,
    SchedulerError, TokenLogprobs,
};
use tandem_protocol::{Envelope, KvDump, KvEvent, LoadReport, RequestId, WorkerId};
use tandem_runtime::events::EventPlane;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::WorkerError;

mod handle;
mod progress;
pub use handle::RequestHandle;

/// What a request receives from the engine.
#[derive(Debug)]
pub enum HostOutput {
    /// The first `bytes` of each of `blocks` are final: the layers the in-flight step has
    /// computed so far (exports by reference only, while the step runs; any may be left out,
    /// and the step's [`Blocks`](HostOutput::Blocks) follows either way).
    Computed {
        blocks: Arc<[ExportedBlock]>,
        bytes: usize,
    },
    /// Prompt KV blocks copied out as they were computed (exporting requests only); always
    /// before the token of the same step.
    Blocks(Vec<ExportedBlock>),
    Token(RequestOutput),
}

/// Where the host publishes.
#[derive(Clone)]
pub struct HostPublishing {
    pub events: Arc<dyn EventPlane>,
    /// Subject of KV events (`tandem.<ns>.kv-events`).
    pub kv_subject: String,
    /// The worker's counters (KV events published).
    pub metrics: Arc<crate::metrics::WorkerMetrics>,
}

impl std::fmt::Debug for HostPublishing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPublishing")
            .field("kv_subject", &self.kv_subject)
            .finish_non_exhaustive()
    }
}

/// Where one request's outputs go.
struct Output {
    tx: mpsc::Sender<HostOutput>,
    /// Set when the channel was full: the request was aborted for it.
    overflowed: Arc<AtomicBool>,
}

struct State {
    engine: DynEngine,
    /// Per-request output channels, bounded by `output_buffer`.
    outputs: HashMap<RequestId, Output>,
    output_buffer: usize,
    /// Requests whose prompt KV is exported.
    exporting: Vec<RequestId>,
    /// The last KV event handed to the publisher's queue.
    events_taken: u64,
}

/// The most outputs one step hands a request: its token, and its blocks when it exports.
const OUTPUTS_PER_STEP: usize = 2;

impl State {
    /// Whether every request's channel has room for what one more step hands it.
    fn room_for_a_step(&self) -> bool {
        self.outputs
            .values()
            .all(|o| o.tx.capacity() >= OUTPUTS_PER_STEP)
    }
}

/// KV events the publisher's queue holds at most: past that (a publisher stalled for long),
/// they are dropped, and the index, seeing the gap, asks this worker for the range or a dump.
const QUEUED_EVENTS_MAX: usize = 1 << 16;

struct Inner {
    worker_id: WorkerId,
    state: Mutex<State>,
    /// A real model's forward pass holds (or is about to hold) `state` now, for as long as it
    /// takes.
    computing: AtomicBool,
    /// KV events taken from the engine, in id order, for the publisher.
    events: Mutex<Vec<KvEvent>>,
    /// Requests tracked, as the last holder of `state` left them.
    tracked: AtomicUsize,
    /// The engine's load report when its step began: what it is for as long as the step's
    /// forward pass holds `state`.
    load_at_step: Mutex<Option<LoadReport>>,
    /// New work for the driver.
    work: Notify,
    /// New KV events for the publisher.
    dirty: Notify,
    /// Requests tracked (submitted and not ended or dropped), for draining.
    idle: Notify,
    /// The engine's clock starts here. Tokio's instant, so that tests on paused time see the
    /// engine's timestamps (TTFT) in that time.
    started: tokio::time::Instant,
}

/// An in-process engine stepped in real time. Cheap to clone.
#[derive(Clone)]
pub struct EngineHost {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EngineHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHost")
            .field("worker_id", &self.inner.worker_id)
            .finish_non_exhaustive()
    }
}

impl EngineHost {
    /// The host's state, for callers on the runtime. A real model's step holds it for its
    /// whole forward pass (seconds for a long chunk); waited for on a runtime worker, that
    /// stalls every task there, HTTP/2 keep-alives included: so then off it ([`cpu_bound`]).
    fn state(&self) -> Locked<'_> {
        let guard = if !self.inner.computing.load(Ordering::Acquire) {
            // Held briefly (the mocker's steps, the serving paths): wait in place.
            self.inner.state.lock()
        } else {
            match self.inner.state.try_lock() {
                Some(guard) => guard,
                None => cpu_bound(|| self.inner.state.lock()),
            }
        };
        self.inner.locked(guard)
    }

    /// Starts the driver and the event publisher on `tasks`; they stop
    /// when `cancel` fires. Each request's outputs wait in a channel of `output_buffer`
    /// (at least 1).
    pub fn start(
        engine: DynEngine,
        publishing: HostPublishing,
        output_buffer: usize,
        tasks: &TaskTracker,
        cancel: CancellationToken,
    ) -> EngineHost {
        let worker_id = engine.pool().worker_id();
        let host = EngineHost {
            inner: Arc::new(Inner {
                worker_id,
                state: Mutex::new(State {
                    engine,
                    outputs: HashMap::new(),
                    output_buffer: output_buffer.max(1),
                    exporting: Vec::new(),
                    events_taken: 0,
                }),
                computing: AtomicBool::new(false),
                events: Mutex::new(Vec::new()),
                tracked: AtomicUsize::new(0),
                load_at_step: Mutex::new(None),
                work: Notify::new(),
                dirty: Notify::new(),
                idle: Notify::new(),
                started: tokio::time::Instant::now(),
            }),
        };
        tasks.spawn(
            host.clone()
                .drive(publishing.metrics.clone(), cancel.clone()),
        );
        tasks.spawn(host.clone().publish_events(publishing, cancel));
        host
    }

    pub fn worker_id(&self) -> WorkerId {
        self.inner.worker_id
    }

    /// Microseconds since the host started: the engine's clock.
    pub fn now_us(&self) -> u64 {
        self.inner.started.elapsed().as_micros() as u64
    }

    /// Queues a request for a local prefill and decode.
    pub fn submit(&self, req: EngineRequest) -> Result<RequestHandle, WorkerError> {
        self.submit_inner(req, None)
    }

    /// Queues a request whose prompt KV from token `from_token` on is exported as it is
    /// computed ([`HostOutput::Blocks`]); the prefill worker's side of a remote prefill.
    /// `by_reference`: the blocks are named, not copied, and stay pinned in the arena after
    /// the request ends until [`release_export`](Self::release_export).
    pub fn submit_exporting(
        &self,
        req: EngineRequest,
        from_token: usize,
        by_reference: bool,
    ) -> Result<RequestHandle, WorkerError> {
        self.submit_inner(req, Some((from_token, by_reference)))
    }

    /// The consumer of an export by reference is done with its blocks.
    pub fn release_export(&self, id: RequestId) {
        self.state().engine.release_export(id);
        self.inner.work.notify_one();
    }

    fn submit_inner(
        &self,
        req: EngineRequest,
        export_from: Option<(usize, bool)>,
    ) -> Result<RequestHandle, WorkerError> {
        let id = req.id;
        let now = self.now_us();
        let handle = {
            let mut st = self.state();
            if st.outputs.contains_key(&id) {
                return Err(WorkerError::DuplicateRequest(id.0));
            }
            st.engine.add_request(req, now).map_err(scheduler_error)?;
            match export_from {
                Some((from, true)) => st.engine.export_kv_by_reference(id, from),
                Some((from, false)) => st.engine.export_kv(id, from),
                None => {}
            }
            if export_from.is_some() {
                st.exporting.push(id);
            }
            self.track(&mut st, id)
        };
        self.inner.work.notify_one();
        Ok(handle)
    }

    /// Reserves blocks for a remote prefill of `req` (the decode side). On success the
    /// caller writes the received KV with [`write_block`](Self::write_block), or has a
    /// transport write it into the arena, then calls [`finish_remote`](Self::finish_remote)
    /// or [`fail_remote`](Self::fail_remote); the handle receives the first token and the
    /// rest. `Overloaded` when there is no room now.
    ///
    /// With `hold`, the reserved blocks are also held (see
    /// [`tandem_engine::BlockPool::hold`]): they stay out of use, even when the request ends,
    /// until [`release_hold`](Self::release_hold) says no writer can reach them any more.
    pub fn begin_remote(
        &self,
        req: EngineRequest,
        hold: bool,
    ) -> Result<(RequestHandle, RemotePrefill), WorkerError> {
        let id = req.id;
        let now = self.now_us();
        let (handle, rp) = {
            let mut st = self.state();
            if st.outputs.contains_key(&id) {
                return Err(WorkerError::DuplicateRequest(id.0));
            }
            let rp = st
                .engine
                .begin_remote_prefill(req, now)
                .map_err(scheduler_error)?;
            if hold && let Err(e) = st.engine.pool_mut().hold(&rp.blocks) {
                st.engine.abort(id);
                return Err(WorkerError::Internal(format!(
                    "holding transfer blocks: {e}"
                )));
            }
            (self.track(&mut st, id), rp)
        };
        Ok((handle, rp))
    }

    /// Writes one received block of request `id` into the device arena. `block` must be one
    /// of the blocks [`begin_remote`](Self::begin_remote) reserved for `id`; the write is
    /// refused once the request is no longer tracked (aborted: its blocks may belong to
    /// someone else by now).
    pub fn write_block(&self, id: RequestId, block: u32, bytes: &[u8]) -> Result<(), WorkerError> {
        let mut st = self.state();
        if !st.outputs.contains_key(&id) {
            return Err(WorkerError::BadTransfer(format!(
                "request {} is gone: block {block} not written",
                id.0
            )));
        }
        let arena = st.engine.pool_mut().device_arena_mut();
        if block as usize >= arena.num_blocks() || bytes.len() != arena.bytes_per_block() {
            return Err(WorkerError::BadTransfer(format!(
                "block {block} of {} bytes does not fit an arena of {} blocks × {} bytes",
                bytes.len(),
                arena.num_blocks(),
                arena.bytes_per_block()
            )));
        }
        arena.write_block(block, bytes);
        Ok(())
    }

    /// Ends the hold [`begin_remote`](Self::begin_remote) took on `blocks`: the transfer into
    /// them is over (completed, or its writer confirmed stopped). Blocks no request uses any
    /// more become free.
    pub fn release_hold(&self, blocks: &[u32]) -> Result<(), WorkerError> {
        let released = self.state().engine.pool_mut().release_hold(blocks);
        released.map_err(|e| WorkerError::Internal(format!("releasing transfer blocks: {e}")))?;
        self.inner.work.notify_one();
        Ok(())
    }

    /// Bytes per KV block of this engine's arena.
    pub fn bytes_per_block(&self) -> usize {
        let st = self.state();
        st.engine.pool().device_arena().bytes_per_block()
    }

    /// The KV of a remote prefill is in: the request continues with `first_token` (and the
    /// prefill worker's logprobs for it, when the request asked for them).
    pub fn finish_remote(
        &self,
        id: RequestId,
        first_token: u32,
        logprobs: Option<Box<TokenLogprobs>>,
    ) -> Result<(), WorkerError> {
        let now = self.now_us();
        let idle = {
            let mut st = self.state();
            let out = st
                .engine
                .finish_remote_prefill(id, first_token, logprobs, now)
                .map_err(scheduler_error)?;
            route_output(&mut st, out);
            st.outputs.is_empty()
        };
        if idle {
            self.inner.idle.notify_waiters();
        }
        self.inner.work.notify_one();
        Ok(())
    }

    /// The remote prefill failed: the request prefills here instead.
    pub fn fail_remote(&self, id: RequestId) -> Result<(), WorkerError> {
        let now = self.now_us();
        self.state()
            .engine
            .fail_remote_prefill(id, now)
            .map_err(scheduler_error)?;
        self.inner.work.notify_one();
        Ok(())
    }

    /// KV events after `after`, or None when the ring no longer holds them (send a dump).
    pub fn events_since(&self, after: u64) -> Option<Vec<KvEvent>> {
        self.state().engine.events_since(after).ok()
    }

    pub fn dump(&self) -> KvDump {
        self.state().engine.dump()
    }

    /// Requests tracked now (queued, running, awaiting KV), as the engine's last holder
    /// left them: read without waiting for a step.
    pub fn in_flight(&self) -> usize {
        self.inner.tracked.load(Ordering::Acquire)
    }

    /// The engine's load report now. While a real model's step computes, the report taken
    /// as it began, stamped now: the engine does not change under a forward pass, and
    /// waiting for it would hold a runtime thread for the step.
    pub fn load_report(&self) -> LoadReport {
        let now = self.now_us();
        if self.inner.computing.load(Ordering::Acquire)
            && let Some(mut report) = self.inner.load_at_step.lock().clone()
        {
            report.timestamp_ms = report.timestamp_ms.max(now / 1000);
            return report;
        }
        self.state().engine.load_report(now)
    }

    /// Waits until no request is tracked, or `timeout` passes; true when idle.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inner.idle.notified();
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.in_flight() == 0;
            }
        }
    }

    /// Runs `f` on the engine, for tests and status pages.
    pub fn with_engine<R>(&self, f: impl FnOnce(&DynEngine) -> R) -> R {
        f(&self.state().engine)
    }

    /// Changes the engine between steps (a stopping worker spilling its cache to disk).
    pub fn with_engine_mut<R>(&self, f: impl FnOnce(&mut DynEngine) -> R) -> R {
        f(&mut self.state().engine)
    }

    /// Tracks a new request: its bounded output channel and its handle.
    fn track(&self, st: &mut State, id: RequestId) -> RequestHandle {
        let (tx, rx) = mpsc::channel(st.output_buffer);
        let overflowed = Arc::new(AtomicBool::new(false));
        st.outputs.insert(
            id,
            Output {
                tx,
                overflowed: overflowed.clone(),
            },
        );
        RequestHandle {
            id,
            rx,
            overflowed,
            buffer: st.output_buffer,
            host: self.clone(),
            ended: false,
        }
    }

    /// Forgets a request: aborts it in the engine when it is still tracked (not ended).
    fn release(&self, id: RequestId) {
        let (aborted, now_idle) = {
            let mut st = self.state();
            let tracked = st.outputs.remove(&id).is_some();
            st.exporting.retain(|r| *r != id);
            if tracked {
                st.engine.abort(id);
            }
            (tracked, st.outputs.is_empty())
        };
        if aborted {
            self.inner.work.notify_one();
        }
        if now_idle {
            self.inner.idle.notify_waiters();
        }
    }

    async fn drive(self, metrics: Arc<crate::metrics::WorkerMetrics>, cancel: CancellationToken) {
        // The end of the previous step, while steps follow each other.
        let mut prev_end: Option<tokio::time::Instant> = None;
        // How long the latest timed step's compute took.
        let mut last_compute = Duration::ZERO;
        // Steps computed inline since this task last let go of its thread.
        let mut inline_steps = 0;
        loop {
            let now = tokio::time::Instant::now();
            // A step that follows another starts at that one's modelled end, not at the
            // driver's wake-up: timers fire up to a millisecond late, and starting from the
            // wake-up added that to every step. Later than the slack (the host's own work
            // overran the step), it starts now.
            let start = prev_end
                .filter(|end| now.saturating_duration_since(*end) <= TIMER_SLACK)
                .unwrap_or(now);
            let start_us = start.duration_since(self.inner.started).as_micros() as u64;
            let (planned, followers) = {
                let mut st = self.state();
                let planned = st.engine.begin_step(start_us);
                if planned.as_ref().is_some_and(|s| s.is_untimed()) {
                    // A forward pass follows: what the load report says while it runs.
                    *self.inner.load_at_step.lock() = Some(st.engine.load_report(start_us));
                    self.inner.computing.store(true, Ordering::Release);
                }
                let followers = match planned {
                    Some(_) => progress::Followers::of(&st),
                    None => progress::Followers::default(),
                };
                (planned, Arc::new(followers))
            };
            let Some(step) = planned else {
                prev_end = None;
                inline_steps = 0;
                tokio::select! {
                    _ = self.inner.work.notified() => continue,
                    _ = cancel.cancelled() => return,
                }
            };
            // The step ends at its start plus its modelled duration, however long the host's
            // own work took: the model's work (KV bytes, digests, copies for export) is done
            // first, inside the modelled time, and the step completes at its end, when its
            // outputs are handed over (and the load reports and KV events see it). Done after
            // the sleep, the work made every step that much longer than modelled.
            let modelled = step.duration_us();
            if step.is_untimed() {
                // A real model's forward pass, on a blocking-pool thread while this task
                // waits: the runtime's workers sleep through it. (Computed in place with
                // `block_in_place`, every step handed this worker's queue to another thread,
                // and the extra threads woken on a machine whose cores the forward pass fills
                // preempted its threads: 0.77× the bare engine's decode rate at batch 1.)
                let (host, followers) = (self.clone(), Arc::clone(&followers));
                let computed = tokio::task::spawn_blocking(move || {
                    host.inner
                        .locked(host.inner.state.lock())
                        .engine
                        .compute_step_with(&|done| followers.tell(done));
                    host.inner.computing.store(false, Ordering::Release);
                });
                tokio::select! {
                    done = computed => {
                        if let Err(e) = done {
                            tracing::error!(error = %e, "the engine's step panicked");
                            return;
                        }
                    }
                    _ = cancel.cancelled() => return,
                }
            } else if modelled == 0 && last_compute < INLINE_COMPUTE {
                // A timed step of no time (a mocker answering at once) whose compute is short:
                // done here. Handed to another thread as a forward pass is, each step cost two
                // wake-ups across threads (a tenth of `tandem up`'s CPU a request at
                // `--speedup-ratio 1e9`). The other tasks (the requests reading these outputs)
                // get their turn when a request's channel has no room for another step's
                // outputs, after `INLINE_STEPS` steps, or when this task's cooperative budget
                // is spent (each step short: at most about `INLINE_STEPS` ×
                // `INLINE_COMPUTE` between turns). A yield after every step woke the
                // runtime's idle worker each time (a yielded task is queued for any worker to
                // take): `tandem up` made 14 system calls a request with it, about 6 without.
                let started = std::time::Instant::now();
                let room = {
                    let mut st = self.state();
                    st.engine.compute_step();
                    st.room_for_a_step()
                };
                last_compute = started.elapsed();
                inline_steps += 1;
                if !room || inline_steps >= INLINE_STEPS {
                    inline_steps = 0;
                    tokio::task::yield_now().await;
                } else {
                    tokio::task::consume_budget().await;
                }
            } else {
                // CPU-bound, and long for big KV shapes: off the async workers' queue.
                let started = std::time::Instant::now();
                cpu_bound(|| self.state().engine.compute_step());
                last_compute = started.elapsed();
            }
            // A model that does not time its steps (the native engine) ends one when its
            // compute does.
            let (end, end_us) = if modelled == 0 {
                let now = tokio::time::Instant::now();
                (
                    now,
                    now.duration_since(self.inner.started).as_micros() as u64,
                )
            } else {
                (start + Duration::from_micros(modelled), start_us + modelled)
            };
            if modelled > 0 {
                // A timed model's KV is all written, but a device would finish its layers
                // one by one over the step: the followers hear of each at its share of it.
                for done in 1..if followers.is_empty() {
                    0
                } else {
                    followers.layers
                } {
                    let at = modelled * u64::from(done) / u64::from(followers.layers);
                    tokio::select! {
                        _ = tokio::time::sleep_until(start + Duration::from_micros(at)) => {}
                        _ = cancel.cancelled() => return,
                    }
                    followers.tell(done);
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(end) => {}
                    _ = cancel.cancelled() => return,
                }
            }
            prev_end = Some(end);
            metrics.steps.step(
                end_us,
                step.prefill_tokens,
                step.decode_tokens,
                step.num_requests,
            );
            if self.complete_step(end_us) {
                self.inner.idle.notify_waiters();
            }
        }
    }

    /// Completes the in-flight step at `now` (its modelled end): exported blocks, then
    /// outputs to their requests. True when no request is left.
    fn complete_step(&self, now: u64) -> bool {
        let mut st = self.state();
        let outputs = st.engine.finish_step(now);
        // Blocks first: a consumer sees a prompt's last blocks before its token.
        let exporting = std::mem::take(&mut st.exporting);
        let mut keep = Vec::with_capacity(exporting.len());
        for id in exporting {
            let Some((blocks, finished)) = st.engine.take_exported(id) else {
                continue;
            };
            if !blocks.is_empty() {
                deliver(&mut st, id, HostOutput::Blocks(blocks));
            }
            if !finished {
                keep.push(id);
            }
        }
        st.exporting = keep;
        for out in outputs {
            route_output(&mut st, out);
        }
        st.outputs.is_empty()
    }

    async fn publish_events(self, p: HostPublishing, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = self.inner.dirty.notified() => {}
                _ = cancel.cancelled() => return,
            }
            let batch = std::mem::take(&mut *self.inner.events.lock());
            if batch.is_empty() {
                continue;
            }
            match batch.encode() {
                Ok(bytes) => {
                    match p.events.publish(&p.kv_subject, Bytes::from(bytes)).await {
                        Ok(()) => p.metrics.events_published(batch.len() as u64),
                        // Not retried here: the index sees the gap (next batch or load
                        // report) and asks this worker for the range.
                        Err(e) => tracing::warn!(error = %e, "publishing KV events failed"),
                    }
                }
                Err(e) => tracing::error!(error = %e, "encoding KV events failed"),
            }
        }
    }
}

impl Inner {
    fn locked<'a>(&'a self, guard: MutexGuard<'a, State>) -> Locked<'a> {
        Locked { inner: self, guard }
    }
}

/// The host's state, held. Letting go of it hands the KV events the holder's changes
/// produced to the publisher's queue (in id order: only a holder takes them) and leaves the
/// count of tracked requests where readers find it without the lock.
struct Locked<'a> {
    inner: &'a Inner,
    guard: MutexGuard<'a, State>,
}

impl Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let st = &mut *self.guard;
        self.inner
            .tracked
            .store(st.outputs.len(), Ordering::Release);
        let newest = st.engine.pool().last_event_id();
        if newest <= st.events_taken {
            return;
        }
        let taken = st.engine.events_since(st.events_taken);
        st.events_taken = newest;
        let Ok(taken) = taken else {
            // More events in one change than the engine's ring holds: consumers see the
            // gap and repair by a dump.
            tracing::warn!(newest, "KV events dropped before publishing");
            return;
        };
        let mut queue = self.inner.events.lock();
        if queue.len() + taken.len() > QUEUED_EVENTS_MAX {
            tracing::warn!(
                dropped = queue.len(),
                "the KV event publisher fell behind: events dropped (the index repairs the gap)"
            );
            queue.clear();
        }
        queue.extend(taken);
        drop(queue);
        self.inner.dirty.notify_one();
    }
}

/// How late a timer may fire (tokio's resolution is a millisecond) for the next step to start
/// at the previous one's modelled end.
const TIMER_SLACK: Duration = Duration::from_millis(2);

/// A timed step of no time whose compute took less than this is computed on the async
/// worker itself (see `drive`).
const INLINE_COMPUTE: Duration = Duration::from_micros(200);

/// The most steps computed inline one after another before the host's task lets the others
/// run (see `drive`).
const INLINE_STEPS: u32 = 16;

/// Runs CPU-heavy synchronous work from async code: on a multi-threaded runtime the worker
/// thread hands its other tasks over first (`block_in_place`), so the work delays no one
/// else; on a current-thread runtime (some tests) it just runs.
pub fn cpu_bound<R>(f: impl FnOnce() -> R) -> R {
    if tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
    {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// Hands an output to its request; the request's channel closes with its last token.
fn route_output(st: &mut State, out: RequestOutput) {
    let id = out.id;
    let last = out.finish.is_some();
    if deliver(st, id, HostOutput::Token(out)) && last {
        // Ended: no longer tracked (a later drop of the handle aborts nothing).
        st.outputs.remove(&id);
    }
}

/// Puts one output in its request's channel. A full channel means the consumer fell
/// `output_buffer` outputs behind: the request is aborted (its blocks freed) and its handle
/// told so. Returns whether the request is still tracked.
fn deliver(st: &mut State, id: RequestId, out: HostOutput) -> bool {
    let Some(o) = st.outputs.get(&id) else {
        return false;
    };
    match o.tx.try_send(out) {
        Ok(()) => true,
        // The handle is gone; its drop is releasing the request.
        Err(mpsc::error::TrySendError::Closed(_)) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            o.overflowed.store(true, Ordering::Release);
            st.outputs.remove(&id);
            st.exporting.retain(|r| *r != id);
            st.engine.abort(id);
            tracing::warn!(request = id.0, "request aborted: its consumer fell behind");
            false
        }
    }
}

fn scheduler_error(e: SchedulerError) -> WorkerError {
    match e.class() {
        ErrorClass::InvalidRequest => WorkerError::InvalidRequest(e.to_string()),
        ErrorClass::Overloaded => WorkerError::Overloaded(e.to_string()),
        ErrorClass::Unavailable | ErrorClass::Cancelled | ErrorClass::Internal => {
            WorkerError::Internal(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests;
