//! tandem's decode worker (docs/ARCHITECTURE.md §1, §6, §7): serves `Generate`. A request prefills
//! here, or — when the frontend names a prefill worker — reserves blocks for the part of the
//! prompt it does not cache and has the prefill worker compute them and write their KV
//! straight into those blocks of this worker's arena (exposed once on the KV transport; or
//! inline on the gRPC stream without one), checks the digest in place, adds them to its
//! prefix cache (published as stored) and decodes. If the prefill worker fails, times out,
//! sends bad KV, or there is no room for the reservation, the request prefills here instead:
//! it completes either way, and the first chunk says which way it went.
//!
//! Blocks a transfer writes into are held until the transfer is over: `PrefillDone` (the
//! prefill worker flushed first), or, for an abandoned one, its `AbortPrefill` answer, a
//! refused connection (its process is gone) or the fence timeout ([`remote::fence`]). So a
//! late write can never land in blocks that another request or the prefix cache uses.
//!
//! The aggregated role is this worker without a prefill pool.
//!
//! A draining worker hands its streams over (unless `drain_handover` is off): each stream
//! past its first token gets a `handover` chunk, and its frontend continues the request on
//! another decode worker — prompt plus the tokens it has — with this worker as the remote
//! prefill. This worker serves that `Prefill` as a prefill worker would
//! ([`tandem_prefill_worker::PrefillService`] over the same engine): the blocks of the
//! stream's tokens are in its prefix cache, so only the last partial block is computed and
//! the rest is sent. The frontend then drops this worker's stream; a stream it does not move
//! (no other decode worker) finishes here, as without a handover.
//!
//! A client that goes away drops the response stream: the request is aborted here and its
//! remote prefill, if running, is cancelled, which aborts it on the prefill worker too.

pub mod remote;
mod whole;

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use futures::stream;
use tandem_engine::{EngineRequest, FinishReason};
use tandem_protocol::ErrorClass;
use tandem_protocol::grpc::{
    self, AbortPrefillReply, AbortPrefillRequest, GenerateChunk, GenerateRequest, PrefillChunk,
    PrefillOutcome, PrefillRequest,
};
use tandem_protocol::{HashSeed, RequestId, WorkerRole};
use tandem_runtime::shutdown::Shutdown;
use tandem_worker::{
    ChunkStream, EngineHost, HostOutput, RequestHandle, ServedEngine, WorkerCalls, WorkerConfig,
    WorkerContext, WorkerDeps, WorkerError,
};
use tokio::net::TcpListener;
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::Status;
use tracing::Instrument as _;

use crate::remote::{PrefillClients, TransferHold};
use tandem_prefill_worker::PrefillService;

/// Runs a decode (or aggregated) worker on `listener` until `shutdown`, then drains.
pub async fn run(
    config: WorkerConfig,
    listener: TcpListener,
    deps: WorkerDeps,
    shutdown: Shutdown,
) -> Result<(), WorkerError> {
    if config.role == WorkerRole::Prefill {
        return Err(WorkerError::InvalidRequest(
            "a decode worker cannot take the prefill role".into(),
        ));
    }
    let ctx = WorkerContext::start(config, &deps, &shutdown).await?;
    let service = Arc::new(DecodeService::new(ctx.clone()));
    ctx.serve(listener, service, deps, shutdown).await
}

/// Counters of the decode worker.
#[derive(Debug, Default)]
pub struct DecodeStats {
    pub remote_prefills: AtomicU64,
    /// Remote prefills that failed and were done locally instead.
    pub remote_prefill_fallbacks: AtomicU64,
    /// Abandoned transfers whose blocks were held until the prefill worker stopped writing.
    pub fences: AtomicU64,
    /// Of those, the ones released without confirmation (fence timeout).
    pub fence_timeouts: AtomicU64,
}

/// The gRPC `Worker` service of a decode worker.
#[derive(Clone, Debug)]
pub struct DecodeService {
    ctx: WorkerContext,
    clients: Arc<PrefillClients>,
    stats: Arc<DecodeStats>,
    /// Serves `Prefill` from this worker's blocks: a drain's handovers.
    kv_source: Arc<PrefillService>,
    /// Cancelled when the worker drains with `drain_handover`: every stream offers its KV.
    handover: CancellationToken,
}

impl DecodeService {
    pub fn new(ctx: WorkerContext) -> Self {
        DecodeService {
            kv_source: Arc::new(PrefillService::for_held_blocks(ctx.clone())),
            ctx,
            clients: Arc::default(),
            stats: Arc::default(),
            handover: CancellationToken::new(),
        }
    }

