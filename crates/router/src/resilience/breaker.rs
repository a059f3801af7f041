//! Circuit breakers per worker ([`Breakers`]) and the retry budget ([`RetryBudget`]), sans-IO
//! (docs/ARCHITECTURE.md §10): a worker that discovery still lists but that fails is not chosen — not
//! even by cache affinity — and retries cannot multiply a failure into an overload.
//!
//! # Breaker
//!
//! Closed → open when a worker fails [`BreakerConfig::consecutive_failures`] times in a row,
//! or when at least [`BreakerConfig::window_min_requests`] outcomes in the last
//! [`BreakerConfig::window_ms`] were failures at [`BreakerConfig::window_failure_ratio`] or
//! more. Open for [`BreakerConfig::open_ms`] (doubled each time it re-opens from half-open,
//! up to [`BreakerConfig::max_open_ms`]), then half-open: one probe request may go; its
//! success closes the breaker, its failure re-opens it. A probe whose outcome never comes
//! (cancelled) frees the slot after another open period.
//!
//! What counts is the caller's call: failures are transport errors, timeouts, a worker's
//! 5xx-class answers and streams that die; never the client's own errors (a 4xx-class answer
//! says nothing about the worker — the SGLang gateway counted those and opened breakers on
//! healthy workers, sgl-project/sglang#25811).
//!
//! # Retry budget
//!
//! Retries (and hedges) may be at most [`RetryBudgetConfig::ratio`] of the successes in the
//! last [`RetryBudgetConfig::window_ms`], plus a floor of
//! [`RetryBudgetConfig::min_per_window`] so that a cold or small system can retry at all.

use std::collections::VecDeque;

use hashbrown::HashMap;
use tandem_protocol::WorkerId;

use crate::error::{ConfigError, non_negative};

/// When breakers open and for how long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BreakerConfig {
    /// Failures in a row that open the breaker (0: off).
    pub consecutive_failures: u32,
    /// The window of the failure-ratio rule, in milliseconds.
    pub window_ms: u64,
    /// Outcomes in the window before the ratio rule applies.
    pub window_min_requests: u32,
    /// Failure ratio in the window that opens the breaker (> 1: rule off).
    pub window_failure_ratio: f64,
    /// The first open period.
    pub open_ms: u64,
    /// The longest open period.
    pub max_open_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            consecutive_failures: 5,
            window_ms: 30_000,
            window_min_requests: 20,
            window_failure_ratio: 0.5,
            open_ms: 5_000,
            max_open_ms: 60_000,
        }
    }
}

impl BreakerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("breaker failure ratio", self.window_failure_ratio)?;
        if self.open_ms == 0 || self.max_open_ms < self.open_ms {
            return Err(ConfigError::OutOfRange {
                name: "breaker open time (ms)",
                requirement: "at least 1 and at most the longest open time",
                value: self.open_ms as f64,
            });
        }
        Ok(())
    }
}

/// A breaker's state, for metrics and explanations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakerState {
    Closed,
    /// Refusing until the time given.
    Open {
        until_ms: u64,
    },
    /// One probe may go (or is out).
    HalfOpen,
}

impl BreakerState {
    /// 0 closed, 1 half-open, 2 open: the gauge's value.
    pub fn level(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open { .. } => 2,
        }
    }
}

#[derive(Clone, Debug)]
struct Breaker {
    state: BreakerState,
    consecutive: u32,
    /// (time, failed) of the outcomes in the window.
    window: VecDeque<(u64, bool)>,
    failures_in_window: u32,
    /// The open period the next opening uses.
    next_open_ms: u64,
    /// A half-open probe went out at this time.
    probe_at: Option<u64>,
    opened: u64,
}

impl Breaker {
    fn new(cfg: &BreakerConfig) -> Self {
        Breaker {
            state: BreakerState::Closed,
            consecutive: 0,
            window: VecDeque::new(),
            failures_in_window: 0,
            next_open_ms: cfg.open_ms,
            probe_at: None,
            opened: 0,
        }
    }

    fn trim(&mut self, cfg: &BreakerConfig, now_ms: u64) {
        while let Some(&(t, failed)) = self.window.front() {
            if t + cfg.window_ms > now_ms {
                break;
            }
            self.window.pop_front();
            if failed {
                self.failures_in_window -= 1;
            }
        }
    }

