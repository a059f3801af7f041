//! A started request's output: its stream from the decode worker, and its migration to
//! another one when that worker fails mid-stream.

use futures::StreamExt;
use tandem_protocol::WorkerId;
use tandem_protocol::grpc::{self, GenerateChunk, RemotePrefillTarget};

use super::admission::TenantUse;
use super::attempt::{Chunks, HitCheck};
use super::{ClusterBackend, Flight, Job};
use crate::cluster::cache_health::Observation;
use crate::cluster::sessions::SessionPermit;
use crate::http::{EngineReport, FinishReason, ServeError, TokenChunk, TokenLogprob};

/// A request's output as it streams: the current decode worker's stream and tracker entry,
/// and what is needed to migrate it when that worker fails mid-stream.
pub(super) struct Run {
    pub(super) backend: ClusterBackend,
    pub(super) job: Job,
    /// The decode worker streaming it now.
    pub(super) decode: RemotePrefillTarget,
    pub(super) excluded: Vec<WorkerId>,
    /// Tokens streamed so far (the prompt of a continuation).
    pub(super) generated: Vec<u32>,
    pub(super) migrations_left: u32,
    /// The first chunk of the current worker, not yet yielded.
    pub(super) pending: Option<GenerateChunk>,
    pub(super) rest: Chunks,
    pub(super) flight: Flight,
    /// Where the edge reads what the engine reported.
    pub(super) engine: EngineReport,
    pub(super) migrated: bool,
    /// The engine answers text, not token ids: no migration (nothing to continue from).
    pub(super) text_only: bool,
    /// What the cache health compares it with at its end, when it was prefilled where it
    /// decodes (`None` with a remote prefill).
    pub(super) check: Option<HitCheck>,
    pub(super) usage: TenantUse,
    /// Its place under the session's cap, held until the stream ends.
    pub(super) _session: Option<SessionPermit>,
    /// The current worker's gRPC call span: it ends with the stream (or the migration).
    pub(super) _call: tracing::Span,
}