    pub fn stats(&self) -> &DecodeStats {
        &self.stats
    }

    /// Starts the remote prefill of `req` from `target`, or falls back to a local prefill
    /// when this worker has no room for the reservation. Returns the handle and the shared
    /// prefill outcome, settled when the KV is in (or the fallback is decided).
    fn start_remote(
        &self,
        req: EngineRequest,
        target: grpc::RemotePrefillTarget,
        cancel: CancellationToken,
    ) -> Result<(RequestHandle, Arc<AtomicI32>), WorkerError> {
        let host = &self.ctx.host;
        // Blocks a transport writes into stay held until the transfer is over.
        let exposed = self.ctx.exposed.clone();
        let (handle, rp) = match host.begin_remote(req.clone(), exposed.is_some()) {
            Ok(x) => x,
            Err(WorkerError::Overloaded(why)) => {
                tracing::debug!(%why, "no room to reserve a remote prefill: local prefill");
                self.stats
                    .remote_prefill_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
                self.ctx.metrics.transfer_fallback();
                let handle = host.submit(req)?;
                return Ok((handle, outcome(PrefillOutcome::Fallback)));
            }
            Err(e) => return Err(e),
        };
        self.stats.remote_prefills.fetch_add(1, Ordering::Relaxed);
        let settled = outcome(PrefillOutcome::Unspecified);
        let wire = tandem_worker::WireSampling::of(&req.sampling);
        let prefill = PrefillRequest {
            request_id: req.id.0,
            prompt: req.prompt,
            hash_seed: req.hash_seed.0,
            sampling_seed: req.sampling_seed,
            temperature: wire.temperature,
            top_p: wire.top_p,
            top_k: wire.top_k,
            min_p: wire.min_p,
            logprobs: wire.logprobs,
            from_token: rp.cached_tokens as u32,
            block_size: self.ctx.config.engine.pool.block_size.get(),
            bytes_per_block: host.bytes_per_block() as u64,
            destination_blocks: Vec::new(),
            destination: String::new(),
            engine_handshake: false,
            cache_salt: String::new(),
            bootstrap_room: 0,
            lora_adapter: req.adapter.clone().unwrap_or_default(),
            skip_digest: !self.ctx.config.kv_digest,
            kv_element_bytes: self.ctx.config.kv_element_bytes(),
        };
        let mut prefill = prefill;
        let mut hold = None;
        if let Some(exposed) = &exposed {
            prefill.destination = exposed.descriptor.to_compact();
            prefill.destination_blocks = rp.blocks.clone();
            hold = Some(TransferHold::new(host.clone(), rp.blocks.clone()));
        }
        let abort = AbortPrefillRequest {
            request_id: req.id.0,
            destination: prefill.destination.clone(),
        };
        let (host, clients, stats) = (host.clone(), self.clients.clone(), self.stats.clone());
        let metrics = self.ctx.metrics.clone();
        let bytes = (rp.blocks.len() * host.bytes_per_block()) as u64;
        let (moved, held) = (
            rp.blocks.len() as u64,
            (rp.cached_tokens / self.ctx.config.engine.pool.block_size.get() as usize) as u64,
        );
        let timeout = self.ctx.config.prefill_timeout;
        let fence_timeout = self.ctx.config.transfer_fence_timeout;
        let stop = self.ctx.stopping();
        let out = settled.clone();
        let id = req.id;
        // The remote prefill's client span, under the `Generate` server span (current here).
        let call = tracing::info_span!(
            "tandem.v1.Worker/Prefill",
            otel.kind = "client",
            server.address = target.address.as_str(),
            tandem.worker = tandem_runtime::telemetry::int(target.worker_id),
            tandem.blocks = tandem_runtime::telemetry::int(rp.blocks.len() as u64),
            tandem.bytes = tandem_runtime::telemetry::int(bytes),
            tandem.outcome = tracing::field::Empty,
        );
        tandem_runtime::telemetry::set_attributes(
            &call,
            &[
                ("rpc.system", "grpc"),
                ("rpc.service", "tandem.v1.Worker"),
                ("rpc.method", "Prefill"),
            ],
        );
        let call_span = call.clone();
        self.ctx.tasks().spawn(
            async move {
                let started = std::time::Instant::now();
                let fetched = tokio::select! {
                    r = tokio::time::timeout(
                        timeout,
                        remote::fetch(
                            &clients, &host, exposed.as_ref(), hold.as_mut(), &target, prefill, &rp,
                            timeout,
                        ),
                    ) => Some(r),
                    // The client went away: the handle's drop aborted the request already.
                    _ = cancel.cancelled() => None,
                };
                if let Some(fetched) = fetched {
                    if settle(&host, &stats, &out, id, fetched, timeout) {
                        metrics.transfer_received(
                            moved,
                            held,
                            bytes,
                            started.elapsed().as_secs_f64(),
                        );
                        call_span.record("tandem.outcome", "remote");
                    } else {
                        metrics.transfer_fallback();
                        call_span.record("tandem.outcome", "fallback");
                        call_span.record("otel.status_code", "ERROR");
                    }
                }
                // Given up before the prefill worker said it was done: its writes may still come,
                // so the blocks stay held (the request has gone on with others) until they cannot.
                if let Some(hold) = hold.filter(TransferHold::is_held) {
                    stats.fences.fetch_add(1, Ordering::Relaxed);
                    let fenced =
                        remote::fence(&clients, &target.address, abort, hold, fence_timeout, stop)
                            .await;
                    if fenced == remote::Fenced::TimedOut {
                        stats.fence_timeouts.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(outcome) = fenced.metric_label() {
                        metrics.fence(outcome);
                    }
                }
            }
            .instrument(call),
        );
        Ok((handle, settled))
    }
}

/// Applies a remote prefill's result: the request continues with the received KV (true), or
/// prefills here (false).
fn settle(
    host: &EngineHost,
    stats: &DecodeStats,
    out: &AtomicI32,
    id: RequestId,
    fetched: Result<Result<remote::FirstToken, WorkerError>, tokio::time::error::Elapsed>,
    timeout: std::time::Duration,
) -> bool {
    let result = match fetched {
        Ok(Ok((first, logprobs))) => {
            out.store(PrefillOutcome::Remote as i32, Ordering::Release);
            host.finish_remote(id, first, logprobs)
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(WorkerError::BadTransfer(format!(
            "remote prefill timed out after {timeout:?}"
        ))),
    };
    if let Err(e) = result {
        tracing::warn!(request = id.0, error = %e, "remote prefill failed: prefilling locally");
        stats
            .remote_prefill_fallbacks
            .fetch_add(1, Ordering::Relaxed);
        out.store(PrefillOutcome::Fallback as i32, Ordering::Release);
        if let Err(e) = host.fail_remote(id) {
            // Aborted meanwhile: nothing left to do.
            tracing::debug!(request = id.0, error = %e, "fallback after abort");
        }
        return false;
    }
    true
}

fn outcome(o: PrefillOutcome) -> Arc<AtomicI32> {
    Arc::new(AtomicI32::new(o as i32))
}

/// The engine request of a `Generate` call, validated.
fn engine_request(req: &GenerateRequest) -> Result<EngineRequest, WorkerError> {
    let sampling = req
        .sampling
        .as_ref()
        .ok_or_else(|| WorkerError::InvalidRequest("sampling parameters missing".into()))?;
    if req.prompt.is_empty() {
        return Err(WorkerError::InvalidRequest("empty prompt".into()));
    }
    if sampling.max_tokens == 0 {
        return Err(WorkerError::InvalidRequest(
            "max_tokens must be at least 1".into(),
        ));
    }
    let mut r = EngineRequest::new(
        RequestId(req.request_id),
        req.prompt.clone(),
        sampling.max_tokens,
    );
    r.hash_seed = HashSeed(req.hash_seed);
    r.sampling_seed = sampling.seed;
    r.sampling = tandem_worker::sampling_params(sampling.into())?;
    r.stop_token = sampling.stop_token;
    r.ignore_eos = sampling.ignore_eos;
    // Empty: the base model (proto3's default).
    r.adapter = Some(req.lora_adapter.clone()).filter(|a| !a.is_empty());
    Ok(r)
}

/// The `Generate` stream: one chunk per token; the first carries how the prompt was
/// prefilled. Holds the cancel guard of the remote prefill, if any.
fn generate_stream(
    handle: RequestHandle,
    outcome: Arc<AtomicI32>,
    guard: DropGuard,
    span: tracing::Span,
    handover: CancellationToken,
) -> ChunkStream<GenerateChunk> {
    // `decode`: from the first token to the last, under the call's server span (which ends
    // with the stream).
    let decode = tracing::info_span!(parent: &span, "decode", tandem.output_tokens = 0i64);
    // `offer`: a drain's handover is still to be offered (once, past the first token).
    let state = Some((
        handle,
        outcome,
        (guard, span, decode, 0u64, handover, true),
        true,
    ));
    Box::pin(stream::unfold(state, |state| async move {
        let (mut handle, outcome, (guard, span, decode, tokens, handover, offer), first) = state?;
        loop {
            let next = if offer && !first {
                tokio::select! {
                    biased;
                    () = handover.cancelled() => None,
                    // Cancel-safe: a token not taken stays queued.
                    next = handle.next() => Some(next),
                }
            } else {
                Some(handle.next().await)
            };
            let Some(next) = next else {
                tracing::info!(tokens, "draining: offering the stream's KV for a handover");
                let chunk = GenerateChunk {
                    handover: true,
                    ..Default::default()
                };
                let state = (
                    handle,
                    outcome,
                    (guard, span, decode, tokens, handover, false),
                    false,
                );
                return Some((Ok(chunk), Some(state)));
            };
            match next {
                Some(Err(e)) => return Some((Err(Status::from(e)), None)),
                Some(Ok(HostOutput::Token(out))) => {
                    let finish = match out.finish {
                        None => grpc::FinishReason::Unspecified,
                        Some(FinishReason::Length) => grpc::FinishReason::Length,
                        Some(_) => grpc::FinishReason::Stop,
                    };
                    let prefill = if first {
                        outcome.load(Ordering::Acquire)
                    } else {
                        PrefillOutcome::Unspecified as i32
                    };
                    let chunk = GenerateChunk {
                        tokens: vec![out.token],
                        cached_tokens: out.cached_tokens as u32,
                        prompt_tokens: out.prompt_tokens as u32,
                        finish: finish as i32,
                        prefill,
                        logprobs: out
                            .logprobs
                            .as_deref()
                            .map(tandem_worker::logprobs_to_wire)
                            .into_iter()
                            .collect(),
                        embedding: out.embedding.map(Vec::from).unwrap_or_default(),
                        ..Default::default()
                    };
                    let tokens = tokens + 1;
                    decode.record(
                        "tandem.output_tokens",
                        tandem_runtime::telemetry::int(tokens),
                    );
                    if first {
                        span.record("tandem.prefill", prefill_name(prefill));
                    }
                    let next = out.finish.is_none().then_some((
                        handle,
                        outcome,
                        (guard, span, decode, tokens, handover, offer),
                        false,
                    ));
                    return Some((Ok(chunk), next));
                }
                // Decode workers never export blocks.
                Some(Ok(HostOutput::Blocks(_) | HostOutput::Computed { .. })) => continue,
                None => {
                    return Some((
                        Err(ErrorClass::Unavailable.status("decode worker stopped")),
                        None,
                    ));
                }
            }
        }
    }))
}

#[tonic::async_trait]
impl WorkerCalls for DecodeService {
    fn engine(&self) -> &dyn ServedEngine {
        &self.ctx
    }

    async fn generate(
        &self,
        req: GenerateRequest,
        span: tracing::Span,
    ) -> Result<ChunkStream<GenerateChunk>, Status> {
        let mut engine_req = engine_request(&req)?;
        if engine_req.stop_token.is_none() {
            // A real model ends its answer with its end-of-sequence token.
            engine_req.stop_token = self.ctx.config.native.as_ref().and_then(|n| n.eos_token);
        }
        let cancel = self.ctx.stopping().child_token();
        // An embedding is the prompt's last hidden state: only a local prefill computes it.
        let remote = req.remote_prefill.filter(|_| !engine_req.sampling.embed);
        let (handle, outcome) = match remote {
            None => (
                self.ctx.host.submit(engine_req)?,
                outcome(PrefillOutcome::Local),
            ),
            Some(target) => self.start_remote(engine_req, target, cancel.clone())?,
        };
        let chunks = generate_stream(
            handle,
            outcome,
            cancel.drop_guard(),
            span,
            self.handover.clone(),
        );
        Ok(if req.whole {
            whole::coalesced(chunks)
        } else {
            chunks
        })
    }

    async fn prefill(
        &self,
        req: PrefillRequest,
        span: tracing::Span,
    ) -> Result<ChunkStream<PrefillChunk>, Status> {
        self.kv_source.prefill(req, span).await
    }

    async fn abort_prefill(&self, req: AbortPrefillRequest) -> Result<AbortPrefillReply, Status> {
        self.kv_source.abort_prefill(req).await
    }

    fn on_drain(&self) {
        if self.ctx.config.drain_handover {
            self.handover.cancel();
        }
    }
}

/// A first chunk's prefill outcome, for the span.
fn prefill_name(outcome: i32) -> &'static str {
    match PrefillOutcome::try_from(outcome) {
        Ok(PrefillOutcome::Local) => "local",
        Ok(PrefillOutcome::Remote) => "remote",
        Ok(PrefillOutcome::Fallback) => "fallback",
        _ => "unknown",
    }
}
