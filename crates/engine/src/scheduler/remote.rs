//! Remote prefill, the decode side: reserve the blocks the prefill worker writes into, then
//! continue the request as if it had been prefilled here, or fall back to a local prefill.
//!
//! The lifecycle: [`Scheduler::begin_remote_prefill`] (the request takes its cached prefix and
//! blocks for the rest of its prompt, all or nothing, and enters [`RequestPhase::AwaitingKv`]);
//! the transport writes the prompt's KV from [`RemotePrefill::transfer`] on into
//! [`RemotePrefill::blocks`]; then either [`Scheduler::finish_remote_prefill`] (commit, first
//! token, decode) or [`Scheduler::fail_remote_prefill`] (free the blocks, prefill locally).
//! [`Scheduler::abort`] works in between. A request awaiting KV is never in a step plan, so
//! all three may be called while a step is in flight.

use std::ops::Range;

use tandem_protocol::RequestId;

use super::{
    EngineRequest, RequestOutput, RequestPhase, Scheduler, SchedulerError, TokenLogprobs,
    sequence::Sequence,
};
use crate::pool::PoolError;

/// What the decode worker tells the prefill worker: which prompt tokens to send, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemotePrefill {
    pub id: RequestId,
    pub prompt_tokens: usize,
    /// Prompt tokens this worker holds already (device and host cache, whole blocks): not
    /// transferred. Also the first prompt position to transfer.
    pub cached_tokens: usize,
    /// Destination device blocks, in order: `blocks[k]` receives the KV of prompt tokens
    /// `cached_tokens + k·block_size ..`, the last one possibly partial. Empty when the whole
    /// prompt is cached here (only the first token is then needed).
    pub blocks: Vec<u32>,
}

impl RemotePrefill {
    /// Prompt positions whose KV the prefill worker sends.
    pub fn transfer(&self) -> Range<usize> {
        self.cached_tokens..self.prompt_tokens
    }
}

impl Scheduler {
    /// Starts the decode side of a remote prefill: validates `req` like
    /// [`add_request`](Self::add_request), then acquires its cached prefix (every full prompt
    /// block cached here, device or host) and allocates blocks for the rest of the prompt,
    /// partial last block included, at once. All or nothing: `NoRoomForKv` (class
    /// `Overloaded`) when the pool cannot hold it now, and nothing changed; the caller then
    /// prefills locally with `add_request`. The request then awaits its KV, holding its blocks
    /// (not evictable) and counted as running in the load report. TTFT counts from `now_us`.
    pub fn begin_remote_prefill(
        &mut self,
        req: EngineRequest,
        now_us: u64,
    ) -> Result<RemotePrefill, SchedulerError> {
        self.validate(&req)?;
        let id = req.id;
        if self.in_flight && self.plan.entries.iter().any(|e| e.id == id) {
            // Aborted during the in-flight step: finishing this one before the step completes
            // would let the stale entry apply to it.
            return Err(SchedulerError::DuplicateRequest(id));
        }
        let bs = self.pool.block_size();
        let mut seq = Sequence::new(req, bs, now_us);
        let prompt_tokens = seq.prompt_len();
        // Unlike a local admission, every full block may be reused: the first token comes from
        // the prefill worker, so nothing has to be computed here.
        let full = bs.full_blocks(prompt_tokens);
        let hit = self
            .pool
            .acquire_and_allocate(id, seq.block_hashes(), full, prompt_tokens)
            .map_err(|e| match e {
                PoolError::OutOfBlocks { needed, available } => SchedulerError::NoRoomForKv {
                    id,
                    needed,
                    available,
                },
                e => e.into(),
            })?;
        self.last_now_us = self.last_now_us.max(now_us);
        let cached_tokens = hit.total() * bs.tokens();
        let table = self.pool.block_table(id).unwrap_or_default();
        let blocks = table[hit.total().min(table.len())..].to_vec();
        seq.phase = RequestPhase::AwaitingKv;
        seq.computed = cached_tokens;
        seq.committed = hit.total();
        seq.cached_tokens = cached_tokens;
        seq.admissions += 1;
        self.seqs.insert(id, seq);
        self.awaiting_kv += 1;
        self.stats.remote_prefills += 1;
        self.stats.cached_tokens += cached_tokens as u64;
        Ok(RemotePrefill {
            id,
            prompt_tokens,
            cached_tokens,
            blocks,
        })
    }

