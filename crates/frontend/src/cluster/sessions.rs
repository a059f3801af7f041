//! Sessions at the frontend: the per-session cap on concurrent requests (so that one agent's
//! fan-out cannot take the pool) and the session series on `/metrics`. Where a session's
//! requests go is the routing replica's business (`tandem_router::sessions`).
//!
//! A request of a session at its cap waits (in arrival order, woken one at a time as the
//! session's requests end) until the request's deadline or the queue's longest wait, then gets
//! 429 `session_limit`; at most [`MAX_WAITING_PER_SESSION`] × the cap wait per session, later
//! ones get the 429 at once. The table holds only sessions with requests in flight or
//! waiting, so it is bounded by the requests in the frontend.

use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashMap;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tandem_router::{SessionKey, SessionOutcome};
use tokio::sync::Notify;

use crate::http::ServeError;

/// Waiting requests per session at most, in multiples of the cap.
pub(crate) const MAX_WAITING_PER_SESSION: u32 = 4;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// Session series on `/metrics`.
#[derive(Debug, Default)]
pub struct SessionMetrics {
    routes: Family<OutcomeLabel, Counter>,
    limited: Counter,
    sessions: Gauge,
}

impl SessionMetrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = SessionMetrics::default();
        for outcome in ["new", "hit", "moved"] {
            let _ = m.routes.get_or_create(&OutcomeLabel { outcome });
        }
        registry.register(
            "tandem_frontend_session_routes",
            "Requests that named a session, by what routing did with it: hit (its pinned \
             worker took it), moved (that worker could not: busy, saturated, failing or gone), \
             new (no pinned worker: first request, or expired)",
            m.routes.clone(),
        );
        registry.register(
            "tandem_frontend_session_limited",
            "Requests refused with 429 session_limit: their session had its cap of concurrent \
             requests in flight for longer than they could wait",
            m.limited.clone(),
        );
        registry.register(
            "tandem_frontend_sessions",
            "Sessions the routing replica keeps pinned",
            m.sessions.clone(),
        );
        m
    }

    pub(crate) fn routed(&self, outcome: SessionOutcome, sessions: usize) {
        let outcome = match outcome {
            SessionOutcome::New => "new",
            SessionOutcome::Hit => "hit",
            SessionOutcome::Moved => "moved",
        };
        self.routes.get_or_create(&OutcomeLabel { outcome }).inc();
        self.sessions
            .set(i64::try_from(sessions).unwrap_or(i64::MAX));
    }
}

#[derive(Debug)]
struct Slot {
    active: u32,
    waiting: u32,
    freed: Arc<Notify>,
}

/// The per-session cap (see the module docs).
#[derive(Debug)]
pub(crate) struct SessionLimiter {
    cap: Option<u32>,
    slots: Mutex<HashMap<SessionKey, Slot>>,
    metrics: Arc<SessionMetrics>,
}

/// A request's place among its session's concurrent requests; released on drop.
#[derive(Debug)]
pub(crate) struct SessionPermit {
    limiter: Arc<SessionLimiter>,
    key: SessionKey,
}

impl Drop for SessionPermit {
    fn drop(&mut self) {
        let mut slots = self.limiter.slots.lock();
        if let Some(s) = slots.get_mut(&self.key) {
            s.active = s.active.saturating_sub(1);
            s.freed.notify_one();
            if s.active == 0 && s.waiting == 0 {
                slots.remove(&self.key);
            }
        }
    }
}

fn limited(cap: u32, retry: Duration) -> ServeError {
    ServeError::overloaded(
        format!("this session already has {cap} requests in flight (its cap); retry later"),
        retry,
    )
    .with_code("session_limit")
}

