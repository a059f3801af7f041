//! The frontend's flow control (docs/ARCHITECTURE.md §10): the I/O around [`tandem_router::FlowQueue`].
//!
//! A new request first passes its tenant's rate limits, then asks the gate for a plan. With
//! nothing queued and a decode worker not saturated ([`tandem_router::SaturationConfig`]) it
//! is planned at once; otherwise it waits in the queue until the pump dispatches it. The pump
//! runs when capacity may have freed — a request ends or gets its first token (its prefill
//! load leaves) — and every [`PUMP_TICK`] while something waits (load reports, peers' syncs,
//! workers joining). It plans the queue's next request under the queue's lock, so the tracker
//! counts it before the next saturation check: one freed slot dispatches one request, never a
//! herd. Lock order: queue, then the replica (never the other way).
//!
//! Refusals are 429 with `Retry-After` (queue full, displaced by a higher band, deadline
//! passed in the queue, rate limits); no decode worker at all is a 503. A waiting request
//! whose client leaves is taken out of the queue when its future is dropped.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tandem_router::flow::{Meta, Ticket};
use tandem_router::{FlowQueue, Priority, RejectReason, Rejection, RouteError, TenantLimits};
use tokio::sync::{Notify, oneshot};

use crate::http::ServeError;

/// How often the pump looks at the queue while something waits, besides its wake-ups.
pub(crate) const PUMP_TICK: Duration = Duration::from_millis(20);

pub(crate) use crate::http::ANONYMOUS;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BandLabel {
    band: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
    kind: &'static str,
}

/// Flow control's series on `/metrics`.
#[derive(Debug)]
pub struct FlowMetrics {
    depth: Family<BandLabel, Gauge>,
    wait: Family<BandLabel, Histogram>,
    rejections: Family<ReasonLabel, Counter>,
    tokens: Family<TenantLabel, Counter>,
    labels: crate::http::TenantLabels,
    /// Session routes and the per-session cap's refusals.
    pub(crate) sessions: Arc<super::sessions::SessionMetrics>,
    /// The status page's rings: recent decisions, migrations and these rejections.
    pub(crate) recent: Arc<super::recent::RecentActivity>,
}

impl FlowMetrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = FlowMetrics {
            depth: Family::default(),
            wait: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 17))
            }),
            rejections: Family::default(),
            tokens: Family::default(),
            labels: Default::default(),
            sessions: Arc::new(super::sessions::SessionMetrics::register(registry)),
            recent: Arc::default(),
        };
        for p in Priority::ALL {
            m.depth
                .get_or_create(&BandLabel { band: p.as_str() })
                .set(0);
        }
        for r in RejectReason::ALL {
            let _ = m
                .rejections
                .get_or_create(&ReasonLabel { reason: r.as_str() });
        }
        registry.register(
            "tandem_frontend_queue_depth",
            "Requests waiting in the frontend's queue, by priority band",
            m.depth.clone(),
        );
        registry.register(
            "tandem_frontend_queue_wait_seconds",
            "Time requests waited in the frontend's queue before dispatch (0 for those \
             dispatched at once), by priority band",
            m.wait.clone(),
        );
        registry.register(
            "tandem_frontend_rejections",
            "Requests refused by flow control, by reason (queue_full, queue_timeout, displaced, \
             rate_limit_requests, rate_limit_tokens, too_many_tenants)",
            m.rejections.clone(),
        );
        registry.register(
            "tandem_frontend_tenant_tokens",
            "Tokens served per tenant, by kind (input: prompt tokens dispatched; output: tokens \
             generated)",
            m.tokens.clone(),
        );
        m
    }

    pub(crate) fn tokens(&self, tenant: &Arc<str>, kind: &'static str, n: u64) {
        if n > 0 {
            let tenant = self.labels.label(tenant);
            self.tokens
                .get_or_create(&TenantLabel { tenant, kind })
                .inc_by(n);
        }
    }

    fn rejected(&self, reason: RejectReason) {
        self.recent.rejection(reason);
        self.rejections
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    fn waited(&self, band: Priority, ms: u64) {
        self.wait
            .get_or_create(&BandLabel {
                band: band.as_str(),
            })
            .observe(ms as f64 / 1000.0);
    }

    fn depth<T>(&self, q: &FlowQueue<T>) {
        for p in Priority::ALL {
            self.depth
                .get_or_create(&BandLabel { band: p.as_str() })
                .set(q.len_band(p) as i64);
        }
    }
}

