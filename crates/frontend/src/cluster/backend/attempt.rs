//! Starting a request on a decode worker: its routing inputs ([`Prepared`]: block hashes, a
//! standalone indexer's overlap), the decision and the tracker entry ([`Plan`]), attempts with
//! re-routing under the retry budget and backoff, hedging, and what each outcome tells the
//! breakers and the TTFT history. Admission (admission.rs) comes before it, the started
//! request's output (stream.rs) after it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_indexer::OverlapScores;
use tandem_protocol::grpc::{
    FindMatchesRequest, GenerateChunk, GenerateRequest, RemotePrefillTarget, Sampling,
};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{AdapterId, ErrorClass, RequestId, SequenceHash, WorkerId};
use tandem_router::{RouteError, RouteInput, RouteRequest, SessionKey};
use tonic::Status;
use tracing::Instrument as _;

use super::trace::{record_decision, route_span};
use super::{ClusterBackend, Flight, Job};
use crate::cluster::flow::Admission;
use crate::cluster::metrics::Overhead;
use crate::cluster::view::WorkerEntry;
use crate::http::{RouteInfo, ServeError};

impl ClusterBackend {
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
    /// records it in the tracker. `admitted`: under flow control, saturated workers are left
    /// out and [`RouteError::Saturated`] means every one is.
    pub(super) fn plan(
        &self,
        p: &Prepared,
        excluded: &[WorkerId],
        admitted: bool,
    ) -> Result<Plan, RouteError> {
        let s = &self.shared;
        let request = RequestId(s.ids.lock().next_u64() >> 1);
        let input = RouteInput {
            request,
            route: p.route,
            hashes: &p.hashes,
            expected_output_tokens: u64::from(p.expected_output_tokens),
            overlap: p.scores.as_ref(),
            session: p.session,
        };
        let now = s.view.now_ms();
        let registry = s.view.registry();
        let span = route_span(&p.span);
        let _entered = span.enter();
        let (plan, sessions) = {
            let mut replica = s.view.replica().write();
            let started = Instant::now();
            let plan = if admitted {
                replica.route_admitted(&input, excluded, now)?
            } else {
                replica.route(&input, excluded, now)?
            };
            let routed = started.elapsed();
            let lookup = replica.last_index_lookup();
            s.counters.overhead(Overhead {
                index: p.overhead.index + lookup,
                score: routed.saturating_sub(lookup),
                ..p.overhead
            });
            (plan, replica.sessions().len())
        };
        if let Some(outcome) = plan.session {
            s.counters.flow.sessions.routed(outcome, sessions);
        }
        s.counters
            .flow
            .recent
            .decision(request, &p.route, excluded.len(), &plan.decision);
        record_decision(&span, &plan.decision, excluded.len());
        for m in plan.sync.iter().cloned() {
            self.sync(m);
        }
        let flight = Flight {
            backend: self.clone(),
            worker: plan.decode_worker(),
            inner: plan.flight,
        };
        // What the index says the decode worker holds, when it prefills there (the cache
        // health's prediction).
        let predicted = match plan.decision.prefill {
            Some(_) => 0,
            None => {
                let blocks = plan
                    .decision
                    .decode
                    .chosen_terms()
                    .map_or(0, |t| u64::from(t.overlap.total()));
                let tokens = blocks.saturating_mul(u64::from(p.route.block_size.get()));
                u32::try_from(tokens.min(p.route.prompt_tokens)).unwrap_or(u32::MAX)
            }
        };
        let entry = |id: WorkerId| registry.get(id).cloned();
        // Discovery may have removed it between the replica's decision and here (the flight
        // is released as it drops).
        let decode = entry(plan.decode_worker()).ok_or(RouteError::AllExcluded)?;
        Ok(Plan {
            decode,
            prefill: plan.prefill_worker().and_then(entry),
            flight,
            predicted,
        })
    }

    /// [`Self::plan`] for a started request (a retry): off saturated workers when possible,
    /// never queued.
    fn plan_retry(&self, p: &Prepared, excluded: &[WorkerId]) -> Result<Plan, ServeError> {
        match self.plan(p, excluded, true) {
            Err(RouteError::Saturated) => self.plan(p, excluded, false),
            r => r,
        }
        .map_err(route_error)
    }

