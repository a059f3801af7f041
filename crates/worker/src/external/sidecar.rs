//! A worker that fronts an external engine (vLLM, SGLang, or an OpenAI-compatible server with
//! vLLM's token-id extension): the sidecar.
//!
//! It registers the engine in discovery (role, model, block size and KV capacity read from the
//! engine where it exposes them, else from flags), serves tandem's `Worker` gRPC to the
//! frontend, relays the engine's ZMQ KV events onto the event plane as tandem events
//! ([`super::events`]), and reports load from the engine's Prometheus endpoint merged with its
//! own count of requests in flight. The frontend cannot tell it from a mocker worker.
//!
//! Health: the engine's `/health` is polled; after `health_failures` misses in a row the
//! sidecar deregisters (the index purges the worker's blocks, the frontend stops routing to
//! it) and clears its relayed cache state, since an engine that comes back has restarted
//! empty. Its streams in flight fail with `Unavailable`, so the frontend migrates them. When
//! the engine answers again, the sidecar registers again and the index dumps it afresh.
//!
//! Disaggregation with real engines goes through their own connectors: a prefill sidecar runs
//! the prompt with vLLM's `kv_transfer_params: {do_remote_decode: true}` and `max_tokens: 1`
//! and hands the engine's answer (`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`,
//! `remote_host`, `remote_port`) back in `PrefillDone.kv_transfer_params`; the decode sidecar
//! passes it into its own engine's request, whose connector pulls the KV. A failed remote
//! prefill becomes a local one on the decode engine.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tandem_protocol::grpc::{
    self, AbortPrefillReply, AbortPrefillRequest, GenerateChunk, GenerateRequest, HealthReply,
    HealthRequest, KvEventsReply, KvEventsRequest, PrefillChunk, PrefillDone, PrefillOutcome,
    PrefillRequest, worker_server,
};
use tandem_protocol::{
    BlockSize, Envelope, ErrorClass, HashSeed, LoadReport, TierCapacity, TokenBlockHasher,
    WorkerAddresses, WorkerId, WorkerRecord, WorkerRole,
};
use tandem_runtime::discovery::{Discovery, Registration, role_name};
use tandem_runtime::events::{EventPlane, subjects};
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status};

use super::engine::{EngineApi, EngineError, EngineFinish, EngineGenerate, EngineKind};
use super::events::{KvRelay, RelayConfig};
use super::prom;
use crate::error::WorkerError;

/// A sidecar's settings (the binary fills them from flags).
#[derive(Clone, Debug)]
pub struct SidecarConfig {
    pub worker_id: WorkerId,
    pub role: WorkerRole,
    /// Served model name, registered in discovery.
    pub model: String,
    /// The model name the engine serves (its `--served-model-name`); defaults to `model`.
    pub engine_model: Option<String>,
    pub namespace: String,
    /// Host other processes reach this sidecar at (the listener's port is appended).
    pub advertise_host: String,
    pub engine: EngineKind,
    /// The engine's HTTP API, `http://host:port`.
    pub engine_url: String,
    /// The engine's ZMQ KV event publisher (`tcp://host:5557`); None: no KV events (the
    /// frontend then knows nothing of this engine's cache).
    pub kv_events: Option<String>,
    /// The engine's ZMQ replay socket; None: a gap is repaired by a clear.
    pub kv_replay: Option<String>,
    /// The ZMQ topic the engine publishes on (vLLM's `KVEventsConfig.topic`, "" by default).
    pub kv_topic: String,
    /// Block size when the engine does not say (vLLM says in `vllm:cache_config_info`); the
    /// engine's wins when both are known.
    pub block_size: Option<u32>,
    /// KV capacity when the engine does not say.
    pub device_blocks: Option<u64>,
    pub host_blocks: Option<u64>,
    /// SGLang run with `--incremental-streaming-output`.
    pub incremental_output: bool,
    pub load_interval: Duration,
    pub health_interval: Duration,
    /// Consecutive failed health checks before the engine's worker leaves discovery.
    pub health_failures: u32,
    /// How long the sidecar waits at start for the engine to answer `/health`.
    pub startup_timeout: Duration,
    pub drain_timeout: Duration,
    /// Decode: how long a remote prefill may take before the engine prefills locally.
    pub prefill_timeout: Duration,
    /// Replayed or relayed events kept for `KvEvents` range requests.
    pub event_ring: usize,
    /// SGLang prefill engines: where decode engines reach the engine's bootstrap server
    /// (`--disaggregation-bootstrap-port`); default: the engine URL's host and the port the
    /// engine reports in `/get_server_info`.
    pub bootstrap_host: Option<String>,
    pub bootstrap_port: Option<u16>,
}