impl SessionLimiter {
    /// `cap`: concurrent requests per session at most (None: no cap).
    pub(crate) fn new(cap: Option<u32>, metrics: Arc<SessionMetrics>) -> Self {
        SessionLimiter {
            cap: cap.filter(|&c| c > 0),
            slots: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    #[cfg(test)]
    fn metrics(&self) -> &SessionMetrics {
        &self.metrics
    }

    /// Sessions with requests in flight or waiting.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.lock().len()
    }

    /// Requests of `key` waiting for a place.
    #[cfg(test)]
    fn waiting(&self, key: SessionKey) -> u32 {
        self.slots.lock().get(&key).map_or(0, |s| s.waiting)
    }

    /// Until `n` requests of `key` wait (a test's condition, with a deadline).
    #[cfg(test)]
    async fn until_waiting(&self, key: SessionKey, n: u32) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while self.waiting(key) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{n} waiters never came"
            );
            tokio::task::yield_now().await;
        }
    }

    /// Waits for a place in the session, until `until` at most.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        key: SessionKey,
        until: tokio::time::Instant,
    ) -> Result<Option<SessionPermit>, ServeError> {
        let Some(cap) = self.cap else {
            return Ok(None);
        };
        let permit = || SessionPermit {
            limiter: self.clone(),
            key,
        };
        let mut waited = false;
        loop {
            let freed = {
                let mut slots = self.slots.lock();
                let s = slots.entry(key).or_insert_with(|| Slot {
                    active: 0,
                    waiting: 0,
                    freed: Arc::new(Notify::new()),
                });
                if waited {
                    s.waiting -= 1;
                }
                if s.active < cap {
                    s.active += 1;
                    return Ok(Some(permit()));
                }
                if s.waiting >= cap.saturating_mul(MAX_WAITING_PER_SESSION) {
                    drop(slots);
                    self.metrics.limited.inc();
                    return Err(limited(cap, Duration::from_secs(1)));
                }
                s.waiting += 1;
                s.freed.clone()
            };
            waited = true;
            // `notify_one` stores a permit when nobody waits yet, so a release between the
            // unlock above and this await is not lost.
            let woke = tokio::time::timeout_at(until, freed.notified()).await;
            if woke.is_err() {
                let mut slots = self.slots.lock();
                if let Some(s) = slots.get_mut(&key) {
                    s.waiting -= 1;
                    // A wake-up meant for us goes to the next waiter.
                    s.freed.notify_one();
                    if s.active == 0 && s.waiting == 0 {
                        slots.remove(&key);
                    }
                }
                drop(slots);
                self.metrics.limited.inc();
                return Err(limited(cap, Duration::from_secs(1)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(cap: Option<u32>) -> Arc<SessionLimiter> {
        Arc::new(SessionLimiter::new(cap, Arc::default()))
    }

    fn soon(ms: u64) -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_millis(ms)
    }

    #[tokio::test]
    async fn a_session_at_its_cap_waits_for_one_of_its_requests_to_end() {
        let l = limiter(Some(2));
        let (a, b) = (SessionKey(1), SessionKey(2));
        let p1 = l.acquire(a, soon(10)).await.unwrap().unwrap();
        let _p2 = l.acquire(a, soon(10)).await.unwrap().unwrap();
        // Another session is not affected.
        let _q = l.acquire(b, soon(10)).await.unwrap().unwrap();
        // The third of `a` waits, and gets its place when the first ends.
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire(a, soon(5_000)).await })
        };
        l.until_waiting(a, 1).await;
        assert!(!waiter.is_finished());
        drop(p1);
        let p3 = waiter.await.unwrap().unwrap();
        assert!(p3.is_some());
        // With no release before its wait ends: 429 session_limit.
        let e = l.acquire(a, soon(30)).await.unwrap_err();
        assert_eq!(e.code(), Some("session_limit"));
        assert_eq!(l.metrics().limited.get(), 1);
    }

    #[tokio::test]
    async fn too_many_waiters_are_refused_at_once_and_the_table_empties() {
        let l = limiter(Some(1));
        let a = SessionKey(7);
        let held = l.acquire(a, soon(10)).await.unwrap().unwrap();
        let mut waiters = Vec::new();
        for _ in 0..MAX_WAITING_PER_SESSION {
            let l = l.clone();
            // Each holds its place until its task ends, then the next goes.
            waiters.push(tokio::spawn(async move {
                l.acquire(a, soon(5_000)).await.map(|p| p.is_some())
            }));
        }
        l.until_waiting(a, MAX_WAITING_PER_SESSION).await;
        let started = std::time::Instant::now();
        let e = l.acquire(a, soon(5_000)).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(e.code(), Some("session_limit"));
        // Releasing lets them through one at a time; at the end nothing is left.
        drop(held);
        for w in waiters {
            assert!(w.await.unwrap().unwrap());
        }
        assert_eq!(l.len(), 0);
        // No cap: no permit, no entry.
        let none = limiter(None);
        assert!(none.acquire(a, soon(1)).await.unwrap().is_none());
        assert_eq!(none.len(), 0);
    }
}
