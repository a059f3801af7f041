//! Flow control at the frontend (docs/ARCHITECTURE.md §10), sans-IO: the bounded queue requests wait in
//! while every decode worker is saturated, the order they leave it in, and the per-tenant rate
//! limits checked before they enter. The frontend holds one [`FlowQueue`] behind a lock and
//! dispatches from it as capacity frees; `tandem sim` could drive the same type in virtual
//! time. Time is milliseconds passed in; nothing here sleeps or spawns.
//!
//! # Order
//!
//! - **Bands** ([`Priority`]): strict — the highest band with a request waiting is served
//!   first. **Starvation guard**: while a lower band's oldest request has waited at least
//!   [`FlowConfig::starvation_ms`], every [`FlowConfig::starvation_every`]-th dispatch goes to
//!   it, so a sustained flood of interactive traffic cannot hold batch work forever, while
//!   interactive keeps the rest of the capacity.
//! - **Tenants** inside a band: the Virtual Token Counter (Sheng et al., "Fairness in Serving
//!   Large Language Models", OSDI 2024). Each tenant has a counter charged
//!   [`FlowConfig::input_weight`] per prompt token when its request is dispatched and
//!   [`FlowConfig::output_weight`] per generated token as the output streams
//!   ([`FlowQueue::charge_output`]), divided by the tenant's weight; the waiting tenant with the
//!   least counter goes next (its oldest request: FIFO within a tenant). A tenant that starts
//!   waiting after a quiet spell is lifted to the least counter among the tenants already
//!   waiting, so idleness cannot be saved up as credit.
//! - **Bound**: at most [`FlowConfig::max_queued`] requests wait. A request arriving at a full
//!   queue displaces the newest request of the lowest band below its own, if any (that one is
//!   refused with [`RejectReason::Displaced`]: batch is shed first); otherwise it is refused
//!   ([`RejectReason::QueueFull`]).
//! - **Deadlines**: every entry has one — its request's, or [`FlowConfig::max_wait_ms`] after
//!   it arrived if sooner; [`FlowQueue::expire`] takes out those past it
//!   ([`RejectReason::QueueTimeout`]).
//!
//! # Rate limits
//!
//! Per tenant, token buckets of requests per minute and tokens per minute
//! ([`TenantLimits`]), refilled continuously. [`FlowQueue::check_limits`] charges a request's
//! prompt plus its `max_tokens` up front (capped at the bucket's size, so a request larger
//! than the budget waits for a full bucket rather than forever) and refuses with the time until
//! the bucket holds enough; [`FlowQueue::refund_tokens`] gives back what the request did not
//! generate. Limits come from [`FlowConfig::limits`] unless [`FlowQueue::set_tenant_limits`]
//! names the tenant.
//!
//! # `Retry-After`
//!
//! Refusals carry a retry time: for rate limits, when the bucket refills enough; for the
//! queue, the requests ahead divided by the queue's drain rate over the last ten seconds
//! (between 1 and 60 s).
//!
//! # Memory
//!
//! Entries are bounded by `max_queued`. Tenant state exists for tenants with requests
//! waiting or running, or with buckets still refilling; idle tenants are dropped by
//! [`FlowQueue::prune`] (a dropped tenant comes back with the least waiting counter, which
//! the lift rule would give it anyway unless it had been over-served), and at most
//! [`FlowConfig::max_tenants`] exist at once ([`RejectReason::TooManyTenants`] beyond).

mod buckets;
mod priority;

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use hashbrown::HashMap;

pub use buckets::TokenBucket;
pub use priority::Priority;

use crate::error::{ConfigError, non_negative};

/// Per-tenant limits and share.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TenantLimits {
    /// Requests admitted per minute at most; None: no limit.
    pub requests_per_minute: Option<u64>,
    /// Prompt + `max_tokens` tokens admitted per minute at most; None: no limit.
    pub tokens_per_minute: Option<u64>,
    /// The tenant's share in the fairness counter (2: served twice the tokens of a tenant of
    /// weight 1 before it counts as equal). > 0.
    pub weight: f64,
}

impl Default for TenantLimits {
    fn default() -> Self {
        TenantLimits {
            requests_per_minute: None,
            tokens_per_minute: None,
            weight: 1.0,
        }
    }
}

