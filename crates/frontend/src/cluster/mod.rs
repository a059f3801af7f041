//! The frontend and the standalone indexer as services over a live cluster (docs/ARCHITECTURE.md §1,
//! §4, §8): [`run_frontend`] serves the OpenAI API ([`crate::http`]) on a
//! [`ClusterBackend`]; [`run_indexer`] serves `FindMatches` from an index fed exactly as the
//! frontend's embedded one ([`ClusterView`]). Both are shells around a
//! [`tandem_router::RoutingReplica`]: the decisions and the index's rules are its; what lives
//! here is the I/O.
//!
//! Layout: `view.rs` (discovery → workers, gRPC clients and the replica's membership; event
//! plane → the replica; the repairs it asks for), `backend/` (the replica's plans → gRPC
//! calls to decode workers, replica sync; one file per stage of a request: `admission.rs`,
//! `attempt.rs` with re-routing under the retry budget, hedging and outcomes to the breakers,
//! `stream.rs` with migration), `indexer.rs`
//! (the `Indexer` gRPC service), `metrics.rs` (the view's gauges on `/metrics`, and what the
//! replica's tracker counts per worker, read at scrape time), `recent.rs` (bounded rings of
//! recent decisions, migrations and rejections) and `status.rs` (pools, workers and those
//! rings for the status page).

mod backend;
pub mod cache_health;
pub(crate) mod flow;
mod indexer;
pub(crate) mod metrics;
mod recent;
mod sessions;
mod status;
pub(crate) mod sync;
mod view;

use std::sync::Arc;
use std::time::Duration;

use tandem_runtime::discovery::Discovery;
use tandem_runtime::events::EventPlane;
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

pub use backend::{BackendConfig, ClusterBackend, HedgeConfig};
pub use indexer::IndexerService;
pub use metrics::RouteCounters;
pub use tandem_indexer::FeedStats;
pub use view::{ClusterView, Registry, ViewConfig, WorkerEntry};

use tandem_router::{FedIndex, RoutingReplica};

use crate::http::{self, HttpConfig, HttpState, Tokenizer, TokenizerSpec};

/// The outside services the frontend and the indexer use.
#[derive(Clone)]
pub struct ClusterDeps {
    pub discovery: Arc<dyn Discovery>,
    pub events: Arc<dyn EventPlane>,
}

impl std::fmt::Debug for ClusterDeps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterDeps").finish_non_exhaustive()
    }
}

