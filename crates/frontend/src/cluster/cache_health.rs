//! Why a worker's prefix cache does not hit, as the frontend can tell: the commonest
//! complaint about a KV-aware router is one that silently never hits. Each finished request
//! (routed on its own, not migrated, prefilled where it decodes) is compared with what the
//! router predicted for it: the prompt tokens the index said its worker held against those
//! the engine says it served from its cache, and the prompt length the engine counted against
//! the one sent. Per worker, a [`Finding`] names a cause:
//!
//! - [`Cause::BlockSizeMismatch`]: the worker announced another KV block size than the
//!   frontend's and was refused (its cache could never match the frontend's block hashes);
//! - [`Cause::NoEvents`]: the worker publishes no KV events (events not enabled on the engine,
//!   or a server that has none), so the router routes it on its memory of where it sent
//!   prompts (approximate), blind to evictions;
//! - [`Cause::HitsBelowPrediction`]: over its recent requests that expected a hit, the engine
//!   served less than half of what the index predicted (events hashed with another seed or
//!   block size, events lagging behind evictions, or a cache smaller than it says);
//! - [`Cause::UnpredictedHits`]: a worker that publishes events serves from its cache, over
//!   its recent requests that hit, more than twice what the index predicted (its events do
//!   not match the prompts the frontend hashes: another hash seed or block size, a tokenizer
//!   that differs, or the events of another engine relayed under its name);
//! - [`Cause::PromptMismatch`]: the engine counts the prompts it is sent differently (a
//!   tokenizer or template that differs from the engine's), on a tenth of requests or more;
//! - [`Cause::EventsGapped`]: the worker's KV events keep getting lost or arriving late (gaps
//!   in its stream, load reports ahead of the index, repairs it does not answer: three within
//!   10,000 of its events, `tandem_indexer::StreamHealth`), each time leaving the index behind
//!   its cache until a repair.
//!
//! Findings show on the status page (`cache_health`), in `/metrics`
//! (`tandem_cache_health{worker,cause}` 1, with `tandem_cache_predicted_tokens` and
//! `tandem_cache_served_tokens` per worker), and once each in the log when first found
//! (unpredicted hits when they hold over a full window of 32 requests: a start-up burst
//! that outruns its own events shows on the status page and clears, unlogged).
//! Units: predicted tokens are the frontend's, served ones the engine's (the same for every
//! engine that takes token ids).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use serde::Serialize;
use tandem_indexer::StreamHealth;
use tandem_protocol::WorkerId;

use super::view::ClusterView;

/// Requests per worker the hit check looks back over (those that expected a hit).
const WINDOW: usize = 32;
/// Tokens (a few blocks' worth) and requests a window must hold before it judges: a burst of
/// repeats that outruns its own events is not a finding.
const MIN_PREDICTED: u64 = 256;
const MIN_REQUESTS: usize = 8;
/// Served below this share of the prediction is a finding.
const SERVED_SHARE: f64 = 0.5;
/// Workers kept (the least recently seen go first): memory stays bounded as workers come
/// and go.
const MAX_WORKERS: usize = 1024;

/// Why a worker's cache may not hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    BlockSizeMismatch,
    NoEvents,
    HitsBelowPrediction,
    UnpredictedHits,
    PromptMismatch,
    EventsGapped,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::BlockSizeMismatch => "block_size_mismatch",
            Cause::NoEvents => "no_events",
            Cause::HitsBelowPrediction => "hits_below_prediction",
            Cause::UnpredictedHits => "unpredicted_hits",
            Cause::PromptMismatch => "prompt_mismatch",
            Cause::EventsGapped => "events_gapped",
        }
    }
}

/// One cause on one worker, and what shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    pub worker: u64,
    pub cause: Cause,
    pub detail: String,
}