    fn open(&mut self, cfg: &BreakerConfig, now_ms: u64) {
        self.state = BreakerState::Open {
            until_ms: now_ms + self.next_open_ms,
        };
        self.next_open_ms = (self.next_open_ms * 2).min(cfg.max_open_ms);
        self.probe_at = None;
        self.consecutive = 0;
        self.window.clear();
        self.failures_in_window = 0;
        self.opened += 1;
    }

    /// Moves an elapsed open period to half-open.
    fn tick(&mut self, now_ms: u64) {
        if let BreakerState::Open { until_ms } = self.state
            && now_ms >= until_ms
        {
            self.state = BreakerState::HalfOpen;
            self.probe_at = None;
        }
    }
}

/// The breakers of a pool's workers (see the module docs).
#[derive(Clone, Debug)]
pub struct Breakers {
    cfg: BreakerConfig,
    workers: HashMap<WorkerId, Breaker>,
    /// Workers whose breaker is open or half-open: the only ones [`Breakers::allows`] may
    /// refuse, listed without a pass over every worker.
    not_closed: std::collections::BTreeSet<WorkerId>,
}

impl Breakers {
    pub fn new(cfg: BreakerConfig) -> Self {
        Breakers {
            cfg,
            workers: HashMap::new(),
            not_closed: std::collections::BTreeSet::new(),
        }
    }

    pub fn config(&self) -> &BreakerConfig {
        &self.cfg
    }

    /// Whether a request may go to `worker` now (closed, or half-open with no probe out).
    /// Does not take the probe: [`Self::on_chosen`] does, for the worker actually chosen.
    pub fn allows(&self, worker: WorkerId, now_ms: u64) -> bool {
        let Some(b) = self.workers.get(&worker) else {
            return true;
        };
        match b.state {
            BreakerState::Closed => true,
            BreakerState::Open { until_ms } => now_ms >= until_ms,
            BreakerState::HalfOpen => b.probe_at.is_none_or(|t| now_ms >= t + self.cfg.open_ms),
        }
    }

    /// `worker` was chosen for a request: a half-open breaker's probe is now out.
    pub fn on_chosen(&mut self, worker: WorkerId, now_ms: u64) {
        if let Some(b) = self.workers.get_mut(&worker) {
            b.tick(now_ms);
            if b.state == BreakerState::HalfOpen {
                b.probe_at = Some(now_ms);
            }
        }
    }

    /// A request on `worker` succeeded.
    pub fn success(&mut self, worker: WorkerId, now_ms: u64) {
        let cfg = self.cfg;
        let b = self
            .workers
            .entry(worker)
            .or_insert_with(|| Breaker::new(&cfg));
        b.tick(now_ms);
        match b.state {
            BreakerState::HalfOpen => {
                *b = Breaker {
                    opened: b.opened,
                    ..Breaker::new(&cfg)
                };
                self.not_closed.remove(&worker);
            }
            BreakerState::Closed => {
                b.consecutive = 0;
                b.trim(&cfg, now_ms);
                b.window.push_back((now_ms, false));
            }
            // A request started before it opened: says nothing new.
            BreakerState::Open { .. } => {}
        }
    }

    /// A request on `worker` failed for a reason that is the worker's. Returns true when
    /// this opened its breaker.
    pub fn failure(&mut self, worker: WorkerId, now_ms: u64) -> bool {
        let cfg = self.cfg;
        let b = self
            .workers
            .entry(worker)
            .or_insert_with(|| Breaker::new(&cfg));
        b.tick(now_ms);
        match b.state {
            BreakerState::HalfOpen => {
                b.open(&cfg, now_ms);
                self.not_closed.insert(worker);
                true
            }
            BreakerState::Open { .. } => false,
            BreakerState::Closed => {
                b.consecutive += 1;
                b.trim(&cfg, now_ms);
                b.window.push_back((now_ms, true));
                b.failures_in_window += 1;
                let n = b.window.len() as u32;
                let by_row =
                    cfg.consecutive_failures > 0 && b.consecutive >= cfg.consecutive_failures;
                let by_ratio = n >= cfg.window_min_requests.max(1)
                    && f64::from(b.failures_in_window) >= cfg.window_failure_ratio * f64::from(n);
                if by_row || by_ratio {
                    b.open(&cfg, now_ms);
                    self.not_closed.insert(worker);
                    true
                } else {
                    false
                }
            }
        }
    }

