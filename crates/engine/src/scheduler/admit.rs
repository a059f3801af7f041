//! Planning a step: the running requests first (preempting under memory pressure), then
//! admissions from the waiting queue.

use tandem_protocol::RequestId;

use super::adapters::Take;
use super::{RequestPhase, ScheduledRequest, Scheduler, StepKind, StepPlan};

impl Scheduler {
    /// Plans the next step. While a step is in flight (planned, not yet completed) it returns
    /// that step's plan again instead of planning another. An empty plan means there is nothing
    /// to compute now (idle, or everything runnable was preempted: schedule again).
    pub fn schedule(&mut self, now_us: u64) -> &StepPlan {
        if self.in_flight {
            return &self.plan;
        }
        self.last_now_us = self.last_now_us.max(now_us);
        let step = self.stats.steps + 1;
        self.plan.reset(step, now_us);
        let mut budget = self.cfg.max_num_batched_tokens;
        self.seat_prefilled();
        self.schedule_running(&mut budget);
        // As in vLLM: a step that had to preempt admits no one, or the admitted request would
        // take the blocks just freed and the preempted one would thrash.
        if self.plan.preempted.is_empty() {
            self.admit_waiting(&mut budget);
        }
        let computed: usize = self.running.iter().map(|id| self.seqs[id].computed).sum();
        self.plan.kv_tokens = computed + self.plan.prefill_tokens + self.plan.decode_tokens;
        if !self.plan.entries.is_empty() {
            self.in_flight = true;
            self.stats.steps += 1;
        }
        &self.plan
    }

