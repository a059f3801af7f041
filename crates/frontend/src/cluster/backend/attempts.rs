//! Starting a request on a decode worker: attempts with re-routing under the retry budget
//! and backoff, hedging, and what each outcome tells the breakers and the TTFT history.

use super::*;
use tandem_protocol::AdapterId;

impl ClusterBackend {
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
        let hashes: Vec<SequenceHash> = compute_block_hashes(&job.prompt, bs, job.seed)
            .iter()
            .map(|h| h.sequence)
            .collect();
        let route = RouteRequest {
            overrides: job.overrides,
            priority: job.priority,
            adapter: job.adapter.as_deref().map(AdapterId::of),
            ..self
                .shared
                .cfg
                .routing
                .route_request(&job.prompt, bs, job.seed)
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
                .expected_output_tokens
                .map_or(job.max_tokens, |n| n.min(job.max_tokens)),
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
        let hedge_after = self.hedge_after(job.prompt.len() as u64);
        let mut others = excluded.to_vec();
        others.push(plan.decode.record.id);
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
        // No first token after the p95 of its size: start it on a second worker too, if the
        // budget allows and another worker is there.
        let hedge = {
            let now = self.shared.view.now_ms();
            let budget = self.shared.view.replica().write().try_retry(now);
            if budget {
                self.plan(prepared, &others, true).ok()
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
                    job.prompt.len() as u64,
                    u64::try_from(started_at.elapsed().as_millis()).unwrap_or(u64::MAX),
                );
                let route = RouteInfo {
                    decode_worker: decode.0,
                    prefill_worker: plan.prefill.as_ref().map(|p| p.record.id.0),
                };
                Ok(Started {
                    route,
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

/// An attempt's answer: the stream, its first chunk and the call's span, the worker's error,
/// or the deadline.
type Attempted = Result<
    Result<
        (
            tonic::Streaming<GenerateChunk>,
            GenerateChunk,
            tracing::Span,
        ),
        Status,
    >,
    tokio::time::error::Elapsed,
>;

/// Why an attempt produced no first token.
enum Failed {
    /// The request's deadline passed.
    Deadline,
    /// The decode worker failed it.
    Worker(WorkerId, Status),
}

/// Whether a failure is the worker's (and counts toward its breaker): transport errors,
/// timeouts, its internal errors, a worker cancelling (shutting down) — never the client's
/// own errors or a worker saying it is busy.
fn counts_against_worker(status: &Status) -> bool {
    matches!(
        ErrorClass::of_status(status),
        ErrorClass::Unavailable | ErrorClass::Internal | ErrorClass::Cancelled
    )
}
