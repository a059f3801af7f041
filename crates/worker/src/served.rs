//! The one worker lifecycle and the one `tandem.v1.Worker` service, whatever computes the
//! answers: tandem's own engine in this process (the mocker or the native model, behind
//! [`crate::WorkerContext`] and the role crates' request handlers) and an external engine
//! behind the sidecar (`tandem_external::sidecar`) each implement [`ServedEngine`] (what the
//! lifecycle needs: the record, KV events, load, in-flight count, health) and [`WorkerCalls`]
//! (the request side: `Generate`, `Prefill`, `AbortPrefill`). [`serve`] registers the worker,
//! answers its gRPC through [`WorkerService`], publishes a load report every interval, takes
//! the worker out of discovery while its engine fails health probes, and drains it on
//! shutdown, the same way for every engine.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tandem_protocol::grpc::{
    AbortPrefillReply, AbortPrefillRequest, GenerateChunk, GenerateRequest, HealthReply,
    HealthRequest, KvEventsReply, KvEventsRequest, PrefillChunk, PrefillRequest, worker_server,
};
use tandem_protocol::{Envelope, ErrorClass, LoadReport, WorkerId, WorkerRecord, WorkerRole};
use tandem_runtime::discovery::{Discovery, Registration, role_name};
use tandem_runtime::events::{EventPlane, subjects};
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::error::WorkerError;
use crate::trace::{Method, record_request, server_span};

/// A stream of a call's chunks.
pub type ChunkStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// `chunks`, polled inside `span`: the call's server span lasts as long as its stream (an
/// OpenTelemetry span ends at its last exit), and what the stream logs belongs to the call.
fn in_span<T: 'static>(mut chunks: ChunkStream<T>, span: tracing::Span) -> ChunkStream<T> {
    Box::pin(futures::stream::poll_fn(move |cx| {
        let _entered = span.enter();
        chunks.as_mut().poll_next(cx)
    }))
}

/// Whether a worker takes requests: set by the lifecycle, read by the service and the
/// worker's own `/metrics`.
#[derive(Debug, Default)]
pub struct Availability {
    draining: Arc<AtomicBool>,
    down: AtomicBool,
}

impl Availability {
    /// Draining: out of discovery, finishing what it has, refusing new requests.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The draining flag itself, for readers that outlive a borrow (the metrics registry).
    pub fn draining_flag(&self) -> Arc<AtomicBool> {
        self.draining.clone()
    }

    /// Down: the engine failed its health probes (the worker is out of discovery until it
    /// answers again).
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Refuses new work while draining (the frontend routes elsewhere on `Unavailable`) or
    /// while the engine is down.
    pub fn check(&self) -> Result<(), Status> {
        if self.is_draining() {
            return Err(WorkerError::Draining.into());
        }
        self.check_up()
    }

    /// Refuses work only while the engine is down: what a draining worker still serves (a
    /// decode worker's `Prefill`, which hands its streams' KV over).
    pub fn check_up(&self) -> Result<(), Status> {
        if self.is_down() {
            return Err(ErrorClass::Unavailable.status("the engine behind this worker is down"));
        }
        Ok(())
    }
}

/// What the lifecycle needs of a worker's engine.
#[tonic::async_trait]
pub trait ServedEngine: Send + Sync + 'static {
    fn worker_id(&self) -> WorkerId;
    fn role(&self) -> WorkerRole;
    fn availability(&self) -> &Availability;
    /// The record registered in discovery: gRPC on `grpc`, metrics on `metrics` if served.
    fn record(&self, grpc: SocketAddr, metrics: Option<SocketAddr>) -> WorkerRecord;
    /// `KvEvents`: a range of the engine's events, or a dump of what it holds.
    fn kv_events(&self, req: KvEventsRequest) -> Result<KvEventsReply, Status>;
    /// The report published every load interval.
    async fn load_report(&self) -> LoadReport;
    /// Requests in flight here.
    fn in_flight(&self) -> u64;
    /// Waits until nothing is in flight or `timeout` passed; true when idle.
    async fn wait_idle(&self, timeout: Duration) -> bool;

    /// The worker has drained and stops: what the engine keeps across a restart is put away
    /// (the native engine's cache onto its disk tier). Nothing, for an external engine.
    fn stopping(&self) {}
    /// Serves the worker's own `GET /metrics` on `tasks` until `stop`, when it has one;
    /// returns where.
    async fn serve_metrics(
        &self,
        _tasks: &TaskTracker,
        _stop: CancellationToken,
    ) -> Result<Option<SocketAddr>, WorkerError> {
        Ok(None)
    }
    /// One health probe of what computes the answers (only asked when [`Lifecycle::health`]
    /// is set: an engine in this process is as alive as the worker).
    async fn probe(&self, _timeout: Duration) -> Result<(), String> {
        Ok(())
    }
    /// The engine was taken out for failed probes: what it held is gone (a restarted engine
    /// starts empty).
    fn on_down(&self) {}
}

