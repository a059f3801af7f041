//! The cluster backend's part of the status page (`GET /status.json`, see
//! `http/observe/status.rs`): its pools and workers as the [`ClusterView`] knows them (registry,
//! latest load reports and when they arrived, the token rates of those reports, breakers, the tracker's own count), and what
//! the router did lately ([`RecentActivity`]).

use serde::Serialize;
use tandem_protocol::{WorkerId, WorkerRole};
use tandem_router::BreakerState;

use super::cache_health::{CacheHealth, Finding, block_size_findings, stream_findings};
use super::recent::{ActivitySnapshot, RecentActivity};
use super::view::{ClusterView, WorkerEntry};

/// One worker as shown.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerStatus {
    pub id: u64,
    /// `decode` or `prefill` (aggregated workers are in the decode pool).
    pub pool: &'static str,
    pub role: &'static str,
    /// `ok`, `no report` (none arrived yet), or the breaker's `open` / `half-open`.
    pub state: &'static str,
    /// Whether it publishes KV events (else the router remembers its own decisions for it).
    pub kv_events: bool,
    /// From its latest load report (`None` before the first one).
    pub kv_active_blocks: Option<u64>,
    pub kv_total_blocks: Option<u64>,
    pub kv_usage: Option<f64>,
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    pub pending_prefill_tokens: Option<u64>,
    /// Tokens per second it computed, prompt (prefill) and generated (decode), from its load
    /// reports' counters (`None` before two reports a second apart).
    pub prefill_tokens_per_s: Option<f64>,
    pub decode_tokens_per_s: Option<f64>,
    /// Requests the router's tracker counts on it (this replica's and its peers').
    pub tracked_requests: u64,
    /// How long ago its latest load report arrived, in milliseconds.
    pub last_seen_ms: Option<u64>,
}

/// One pool's sums over its workers' latest reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PoolStatus {
    pub name: &'static str,
    pub workers: usize,
    /// Workers with a load report.
    pub reporting: usize,
    pub running: u64,
    pub waiting: u64,
    pub kv_active_blocks: u64,
    pub kv_total_blocks: u64,
    pub kv_usage: Option<f64>,
    /// Sums of the workers' token rates (those that have one).
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
}

/// The cluster backend's status.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterStatus {
    pub kind: &'static str,
    pub router_id: u64,
    pub pools: Vec<PoolStatus>,
    pub workers: Vec<WorkerStatus>,
    /// Why registered workers' caches may not hit (`cache_health.rs`), worker by worker.
    pub cache_health: Vec<Finding>,
    #[serde(flatten)]
    pub activity: ActivitySnapshot,
}

fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
        WorkerRole::Aggregated => "aggregated",
    }
}

fn usage(active: u64, total: u64) -> Option<f64> {
    (total > 0).then(|| active as f64 / total as f64)
}

/// The view's workers and `activity`, now.
pub(crate) fn cluster_status(
    view: &ClusterView,
    activity: &RecentActivity,
    cache: &CacheHealth,
) -> ClusterStatus {
    let now = view.now_ms();
    // The registry first, then the replica: the order the view itself locks them in.
    let entries: Vec<(&'static str, WorkerId, WorkerRole, bool)> = {
        let registry = view.registry();
        let list =
            |pool: &'static str,
             m: &std::collections::BTreeMap<WorkerId, std::sync::Arc<WorkerEntry>>| {
                m.values()
                    .map(move |e| (pool, e.record.id, e.record.role, e.record.kv_events))
                    .collect::<Vec<_>>()
            };
        let mut all = list("decode", &registry.decode);
        all.extend(list("prefill", &registry.prefill));
        all
    };
    let (router_id, workers) = {
        let replica = view.replica().read();
        let workers: Vec<WorkerStatus> = entries
            .into_iter()
            .map(|(pool, id, role, kv_events)| {
                let report = replica.report(id);
                let state = match replica.breaker(id, now) {
                    BreakerState::Open { .. } => "open",
                    BreakerState::HalfOpen => "half-open",
                    BreakerState::Closed if report.is_none() => "no report",
                    BreakerState::Closed => "ok",
                };
                WorkerStatus {
                    id: id.0,
                    pool,
                    role: role_name(role),
                    state,
                    kv_events,
                    kv_active_blocks: report.map(|r| r.kv_active_blocks),
                    kv_total_blocks: report.map(|r| r.kv_total_blocks),
                    kv_usage: report.and_then(|r| usage(r.kv_active_blocks, r.kv_total_blocks)),
                    running: report.map(|r| r.running_requests),
                    waiting: report.map(|r| r.waiting_requests),
                    pending_prefill_tokens: report.map(|r| r.pending_prefill_tokens),
                    prefill_tokens_per_s: None,
                    decode_tokens_per_s: None,
                    tracked_requests: replica.tracker().load(id).active_requests,
                    last_seen_ms: None,
                }
            })
            .collect();
        (replica.config().router_id, workers)
    };
    let workers: Vec<WorkerStatus> = workers
        .into_iter()
        .map(|mut w| {
            w.last_seen_ms = view
                .last_report_age(WorkerId(w.id))
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            let rates = view.token_rates(WorkerId(w.id));
            w.prefill_tokens_per_s = rates.map(|r| r.prefill);
            w.decode_tokens_per_s = rates.map(|r| r.decode);
            w
        })
        .collect();
    let pools = ["decode", "prefill"]
        .into_iter()
        .map(|name| {
            let mut p = PoolStatus {
                name,
                ..PoolStatus::default()
            };
            for w in workers.iter().filter(|w| w.pool == name) {
                p.workers += 1;
                if w.running.is_some() {
                    p.reporting += 1;
                }
                p.running += u64::from(w.running.unwrap_or(0));
                p.waiting += u64::from(w.waiting.unwrap_or(0));
                p.kv_active_blocks += w.kv_active_blocks.unwrap_or(0);
                p.kv_total_blocks += w.kv_total_blocks.unwrap_or(0);
                p.prefill_tokens_per_s += w.prefill_tokens_per_s.unwrap_or(0.0);
                p.decode_tokens_per_s += w.decode_tokens_per_s.unwrap_or(0.0);
            }
            p.kv_usage = usage(p.kv_active_blocks, p.kv_total_blocks);
            p
        })
        .collect();
    let refused = block_size_findings(&view.refused_block_sizes(), view.block_size().get());
    let cache_health = refused
        .into_iter()
        .chain(stream_findings(&view.troubled_streams()))
        .chain(
            cache
                .findings()
                .into_iter()
                .filter(|f| workers.iter().any(|w| w.id == f.worker)),
        )
        .collect();
    ClusterStatus {
        kind: "cluster",
        router_id: router_id.0,
        pools,
        workers,
        cache_health,
        activity: activity.snapshot(),
    }
}
