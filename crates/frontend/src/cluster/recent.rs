//! What the router did lately, for the status page ([`RecentActivity`]): bounded rings of the
//! last routing decisions (each candidate's cost terms, as the policy computed them), of
//! migrations and of flow-control rejections, plus running totals. Memory is fixed: at most
//! [`DECISIONS`] decisions of at most [`CANDIDATES`] candidates per pool, [`EVENTS`]
//! migrations and [`EVENTS`] rejections; a failure message is cut to [`MAX_TEXT`] bytes.
//!
//! Recording takes one short lock and copies the decision's terms; nothing here decides
//! anything. The clock is injectable (`*_at` variants) so tests are deterministic.

use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::Serialize;
use tandem_protocol::{RequestId, WorkerId};
use tandem_router::{Decision, DisaggDecision, DisaggReason, RejectReason, RouteRequest, Rule};

/// Routing decisions kept.
pub const DECISIONS: usize = 50;
/// Candidates kept per pool of a decision: the chosen one and the cheapest others.
pub const CANDIDATES: usize = 16;
/// Migrations kept, and rejections kept.
pub const EVENTS: usize = 50;
/// Longest failure message kept, in bytes.
pub const MAX_TEXT: usize = 240;

/// One candidate's terms (`tandem_router::ScoreTerms`), as shown.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    pub worker: u64,
    pub chosen: bool,
    /// Leading prompt blocks cached on it, by tier.
    pub overlap_device: u32,
    pub overlap_host: u32,
    pub overlap_disk: u32,
    pub decay: f64,
    pub credit: f64,
    pub raw_prefill_blocks: f64,
    pub prefill_blocks: f64,
    pub decode_blocks: u64,
    pub active_requests: u64,
    pub speed: f64,
    pub transfer: f64,
    pub adapter: f64,
    pub cost: f64,
    pub probability: Option<f64>,
}

/// One pool's decision: its rule and candidates.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolDecision {
    pub worker: u64,
    /// The policy's rule that chose (`MinCost`, `Sampled`, `LeastLoaded`, …), written as
    /// its name when the record is read.
    #[serde(serialize_with = "rule_name")]
    pub rule: Rule,
    /// Candidates scored, before the cut to [`CANDIDATES`].
    pub candidates_total: usize,
    /// The chosen one first, then by cost.
    pub candidates: Vec<Candidate>,
    /// Workers left out as busy before the policy ran.
    pub excluded_busy: usize,
}

/// One routing decision.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecisionRecord {
    /// Milliseconds since the Unix epoch, when it was recorded.
    pub unix_ms: u64,
    /// The router's request id (of this attempt).
    pub request: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens the chosen worker (the prefill worker when remote) holds, by the
    /// router's index.
    pub cached_tokens: u64,
    /// Workers left out because they already failed this request (retries).
    pub excluded: usize,
    /// Where the prompt is prefilled and why (the disaggregation rule), written as a
    /// sentence when the record is read.
    #[serde(serialize_with = "disagg_sentence")]
    pub disagg: DisaggReason,
    pub decode: PoolDecision,
    pub prefill: Option<PoolDecision>,
    #[serde(skip)]
    at: Instant,
}

/// A request moved to another decode worker after its first token.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MigrationRecord {
    pub unix_ms: u64,
    pub request: u64,
    /// The decode worker that failed it.
    pub from_worker: u64,
    /// Tokens it had generated there.
    pub generated_tokens: u32,
    pub failure: String,
    #[serde(skip)]
    at: Instant,
}

/// A request refused by flow control.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RejectionRecord {
    pub unix_ms: u64,
    /// `queue_full`, `queue_timeout`, `displaced`, `rate_limit_requests`, …
    pub reason: &'static str,
    #[serde(skip)]
    at: Instant,
}

/// Counts since start.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Totals {
    pub decisions: u64,
    pub remote_prefills: u64,
    pub migrations: u64,
    pub rejections: u64,
    /// Over every decision: prompt tokens, and those the router's index said were cached on
    /// the worker chosen to prefill.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Over the remote prefills that completed: prompt tokens whose KV the prefill worker
    /// sent, and those the decode worker already held (its cached prefix, not sent).
    pub remote_tokens_moved: u64,
    pub remote_tokens_held: u64,
}