    /// Starts the plan on its decode worker and waits for the first chunk.
    async fn attempt(
        &self,
        plan: &Plan,
        job: &Job,
    ) -> Result<(Chunks, GenerateChunk, tracing::Span), Status> {
        let greq = GenerateRequest {
            request_id: plan.flight.inner.request().0,
            prompt: job.req.prompt_tokens.clone(),
            sampling: Some(Sampling {
                max_tokens: job.req.max_tokens,
                seed: job.sampling_seed,
                temperature: job.req.temperature,
                stop_token: None,
                ignore_eos: job.req.ignore_eos,
                // 1 is every engine's default: not sent, so the engine's own applies (as
                // top_k 0 and min_p 0: off).
                top_p: (job.req.top_p < 1.0).then_some(job.req.top_p),
                top_k: (job.req.top_k > 0).then_some(job.req.top_k),
                min_p: (job.req.min_p > 0.0).then_some(job.req.min_p),
                logprobs: job.req.logprobs.map(u32::from),
                embed: job.req.embed,
            }),
            hash_seed: job.seed.0,
            remote_prefill: job.kv_from.clone().or_else(|| {
                plan.prefill.as_ref().map(|p| RemotePrefillTarget {
                    worker_id: p.record.id.0,
                    address: p.record.addresses.grpc.clone(),
                })
            }),
            cache_salt: job.req.cache_salt.clone().unwrap_or_default(),
            lora_adapter: job.req.adapter.clone().unwrap_or_default(),
            // Rendered only for an engine that takes text (a plain OpenAI-compatible server).
            text: plan
                .decode
                .record
                .takes_text
                .then(|| job.req.source.as_ref().map(|s| s.text()))
                .flatten(),
            // Nothing here reads the tokens before the end: the answer may come in one piece
            // (stop strings are cut here as they stream; a hedge waits for a first token).
            whole: !job.req.stream && job.req.stop.is_empty() && self.shared.cfg.hedge.is_none(),
        };
        let span = tracing::info_span!(
            "tandem.v1.Worker/Generate",
            otel.kind = "client",
            server.address = plan.decode.record.addresses.grpc.as_str(),
            tandem.worker = tandem_runtime::telemetry::int(plan.decode.record.id.0),
            tandem.remote_prefill = plan.prefill.is_some(),
        );
        tandem_runtime::telemetry::set_attributes(
            &span,
            &[
                ("rpc.system", "grpc"),
                ("rpc.service", "tandem.v1.Worker"),
                ("rpc.method", "Generate"),
            ],
        );
        let mut call = tonic::Request::new(greq);
        tandem_runtime::telemetry::inject_metadata(&span, call.metadata_mut());
        // A worker of this process is called directly, its messages never encoded.
        let direct = tandem_runtime::grpc::direct_worker(&plan.decode.record.addresses.grpc);
        let (stream, first) = async {
            let mut stream = match direct {
                Some(worker) => Chunks::Direct(worker.generate_direct(call).await?.into_inner()),
                // The client is cloned only for a call that goes through it.
                None => {
                    let mut client = plan.decode.client.clone();
                    Chunks::Grpc(Box::new(client.generate(call).await?.into_inner()))
                }
            };
            let first = stream
                .message()
                .await?
                .ok_or_else(|| Status::unavailable("the worker ended the stream before a token"))?;
            Ok::<_, Status>((stream, first))
        }
        .instrument(span.clone())
        .await
        .inspect_err(|status| {
            span.record("otel.status_code", "ERROR");
            span.record("rpc.grpc.status_code", status.code() as i32);
        })?;
        Ok((stream, first, span))
    }

