//! [`Picker`]: one request's prompt → hashes → the routing replica under flow control → the
//! chosen worker's HTTP endpoint (and fallbacks), with the request held in the tracker by a
//! [`Lease`] until its response ends.
//!
//! Only decode (and aggregated) workers that register an HTTP endpoint
//! ([`tandem_protocol::WorkerAddresses::http`]) can be picked: the gateway sends the request
//! itself there. Prefill workers are never candidates (a gateway has no way to name one), so
//! the replica decides as if there were no prefill pool.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{AdapterId, HashSeed, RequestId, SequenceHash, WorkerId};
use tandem_router::{
    InFlight, RouteError, RouteInput, RouteRequest, RoutingConfig, SessionKey, SyncMessage,
};

use crate::cluster::ClusterView;
use crate::cluster::flow::{ANONYMOUS, Admission, Gate};
use crate::cluster::metrics::RouteCounters;
use crate::cluster::sync::ReplicaSync;
use crate::http::{BodyCheck, Endpoint, ServeError, ValidRequest};

/// What routing a request needs, computed once (and held while it waits in the queue, and
/// until its response ends: a fallback re-books it on the endpoint that served it).
pub(crate) struct Prepared {
    route: RouteRequest,
    hashes: Vec<SequenceHash>,
    expected_output_tokens: u64,
    session: Option<SessionKey>,
    /// The gateway's subset hint: only these endpoints may be picked (None: any).
    subset: Option<Vec<String>>,
}

/// The picker's shared state.
pub(crate) struct Picker {
    pub view: Arc<ClusterView>,
    pub counters: Arc<RouteCounters>,
    pub gate: Gate<Arc<Prepared>, Lease>,
    pub body: Arc<BodyCheck>,
    pub routing: RoutingConfig,
    /// Endpoints named after the chosen one, for the gateway to fall back on.
    pub fallbacks: usize,
    /// Request ids (drawn apart from the replica's generator).
    pub ids: Mutex<tandem_router::Rng>,
    pub sync: Option<ReplicaSync>,
}

/// A request's place in the tracker on the worker it was sent to; released on drop.
pub(crate) struct Lease {
    picker: Arc<Picker>,
    worker: WorkerId,
    /// The chosen endpoint first, then the fallbacks.
    pub endpoints: Vec<String>,
    inner: InFlight,
}

/// A request's running count in its tenant's budget; released on drop.
pub(crate) struct TenantHold {
    picker: Arc<Picker>,
    tenant: Arc<str>,
}

impl Drop for TenantHold {
    fn drop(&mut self) {
        self.picker.gate.finished(&self.tenant);
    }
}

/// A routed request: where it goes and what it holds until its response ends (fields drop
/// in order: the tracker entry, then the tenant's count).
pub(crate) struct Picked {
    pub lease: Lease,
    pub prepared: Arc<Prepared>,
    _tenant: TenantHold,
}

impl Picker {
    /// Whether any worker can be picked now (the gRPC health of the ext_proc service).
    pub fn ready(&self) -> bool {
        self.view
            .registry()
            .decode
            .values()
            .any(|e| e.record.addresses.http.is_some())
    }

    fn sync(&self, msgs: impl IntoIterator<Item = SyncMessage>) {
        if let Some(sync) = &self.sync {
            for m in msgs {
                sync.send(m);
            }
        }
    }

    /// Routes one request: `body` of `endpoint` (None: a request whose prompt the picker
    /// does not read, routed on load alone), its headers, the gateway's subset hint.
    pub async fn pick(
        self: &Arc<Self>,
        endpoint: Option<Endpoint>,
        body: &[u8],
        headers: &axum::http::HeaderMap,
        subset: Option<Vec<String>>,
    ) -> Result<Picked, ServeError> {
        let id = self.ids.lock().next_u64() >> 1;
        let now = self.view.now_ms();
        let (prepared, admission) = match endpoint {
            Some(e) if !body.is_empty() => {
                let req = self.body.check(e, body, headers, id).await?;
                self.prepare(req, subset, now)
            }
            _ => self.prepare_unread(headers, subset, now),
        };
        if !self.eligible_exists(&prepared.subset) {
            return Err(ServeError::unavailable(match &prepared.subset {
                None => "no model server endpoint is ready",
                Some(_) => "no endpoint of the gateway's subset hint is ready",
            }));
        }
        self.gate.check_limits(&admission, now)?;
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(admission.deadline_ms.saturating_sub(now));
        let prepared = Arc::new(prepared);
        let me = self.clone();
        let lease = self
            .gate
            .acquire(&admission, prepared.clone(), now, deadline, |p| me.plan(p))
            .await?;
        self.gate.begin(&admission.tenant);
        Ok(Picked {
            lease,
            prepared,
            _tenant: TenantHold {
                picker: self.clone(),
                tenant: admission.tenant,
            },
        })
    }

