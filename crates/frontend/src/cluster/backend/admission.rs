//! Admission of a new request: its tenant's limits and budget, its session's cap, the flow
//! queue (a request waits there until a worker has room), and the pump that dispatches the
//! queue as capacity frees.

use std::sync::Arc;
use std::time::Duration;

use tandem_protocol::HashSeed;
use tandem_router::SessionKey;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{ClusterBackend, Job};
use crate::cluster::flow::{Admission, PUMP_TICK};
use crate::cluster::sessions::SessionPermit;
use crate::http::{ServeError, ValidRequest};

/// A request's use of its tenant's budget: output charged to the fairness counter as it
/// streams; on drop, the running count released and the unused part of the token budget
/// given back.
pub(super) struct TenantUse {
    pub(super) backend: ClusterBackend,
    pub(super) tenant: Arc<str>,
    /// Charged to the tokens-per-minute bucket at admission.
    pub(super) charged: u64,
    pub(super) prompt_tokens: u64,
    pub(super) generated: u64,
    pub(super) begun: bool,
}

impl TenantUse {
    pub(super) fn output(&mut self, tokens: u64) {
        self.generated += tokens;
        self.backend.shared.gate.charge_output(&self.tenant, tokens);
    }
}

impl Drop for TenantUse {
    fn drop(&mut self) {
        let gate = &self.backend.shared.gate;
        let now = self.backend.shared.view.now_ms();
        let used = if self.begun {
            gate.finished(&self.tenant);
            self.prompt_tokens + self.generated
        } else {
            0
        };
        gate.refund(&self.tenant, self.charged.saturating_sub(used), now);
    }
}

/// A new request past admission: within its tenant's limits, its session's place held, its
/// job built (the flow queue comes with its first plan, in [`ClusterBackend::start_job`]).
pub(super) struct Admitted {
    pub(super) admission: Admission,
    pub(super) usage: TenantUse,
    pub(super) job: Job,
    /// Its place under the session's cap, held until the stream ends.
    pub(super) session: Option<SessionPermit>,
}

impl ClusterBackend {
    /// Checks `req` against its tenant's limits (charging its budget) and waits for a place
    /// under its session's cap.
    pub(super) async fn admit(&self, req: ValidRequest) -> Result<Admitted, ServeError> {
        let s = &self.shared;
        let now = s.view.now_ms();
        let left = req
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        let admission = Admission::of(&req, now);
        s.gate.check_limits(&admission, now)?;
        let usage = TenantUse {
            backend: self.clone(),
            tenant: admission.tenant.clone(),
            charged: admission.charged,
            prompt_tokens: admission.prompt_tokens,
            generated: 0,
            begun: false,
        };
        let job = Job {
            seed: HashSeed::for_request(
                req.cache_salt.as_deref().map(str::as_bytes),
                req.adapter.as_deref(),
            ),
            sampling_seed: req.seed.unwrap_or_else(|| s.ids.lock().next_u64()),
            deadline: tokio::time::Instant::now() + left,
            session: req
                .routing
                .session
                .as_deref()
                .map(|id| SessionKey::new(req.tenant.as_deref(), id)),
            kv_from: None,
            req,
        };
        let session = match job.session {
            Some(key) => {
                // Waits no longer than the queue would.
                let most = Duration::from_millis(s.cfg.flow.max_wait_ms);
                let until = job.deadline.min(tokio::time::Instant::now() + most);
                s.sessions.acquire(key, until).await?
            }
            None => None,
        };
        Ok(Admitted {
            admission,
            usage,
            job,
            session,
        })
    }

    /// Spawns the pump: it dispatches queued requests as capacity frees (see flow.rs).
    pub(super) fn spawn_pump(self, tasks: &TaskTracker, cancel: CancellationToken) {
        tasks.spawn(async move {
            let gate = &self.shared.gate;
            loop {
                let tick = if gate.is_empty() {
                    Duration::from_secs(1)
                } else {
                    PUMP_TICK
                };
                tokio::select! {
                    () = gate.woken() => {}
                    () = tokio::time::sleep(tick) => {}
                    () = cancel.cancelled() => return,
                }
                let now = self.shared.view.now_ms();
                gate.pump(now, |p| self.plan(p, &[], true));
            }
        });
    }
}