    /// Routes `job` and starts it. A decode worker that fails before the first token is
    /// excluded and the request re-routed, up to `max_attempts`, each retry taken from the
    /// retry budget and after an exponential backoff with jitter; with hedging on, a request
    /// still without a first token after its size's p95 TTFT is also started on a second
    /// worker, and the first to stream wins. `admission`: a new request, planned through
    /// flow control (continuations after a migration are not).
    pub(super) async fn start_job(
        &self,
        job: &Job,
        excluded: &mut Vec<WorkerId>,
        admission: Option<&Admission>,
    ) -> Result<Started, ServeError> {
        let bs = self.shared.view.config().block_size;
        let hashing = Instant::now();
        let hashes: Vec<SequenceHash> = compute_block_hashes(&job.req.prompt_tokens, bs, job.seed)
            .iter()
            .map(|h| h.sequence)
            .collect();
        let route = RouteRequest {
            overrides: job.req.routing.overrides,
            priority: job.req.priority,
            adapter: job.req.adapter.as_deref().map(AdapterId::of),
            // An embedding is the last hidden state of the prompt's own prefill.
            local_prefill: job.req.embed,
            ..self
                .shared
                .cfg
                .routing
                .route_request(&job.req.prompt_tokens, bs, job.seed)
        };
        let hash = hashing.elapsed();
        let looking = Instant::now();
        let scores = self.remote_matches(&hashes).await;
        let index = if scores.is_some() {
            looking.elapsed()
        } else {
            Duration::ZERO
        };
        let prepared = Arc::new(Prepared {
            route,
            hashes,
            scores,
            overhead: Overhead {
                hash,
                index,
                score: Duration::ZERO,
            },
            span: tracing::Span::current(),
            expected_output_tokens: job
                .req
                .routing
                .expected_output_tokens
                .map_or(job.req.max_tokens, |n| n.min(job.req.max_tokens)),
            session: job.session,
        });
        let mut plan = match admission {
            Some(a) => {
                let now = self.shared.view.now_ms();
                let me = self.clone();
                self.shared
                    .gate
                    .acquire(a, prepared.clone(), now, job.deadline, |p| {
                        me.plan(p, &[], true)
                    })
                    .instrument(tracing::info_span!(
                        "queue",
                        tandem.tenant = a.tenant.as_ref(),
                        tandem.priority = a.priority.as_str(),
                    ))
                    .await?
            }
            None => self.plan_retry(&prepared, excluded)?,
        };
        let mut tries = 0;
        let last = loop {
            tries += 1;
            let status = match self.attempt_hedged(plan, &prepared, job, excluded).await {
                Ok(started) => return Ok(started),
                Err(Failed::Deadline) => {
                    return Err(ServeError::deadline_exceeded(
                        "the request's deadline passed before its first token",
                    ));
                }
                Err(Failed::Worker(worker, status)) if retryable(&status) => {
                    tracing::warn!(
                        worker = worker.0,
                        %status,
                        "decode worker failed before the first token: re-routing"
                    );
                    excluded.push(worker);
                    self.shared.counters.reroute();
                    status
                }
                Err(Failed::Worker(_, status)) => return Err(status_to_error(&status)),
            };
            if tries >= self.shared.cfg.max_attempts.max(1) {
                break status;
            }
            let now = self.shared.view.now_ms();
            if !self.shared.view.replica().write().try_retry(now) {
                self.shared.counters.retry("budget_exhausted");
                tracing::warn!("retry budget spent: not re-routing");
                break status;
            }
            self.shared.counters.retry("retried");
            self.backoff(tries, job.deadline).await;
            plan = self.plan_retry(&prepared, excluded)?;
        };
        Err(status_to_error(&last))
    }