/// [`RecentActivity`] as the status page reads it; lists newest first, each entry with its
/// age in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActivitySnapshot {
    pub totals: Totals,
    /// Cached / prompt tokens over the decisions listed (`None` without prompt tokens).
    pub hit_rate_recent: Option<f64>,
    /// The same over every decision since start.
    pub hit_rate_total: Option<f64>,
    pub decisions: Vec<Aged<DecisionRecord>>,
    pub migrations: Vec<Aged<MigrationRecord>>,
    pub rejections: Vec<Aged<RejectionRecord>>,
    /// Rejections since start, by reason (every reason, zeros included).
    pub rejections_by_reason: Vec<(&'static str, u64)>,
}

/// An entry with how long ago it happened.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Aged<T> {
    pub age_ms: u64,
    #[serde(flatten)]
    pub entry: T,
}

#[derive(Debug, Default)]
struct Inner {
    decisions: VecDeque<DecisionRecord>,
    migrations: VecDeque<MigrationRecord>,
    rejections: VecDeque<RejectionRecord>,
    totals: Totals,
    by_reason: [u64; RejectReason::ALL.len()],
}

/// The router's recent decisions, migrations and rejections. Shared by `Arc`.
#[derive(Debug, Default)]
pub struct RecentActivity {
    inner: Mutex<Inner>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn push<T>(ring: &mut VecDeque<T>, cap: usize, item: T) {
    if ring.len() == cap {
        ring.pop_front();
    }
    ring.push_back(item);
}

/// `s` cut to at most `max` bytes on a character boundary.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The disaggregation rule's answer in words.
/// A rule as its name (the record keeps the rule: nothing is formatted per decision).
fn rule_name<S: serde::Serializer>(rule: &Rule, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{rule:?}"))
}

/// A disaggregation reason as its sentence.
fn disagg_sentence<S: serde::Serializer>(why: &DisaggReason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&disagg_reason(why))
}

fn disagg_reason(why: &DisaggReason) -> String {
    match *why {
        DisaggReason::NoPrefillPool => "local: no prefill pool".into(),
        DisaggReason::Never => "local: disaggregation off".into(),
        DisaggReason::Always => "remote: always".into(),
        DisaggReason::ShortEffectivePrompt { effective_tokens } => {
            format!("local: short effective prompt ({effective_tokens} tokens)")
        }
        DisaggReason::LongEffectivePrompt { effective_tokens } => {
            format!("remote: long effective prompt ({effective_tokens} tokens)")
        }
        DisaggReason::PrefillBusy { backlog_tokens } => {
            format!("local: prefill pool busy ({backlog_tokens} backlog tokens)")
        }
        DisaggReason::PrefillAvailable { backlog_tokens } => {
            format!("remote: prefill pool available ({backlog_tokens} backlog tokens)")
        }
        DisaggReason::LongPromptPrefillAvailable {
            effective_tokens,
            backlog_tokens,
        } => format!(
            "remote: long prompt ({effective_tokens} tokens), prefill available \
             ({backlog_tokens} backlog tokens)"
        ),
        DisaggReason::LocalSooner {
            remote_cost,
            local_cost,
        } => format!("local: sooner here (remote {remote_cost:.1} > local {local_cost:.1})"),
        DisaggReason::Fallback => "local: fallback".into(),
        DisaggReason::LocalOnly => "local: asked (an embedding)".into(),
    }
}

fn pool_decision(d: &Decision) -> PoolDecision {
    let mut candidates: Vec<Candidate> = d
        .explain
        .iter()
        .map(|t| Candidate {
            worker: t.worker.0,
            chosen: t.worker == d.worker,
            overlap_device: t.overlap.device,
            overlap_host: t.overlap.host,
            overlap_disk: t.overlap.disk,
            decay: t.decay,
            credit: t.credit,
            raw_prefill_blocks: t.raw_prefill_blocks,
            prefill_blocks: t.prefill_blocks,
            decode_blocks: t.decode_blocks,
            active_requests: t.active_requests,
            speed: t.speed,
            transfer: t.transfer,
            adapter: t.adapter,
            cost: t.cost,
            probability: t.probability,
        })
        .collect();
    let candidates_total = candidates.len();
    // The chosen first, then the cheapest (NaN last); ties by worker id.
    candidates.sort_by(|a, b| {
        b.chosen
            .cmp(&a.chosen)
            .then(a.cost.total_cmp(&b.cost))
            .then(a.worker.cmp(&b.worker))
    });
    candidates.truncate(CANDIDATES);
    PoolDecision {
        worker: d.worker.0,
        rule: d.rule,
        candidates_total,
        candidates,
        excluded_busy: d.excluded_busy.len(),
    }
}

fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

fn aged<T: Clone>(ring: &VecDeque<T>, now: Instant, at: impl Fn(&T) -> Instant) -> Vec<Aged<T>> {
    ring.iter()
        .rev()
        .map(|e| Aged {
            age_ms: u64::try_from(now.saturating_duration_since(at(e)).as_millis())
                .unwrap_or(u64::MAX),
            entry: e.clone(),
        })
        .collect()
}

impl RecentActivity {
    /// A decision the replica made for request `request` (of `route`), with `excluded`
    /// workers left out as having failed it.
    pub fn decision(
        &self,
        request: RequestId,
        route: &RouteRequest,
        excluded: usize,
        d: &DisaggDecision,
    ) {
        self.decision_at(Instant::now(), request, route, excluded, d);
    }

    pub fn decision_at(
        &self,
        now: Instant,
        request: RequestId,
        route: &RouteRequest,
        excluded: usize,
        d: &DisaggDecision,
    ) {
        // Where the prompt is computed decides what its cache saves.
        let prefiller = d.prefill.as_ref().unwrap_or(&d.decode);
        let blocks = prefiller
            .chosen_terms()
            .map_or(0, |t| u64::from(t.overlap.total()));
        let cached = blocks
            .saturating_mul(u64::from(route.block_size.get()))
            .min(route.prompt_tokens);
        let record = DecisionRecord {
            unix_ms: unix_ms(),
            request: request.0,
            prompt_tokens: route.prompt_tokens,
            cached_tokens: cached,
            excluded,
            disagg: d.why,
            decode: pool_decision(&d.decode),
            prefill: d.prefill.as_ref().map(pool_decision),
            at: now,
        };
        let mut inner = self.inner.lock();
        let t = &mut inner.totals;
        t.decisions += 1;
        t.remote_prefills += u64::from(d.prefill.is_some());
        t.prompt_tokens = t.prompt_tokens.saturating_add(route.prompt_tokens);
        t.cached_tokens = t.cached_tokens.saturating_add(cached);
        push(&mut inner.decisions, DECISIONS, record);
    }

    /// A remote prefill completed: `moved` prompt tokens came over, `held` were cached on the
    /// decode worker.
    pub fn remote_prefill(&self, moved: u64, held: u64) {
        let mut inner = self.inner.lock();
        let t = &mut inner.totals;
        t.remote_tokens_moved = t.remote_tokens_moved.saturating_add(moved);
        t.remote_tokens_held = t.remote_tokens_held.saturating_add(held);
    }

    /// A request leaving decode worker `from` after `generated` tokens, because of
    /// `failure`.
    pub fn migration(&self, request: RequestId, from: WorkerId, generated: u32, failure: &str) {
        self.migration_at(Instant::now(), request, from, generated, failure);
    }

    pub fn migration_at(
        &self,
        now: Instant,
        request: RequestId,
        from: WorkerId,
        generated: u32,
        failure: &str,
    ) {
        let record = MigrationRecord {
            unix_ms: unix_ms(),
            request: request.0,
            from_worker: from.0,
            generated_tokens: generated,
            failure: cut(failure, MAX_TEXT),
            at: now,
        };
        let mut inner = self.inner.lock();
        inner.totals.migrations += 1;
        push(&mut inner.migrations, EVENTS, record);
    }

    /// A request refused by flow control.
    pub fn rejection(&self, reason: RejectReason) {
        self.rejection_at(Instant::now(), reason);
    }

    pub fn rejection_at(&self, now: Instant, reason: RejectReason) {
        let record = RejectionRecord {
            unix_ms: unix_ms(),
            reason: reason.as_str(),
            at: now,
        };
        let mut inner = self.inner.lock();
        inner.totals.rejections += 1;
        if let Some(i) = RejectReason::ALL.iter().position(|r| *r == reason) {
            inner.by_reason[i] += 1;
        }
        push(&mut inner.rejections, EVENTS, record);
    }

    pub fn snapshot(&self) -> ActivitySnapshot {
        self.snapshot_at(Instant::now())
    }

