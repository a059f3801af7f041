//! Session affinity: a conversation (or an agent's run) keeps going to the decode worker that
//! served its last turn, where its whole history is cached, while that worker is healthy and
//! not busy; otherwise the policy chooses and the session moves with the request.
//!
//! The table is bounded ([`SessionConfig::max_sessions`], least recently used evicted first)
//! and forgets a session [`SessionConfig::ttl_ms`] after its last request ended (a session
//! with requests in flight never expires). Sans-IO: time is passed in.
//!
//! Why pin when the `kv` cost already prefers the worker holding the history: the cost sees
//! the cache only through KV events and load estimates, both of which lag; a pinned session
//! is right by construction at the next turn, costs no index lookup to be right, and keeps
//! being right on engines that publish no events. The escape (busy, saturated, breaker open,
//! excluded after a failure) keeps it from holding a conversation on a worker that cannot
//! serve it.

use std::collections::BTreeSet;

use hashbrown::HashMap;
use tandem_protocol::WorkerId;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::ConfigError;

/// A session's key: a hash of its tenant and id, so tenants never share sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey(pub u64);

impl SessionKey {
    pub fn new(tenant: Option<&str>, id: &str) -> Self {
        let t = tenant.map_or(0, |t| xxh3_64_with_seed(t.as_bytes(), 0x5e55));
        SessionKey(xxh3_64_with_seed(id.as_bytes(), t))
    }
}

/// Knobs of session affinity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SessionConfig {
    /// Pin sessions at all (a request's session is otherwise ignored by routing).
    pub enabled: bool,
    /// How long an idle session (no request in flight) stays pinned.
    pub ttl_ms: u64,
    /// Sessions remembered at most.
    pub max_sessions: usize,
}

impl Default for SessionConfig {
    /// On; 10 minutes idle (a user reading an answer and typing the next turn; engines keep
    /// a conversation's prefix far shorter under load, and then the escape moves it); 100,000
    /// sessions (about 6 MB).
    fn default() -> Self {
        SessionConfig {
            enabled: true,
            ttl_ms: 600_000,
            max_sessions: 100_000,
        }
    }
}

impl SessionConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.enabled && (self.ttl_ms == 0 || self.max_sessions == 0) {
            return Err(ConfigError::OutOfRange {
                name: "session ttl (ms) and max sessions",
                requirement: "at least 1 each",
                value: 0.0,
            });
        }
        Ok(())
    }
}

/// What happened to a session when one of its requests was routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionOutcome {
    /// Unknown (new, expired or evicted): now pinned to the chosen worker.
    New,
    /// Routed to its pinned worker.
    Hit,
    /// Its pinned worker could not take it (busy, saturated, failing, gone): pinned to the
    /// new one.
    Moved,
}

/// Counters for `/metrics` and the simulator's report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    pub new: u64,
    pub hits: u64,
    pub moves: u64,
    /// Forgotten after the TTL.
    pub expired: u64,
    /// Forgotten to stay under the bound.
    pub evicted: u64,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    worker: WorkerId,
    /// When its last request ended, or began (whichever is later).
    last_ms: u64,
    /// Requests of the session routed and not finished.
    active: u32,
}

/// The session table (see the module docs).
#[derive(Debug)]
pub struct Sessions {
    cfg: SessionConfig,
    map: HashMap<SessionKey, Entry>,
    /// Idle sessions by last use: the expiry and eviction order. Sessions with requests in
    /// flight are not in it.
    idle: BTreeSet<(u64, SessionKey)>,
    stats: SessionStats,
}

