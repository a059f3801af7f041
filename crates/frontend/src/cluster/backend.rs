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
use tandem_protocol::{Envelope, ErrorClass, HashSeed, RequestId, SequenceHash, WorkerId};
use tandem_runtime::events::{EventPlane, subjects};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use tonic::transport::Channel;

use super::metrics::RouteCounters;
use super::view::{ClusterView, WorkerEntry};
use crate::http::{
    Backend, EngineReport, FinishReason, Generation, RouteInfo, ServeError, TokenChunk,
    ValidRequest,
};
use tandem_router::{
    InFlight, Input, ReplicaConfig, Rng, RouteError, RouteInput, RouteRequest, RouterId,
    RoutingConfig, SyncMessage,
};

/// Sync messages waiting to be published; beyond it they are dropped (peers expire the
/// entries by TTL).
const SYNC_QUEUE: usize = 4096;

/// How the backend routes.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// How requests are routed: the same type `tandem sim` takes.
    pub routing: RoutingConfig,
    /// This replica's id among the frontends sharing one view.
    pub router_id: RouterId,
    /// Share tracker changes with peer replicas over the event plane.
    pub replica_sync: bool,
    /// Standalone indexer (`tandem indexer`) address; None: the view's embedded index.
    pub indexer_url: Option<String>,
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
            routing: RoutingConfig::default(),
            router_id,
            replica_sync: true,
            indexer_url: None,
            max_attempts: 3,
            max_migrations: 3,
            connect_timeout: Duration::from_secs(2),
            seed: router_id.0,
        }
    }

    /// The routing replica this configuration describes: what [`crate::run_frontend`] routes
    /// with.
    pub fn replica_config(&self) -> ReplicaConfig {
        ReplicaConfig {
            router_id: self.router_id,
            seed: self.seed,
            routing: self.routing,
        }
    }
}

struct Shared {
    view: Arc<ClusterView>,
    counters: Arc<RouteCounters>,
    cfg: BackendConfig,
    /// Request ids and sampling seeds: drawn apart from the replica's generator, so that the
    /// routing decisions draw exactly what the simulator's do.
    ids: Mutex<Rng>,
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

/// A routing decision for one attempt, with the workers' clients.
struct Plan {
    decode: WorkerEntry,
    prefill: Option<WorkerEntry>,
    flight: InFlight,
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
        let shared = Arc::new(Shared {
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
    /// records it in the tracker.
    fn plan(
        &self,
        route: &RouteRequest,
        hashes: &[SequenceHash],
        scores: Option<&OverlapScores>,
        excluded: &[WorkerId],
        max_tokens: u32,
    ) -> Result<Plan, ServeError> {
        let s = &self.shared;
        let request = RequestId(s.ids.lock().next_u64() >> 1);
        let input = RouteInput {
            request,
            route: *route,
            hashes,
            expected_output_tokens: u64::from(max_tokens),
            overlap: scores,
        };
        let now = s.view.now_ms();
        let registry = s.view.registry();
        let plan = s
            .view
            .replica()
            .write()
            .route(&input, excluded, now)
            .map_err(|e| match e {
                RouteError::NoWorkers => {
                    ServeError::unavailable("no decode workers are registered")
                }
                RouteError::AllExcluded => {
                    ServeError::unavailable("every decode worker failed this request")
                }
                e => ServeError::from(e),
            })?;
        for m in plan.sync.iter().cloned() {
            self.sync(m);
        }
        let entry = |id: WorkerId| registry.get(id).cloned();
        let decode = entry(plan.decode_worker());
        let Some(decode) = decode else {
            // Discovery removed it between the replica's decision and here.
            self.end(plan.flight);
            return Err(ServeError::unavailable("the chosen decode worker left"));
        };
        Ok(Plan {
            decode,
            prefill: plan.prefill_worker().and_then(entry),
            flight: plan.flight,
        })
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
    ) -> Result<(tonic::Streaming<GenerateChunk>, GenerateChunk), Status> {
        let greq = GenerateRequest {
            request_id: plan.flight.request().0,
            prompt: job.prompt.clone(),
            sampling: Some(Sampling {
                max_tokens: job.max_tokens,
                seed: job.sampling_seed,
                temperature: job.temperature,
                stop_token: None,
                ignore_eos: job.ignore_eos,
                // 1 is every engine's default: not sent, so the engine's own applies.
                top_p: (job.top_p < 1.0).then_some(job.top_p),
            }),
            hash_seed: job.seed.0,
            remote_prefill: plan.prefill.as_ref().map(|p| RemotePrefillTarget {
                worker_id: p.record.id.0,
                address: p.record.addresses.grpc.clone(),
            }),
            cache_salt: job.cache_salt.clone().unwrap_or_default(),
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
    /// The client's cache salt, passed on for external engines' own salting.
    cache_salt: Option<String>,
    top_p: f32,
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
        let scores = self.remote_matches(&hashes).await;
        let route = RouteRequest::from_tokens(&job.prompt, bs, job.seed);
        let mut last = None;
        for _ in 0..self.shared.cfg.max_attempts.max(1) {
            let plan = self.plan(&route, &hashes, scores.as_ref(), excluded, job.max_tokens)?;
            let mut flight = Flight {
                backend: self.clone(),
                worker: plan.decode.record.id,
                inner: plan.flight,
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
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.backend.end(self.inner);
    }
}

#[async_trait::async_trait]
impl Backend for ClusterBackend {
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError> {
        let engine = req.engine.clone();
        let job = Job {
            seed: HashSeed::from_salt(req.cache_salt.as_deref().map(str::as_bytes)),
            sampling_seed: req
                .seed
                .unwrap_or_else(|| self.shared.ids.lock().next_u64()),
            prompt: req.prompt_tokens,
            max_tokens: req.max_tokens,
            temperature: req.temperature,
            ignore_eos: req.ignore_eos,
            cache_salt: req.cache_salt.clone(),
            top_p: req.top_p,
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
            engine,
            migrated: false,
            text_only: false,
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
    /// Where the edge reads what the engine reported.
    engine: EngineReport,
    migrated: bool,
    /// The engine answers text, not token ids: no migration (nothing to continue from).
    text_only: bool,
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
                    // An engine's text without ids cannot be continued elsewhere.
                    run.text_only |= c.text.is_some();
                    // What the engine counted of the prompt (a continuation's is longer).
                    if !run.migrated {
                        run.engine.set_prompt_tokens(c.prompt_tokens);
                    }
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
        if self.migrations_left == 0 || done >= self.job.max_tokens || self.text_only {
            return Err(ServeError::unavailable(failure));
        }
        self.migrations_left -= 1;
        self.migrated = true;
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