impl TenantLimits {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("tenant weight", self.weight)?;
        if self.weight == 0.0 {
            return Err(ConfigError::OutOfRange {
                name: "tenant weight",
                requirement: "> 0",
                value: 0.0,
            });
        }
        for (name, v) in [
            ("requests per minute", self.requests_per_minute),
            ("tokens per minute", self.tokens_per_minute),
        ] {
            if v == Some(0) {
                return Err(ConfigError::OutOfRange {
                    name,
                    requirement: "at least 1 (leave it unset for no limit)",
                    value: 0.0,
                });
            }
        }
        Ok(())
    }
}

/// How the queue orders, bounds and limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlowConfig {
    /// Requests waiting at most (0: none wait; a request that finds every worker saturated is
    /// refused at once).
    pub max_queued: usize,
    /// The longest a request waits in the queue, whatever its deadline: past it, it is
    /// refused (`Retry-After`) rather than kept for a worker that will not be free in time
    /// to matter — under sustained overload the queue sheds instead of growing every
    /// request's wait.
    pub max_wait_ms: u64,
    /// A lower band whose oldest request has waited this long is starving.
    pub starvation_ms: u64,
    /// A starving band gets one dispatch after this many went to the bands above it.
    pub starvation_every: u32,
    /// Fairness charge per prompt token.
    pub input_weight: f64,
    /// Fairness charge per generated token (VTC's default is twice the input's: output tokens
    /// cost the engine more).
    pub output_weight: f64,
    /// Limits of tenants not named in [`FlowQueue::set_tenant_limits`].
    pub limits: TenantLimits,
    /// Tenants tracked at once at most.
    pub max_tenants: usize,
}

impl Default for FlowConfig {
    fn default() -> Self {
        FlowConfig {
            max_queued: 1024,
            max_wait_ms: 10_000,
            starvation_ms: 5_000,
            starvation_every: 8,
            input_weight: 1.0,
            output_weight: 2.0,
            limits: TenantLimits::default(),
            max_tenants: 100_000,
        }
    }
}

impl FlowConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("fairness input weight", self.input_weight)?;
        non_negative("fairness output weight", self.output_weight)?;
        self.limits.validate()?;
        if self.starvation_every == 0 || self.max_tenants == 0 {
            return Err(ConfigError::OutOfRange {
                name: "starvation share / max tenants",
                requirement: "at least 1",
                value: 0.0,
            });
        }
        Ok(())
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The queue was full of requests of its band or above.
    QueueFull,
    /// Its deadline passed while it waited.
    QueueTimeout,
    /// A request of a higher band took its place in a full queue.
    Displaced,
    /// The tenant's requests-per-minute limit.
    RequestsPerMinute,
    /// The tenant's tokens-per-minute limit.
    TokensPerMinute,
    /// More tenants at once than [`FlowConfig::max_tenants`].
    TooManyTenants,
}

impl RejectReason {
    pub const ALL: [RejectReason; 6] = [
        RejectReason::QueueFull,
        RejectReason::QueueTimeout,
        RejectReason::Displaced,
        RejectReason::RequestsPerMinute,
        RejectReason::TokensPerMinute,
        RejectReason::TooManyTenants,
    ];

    /// The label in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "queue_full",
            RejectReason::QueueTimeout => "queue_timeout",
            RejectReason::Displaced => "displaced",
            RejectReason::RequestsPerMinute => "rate_limit_requests",
            RejectReason::TokensPerMinute => "rate_limit_tokens",
            RejectReason::TooManyTenants => "too_many_tenants",
        }
    }

    /// A rate limit of the tenant's, not the cluster's capacity.
    pub fn is_rate_limit(self) -> bool {
        matches!(
            self,
            RejectReason::RequestsPerMinute | RejectReason::TokensPerMinute
        )
    }
}

/// A refusal and when to come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: RejectReason,
    pub retry_after_ms: u64,
}

/// A queued request's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(u64);

/// What the queue knows of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Meta {
    pub tenant: Arc<str>,
    pub priority: Priority,
    /// Prompt tokens, charged to the tenant's counter at dispatch.
    pub prompt_tokens: u64,
    /// When it entered the queue.
    pub arrived_ms: u64,
    /// When it must have left it.
    pub deadline_ms: u64,
}

