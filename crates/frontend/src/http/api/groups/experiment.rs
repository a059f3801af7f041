//! A/B routing at the edge: a request the pool serves is placed in an arm of the groups
//! file's `[experiment]` (`tandem_router::groups::ExperimentConfig`: by session, else by the
//! prompt's start), routed with that arm's `kv` knobs (a knob the request sets itself wins),
//! and counted under its arm when it ends — requests, time to first token, prompt tokens
//! and those served from cache (the hit rate), completion tokens, and goodput (requests
//! within the experiment's TTFT objective) — on `/metrics` and side by side on the status
//! page. The response says its arm: `x-tandem-experiment: NAME/ARM`.

use std::sync::Arc;

use axum::http::HeaderValue;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tandem_router::groups::Arm;

use tandem_router::groups::ExperimentConfig;

use crate::http::ValidRequest;
use crate::http::metrics::{EndHook, Ended};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ArmLabels {
    experiment: String,
    arm: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ArmOutcome {
    experiment: String,
    arm: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ArmTokens {
    experiment: String,
    arm: &'static str,
    kind: &'static str,
}

/// One arm's totals, for the status page.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    requests: u64,
    errors: u64,
    ttft_sum_s: f64,
    ttft_count: u64,
    prompt: u64,
    cached: u64,
    completion: u64,
    good: u64,
}

/// The experiments' series and totals.
#[derive(Debug)]
pub(super) struct ExperimentBook {
    requests: Family<ArmOutcome, Counter>,
    ttft: Family<ArmLabels, Histogram>,
    tokens: Family<ArmTokens, Counter>,
    goodput: Family<ArmLabels, Counter>,
    /// `(experiment, arm)` → totals; an experiment renamed by a reload keeps its old rows
    /// (a handful: one per name the file has had).
    totals: Mutex<Vec<((String, Arm), Totals)>>,
}

impl ExperimentBook {
    pub(super) fn register(registry: &mut Registry) -> ExperimentBook {
        let book = ExperimentBook {
            requests: Family::default(),
            ttft: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.005, 2.0, 14))
            }),
            tokens: Family::default(),
            goodput: Family::default(),
            totals: Mutex::default(),
        };
        registry.register(
            "tandem_experiment_requests",
            "Requests of each arm of an A/B routing experiment, by outcome (ok, error)",
            book.requests.clone(),
        );
        registry.register(
            "tandem_experiment_ttft_seconds",
            "Time to first token of each arm of an A/B routing experiment",
            book.ttft.clone(),
        );
        registry.register(
            "tandem_experiment_tokens",
            "Tokens of each arm of an A/B routing experiment, by kind (prompt; cached: of the prompt, served from cache; completion)",
            book.tokens.clone(),
        );
        registry.register(
            "tandem_experiment_goodput",
            "Requests of each arm of an A/B routing experiment answered within its TTFT objective (ttft_slo_ms)",
            book.goodput.clone(),
        );
        book
    }

    fn ended(&self, experiment: &str, arm: Arm, slo_ms: Option<f64>, end: &Ended) {
        let ok = end.status == 200;
        let labels = ArmLabels {
            experiment: experiment.to_string(),
            arm: arm.as_str(),
        };
        self.requests
            .get_or_create(&ArmOutcome {
                experiment: experiment.to_string(),
                arm: arm.as_str(),
                outcome: if ok { "ok" } else { "error" },
            })
            .inc();
        for (kind, n) in [
            ("prompt", end.prompt_tokens),
            ("cached", end.cached_tokens),
            ("completion", end.completion_tokens),
        ] {
            self.tokens
                .get_or_create(&ArmTokens {
                    experiment: experiment.to_string(),
                    arm: arm.as_str(),
                    kind,
                })
                .inc_by(n);
        }
        let ttft = end.ttft.filter(|_| ok).map(|d| d.as_secs_f64());
        if let Some(t) = ttft {
            self.ttft.get_or_create(&labels).observe(t);
        }
        let good = ok && slo_ms.is_some_and(|slo| ttft.is_some_and(|t| t * 1000.0 <= slo));
        if good {
            self.goodput.get_or_create(&labels).inc();
        }
        let mut totals = self.totals.lock();
        let key = (experiment.to_string(), arm);
        let at = match totals.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                totals.push((key, Totals::default()));
                totals.len() - 1
            }
        };
        let t = &mut totals[at].1;
        t.requests += 1;
        t.errors += u64::from(!ok);
        if let Some(s) = ttft {
            t.ttft_sum_s += s;
            t.ttft_count += 1;
        }
        t.prompt += end.prompt_tokens;
        t.cached += end.cached_tokens;
        t.completion += end.completion_tokens;
        t.good += u64::from(good);
    }

    /// The arms side by side, for the status page.
    pub(super) fn status(&self) -> serde_json::Value {
        let totals = self.totals.lock();
        let rows: Vec<serde_json::Value> = totals
            .iter()
            .map(|((name, arm), t)| {
                serde_json::json!({
                    "experiment": name,
                    "arm": arm.as_str(),
                    "requests": t.requests,
                    "errors": t.errors,
                    "mean_ttft_ms": (t.ttft_count > 0)
                        .then(|| t.ttft_sum_s * 1000.0 / t.ttft_count as f64),
                    "hit_rate": (t.prompt > 0).then(|| t.cached as f64 / t.prompt as f64),
                    "completion_tokens": t.completion,
                    "goodput": t.good,
                })
            })
            .collect();
        serde_json::Value::Array(rows)
    }
}

impl ExperimentBook {
    /// Places a request the pool serves in an arm of `experiment`: its routing takes the
    /// arm's knobs where it sets none of its own. Returns the response's
    /// `x-tandem-experiment` and the hook that counts the request under its arm.
    pub(super) fn assign(
        self: &Arc<Self>,
        experiment: ExperimentConfig,
        req: &mut ValidRequest,
    ) -> Option<(HeaderValue, EndHook)> {
        let arm = experiment.arm_of(req.routing.session.as_deref(), &req.prompt_tokens);
        let knobs = experiment.arm(arm).overrides();
        let own = &mut req.routing.overrides;
        own.overlap_credit = own.overlap_credit.or(knobs.overlap_credit);
        own.prefill_load_scale = own.prefill_load_scale.or(knobs.prefill_load_scale);
        own.temperature = own.temperature.or(knobs.temperature);
        let header =
            HeaderValue::from_str(&format!("{}/{}", experiment.name, arm.as_str())).ok()?;
        let book = self.clone();
        let hook = EndHook(Box::new(move |end: &Ended| {
            book.ended(&experiment.name, arm, experiment.ttft_slo_ms, end);
        }));
        Some((header, hook))
    }
}