impl SidecarConfig {
    pub fn new(worker_id: WorkerId, role: WorkerRole, engine: EngineKind, url: &str) -> Self {
        SidecarConfig {
            worker_id,
            role,
            model: "model".into(),
            engine_model: None,
            namespace: "default".into(),
            advertise_host: "127.0.0.1".into(),
            engine,
            engine_url: url.into(),
            kv_events: None,
            kv_replay: None,
            kv_topic: String::new(),
            block_size: None,
            device_blocks: None,
            host_blocks: None,
            incremental_output: false,
            load_interval: Duration::from_millis(500),
            health_interval: Duration::from_secs(1),
            health_failures: 3,
            startup_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(30),
            prefill_timeout: Duration::from_secs(30),
            event_ring: 65_536,
            bootstrap_host: None,
            bootstrap_port: None,
        }
    }
}

/// Counters of a sidecar.
#[derive(Debug, Default)]
pub struct SidecarStats {
    pub requests: AtomicU64,
    pub engine_errors: AtomicU64,
    pub remote_prefills: AtomicU64,
    pub remote_prefill_fallbacks: AtomicU64,
    /// Times the engine was taken out for failed health checks.
    pub engine_outages: AtomicU64,
}

/// What the sidecar learned of its engine at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineShape {
    pub block_size: BlockSize,
    pub device_blocks: u64,
    pub host_blocks: u64,
    /// SGLang's bootstrap port, as its server info says.
    pub bootstrap_port: Option<u16>,
}

struct Inner {
    config: SidecarConfig,
    api: EngineApi,
    shape: EngineShape,
    relay: Option<KvRelay>,
    stats: SidecarStats,
    draining: AtomicBool,
    /// Set while the engine fails its health checks.
    down: AtomicBool,
    /// Requests in flight here, and their prompt tokens not yet past their first token.
    in_flight: AtomicU64,
    pending_prefill_tokens: AtomicU64,
    idle: tokio::sync::Notify,
    started: Instant,
    prefill_clients: parking_lot::Mutex<
        hashbrown::HashMap<String, grpc::worker_client::WorkerClient<tonic::transport::Channel>>,
    >,
    /// Prefill requests running on the engine after their handshake was answered (SGLang).
    tasks: TaskTracker,
}

/// The sidecar's shared state and its `Worker` service. Cheap to clone.
#[derive(Clone)]
pub struct Sidecar {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Sidecar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sidecar")
            .field("worker_id", &self.inner.config.worker_id)
            .field("engine", &self.inner.config.engine)
            .field("shape", &self.inner.shape)
            .finish_non_exhaustive()
    }
}

/// Runs a sidecar on `listener` until `shutdown`, then drains.
pub async fn run(
    config: SidecarConfig,
    listener: TcpListener,
    discovery: Arc<dyn Discovery>,
    events: Arc<dyn EventPlane>,
    shutdown: Shutdown,
) -> Result<(), WorkerError> {
    let tasks = TaskTracker::new();
    let stop = shutdown.stop_token().child_token();
    let sidecar = Sidecar::start(config, events.clone(), &tasks, stop.clone(), &shutdown).await?;
    let result = sidecar
        .clone()
        .serve(listener, discovery, events, shutdown, &tasks, stop.clone())
        .await;
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    result
}

impl Sidecar {
    /// Waits for the engine, reads its shape, and starts the KV relay.
    pub async fn start(
        config: SidecarConfig,
        events: Arc<dyn EventPlane>,
        tasks: &TaskTracker,
        stop: CancellationToken,
        shutdown: &Shutdown,
    ) -> Result<Sidecar, WorkerError> {
        let engine_model = config.engine_model.clone().unwrap_or(config.model.clone());
        let api = EngineApi::new(config.engine, &config.engine_url, &engine_model)
            .map_err(|e| WorkerError::InvalidRequest(e.to_string()))?
            .with_incremental_output(config.incremental_output);
        wait_for_engine(&api, config.startup_timeout, shutdown).await?;
        let shape = engine_shape(&api, &config).await?;
        tracing::info!(
            engine = config.engine.as_str(),
            url = api.base_url(),
            block_size = shape.block_size.get(),
            device_blocks = shape.device_blocks,
            "engine found"
        );
        let relay = config.kv_events.as_ref().map(|endpoint| {
            KvRelay::start(
                RelayConfig {
                    worker_id: config.worker_id,
                    block_size: shape.block_size,
                    endpoint: endpoint.clone(),
                    replay_endpoint: config.kv_replay.clone(),
                    topic: config.kv_topic.clone(),
                    ring_capacity: config.event_ring,
                    events: events.clone(),
                    subject: subjects::kv_events(&config.namespace),
                },
                tasks,
                stop.clone(),
            )
        });
        Ok(Sidecar {
            inner: Arc::new(Inner {
                config,
                api,
                shape,
                relay,
                stats: SidecarStats::default(),
                draining: AtomicBool::new(false),
                down: AtomicBool::new(false),
                in_flight: AtomicU64::new(0),
                pending_prefill_tokens: AtomicU64::new(0),
                idle: tokio::sync::Notify::new(),
                started: Instant::now(),
                prefill_clients: Default::default(),
                tasks: tasks.clone(),
            }),
        })
    }

