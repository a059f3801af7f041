//! [`ClusterBackend`]: the HTTP edge's [`Backend`] over real workers.
//!
//! Per request: hash the prompt's full blocks under its cache salt and LoRA adapter
//! ([`HashSeed::for_request`]), find each worker's
//! cached prefix (embedded index or a standalone indexer), gather candidate views (overlap,
//! the tracker's load merged with the latest load report, warm-up), decide — the policy over
//! the decode pool, or conditional disaggregation when a prefill pool exists — record the
//! request in the active-sequence tracker (shared with peer replicas over the event plane),
//! and call the decode worker's `Generate`, naming the prefill worker when prefill is
//! remote.
//!
//! Failures before the first token are retried on another decode worker (the frontend's is
//! the one retry layer, docs/ARCHITECTURE.md §10), up to `max_attempts`. A failure after the first token
//! migrates the request (docs/ARCHITECTURE.md §1): prompt + tokens generated so far go to another decode
//! worker for the rest of the token budget, up to `max_migrations` times; beyond that the
//! stream ends with an error item and the edge closes the response cleanly.
//!
//! The tracker entry of a request lives in a guard owned by its output stream: the prefill
//! load leaves at the first token, everything leaves when the stream ends or is dropped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream;
use parking_lot::Mutex;
use tandem_indexer::OverlapScores;
use tandem_protocol::grpc::{
    self, FindMatchesRequest, GenerateChunk, GenerateRequest, RemotePrefillTarget, Sampling,
    indexer_client::IndexerClient,
};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{Envelope, ErrorClass, HashSeed, RequestId, SequenceHash, WorkerId};
use tandem_runtime::events::{EventPlane, subjects};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use tonic::transport::Channel;
use tracing::Instrument as _;

use super::flow::{Admission, Gate, PUMP_TICK};
use super::metrics::{Overhead, RouteCounters};
use super::sessions::{SessionLimiter, SessionPermit};
use super::view::{ClusterView, WorkerEntry};
use crate::http::{
    Backend, EngineReport, FinishReason, Generation, RouteInfo, ServeError, TokenChunk,
    TokenLogprob, ValidRequest,
};
use run::Run;
use tandem_router::{
    FlowQueue, InFlight, Input, KvOverrides, Priority, Rng, RouteError, RouteInput, RouteRequest,
    SessionKey, SyncMessage, TenantLimits, TtftHistory,
};
use trace::{record_decision, route_span};

mod attempts;
mod config;
mod run;
mod trace;

pub use config::{BackendConfig, HedgeConfig};

/// Sync messages waiting to be published; beyond it they are dropped (peers expire the
/// entries by TTL).
const SYNC_QUEUE: usize = 4096;

struct Shared {
    view: Arc<ClusterView>,
    counters: Arc<RouteCounters>,
    cfg: BackendConfig,
    /// Request ids and sampling seeds: drawn apart from the replica's generator, so that the
    /// routing decisions draw exactly what the simulator's do.
    ids: Mutex<Rng>,
    indexer: Option<IndexerClient<Channel>>,
    sync_tx: Option<mpsc::Sender<SyncMessage>>,
    gate: Gate<Arc<Prepared>, Plan>,
    /// Recent times to first token by prompt size, for hedging.
    ttft: Mutex<TtftHistory>,
    sessions: Arc<SessionLimiter>,
}

/// The frontend's backend over a live cluster. Cheap to clone.
#[derive(Clone)]
pub struct ClusterBackend {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ClusterBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterBackend")
            .field("router_id", &self.shared.cfg.router_id)
            .finish_non_exhaustive()
    }
}

/// A routing decision for one attempt, with the workers' clients and the request's place in
/// the tracker (released when the plan, or the run holding its flight, is dropped).
struct Plan {
    decode: WorkerEntry,
    prefill: Option<WorkerEntry>,
    flight: Flight,
}