/// Why a frontend or indexer could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("runtime: {0}")]
    Runtime(#[from] tandem_runtime::RuntimeError),
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

/// Everything a frontend needs.
#[derive(Clone, Debug)]
pub struct FrontendConfig {
    pub view: ViewConfig,
    pub http: HttpConfig,
    pub tokenizer: TokenizerSpec,
    pub backend: BackendConfig,
    /// How long a draining frontend lets responses in flight finish.
    pub drain_timeout: Duration,
    /// Backend groups (`--groups`), if any (`http/api/groups/`).
    pub groups: Option<crate::http::GroupsOptions>,
}

/// The cluster view over `deps` with its routing replica, and the metrics registry with the
/// view's gauges and the routing counters registered: what the frontend and the endpoint
/// picker both route with. `embedded`: the view keeps its own KV index.
pub(crate) async fn start_view(
    view: &ViewConfig,
    backend: &BackendConfig,
    embedded: bool,
    deps: &ClusterDeps,
    tasks: &TaskTracker,
    stop: &tokio_util::sync::CancellationToken,
) -> Result<
    (
        Arc<ClusterView>,
        prometheus_client::registry::Registry,
        Arc<metrics::RouteCounters>,
    ),
    ServiceError,
> {
    let mut view_cfg = view.clone();
    view_cfg.embedded_index = embedded;
    let replica = RoutingReplica::new(backend.replica_config())
        .map_err(|e| ServiceError::Config(format!("routing: {e}")))?;
    let view = ClusterView::start(
        view_cfg,
        replica,
        deps.discovery.clone(),
        deps.events.clone(),
        tasks.clone(),
        stop.clone(),
    )
    .await?;
    let mut registry = prometheus_client::registry::Registry::default();
    metrics::register(&mut registry, view.clone(), tasks, stop.clone());
    let counters = metrics::RouteCounters::register(&mut registry);
    registry.register_collector(Box::new(cache_health::CacheHealthMetrics {
        health: counters.cache.clone(),
        view: view.clone(),
    }));
    Ok((view, registry, counters))
}

/// Serves the OpenAI API on `listener` (and the operator's surfaces on `admin`: the status
/// page, `/status.json`, `/metrics`) until `shutdown` drains; then drains: `/health` turns
/// 503, new requests are refused, responses in flight finish (up to the drain timeout, or
/// until `shutdown` stops). Every task and token of the frontend hangs under `shutdown`.
pub async fn run_frontend(
    cfg: FrontendConfig,
    listener: TcpListener,
    admin: Option<TcpListener>,
    deps: ClusterDeps,
    shutdown: Shutdown,
) -> Result<(), ServiceError> {
    let tokenizer =
        Tokenizer::load(&cfg.tokenizer).map_err(|e| ServiceError::Config(e.to_string()))?;
    let tasks = TaskTracker::new();
    let stop = shutdown.stop_token().child_token();
    let embedded = cfg.backend.indexer_url.is_none();
    let (view, registry, counters) =
        start_view(&cfg.view, &cfg.backend, embedded, &deps, &tasks, &stop).await?;
    let backend = ClusterBackend::start(
        cfg.backend.clone(),
        view,
        counters,
        deps.events.clone(),
        &tasks,
        stop.clone(),
    )
    .await
    .map_err(|e| ServiceError::Config(e.message().to_string()))?;
    let mut state = HttpState::builder(Arc::new(backend), cfg.http.clone(), Arc::new(tokenizer))
        .registry(registry);
    if let Some(groups) = cfg.groups.clone() {
        state = state.groups(groups);
    }
    let state = state
        .build()
        .map_err(|e| ServiceError::Config(e.to_string()))?;
    let server_stop = stop.child_token();
    let addr = listener.local_addr()?;
    let admin_addr = admin.as_ref().map(TcpListener::local_addr).transpose()?;
    // Plain HTTP or TLS as `cfg.http.tls` says; the API keys file is reloaded meanwhile.
    let server = tokio::spawn(http::serve_state(
        listener,
        admin,
        state.clone(),
        server_stop.clone(),
    ));
    tracing::info!(
        %addr,
        admin = ?admin_addr,
        model = %cfg.http.served_model_name,
        lora_adapters = ?cfg.http.lora_adapters,
        "frontend serving"
    );

    shutdown.draining().await;
    state.start_draining();
    tracing::info!(in_flight = state.in_flight(), "frontend draining");
    let drained = tokio::select! {
        idle = tokio::time::timeout(cfg.drain_timeout, state.wait_idle()) => idle.is_ok(),
        () = shutdown.stopped() => false,
    };
    if !drained {
        tracing::warn!(
            in_flight = state.in_flight(),
            "drain timeout: closing with requests in flight"
        );
    }
    server_stop.cancel();
    stop.cancel();
    // Streams still open after the drain timeout end when their workers stop; do not wait
    // for them forever.
    let served = match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(r) => r,
        Err(_) => Ok(Ok(())),
    };
    tasks.close();
    tasks.wait().await;
    match served {
        Ok(r) => r.map_err(ServiceError::from),
        Err(e) => Err(ServiceError::Config(format!("server task: {e}"))),
    }
}

/// Serves `FindMatches` on `listener` from an index fed by the event plane, until `shutdown`
/// drains (it holds no requests to drain).
pub async fn run_indexer(
    mut cfg: ViewConfig,
    listener: TcpListener,
    deps: ClusterDeps,
    shutdown: Shutdown,
) -> Result<(), ServiceError> {
    cfg.embedded_index = true;
    let tasks = TaskTracker::new();
    let stop = shutdown.stop_token().child_token();
    // The index and its feed rules: the indexer routes nothing.
    let view = ClusterView::start(
        cfg,
        FedIndex::new(),
        deps.discovery,
        deps.events,
        tasks.clone(),
        stop.clone(),
    )
    .await?;
    let router = tonic::transport::Server::builder().add_service(
        tandem_protocol::grpc::indexer_server::IndexerServer::new(IndexerService::new(view)),
    );
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "indexer serving");
    let served =
        tandem_runtime::grpc::serve_tonic(router, listener, shutdown.drain_token().clone()).await;
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    served.map_err(ServiceError::from)
}
