//! A worker that fronts an external engine (vLLM, SGLang, or an OpenAI-compatible server with
//! vLLM's token-id extension): the sidecar.
//!
//! It registers the engine in discovery (role, model, block size and KV capacity read from the
//! engine where it exposes them, else from flags), serves tandem's `Worker` gRPC to the
//! frontend, relays the engine's ZMQ KV events onto the event plane as tandem events
//! ([`super::events`]), and reports load from the engine's Prometheus endpoint merged with its
//! own count of requests in flight. The frontend cannot tell it from a mocker worker: it runs
//! the same lifecycle and gRPC service ([`tandem_worker::served`]) as tandem's own engines.
//!
//! Health: the engine's `/health` is polled (`/v1/models` for a server without one:
//! [`EngineApi::health`]); after `health_failures` misses in a row the
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
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tandem_protocol::grpc::{self, KvEventsReply, KvEventsRequest};
use tandem_protocol::{
    BlockSize, LoadReport, TierCapacity, WorkerAddresses, WorkerId, WorkerRecord, WorkerRole,
};
use tandem_runtime::discovery::Discovery;
use tandem_runtime::events::{EventPlane, subjects};
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;

use super::engine::{EngineApi, EngineKind};
use super::events::{KvRelay, RelayConfig};
use super::prom;
use tandem_worker::error::WorkerError;
use tandem_worker::served::{Availability, HealthProbe, Lifecycle, ServedEngine};

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
    /// Its topology label (see [`tandem_worker::WorkerConfig::rack`]).
    pub rack: String,
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
    /// Where a gateway reaches the engine's HTTP API, `host:port`, registered for the
    /// endpoint picker (`tandem epp`); None: the engine URL's host and port, with a loopback
    /// host replaced by `advertise_host` (an engine beside its sidecar in one pod).
    pub engine_advertise: Option<String>,
}

