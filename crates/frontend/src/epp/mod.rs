//! `tandem epp`: the frontend's router as a Gateway API Inference Extension endpoint picker
//! (docs/ARCHITECTURE.md §9). A Kubernetes gateway (Envoy) asks it, over Envoy's external processing
//! protocol, where each inference request of an `InferencePool` should go; it reads the
//! request body, tokenizes it as the frontend does (chat template included), routes it with
//! the KV index and the active-sequence tracker under the frontend's flow control, and
//! answers with the chosen model server's `ip:port` (then fallbacks) in the
//! `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata. The gateway
//! then sends the request to that engine itself: the picker never sees tokens.
//!
//! Protocol: GIE's endpoint picker protocol v1
//! (kubernetes-sigs/gateway-api-inference-extension,
//! docs/proposals/004-endpoint-picker-protocol/README.md) over Envoy's ext_proc
//! (envoyproxy/data-plane-api, envoy/service/ext_proc/v3/external_processor.proto; our
//! trimmed copies are in proto/envoy/). The stream handling is `exchange.rs`, routing and the
//! tracker's entry `picker.rs`.
//!
//! gRPC health (grpc.health.v1, as the protocol's "Health Checking" names the services):
//! `liveness` serves while the process does; `readiness`,
//! `envoy.service.ext_proc.v3.ExternalProcessor` and the empty service name serve while a
//! worker with an HTTP endpoint is registered, and turn NOT_SERVING when none is, or while
//! draining.
//!
//! Pickable workers are the decode (and aggregated) workers whose record names an HTTP
//! endpoint ([`tandem_protocol::WorkerAddresses::http`]): sidecars in front of vLLM or
//! SGLang register their engine's. Mocker workers serve no HTTP and are never picked.

mod exchange;
mod picker;
mod proto;

use std::sync::Arc;
use std::time::Duration;

use axum::response::IntoResponse;
use futures::StreamExt;
use parking_lot::Mutex;
use tandem_router::FlowQueue;
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use crate::cluster::flow::{Gate, PUMP_TICK};
use crate::cluster::sync::ReplicaSync;
use crate::cluster::{BackendConfig, ClusterDeps, ServiceError, ViewConfig};
use crate::http::{BodyCheck, HttpConfig, Tokenizer, TokenizerSpec};
use picker::Picker;
use proto::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use proto::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};

/// The ext_proc service's name, as gRPC health reports it.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Answers queued per stream before the stream's task waits for Envoy to read them.
const STREAM_QUEUE: usize = 8;

/// Everything an endpoint picker needs: the frontend's view, HTTP (validation, template,
/// context length), tokenizer and routing / flow-control settings, and its own.
#[derive(Clone, Debug)]
pub struct EppConfig {
    pub view: ViewConfig,
    pub http: HttpConfig,
    pub tokenizer: TokenizerSpec,
    pub backend: BackendConfig,
    /// Endpoints named after the chosen one for the gateway to fall back on (the policy's
    /// next choices).
    pub fallbacks: usize,
    /// How long a draining picker keeps serving streams in flight.
    pub drain_timeout: Duration,
}

