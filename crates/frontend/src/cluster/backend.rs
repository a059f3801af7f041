//! [`ClusterBackend`]: the HTTP edge's [`Backend`] over real workers.
//!
//! Per request: hash the prompt's full blocks under its cache salt, find each worker's
//! cached prefix (embedded index or a standalone indexer), gather candidate views (overlap,
//! the tracker's load merged with the latest load report, warm-up), decide — the policy over
//! the decode pool, or conditional disaggregation when a prefill pool exists — record the
//! request in the active-sequence tracker (shared with peer replicas over the event plane),
//! and call the decode worker's `Generate`, naming the prefill worker when prefill is
//! remote.
//!
//! Failures before the first token are retried on another decode worker (the frontend's is
//! the one retry layer, DESIGN.md §10), up to `max_attempts`. A failure after the first token
//! migrates the request (DESIGN.md §1): prompt + tokens generated so far go to another decode
//! worker for the rest of the token budget, up to `max_migrations` times; beyond that the
//! stream ends with an error item and the edge closes the response cleanly.
//!
//! The tracker entry of a request lives in a guard owned by its output stream: the prefill
//! load leaves at the first token, everything leaves when the stream ends or is dropped.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream;
use parking_lot::Mutex;
use tandem_indexer::OverlapScores;
use tandem_protocol::grpc::{
    self, FindMatchesRequest, GenerateChunk, GenerateRequest, RemotePrefillTarget, Sampling,
    indexer_client::IndexerClient,
};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{Envelope, HashSeed, MessageKind, RequestId, SequenceHash, WorkerId};
use tandem_runtime::events::{EventPlane, subjects};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::metrics::RouteCounters;
use super::view::{ClusterView, WorkerEntry};
use crate::http::{
    Backend, FinishReason, Generation, RouteInfo, ServeError, TokenChunk, ValidRequest,
};
use crate::{
    ActiveSequences, DisaggConfig, NewSequence, Rng, RouteRequest, Router, RouterConfig, RouterId,
    SyncMessage, TrackerConfig, WorkerLoad, WorkerView, disagg,
};

/// Tracker ids of a request's prefill part: the request id with the top bit flipped.
const PREFILL_BIT: u64 = 1 << 63;
/// Sync messages waiting to be published; beyond it they are dropped (peers expire the
/// entries by TTL).
const SYNC_QUEUE: usize = 4096;

impl Envelope for SyncMessage {
    const KIND: MessageKind = MessageKind::RouterSync;
}

/// How the backend routes.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// The policy over the decode pool when there is no prefill pool.
    pub router: RouterConfig,
    /// Conditional disaggregation, when a prefill pool exists.
    pub disagg: DisaggConfig,
    pub tracker: TrackerConfig,
    /// This replica's id among the frontends sharing one view.
    pub router_id: RouterId,
    /// Share tracker changes with peer replicas over the event plane.
    pub replica_sync: bool,
    /// Standalone indexer (`tandem indexer`) address; None: the view's embedded index.
    pub indexer_url: Option<String>,
    /// Fold the workers' load reports into the tracker's load (the larger of the two on each
    /// count). Off by default: the tracker (with replica sync) knows every request routed,
    /// while a report lags by up to its interval — a report taken while a request was still
    /// running makes the worker that just cached its prefix look busy, and the next request
    /// with that prefix goes elsewhere. Turn it on for frontend replicas that do not sync.
    /// The KV usage (for the busy threshold) always comes from the reports.
    pub merge_load_reports: bool,
    /// Decode workers tried per request before giving up.
    pub max_attempts: u32,
    /// Times a request may move to another decode worker after its first token, when its
    /// worker fails mid-stream.
    pub max_migrations: u32,
    pub connect_timeout: Duration,
    pub seed: u64,
}

impl BackendConfig {
    pub fn new(router_id: RouterId) -> Self {
        BackendConfig {
            router: RouterConfig::default(),
            disagg: DisaggConfig::default(),
            tracker: TrackerConfig::default(),
            router_id,
            replica_sync: true,
            indexer_url: None,
            merge_load_reports: false,
            max_attempts: 3,
            max_migrations: 3,
            connect_timeout: Duration::from_secs(2),
            seed: router_id.0,
        }
    }
}

struct RouteState {
    router: Router,
    tracker: ActiveSequences,
    rng: Rng,
}