/// The request side of a worker: its answers to `Generate`, `Prefill` and `AbortPrefill`,
/// each run under the call's server span. A role that does not serve a call keeps the
/// default, which says where to send it.
#[tonic::async_trait]
pub trait WorkerCalls: Send + Sync + 'static {
    /// The engine behind the calls.
    fn engine(&self) -> &dyn ServedEngine;

    async fn generate(
        &self,
        _req: GenerateRequest,
        _span: tracing::Span,
    ) -> Result<ChunkStream<GenerateChunk>, Status> {
        Err(Status::unimplemented(
            "a prefill worker does not decode: send Generate to a decode worker",
        ))
    }

    async fn prefill(
        &self,
        _req: PrefillRequest,
        _span: tracing::Span,
    ) -> Result<ChunkStream<PrefillChunk>, Status> {
        Err(Status::unimplemented(
            "a decode worker does not serve remote prefills: send Prefill to a prefill worker",
        ))
    }

    async fn abort_prefill(&self, _req: AbortPrefillRequest) -> Result<AbortPrefillReply, Status> {
        Err(Status::unimplemented(
            "a decode worker runs no remote prefills: send AbortPrefill to a prefill worker",
        ))
    }

    /// The worker starts to drain (it is out of discovery and refuses new `Generate`s); it
    /// stops once nothing is in flight or the drain timeout passes.
    fn on_drain(&self) {}
}

/// The `tandem.v1.Worker` gRPC service of any [`WorkerCalls`]: server spans, the
/// availability check, `KvEvents` and `Health` here; the rest in the calls.
#[derive(Debug)]
pub struct WorkerService<C> {
    calls: Arc<C>,
}

impl<C> Clone for WorkerService<C> {
    fn clone(&self) -> Self {
        WorkerService {
            calls: self.calls.clone(),
        }
    }
}

impl<C: WorkerCalls> WorkerService<C> {
    pub fn new(calls: Arc<C>) -> Self {
        WorkerService { calls }
    }
}