/// What routing a request needs, computed once per job (and held while it waits in the
/// queue).
struct Prepared {
    route: RouteRequest,
    hashes: Vec<SequenceHash>,
    scores: Option<OverlapScores>,
    /// Output tokens the tracker counts the request for: its expected length, else
    /// `max_tokens`.
    expected_output_tokens: u32,
    session: Option<SessionKey>,
    /// The router's time on it before the decision: hashing, and a standalone indexer's
    /// lookup (zero when the replica's own index answers, timed in [`Self::plan`]).
    overhead: Overhead,
    /// The request's span: its `route` spans hang under it (a queued request is planned by
    /// whichever task dispatches it).
    span: tracing::Span,
}

impl ClusterBackend {
    /// Builds the backend on `view` (whose replica it routes with); with replica sync,
    /// publishes this replica's tracker changes and applies its peers'.
    pub async fn start(
        cfg: BackendConfig,
        view: Arc<ClusterView>,
        counters: Arc<RouteCounters>,
        events: Arc<dyn EventPlane>,
        tasks: &TaskTracker,
        cancel: CancellationToken,
    ) -> Result<Self, ServeError> {
        let indexer = match &cfg.indexer_url {
            Some(url) => {
                let ch = tandem_runtime::grpc::lazy_channel(url, cfg.connect_timeout)
                    .map_err(|e| ServeError::internal(format!("indexer address: {e}")))?;
                Some(IndexerClient::new(ch))
            }
            None => None,
        };
        let subject = subjects::router_sync(&view.config().namespace);
        let sync_tx = if cfg.replica_sync {
            let (tx, mut rx) = mpsc::channel::<SyncMessage>(SYNC_QUEUE);
            let (ev, c) = (events.clone(), cancel.clone());
            let subj = subject.clone();
            tasks.spawn(async move {
                loop {
                    let msg = tokio::select! {
                        m = rx.recv() => match m { Some(m) => m, None => return },
                        _ = c.cancelled() => return,
                    };
                    match msg.encode() {
                        Ok(bytes) => {
                            if let Err(e) = ev.publish(&subj, bytes.into()).await {
                                tracing::debug!(error = %e, "publishing router sync failed");
                            }
                        }
                        Err(e) => tracing::error!(error = %e, "encoding router sync failed"),
                    }
                }
            });
            Some(tx)
        } else {
            None
        };
        let queue = FlowQueue::new(cfg.flow)
            .map_err(|e| ServeError::internal(format!("flow control: {e}")))?;
        let gate = Gate::new(queue, counters.flow.clone());
        let ttft = Mutex::new(TtftHistory::new(cfg.hedge.map_or(20, |h| h.min_samples)));
        let sessions = Arc::new(SessionLimiter::new(
            cfg.session_cap,
            counters.flow.sessions.clone(),
        ));
        let shared = Arc::new(Shared {
            sessions,
            ttft,
            gate,
            view,
            counters,
            ids: Mutex::new(Rng::seed_from_u64(cfg.seed ^ 0x6964_7300_0000_0000)),
            indexer,
            sync_tx,
            cfg,
        });
        if shared.cfg.replica_sync {
            let mut sub = events
                .subscribe(&subject)
                .await
                .map_err(|e| ServeError::unavailable(format!("event plane: {e}")))?;
            let (s, c) = (shared.clone(), cancel.clone());
            tasks.spawn(async move {
                loop {
                    let bytes = tokio::select! {
                        m = sub.next() => match m { Some(b) => b, None => return },
                        _ = c.cancelled() => return,
                    };
                    let Ok(msg) = SyncMessage::decode(&bytes) else {
                        continue;
                    };
                    if msg.router() != s.cfg.router_id {
                        let now = s.view.now_ms();
                        // A sync message never asks for a repair.
                        let _ = s.view.replica().write().apply(Input::PeerSync(&msg), now);
                    }
                }
            });
        }
        let backend = ClusterBackend {
            shared: shared.clone(),
        };
        let c = cancel.clone();
        tasks.spawn(async move {
            // The pump: dispatches queued requests as capacity frees (see flow.rs).
            let gate = &backend.shared.gate;
            loop {
                let tick = if gate.is_empty() {
                    Duration::from_secs(1)
                } else {
                    PUMP_TICK
                };
                tokio::select! {
                    () = gate.woken() => {}
                    () = tokio::time::sleep(tick) => {}
                    () = c.cancelled() => return,
                }
                let now = backend.shared.view.now_ms();
                gate.pump(now, |p| backend.plan(p, &[], true));
            }
        });
        let (s, c) = (shared.clone(), cancel);
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let now = s.view.now_ms();
                        s.view.replica().write().expire(now);
                    }
                    _ = c.cancelled() => return,
                }
            }
        });
        Ok(ClusterBackend { shared })
    }

    pub fn view(&self) -> &Arc<ClusterView> {
        &self.shared.view
    }

    /// The standalone indexer's overlap scores, when one is configured (else the replica
    /// asks its own index).
    async fn remote_matches(&self, hashes: &[SequenceHash]) -> Option<OverlapScores> {
        let client = self.shared.indexer.as_ref()?;
        let req = FindMatchesRequest {
            sequence_hashes: hashes.iter().map(|h| h.0).collect(),
        };
        match client.clone().find_matches(req).await {
            Ok(reply) => {
                let mut scores: Vec<_> = reply
                    .into_inner()
                    .workers
                    .into_iter()
                    .map(|w| {
                        let counts = tandem_indexer::TierCounts {
                            device: w.device,
                            host: w.host,
                            disk: w.disk,
                        };
                        (WorkerId(w.worker_id), counts)
                    })
                    .collect();
                scores.sort_by_key(|(w, _)| *w);
                Some(OverlapScores { scores })
            }
            Err(status) => {
                // Routing on load alone beats refusing the request.
                tracing::warn!(%status, "indexer unavailable: routing without overlap");
                Some(OverlapScores::default())
            }
        }
    }

    /// Decides where the request goes (excluding workers that already failed it) and
    /// records it in the tracker. `admitted`: under flow control, saturated workers are left
    /// out and [`RouteError::Saturated`] means every one is.
    fn plan(
        &self,
        p: &Prepared,
        excluded: &[WorkerId],
        admitted: bool,
    ) -> Result<Plan, RouteError> {
        let s = &self.shared;
        let request = RequestId(s.ids.lock().next_u64() >> 1);
        let input = RouteInput {
            request,
            route: p.route,
            hashes: &p.hashes,
            expected_output_tokens: u64::from(p.expected_output_tokens),
            overlap: p.scores.as_ref(),
            session: p.session,
        };
        let now = s.view.now_ms();
        let registry = s.view.registry();
        let span = route_span(&p.span);
        let _entered = span.enter();
        let (plan, sessions) = {
            let mut replica = s.view.replica().write();
            let started = Instant::now();
            let plan = if admitted {
                replica.route_admitted(&input, excluded, now)?
            } else {
                replica.route(&input, excluded, now)?
            };
            let routed = started.elapsed();
            let lookup = replica.last_index_lookup();
            s.counters.overhead(Overhead {
                index: p.overhead.index + lookup,
                score: routed.saturating_sub(lookup),
                ..p.overhead
            });
            (plan, replica.sessions().len())
        };
        if let Some(outcome) = plan.session {
            s.counters.flow.sessions.routed(outcome, sessions);
        }
        s.counters
            .flow
            .recent
            .decision(request, &p.route, excluded.len(), &plan.decision);
        record_decision(&span, &plan.decision, excluded.len());
        for m in plan.sync.iter().cloned() {
            self.sync(m);
        }
        let flight = Flight {
            backend: self.clone(),
            worker: plan.decode_worker(),
            inner: plan.flight,
        };
        let entry = |id: WorkerId| registry.get(id).cloned();
        // Discovery may have removed it between the replica's decision and here (the flight
        // is released as it drops).
        let decode = entry(plan.decode_worker()).ok_or(RouteError::AllExcluded)?;
        Ok(Plan {
            decode,
            prefill: plan.prefill_worker().and_then(entry),
            flight,
        })
    }

    /// [`Self::plan`] for a started request (a retry): off saturated workers when possible,
    /// never queued.
    fn plan_retry(&self, p: &Prepared, excluded: &[WorkerId]) -> Result<Plan, ServeError> {
        match self.plan(p, excluded, true) {
            Err(RouteError::Saturated) => self.plan(p, excluded, false),
            r => r,
        }
        .map_err(route_error)
    }

    /// Ends a request's tracking and tells the peers.
    fn end(&self, flight: InFlight) {
        let now = self.shared.view.now_ms();
        let msgs = self.shared.view.replica().write().finish(flight, now);
        for m in msgs {
            self.sync(m);
        }
    }

    fn sync(&self, msg: SyncMessage) {
        if let Some(tx) = &self.shared.sync_tx {
            let _ = tx.try_send(msg);
        }
    }

    /// Starts the plan on its decode worker and waits for the first chunk.
    async fn attempt(
        &self,
        plan: &Plan,
        job: &Job,
    ) -> Result<
        (
            tonic::Streaming<GenerateChunk>,
            GenerateChunk,
            tracing::Span,
        ),
        Status,
    > {
        let greq = GenerateRequest {
            request_id: plan.flight.inner.request().0,
            prompt: job.prompt.clone(),
            sampling: Some(Sampling {
                max_tokens: job.max_tokens,
                seed: job.sampling_seed,
                temperature: job.temperature,
                stop_token: None,
                ignore_eos: job.ignore_eos,
                // 1 is every engine's default: not sent, so the engine's own applies (as
                // top_k 0 and min_p 0: off).
                top_p: (job.top_p < 1.0).then_some(job.top_p),
                top_k: (job.top_k > 0).then_some(job.top_k),
                min_p: (job.min_p > 0.0).then_some(job.min_p),
                logprobs: job.logprobs.map(u32::from),
            }),
            hash_seed: job.seed.0,
            remote_prefill: job.kv_from.clone().or_else(|| {
                plan.prefill.as_ref().map(|p| RemotePrefillTarget {
                    worker_id: p.record.id.0,
                    address: p.record.addresses.grpc.clone(),
                })
            }),
            cache_salt: job.cache_salt.clone().unwrap_or_default(),
            lora_adapter: job.adapter.clone().unwrap_or_default(),
        };
        let span = tracing::info_span!(
            "tandem.v1.Worker/Generate",
            otel.kind = "client",
            server.address = plan.decode.record.addresses.grpc.as_str(),
            tandem.worker = tandem_runtime::telemetry::int(plan.decode.record.id.0),
            tandem.remote_prefill = plan.prefill.is_some(),
        );
        tandem_runtime::telemetry::set_attributes(
            &span,
            &[
                ("rpc.system", "grpc"),
                ("rpc.service", "tandem.v1.Worker"),
                ("rpc.method", "Generate"),
            ],
        );
        let mut call = tonic::Request::new(greq);
        tandem_runtime::telemetry::inject_metadata(&span, call.metadata_mut());
        let mut client = plan.decode.client.clone();
        let (stream, first) = async {
            let mut stream = client.generate(call).await?.into_inner();
            let first = stream
                .message()
                .await?
                .ok_or_else(|| Status::unavailable("the worker ended the stream before a token"))?;
            Ok::<_, Status>((stream, first))
        }
        .instrument(span.clone())
        .await
        .inspect_err(|status| {
            span.record("otel.status_code", "ERROR");
            span.record("rpc.grpc.status_code", status.code() as i32);
        })?;
        Ok((stream, first, span))
    }
}