    /// A validated request's routing inputs, as the frontend's backend computes them.
    fn prepare(
        &self,
        req: ValidRequest,
        subset: Option<Vec<String>>,
        now: u64,
    ) -> (Prepared, Admission) {
        let bs = self.view.config().block_size;
        let seed = HashSeed::for_request(
            req.cache_salt.as_deref().map(str::as_bytes),
            req.adapter.as_deref(),
        );
        let hashes = compute_block_hashes(&req.prompt_tokens, bs, seed)
            .iter()
            .map(|h| h.sequence)
            .collect();
        let route = RouteRequest {
            overrides: req.routing.overrides,
            priority: req.priority,
            adapter: req.adapter.as_deref().map(AdapterId::of),
            ..self.routing.route_request(&req.prompt_tokens, bs, seed)
        };
        let admission = Admission::of(&req, now);
        let prepared = Prepared {
            route,
            hashes,
            expected_output_tokens: u64::from(
                req.routing
                    .expected_output_tokens
                    .map_or(req.max_tokens, |n| n.min(req.max_tokens)),
            ),
            session: req
                .routing
                .session
                .as_deref()
                .map(|s| SessionKey::new(req.tenant.as_deref(), s)),
            subset,
        };
        (prepared, admission)
    }

    /// A request without a prompt the picker reads: routed on load alone.
    fn prepare_unread(
        &self,
        headers: &axum::http::HeaderMap,
        subset: Option<Vec<String>>,
        now: u64,
    ) -> (Prepared, Admission) {
        let bs = self.view.config().block_size;
        let tenant = headers
            .get("x-tandem-tenant")
            .and_then(|v| v.to_str().ok())
            .filter(|t| !t.is_empty())
            .map_or_else(|| Arc::from(ANONYMOUS), Arc::from);
        let timeout = self.body.config().request_timeout;
        let admission = Admission {
            tenant,
            priority: tandem_router::Priority::Standard,
            prompt_tokens: 0,
            charged: 0,
            deadline_ms: now.saturating_add(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
        };
        let prepared = Prepared {
            route: self.routing.route_request(&[], bs, HashSeed::default()),
            hashes: Vec::new(),
            expected_output_tokens: 0,
            session: None,
            subset,
        };
        (prepared, admission)
    }

    fn eligible_exists(&self, subset: &Option<Vec<String>>) -> bool {
        let registry = self.view.registry();
        registry
            .decode
            .values()
            .any(|e| eligible(e.record.addresses.http.as_deref(), subset))
    }

    /// Routes `p` among the pickable workers and records it in the tracker (called under the
    /// gate's queue lock). [`RouteError::Saturated`]: every pickable worker is.
    pub fn plan(self: &Arc<Self>, p: &Prepared) -> Result<Lease, RouteError> {
        let request = RequestId(self.ids.lock().next_u64() >> 1);
        let input = RouteInput {
            request,
            route: p.route,
            hashes: &p.hashes,
            expected_output_tokens: p.expected_output_tokens,
            overlap: None,
            session: p.session,
        };
        let now = self.view.now_ms();
        let registry = self.view.registry();
        let mut excluded: Vec<WorkerId> = registry
            .decode
            .iter()
            .filter(|(_, e)| !eligible(e.record.addresses.http.as_deref(), &p.subset))
            .map(|(id, _)| *id)
            .collect();
        excluded.extend(registry.prefill.keys().copied());
        let http = |id: WorkerId| {
            registry
                .get(id)
                .and_then(|e| e.record.addresses.http.clone())
        };
        let mut replica = self.view.replica().write();
        let plan = match replica.route_admitted(&input, &excluded, now) {
            // Workers exist but none is pickable: as good as none for the gateway.
            Err(RouteError::AllExcluded) => Err(RouteError::NoWorkers),
            r => r,
        }?;
        let worker = plan.decode_worker();
        self.counters
            .flow
            .recent
            .decision(request, &p.route, 0, &plan.decision);
        let Some(chosen) = http(worker) else {
            // Cannot be: only workers with an endpoint are candidates. Released here, under
            // the replica's lock (a lease's drop would take it again).
            let msgs = replica.finish(plan.flight, now);
            self.sync(msgs);
            return Err(RouteError::NoWorkers);
        };
        self.sync(plan.sync);
        let mut endpoints = Vec::with_capacity(1 + self.fallbacks);
        endpoints.push(chosen);
        // The fallbacks: the policy's next choices, decided but not recorded (the served
        // endpoint read back from the response moves the entry if the gateway used one).
        excluded.push(worker);
        for _ in 0..self.fallbacks {
            let Ok(d) = replica.decide(&input, &excluded, now) else {
                break;
            };
            let w = d.decode_worker();
            excluded.push(w);
            if let Some(e) = http(w) {
                endpoints.push(e);
            }
        }
        Ok(Lease {
            picker: self.clone(),
            worker,
            endpoints,
            inner: plan.flight,
        })
    }
}

/// Whether a worker with HTTP endpoint `http` may be picked under the subset hint.
fn eligible(http: Option<&str>, subset: &Option<Vec<String>>) -> bool {
    match (http, subset) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(h), Some(s)) => s.iter().any(|e| e == h),
    }
}