    pub fn stats(&self) -> &SidecarStats {
        &self.inner.stats
    }

    pub fn shape(&self) -> EngineShape {
        self.inner.shape
    }

    pub fn relay(&self) -> Option<&KvRelay> {
        self.inner.relay.as_ref()
    }

    /// The record registered in discovery.
    pub fn record(&self, addr: SocketAddr) -> WorkerRecord {
        let c = &self.inner.config;
        WorkerRecord {
            id: c.worker_id,
            role: c.role,
            model: c.model.clone(),
            block_size: self.inner.shape.block_size,
            kv_capacity: TierCapacity {
                device_blocks: self.inner.shape.device_blocks,
                host_blocks: self.inner.shape.host_blocks,
                disk_blocks: 0,
            },
            addresses: WorkerAddresses {
                grpc: format!("{}:{}", c.advertise_host, addr.port()),
                kv_transfer: None,
            },
            kv_events: self.inner.relay.is_some(),
        }
    }

    fn accepting(&self) -> Result<(), Status> {
        if self.inner.draining.load(Ordering::Acquire) {
            return Err(WorkerError::Draining.into());
        }
        if self.inner.down.load(Ordering::Acquire) {
            return Err(ErrorClass::Unavailable.status("the engine behind this worker is down"));
        }
        Ok(())
    }

    async fn serve(
        self,
        listener: TcpListener,
        discovery: Arc<dyn Discovery>,
        events: Arc<dyn EventPlane>,
        shutdown: Shutdown,
        tasks: &TaskTracker,
        stop: CancellationToken,
    ) -> Result<(), WorkerError> {
        let addr = listener
            .local_addr()
            .map_err(|e| WorkerError::Internal(format!("listener address: {e}")))?;
        let record = self.record(addr);
        let server_stop = stop.child_token();
        let router = tonic::transport::Server::builder()
            .add_service(worker_server::WorkerServer::new(self.clone()));
        let server = tokio::spawn(tandem_runtime::grpc::serve_tonic(
            router,
            listener,
            server_stop.clone(),
        ));
        tasks.spawn(self.clone().report_load(events, stop.clone()));
        let mut registration =
            Some(discovery.register(record.clone()).await.inspect_err(|_| {
                server_stop.cancel();
            })?);
        tracing::info!(
            worker = self.inner.config.worker_id.0,
            role = role_name(self.inner.config.role),
            engine = self.inner.config.engine.as_str(),
            %addr,
            "sidecar serving"
        );
        self.watch_health(&mut registration, &discovery, &record, &shutdown)
            .await;

        let in_flight = self.inner.in_flight.load(Ordering::Acquire);
        tracing::info!(in_flight, "draining");
        self.inner.draining.store(true, Ordering::Release);
        if let Some(r) = registration.take() {
            r.deregister().await;
        }
        let drained = tokio::select! {
            idle = self.wait_idle(self.inner.config.drain_timeout) => idle,
            () = shutdown.stopped() => false,
        };
        if !drained {
            tracing::warn!(
                in_flight = self.inner.in_flight.load(Ordering::Acquire),
                "drain timeout: stopping with requests in flight"
            );
        }
        server_stop.cancel();
        match server.await {
            Ok(r) => r.map_err(WorkerError::from),
            Err(e) => Err(WorkerError::Internal(format!("server task: {e}"))),
        }
    }