/// Serves ext_proc and gRPC health on `listener` (and Prometheus `/metrics` on
/// `metrics_listener`) until `shutdown` drains; then reports NOT_SERVING and lets streams in
/// flight end, up to the drain timeout.
pub async fn run_epp(
    cfg: EppConfig,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    deps: ClusterDeps,
    shutdown: Shutdown,
) -> Result<(), ServiceError> {
    let config = |e: &dyn std::fmt::Display| ServiceError::Config(e.to_string());
    let tokenizer = Arc::new(Tokenizer::load(&cfg.tokenizer).map_err(|e| config(&e))?);
    let body = Arc::new(BodyCheck::new(cfg.http.clone(), tokenizer).map_err(|e| config(&e))?);
    let tasks = TaskTracker::new();
    let stop = shutdown.stop_token().child_token();
    let (view, registry, counters) =
        crate::cluster::start_view(&cfg.view, &cfg.backend, true, &deps, &tasks, &stop).await?;
    let queue = FlowQueue::new(cfg.backend.flow)
        .map_err(|e| ServiceError::Config(format!("flow control: {e}")))?;
    let sync = if cfg.backend.replica_sync {
        // Shared with the frontends and other pickers of the namespace (docs/ARCHITECTURE.md §5).
        let (gauge, events) = (counters.sync_peers.clone(), deps.events.clone());
        let me = cfg.backend.router_id;
        Some(ReplicaSync::on_view(me, &view, events, gauge, (&tasks, stop.clone())).await?)
    } else {
        None
    };
    let picker = Arc::new(Picker {
        gate: Gate::new(queue, counters.flow.clone()),
        view: view.clone(),
        counters,
        body,
        routing: cfg.backend.routing,
        fallbacks: cfg.fallbacks,
        ids: Mutex::new(tandem_router::Rng::seed_from_u64(
            cfg.backend.seed ^ 0x6570_7000_0000_0000,
        )),
        sync,
    });
    start_housekeeping(&picker, &tasks, stop.clone());
    if let Some(l) = metrics_listener {
        serve_metrics(l, registry, &tasks, stop.clone())?;
    }

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let draining = CancellationToken::new();
    {
        let (p, d, s) = (picker.clone(), draining.clone(), stop.clone());
        tasks.spawn(async move {
            let mut last = None;
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = s.cancelled() => return,
                }
                let ready = p.ready() && !d.is_cancelled();
                if last == Some(ready) {
                    continue;
                }
                last = Some(ready);
                let status = if ready {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                for name in ["", "readiness", EXT_PROC_SERVICE] {
                    reporter.set_service_status(name, status).await;
                }
                tracing::info!(ready, "endpoint picker readiness");
            }
        });
    }
    let service = ExtProc {
        picker: picker.clone(),
        tasks: tasks.clone(),
        stop: stop.clone(),
    };
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(service));
    let addr = listener.local_addr()?;
    tracing::info!(%addr, model = %cfg.http.served_model_name, "endpoint picker serving");
    let serve_stop = CancellationToken::new();
    let server = tokio::spawn(tandem_runtime::grpc::serve_tonic(
        router,
        listener,
        serve_stop.clone(),
    ));

    shutdown.draining().await;
    draining.cancel();
    tracing::info!("endpoint picker draining");
    // Envoy sees NOT_SERVING and stops sending; streams in flight end with their responses.
    tokio::select! {
        () = tokio::time::sleep(cfg.drain_timeout) => {}
        () = shutdown.stopped() => {}
        () = wait_idle(&picker) => {}
    }
    serve_stop.cancel();
    stop.cancel();
    let served = match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(Ok(r)) => r.map_err(ServiceError::from),
        Ok(Err(e)) => Err(ServiceError::Config(format!("server task: {e}"))),
        Err(_) => Ok(()),
    };
    tasks.close();
    tasks.wait().await;
    served
}

/// Returns when no request is tracked in flight by this picker's replica (checked every
/// 100 ms; a short grace first, for Envoy to see NOT_SERVING).
async fn wait_idle(picker: &Picker) {
    tokio::time::sleep(Duration::from_secs(1)).await;
    loop {
        let busy = {
            let replica = picker.view.replica().read();
            replica
                .decode_workers()
                .any(|w| replica.tracker().load(w).to_worker_load().active_requests > 0)
        };
        if !busy {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The pump (queued requests dispatched as capacity frees) and the replica's expiry tick.
fn start_housekeeping(picker: &Arc<Picker>, tasks: &TaskTracker, stop: CancellationToken) {
    let (p, c) = (picker.clone(), stop.clone());
    tasks.spawn(async move {
        loop {
            let tick = if p.gate.is_empty() {
                Duration::from_secs(1)
            } else {
                PUMP_TICK
            };
            tokio::select! {
                () = p.gate.woken() => {}
                () = tokio::time::sleep(tick) => {}
                () = c.cancelled() => return,
            }
            let now = p.view.now_ms();
            p.gate.pump(now, |job| p.plan(job));
        }
    });
    let (p, c) = (picker.clone(), stop);
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let now = p.view.now_ms();
                    p.view.replica().write().expire(now);
                }
                () = c.cancelled() => return,
            }
        }
    });
}

/// `GET /metrics` (OpenMetrics text) on its own listener.
fn serve_metrics(
    listener: TcpListener,
    registry: prometheus_client::registry::Registry,
    tasks: &TaskTracker,
    stop: CancellationToken,
) -> Result<(), ServiceError> {
    let registry = Arc::new(registry);
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        text,
                    )
                        .into_response(),
                    Err(_) => axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                }
            }
        }),
    );
    tracing::info!(addr = %listener.local_addr()?, "endpoint picker metrics");
    tasks.spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::warn!(error = %e, "metrics listener failed");
        }
    });
    Ok(())
}

/// The ext_proc service: one task per stream, owned by the picker's task tracker.
struct ExtProc {
    picker: Arc<Picker>,
    tasks: TaskTracker,
    stop: CancellationToken,
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = futures::stream::BoxStream<'static, Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let exchange = exchange::Exchange::new(self.picker.clone());
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = exchange.run(inbound, tx) => {}
                () = stop.cancelled() => {}
            }
        });
        let out =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(out.boxed()))
    }
}