    /// The state of `worker`'s breaker now.
    pub fn state(&self, worker: WorkerId, now_ms: u64) -> BreakerState {
        self.workers.get(&worker).map_or(BreakerState::Closed, |b| {
            let mut b = b.clone();
            b.tick(now_ms);
            b.state
        })
    }

    /// How many times `worker`'s breaker opened.
    pub fn times_opened(&self, worker: WorkerId) -> u64 {
        self.workers.get(&worker).map_or(0, |b| b.opened)
    }

    /// A worker left: its breaker goes (a new worker under the id starts closed).
    pub fn remove(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
        self.not_closed.remove(&worker);
    }

    /// The workers [`Breakers::allows`] refuses now, by id: a pass over the breakers that
    /// are not closed only.
    pub fn refused(&self, now_ms: u64) -> impl Iterator<Item = WorkerId> + '_ {
        self.not_closed
            .iter()
            .copied()
            .filter(move |&w| !self.allows(w, now_ms))
    }

    /// Workers with a breaker that is not closed.
    pub fn not_closed(&self, now_ms: u64) -> Vec<(WorkerId, BreakerState)> {
        let mut out: Vec<_> = self
            .workers
            .keys()
            .map(|&w| (w, self.state(w, now_ms)))
            .filter(|(_, s)| *s != BreakerState::Closed)
            .collect();
        out.sort_by_key(|(w, _)| *w);
        out
    }
}

/// How many retries the budget allows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryBudgetConfig {
    /// Retries per success in the window (0.1: one retry per ten successes).
    pub ratio: f64,
    /// Retries the window always allows.
    pub min_per_window: u32,
    pub window_ms: u64,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        RetryBudgetConfig {
            ratio: 0.1,
            // Finagle's floor: 10 a second, so that a small or cold system can retry at all.
            min_per_window: 100,
            window_ms: 10_000,
        }
    }
}

impl RetryBudgetConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("retry budget ratio", self.ratio)?;
        if self.window_ms == 0 {
            return Err(ConfigError::OutOfRange {
                name: "retry budget window (ms)",
                requirement: "at least 1",
                value: 0.0,
            });
        }
        Ok(())
    }
}

/// Successes and retries per second over the window.
#[derive(Clone, Debug)]
pub struct RetryBudget {
    cfg: RetryBudgetConfig,
    /// (second, successes, retries), oldest first.
    seconds: VecDeque<(u64, u32, u32)>,
}

impl RetryBudget {
    pub fn new(cfg: RetryBudgetConfig) -> Self {
        RetryBudget {
            cfg,
            seconds: VecDeque::new(),
        }
    }

    fn slot(&mut self, now_ms: u64) -> &mut (u64, u32, u32) {
        let s = now_ms / 1000;
        let window_s = self.cfg.window_ms.div_ceil(1000);
        while self
            .seconds
            .front()
            .is_some_and(|(t, _, _)| t + window_s <= s)
        {
            self.seconds.pop_front();
        }
        if self.seconds.back().is_none_or(|(t, _, _)| *t != s) {
            self.seconds.push_back((s, 0, 0));
        }
        self.seconds.back_mut().expect("pushed")
    }

    pub fn success(&mut self, now_ms: u64) {
        self.slot(now_ms).1 += 1;
    }

    /// Takes one retry from the budget; false (nothing taken) when it is spent.
    pub fn try_retry(&mut self, now_ms: u64) -> bool {
        self.slot(now_ms);
        let (ok, retries) = self.seconds.iter().fold((0u64, 0u64), |(o, r), (_, s, t)| {
            (o + u64::from(*s), r + u64::from(*t))
        });
        let allowed =
            (self.cfg.ratio * ok as f64).floor() as u64 + u64::from(self.cfg.min_per_window);
        if retries >= allowed {
            return false;
        }
        self.slot(now_ms).2 += 1;
        true
    }
}