/// One finished request, as the hit check sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    pub worker: WorkerId,
    /// The worker publishes KV events.
    pub kv_events: bool,
    /// Prompt tokens the index said the worker held.
    pub predicted: u32,
    /// Prompt tokens the engine said it served from its cache.
    pub served: u32,
    /// The prompt length sent, and the engine's count of it (`None`: not compared, as for
    /// an engine that reads text with its own tokenizer).
    pub prompt: Option<(u32, u32)>,
}

#[derive(Debug, Default)]
struct Stats {
    kv_events: bool,
    /// (predicted, served) of recent requests that expected a hit.
    window: VecDeque<(u32, u32)>,
    /// (predicted, served) of recent requests the engine served from its cache.
    served_window: VecDeque<(u32, u32)>,
    predicted_total: u64,
    served_total: u64,
    compared: u64,
    mismatches: u64,
    seen: u64,
    /// Causes already said in the log.
    logged: Vec<Cause>,
}

/// The causes a request's observation can show, in the order they are listed.
const OBSERVED: [Cause; 4] = [
    Cause::NoEvents,
    Cause::HitsBelowPrediction,
    Cause::UnpredictedHits,
    Cause::PromptMismatch,
];

impl Stats {
    /// Whether `cause` holds now: cheap, for every request (no text is made).
    fn holds(&self, cause: Cause) -> bool {
        match cause {
            Cause::BlockSizeMismatch | Cause::EventsGapped => false,
            Cause::NoEvents => !self.kv_events,
            Cause::HitsBelowPrediction => {
                let (predicted, served) = sums(&self.window);
                self.window.len() >= MIN_REQUESTS
                    && predicted >= MIN_PREDICTED
                    && (served as f64) < SERVED_SHARE * predicted as f64
            }
            Cause::UnpredictedHits => {
                let (predicted, served) = sums(&self.served_window);
                self.kv_events
                    && self.served_window.len() >= MIN_REQUESTS
                    && served >= MIN_PREDICTED
                    && (predicted as f64) < SERVED_SHARE * served as f64
            }
            Cause::PromptMismatch => self.mismatches > 0 && self.mismatches * 10 >= self.compared,
        }
    }

    /// Whether `cause` is said in the log: it holds, and unpredicted hits over a full window.
    /// A burst of requests that outruns its own events at start (every one routed before the
    /// first event arrived, then served from the cache the first one filled) shows as
    /// unpredicted hits on the status page while it lasts and then clears; it is not a
    /// finding worth a log line.
    fn settled(&self, cause: Cause) -> bool {
        let full = cause != Cause::UnpredictedHits || self.served_window.len() >= WINDOW;
        full && self.holds(cause)
    }

    /// What shows `cause`, in words.
    fn detail(&self, cause: Cause) -> String {
        match cause {
            Cause::BlockSizeMismatch | Cause::EventsGapped => String::new(),
            Cause::NoEvents => "publishes no KV events: routed on where the router sent prompts \
                                (approximate), blind to what the engine evicts"
                .to_string(),
            Cause::HitsBelowPrediction => {
                let (predicted, served) = sums(&self.window);
                format!(
                    "served {served} of the {predicted} prompt tokens the index predicted from \
                     its cache over its last {} requests that expected a hit: events hashed \
                     with another seed or block size, events behind evictions, or a smaller \
                     cache than reported",
                    self.window.len()
                )
            }
            Cause::UnpredictedHits => {
                let (predicted, served) = sums(&self.served_window);
                format!(
                    "served {served} prompt tokens from its cache over its last {} requests \
                     that hit, where the index predicted {predicted}: its events do not match \
                     the prompts the frontend hashes (another hash seed or block size, another \
                     tokenizer, or another engine's events relayed as its own)",
                    self.served_window.len()
                )
            }
            Cause::PromptMismatch => format!(
                "counted {} of {} prompts at another length than sent: its tokenizer or chat \
                 template differs from the frontend's",
                self.mismatches, self.compared
            ),
        }
    }