/// What is sent to a decode worker: the request, or its continuation after a migration
/// (prompt + tokens generated so far, the remaining token budget).
#[derive(Clone, Debug)]
struct Job {
    prompt: Vec<u32>,
    max_tokens: u32,
    temperature: f32,
    ignore_eos: bool,
    seed: HashSeed,
    sampling_seed: u64,
    /// The client's cache salt, passed on for external engines' own salting.
    cache_salt: Option<String>,
    /// The LoRA adapter it runs on (already part of `seed`).
    adapter: Option<String>,
    top_p: f32,
    top_k: u32,
    min_p: f32,
    logprobs: Option<u8>,
    /// Past it the request is cancelled (continuations keep the original's).
    deadline: tokio::time::Instant,
    /// `kv` knob overrides of the request.
    overrides: KvOverrides,
    /// Output tokens the client expects (at most `max_tokens`).
    expected_output_tokens: Option<u32>,
    /// Its session, keyed with its tenant.
    session: Option<SessionKey>,
    /// Its band (the `kv` decode term's weight).
    priority: Priority,
    /// A handover's continuation: the draining decode worker that holds its KV, asked for
    /// it as the remote prefill whatever the router would pick.
    kv_from: Option<RemotePrefillTarget>,
}

/// A request started on a decode worker, its first chunk in hand.
struct Started {
    route: RouteInfo,
    /// The decode worker streaming it (the source of a handover's KV).
    decode: RemotePrefillTarget,
    first: GenerateChunk,
    rest: tonic::Streaming<GenerateChunk>,
    flight: Flight,
    /// The gRPC call's client span, open while its stream is read.
    span: tracing::Span,
}