    /// Polls the engine's health until `shutdown` drains: out of discovery after
    /// `health_failures` misses, back in when it answers again.
    async fn watch_health(
        &self,
        registration: &mut Option<Registration>,
        discovery: &Arc<dyn Discovery>,
        record: &WorkerRecord,
        shutdown: &Shutdown,
    ) {
        let c = &self.inner.config;
        let mut tick = tokio::time::interval(c.health_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut misses = 0u32;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.draining() => return,
            }
            let timeout = c.health_interval.max(Duration::from_millis(200));
            match self.inner.api.health(timeout).await {
                Ok(()) => {
                    misses = 0;
                    if self.inner.down.swap(false, Ordering::AcqRel) {
                        tracing::info!("engine answers again: registering");
                        match discovery.register(record.clone()).await {
                            Ok(r) => *registration = Some(r),
                            Err(e) => {
                                tracing::warn!(error = %e, "re-registering failed; retrying");
                                self.inner.down.store(true, Ordering::Release);
                            }
                        }
                    }
                }
                Err(e) => {
                    misses += 1;
                    if misses >= c.health_failures && !self.inner.down.swap(true, Ordering::AcqRel)
                    {
                        tracing::warn!(error = %e, misses, "engine down: leaving discovery");
                        self.inner
                            .stats
                            .engine_outages
                            .fetch_add(1, Ordering::Relaxed);
                        if let Some(r) = registration.take() {
                            r.deregister().await;
                        }
                        // A restarted engine's cache is empty; whatever it held is gone.
                        if let Some(relay) = &self.inner.relay {
                            relay.reset("engine down");
                        }
                    }
                }
            }
        }
    }

    async fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inner.idle.notified();
            if self.inner.in_flight.load(Ordering::Acquire) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.inner.in_flight.load(Ordering::Acquire) == 0;
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.inner.started.elapsed().as_millis() as u64
    }

    /// The load report: the engine's own figures when its metrics answer, with requests
    /// sent here but not yet visible there counted as waiting.
    pub async fn load_report(&self) -> LoadReport {
        let ours = self.inner.in_flight.load(Ordering::Acquire);
        let ours = u32::try_from(ours).unwrap_or(u32::MAX);
        let engine = match self.inner.api.metrics(Duration::from_secs(2)).await {
            Ok(text) => prom::load(self.inner.config.engine, &prom::parse(&text)),
            Err(e) => {
                tracing::debug!(error = %e, "engine metrics unavailable");
                None
            }
        };
        let total = self.inner.shape.device_blocks;
        let (running, waiting, usage) = match engine {
            Some(l) => {
                let seen = l.running.saturating_add(l.waiting);
                (l.running, l.waiting + ours.saturating_sub(seen), l.kv_usage)
            }
            None => (ours, 0, 0.0),
        };
        LoadReport {
            worker_id: self.inner.config.worker_id,
            timestamp_ms: self.now_ms(),
            running_requests: running,
            waiting_requests: waiting,
            pending_prefill_tokens: self.inner.pending_prefill_tokens.load(Ordering::Acquire),
            kv_active_blocks: (usage * total as f64).round() as u64,
            kv_total_blocks: total,
            last_kv_event_id: self.inner.relay.as_ref().map_or(0, KvRelay::last_event_id),
        }
    }

    async fn report_load(self, events: Arc<dyn EventPlane>, stop: CancellationToken) {
        let subject = subjects::load_reports(&self.inner.config.namespace);
        let mut tick = tokio::time::interval(self.inner.config.load_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            if self.inner.down.load(Ordering::Acquire) {
                continue;
            }
            let report = self.load_report().await;
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

    fn engine_request(&self, req: &GenerateRequest) -> Result<EngineGenerate, Status> {
        if req.prompt.is_empty() {
            return Err(WorkerError::InvalidRequest("empty prompt".into()).into());
        }
        let s = req.sampling.unwrap_or_default();
        Ok(EngineGenerate {
            request_id: format!("tandem-{}", req.request_id),
            prompt: req.prompt.clone(),
            max_tokens: s.max_tokens.max(1),
            temperature: s.temperature,
            top_p: s.top_p,
            seed: Some(s.seed),
            stop_token: s.stop_token,
            ignore_eos: s.ignore_eos,
            cache_salt: Some(req.cache_salt.clone()).filter(|s| !s.is_empty()),
            kv_transfer_params: None,
            bootstrap: None,
        })
    }

    /// Asks the prefill sidecar `target` to run the prompt on its engine with the
    /// connector's handshake; returns the `kv_transfer_params` for this engine's request.
    async fn remote_prefill(
        &self,
        target: &grpc::RemotePrefillTarget,
        req: &GenerateRequest,
    ) -> Result<serde_json::Value, WorkerError> {
        let mut client = self.prefill_client(&target.address)?;
        // SGLang's router picks a random room per request (`random.randint(0, 2**63 - 1)`).
        let room = xxhash_rust::xxh3::xxh3_64_with_seed(
            &req.request_id.to_le_bytes(),
            self.inner.started.elapsed().as_nanos() as u64,
        ) >> 1;
        let prefill = PrefillRequest {
            request_id: req.request_id,
            prompt: req.prompt.clone(),
            hash_seed: req.hash_seed,
            sampling_seed: req.sampling.as_ref().map_or(0, |s| s.seed),
            from_token: 0,
            block_size: self.inner.shape.block_size.get(),
            bytes_per_block: 0,
            destination_blocks: Vec::new(),
            destination: String::new(),
            engine_handshake: true,
            cache_salt: req.cache_salt.clone(),
            bootstrap_room: room,
        };
        let mut stream = client
            .prefill(prefill)
            .await
            .map_err(|s| WorkerError::BadTransfer(format!("prefill refused: {}", s.message())))?
            .into_inner();
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|s| WorkerError::BadTransfer(format!("prefill: {}", s.message())))?;
            if let Some(grpc::prefill_chunk::Item::Done(done)) = chunk.item {
                return serde_json::from_str(&done.kv_transfer_params).map_err(|e| {
                    WorkerError::BadTransfer(format!("prefill handshake is not JSON: {e}"))
                });
            }
        }
        Err(WorkerError::BadTransfer(
            "prefill stream ended without its handshake".into(),
        ))
    }

    /// Prompt tokens the engine holds in its device cache, by its relayed events (0
    /// without events). Like the engines, never the whole prompt: the last token is always
    /// computed.
    fn cached_estimate(&self, req: &GenerateRequest) -> u32 {
        let Some(relay) = &self.inner.relay else {
            return 0;
        };
        let bs = self.inner.shape.block_size;
        let mut hasher = TokenBlockHasher::new(bs, HashSeed(req.hash_seed));
        let mut hashes = Vec::new();
        hasher.extend(&req.prompt, &mut hashes);
        let chain: Vec<_> = hashes.iter().map(|h| h.sequence).collect();
        let held = relay.device_prefix(&chain) as u64 * u64::from(bs.get());
        let most = (req.prompt.len() as u64).saturating_sub(1);
        u32::try_from(held.min(most) / u64::from(bs.get()) * u64::from(bs.get()))
            .unwrap_or(u32::MAX)
    }

    /// SGLang's disaggregation (as its router, `sglang_router` / `mini_lb`, drives it): the
    /// prefill and decode engines get the same request with `bootstrap_host`,
    /// `bootstrap_port` (the prefill engine's bootstrap server) and `bootstrap_room`, at the
    /// same time; the prefill engine waits in the room for the decode engine and sends it
    /// the KV. So the handshake is answered at once, and the prefill request runs on in the
    /// background (its own timeout bounds it).
    fn prefill_sglang(
        &self,
        req: PrefillRequest,
    ) -> Result<Response<BoxStream<PrefillChunk>>, Status> {
        let c = &self.inner.config;
        let host = c
            .bootstrap_host
            .clone()
            .or_else(|| url_host(&c.engine_url))
            .ok_or_else(|| {
                ErrorClass::Internal.status("no bootstrap host for the SGLang engine")
            })?;
        let port = c
            .bootstrap_port
            .or(self.inner.shape.bootstrap_port)
            .ok_or_else(|| {
                ErrorClass::Internal.status(
                    "the SGLang engine reports no disaggregation_bootstrap_port: pass \
                 --engine-bootstrap-port",
                )
            })?;
        let room = req.bootstrap_room;
        let bootstrap = super::engine::SglangBootstrap {
            host: host.clone(),
            port,
            room,
        };
        let engine_req = EngineGenerate {
            request_id: format!("tandem-{}", req.request_id),
            prompt: req.prompt,
            max_tokens: 1,
            temperature: 0.0,
            top_p: None,
            seed: Some(req.sampling_seed),
            stop_token: None,
            ignore_eos: true,
            cache_salt: None,
            kv_transfer_params: None,
            bootstrap: Some(bootstrap),
        };
        let flight = self.begin(engine_req.prompt.len() as u64);
        let api = self.inner.api.clone();
        let timeout = c.prefill_timeout;
        self.inner.tasks.spawn(async move {
            let _flight = flight;
            match tokio::time::timeout(timeout, api.generate_whole(&engine_req)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(room, error = %e, "SGLang prefill failed"),
                Err(_) => tracing::warn!(room, ?timeout, "SGLang prefill timed out"),
            }
        });
        let done = PrefillDone {
            first_token: 0,
            digest: 0,
            blocks: 0,
            cached_tokens: 0,
            kv_transfer_params: serde_json::json!({
                "bootstrap_host": host,
                "bootstrap_port": port,
                "bootstrap_room": room,
            })
            .to_string(),
        };
        let chunk = PrefillChunk {
            item: Some(grpc::prefill_chunk::Item::Done(done)),
        };
        Ok(Response::new(Box::pin(futures::stream::once(async move {
            Ok(chunk)
        }))))
    }

    /// A client of the prefill sidecar at `address`, made once per address (connections are
    /// opened lazily and kept).
    fn prefill_client(
        &self,
        address: &str,
    ) -> Result<grpc::worker_client::WorkerClient<tonic::transport::Channel>, WorkerError> {
        let mut clients = self.inner.prefill_clients.lock();
        if let Some(c) = clients.get(address) {
            return Ok(c.clone());
        }
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| WorkerError::BadTransfer(format!("prefill address {address}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        let client = grpc::worker_client::WorkerClient::new(channel);
        if clients.len() >= 1024 {
            clients.clear();
        }
        clients.insert(address.to_string(), client.clone());
        Ok(client)
    }

    fn begin(&self, prompt_tokens: u64) -> FlightGuard {
        self.inner.in_flight.fetch_add(1, Ordering::AcqRel);
        self.inner
            .pending_prefill_tokens
            .fetch_add(prompt_tokens, Ordering::AcqRel);
        self.inner.stats.requests.fetch_add(1, Ordering::Relaxed);
        FlightGuard {
            sidecar: self.clone(),
            pending: prompt_tokens,
        }
    }
}

/// A request's place in the sidecar's own counts.
struct FlightGuard {
    sidecar: Sidecar,
    /// Prompt tokens still counted as pending prefill (until the first token).
    pending: u64,
}

impl FlightGuard {
    fn first_token(&mut self) {
        let p = std::mem::take(&mut self.pending);
        self.sidecar
            .inner
            .pending_prefill_tokens
            .fetch_sub(p, Ordering::AcqRel);
    }
}

impl Drop for FlightGuard {
    fn drop(&mut self) {
        self.first_token();
        if self.sidecar.inner.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.sidecar.inner.idle.notify_waiters();
        }
    }
}