    fn causes(&self, worker: WorkerId) -> Vec<Finding> {
        OBSERVED
            .into_iter()
            .filter(|&c| self.holds(c))
            .map(|cause| Finding {
                worker: worker.0,
                cause,
                detail: self.detail(cause),
            })
            .collect()
    }
}

fn sums(window: &VecDeque<(u32, u32)>) -> (u64, u64) {
    window.iter().fold((0, 0), |(p, s), &(a, b)| {
        (p + u64::from(a), s + u64::from(b))
    })
}

fn push(window: &mut VecDeque<(u32, u32)>, entry: (u32, u32)) {
    if window.len() == WINDOW {
        window.pop_front();
    }
    window.push_back(entry);
}

/// The per-worker hit check.
#[derive(Debug, Default)]
pub struct CacheHealth {
    workers: Mutex<HashMap<WorkerId, Stats>>,
    clock: Mutex<u64>,
}

impl CacheHealth {
    /// Takes one finished request; says each cause the first time it holds for the worker.
    pub fn observe(&self, o: Observation) {
        let seen = {
            let mut c = self.clock.lock();
            *c += 1;
            *c
        };
        let mut workers = self.workers.lock();
        if !workers.contains_key(&o.worker)
            && workers.len() >= MAX_WORKERS
            && let Some(oldest) = workers.iter().min_by_key(|(_, s)| s.seen).map(|(w, _)| *w)
        {
            workers.remove(&oldest);
        }
        let s = workers.entry(o.worker).or_default();
        s.seen = seen;
        s.kv_events = o.kv_events;
        s.predicted_total += u64::from(o.predicted);
        s.served_total += u64::from(o.served);
        if o.predicted > 0 {
            push(&mut s.window, (o.predicted, o.served));
        }
        if o.served > 0 {
            push(&mut s.served_window, (o.predicted, o.served));
        }
        if let Some((sent, counted)) = o.prompt {
            s.compared += 1;
            s.mismatches += u64::from(sent != counted);
        }
        for cause in OBSERVED {
            if !s.logged.contains(&cause) && s.settled(cause) {
                s.logged.push(cause);
                tracing::warn!(
                    worker = o.worker.0,
                    cause = cause.as_str(),
                    "cache health: {}",
                    s.detail(cause)
                );
            }
        }
    }

    /// Every cause that holds now, by worker.
    pub fn findings(&self) -> Vec<Finding> {
        let workers = self.workers.lock();
        let mut ids: Vec<&WorkerId> = workers.keys().collect();
        ids.sort();
        ids.into_iter()
            .flat_map(|id| workers[id].causes(*id))
            .collect()
    }

    fn totals(&self) -> Vec<(u64, u64, u64)> {
        let workers = self.workers.lock();
        let mut out: Vec<_> = workers
            .iter()
            .map(|(w, s)| (w.0, s.predicted_total, s.served_total))
            .collect();
        out.sort_unstable();
        out
    }
}

/// The workers refused for their block size (`refused`: theirs, by worker), as findings.
pub fn block_size_findings(refused: &[(WorkerId, u32)], ours: u32) -> Vec<Finding> {
    refused
        .iter()
        .map(|&(w, theirs)| Finding {
            worker: w.0,
            cause: Cause::BlockSizeMismatch,
            detail: format!(
                "refused: it announces KV blocks of {theirs} tokens, the frontend hashes \
                 blocks of {ours} (--block-size), so its cache could never match"
            ),
        })
        .collect()
}

/// The workers whose KV event streams keep losing events (the index's feed says which), as
/// findings.
pub fn stream_findings(troubled: &[(WorkerId, StreamHealth)]) -> Vec<Finding> {
    troubled
        .iter()
        .map(|&(w, h)| Finding {
            worker: w.0,
            cause: Cause::EventsGapped,
            detail: format!(
                "its KV events keep getting lost or arriving late: {} gaps in its stream, {} \
                 load reports ahead of the index, {} repairs unanswered, over {} events \
                 applied; each time the index lags its cache until a repair (a lossy or \
                 overloaded event plane, or a publisher that drops events)",
                h.gaps, h.behind, h.failed_repairs, h.applied
            ),
        })
        .collect()
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    worker: u64,
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: u64,
}