/// A routing error as the client sees it.
fn route_error(e: RouteError) -> ServeError {
    match e {
        RouteError::NoWorkers => ServeError::unavailable("no decode workers are registered"),
        RouteError::AllExcluded => {
            ServeError::unavailable("every decode worker failed this request")
        }
        e => ServeError::from(e),
    }
}

/// Whether another decode worker may succeed where this one failed (before any token).
fn retryable(status: &Status) -> bool {
    ErrorClass::of_status(status).may_succeed_elsewhere()
}

fn status_to_error(status: &Status) -> ServeError {
    let message = status.message().to_string();
    match ErrorClass::of_status(status) {
        ErrorClass::InvalidRequest => ServeError::invalid(message),
        ErrorClass::Overloaded => ServeError::overloaded(message, Duration::from_secs(1)),
        ErrorClass::Unavailable | ErrorClass::Cancelled | ErrorClass::Internal => {
            ServeError::unavailable(format!("worker failed: {message}"))
        }
    }
}

fn token_chunk(c: &GenerateChunk) -> TokenChunk {
    let finish = match grpc::FinishReason::try_from(c.finish) {
        Ok(grpc::FinishReason::Length) => Some(FinishReason::Length),
        Ok(grpc::FinishReason::Stop) => Some(FinishReason::Stop),
        _ => None,
    };
    TokenChunk {
        tokens: c.tokens.clone(),
        finish,
        cached_tokens: c.cached_tokens,
        text: c.text.clone(),
        text_tokens: c.completion_tokens,
        logprobs: c
            .logprobs
            .iter()
            .map(|l| TokenLogprob {
                logprob: l.logprob,
                // A worker's malformed alternatives are dropped; its token still counts.
                top: l.top_pairs().unwrap_or_default(),
            })
            .collect(),
    }
}

