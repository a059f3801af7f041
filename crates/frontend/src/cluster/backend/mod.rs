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
//!
//! A request passes three stages, one file each: `admission.rs` (tenant limits and budget,
//! the session cap, the pump that dispatches the flow queue), `attempt.rs` (routing inputs,
//! the decision, attempts, retries and hedges up to the first token) and `stream.rs` (the
//! output, and its migration when the decode worker fails mid-stream). This file holds what
//! they share: the backend, the job, and the request's place in the tracker.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tandem_protocol::grpc::{RemotePrefillTarget, indexer_client::IndexerClient};
use tandem_protocol::{HashSeed, WorkerId};
use tandem_router::{FlowQueue, InFlight, Rng, SessionKey, SyncMessage, TenantLimits, TtftHistory};
use tandem_runtime::events::EventPlane;
use tandem_runtime::grpc::Transport;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::flow::Gate;
use super::metrics::RouteCounters;
use super::sessions::SessionLimiter;
use super::sync::ReplicaSync;
use super::view::ClusterView;
use crate::http::{Backend, Generation, ServeError, ValidRequest};
use admission::Admitted;
use attempt::{Plan, Prepared};
use stream::Run;

mod admission;
mod attempt;
mod config;
mod stream;
mod trace;

pub use config::{BackendConfig, HedgeConfig};

struct Shared {
    view: Arc<ClusterView>,
    counters: Arc<RouteCounters>,
    cfg: BackendConfig,
    /// Request ids and sampling seeds: drawn apart from the replica's generator, so that the
    /// routing decisions draw exactly what the simulator's do.
    ids: Mutex<Rng>,
    indexer: Option<IndexerClient<Transport>>,
    sync: Option<ReplicaSync>,
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
                // Per serving thread, as the workers' (`tandem_runtime::grpc::NetTransport`).
                let ch = tandem_runtime::grpc::transport(url, cfg.connect_timeout)
                    .map_err(|e| ServeError::internal(format!("indexer address: {e}")))?;
                Some(IndexerClient::new(ch))
            }
            None => None,
        };
        let sync = if cfg.replica_sync {
            let gauge = counters.sync_peers.clone();
            let sync =
                ReplicaSync::on_view(cfg.router_id, &view, events, gauge, (tasks, cancel.clone()))
                    .await
                    .map_err(|e| ServeError::unavailable(format!("event plane: {e}")))?;
            Some(sync)
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
            sync,
            cfg,
        });
        ClusterBackend {
            shared: shared.clone(),
        }
        .spawn_pump(tasks, cancel.clone());
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

    /// Ends a request's tracking and tells the peers.
    fn end(&self, flight: InFlight) {
        let now = self.shared.view.now_ms();
        let msgs = self.shared.view.replica().write().finish(flight, now);
        for m in msgs {
            self.sync(m);
        }
    }

    fn sync(&self, msg: SyncMessage) {
        if let Some(sync) = &self.shared.sync {
            sync.send(msg);
        }
    }
}

/// What is sent to a decode worker: the validated request as the edge handed it over, or its
/// continuation after a migration or a handover (its prompt + the tokens generated so far, the
/// rest of its token budget), and what the backend adds to it.
#[derive(Clone, Debug)]
struct Job {
    req: ValidRequest,
    /// The block-hash seed of its cache salt and adapter.
    seed: HashSeed,
    /// The request's sampling seed, or one drawn for it (every attempt samples alike).
    sampling_seed: u64,
    /// Past it the request is cancelled (continuations keep the original's). Tokio's
    /// instant, for the tests on paused time.
    deadline: tokio::time::Instant,
    /// Its session, keyed with its tenant.
    session: Option<SessionKey>,
    /// A handover's continuation: the draining decode worker that holds its KV, asked for
    /// it as the remote prefill whatever the router would pick.
    kv_from: Option<RemotePrefillTarget>,
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

#[async_trait::async_trait]
impl Backend for ClusterBackend {
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError> {
        let engine = req.engine.clone();
        let s = &self.shared;
        if s.view.registry().decode.is_empty() {
            return Err(ServeError::unavailable("no decode workers are registered"));
        }
        let Admitted {
            admission,
            mut usage,
            job,
            session,
        } = self.admit(req).await?;
        let mut excluded = Vec::new();
        let started = self
            .start_job(&job, &mut excluded, Some(&admission))
            .await?;
        s.gate.begin(&admission.tenant);
        usage.begun = true;
        let route = started.route;
        let check = route.prefill_worker.is_none().then_some(started.check);
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
            check,
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

    fn try_retry(&self) -> bool {
        let now = self.shared.view.now_ms();
        self.shared.view.replica().write().try_retry(now)
    }

    fn ready(&self) -> bool {
        !self.shared.view.registry().decode.is_empty()
    }

    fn status(&self) -> Option<serde_json::Value> {
        let s = &self.shared;
        serde_json::to_value(super::status::cluster_status(
            &s.view,
            &s.counters.flow.recent,
            &s.counters.cache,
        ))
        .ok()
    }
}