/// The host part of `http://host:port/...`.
fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => authority,
    };
    (!host.is_empty()).then(|| host.trim_matches(['[', ']']).to_string())
}

/// SGLang's bootstrap fields out of a prefill sidecar's handshake.
fn bootstrap_of(params: &serde_json::Value) -> Option<super::engine::SglangBootstrap> {
    Some(super::engine::SglangBootstrap {
        host: params.get("bootstrap_host")?.as_str()?.to_string(),
        port: u16::try_from(params.get("bootstrap_port")?.as_u64()?).ok()?,
        room: params.get("bootstrap_room")?.as_u64()?,
    })
}

fn engine_status(e: &EngineError) -> Status {
    e.class().status(e.to_string())
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Waits until the engine answers `/health` (it may still be loading weights).
async fn wait_for_engine(
    api: &EngineApi,
    timeout: Duration,
    shutdown: &Shutdown,
) -> Result<(), WorkerError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut logged = false;
    loop {
        match api.health(Duration::from_secs(2)).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                if !logged {
                    tracing::info!(url = api.base_url(), error = %e, "waiting for the engine");
                    logged = true;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(WorkerError::Internal(format!(
                        "the engine at {} did not answer /health within {timeout:?}: {e}",
                        api.base_url()
                    )));
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
            () = shutdown.draining() => {
                return Err(WorkerError::Draining);
            }
        }
    }
}