/// A request's place in the tracker, released when its stream ends or is dropped.
struct Flight {
    backend: ClusterBackend,
    worker: WorkerId,
    inner: InFlight,
}

impl Flight {
    fn first_token(&mut self) {
        let s = &self.backend.shared;
        let now = s.view.now_ms();
        let msgs = s.view.replica().write().first_token(&mut self.inner, now);
        for m in msgs {
            self.backend.sync(m);
        }
        // Its prefill load left: a saturated worker may have room.
        s.gate.wake();
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.backend.end(self.inner);
        self.backend.shared.gate.wake();
    }
}

/// A request's use of its tenant's budget: output charged to the fairness counter as it
/// streams; on drop, the running count released and the unused part of the token budget
/// given back.
struct TenantUse {
    backend: ClusterBackend,
    tenant: Arc<str>,
    /// Charged to the tokens-per-minute bucket at admission.
    charged: u64,
    prompt_tokens: u64,
    generated: u64,
    begun: bool,
}

impl TenantUse {
    fn output(&mut self, tokens: u64) {
        self.generated += tokens;
        self.backend.shared.gate.charge_output(&self.tenant, tokens);
    }
}

impl Drop for TenantUse {
    fn drop(&mut self) {
        let gate = &self.backend.shared.gate;
        let now = self.backend.shared.view.now_ms();
        let used = if self.begun {
            gate.finished(&self.tenant);
            self.prompt_tokens + self.generated
        } else {
            0
        };
        gate.refund(&self.tenant, self.charged.saturating_sub(used), now);
    }
}