    /// Sleeps before retry `n` (1 for the first): full jitter over `base * 2^(n-1)`, capped,
    /// and never past the deadline.
    async fn backoff(&self, n: u32, deadline: tokio::time::Instant) {
        let cfg = &self.shared.cfg;
        let cap = cfg
            .retry_backoff
            .saturating_mul(1 << (n - 1).min(16))
            .min(cfg.retry_backoff_max);
        let unit = (self.shared.ids.lock().next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let wait = cap.mul_f64(unit);
        tokio::time::sleep_until((tokio::time::Instant::now() + wait).min(deadline)).await;
    }

    /// Runs one attempt, hedged when configured, and records every outcome in the breakers.
    async fn attempt_hedged(
        &self,
        plan: Plan,
        prepared: &Prepared,
        job: &Job,
        excluded: &[WorkerId],
    ) -> Result<Started, Failed> {
        let started_at = tokio::time::Instant::now();
        let hedge_after = self.hedge_after(job.req.prompt_tokens.len() as u64);
        let decode = plan.decode.record.id;
        let primary = self.attempt_owned(plan, job);
        tokio::pin!(primary);
        let first = match hedge_after {
            None => Some((&mut primary).await),
            Some(after) => tokio::select! {
                r = &mut primary => Some(r),
                () = tokio::time::sleep(after) => None,
            },
        };
        if let Some((plan, r)) = first {
            return self.settle(plan, r, started_at, job);
        }
        // The race with a second worker, boxed: its second attempt's state would otherwise
        // be carried in every request's future, hedged or not (most are not).
        let mut others = excluded.to_vec();
        others.push(decode);
        Box::pin(self.hedge(primary, prepared, job, &others, started_at)).await
    }

    /// No first token after the p95 of its size: the request is started on a second worker
    /// too, if the budget allows and another worker is there, and the first to stream wins.
    async fn hedge(
        &self,
        mut primary: std::pin::Pin<&mut impl Future<Output = (Plan, Attempted)>>,
        prepared: &Prepared,
        job: &Job,
        others: &[WorkerId],
        started_at: tokio::time::Instant,
    ) -> Result<Started, Failed> {
        let hedge = {
            let now = self.shared.view.now_ms();
            let budget = self.shared.view.replica().write().try_retry(now);
            if budget {
                self.plan(prepared, others, true).ok()
            } else {
                self.shared.counters.hedge("budget_exhausted");
                None
            }
        };
        let Some(hedge) = hedge else {
            let (plan, r) = primary.await;
            return self.settle(plan, r, started_at, job);
        };
        self.shared.counters.hedge("started");
        let secondary = self.attempt_owned(hedge, job);
        tokio::pin!(secondary);
        let (mut a_done, mut b_done) = (false, false);
        let mut failure = Failed::Deadline;
        while !(a_done && b_done) {
            let (won, plan, r) = tokio::select! {
                (plan, r) = &mut primary, if !a_done => {
                    a_done = true;
                    ("primary_won", plan, r)
                }
                (plan, r) = &mut secondary, if !b_done => {
                    b_done = true;
                    ("hedge_won", plan, r)
                }
            };
            // The loser's stream and plan drop with this function's futures: its worker
            // stops and frees its blocks, its tracker entry leaves.
            match self.settle(plan, r, started_at, job) {
                Ok(started) => {
                    self.shared.counters.hedge(won);
                    return Ok(started);
                }
                Err(f) => failure = f,
            }
        }
        Err(failure)
    }

    /// [`Self::attempt`] under the job's deadline, owning its plan.
    async fn attempt_owned(&self, plan: Plan, job: &Job) -> (Plan, Attempted) {
        let r = tokio::time::timeout_at(job.deadline, self.attempt(&plan, job)).await;
        (plan, r)
    }

    /// The hedging delay for a prompt of `prompt_tokens`: None when hedging is off or the
    /// size has too few samples yet.
    fn hedge_after(&self, prompt_tokens: u64) -> Option<Duration> {
        let h = self.shared.cfg.hedge?;
        let ms = self
            .shared
            .ttft
            .lock()
            .quantile_ms(prompt_tokens, h.quantile)?;
        Some(Duration::from_millis(ms.max(h.min_delay_ms)))
    }

    /// Records an attempt's outcome (breakers, TTFT history) and turns it into the answer.
    fn settle(
        &self,
        mut plan: Plan,
        r: Attempted,
        started_at: tokio::time::Instant,
        job: &Job,
    ) -> Result<Started, Failed> {
        let s = &self.shared;
        let now = s.view.now_ms();
        let decode = plan.decode.record.id;
        match r {
            Err(_) => Err(Failed::Deadline),
            Ok(Ok((rest, first, span))) => {
                plan.flight.first_token();
                s.counters.prefill(&first);
                {
                    let mut replica = s.view.replica().write();
                    replica.worker_succeeded(decode, now);
                    if let Some(p) = &plan.prefill {
                        use tandem_protocol::grpc::PrefillOutcome;
                        // A fallback (the decode worker prefilled locally) is not counted
                        // against the prefill worker: most are a prefill queue longer than
                        // the decode worker's patience, i.e. load, and a breaker opened by
                        // load would only move more of it onto the others. A dead prefill
                        // worker leaves with its lease.
                        if let Ok(PrefillOutcome::Remote) = PrefillOutcome::try_from(first.prefill)
                        {
                            replica.worker_succeeded(p.record.id, now);
                        }
                    }
                }
                s.ttft.lock().record(
                    job.req.prompt_tokens.len() as u64,
                    u64::try_from(started_at.elapsed().as_millis()).unwrap_or(u64::MAX),
                );
                let route = RouteInfo {
                    decode_worker: decode.0,
                    prefill_worker: plan.prefill.as_ref().map(|p| p.record.id.0),
                };
                let check = HitCheck {
                    predicted: plan.predicted,
                    kv_events: plan.decode.record.kv_events,
                    text: plan.decode.record.takes_text,
                };
                Ok(Started {
                    route,
                    check,
                    decode: RemotePrefillTarget {
                        worker_id: decode.0,
                        address: plan.decode.record.addresses.grpc.clone(),
                    },
                    first,
                    rest,
                    flight: plan.flight,
                    span,
                })
            }
            Ok(Err(status)) => {
                if counts_against_worker(&status)
                    && s.view.replica().write().worker_failed(decode, now)
                {
                    tracing::warn!(worker = decode.0, %status, "circuit breaker opened");
                }
                Err(Failed::Worker(decode, status))
            }
        }
    }
}

/// A decode worker's `Generate` stream: over gRPC, or from a worker of this process called
/// directly (`tandem_runtime::grpc::direct_worker`: no encoding on either side).
pub(super) enum Chunks {
    /// Boxed: a `Streaming` is a few hundred bytes, a direct stream one pointer.
    Grpc(Box<tonic::Streaming<GenerateChunk>>),
    Direct(tandem_protocol::grpc::ChunkStream),
}

impl Chunks {
    /// The next chunk, `None` at the stream's end.
    pub(super) async fn message(&mut self) -> Result<Option<GenerateChunk>, tonic::Status> {
        match self {
            Chunks::Grpc(s) => s.message().await,
            Chunks::Direct(s) => futures::StreamExt::next(s).await.transpose(),
        }
    }
}

/// An attempt's answer: the stream, its first chunk and the call's span, the worker's error,
/// or the deadline.
type Attempted =
    Result<Result<(Chunks, GenerateChunk, tracing::Span), Status>, tokio::time::error::Elapsed>;

/// Why an attempt produced no first token.
pub(super) enum Failed {
    /// The request's deadline passed.
    Deadline,
    /// The decode worker failed it.
    Worker(WorkerId, Status),
}

/// Whether a failure is the worker's (and counts toward its breaker): transport errors,
/// timeouts, its internal errors, a worker cancelling (shutting down) — never the client's
/// own errors or a worker saying it is busy.
pub(super) fn counts_against_worker(status: &Status) -> bool {
    matches!(
        ErrorClass::of_status(status),
        ErrorClass::Unavailable | ErrorClass::Internal | ErrorClass::Cancelled
    )
}

/// A routing decision for one attempt, with the workers' clients and the request's place in
/// the tracker (released when the plan, or the run holding its flight, is dropped).
pub(super) struct Plan {
    pub(super) decode: Arc<WorkerEntry>,
    pub(super) prefill: Option<Arc<WorkerEntry>>,
    pub(super) flight: Flight,
    /// Prompt tokens the index says the decode worker holds (0 with a remote prefill).
    pub(super) predicted: u32,
}

/// What the cache health compares a finished request with (`cache_health.rs`).
#[derive(Clone, Copy, Debug)]
pub(super) struct HitCheck {
    pub(super) predicted: u32,
    pub(super) kv_events: bool,
    /// The engine reads the prompt as text, with its own tokenizer: its count is not ours.
    pub(super) text: bool,
}

/// What routing a request needs, computed once per job (and held while it waits in the
/// queue).
pub(super) struct Prepared {
    pub(super) route: RouteRequest,
    pub(super) hashes: Vec<SequenceHash>,
    pub(super) scores: Option<OverlapScores>,
    /// Output tokens the tracker counts the request for: its expected length, else
    /// `max_tokens`.
    pub(super) expected_output_tokens: u32,
    pub(super) session: Option<SessionKey>,
    /// The router's time on it before the decision: hashing, and a standalone indexer's
    /// lookup (zero when the replica's own index answers, timed in [`Self::plan`]).
    pub(super) overhead: Overhead,
    /// The request's span: its `route` spans hang under it (a queued request is planned by
    /// whichever task dispatches it).
    pub(super) span: tracing::Span,
}

/// A request started on a decode worker, its first chunk in hand.
pub(super) struct Started {
    pub(super) route: RouteInfo,
    pub(super) check: HitCheck,
    /// The decode worker streaming it (the source of a handover's KV).
    pub(super) decode: RemotePrefillTarget,
    pub(super) first: GenerateChunk,
    pub(super) rest: Chunks,
    pub(super) flight: Flight,
    /// The gRPC call's client span, open while its stream is read.
    pub(super) span: tracing::Span,
}

/// A routing error as the client sees it.
pub(super) fn route_error(e: RouteError) -> ServeError {
    match e {
        RouteError::NoWorkers => ServeError::unavailable("no decode workers are registered"),
        RouteError::AllExcluded => {
            ServeError::unavailable("every decode worker failed this request")
        }
        e => ServeError::from(e),
    }
}

/// Whether another decode worker may succeed where this one failed (before any token).
pub(super) fn retryable(status: &Status) -> bool {
    ErrorClass::of_status(status).may_succeed_elsewhere()
}

pub(super) fn status_to_error(status: &Status) -> ServeError {
    let message = status.message().to_string();
    match ErrorClass::of_status(status) {
        ErrorClass::InvalidRequest => ServeError::invalid(message),
        ErrorClass::Overloaded => ServeError::overloaded(message, Duration::from_secs(1)),
        ErrorClass::Unavailable | ErrorClass::Cancelled | ErrorClass::Internal => {
            ServeError::unavailable(format!("worker failed: {message}"))
        }
    }
}