/// Block size and capacity: the engine's where it says (vLLM's `vllm:cache_config_info`,
/// SGLang's `page_size` and `max_total_num_tokens`), else the flags. The engine's block size
/// is the worker's: the frontend's own mismatch check then refuses a pool that mixes sizes.
async fn engine_shape(api: &EngineApi, c: &SidecarConfig) -> Result<EngineShape, WorkerError> {
    let mut geometry = match api.metrics(Duration::from_secs(5)).await {
        Ok(text) => prom::geometry(&prom::parse(&text)),
        Err(_) => prom::EngineGeometry::default(),
    };
    let mut bootstrap_port = None;
    if let Some(info) = api.server_info(Duration::from_secs(5)).await {
        bootstrap_port = info
            .get("disaggregation_bootstrap_port")
            .and_then(serde_json::Value::as_u64)
            .and_then(|p| u16::try_from(p).ok());
        let page = info.get("page_size").and_then(serde_json::Value::as_u64);
        let tokens = info
            .get("max_total_num_tokens")
            .and_then(serde_json::Value::as_u64);
        geometry.block_size = geometry
            .block_size
            .or(page.and_then(|p| u32::try_from(p).ok()));
        if let (Some(p), Some(t)) = (page, tokens)
            && p > 0
        {
            geometry.device_blocks = geometry.device_blocks.or(Some(t / p));
        }
    }
    let block_size = match (geometry.block_size, c.block_size) {
        (Some(e), Some(f)) => {
            if e != f {
                tracing::warn!(
                    engine = e,
                    flag = f,
                    "the engine's block size wins over --block-size"
                );
            }
            e
        }
        (Some(b), None) | (None, Some(b)) => b,
        (None, None) => {
            return Err(WorkerError::InvalidRequest(format!(
                "the {} engine does not say its block size: pass --block-size (its \
                 --block-size / --page-size)",
                c.engine.as_str()
            )));
        }
    };
    let block_size = BlockSize::new(block_size)
        .map_err(|e| WorkerError::InvalidRequest(format!("block size: {e}")))?;
    Ok(EngineShape {
        block_size,
        device_blocks: geometry.device_blocks.or(c.device_blocks).unwrap_or(0),
        host_blocks: geometry.host_blocks.or(c.host_blocks).unwrap_or(0),
        bootstrap_port,
    })
}