#[async_trait::async_trait]
impl Backend for ClusterBackend {
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError> {
        let engine = req.engine.clone();
        let s = &self.shared;
        if s.view.registry().decode.is_empty() {
            return Err(ServeError::unavailable("no decode workers are registered"));
        }
        let now = s.view.now_ms();
        let left = req
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        let admission = Admission::of(&req, now);
        let prompt_tokens = admission.prompt_tokens;
        s.gate.check_limits(&admission, now)?;
        let mut usage = TenantUse {
            backend: self.clone(),
            tenant: admission.tenant.clone(),
            charged: admission.charged,
            prompt_tokens,
            generated: 0,
            begun: false,
        };
        let job = Job {
            seed: HashSeed::for_request(
                req.cache_salt.as_deref().map(str::as_bytes),
                req.adapter.as_deref(),
            ),
            sampling_seed: req.seed.unwrap_or_else(|| s.ids.lock().next_u64()),
            prompt: req.prompt_tokens,
            max_tokens: req.max_tokens,
            temperature: req.temperature,
            ignore_eos: req.ignore_eos,
            cache_salt: req.cache_salt.clone(),
            adapter: req.adapter.clone(),
            top_p: req.top_p,
            top_k: req.top_k,
            min_p: req.min_p,
            logprobs: req.logprobs,
            deadline: tokio::time::Instant::now() + left,
            overrides: req.routing.overrides,
            priority: req.priority,
            expected_output_tokens: req.routing.expected_output_tokens,
            session: req
                .routing
                .session
                .as_deref()
                .map(|id| SessionKey::new(req.tenant.as_deref(), id)),
            kv_from: None,
        };
        let session = match job.session {
            Some(key) => {
                // Waits no longer than the queue would.
                let most = Duration::from_millis(s.cfg.flow.max_wait_ms);
                let until = job.deadline.min(tokio::time::Instant::now() + most);
                s.sessions.acquire(key, until).await?
            }
            None => None,
        };
        let mut excluded = Vec::new();
        let started = self
            .start_job(&job, &mut excluded, Some(&admission))
            .await?;
        s.gate.begin(&admission.tenant);
        usage.begun = true;
        let route = started.route;
        let run = Run {
            backend: self.clone(),
            job,
            decode: started.decode,
            excluded,
            generated: Vec::new(),
            migrations_left: s.cfg.max_migrations,
            pending: Some(started.first),
            rest: started.rest,
            flight: started.flight,
            engine,
            migrated: false,
            text_only: false,
            usage,
            _session: session,
            _call: started.span,
        };
        Ok(Generation {
            route,
            chunks: run.into_stream(),
        })
    }

    fn set_tenants(&self, tenants: Vec<(Arc<str>, TenantLimits)>) {
        self.shared.gate.set_tenants(tenants);
    }

    fn ready(&self) -> bool {
        !self.shared.view.registry().decode.is_empty()
    }

    fn status(&self) -> Option<serde_json::Value> {
        let s = &self.shared;
        serde_json::to_value(super::status::cluster_status(
            &s.view,
            &s.counters.flow.recent,
        ))
        .ok()
    }
}