struct Shared {
    view: Arc<ClusterView>,
    counters: Arc<RouteCounters>,
    cfg: BackendConfig,
    state: Mutex<RouteState>,
    indexer: Option<IndexerClient<Channel>>,
    sync_tx: Option<mpsc::Sender<SyncMessage>>,
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

/// A routing decision for one attempt.
struct Plan {
    decode: WorkerEntry,
    prefill: Option<WorkerEntry>,
    request: RequestId,
}

impl ClusterBackend {
    /// Builds the backend on `view`; with replica sync, publishes this replica's tracker
    /// changes and applies its peers'.
    pub async fn start(
        cfg: BackendConfig,
        view: Arc<ClusterView>,
        counters: Arc<RouteCounters>,
        events: Arc<dyn EventPlane>,
        tasks: &TaskTracker,
        cancel: CancellationToken,
    ) -> Result<Self, ServeError> {
        cfg.disagg
            .validate()
            .map_err(|e| ServeError::internal(format!("disaggregation config: {e}")))?;
        let router = Router::new(cfg.router)
            .map_err(|e| ServeError::internal(format!("router config: {e}")))?;
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
        let shared = Arc::new(Shared {
            view,
            counters,
            state: Mutex::new(RouteState {
                router,
                tracker: ActiveSequences::new(cfg.router_id, cfg.tracker),
                rng: Rng::seed_from_u64(cfg.seed),
            }),
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
                        s.state.lock().tracker.apply(&msg, now);
                    }
                }
            });
        }
        let (s, c) = (shared.clone(), cancel);
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let now = s.view.now_ms();
                        s.state.lock().tracker.expire(now);
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

    async fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        let Some(client) = &self.shared.indexer else {
            return self.shared.view.find_matches(hashes);
        };
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
                OverlapScores { scores }
            }
            Err(status) => {
                // Routing on load alone beats refusing the request.
                tracing::warn!(%status, "indexer unavailable: routing without overlap");
                OverlapScores::default()
            }
        }
    }

    /// Decides where the request goes (excluding workers that already failed it) and
    /// records it in the tracker.
    fn plan(
        &self,
        route: &RouteRequest,
        hashes: &[SequenceHash],
        scores: &OverlapScores,
        excluded: &[WorkerId],
        max_tokens: u32,
    ) -> Result<Plan, ServeError> {
        let s = &self.shared;
        let now = s.view.now_ms();
        let registry = s.view.registry();
        let mut st = s.state.lock();
        let views = |pool: &std::collections::BTreeMap<WorkerId, WorkerEntry>, st: &RouteState| {
            let cfg = st.router.pool_config();
            pool.values()
                .filter(|e| !excluded.contains(&e.record.id))
                .map(|e| {
                    let id = e.record.id;
                    let mut load: WorkerLoad = st.tracker.load(id).to_worker_load();
                    if let Some(r) = s.view.report(id) {
                        if s.cfg.merge_load_reports {
                            load.merge_report(&r);
                        } else {
                            load.kv_usage = r.kv_usage();
                        }
                    }
                    let mut v = WorkerView::new(id, load);
                    v.overlap = scores.get(id).unwrap_or_default();
                    v.warming_up = cfg.is_warming_up(e.joined_ms, now);
                    v
                })
                .collect::<Vec<_>>()
        };
        let decode_views = views(&registry.decode, &st);
        if decode_views.is_empty() {
            return Err(ServeError::unavailable(if registry.decode.is_empty() {
                "no decode workers are registered"
            } else {
                "every decode worker failed this request"
            }));
        }
        let prefill_views = views(&registry.prefill, &st);
        let st = &mut *st;
        let (decode, prefill) = if prefill_views.is_empty() {
            let d = st.router.select(route, &decode_views, &mut st.rng)?;
            (d, None)
        } else {
            let d = disagg::decide(
                &s.cfg.disagg,
                route,
                &decode_views,
                &prefill_views,
                &mut st.rng,
            )?;
            (d.decode, d.prefill)
        };
        let request = RequestId(st.rng.next_u64() & !PREFILL_BIT);
        let bs = u64::from(route.block_size.get());
        let overlap =
            |d: &crate::Decision| d.chosen_terms().map_or(0, |t| u64::from(t.overlap.total()));
        let mut msgs = vec![st.tracker.add(
            NewSequence {
                request,
                worker: decode.worker,
                blocks: hashes.to_vec(),
                prefill_tokens: if prefill.is_some() {
                    0
                } else {
                    route.prompt_tokens.saturating_sub(overlap(&decode) * bs)
                },
                private_blocks: NewSequence::private_blocks_for(
                    route.prompt_tokens,
                    u64::from(max_tokens),
                    route.block_size,
                ),
            },
            now,
        )];
        if let Some(p) = &prefill {
            msgs.push(st.tracker.add(
                NewSequence {
                    request: RequestId(request.0 | PREFILL_BIT),
                    worker: p.worker,
                    blocks: hashes.to_vec(),
                    prefill_tokens: route.prompt_tokens.saturating_sub(overlap(p) * bs),
                    private_blocks: 1,
                },
                now,
            ));
        }
        for m in msgs {
            self.sync(m);
        }
        let entry = |id: WorkerId| registry.get(id).cloned();
        let plan = Plan {
            decode: entry(decode.worker)
                .ok_or_else(|| ServeError::internal("the chosen worker vanished"))?,
            prefill: prefill.and_then(|p| entry(p.worker)),
            request,
        };
        Ok(plan)
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
    ) -> Result<(tonic::Streaming<GenerateChunk>, GenerateChunk), Status> {
        let greq = GenerateRequest {
            request_id: plan.request.0,
            prompt: job.prompt.clone(),
            sampling: Some(Sampling {
                max_tokens: job.max_tokens,
                seed: job.sampling_seed,
                temperature: job.temperature,
                stop_token: None,
                ignore_eos: job.ignore_eos,
            }),
            hash_seed: job.seed.0,
            remote_prefill: plan.prefill.as_ref().map(|p| RemotePrefillTarget {
                worker_id: p.record.id.0,
                address: p.record.addresses.grpc.clone(),
            }),
        };
        let mut client = plan.decode.client.clone();
        let mut stream = client.generate(greq).await?.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::unavailable("the worker ended the stream before a token"))?;
        Ok((stream, first))
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
}