    /// Seats remotely prefilled requests (they hold their KV and decode) while seats last,
    /// before any waiting request is admitted.
    fn seat_prefilled(&mut self) {
        while self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.prefilled.front() else {
                break;
            };
            // In order: one whose adapter has no slot holds the queue (it holds its KV).
            if !self.take_adapter(id) {
                break;
            }
            self.prefilled.pop_front();
            self.running.push(id);
        }
    }

    /// Whether `id`'s adapter has a slot this step (taking it, loading the adapter if need
    /// be); a request without one always has.
    fn can_take_adapter(&self, id: RequestId) -> bool {
        let Some(name) = self.seqs[&id].adapter() else {
            return true;
        };
        self.adapters.can_take(name, |n| self.adapter_in_use(n))
    }

    fn take_adapter(&mut self, id: RequestId) -> bool {
        let Some(name) = self.seqs[&id].adapter().cloned() else {
            return true;
        };
        let (seqs, running) = (&self.seqs, &self.running);
        let in_use = |n: &str| {
            running
                .iter()
                .any(|r| seqs[r].adapter().is_some_and(|a| &**a == n))
        };
        match self.adapters.take(&name, self.plan.step, in_use) {
            Take::Resident => true,
            Take::Loaded => {
                self.plan.adapter_loads += 1;
                self.stats.adapter_loads += 1;
                true
            }
            Take::NoSlot => false,
        }
    }

    fn adapter_in_use(&self, name: &str) -> bool {
        self.running
            .iter()
            .any(|r| self.seqs[r].adapter().is_some_and(|a| &**a == name))
    }

    /// Gives each running request, in admission order, its next tokens while budget lasts.
    fn schedule_running(&mut self, budget: &mut usize) {
        let chunk_cap = self.chunk_cap();
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let start = seq.computed;
            let remaining = seq.tokens().len() - start;
            let n = match seq.phase {
                RequestPhase::Decoding => 1,
                _ => remaining.min(*budget).min(chunk_cap),
            };
            if !self.allocate_or_preempt(id, start + n) {
                // It preempted itself: it was the last running request.
                break;
            }
            self.push_entry(id, start, n);
            *budget -= n;
            i += 1;
        }
    }

    /// Grows `id`'s table to `total_tokens`, preempting from the back of the running list until
    /// it fits. False when `id` itself had to go.
    fn allocate_or_preempt(&mut self, id: RequestId, total_tokens: usize) -> bool {
        loop {
            if self.pool.allocate(id, total_tokens).is_ok() {
                return true;
            }
            let Some(&victim) = self.running.last() else {
                return false;
            };
            self.preempt_last();
            if victim == id {
                return false;
            }
        }
    }

    /// Preempts the most recently admitted running request by recompute.
    fn preempt_last(&mut self) {
        let Some(id) = self.running.pop() else { return };
        let freed = self.pool.free(id);
        debug_assert!(freed.is_ok(), "running request {id} had no block table");
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.reset_for_recompute();
            seq.preemptions += 1;
        }
        // Front of the queue: preempted last means admitted earliest, so repeated preemptions
        // in one step leave the queue in admission order.
        self.waiting.push_front(id);
        self.plan.preempted.push(id);
        self.stats.preemptions += 1;
    }

    /// Admits waiting requests first come first served while budget, seats and blocks last.
    /// A request whose LoRA adapter has no slot is passed over for this step, keeping its
    /// place (vLLM's `skipped_waiting_requests`).
    fn admit_waiting(&mut self, budget: &mut usize) {
        let mut skipped = Vec::new();
        self.admit_waiting_skipping(budget, &mut skipped);
        for id in skipped.into_iter().rev() {
            self.waiting.push_front(id);
        }
    }

    fn admit_waiting_skipping(&mut self, budget: &mut usize, skipped: &mut Vec<RequestId>) {
        let bs = self.pool.block_size().tokens();
        let chunk_cap = self.chunk_cap();
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            if !self.can_take_adapter(id) {
                self.waiting.pop_front();
                skipped.push(id);
                continue;
            }
            let seq = &self.seqs[&id];
            let total = seq.tokens().len();
            // Never reuse the block holding the last token: at least one token is computed,
            // so the model has logits to sample the next token from.
            let max_reuse = (total - 1) / bs;
            let hit = match self.pool.acquire_prefix(id, seq.block_hashes(), max_reuse) {
                Ok(hit) => hit,
                Err(e) => {
                    // Waiting requests hold no table; this is a broken invariant, not pressure.
                    debug_assert!(false, "acquire_prefix for waiting {id}: {e}");
                    break;
                }
            };
            let cached = hit.total() * bs;
            let remaining = total - cached;
            let n = if self.cfg.enable_chunked_prefill {
                remaining.min(*budget).min(chunk_cap)
            } else {
                remaining
            };
            let fits_budget = n <= *budget;
            if !fits_budget || self.pool.allocate(id, cached + n).is_err() {
                // Strict FCFS: the head of the queue waits for room, nobody overtakes it.
                let freed = self.pool.free(id);
                debug_assert!(freed.is_ok());
                break;
            }
            self.waiting.pop_front();
            let taken = self.take_adapter(id);
            debug_assert!(taken, "checked before admission");
            self.running.push(id);
            let seq = self
                .seqs
                .get_mut(&id)
                .expect("waiting requests are tracked");
            seq.phase = RequestPhase::Prefilling;
            seq.computed = cached;
            seq.committed = hit.total();
            // What the prefix cache saved is counted at the admission before any preemption
            // only. A preempted request re-admitted finds its own blocks, committed before the
            // preemption: counting those as cached reported a hit rate several times the true
            // one past capacity. vLLM keeps them apart the same way (`PrefixCacheStats`'s
            // `preempted_*`). A remote prefill that fell back is no preemption: its local
            // admission counts what this worker holds.
            if seq.preemptions == 0 {
                seq.cached_tokens = cached;
                self.stats.cached_tokens += cached as u64;
                self.stats.queried_tokens += total as u64;
            } else {
                self.stats.preempted_cached_tokens += cached as u64;
                self.stats.preempted_queried_tokens += total as u64;
            }
            seq.admissions += 1;
            self.stats.admissions += 1;
            self.push_entry(id, cached, n);
            *budget -= n;
        }
    }

    fn chunk_cap(&self) -> usize {
        match (self.cfg.enable_chunked_prefill, self.cfg.max_prefill_chunk) {
            (true, Some(c)) => c,
            _ => usize::MAX,
        }
    }

    /// Adds a plan entry computing tokens `start .. start + n` of `id`, whose table holds them.
    fn push_entry(&mut self, id: RequestId, start: usize, n: usize) {
        let seq = &self.seqs[&id];
        let end = start + n;
        let samples = end == seq.tokens().len();
        let kind = if seq.phase == RequestPhase::Decoding {
            self.plan.decode_tokens += 1;
            StepKind::Decode { position: start }
        } else {
            self.plan.prefill_tokens += n;
            StepKind::Prefill { start, len: n }
        };
        let table = self.pool.block_table(id).unwrap_or_default();
        let nblocks = self.pool.block_size().blocks_for(end).min(table.len());
        debug_assert_eq!(
            nblocks,
            self.pool.block_size().blocks_for(end),
            "table too short"
        );
        let block_start = self.plan.block_ids.len() as u32;
        self.plan.block_ids.extend_from_slice(&table[..nblocks]);
        self.plan.entries.push(ScheduledRequest {
            id,
            kind,
            samples,
            block_start,
            block_len: nblocks as u32,
        });
    }
}