/// The findings (the refused workers' too) and totals, read at scrape time.
#[derive(Debug)]
pub(crate) struct CacheHealthMetrics {
    pub(crate) health: Arc<CacheHealth>,
    pub(crate) view: Arc<ClusterView>,
}

impl Collector for CacheHealthMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut metric = encoder.encode_descriptor(
            "tandem_cache_health",
            "1 for each reason a worker's prefix cache may not hit: block_size_mismatch (the \
             worker was refused), no_events (routed \
             approximately), hits_below_prediction (the engine served under half of what the \
             index predicted), unpredicted_hits (it served over twice what the index \
             predicted: its events do not match), prompt_mismatch (the engine counts prompts \
             differently), events_gapped (its KV events keep getting lost or arriving late)",
            None,
            MetricType::Gauge,
        )?;
        let refused = self.view.refused_block_sizes();
        let ours = self.view.block_size().get();
        let findings = block_size_findings(&refused, ours)
            .into_iter()
            .chain(stream_findings(&self.view.troubled_streams()))
            .chain(self.health.findings());
        for f in findings {
            let label = CauseLabel {
                worker: f.worker,
                cause: f.cause.as_str(),
            };
            ConstGauge::new(1i64).encode(metric.encode_family(&label)?)?;
        }
        let totals = self.health.totals();
        for (name, help, pick) in [
            (
                "tandem_cache_predicted_tokens",
                "Prompt tokens the KV index predicted a worker held, over the requests it \
                 finished (routed on their own, prefilled where they decoded)",
                (|t: &(u64, u64, u64)| t.1) as fn(&(u64, u64, u64)) -> u64,
            ),
            (
                "tandem_cache_served_tokens",
                "Prompt tokens a worker's engine said it served from its cache, over the same \
                 requests",
                |t: &(u64, u64, u64)| t.2,
            ),
        ] {
            let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for t in &totals {
                let value = i64::try_from(pick(t)).unwrap_or(i64::MAX);
                ConstGauge::new(value)
                    .encode(metric.encode_family(&WorkerLabel { worker: t.0 })?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(worker: u64, predicted: u32, served: u32) -> Observation {
        Observation {
            worker: WorkerId(worker),
            kv_events: true,
            predicted,
            served,
            prompt: Some((100, 100)),
        }
    }

    fn causes(h: &CacheHealth, worker: u64) -> Vec<Cause> {
        h.findings()
            .into_iter()
            .filter(|f| f.worker == worker)
            .map(|f| f.cause)
            .collect()
    }

    #[test]
    fn hits_below_the_prediction_are_found_and_recover() {
        let h = CacheHealth::default();
        // Served as predicted: nothing.
        for _ in 0..10 {
            h.observe(obs(1, 512, 500));
        }
        assert!(causes(&h, 1).is_empty());
        // Too little predicted, or too few requests, to judge yet on a new worker.
        h.observe(obs(2, 128, 0));
        for _ in 0..MIN_REQUESTS - 2 {
            h.observe(obs(2, 4096, 0));
        }
        assert!(causes(&h, 2).is_empty());
        h.observe(obs(2, 4096, 0));
        assert_eq!(causes(&h, 2), vec![Cause::HitsBelowPrediction]);
        // The engine stops serving what the index says it holds.
        for _ in 0..WINDOW {
            h.observe(obs(1, 512, 16));
        }
        let f: Vec<Finding> = h.findings().into_iter().filter(|f| f.worker == 1).collect();
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].cause, Cause::HitsBelowPrediction);
        assert!(
            f[0].detail.contains("over its last 32 requests"),
            "{}",
            f[0].detail
        );
        // The window moves on: served again, the finding goes.
        for _ in 0..WINDOW {
            h.observe(obs(1, 512, 512));
        }
        assert!(causes(&h, 1).is_empty());
        // Requests that expected no hit do not dilute the window.
        for _ in 0..WINDOW {
            h.observe(obs(1, 512, 0));
            h.observe(obs(1, 0, 0));
        }
        assert_eq!(causes(&h, 1), vec![Cause::HitsBelowPrediction]);
    }

    /// A start-up burst (8 requests routed before the worker's first event, each served from
    /// the cache the first filled) shows while it lasts, and is not logged; a worker whose
    /// events never match is logged once its window is full.
    #[test]
    fn a_burst_that_outruns_its_events_is_shown_but_not_logged() {
        let h = CacheHealth::default();
        for _ in 0..8 {
            h.observe(obs(3, 0, 144));
        }
        assert_eq!(causes(&h, 3), vec![Cause::UnpredictedHits]);
        for _ in 0..WINDOW {
            h.observe(obs(3, 144, 144));
        }
        assert!(causes(&h, 3).is_empty());
        let logged = |w: u64| h.workers.lock()[&WorkerId(w)].logged.clone();
        assert!(logged(3).is_empty());
        for i in 0..WINDOW {
            h.observe(obs(4, 0, 144));
            let expected = if i + 1 < WINDOW {
                vec![]
            } else {
                vec![Cause::UnpredictedHits]
            };
            assert_eq!(logged(4), expected, "request {i}");
        }
    }

    /// An engine that serves what the index never saw: its events do not match. Not said of
    /// a worker without events (the router's memory is expected to miss some).
    #[test]
    fn hits_the_index_did_not_predict_are_found_for_workers_with_events() {
        let h = CacheHealth::default();
        for _ in 0..10 {
            h.observe(obs(6, 0, 480));
        }
        assert_eq!(causes(&h, 6), vec![Cause::UnpredictedHits]);
        let f = &h.findings()[0];
        assert!(
            f.detail.contains("where the index predicted 0"),
            "{}",
            f.detail
        );
        // Predicted again: the window moves on.
        for _ in 0..WINDOW {
            h.observe(obs(6, 480, 480));
        }
        assert!(causes(&h, 6).is_empty());
        for _ in 0..10 {
            h.observe(Observation {
                kv_events: false,
                ..obs(7, 0, 480)
            });
        }
        assert_eq!(causes(&h, 7), vec![Cause::NoEvents]);
    }

    #[test]
    fn no_events_and_prompt_mismatches_are_found() {
        let h = CacheHealth::default();
        h.observe(Observation {
            kv_events: false,
            ..obs(3, 0, 0)
        });
        assert_eq!(causes(&h, 3), vec![Cause::NoEvents]);
        // One mismatch in nineteen is under a tenth; two in twenty is a tenth.
        for i in 0..19 {
            let counted = if i == 0 { 99 } else { 100 };
            h.observe(Observation {
                prompt: Some((100, counted)),
                ..obs(4, 0, 0)
            });
        }
        assert!(causes(&h, 4).is_empty());
        h.observe(Observation {
            prompt: Some((100, 120)),
            ..obs(4, 0, 0)
        });
        assert_eq!(causes(&h, 4), vec![Cause::PromptMismatch]);
        // Not compared (an engine with its own tokenizer): not counted.
        for _ in 0..100 {
            h.observe(Observation {
                prompt: None,
                ..obs(5, 0, 0)
            });
        }
        assert!(causes(&h, 5).is_empty());
    }

    #[test]
    fn workers_kept_are_bounded() {
        let h = CacheHealth::default();
        for w in 0..(MAX_WORKERS as u64 + 10) {
            h.observe(Observation {
                kv_events: false,
                ..obs(w, 0, 0)
            });
        }
        let f = h.findings();
        assert_eq!(f.len(), MAX_WORKERS);
        // The first ones seen went first.
        assert_eq!(f[0].worker, 10);
    }
}