impl Run {
    /// Chunks up to the one with a finish reason; the run (and its tracker entry) lives as
    /// long as the stream.
    pub(super) fn into_stream(
        self,
    ) -> futures::stream::BoxStream<'static, Result<TokenChunk, ServeError>> {
        futures::stream::unfold(Some(self), |run| async move {
            let mut run = run?;
            match run.next_chunk().await {
                Ok(c) => {
                    let last = c.finish != grpc::FinishReason::Unspecified as i32;
                    run.generated.extend_from_slice(&c.tokens);
                    let n = if c.tokens.is_empty() {
                        c.completion_tokens
                    } else {
                        c.tokens.len() as u32
                    };
                    run.usage.output(u64::from(n));
                    // An engine's text without ids cannot be continued elsewhere.
                    run.text_only |= c.text.is_some();
                    // What the engine counted of the prompt (a continuation's is longer).
                    if !run.migrated {
                        run.engine.set_prompt_tokens(c.prompt_tokens);
                    }
                    if last {
                        run.observe_cache(&c);
                    }
                    Some((Ok(token_chunk(&c)), (!last).then_some(run)))
                }
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed()
    }

    /// The finished request, for the cache health: what the engine served from its cache
    /// (its last chunk carries its own count) against the index's prediction. Not for a
    /// migrated request (another worker, a longer prompt).
    fn observe_cache(&self, last: &GenerateChunk) {
        let Some(check) = self.check.filter(|_| !self.migrated) else {
            return;
        };
        let sent = u32::try_from(self.job.req.prompt_tokens.len()).unwrap_or(u32::MAX);
        self.backend.shared.counters.cache.observe(Observation {
            worker: WorkerId(self.decode.worker_id),
            kv_events: check.kv_events,
            predicted: check.predicted,
            served: last.cached_tokens,
            prompt: (!check.text && !self.text_only && last.prompt_tokens > 0)
                .then_some((sent, last.prompt_tokens)),
        });
    }

    async fn next_chunk(&mut self) -> Result<GenerateChunk, ServeError> {
        loop {
            if let Some(c) = self.pending.take() {
                return Ok(c);
            }
            let next = tokio::time::timeout_at(self.job.deadline, self.rest.message());
            let Ok(next) = next.await else {
                return Err(ServeError::deadline_exceeded(
                    "the request's deadline passed while it was generating",
                ));
            };
            let failure = match next {
                // The rare paths are boxed: inline, their routing and start made this
                // future (moved into the stream's box with the run) some kilobytes larger.
                Ok(Some(c)) if c.handover => {
                    Box::pin(self.hand_over()).await;
                    continue;
                }
                Ok(Some(c)) => return Ok(c),
                Ok(None) => "the decode worker ended the stream early".to_string(),
                Err(status) => format!("the decode worker failed mid-stream: {}", status.message()),
            };
            Box::pin(self.migrate(failure)).await?;
        }
    }

    /// The decode worker drains and offers the request's KV: the request continues on
    /// another decode worker (prompt + the tokens so far, the rest of the budget) with the
    /// offering worker as its remote prefill, so the KV moves instead of being recomputed,
    /// and the offering worker's stream is dropped. When no other worker can start it, the
    /// stream goes on where it is (the draining worker finishes it).
    async fn hand_over(&mut self) {
        let counters = &self.backend.shared.counters;
        let done = self.generated.len() as u32;
        if self.migrations_left == 0 || done >= self.job.req.max_tokens || self.text_only {
            counters.handover("declined");
            return;
        }
        let mut job = self.job.clone();
        job.req.prompt_tokens.extend_from_slice(&self.generated);
        job.req.max_tokens -= done;
        job.kv_from = Some(self.decode.clone());
        let from = self.flight.worker;
        let mut excluded = self.excluded.clone();
        excluded.push(from);
        let started = match self.backend.start_job(&job, &mut excluded, None).await {
            Ok(started) => started,
            Err(e) => {
                counters.handover("declined");
                tracing::warn!(
                    worker = from.0,
                    error = e.message(),
                    "handover declined: the draining worker finishes the stream"
                );
                return;
            }
        };
        counters.handover("moved");
        let request = self.flight.inner.request();
        counters
            .flow
            .recent
            .migration(request, from, done, "handover: the decode worker drains");
        tracing::info!(
            from = from.0,
            to = started.decode.worker_id,
            generated = done,
            "handed the request over with its KV"
        );
        self.migrations_left -= 1;
        self.migrated = true;
        self.excluded = excluded;
        self.pending = Some(started.first);
        self.rest = started.rest;
        self.flight = started.flight;
        self.decode = started.decode;
        self._call = started.span;
    }

    /// Continues the request on another decode worker: prompt + the tokens generated so
    /// far, for the rest of the token budget.
    async fn migrate(&mut self, failure: String) -> Result<(), ServeError> {
        let done = self.generated.len() as u32;
        if self.migrations_left == 0 || done >= self.job.req.max_tokens || self.text_only {
            return Err(ServeError::unavailable(failure));
        }
        self.migrations_left -= 1;
        self.migrated = true;
        {
            let now = self.backend.shared.view.now_ms();
            let mut replica = self.backend.shared.view.replica().write();
            if replica.worker_failed(self.flight.worker, now) {
                tracing::warn!(worker = self.flight.worker.0, "circuit breaker opened");
            }
        }
        self.backend.shared.counters.migration();
        let request = self.flight.inner.request();
        let recent = &self.backend.shared.counters.flow.recent;
        recent.migration(request, self.flight.worker, done, &failure);
        self.excluded.push(self.flight.worker);
        tracing::warn!(
            worker = self.flight.worker.0,
            generated = done,
            %failure,
            "migrating the request to another decode worker"
        );
        let mut job = self.job.clone();
        job.req.prompt_tokens.extend_from_slice(&self.generated);
        job.req.max_tokens -= done;
        let started = self
            .backend
            .start_job(&job, &mut self.excluded, None)
            .await
            .map_err(|e| {
                ServeError::unavailable(format!("{failure}; migration failed: {}", e.message()))
            })?;
        self.pending = Some(started.first);
        self.rest = started.rest;
        self.flight = started.flight;
        self.decode = started.decode;
        self._call = started.span;
        Ok(())
    }
}

pub(super) fn token_chunk(c: &GenerateChunk) -> TokenChunk {
    let finish = match grpc::FinishReason::try_from(c.finish) {
        Ok(grpc::FinishReason::Length) => Some(FinishReason::Length),
        Ok(grpc::FinishReason::Stop) => Some(FinishReason::Stop),
        _ => None,
    };
    TokenChunk {
        tokens: c.tokens.clone(),
        finish,
        cached_tokens: c.cached_tokens,
        text: c.text.clone(),
        text_tokens: c.completion_tokens,
        logprobs: c
            .logprobs
            .iter()
            .map(|l| TokenLogprob {
                logprob: l.logprob,
                // A worker's malformed alternatives are dropped; its token still counts.
                top: l.top_pairs().unwrap_or_default(),
            })
            .collect(),
        embedding: c.embedding.clone(),
    }
}