/// The refusal as the client sees it.
pub(crate) fn rejection_error(r: Rejection) -> ServeError {
    let retry = Duration::from_millis(r.retry_after_ms.max(1000));
    match r.reason {
        RejectReason::QueueFull => ServeError::overloaded(
            "every worker is saturated and the queue is full; retry later",
            retry,
        ),
        RejectReason::QueueTimeout => ServeError::overloaded(
            "the request's deadline passed while it waited for capacity",
            retry,
        ),
        RejectReason::Displaced => ServeError::overloaded(
            "the request was shed from the full queue for higher-priority work",
            retry,
        ),
        RejectReason::RequestsPerMinute => {
            ServeError::overloaded("rate limit reached for requests per minute", retry)
                .with_code("rate_limit_exceeded")
        }
        RejectReason::TokensPerMinute => {
            ServeError::overloaded("rate limit reached for tokens per minute", retry)
                .with_code("rate_limit_exceeded")
        }
        RejectReason::TooManyTenants => {
            ServeError::overloaded("too many tenants have requests in flight", retry)
        }
    }
}

/// What a queued request waits for: a plan (its tracker entry already recorded), or why not.
pub(crate) type Outcome<P> = Result<P, ServeError>;

/// A queued request: what the shell needs to plan it, and where to send the plan.
pub(crate) struct Waiter<J, P> {
    pub job: J,
    tx: oneshot::Sender<Outcome<P>>,
}

/// The queue, its wake-ups and metrics. `J` is what planning a request needs, `P` a plan.
pub(crate) struct Gate<J, P> {
    queue: Mutex<FlowQueue<Waiter<J, P>>>,
    wake: Notify,
    pub metrics: Arc<FlowMetrics>,
}

/// The request's side of the gate: its tenant's budget, released when it ends.
pub(crate) struct Admission {
    pub tenant: Arc<str>,
    pub priority: Priority,
    pub prompt_tokens: u64,
    /// Prompt + `max_tokens`, charged to the tokens-per-minute bucket.
    pub charged: u64,
    pub deadline_ms: u64,
}

impl Admission {
    /// `req`'s admission at `now_ms`: its tenant (anonymous without one), band, prompt, the
    /// tokens it may use (prompt + `max_tokens`) and its deadline on the view's clock.
    pub(crate) fn of(req: &crate::http::ValidRequest, now_ms: u64) -> Self {
        let left = req
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        let prompt_tokens = req.prompt_tokens.len() as u64;
        Admission {
            tenant: req.tenant.clone().unwrap_or_else(|| ANONYMOUS.into()),
            priority: req.priority,
            prompt_tokens,
            charged: prompt_tokens + u64::from(req.max_tokens),
            deadline_ms: now_ms.saturating_add(u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
        }
    }
}

impl<J, P> Gate<J, P> {
    pub(crate) fn new(queue: FlowQueue<Waiter<J, P>>, metrics: Arc<FlowMetrics>) -> Self {
        Gate {
            queue: Mutex::new(queue),
            wake: Notify::new(),
            metrics,
        }
    }

    /// Capacity may have freed: run the pump soon, if anything waits for it. With the queue
    /// empty there is nothing to dispatch (a request queued later wakes the pump itself), and
    /// waking it anyway would cost every request a task wake-up or three.
    pub(crate) fn wake(&self) {
        if !self.queue.lock().is_empty() {
            self.wake.notify_one();
        }
    }