/// A request started on a decode worker, its first chunk in hand.
struct Started {
    route: RouteInfo,
    first: GenerateChunk,
    rest: tonic::Streaming<GenerateChunk>,
    flight: Flight,
}

impl ClusterBackend {
    /// Routes `job` and starts it, re-routing (to a worker not in `excluded`) when a decode
    /// worker fails before the first token, up to `max_attempts`; failed workers are added
    /// to `excluded`.
    async fn start_job(
        &self,
        job: &Job,
        excluded: &mut Vec<WorkerId>,
    ) -> Result<Started, ServeError> {
        let bs = self.shared.view.config().block_size;
        let hashes: Vec<SequenceHash> = compute_block_hashes(&job.prompt, bs, job.seed)
            .iter()
            .map(|h| h.sequence)
            .collect();
        let scores = self.find_matches(&hashes).await;
        let route = RouteRequest::from_tokens(&job.prompt, bs, job.seed);
        let mut last = None;
        for _ in 0..self.shared.cfg.max_attempts.max(1) {
            let plan = self.plan(&route, &hashes, &scores, excluded, job.max_tokens)?;
            let mut flight = Flight {
                backend: self.clone(),
                request: plan.request,
                worker: plan.decode.record.id,
                remote: plan.prefill.is_some(),
                prefill_done: false,
            };
            match self.attempt(&plan, job).await {
                Ok((rest, first)) => {
                    flight.first_token();
                    self.shared.counters.prefill(first.prefill);
                    let route = RouteInfo {
                        decode_worker: plan.decode.record.id.0,
                        prefill_worker: plan.prefill.as_ref().map(|p| p.record.id.0),
                    };
                    return Ok(Started {
                        route,
                        first,
                        rest,
                        flight,
                    });
                }
                Err(status) if retryable(&status) => {
                    tracing::warn!(
                        worker = plan.decode.record.id.0,
                        %status,
                        "decode worker failed before the first token: re-routing"
                    );
                    excluded.push(plan.decode.record.id);
                    self.shared.counters.reroute();
                    last = Some(status);
                }
                Err(status) => return Err(status_to_error(&status)),
            }
        }
        Err(last.as_ref().map_or_else(
            || ServeError::unavailable("no decode worker could serve the request"),
            status_to_error,
        ))
    }
}

/// Whether another decode worker may succeed where this one failed (before any token).
fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::Unknown
            | Code::Aborted
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Internal
    )
}

fn status_to_error(status: &Status) -> ServeError {
    match status.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::AlreadyExists => {
            ServeError::invalid(status.message().to_string())
        }
        Code::ResourceExhausted => {
            ServeError::overloaded(status.message().to_string(), Duration::from_secs(1))
        }
        _ => ServeError::unavailable(format!("worker failed: {}", status.message())),
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
    }
}

/// A request's place in the tracker, released when its stream ends or is dropped.
struct Flight {
    backend: ClusterBackend,
    request: RequestId,
    worker: WorkerId,
    remote: bool,
    prefill_done: bool,
}