/// Which tenant was served, by how much: for the shell's per-tenant metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatched<T> {
    pub ticket: Ticket,
    pub meta: Meta,
    pub item: T,
}

#[derive(Debug)]
struct Entry<T> {
    meta: Meta,
    item: T,
}

#[derive(Debug, Default)]
struct TenantState {
    /// The virtual token counter.
    counter: f64,
    /// Requests waiting, all bands.
    queued: u32,
    /// Requests dispatched and not finished.
    running: u32,
    requests: Option<TokenBucket>,
    tokens: Option<TokenBucket>,
}

#[derive(Debug, Default)]
struct Band {
    /// Each waiting tenant's tickets, oldest first (tickets grow with arrival).
    per_tenant: HashMap<Arc<str>, BTreeSet<Ticket>>,
    /// Every waiting ticket of the band, oldest first.
    order: BTreeSet<Ticket>,
    /// Dispatches that went to higher bands while this one starved.
    skipped: u32,
}

/// Dispatch counts per second over the last [`DRAIN_WINDOW_S`] seconds.
const DRAIN_WINDOW_S: usize = 10;

#[derive(Debug, Default)]
struct DrainRate {
    /// (second, dispatches in it), newest last.
    seconds: VecDeque<(u64, u32)>,
    first_ms: Option<u64>,
}

impl DrainRate {
    fn record(&mut self, now_ms: u64) {
        let s = now_ms / 1000;
        self.first_ms.get_or_insert(now_ms);
        match self.seconds.back_mut() {
            Some((t, n)) if *t == s => *n += 1,
            _ => self.seconds.push_back((s, 1)),
        }
        self.trim(s);
    }

    fn trim(&mut self, s: u64) {
        while self
            .seconds
            .front()
            .is_some_and(|(t, _)| t + DRAIN_WINDOW_S as u64 <= s)
        {
            self.seconds.pop_front();
        }
    }

    /// Dispatches per second over the window (or since the first dispatch, if later).
    fn per_second(&self, now_ms: u64) -> f64 {
        let s = now_ms / 1000;
        let n: u32 = self
            .seconds
            .iter()
            .filter(|(t, _)| t + (DRAIN_WINDOW_S as u64) > s)
            .map(|(_, n)| n)
            .sum();
        let Some(first) = self.first_ms else {
            return 0.0;
        };
        let span_ms = now_ms
            .saturating_sub(first)
            .clamp(1000, DRAIN_WINDOW_S as u64 * 1000);
        f64::from(n) * 1000.0 / span_ms as f64
    }
}

/// The frontend's queue (see the module docs). `T` is the shell's handle for a waiting
/// request (e.g. where to send its dispatch).
#[derive(Debug)]
pub struct FlowQueue<T> {
    cfg: FlowConfig,
    entries: HashMap<Ticket, Entry<T>>,
    bands: [Band; 3],
    /// (deadline, ticket) of every waiting request.
    deadlines: BTreeSet<(u64, Ticket)>,
    tenants: HashMap<Arc<str>, TenantState>,
    /// Limits of tenants named by the operator.
    named: HashMap<Arc<str>, TenantLimits>,
    next_ticket: u64,
    drain: DrainRate,
}

impl<T> FlowQueue<T> {
    pub fn new(cfg: FlowConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(FlowQueue {
            cfg,
            entries: HashMap::new(),
            bands: Default::default(),
            deadlines: BTreeSet::new(),
            tenants: HashMap::new(),
            named: HashMap::new(),
            next_ticket: 0,
            drain: DrainRate::default(),
        })
    }

    pub fn config(&self) -> &FlowConfig {
        &self.cfg
    }

