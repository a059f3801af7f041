//! What every in-process worker role shares: its configuration, the engine host, and the
//! engine's side of the one lifecycle ([`crate::served`]: record, `KvEvents`, load, drain).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{ArenaStorage, DynEngine, Engine, EngineConfig, MockEngine, MockEngineConfig};
use tandem_kv_transfer::{MemoryKind, Region, RegionDescriptor, Transport};
use tandem_protocol::ErrorClass;
use tandem_protocol::grpc::{KvEventsReply, KvEventsRequest, kv_events_reply};
use tandem_protocol::{
    Envelope, LoadReport, TierCapacity, WorkerAddresses, WorkerId, WorkerRecord, WorkerRole,
};
use tandem_runtime::discovery::Discovery;
use tandem_runtime::events::{EventPlane, subjects};
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;

use crate::arena::{KvMemory, RegionStorage};
use crate::error::WorkerError;
use crate::host::{EngineHost, HostPublishing};
use crate::metrics::WorkerMetrics;
use crate::served::{Availability, Lifecycle, ServedEngine, WorkerCalls};

/// A worker's settings (the binary fills them from flags).
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub worker_id: WorkerId,
    pub role: WorkerRole,
    /// Served model name, registered in discovery.
    pub model: String,
    /// Discovery and event-plane namespace.
    pub namespace: String,
    /// The engine; its pool's `worker_id` is overwritten with `worker_id`. With `native`
    /// set, its `mocker` part is unused: the model computes the steps and sizes the KV.
    pub engine: MockEngineConfig,
    /// The native engine's model, computing real tokens; None: the mocker.
    pub native: Option<NativeEngine>,
    /// Host name other processes reach this worker at (the listener's port is appended).
    pub advertise_host: String,
    /// Its topology label (rack, NVLink domain, zone; empty: unknown), registered with its
    /// host and process for the router's KV transfer cost.
    pub rack: String,
    pub load_interval: Duration,
    /// How long a draining worker waits for in-flight requests before it exits anyway.
    pub drain_timeout: Duration,
    /// Decode workers: on drain, offer each stream's KV to its frontend, which continues
    /// the stream on another decode worker with this one as its remote prefill (the KV
    /// moves, nothing is recomputed); false: streams finish here.
    pub drain_handover: bool,
    /// Decode workers: how long a remote prefill may take before prefilling locally.
    pub prefill_timeout: Duration,
    /// Where the engine's device arena lives.
    pub kv_memory: KvMemory,
    /// Decode workers: how long the destination blocks of an abandoned remote prefill stay
    /// out of use while the prefill worker cannot confirm that it stopped writing them.
    pub transfer_fence_timeout: Duration,
    /// Prefill workers, fault injection for tests: flip one byte of the first block of every
    /// transfer after its digest is taken (the decode worker must notice and fall back).
    pub corrupt_transfers: bool,
    /// Outputs (about one per engine step) a request's consumer may fall behind before the
    /// request is aborted: bounds a stalled stream's memory.
    pub output_buffer: usize,
    /// Where to serve `GET /metrics` (`host:port`, port 0 picks one); None: not served.
    pub metrics_listen: Option<String>,
    /// The engine's disk tier (`--kv-disk-dir`); None: no disk tier.
    pub kv_disk: Option<crate::disk::KvDiskConfig>,
    /// Decode workers: check each remote prefill's KV against the prefill worker's digest
    /// (`--kv-digest`; a mismatch falls back to a local prefill). Off, neither side hashes.
    pub kv_digest: bool,
    /// Prefill workers: send each layer's part of a step's blocks as soon as the layer is
    /// computed (`--kv-layer-streaming`); off, each block goes whole when its step ends.
    pub kv_layer_streaming: bool,
}