impl Flight {
    fn first_token(&mut self) {
        if self.prefill_done {
            return;
        }
        self.prefill_done = true;
        let s = &self.backend.shared;
        let now = s.view.now_ms();
        let mut msgs = Vec::with_capacity(2);
        {
            let mut st = s.state.lock();
            msgs.push(st.tracker.prefill_done(self.request, now));
            if self.remote {
                msgs.push(
                    st.tracker
                        .free(RequestId(self.request.0 | PREFILL_BIT), now),
                );
            }
        }
        for m in msgs {
            self.backend.sync(m);
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let s = &self.backend.shared;
        let now = s.view.now_ms();
        let mut msgs = Vec::with_capacity(2);
        {
            let mut st = s.state.lock();
            msgs.push(st.tracker.free(self.request, now));
            if self.remote && !self.prefill_done {
                msgs.push(
                    st.tracker
                        .free(RequestId(self.request.0 | PREFILL_BIT), now),
                );
            }
        }
        for m in msgs {
            self.backend.sync(m);
        }
    }
}

#[async_trait::async_trait]
impl Backend for ClusterBackend {
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError> {
        let job = Job {
            seed: HashSeed::from_salt(req.cache_salt.as_deref().map(str::as_bytes)),
            sampling_seed: req
                .seed
                .unwrap_or_else(|| self.shared.state.lock().rng.next_u64()),
            prompt: req.prompt_tokens,
            max_tokens: req.max_tokens,
            temperature: req.temperature,
            ignore_eos: req.ignore_eos,
        };
        let mut excluded = Vec::new();
        let started = self.start_job(&job, &mut excluded).await?;
        let route = started.route;
        let run = Run {
            backend: self.clone(),
            job,
            excluded,
            generated: Vec::new(),
            migrations_left: self.shared.cfg.max_migrations,
            pending: Some(started.first),
            rest: started.rest,
            flight: started.flight,
        };
        Ok(Generation {
            route,
            chunks: run.into_stream(),
        })
    }

    fn ready(&self) -> bool {
        !self.shared.view.registry().decode.is_empty()
    }
}

/// A request's output as it streams: the current decode worker's stream and tracker entry,
/// and what is needed to migrate it when that worker fails mid-stream.
struct Run {
    backend: ClusterBackend,
    job: Job,
    excluded: Vec<WorkerId>,
    /// Tokens streamed so far (the prompt of a continuation).
    generated: Vec<u32>,
    migrations_left: u32,
    /// The first chunk of the current worker, not yet yielded.
    pending: Option<GenerateChunk>,
    rest: tonic::Streaming<GenerateChunk>,
    flight: Flight,
}

impl Run {
    /// Chunks up to the one with a finish reason; the run (and its tracker entry) lives as
    /// long as the stream.
    fn into_stream(self) -> futures::stream::BoxStream<'static, Result<TokenChunk, ServeError>> {
        stream::unfold(Some(self), |run| async move {
            let mut run = run?;
            match run.next_chunk().await {
                Ok(c) => {
                    let last = c.finish != grpc::FinishReason::Unspecified as i32;
                    run.generated.extend_from_slice(&c.tokens);
                    Some((Ok(token_chunk(&c)), (!last).then_some(run)))
                }
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed()
    }

    async fn next_chunk(&mut self) -> Result<GenerateChunk, ServeError> {
        loop {
            if let Some(c) = self.pending.take() {
                return Ok(c);
            }
            let failure = match self.rest.message().await {
                Ok(Some(c)) => return Ok(c),
                Ok(None) => "the decode worker ended the stream early".to_string(),
                Err(status) => format!("the decode worker failed mid-stream: {}", status.message()),
            };
            self.migrate(failure).await?;
        }
    }

    /// Continues the request on another decode worker: prompt + the tokens generated so
    /// far, for the rest of the token budget.
    async fn migrate(&mut self, failure: String) -> Result<(), ServeError> {
        let done = self.generated.len() as u32;
        if self.migrations_left == 0 || done >= self.job.max_tokens {
            return Err(ServeError::unavailable(failure));
        }
        self.migrations_left -= 1;
        self.backend.shared.counters.migration();
        self.excluded.push(self.flight.worker);
        tracing::warn!(
            worker = self.flight.worker.0,
            generated = done,
            %failure,
            "migrating the request to another decode worker"
        );
        let mut job = self.job.clone();
        job.prompt.extend_from_slice(&self.generated);
        job.max_tokens -= done;
        let started = self
            .backend
            .start_job(&job, &mut self.excluded)
            .await
            .map_err(|e| {
                ServeError::unavailable(format!("{failure}; migration failed: {}", e.message()))
            })?;
        self.pending = Some(started.first);
        self.rest = started.rest;
        self.flight = started.flight;
        Ok(())
    }
}