    /// Replaces the limits of named tenants (e.g. from a reloaded keys file); others get
    /// [`FlowConfig::limits`]. Buckets of tenants whose limit changed start full.
    pub fn set_tenant_limits(
        &mut self,
        limits: impl IntoIterator<Item = (Arc<str>, TenantLimits)>,
    ) -> Result<(), ConfigError> {
        let mut named = HashMap::new();
        for (tenant, l) in limits {
            l.validate()?;
            named.insert(tenant, l);
        }
        for (tenant, state) in self.tenants.iter_mut() {
            let new = named.get(tenant).copied().unwrap_or(self.cfg.limits);
            let old = self.named.get(tenant).copied().unwrap_or(self.cfg.limits);
            if new.requests_per_minute != old.requests_per_minute
                || new.tokens_per_minute != old.tokens_per_minute
            {
                state.requests = None;
                state.tokens = None;
            }
        }
        self.named = named;
        Ok(())
    }

    fn limits_of(&self, tenant: &str) -> TenantLimits {
        self.named.get(tenant).copied().unwrap_or(self.cfg.limits)
    }

    /// Requests waiting, all bands.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Requests waiting in `band`.
    pub fn len_band(&self, band: Priority) -> usize {
        self.bands[band.band()].order.len()
    }

    /// Tenants with state.
    pub fn tenants(&self) -> usize {
        self.tenants.len()
    }

    /// A tenant's fairness counter (0 for one without state).
    pub fn counter(&self, tenant: &str) -> f64 {
        self.tenants.get(tenant).map_or(0.0, |t| t.counter)
    }

    /// The state of `tenant`, made if needed (None when at the tenant bound even after
    /// pruning).
    fn tenant_mut(&mut self, tenant: &Arc<str>, now_ms: u64) -> Option<&mut TenantState> {
        if !self.tenants.contains_key(tenant) {
            if self.tenants.len() >= self.cfg.max_tenants {
                self.prune(now_ms);
            }
            if self.tenants.len() >= self.cfg.max_tenants {
                return None;
            }
            self.tenants.insert(tenant.clone(), TenantState::default());
        }
        self.tenants.get_mut(tenant)
    }

    /// Checks the tenant's rate limits for a request of `tokens` (prompt + `max_tokens`) and
    /// charges them. Refused: nothing is charged.
    pub fn check_limits(
        &mut self,
        tenant: &Arc<str>,
        tokens: u64,
        now_ms: u64,
    ) -> Result<(), Rejection> {
        let limits = self.limits_of(tenant);
        let Some(state) = self.tenant_mut(tenant, now_ms) else {
            return Err(Rejection {
                reason: RejectReason::TooManyTenants,
                retry_after_ms: 1000,
            });
        };
        let requests = limits.requests_per_minute.map(|rpm| {
            state
                .requests
                .get_or_insert_with(|| TokenBucket::per_minute(rpm, now_ms))
        });
        let wait_requests = requests.map_or(0, |b| b.wait_ms(1, now_ms));
        let tokens_wait = limits.tokens_per_minute.map_or(0, |tpm| {
            state
                .tokens
                .get_or_insert_with(|| TokenBucket::per_minute(tpm, now_ms))
                .wait_ms(tokens, now_ms)
        });
        if wait_requests > 0 {
            return Err(Rejection {
                reason: RejectReason::RequestsPerMinute,
                retry_after_ms: wait_requests,
            });
        }
        if tokens_wait > 0 {
            return Err(Rejection {
                reason: RejectReason::TokensPerMinute,
                retry_after_ms: tokens_wait,
            });
        }
        if let Some(b) = state.requests.as_mut() {
            b.take(1, now_ms);
        }
        if let Some(b) = state.tokens.as_mut() {
            b.take(tokens, now_ms);
        }
        Ok(())
    }

    /// Gives back tokens charged by [`Self::check_limits`] that were not used (a request
    /// refused later, or one that generated fewer than its `max_tokens`).
    pub fn refund_tokens(&mut self, tenant: &str, tokens: u64, now_ms: u64) {
        if let Some(b) = self.tenants.get_mut(tenant).and_then(|t| t.tokens.as_mut()) {
            b.give_back(tokens, now_ms);
        }
    }

    /// The retry time of a queue refusal with `ahead` requests in front.
    fn queue_retry_ms(&self, ahead: usize, now_ms: u64) -> u64 {
        let rate = self.drain.per_second(now_ms);
        if rate <= 0.0 {
            return 10_000;
        }
        ((ahead.max(1) as f64 / rate * 1000.0).ceil() as u64).clamp(1000, 60_000)
    }