    /// Ends a remote prefill whose KV is in the destination blocks: commits the prompt's full
    /// blocks to the prefix cache (published as stored), counts the prompt as computed and
    /// takes `first_token` (sampled by the prefill worker) as generated. Returns its output
    /// (`first_token: true`, TTFT from `begin_remote_prefill`). If that token ends the request
    /// (`max_tokens` 1 or the stop token) it finishes and frees its blocks now; otherwise it
    /// decodes from the next step: seated at once if a seat is free, else queued, and the
    /// queue is seated before any waiting request is admitted. On an error nothing changed.
    pub fn finish_remote_prefill(
        &mut self,
        id: RequestId,
        first_token: u32,
        logprobs: Option<Box<TokenLogprobs>>,
        now_us: u64,
    ) -> Result<RequestOutput, SchedulerError> {
        let bs = self.pool.block_size();
        let Some(seq) = self
            .seqs
            .get_mut(&id)
            .filter(|s| s.phase == RequestPhase::AwaitingKv)
        else {
            return Err(SchedulerError::NotAwaitingKv(id));
        };
        let full = bs.full_blocks(seq.prompt_len());
        self.pool.commit(id, &seq.block_hashes()[..full])?;
        self.last_now_us = self.last_now_us.max(now_us);
        self.awaiting_kv -= 1;
        seq.committed = full;
        seq.computed = seq.prompt_len();
        let finish = seq.push_token(first_token);
        seq.phase = RequestPhase::Decoding;
        let out = RequestOutput {
            id,
            token: first_token,
            first_token: true,
            cached_tokens: seq.cached_tokens,
            prompt_tokens: seq.prompt_len(),
            completion_tokens: seq.generated,
            finish,
            time_to_first_token_us: Some(now_us.saturating_sub(seq.arrival_us)),
            logprobs,
            // (A remote prefill's worker computed the prompt: no embedding comes with it.)
            embedding: None,
        };
        if finish.is_some() {
            self.seqs.remove(&id);
            self.stats.finished += 1;
            self.pool.free(id)?;
        } else if self.prefilled.is_empty() && self.running.len() < self.cfg.max_num_seqs {
            self.running.push(id);
        } else {
            self.prefilled.push_back(id);
        }
        Ok(out)
    }

    /// Gives up on a remote prefill (transfer failed, timed out, or its checksum did not
    /// match): frees the destination blocks (the uncommitted ones return to the free list,
    /// whatever was written into them is discarded) and queues the request at the front of the
    /// waiting queue to prefill locally; its cached prefix is acquired again on admission.
    /// Counted in `remote_prefill_fallbacks`.
    pub fn fail_remote_prefill(
        &mut self,
        id: RequestId,
        now_us: u64,
    ) -> Result<(), SchedulerError> {
        let Some(seq) = self
            .seqs
            .get_mut(&id)
            .filter(|s| s.phase == RequestPhase::AwaitingKv)
        else {
            return Err(SchedulerError::NotAwaitingKv(id));
        };
        self.pool.free(id)?;
        seq.reset_for_recompute();
        self.last_now_us = self.last_now_us.max(now_us);
        self.awaiting_kv -= 1;
        // Front, like a preempted request: it has waited for its remote prefill already. The
        // queue bound is not applied, as for preemption: the request was accepted before.
        self.waiting.push_front(id);
        self.stats.remote_prefill_fallbacks += 1;
        Ok(())
    }
}