#[tonic::async_trait]
impl worker_server::Worker for Sidecar {
    type GenerateStream = BoxStream<GenerateChunk>;
    type PrefillStream = BoxStream<PrefillChunk>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.accepting()?;
        let req = request.into_inner();
        let mut engine_req = self.engine_request(&req)?;
        let mut flight = self.begin(req.prompt.len() as u64);
        let mut outcome = PrefillOutcome::Local;
        if let Some(target) = &req.remote_prefill {
            self.inner
                .stats
                .remote_prefills
                .fetch_add(1, Ordering::Relaxed);
            let timeout = self.inner.config.prefill_timeout;
            let sglang = self.inner.config.engine == EngineKind::Sglang;
            match tokio::time::timeout(timeout, self.remote_prefill(target, &req)).await {
                Ok(Ok(params)) if sglang => match bootstrap_of(&params) {
                    Some(b) => {
                        engine_req.bootstrap = Some(b);
                        outcome = PrefillOutcome::Remote;
                    }
                    None => {
                        tracing::debug!(%params, "prefill handshake without a bootstrap room");
                        outcome = PrefillOutcome::Fallback;
                    }
                },
                Ok(Ok(params)) => {
                    engine_req.kv_transfer_params = Some(params);
                    outcome = PrefillOutcome::Remote;
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "remote prefill failed: local prefill");
                    outcome = PrefillOutcome::Fallback;
                }
                Err(_) => {
                    tracing::debug!(?timeout, "remote prefill timed out: local prefill");
                    outcome = PrefillOutcome::Fallback;
                }
            }
            // An SGLang decode engine cannot prefill by itself: without its prefill engine the
            // request goes back to the frontend, which tries another worker (nothing was
            // generated yet).
            if sglang && outcome == PrefillOutcome::Fallback {
                self.inner
                    .stats
                    .remote_prefill_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
                return Err(ErrorClass::Unavailable.status(
                    "the SGLang prefill engine did not take the request (a decode-mode SGLang \
                     engine cannot prefill by itself)",
                ));
            }
            if outcome == PrefillOutcome::Fallback {
                self.inner
                    .stats
                    .remote_prefill_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut deltas = match self.inner.api.generate(&engine_req).await {
            Ok(s) => s,
            Err(e) => {
                self.inner
                    .stats
                    .engine_errors
                    .fetch_add(1, Ordering::Relaxed);
                return Err(engine_status(&e));
            }
        };
        let prompt_tokens = req.prompt.len() as u32;
        // Until the engine's own count arrives with its usage (at the end), the first chunk
        // says what the engine's events say it holds of the prompt.
        let estimate = self.cached_estimate(&req);
        let sidecar = self.clone();
        let stream = super::engine::channel_stream(move |tx| async move {
            let mut first = true;
            // The finishing chunk waits for the engine's usage, which follows it (vLLM's
            // `include_usage` chunk): that is where the engine's own cached-token count is.
            let mut last: Option<GenerateChunk> = None;
            let mut text_tokens = 0u32;
            while let Some(d) = deltas.next().await {
                let d = match d {
                    Ok(d) => d,
                    Err(e) => {
                        sidecar
                            .inner
                            .stats
                            .engine_errors
                            .fetch_add(1, Ordering::Relaxed);
                        let _ = tx.send(Err(engine_status(&e))).await;
                        return;
                    }
                };
                if let Some(l) = last.as_mut() {
                    l.tokens.extend(d.tokens);
                    l.cached_tokens = d.cached_tokens.unwrap_or(l.cached_tokens);
                    l.prompt_tokens = d.prompt_tokens.unwrap_or(l.prompt_tokens);
                    if let Some(t) = d.text {
                        l.text.get_or_insert_with(String::new).push_str(&t);
                    }
                    // A text-only engine's usage: what its chunks did not count yet.
                    if l.text.is_some()
                        && let Some(total) = d.completion_tokens
                    {
                        l.completion_tokens += total.saturating_sub(text_tokens);
                    }
                    continue;
                }
                let has_text = d.text.as_ref().is_some_and(|t| !t.is_empty());
                if d.tokens.is_empty() && !has_text && d.finish.is_none() {
                    continue;
                }
                if first && (!d.tokens.is_empty() || has_text) {
                    flight.first_token();
                }
                // Text without ids: one token per streamed chunk until the usage says.
                let counted = u32::from(has_text);
                text_tokens += counted;
                let chunk = GenerateChunk {
                    text: d.text,
                    completion_tokens: counted,
                    tokens: d.tokens,
                    cached_tokens: d.cached_tokens.unwrap_or(estimate),
                    prompt_tokens: d.prompt_tokens.unwrap_or(prompt_tokens),
                    finish: match d.finish {
                        Some(EngineFinish::Length) => grpc::FinishReason::Length as i32,
                        Some(EngineFinish::Stop) => grpc::FinishReason::Stop as i32,
                        None => grpc::FinishReason::Unspecified as i32,
                    },
                    prefill: if first {
                        outcome as i32
                    } else {
                        PrefillOutcome::Unspecified as i32
                    },
                };
                first = false;
                if chunk.finish != grpc::FinishReason::Unspecified as i32 {
                    last = Some(chunk);
                } else if tx.send(Ok(chunk)).await.is_err() {
                    return;
                }
            }
            if let Some(l) = last {
                let _ = tx.send(Ok(l)).await;
            }
            drop(flight);
        });
        Ok(Response::new(stream))
    }