    pub(crate) async fn woken(&self) {
        self.wake.notified().await
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    pub(crate) fn set_tenants(&self, tenants: Vec<(Arc<str>, TenantLimits)>) {
        if let Err(e) = self.queue.lock().set_tenant_limits(tenants) {
            tracing::error!(error = %e, "tenant limits refused; keeping the previous ones");
        }
    }

    /// The tenant's rate limits for a request of `a.charged` tokens.
    pub(crate) fn check_limits(&self, a: &Admission, now_ms: u64) -> Result<(), ServeError> {
        let r = self.queue.lock().check_limits(&a.tenant, a.charged, now_ms);
        r.map_err(|r| {
            self.metrics.rejected(r.reason);
            rejection_error(r)
        })
    }

    /// Gives back what [`Self::check_limits`] charged and was not used.
    pub(crate) fn refund(&self, tenant: &str, tokens: u64, now_ms: u64) {
        if tokens > 0 {
            self.queue.lock().refund_tokens(tenant, tokens, now_ms);
        }
    }

    pub(crate) fn charge_output(&self, tenant: &Arc<str>, tokens: u64) {
        self.queue.lock().charge_output(tenant, tokens);
        self.metrics.tokens(tenant, "output", tokens);
    }

    /// A request holds its plan: its tenant counts it as running until [`Self::finished`].
    pub(crate) fn begin(&self, tenant: &str) {
        self.queue.lock().begin(tenant);
    }

    /// A running request ended: its tenant's running count drops and the pump runs.
    pub(crate) fn finished(&self, tenant: &str) {
        self.queue.lock().finished(tenant);
        self.wake();
    }

    /// Plans the request at once when nothing waits and `plan` finds a worker that is not
    /// saturated; else queues it and waits for the pump (or its deadline). `plan` is called
    /// under the queue's lock.
    pub(crate) async fn acquire(
        &self,
        a: &Admission,
        job: J,
        now_ms: u64,
        deadline: tokio::time::Instant,
        plan: impl FnOnce(&J) -> Result<P, RouteError>,
    ) -> Outcome<P> {
        let rx = {
            let mut q = self.queue.lock();
            if q.is_empty() {
                match plan(&job) {
                    Ok(p) => {
                        q.dispatch_direct(&a.tenant, a.prompt_tokens, now_ms);
                        drop(q);
                        self.metrics.waited(a.priority, 0);
                        self.metrics.tokens(&a.tenant, "input", a.prompt_tokens);
                        return Ok(p);
                    }
                    Err(RouteError::Saturated) => {}
                    Err(e) => return Err(ServeError::from(e)),
                }
            }
            let meta = Meta {
                tenant: a.tenant.clone(),
                priority: a.priority,
                prompt_tokens: a.prompt_tokens,
                arrived_ms: now_ms,
                deadline_ms: a.deadline_ms,
            };
            let (tx, rx) = oneshot::channel();
            match q.enqueue(meta, Waiter { job, tx }, now_ms) {
                Err((r, _)) => {
                    drop(q);
                    self.metrics.rejected(r.reason);
                    return Err(rejection_error(r));
                }
                Ok((ticket, displaced)) => {
                    if let Some((_, w)) = displaced {
                        let r = Rejection {
                            reason: RejectReason::Displaced,
                            retry_after_ms: q.retry_after_ms(now_ms),
                        };
                        self.metrics.rejected(r.reason);
                        let _ = w.tx.send(Err(rejection_error(r)));
                    }
                    self.metrics.depth(&q);
                    // The queue's own bound on the wait, if sooner than the request's.
                    let most = Duration::from_millis(q.config().max_wait_ms);
                    (ticket, rx, deadline.min(tokio::time::Instant::now() + most))
                }
            }
        };
        let (ticket, rx, deadline) = rx;
        self.wake();
        let guard = Queued { gate: self, ticket };
        let out = tokio::select! {
            r = rx => r.unwrap_or_else(|_| Err(ServeError::internal("the queue dropped a request"))),
            () = tokio::time::sleep_until(deadline) => {
                // Taken out here unless the pump dispatched it meanwhile (then the plan is
                // in the channel, which the guard's drop cannot see: take it).
                let mut q = self.queue.lock();
                if q.remove(ticket).is_some() {
                    let r = Rejection {
                        reason: RejectReason::QueueTimeout,
                        retry_after_ms: q.retry_after_ms(now_ms),
                    };
                    self.metrics.depth(&q);
                    drop(q);
                    self.metrics.rejected(r.reason);
                    Err(rejection_error(r))
                } else {
                    drop(q);
                    Err(ServeError::overloaded(
                        "the request's deadline passed while it waited for capacity",
                        Duration::from_secs(1),
                    ))
                }
            }
        };
        drop(guard);
        out
    }

    /// Dispatches what can be dispatched: expired requests are refused, then the queue's next
    /// requests are planned with `plan` until it answers [`RouteError::Saturated`]. A plan whose
    /// request is gone is dropped here (a plan releases its tracker entry when dropped).
    pub(crate) fn pump(&self, now_ms: u64, mut plan: impl FnMut(&J) -> Result<P, RouteError>) {
        // Outcomes are sent after the lock is released: a plan whose request left meanwhile
        // comes back from its send and is dropped, and a plan's drop ends its booking, which
        // wakes this gate and takes this lock (dropped under it, both runtime workers
        // deadlocked on the queue).
        let mut outcomes: Vec<(oneshot::Sender<Outcome<P>>, Outcome<P>)> = Vec::new();
        let mut q = self.queue.lock();
        let expired = q.expire(now_ms);
        let retry_after_ms = q.retry_after_ms(now_ms);
        for (_, w) in expired {
            let r = Rejection {
                reason: RejectReason::QueueTimeout,
                retry_after_ms,
            };
            self.metrics.rejected(r.reason);
            outcomes.push((w.tx, Err(rejection_error(r))));
        }
        let mut unsent = None;
        while let Some(ticket) = q.peek(now_ms) {
            let Some((_, w)) = q.get(ticket) else { break };
            if w.tx.is_closed() {
                q.remove(ticket);
                continue;
            }
            match plan(&w.job) {
                Ok(p) => {
                    let Some(d) = q.dispatch(ticket, now_ms) else {
                        unsent = Some(p);
                        break;
                    };
                    self.metrics
                        .waited(d.meta.priority, now_ms.saturating_sub(d.meta.arrived_ms));
                    self.metrics
                        .tokens(&d.meta.tenant, "input", d.meta.prompt_tokens);
                    outcomes.push((d.item.tx, Ok(p)));
                }
                Err(RouteError::Saturated) => break,
                Err(e) => {
                    if let Some((_, w)) = q.remove(ticket) {
                        outcomes.push((w.tx, Err(ServeError::from(e))));
                    }
                }
            }
        }
        q.prune(now_ms);
        self.metrics.depth(&q);
        drop(q);
        drop(unsent);
        for (tx, outcome) in outcomes {
            // A request that left meanwhile: its plan comes back and is dropped here.
            let _ = tx.send(outcome);
        }
    }
}

/// Takes a waiting request out of the queue when its future is dropped (the client left).
struct Queued<'a, J, P> {
    gate: &'a Gate<J, P>,
    ticket: Ticket,
}

impl<J, P> Drop for Queued<'_, J, P> {
    fn drop(&mut self) {
        let mut q = self.gate.queue.lock();
        if q.remove(self.ticket).is_some() {
            self.gate.metrics.depth(&q);
        }
    }
}

#[cfg(test)]
#[path = "flow_tests.rs"]
mod tests;