    /// The `Retry-After` of a refusal by the queue now (for a shell refusing on its own, e.g.
    /// a deadline).
    pub fn retry_after_ms(&self, now_ms: u64) -> u64 {
        self.queue_retry_ms(self.len(), now_ms)
    }

    /// Puts a request in the queue. A full queue makes room by displacing the newest request
    /// of the lowest band below `meta.priority` (returned, to be refused with
    /// [`RejectReason::Displaced`]); with none, the request is refused and handed back.
    #[allow(clippy::type_complexity)]
    pub fn enqueue(
        &mut self,
        mut meta: Meta,
        item: T,
        now_ms: u64,
    ) -> Result<(Ticket, Option<(Meta, T)>), (Rejection, T)> {
        meta.deadline_ms = meta
            .deadline_ms
            .min(now_ms.saturating_add(self.cfg.max_wait_ms));
        let mut displaced = None;
        if self.entries.len() >= self.cfg.max_queued {
            let victim = (meta.priority.band() + 1..self.bands.len())
                .rev()
                .find_map(|b| self.bands[b].order.last().copied());
            match victim.and_then(|t| self.take(t)) {
                Some(v) => displaced = Some(v),
                None => {
                    let rejection = Rejection {
                        reason: RejectReason::QueueFull,
                        retry_after_ms: self.queue_retry_ms(self.entries.len(), now_ms),
                    };
                    return Err((rejection, item));
                }
            }
        }
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        // The lift: a tenant that starts waiting does not bring credit from its quiet time.
        let least_waiting = self
            .tenants
            .values()
            .filter(|t| t.queued > 0)
            .map(|t| t.counter)
            .reduce(f64::min);
        let Some(state) = self.tenant_mut(&meta.tenant, now_ms) else {
            let rejection = Rejection {
                reason: RejectReason::TooManyTenants,
                retry_after_ms: 1000,
            };
            // Put a displaced request back: nothing was admitted in its place.
            if let Some((m, i)) = displaced {
                let _ = self.enqueue(m, i, now_ms);
            }
            return Err((rejection, item));
        };
        if state.queued == 0
            && let Some(least) = least_waiting
        {
            state.counter = state.counter.max(least);
        }
        state.queued += 1;
        let band = &mut self.bands[meta.priority.band()];
        band.per_tenant
            .entry(meta.tenant.clone())
            .or_default()
            .insert(ticket);
        band.order.insert(ticket);
        self.deadlines.insert((meta.deadline_ms, ticket));
        self.entries.insert(ticket, Entry { meta, item });
        Ok((ticket, displaced))
    }

    /// Removes a waiting request (e.g. its client left); None when it is not waiting.
    pub fn remove(&mut self, ticket: Ticket) -> Option<(Meta, T)> {
        self.take(ticket)
    }

    fn take(&mut self, ticket: Ticket) -> Option<(Meta, T)> {
        let entry = self.entries.remove(&ticket)?;
        let band = &mut self.bands[entry.meta.priority.band()];
        band.order.remove(&ticket);
        if let Some(set) = band.per_tenant.get_mut(&entry.meta.tenant) {
            set.remove(&ticket);
            if set.is_empty() {
                band.per_tenant.remove(&entry.meta.tenant);
            }
        }
        self.deadlines.remove(&(entry.meta.deadline_ms, ticket));
        if let Some(t) = self.tenants.get_mut(&entry.meta.tenant) {
            t.queued = t.queued.saturating_sub(1);
        }
        Some((entry.meta, entry.item))
    }

    /// Takes out every request whose deadline is at or before `now_ms`, oldest deadline first.
    pub fn expire(&mut self, now_ms: u64) -> Vec<(Meta, T)> {
        let mut out = Vec::new();
        while let Some(&(deadline, ticket)) = self.deadlines.first() {
            if deadline > now_ms {
                break;
            }
            match self.take(ticket) {
                Some(e) => out.push(e),
                None => {
                    self.deadlines.pop_first();
                }
            }
        }
        out
    }

    /// The next request to dispatch, by the band and fairness rules, without taking it (the
    /// shell may find that it cannot be placed after all). Deterministic.
    pub fn peek(&self, now_ms: u64) -> Option<Ticket> {
        let band = self.next_band(now_ms)?;
        self.next_in_band(band)
    }