    async fn prefill(
        &self,
        request: Request<PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        self.accepting()?;
        let req = request.into_inner();
        if !req.engine_handshake {
            return Err(WorkerError::InvalidRequest(
                "this worker fronts an external engine: it prefills through the engine's KV \
                 connector (engine_handshake), not into tandem's KV regions"
                    .into(),
            )
            .into());
        }
        if req.block_size != self.inner.shape.block_size.get() {
            return Err(WorkerError::InvalidRequest(format!(
                "block size {} differs from this engine's {}",
                req.block_size,
                self.inner.shape.block_size.get()
            ))
            .into());
        }
        if self.inner.config.engine == EngineKind::Sglang {
            return self.prefill_sglang(req);
        }
        let _flight = self.begin(req.prompt.len() as u64);
        // vLLM's connector protocol, as its disaggregated proxy uses it: the prefill request
        // asks to keep the KV for a remote decode and generates one token.
        let engine_req = EngineGenerate {
            request_id: format!("tandem-{}", req.request_id),
            prompt: req.prompt,
            max_tokens: 1,
            temperature: 0.0,
            top_p: None,
            seed: Some(req.sampling_seed),
            stop_token: None,
            ignore_eos: true,
            cache_salt: Some(req.cache_salt).filter(|s| !s.is_empty()),
            kv_transfer_params: Some(serde_json::json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            })),
            bootstrap: None,
        };
        let answer = self
            .inner
            .api
            .generate_whole(&engine_req)
            .await
            .map_err(|e| engine_status(&e))?;
        let Some(params) = answer.kv_transfer_params else {
            return Err(ErrorClass::Internal.status(
                "the engine's answer has no kv_transfer_params: is it started with a \
                 --kv-transfer-config whose kv_role is kv_producer or kv_both?",
            ));
        };
        let done = PrefillDone {
            first_token: answer.tokens.first().copied().unwrap_or(0),
            digest: 0,
            blocks: 0,
            cached_tokens: answer.cached_tokens.unwrap_or(0),
            kv_transfer_params: params.to_string(),
        };
        let chunk = PrefillChunk {
            item: Some(grpc::prefill_chunk::Item::Done(done)),
        };
        Ok(Response::new(Box::pin(futures::stream::once(async move {
            Ok(chunk)
        }))))
    }

    async fn abort_prefill(
        &self,
        _request: Request<AbortPrefillRequest>,
    ) -> Result<Response<AbortPrefillReply>, Status> {
        // Nothing of a connector prefill reaches tandem's regions: nothing to fence.
        Ok(Response::new(AbortPrefillReply { was_running: false }))
    }

    async fn kv_events(
        &self,
        request: Request<KvEventsRequest>,
    ) -> Result<Response<KvEventsReply>, Status> {
        let req = request.into_inner();
        let worker_id = self.inner.config.worker_id;
        let reply = match &self.inner.relay {
            // No events relayed: an empty cache, as far as anyone can tell.
            None => crate::context::kv_events_reply(
                &req,
                0,
                |_| None,
                || tandem_protocol::KvDump {
                    worker_id,
                    last_event_id: 0,
                    events: Vec::new(),
                },
            ),
            Some(relay) => crate::context::kv_events_reply(
                &req,
                relay.last_event_id(),
                |after| relay.events_since(after),
                || relay.dump(),
            ),
        };
        reply.map(Response::new)
    }

    async fn health(
        &self,
        _request: Request<HealthRequest>,
    ) -> Result<Response<HealthReply>, Status> {
        let draining = self.inner.draining.load(Ordering::Acquire);
        let down = self.inner.down.load(Ordering::Acquire);
        Ok(Response::new(HealthReply {
            worker_id: self.inner.config.worker_id.0,
            role: role_name(self.inner.config.role).to_string(),
            serving: !draining && !down,
            draining,
        }))
    }
}