impl SidecarConfig {
    /// The engine's HTTP endpoint as others reach it ([`Self::engine_advertise`]); None when
    /// the engine URL names no host.
    pub fn http_endpoint(&self) -> Option<String> {
        if let Some(a) = &self.engine_advertise {
            return Some(a.clone());
        }
        let rest = self
            .engine_url
            .split_once("://")
            .map_or(&*self.engine_url, |(_, r)| r);
        let authority = rest.split(['/', '?']).next().unwrap_or_default();
        // `host:port`, `[v6]:port`, or a host alone.
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((h, p)) => (&authority[..h.len() + 2], p.strip_prefix(':')),
                None => return None,
            },
            None => match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            },
        };
        if host.is_empty() {
            return None;
        }
        let port =
            port.filter(|p| !p.is_empty())
                .unwrap_or(if self.engine_url.starts_with("https:") {
                    "443"
                } else {
                    "80"
                });
        let loopback = matches!(host, "localhost" | "127.0.0.1" | "[::1]" | "0.0.0.0");
        let host = if loopback { &self.advertise_host } else { host };
        Some(format!("{host}:{port}"))
    }

    pub fn new(worker_id: WorkerId, role: WorkerRole, engine: EngineKind, url: &str) -> Self {
        SidecarConfig {
            worker_id,
            role,
            model: "model".into(),
            engine_model: None,
            namespace: "default".into(),
            advertise_host: "127.0.0.1".into(),
            rack: String::new(),
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
            engine_advertise: None,
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
    availability: Availability,
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
    /// Held by a probe that is a request of the engine's API, and by a request while it
    /// starts: neither happens during the other (`probe`).
    probe_gate: tokio::sync::Mutex<()>,
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
    let lifecycle = Lifecycle {
        namespace: config.namespace.clone(),
        load_interval: config.load_interval,
        drain_timeout: config.drain_timeout,
        health: Some(HealthProbe {
            interval: config.health_interval,
            failures: config.health_failures,
        }),
    };
    let sidecar = Sidecar::start(config, events.clone(), &tasks, stop.clone(), &shutdown).await?;
    let result = tandem_worker::served::serve(
        Arc::new(sidecar),
        lifecycle,
        listener,
        discovery,
        events,
        shutdown,
        &tasks,
        stop.clone(),
    )
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
        api.probe_prompts(Duration::from_secs(30))
            .await
            .map_err(|e| WorkerError::InvalidRequest(e.to_string()))?;
        let shape = engine_shape(&api, &config).await?;
        tracing::info!(
            engine = config.engine.as_str(),
            url = api.base_url(),
            block_size = shape.block_size.get(),
            device_blocks = shape.device_blocks,
            prompts = if api.takes_text() {
                "text"
            } else {
                "token ids"
            },
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
                availability: Availability::default(),
                in_flight: AtomicU64::new(0),
                pending_prefill_tokens: AtomicU64::new(0),
                idle: tokio::sync::Notify::new(),
                started: Instant::now(),
                prefill_clients: Default::default(),
                tasks: tasks.clone(),
                probe_gate: tokio::sync::Mutex::new(()),
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

    fn now_ms(&self) -> u64 {
        self.inner.started.elapsed().as_millis() as u64
    }
}

#[tonic::async_trait]
impl ServedEngine for Sidecar {
    fn worker_id(&self) -> WorkerId {
        self.inner.config.worker_id
    }

    fn role(&self) -> WorkerRole {
        self.inner.config.role
    }

    fn availability(&self) -> &Availability {
        &self.inner.availability
    }

    /// The record registered in discovery (the sidecar serves no `/metrics` of its own: the
    /// engine's are scraped).
    fn record(&self, addr: SocketAddr, _metrics: Option<SocketAddr>) -> WorkerRecord {
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
                metrics: None,
                http: c.http_endpoint(),
            },
            kv_events: self.inner.relay.is_some(),
            placement: tandem_protocol::Placement::here(&c.advertise_host, &c.rack),
            takes_text: self.inner.api.takes_text(),
        }
    }

    fn kv_events(&self, req: KvEventsRequest) -> Result<KvEventsReply, Status> {
        let worker_id = self.inner.config.worker_id;
        match &self.inner.relay {
            // No events relayed: an empty cache, as far as anyone can tell.
            None => tandem_worker::context::kv_events_reply(
                &req,
                0,
                |_| None,
                || tandem_protocol::KvDump {
                    worker_id,
                    last_event_id: 0,
                    events: Vec::new(),
                },
            ),
            Some(relay) => tandem_worker::context::kv_events_reply(
                &req,
                relay.last_event_id(),
                |after| relay.events_since(after),
                || relay.dump(),
            ),
        }
    }

    /// The load report: the engine's own figures when its metrics answer, with requests
    /// sent here but not yet visible there counted as waiting; its LoRA adapters where it
    /// reports them (vLLM's `vllm:lora_requests_info`, [`prom::adapters`]).
    async fn load_report(&self) -> LoadReport {
        let ours = self.inner.in_flight.load(Ordering::Acquire);
        let ours = u32::try_from(ours).unwrap_or(u32::MAX);
        let (engine, adapters) = match self.inner.api.metrics(Duration::from_secs(2)).await {
            Ok(text) => {
                let samples = prom::parse(&text);
                (
                    prom::load(self.inner.config.engine, &samples),
                    prom::adapters(&samples),
                )
            }
            Err(e) => {
                tracing::debug!(error = %e, "engine metrics unavailable");
                (None, None)
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
            adapters: adapters.unwrap_or_default(),
            // Not measured behind an external engine: the router weighs it at the pool's
            // median speed.
            ..LoadReport::default()
        }
    }

    fn in_flight(&self) -> u64 {
        self.inner.in_flight.load(Ordering::Acquire)
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

    async fn probe(&self, timeout: Duration) -> Result<(), String> {
        // Without `/health` the probe is a request of the engine's API, and llama.cpp's Python
        // server ends the stream it is serving when another request arrives
        // (`interrupt_requests`, on by default: `llama_cpp/server/app.py`,
        // `get_event_publisher`). While requests are in flight, their progress stands for it;
        // none starts while the probe runs.
        let gate = match self.inner.api.has_health_route() {
            true => None,
            false => Some(self.inner.probe_gate.lock().await),
        };
        if gate.is_some() && self.in_flight() > 0 {
            return Ok(());
        }
        self.inner
            .api
            .health(timeout)
            .await
            .map_err(|e| e.to_string())
    }

    fn on_down(&self) {
        self.inner
            .stats
            .engine_outages
            .fetch_add(1, Ordering::Relaxed);
        // A restarted engine's cache is empty; whatever it held is gone.
        if let Some(relay) = &self.inner.relay {
            relay.reset("engine down");
        }
    }
}

/// Waits until the engine answers its health probe (it may still be loading weights).
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
                        "the engine at {} did not answer {} within {timeout:?}: {e}",
                        api.base_url(),
                        api.health_path()
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

mod service;
