//! LoRA-aware routing: requests gather on the workers that hold their adapter.
//!
//! A request on a LoRA adapter hashes its blocks under the adapter too
//! ([`tandem_protocol::HashSeed::for_request`]), so its prefix overlap already counts only
//! blocks computed with that adapter. What the overlap cannot see is the adapter itself: a
//! worker that does not hold it must load it before the request starts (tens of ms from host
//! memory, more from disk), and one whose adapter slots are all in use by running requests
//! makes the request wait for a slot (vLLM skips it until one frees). The `kv` cost therefore
//! adds, in blocks like its other terms,
//!
//! ```text
//! adapter(w) = 0                        the adapter is resident on w
//!            = load_cost                w has a free slot
//!            = 1.5 · load_cost          w must evict an idle adapter (whose next request
//!                                       then likely pays a load of its own)
//!            = load_cost + full_cost    every slot of w is in use
//! ```
//!
//! Which adapters a worker holds is an estimate, kept as an engine keeps its slots (least
//! recently used out): the adapters of this replica's requests in flight there (they must
//! be loaded), then those it routed there within [`AdapterConfig::ttl_ms`], newest first,
//! then those the worker's latest load report lists ([`tandem_protocol::AdapterLoad`]), at
//! most as many as the worker has slots. So a burst of requests on a new adapter gathers on
//! the first worker chosen instead of loading it everywhere before the next report, and an
//! adapter pushed out by newer ones stops counting. Every slot is taken when this replica's
//! requests in flight there use as many adapters as it has slots. A worker that reports no
//! slot count (0) is never full, and caps nothing. Sans-IO: time is passed in.

use hashbrown::HashMap;
use tandem_protocol::{AdapterId, AdapterLoad, WorkerId};

use crate::error::{ConfigError, non_negative};

/// Knobs of LoRA-aware routing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdapterConfig {
    /// Blocks added to a worker's cost when it must load the request's adapter. Default 96:
    /// a 20 ms load stalls the worker about as long as prefilling 80 blocks of 16 tokens on
    /// the mocker's default timing, and a sweep on a 16-adapter workload put the best TTFT
    /// between 96 and 256 (crates/router/EXPERIMENTS.md).
    pub load_cost: f64,
    /// Blocks added on top when every adapter slot of the worker is taken (the request waits
    /// for one). Default 128.
    pub full_cost: f64,
    /// How long an adapter routed to a worker counts as resident there without a report
    /// saying so. Default 30 s.
    pub ttl_ms: u64,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        AdapterConfig {
            load_cost: 96.0,
            full_cost: 128.0,
            ttl_ms: 30_000,
        }
    }
}

impl AdapterConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("adapter load cost", self.load_cost)?;
        non_negative("adapter full cost", self.full_cost)
    }

    /// The cost term of a fit.
    pub fn cost(&self, fit: AdapterFit) -> f64 {
        match fit {
            AdapterFit::Resident => 0.0,
            AdapterFit::Loadable => self.load_cost,
            AdapterFit::Evicts => 1.5 * self.load_cost,
            AdapterFit::Full => self.load_cost + self.full_cost,
        }
    }
}

/// How a worker stands with a request's adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterFit {
    /// Held already (or the request has no adapter).
    Resident,
    /// Must be loaded; a slot is free.
    Loadable,
    /// Must be loaded in place of an idle adapter.
    Evicts,
    /// Must be loaded, and every slot is taken.
    Full,
}

#[derive(Clone, Debug, Default)]
struct WorkerAdapters {
    max_loaded: u32,
    reported: Vec<AdapterId>,
    /// Routed here by this replica, with when (latest start or end of a request on it).
    routed: Vec<(AdapterId, u64)>,
    /// This replica's requests in flight here, per adapter.
    in_flight: Vec<(AdapterId, u32)>,
}

impl WorkerAdapters {
    fn touch(&mut self, adapter: AdapterId, ttl_ms: u64, now_ms: u64) {
        self.routed
            .retain(|(a, at)| *a != adapter && now_ms.saturating_sub(*at) < ttl_ms);
        self.routed.push((adapter, now_ms));
    }