impl WorkerConfig {
    /// Defaults for `role`: 16-token blocks, 8,192 device blocks, the mocker's timing.
    pub fn new(worker_id: WorkerId, role: WorkerRole) -> Self {
        let pool = tandem_engine::BlockPoolConfig::new(worker_id, 8192);
        WorkerConfig {
            worker_id,
            role,
            model: "mocker".to_string(),
            namespace: "default".to_string(),
            engine: MockEngineConfig::new(pool),
            native: None,
            advertise_host: "127.0.0.1".to_string(),
            rack: String::new(),
            load_interval: Duration::from_millis(500),
            drain_timeout: Duration::from_secs(30),
            drain_handover: true,
            prefill_timeout: Duration::from_secs(5),
            kv_memory: KvMemory::Host,
            transfer_fence_timeout: Duration::from_secs(60),
            corrupt_transfers: false,
            output_buffer: 1024,
            metrics_listen: None,
            kv_disk: None,
            kv_digest: true,
            kv_layer_streaming: true,
        }
    }
}

/// A worker's native engine: a loaded GGUF model (shared by every engine of the process) and
/// the kernels and threads it computes with.
#[derive(Clone, Debug)]
pub struct NativeEngine {
    pub model: Arc<tandem_native::Llama>,
    pub kernels: tandem_native::Kernels,
    /// Threads of one step's compute (at least 1).
    pub threads: usize,
    /// The model's end-of-sequence token: generation stops there unless a request asks to
    /// ignore it (`tokenizer.ggml.eos_token_id`; ChatML models end a turn with it).
    pub eos_token: Option<u32>,
    /// The model's weights on a GPU, when the engine computes there (`--device cuda`; its
    /// KV arena must then be in that device's memory, [`KvMemory::Cuda`]).
    #[cfg(feature = "cuda")]
    pub gpu: Option<Arc<tandem_native::gpu::GpuWeights>>,
    /// What K and V are stored as (`--kv-dtype`; the GPU engine keeps f16).
    pub kv_dtype: tandem_native::KvDtype,
}

impl WorkerConfig {
    /// Bytes of one KV block: the model's K and V per token (as `--kv-dtype` says) for the
    /// native engine, the mocker's shape otherwise.
    pub fn bytes_per_block(&self) -> usize {
        match &self.native {
            Some(n) => tandem_native::NativeModel::kv_shape_as(&n.model, n.kv_dtype)
                .bytes_per_block(self.engine.pool.block_size.tokens()),
            None => MockEngine::bytes_per_block(&self.engine),
        }
    }

    /// Bytes of one KV element (2: f16, 4: f32).
    pub fn kv_element_bytes(&self) -> u32 {
        match &self.native {
            Some(n) => n.kv_dtype.bytes() as u32,
            None => self.engine.mocker.kv_shape.dtype_bytes,
        }
    }

    /// Builds the engine, its device arena in `storage` when given.
    fn build_engine(
        &self,
        storage: Option<Box<dyn ArenaStorage>>,
    ) -> Result<DynEngine, tandem_engine::EngineError> {
        let Some(n) = &self.native else {
            return match storage {
                Some(s) => MockEngine::with_device_storage(self.engine.clone(), s),
                None => MockEngine::new(self.engine.clone()),
            }
            .map(Engine::into_dyn);
        };
        let cfg = EngineConfig {
            pool: self.engine.pool.clone(),
            scheduler: self.engine.scheduler.clone(),
        };
        #[cfg(feature = "cuda")]
        if let Some(weights) = &n.gpu {
            let model = tandem_native::gpu::GpuModel::new(
                weights.clone(),
                self.engine.pool.block_size.tokens(),
            )
            .map_err(|_| {
                tandem_engine::EngineError::InvalidConfig("no CUDA stream for the GPU engine")
            })?;
            let storage = storage
                .filter(|s| {
                    s.device()
                        .is_some_and(|d| d.ordinal == weights.gpu().ordinal())
                })
                .ok_or(tandem_engine::EngineError::InvalidConfig(
                    "a GPU engine's KV arena must be in that GPU's memory (--kv-memory cuda:N)",
                ))?;
            return Engine::with_model_and_storage(cfg, model, storage).map(Engine::into_dyn);
        }
        let model = tandem_native::NativeModel::new(
            n.model.clone(),
            n.kernels,
            self.engine.pool.block_size.tokens(),
            n.threads,
        )
        .with_kv_dtype(n.kv_dtype);
        match storage {
            Some(s) => Engine::with_model_and_storage(cfg, model, s),
            None => Engine::new_with_model(cfg, model),
        }
        .map(Engine::into_dyn)
    }
}

