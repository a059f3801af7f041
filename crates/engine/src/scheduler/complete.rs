//! Completing a step: advance each scheduled request, take the sampled tokens, commit full
//! blocks to the prefix cache, finish and free the requests that are done.

use super::{
    RequestOutput, RequestPhase, SampledToken, ScheduledRequest, Scheduler, SchedulerError,
};

impl Scheduler {
    /// Reports the in-flight step as computed. `outputs` holds one token per plan entry that
    /// samples, in plan order; entries of requests aborted during the step may have one or not.
    /// Returns one output per token emitted. On an error nothing changed.
    pub fn complete_step(
        &mut self,
        outputs: &[SampledToken],
        now_us: u64,
    ) -> Result<Vec<RequestOutput>, SchedulerError> {
        if !self.in_flight {
            return Err(SchedulerError::NoStepInFlight);
        }
        self.check_outputs(outputs)?;
        self.last_now_us = self.last_now_us.max(now_us);
        let entries = std::mem::take(&mut self.plan.entries);
        let mut emitted = Vec::with_capacity(outputs.len());
        let mut cursor = 0;
        let mut any_finished = false;
        let mut result = Ok(());
        for entry in &entries {
            let token = match outputs.get(cursor) {
                Some(o) if entry.samples && o.id == entry.id => {
                    cursor += 1;
                    Some(o)
                }
                _ => None,
            };
            match self.advance(entry, token, now_us, &mut emitted) {
                Ok(finished) => any_finished |= finished,
                Err(e) => {
                    // Only a pool bookkeeping bug gets here; finish the step regardless so the
                    // scheduler stays usable, and report the first error.
                    if result.is_ok() {
                        result = Err(e);
                    }
                }
            }
        }
        self.plan.entries = entries;
        self.in_flight = false;
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|id| seqs.contains_key(id));
        }
        result.map(|()| emitted)
    }

    /// Checks that `outputs` names, in order, exactly the sampling entries of requests still
    /// running (plus, optionally, ones aborted during the step).
    fn check_outputs(&self, outputs: &[SampledToken]) -> Result<(), SchedulerError> {
        let mut cursor = 0;
        for e in self.plan.entries.iter().filter(|e| e.samples) {
            let got = outputs.get(cursor).map(|o| o.id);
            if got == Some(e.id) {
                cursor += 1;
            } else if self.is_running(e.id) {
                return Err(SchedulerError::OutputMismatch {
                    expected: Some(e.id),
                    got,
                });
            }
        }
        match outputs.get(cursor) {
            Some(extra) => Err(SchedulerError::OutputMismatch {
                expected: None,
                got: Some(extra.id),
            }),
            None => Ok(()),
        }
    }

    fn is_running(&self, id: tandem_protocol::RequestId) -> bool {
        self.seqs.get(&id).is_some_and(|s| s.phase.is_scheduled())
    }

    /// Applies one entry's results; true when the request finished.
    fn advance(
        &mut self,
        entry: &ScheduledRequest,
        token: Option<&SampledToken>,
        now_us: u64,
        emitted: &mut Vec<RequestOutput>,
    ) -> Result<bool, SchedulerError> {
        let id = entry.id;
        let Some(seq) = self.seqs.get_mut(&id).filter(|s| s.phase.is_scheduled()) else {
            return Ok(false); // aborted during the step
        };
        let range = entry.tokens();
        seq.computed = range.end;
        if entry.is_prefill() {
            self.stats.prefill_tokens += range.len() as u64;
        } else {
            self.stats.decode_tokens += 1;
        }
        let mut finish = None;
        if let Some(out) = token {
            let token = out.token;
            let first_token = seq.generated == 0;
            finish = seq.push_token(token);
            seq.phase = RequestPhase::Decoding;
            emitted.push(RequestOutput {
                id,
                token,
                first_token,
                cached_tokens: seq.cached_tokens,
                prompt_tokens: seq.prompt_len(),
                completion_tokens: seq.generated,
                finish,
                time_to_first_token_us: first_token.then(|| now_us.saturating_sub(seq.arrival_us)),
                logprobs: out.logprobs.clone(),
                embedding: out.embedding.clone(),
            });
        }
        // Commit before a finished request is freed, so its blocks stay reusable.
        let full = self.pool.block_size().full_blocks(seq.computed);
        if full > seq.committed {
            self.pool.commit(id, &seq.block_hashes()[..full])?;
            seq.committed = full;
        }
        if finish.is_some() {
            self.seqs.remove(&id);
            self.stats.finished += 1;
            if self.pin_on_finish.remove(&id) {
                let blocks = self.pool.pin(id)?;
                self.pinned.insert(id, blocks);
            }
            self.pool.free(id)?;
            return Ok(true);
        }
        Ok(false)
    }
}