#[tonic::async_trait]
impl<C: WorkerCalls> worker_server::Worker for WorkerService<C> {
    type GenerateStream = ChunkStream<GenerateChunk>;
    type PrefillStream = ChunkStream<PrefillChunk>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = server_span(Method::Generate, request.metadata());
        let req = request.into_inner();
        record_request(&span, req.request_id, req.prompt.len());
        self.calls.engine().availability().check()?;
        let chunks = self
            .calls
            .generate(req, span.clone())
            .instrument(span.clone())
            .await?;
        Ok(Response::new(in_span(chunks, span)))
    }

    async fn prefill(
        &self,
        request: Request<PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let span = server_span(Method::Prefill, request.metadata());
        let req = request.into_inner();
        record_request(&span, req.request_id, req.prompt.len());
        let engine = self.calls.engine();
        if engine.role() == WorkerRole::Prefill {
            engine.availability().check()?;
        } else {
            // A decode worker's `Prefill` moves a stream's KV away: draining is when.
            engine.availability().check_up()?;
        }
        let chunks = self
            .calls
            .prefill(req, span.clone())
            .instrument(span.clone())
            .await?;
        Ok(Response::new(in_span(chunks, span)))
    }

    async fn abort_prefill(
        &self,
        request: Request<AbortPrefillRequest>,
    ) -> Result<Response<AbortPrefillReply>, Status> {
        // Answered while draining too: a decode worker fences its blocks on the answer.
        self.calls
            .abort_prefill(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn kv_events(
        &self,
        request: Request<KvEventsRequest>,
    ) -> Result<Response<KvEventsReply>, Status> {
        self.calls
            .engine()
            .kv_events(request.into_inner())
            .map(Response::new)
    }

    async fn health(
        &self,
        _request: Request<HealthRequest>,
    ) -> Result<Response<HealthReply>, Status> {
        let engine = self.calls.engine();
        let a = engine.availability();
        Ok(Response::new(HealthReply {
            worker_id: engine.worker_id().0,
            role: role_name(engine.role()).to_string(),
            serving: !a.is_draining() && !a.is_down(),
            draining: a.is_draining(),
        }))
    }
}

/// How a worker is run.
#[derive(Clone, Debug)]
pub struct Lifecycle {
    /// Discovery and event-plane namespace.
    pub namespace: String,
    pub load_interval: Duration,
    /// How long a draining worker waits for in-flight requests before it stops anyway.
    pub drain_timeout: Duration,
    /// Probe the engine every interval; out of discovery after this many misses in a row,
    /// back in when it answers again. None: never probed.
    pub health: Option<HealthProbe>,
}

#[derive(Clone, Copy, Debug)]
pub struct HealthProbe {
    pub interval: Duration,
    pub failures: u32,
}

/// Serves `calls` on `listener`, registered in discovery, until `shutdown`; then drains:
/// deregisters, refuses new requests, tells the calls ([`WorkerCalls::on_drain`]: a decode
/// worker offers its streams' KV), lets in-flight ones finish (up to the drain timeout) and
/// stops serving. Its own tasks (load reports, `/metrics`) run on `tasks` until `stop`;
/// the caller cancels `stop` and waits for `tasks` after this returns.
#[allow(clippy::too_many_arguments)]
pub async fn serve<C: WorkerCalls>(
    calls: Arc<C>,
    lifecycle: Lifecycle,
    listener: TcpListener,
    discovery: Arc<dyn Discovery>,
    events: Arc<dyn EventPlane>,
    shutdown: Shutdown,
    tasks: &TaskTracker,
    stop: CancellationToken,
) -> Result<(), WorkerError> {
    let engine = calls.engine();
    let addr = listener
        .local_addr()
        .map_err(|e| WorkerError::Internal(format!("listener address: {e}")))?;
    // Metrics stay up while the worker drains (the drain is worth watching).
    let metrics = engine.serve_metrics(tasks, stop.clone()).await?;
    let record = engine.record(addr, metrics);
    let server_stop = stop.child_token();
    let worker = Arc::new(WorkerService::new(calls.clone()));
    let service = worker_server::WorkerServer::from_arc(worker.clone());
    // A frontend in this process (`--backend-url`, `tandem up`) calls the service directly,
    // and its `Generate` without encoding.
    let _local = tandem_runtime::grpc::register_local(
        &record.addresses.grpc,
        service.clone(),
        server_stop.clone(),
    )
    .with_direct(worker);
    let router = tonic::transport::Server::builder().add_service(service);
    let server = tokio::spawn(tandem_runtime::grpc::serve_tonic(
        router,
        listener,
        server_stop.clone(),
    ));
    tasks.spawn(report_load(
        calls.clone(),
        events,
        subjects::load_reports(&lifecycle.namespace),
        lifecycle.load_interval,
        stop.clone(),
    ));
    let mut registration = match discovery.register(record.clone()).await {
        Ok(r) => Some(r),
        Err(e) => {
            server_stop.cancel();
            return Err(e.into());
        }
    };
    tracing::info!(
        worker = engine.worker_id().0,
        role = role_name(engine.role()),
        %addr,
        "worker serving"
    );
    match lifecycle.health {
        Some(probe) => {
            watch_health(
                engine,
                probe,
                &mut registration,
                &discovery,
                &record,
                &shutdown,
            )
            .await;
        }
        None => shutdown.draining().await,
    }

    tracing::info!(in_flight = engine.in_flight(), "draining");
    engine
        .availability()
        .draining
        .store(true, Ordering::Release);
    if let Some(r) = registration.take() {
        r.deregister().await;
    }
    calls.on_drain();
    let drained = tokio::select! {
        idle = engine.wait_idle(lifecycle.drain_timeout) => idle,
        () = shutdown.stopped() => false,
    };
    if !drained {
        tracing::warn!(
            in_flight = engine.in_flight(),
            "drain timeout: stopping with requests in flight"
        );
    }
    engine.stopping();
    server_stop.cancel();
    match server.await {
        Ok(r) => r.map_err(WorkerError::from),
        Err(e) => Err(WorkerError::Internal(format!("server task: {e}"))),
    }
}

/// Probes the engine until `shutdown` drains: out of discovery after `probe.failures` misses
/// in a row, back in when it answers again.
async fn watch_health(
    engine: &dyn ServedEngine,
    probe: HealthProbe,
    registration: &mut Option<Registration>,
    discovery: &Arc<dyn Discovery>,
    record: &WorkerRecord,
    shutdown: &Shutdown,
) {
    let down = &engine.availability().down;
    let mut tick = tokio::time::interval(probe.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut misses = 0u32;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = shutdown.draining() => return,
        }
        let timeout = probe.interval.max(Duration::from_millis(200));
        match engine.probe(timeout).await {
            Ok(()) => {
                misses = 0;
                if down.swap(false, Ordering::AcqRel) {
                    tracing::info!("engine answers again: registering");
                    match discovery.register(record.clone()).await {
                        Ok(r) => *registration = Some(r),
                        Err(e) => {
                            tracing::warn!(error = %e, "re-registering failed; retrying");
                            down.store(true, Ordering::Release);
                        }
                    }
                }
            }
            Err(e) => {
                misses += 1;
                if misses >= probe.failures && !down.swap(true, Ordering::AcqRel) {
                    tracing::warn!(error = %e, misses, "engine down: leaving discovery");
                    if let Some(r) = registration.take() {
                        r.deregister().await;
                    }
                    engine.on_down();
                }
            }
        }
    }
}

/// Publishes the engine's load report every `interval` until `stop` (none while it is down:
/// it is out of discovery).
async fn report_load<C: WorkerCalls>(
    calls: Arc<C>,
    events: Arc<dyn EventPlane>,
    subject: String,
    interval: Duration,
    stop: CancellationToken,
) {
    let engine = calls.engine();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        if engine.availability().is_down() {
            continue;
        }
        let report = engine.load_report().await;
        match report.encode() {
            Ok(bytes) => {
                if let Err(e) = events.publish(&subject, Bytes::from(bytes)).await {
                    tracing::debug!(error = %e, "publishing a load report failed");
                }
            }
            Err(e) => tracing::error!(error = %e, "encoding a load report failed"),
        }
    }
}