    /// The adapters it most likely holds: those of requests in flight (they must be
    /// loaded), then those routed here newest first (within the TTL), then those reported;
    /// at most its slot count when it reports one, as an engine evicting the least recently
    /// used would.
    fn likely_resident(&self, ttl_ms: u64, now_ms: u64) -> Vec<AdapterId> {
        let mut out: Vec<AdapterId> = self.in_flight.iter().map(|(a, _)| *a).collect();
        let routed = self
            .routed
            .iter()
            .rev()
            .filter(|(_, at)| now_ms.saturating_sub(*at) < ttl_ms)
            .map(|(a, _)| *a);
        for a in routed.chain(self.reported.iter().copied()) {
            if !out.contains(&a) {
                out.push(a);
            }
        }
        if self.max_loaded > 0 {
            out.truncate((self.max_loaded as usize).max(self.in_flight.len()));
        }
        out
    }
}

/// What one replica knows of every worker's adapters.
#[derive(Clone, Debug, Default)]
pub struct Adapters {
    config: AdapterConfig,
    workers: HashMap<WorkerId, WorkerAdapters>,
}

impl Adapters {
    pub fn new(config: AdapterConfig) -> Self {
        Adapters {
            config,
            workers: HashMap::new(),
        }
    }

    pub fn config(&self) -> &AdapterConfig {
        &self.config
    }

    /// A worker's report: what it holds now replaces what it said before.
    pub fn report(&mut self, worker: WorkerId, load: &AdapterLoad) {
        if load.max_loaded == 0 && load.resident.is_empty() && !self.workers.contains_key(&worker) {
            return; // no LoRA there: nothing to remember
        }
        let w = self.workers.entry(worker).or_default();
        w.max_loaded = load.max_loaded;
        w.reported.clear();
        w.reported
            .extend(load.resident.iter().map(|n| AdapterId::of(n)));
    }

    /// A request on `adapter` starts on `worker`.
    pub fn start(&mut self, worker: WorkerId, adapter: AdapterId, now_ms: u64) {
        let ttl = self.config.ttl_ms;
        let w = self.workers.entry(worker).or_default();
        w.touch(adapter, ttl, now_ms);
        match w.in_flight.iter_mut().find(|(a, _)| *a == adapter) {
            Some((_, n)) => *n += 1,
            None => w.in_flight.push((adapter, 1)),
        }
    }

    /// A request on `adapter` that started on `worker` is done there.
    pub fn end(&mut self, worker: WorkerId, adapter: AdapterId, now_ms: u64) {
        let ttl = self.config.ttl_ms;
        let Some(w) = self.workers.get_mut(&worker) else {
            return; // the worker left meanwhile
        };
        w.touch(adapter, ttl, now_ms);
        if let Some(i) = w.in_flight.iter().position(|(a, _)| *a == adapter) {
            w.in_flight[i].1 -= 1;
            if w.in_flight[i].1 == 0 {
                w.in_flight.swap_remove(i);
            }
        }
    }

    /// The worker left: forget it.
    pub fn remove(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// How `worker` stands with `adapter` at `now_ms`.
    pub fn fit(&self, worker: WorkerId, adapter: Option<AdapterId>, now_ms: u64) -> AdapterFit {
        let Some(adapter) = adapter else {
            return AdapterFit::Resident;
        };
        let Some(w) = self.workers.get(&worker) else {
            return AdapterFit::Loadable;
        };
        let resident = w.likely_resident(self.config.ttl_ms, now_ms);
        let slots = w.max_loaded as usize;
        if resident.contains(&adapter) {
            AdapterFit::Resident
        } else if slots > 0 && w.in_flight.len() >= slots {
            AdapterFit::Full
        } else if slots > 0 && resident.len() >= slots {
            AdapterFit::Evicts
        } else {
            AdapterFit::Loadable
        }
    }

    /// The `kv` cost term of `worker` for `adapter` ([`AdapterConfig::cost`]).
    pub fn cost(&self, worker: WorkerId, adapter: Option<AdapterId>, now_ms: u64) -> f64 {
        self.config.cost(self.fit(worker, adapter, now_ms))
    }
}