impl Lease {
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The response began: the request's prefill load leaves its worker.
    pub fn first_token(&mut self) {
        let now = self.picker.view.now_ms();
        let msgs = self
            .picker
            .view
            .replica()
            .write()
            .first_token(&mut self.inner, now);
        self.picker.sync(msgs);
        self.picker.gate.wake();
    }

    /// The gateway says `served` answered the request: when that is not the worker it is
    /// booked on (a fallback was used), the entry moves to the worker serving at `served`.
    pub fn served(&mut self, served: &str, p: &Prepared) {
        let picker = self.picker.clone();
        let current = self.endpoints.first().map(String::as_str);
        if current == Some(served) {
            return;
        }
        let registry = picker.view.registry();
        let Some(target) = registry
            .decode
            .iter()
            .find(|(_, e)| e.record.addresses.http.as_deref() == Some(served))
            .map(|(id, _)| *id)
        else {
            tracing::debug!(served, "served endpoint is not a known worker");
            return;
        };
        if target == self.worker {
            return;
        }
        let others: Vec<WorkerId> = registry
            .decode
            .keys()
            .chain(registry.prefill.keys())
            .copied()
            .filter(|id| *id != target)
            .collect();
        let input = RouteInput {
            request: RequestId(picker.ids.lock().next_u64() >> 1),
            route: p.route,
            hashes: &p.hashes,
            expected_output_tokens: p.expected_output_tokens,
            overlap: None,
            session: p.session,
        };
        let now = picker.view.now_ms();
        let mut replica = picker.view.replica().write();
        match replica.route(&input, &others, now) {
            Ok(plan) if plan.decode_worker() == target => {
                let old = std::mem::replace(&mut self.inner, plan.flight);
                let mut msgs = replica.finish(old, now);
                msgs.extend(plan.sync);
                drop(replica);
                tracing::info!(
                    from = self.worker.0,
                    to = target.0,
                    "the gateway fell back to another endpoint: tracker entry moved"
                );
                self.worker = target;
                self.endpoints.insert(0, served.to_string());
                picker.sync(msgs);
                picker.gate.wake();
            }
            Ok(plan) => {
                // Not the served worker (cannot happen with all others excluded): undo.
                let msgs = replica.finish(plan.flight, now);
                drop(replica);
                picker.sync(msgs);
            }
            Err(e) => tracing::debug!(error = %e, "could not move the tracker entry"),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let now = self.picker.view.now_ms();
        let msgs = self.picker.view.replica().write().finish(self.inner, now);
        self.picker.sync(msgs);
        self.picker.gate.wake();
    }
}