    /// The waiting request behind a ticket.
    pub fn get(&self, ticket: Ticket) -> Option<(&Meta, &T)> {
        self.entries.get(&ticket).map(|e| (&e.meta, &e.item))
    }

    /// Takes a request out for dispatch: charges its prompt to the tenant's counter and counts
    /// it in the drain rate. (Its shell calls [`Self::begin`] once the request holds it.)
    pub fn dispatch(&mut self, ticket: Ticket, now_ms: u64) -> Option<Dispatched<T>> {
        let band = self.entries.get(&ticket)?.meta.priority.band();
        let starving = self.starving(now_ms);
        for (b, s) in starving.iter().enumerate() {
            if *s && b > band {
                self.bands[b].skipped += 1;
            }
        }
        self.bands[band].skipped = 0;
        let (meta, item) = self.take(ticket)?;
        self.started(&meta.tenant, meta.prompt_tokens, now_ms);
        Some(Dispatched { ticket, meta, item })
    }

    /// A request that never waited (the queue was empty and a worker free): charged and
    /// counted as [`Self::dispatch`] does.
    pub fn dispatch_direct(&mut self, tenant: &Arc<str>, prompt_tokens: u64, now_ms: u64) {
        self.started(tenant, prompt_tokens, now_ms);
    }

    fn started(&mut self, tenant: &Arc<str>, prompt_tokens: u64, now_ms: u64) {
        self.drain.record(now_ms);
        let charge = self.cfg.input_weight * prompt_tokens as f64 / self.limits_of(tenant).weight;
        // A tenant over the bound still runs (its check passed earlier); it is just not
        // charged.
        if let Some(t) = self.tenant_mut(tenant, now_ms) {
            t.counter += charge;
        }
    }

    /// A dispatched request is running: its tenant's state is kept until [`Self::finished`].
    pub fn begin(&mut self, tenant: &str) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.running += 1;
        }
    }

    /// Charges generated tokens to the tenant's counter.
    pub fn charge_output(&mut self, tenant: &str, tokens: u64) {
        let charge = self.cfg.output_weight * tokens as f64 / self.limits_of(tenant).weight;
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.counter += charge;
        }
    }

    /// A running request ended.
    pub fn finished(&mut self, tenant: &str) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.running = t.running.saturating_sub(1);
        }
    }

    /// Drops the state of idle tenants: none waiting or running, buckets full again.
    pub fn prune(&mut self, now_ms: u64) {
        self.tenants.retain(|_, t| {
            t.queued > 0
                || t.running > 0
                || t.requests.as_ref().is_some_and(|b| !b.is_full(now_ms))
                || t.tokens.as_ref().is_some_and(|b| !b.is_full(now_ms))
        });
    }

    /// Per band, whether its oldest request has waited at least the starvation time.
    fn starving(&self, now_ms: u64) -> [bool; 3] {
        let mut out = [false; 3];
        for (b, band) in self.bands.iter().enumerate() {
            out[b] = band
                .order
                .first()
                .and_then(|t| self.entries.get(t))
                .is_some_and(|e| {
                    now_ms.saturating_sub(e.meta.arrived_ms) >= self.cfg.starvation_ms
                });
        }
        out
    }

    fn next_band(&self, now_ms: u64) -> Option<usize> {
        let top = (0..self.bands.len()).find(|&b| !self.bands[b].order.is_empty())?;
        let starving = self.starving(now_ms);
        // The highest starving band below the top whose share is due.
        let due = (top + 1..self.bands.len())
            .find(|&b| starving[b] && self.bands[b].skipped >= self.cfg.starvation_every);
        Some(due.unwrap_or(top))
    }

    /// The band's tenant with the least counter (ties: the oldest request), its oldest
    /// request.
    fn next_in_band(&self, band: usize) -> Option<Ticket> {
        self.bands[band]
            .per_tenant
            .iter()
            .filter_map(|(tenant, tickets)| {
                let first = *tickets.first()?;
                let counter = self.tenants.get(tenant).map_or(0.0, |t| t.counter);
                Some((counter, first))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, t)| t)
    }
}