impl WorkerConfig {
    /// Where this worker runs, as registered.
    pub fn placement(&self) -> tandem_protocol::Placement {
        tandem_protocol::Placement::here(&self.advertise_host, &self.rack)
    }
}

/// The outside services a worker talks to.
#[derive(Clone)]
pub struct WorkerDeps {
    pub discovery: Arc<dyn Discovery>,
    pub events: Arc<dyn EventPlane>,
    /// The KV transport (one per process); None: KV travels inline on the gRPC stream.
    pub transport: Option<Arc<dyn Transport>>,
}

/// A decode worker's device arena, exposed on its KV transport: prefill workers write the
/// blocks the engine reserved straight into it, where the engine reads them.
#[derive(Clone, Debug)]
pub struct ExposedArena {
    pub region: Arc<Region>,
    pub descriptor: RegionDescriptor,
}

impl std::fmt::Debug for WorkerDeps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerDeps").finish_non_exhaustive()
    }
}

/// State shared by a worker's request handlers.
#[derive(Clone, Debug)]
pub struct WorkerContext {
    pub config: Arc<WorkerConfig>,
    pub host: EngineHost,
    /// The KV transport, when one is configured.
    pub transport: Option<Arc<dyn Transport>>,
    /// The engine's arena as prefill workers see it (decode workers with a transport).
    pub exposed: Option<ExposedArena>,
    /// The region the engine's device arena lives in, when it is one (a transport's memory
    /// or GPU memory): prefill workers send blocks straight from it.
    pub arena: Option<Arc<Region>>,
    /// Its counters, served on `/metrics` with the engine's state.
    pub metrics: Arc<WorkerMetrics>,
    availability: Arc<Availability>,
    /// Cancelled when the worker stops for good (after draining): ends its tasks.
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl WorkerContext {
    /// Builds the engine and starts its host tasks. The engine's device arena is a region
    /// of the KV transport for a decode worker with one (exposed, so that prefill workers
    /// write into it), CUDA memory with [`KvMemory::Cuda`], plain host memory otherwise.
    /// Its tasks hang under `shutdown`'s stop token: they end after [`WorkerContext::serve`]
    /// drained, or at once when the process stops.
    pub async fn start(
        mut config: WorkerConfig,
        deps: &WorkerDeps,
        shutdown: &Shutdown,
    ) -> Result<Self, WorkerError> {
        let events = deps.events.clone();
        config.engine.pool.worker_id = config.worker_id;
        let (region, exposed) = arena_region(&config, deps.transport.as_deref()).await?;
        let storage = region
            .clone()
            .map(|r| Box::new(RegionStorage::new(r)) as Box<dyn ArenaStorage>);
        let mut engine = config
            .build_engine(storage)
            .map_err(|e| WorkerError::InvalidRequest(format!("engine config: {e}")))?;
        if let Some(disk) = &config.kv_disk {
            let print = crate::disk::fingerprint(
                &config.model,
                &engine.model().kv_shape(),
                config.engine.pool.block_size.tokens(),
            );
            let store = crate::disk::FileDiskStore::open(disk, &print, config.bytes_per_block())
                .map_err(|e| {
                    WorkerError::InvalidRequest(format!(
                        "--kv-disk-dir {}: {e}",
                        disk.dir.display()
                    ))
                })?;
            engine.pool_mut().attach_disk(Box::new(store));
        }
        let tasks = TaskTracker::new();
        let stop = shutdown.stop_token().child_token();
        let metrics = Arc::new(WorkerMetrics::default());
        let publishing = HostPublishing {
            events,
            kv_subject: subjects::kv_events(&config.namespace),
            metrics: metrics.clone(),
        };
        let host = EngineHost::start(
            engine,
            publishing,
            config.output_buffer,
            &tasks,
            stop.clone(),
        );
        Ok(WorkerContext {
            config: Arc::new(config),
            host,
            transport: deps.transport.clone(),
            exposed,
            arena: region,
            metrics,
            availability: Arc::default(),
            stop,
            tasks,
        })
    }

    /// Cancelled when the worker stops for good: background work (transfer fences) ends.
    pub fn stopping(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// The tracker owning per-request tasks (remote prefill fetches), so none outlives the
    /// worker.
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// `KvEvents`: the range after `after`, or a dump when asked or when the ring no longer
    /// holds the range.
    pub fn kv_events(&self, req: KvEventsRequest) -> Result<KvEventsReply, Status> {
        let last = self.host.with_engine(|e| e.pool().last_event_id());
        kv_events_reply(
            &req,
            last,
            |after| self.host.events_since(after),
            || self.host.dump(),
        )
    }

    /// The record registered in discovery: gRPC on `addr`, metrics on `metrics` if served.
    pub fn record(&self, addr: SocketAddr, metrics: Option<SocketAddr>) -> WorkerRecord {
        let pool = &self.config.engine.pool;
        WorkerRecord {
            id: self.config.worker_id,
            role: self.config.role,
            model: self.config.model.clone(),
            block_size: pool.block_size,
            kv_capacity: TierCapacity {
                device_blocks: u64::from(pool.device_blocks),
                host_blocks: u64::from(pool.host_blocks),
                disk_blocks: 0,
            },
            addresses: WorkerAddresses {
                grpc: format!("{}:{}", self.config.advertise_host, addr.port()),
                kv_transfer: self.exposed.as_ref().map(|l| l.descriptor.to_compact()),
                metrics: metrics.map(|m| format!("{}:{}", self.config.advertise_host, m.port())),
                http: None,
            },
            kv_events: true,
            placement: self.config.placement(),
            takes_text: false,
        }
    }

    /// Serves `calls` (the role's request handlers over this context) on `listener`,
    /// registered in discovery, until `shutdown`; then drains (the one lifecycle,
    /// [`crate::served::serve`]) and ends the engine's tasks.
    pub async fn serve<C: WorkerCalls>(
        self,
        listener: TcpListener,
        calls: Arc<C>,
        deps: WorkerDeps,
        shutdown: Shutdown,
    ) -> Result<(), WorkerError> {
        let lifecycle = Lifecycle {
            namespace: self.config.namespace.clone(),
            load_interval: self.config.load_interval,
            drain_timeout: self.config.drain_timeout,
            health: None,
        };
        let served = crate::served::serve(
            calls,
            lifecycle,
            listener,
            deps.discovery,
            deps.events,
            shutdown,
            &self.tasks,
            self.stop.clone(),
        )
        .await;
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        served
    }
}

#[tonic::async_trait]
impl ServedEngine for WorkerContext {
    fn stopping(&self) {
        if self.config.kv_disk.is_some() {
            self.host.with_engine_mut(|e| e.pool_mut().spill_to_disk());
        }
    }

    fn worker_id(&self) -> WorkerId {
        self.config.worker_id
    }

    fn role(&self) -> WorkerRole {
        self.config.role
    }

    fn availability(&self) -> &Availability {
        &self.availability
    }

    fn record(&self, grpc: SocketAddr, metrics: Option<SocketAddr>) -> WorkerRecord {
        WorkerContext::record(self, grpc, metrics)
    }

    fn kv_events(&self, req: KvEventsRequest) -> Result<KvEventsReply, Status> {
        WorkerContext::kv_events(self, req)
    }

    async fn load_report(&self) -> LoadReport {
        self.host.load_report()
    }

    fn in_flight(&self) -> u64 {
        self.host.in_flight() as u64
    }

    async fn wait_idle(&self, timeout: Duration) -> bool {
        self.host.wait_idle(timeout).await
    }

    async fn serve_metrics(
        &self,
        tasks: &TaskTracker,
        stop: CancellationToken,
    ) -> Result<Option<SocketAddr>, WorkerError> {
        let Some(listen) = &self.config.metrics_listen else {
            return Ok(None);
        };
        let (listener, local) = crate::scrape::bind(listen).await?;
        let registry = crate::scrape::registry(
            &self.metrics,
            self.host.clone(),
            &self.config.model,
            self.availability.draining_flag(),
        );
        tasks.spawn(async move {
            if let Err(e) = crate::scrape::serve(listener, registry, stop).await {
                tracing::error!(error = %e, "metrics server failed");
            }
        });
        Ok(Some(local))
    }
}

/// The region the engine's device arena lives in, and its exposure on the transport: a
/// worker with a transport allocates it from the transport (UCX shared memory, so a peer on
/// the same host maps it) unless it is in CUDA memory; a decode worker exposes it (prefill
/// workers write into it), a prefill worker sends from it. Any worker with
/// [`KvMemory::Cuda`] gets CUDA memory. None: the engine allocates host memory itself.
async fn arena_region(
    config: &WorkerConfig,
    transport: Option<&dyn Transport>,
) -> Result<(Option<Arc<Region>>, Option<ExposedArena>), WorkerError> {
    let blocks = config.engine.pool.device_blocks;
    let bytes = config.bytes_per_block();
    if bytes == 0 {
        // Timing only: no KV bytes to keep or move.
        return Ok((None, None));
    }
    let exposes = matches!(config.role, WorkerRole::Decode | WorkerRole::Aggregated);
    let region = match (config.kv_memory, transport) {
        (KvMemory::Cuda { ordinal }, _) => Region::cuda(ordinal, blocks, bytes)
            .map_err(|e| WorkerError::InvalidRequest(format!("--kv-memory cuda:{ordinal}: {e}")))?,
        (KvMemory::Host, Some(t)) => t
            .alloc_region(blocks, bytes)
            .await
            .map_err(|e| WorkerError::Internal(format!("KV region: {e}")))?,
        (KvMemory::Host, _) => return Ok((None, None)),
    };
    let exposed = match transport {
        Some(t) if exposes => {
            let descriptor = t.expose(region.clone()).await.map_err(|e| {
                let hint = if region.memory_kind() == MemoryKind::Cuda {
                    " (GPU memory needs a transport that can reach it: a UCX built with \
                     CUDA support, or --kv-transport tcp)"
                } else {
                    ""
                };
                WorkerError::InvalidRequest(format!("exposing the KV arena: {e}{hint}"))
            })?;
            tracing::info!(
                transport = t.kind().as_str(),
                memory = %region.memory_kind(),
                "KV arena exposed to prefill workers"
            );
            Some(ExposedArena {
                region: region.clone(),
                descriptor,
            })
        }
        _ => None,
    };
    Ok((Some(region), exposed))
}

/// The answer to `KvEvents` from a worker whose latest event is `last`: the range after
/// `req.after` (`since`), or a dump when asked, when the range is gone, or when `after` is
/// beyond `last` (a consumer that knew an earlier run of this worker id: only a dump can
/// correct it). Mocker workers and sidecars answer alike.
pub fn kv_events_reply(
    req: &KvEventsRequest,
    last: u64,
    since: impl FnOnce(u64) -> Option<Vec<tandem_protocol::KvEvent>>,
    dump: impl FnOnce() -> tandem_protocol::KvDump,
) -> Result<KvEventsReply, Status> {
    let encoded = |r: Result<Vec<u8>, tandem_protocol::CodecError>| {
        r.map_err(|e| ErrorClass::Internal.status(format!("encoding KV events: {e}")))
    };
    let ahead = req.after > last;
    let range = if req.dump || ahead {
        None
    } else {
        since(req.after)
    };
    let body = match range {
        Some(events) => kv_events_reply::Body::Events(encoded(events.encode())?),
        None => kv_events_reply::Body::Dump(encoded(dump().encode())?),
    };
    Ok(KvEventsReply { body: Some(body) })
}