    pub fn snapshot_at(&self, now: Instant) -> ActivitySnapshot {
        let inner = self.inner.lock();
        let (prompt, cached) = inner.decisions.iter().fold((0u64, 0u64), |(p, c), d| {
            (
                p.saturating_add(d.prompt_tokens),
                c.saturating_add(d.cached_tokens),
            )
        });
        ActivitySnapshot {
            totals: inner.totals.clone(),
            hit_rate_recent: ratio(cached, prompt),
            hit_rate_total: ratio(inner.totals.cached_tokens, inner.totals.prompt_tokens),
            decisions: aged(&inner.decisions, now, |d| d.at),
            migrations: aged(&inner.migrations, now, |m| m.at),
            rejections: aged(&inner.rejections, now, |r| r.at),
            rejections_by_reason: RejectReason::ALL
                .iter()
                .zip(inner.by_reason)
                .map(|(r, n)| (r.as_str(), n))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use tandem_indexer::TierCounts;
    use tandem_protocol::{BlockSize, HashSeed};
    use tandem_router::{Rule, ScoreTerms};

    fn terms(worker: u64, device: u32, cost: f64) -> ScoreTerms {
        ScoreTerms {
            worker: WorkerId(worker),
            overlap: TierCounts {
                device,
                host: 1,
                disk: 0,
            },
            decay: 1.0,
            credit: f64::from(device),
            raw_prefill_blocks: 10.0,
            prefill_blocks: 10.0 - f64::from(device),
            decode_blocks: 3,
            active_requests: worker,
            speed: 1.0,
            transfer: 0.0,
            adapter: 0.0,
            cost,
            probability: Some(0.5),
        }
    }

    fn decision(worker: u64, explain: Vec<ScoreTerms>) -> Decision {
        Decision {
            worker: WorkerId(worker),
            rule: Rule::MinCost,
            explain,
            excluded_busy: vec![WorkerId(99)],
        }
    }

    fn route(prompt_tokens: u64) -> RouteRequest {
        let tokens: Vec<u32> = (0..prompt_tokens as u32).collect();
        RouteRequest::from_tokens(&tokens, BlockSize::DEFAULT, HashSeed::UNSALTED)
    }

    #[test]
    fn a_decision_keeps_every_candidates_terms_chosen_first() {
        let a = RecentActivity::default();
        let t0 = Instant::now();
        let bs = u64::from(BlockSize::DEFAULT.get());
        let d = DisaggDecision {
            decode: decision(
                2,
                vec![terms(1, 0, 5.0), terms(2, 3, 7.0), terms(3, 1, 1.0)],
            ),
            prefill: None,
            why: DisaggReason::ShortEffectivePrompt {
                effective_tokens: 40,
            },
        };
        a.decision_at(t0, RequestId(7), &route(10 * bs), 1, &d);
        let s = a.snapshot_at(t0 + Duration::from_millis(1500));
        assert_eq!(s.decisions.len(), 1);
        let r = &s.decisions[0];
        assert_eq!(r.age_ms, 1500);
        assert_eq!(r.entry.request, 7);
        assert_eq!(r.entry.excluded, 1);
        let json = serde_json::to_value(&r.entry).unwrap();
        let disagg = json["disagg"].as_str().unwrap();
        assert!(disagg.contains("40 tokens"), "{disagg}");
        assert_eq!(json["decode"]["rule"], "MinCost");
        assert_eq!(r.entry.decode.rule, Rule::MinCost);
        assert_eq!(r.entry.decode.excluded_busy, 1);
        let order: Vec<(u64, bool)> = r
            .entry
            .decode
            .candidates
            .iter()
            .map(|c| (c.worker, c.chosen))
            .collect();
        assert_eq!(order, vec![(2, true), (3, false), (1, false)]);
        // Worker 2 holds 3 device + 1 host blocks of the 10-block prompt.
        let chosen = &r.entry.decode.candidates[0];
        assert_eq!((chosen.overlap_device, chosen.overlap_host), (3, 1));
        assert_eq!(chosen.cost, 7.0);
        assert_eq!(r.entry.cached_tokens, 4 * bs);
        assert_eq!(s.hit_rate_recent, Some(0.4));
        assert_eq!(s.totals.decisions, 1);
        assert_eq!(s.totals.remote_prefills, 0);
    }

    #[test]
    fn completed_remote_prefills_sum_what_moved_and_what_was_held() {
        let a = RecentActivity::default();
        a.remote_prefill(900, 0);
        a.remote_prefill(404, 896);
        let t = a.snapshot().totals;
        assert_eq!((t.remote_tokens_moved, t.remote_tokens_held), (1304, 896));
    }

    #[test]
    fn a_remote_prefill_counts_the_prefill_workers_cache() {
        let a = RecentActivity::default();
        let bs = u64::from(BlockSize::DEFAULT.get());
        let d = DisaggDecision {
            decode: decision(1, vec![terms(1, 0, 1.0)]),
            prefill: Some(decision(21, vec![terms(21, 5, 2.0), terms(22, 0, 3.0)])),
            why: DisaggReason::LongEffectivePrompt {
                effective_tokens: 900,
            },
        };
        a.decision(RequestId(1), &route(20 * bs), 0, &d);
        let s = a.snapshot();
        let r = &s.decisions[0].entry;
        assert_eq!(r.prefill.as_ref().map(|p| p.worker), Some(21));
        assert_eq!(r.cached_tokens, 6 * bs);
        assert_eq!(s.totals.remote_prefills, 1);
        assert_eq!(s.hit_rate_total, Some(0.3));
    }

    #[test]
    fn rings_are_bounded_and_newest_first() {
        let a = RecentActivity::default();
        let t0 = Instant::now();
        let many: Vec<ScoreTerms> = (0..100).map(|w| terms(w, 0, w as f64)).collect();
        for i in 0..(DECISIONS as u64 + 10) {
            let d = DisaggDecision {
                decode: decision(50, many.clone()),
                prefill: None,
                why: DisaggReason::NoPrefillPool,
            };
            a.decision_at(
                t0 + Duration::from_millis(i),
                RequestId(i),
                &route(16),
                0,
                &d,
            );
            a.migration_at(t0, RequestId(i), WorkerId(3), 5, &"x".repeat(10_000));
            a.rejection_at(t0, RejectReason::QueueFull);
        }
        let s = a.snapshot_at(t0 + Duration::from_secs(1));
        assert_eq!(s.decisions.len(), DECISIONS);
        assert_eq!(s.decisions[0].entry.request, DECISIONS as u64 + 9);
        assert_eq!(s.decisions.last().map(|d| d.entry.request), Some(10));
        let c = &s.decisions[0].entry.decode;
        assert_eq!(c.candidates_total, 100);
        assert_eq!(c.candidates.len(), CANDIDATES);
        assert_eq!(c.candidates[0].worker, 50);
        assert_eq!(c.candidates[1].worker, 0);
        assert_eq!(s.migrations.len(), EVENTS);
        assert!(s.migrations[0].entry.failure.len() <= MAX_TEXT + '…'.len_utf8());
        assert_eq!(s.rejections.len(), EVENTS);
        assert_eq!(s.totals.rejections, DECISIONS as u64 + 10);
        assert_eq!(s.totals.migrations, DECISIONS as u64 + 10);
        assert!(
            s.rejections_by_reason
                .contains(&("queue_full", DECISIONS as u64 + 10))
        );
        assert!(s.rejections_by_reason.contains(&("displaced", 0)));
    }

    #[test]
    fn text_is_cut_on_a_character_boundary() {
        let s = "é".repeat(200);
        let c = cut(&s, 7);
        assert_eq!(c, "ééé…");
        assert_eq!(cut("short", 7), "short");
    }

    #[test]
    fn non_finite_costs_serialize() {
        let a = RecentActivity::default();
        let d = DisaggDecision {
            decode: decision(1, vec![terms(1, 0, f64::INFINITY), terms(2, 0, f64::NAN)]),
            prefill: None,
            why: DisaggReason::Never,
        };
        a.decision(RequestId(1), &route(0), 0, &d);
        let s = a.snapshot();
        assert_eq!(s.hit_rate_recent, None);
        let json = serde_json::to_value(&s).expect("serializes");
        assert_eq!(
            json["decisions"][0]["decode"]["candidates"][0]["cost"],
            serde_json::Value::Null
        );
        assert_eq!(
            json["decisions"][0]["age_ms"].as_u64().map(|_| ()),
            Some(())
        );
    }
}