impl Sessions {
    pub fn new(cfg: SessionConfig) -> Self {
        Sessions {
            cfg,
            map: HashMap::new(),
            idle: BTreeSet::new(),
            stats: SessionStats::default(),
        }
    }

    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// Forgets idle sessions past their TTL.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(&(last, key)) = self.idle.first() {
            if now_ms.saturating_sub(last) < self.cfg.ttl_ms {
                break;
            }
            self.idle.pop_first();
            self.map.remove(&key);
            self.stats.expired += 1;
        }
    }

    /// The worker a session is pinned to, if any (after expiry at `now_ms`).
    pub fn pinned(&mut self, key: SessionKey, now_ms: u64) -> Option<WorkerId> {
        if !self.cfg.enabled {
            return None;
        }
        self.expire(now_ms);
        self.map.get(&key).map(|e| e.worker)
    }

    /// A request of the session was routed to `worker`: pins it there and counts it in flight.
    pub fn bind(&mut self, key: SessionKey, worker: WorkerId, now_ms: u64) -> SessionOutcome {
        if !self.cfg.enabled {
            return SessionOutcome::New;
        }
        self.expire(now_ms);
        let outcome = match self.map.get_mut(&key) {
            Some(e) => {
                if e.active == 0 {
                    self.idle.remove(&(e.last_ms, key));
                }
                let outcome = if e.worker == worker {
                    SessionOutcome::Hit
                } else {
                    SessionOutcome::Moved
                };
                e.worker = worker;
                e.last_ms = e.last_ms.max(now_ms);
                e.active += 1;
                outcome
            }
            None => {
                if self.map.len() >= self.cfg.max_sessions {
                    self.evict_one();
                }
                self.map.insert(
                    key,
                    Entry {
                        worker,
                        last_ms: now_ms,
                        active: 1,
                    },
                );
                SessionOutcome::New
            }
        };
        match outcome {
            SessionOutcome::New => self.stats.new += 1,
            SessionOutcome::Hit => self.stats.hits += 1,
            SessionOutcome::Moved => self.stats.moves += 1,
        }
        outcome
    }

    /// A request of the session ended.
    pub fn release(&mut self, key: SessionKey, now_ms: u64) {
        let Some(e) = self.map.get_mut(&key) else {
            return;
        };
        e.active = e.active.saturating_sub(1);
        e.last_ms = e.last_ms.max(now_ms);
        if e.active == 0 {
            self.idle.insert((e.last_ms, key));
        }
    }

    /// The worker left: its sessions are forgotten (their next request is routed afresh).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let gone: Vec<SessionKey> = self
            .map
            .iter()
            .filter(|(_, e)| e.worker == worker)
            .map(|(k, _)| *k)
            .collect();
        for key in gone {
            if let Some(e) = self.map.remove(&key)
                && e.active == 0
            {
                self.idle.remove(&(e.last_ms, key));
            }
        }
    }

    /// Drops the least recently used idle session, or, with none idle, an arbitrary busy one
    /// (the bound holds whatever the traffic).
    fn evict_one(&mut self) {
        let key = match self.idle.pop_first() {
            Some((_, key)) => key,
            None => match self.map.keys().next() {
                Some(&k) => k,
                None => return,
            },
        };
        self.map.remove(&key);
        self.stats.evicted += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(ttl_ms: u64, max: usize) -> Sessions {
        Sessions::new(SessionConfig {
            enabled: true,
            ttl_ms,
            max_sessions: max,
        })
    }

    const A: SessionKey = SessionKey(1);
    const B: SessionKey = SessionKey(2);
    const C: SessionKey = SessionKey(3);

    #[test]
    fn a_session_is_pinned_moves_and_expires_after_its_ttl_idle() {
        let mut s = table(100, 10);
        assert_eq!(s.pinned(A, 0), None);
        assert_eq!(s.bind(A, WorkerId(1), 0), SessionOutcome::New);
        assert_eq!(s.pinned(A, 5), Some(WorkerId(1)));
        assert_eq!(s.bind(A, WorkerId(1), 5), SessionOutcome::Hit);
        // In flight (2 requests): never expires.
        assert_eq!(s.pinned(A, 10_000), Some(WorkerId(1)));
        s.release(A, 10_000);
        assert_eq!(s.pinned(A, 20_000), Some(WorkerId(1)));
        s.release(A, 20_000);
        // Idle from 20,000: pinned until 20,100.
        assert_eq!(s.pinned(A, 20_099), Some(WorkerId(1)));
        assert_eq!(s.bind(A, WorkerId(2), 20_099), SessionOutcome::Moved);
        s.release(A, 20_099);
        assert_eq!(s.pinned(A, 20_198), Some(WorkerId(2)));
        assert_eq!(s.pinned(A, 20_199), None);
        assert_eq!(
            s.stats(),
            SessionStats {
                new: 1,
                hits: 1,
                moves: 1,
                expired: 1,
                evicted: 0
            }
        );
        assert!(s.is_empty());
    }

    #[test]
    fn the_bound_evicts_the_least_recently_used_idle_session() {
        let mut s = table(1_000_000, 2);
        s.bind(A, WorkerId(1), 0);
        s.release(A, 1);
        s.bind(B, WorkerId(2), 2);
        s.release(B, 3);
        // A is older: C takes its place.
        s.bind(C, WorkerId(3), 4);
        assert_eq!(s.len(), 2);
        assert_eq!(s.pinned(A, 5), None);
        assert_eq!(s.pinned(B, 5), Some(WorkerId(2)));
        assert_eq!(s.stats().evicted, 1);
        // Nothing idle (B and C in flight): the bound still holds.
        s.bind(B, WorkerId(2), 6);
        s.bind(A, WorkerId(1), 7);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn a_leaving_worker_takes_its_sessions_and_keys_separate_tenants() {
        let mut s = table(1000, 10);
        s.bind(A, WorkerId(1), 0);
        s.bind(B, WorkerId(2), 0);
        s.release(B, 1);
        s.remove_worker(WorkerId(2));
        s.remove_worker(WorkerId(1));
        assert!(s.is_empty());
        // Releasing a forgotten session is harmless.
        s.release(A, 2);
        assert!(s.is_empty());
        assert_ne!(
            SessionKey::new(Some("t1"), "conv"),
            SessionKey::new(Some("t2"), "conv")
        );
        assert_ne!(
            SessionKey::new(None, "conv"),
            SessionKey::new(Some("t1"), "conv")
        );
        assert_eq!(SessionKey::new(None, "c"), SessionKey::new(None, "c"));
        // Disabled: nothing is pinned.
        let mut off = Sessions::new(SessionConfig {
            enabled: false,
            ..SessionConfig::default()
        });
        off.bind(A, WorkerId(1), 0);
        assert_eq!(off.pinned(A, 0), None);
        assert!(
            SessionConfig {
                ttl_ms: 0,
                ..SessionConfig::default()
            }
            .validate()
            .is_err()
        );
    }
}
