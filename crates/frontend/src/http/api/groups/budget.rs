//! Budgets at the edge: who a request is charged to (its tenant, its session, its task), whether
//! it may go (the groups file's `[[budget]]` rules, decided by `tandem_router::groups::Budgets`),
//! and what it spent once its answer says so — the pool's own token counts, or an endpoint's
//! `usage` — priced by the group that answered.
//!
//! Over a budget: 429 with code `budget_exceeded` (and `Retry-After` when a window ends), or,
//! where the model has a batch group, the request goes there instead (`x-tandem-budget:
//! demoted`). An endpoint's answer without `usage` (a stream whose client did not ask for
//! it) is charged an estimate: the body's bytes / 4 for the prompt, a token per streamed
//! event (or the answer's bytes / 4) for the completion.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tandem_router::groups::{BudgetConfig, Budgets, Charge, Cost};

use super::now_ms;
use crate::http::auth::{ANONYMOUS, Tenant};
use crate::http::error::ServeError;
use crate::http::hints::BodyHead;
use crate::http::metrics::TenantLabels;

/// Who a request is charged to.
#[derive(Clone, Debug)]
pub(crate) struct Payer {
    tenant: Arc<str>,
    session: Option<Arc<str>>,
    task: Option<Arc<str>>,
}

impl Payer {
    /// The tenant (its key's; [`ANONYMOUS`] without one), the session (`x-session-id`, else
    /// the body's `tandem.session_id`, else its session field, as `head` read them) and the
    /// task (`x-tandem-task`) of a request.
    pub(crate) fn of(tenant: Option<&Tenant>, headers: &HeaderMap, head: &BodyHead) -> Payer {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(Arc::from)
        };
        let body = head
            .own_session
            .as_deref()
            .or(head.field_session.as_deref());
        Payer {
            tenant: tenant.map_or_else(|| Arc::from(ANONYMOUS), |t| t.name.clone()),
            session: header("x-session-id").or_else(|| body.map(Arc::from)),
            task: header("x-tandem-task"),
        }
    }

    fn charge(&self) -> Charge<'_> {
        Charge {
            tenant: &self.tenant,
            session: self.session.as_deref(),
            task: self.task.as_deref(),
        }
    }
}

/// What the edge knows of a request before the groups route it.
#[derive(Clone, Debug)]
pub(crate) struct Caller {
    pub(crate) payer: Payer,
    /// Over its budget, sent to the model's batch group.
    pub(crate) demoted: bool,
    /// `x-tandem-escalate`: a cascade's large model at once.
    pub(crate) escalate: bool,
    /// The body's `model` and `max_tokens` (read once, with the session, at the edge).
    pub(crate) model: Option<String>,
    pub(crate) max_tokens: Option<u32>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokensLabel {
    tenant: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabel {
    per: &'static str,
    outcome: &'static str,
}

/// The budgets' counts and series.
#[derive(Debug)]
pub(super) struct BudgetBook {
    budgets: parking_lot::Mutex<Budgets>,
    spend: Family<TenantLabel, Counter<f64, std::sync::atomic::AtomicU64>>,
    tokens: Family<TokensLabel, Counter>,
    refusals: Family<RefusalLabel, Counter>,
    labels: TenantLabels,
}

impl BudgetBook {
    pub(super) fn register(rules: &[BudgetConfig], registry: &mut Registry) -> BudgetBook {
        let book = BudgetBook {
            budgets: parking_lot::Mutex::new(Budgets::new(rules)),
            spend: Family::default(),
            tokens: Family::default(),
            refusals: Family::default(),
            labels: TenantLabels::default(),
        };
        registry.register(
            "tandem_tenant_spend",
            "What each tenant's tokens cost, at the prices of the backend group that answered (its `cost` in the groups file)",
            book.spend.clone(),
        );
        registry.register(
            "tandem_tenant_budget_tokens",
            "Tokens charged to each tenant's budgets, by kind (prompt, completion)",
            book.tokens.clone(),
        );
        registry.register(
            "tandem_budget_refusals",
            "Requests over a budget, by the rule's scope (tenant, session, task) and what became of them (refused: 429 budget_exceeded; demoted: sent to the model's batch group)",
            book.refusals.clone(),
        );
        book
    }

    /// The file was reloaded: its rules replace the old ones, each unchanged rule keeping
    /// its counts.
    pub(super) fn reconfigure(&self, rules: &[BudgetConfig]) {
        self.budgets.lock().reconfigure(rules);
    }
}

impl BudgetBook {
    /// Whether a request charged to `payer` may go: `Ok(false)` as it is, `Ok(true)`
    /// demoted (over a budget, and `can_demote`: its model has a batch group), `Err` refused.
    pub(super) fn check(&self, payer: &Payer, can_demote: bool) -> Result<bool, ServeError> {
        let Err(over) = self.budgets.lock().check(&payer.charge(), now_ms()) else {
            return Ok(false);
        };
        self.refusals
            .get_or_create(&RefusalLabel {
                per: over.per.as_str(),
                outcome: if can_demote { "demoted" } else { "refused" },
            })
            .inc();
        if can_demote {
            return Ok(true);
        }
        let message = format!(
            "the {} budget of {} tokens is spent ({} used){}",
            over.per.as_str(),
            over.tokens,
            over.spent,
            if over.retry_after_ms.is_some() {
                "; it starts again when its window ends"
            } else {
                ""
            }
        );
        Err(ServeError::over_budget(
            message,
            over.retry_after_ms.map(Duration::from_millis),
        ))
    }

    /// A bill for a request charged to `payer`, answered at `cost`.
    pub(super) fn bill(self: &Arc<Self>, payer: Payer, cost: Option<Cost>) -> Bill {
        Bill {
            book: self.clone(),
            payer,
            cost,
        }
    }
}

/// What a request owes once its tokens are known.
#[derive(Debug)]
pub(crate) struct Bill {
    book: Arc<BudgetBook>,
    payer: Payer,
    cost: Option<Cost>,
}

impl Bill {
    /// The request used `prompt` and `completion` tokens.
    pub(crate) fn settle(self, prompt: u64, completion: u64) {
        let book = &self.book;
        book.budgets
            .lock()
            .spend(&self.payer.charge(), prompt + completion, now_ms());
        let tenant = book.labels.label(&self.payer.tenant);
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            book.tokens
                .get_or_create(&TokensLabel {
                    tenant: tenant.clone(),
                    kind,
                })
                .inc_by(n);
        }
        if let Some(c) = self.cost {
            book.spend
                .get_or_create(&TenantLabel { tenant })
                .inc_by(c.of(prompt, completion));
        }
    }
}

/// The tokens an endpoint's answer used, read as it passes: its last bytes (where `usage`
/// is, in a whole answer and in a stream's last event) and its count of events.
#[derive(Debug, Default)]
pub(super) struct Usage {
    tail: Vec<u8>,
    bytes: u64,
    events: u64,
    /// The last bytes of the previous piece, so an event split across pieces is counted.
    carry: Vec<u8>,
}

/// The most of an answer's end kept to find its `usage`.
const TAIL: usize = 16 << 10;

#[derive(serde::Deserialize)]
struct Reported {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

impl Usage {
    pub(super) fn saw(&mut self, piece: &[u8]) {
        self.bytes += piece.len() as u64;
        let mut joined = std::mem::take(&mut self.carry);
        joined.extend_from_slice(piece);
        self.events += memchr::memmem::find_iter(&joined, b"data:").count() as u64;
        let keep = joined.len().min(4);
        self.carry = joined[joined.len() - keep..].to_vec();
        self.tail.extend_from_slice(piece);
        if self.tail.len() > 2 * TAIL {
            self.tail.drain(..self.tail.len() - TAIL);
        }
    }

    /// `(prompt, completion)`: the answer's own `usage` (the last one that is an object),
    /// else the estimate of the module docs from `prompt_estimate`.
    pub(super) fn tokens(&self, prompt_estimate: u64) -> (u64, u64) {
        let at = memchr::memmem::rfind_iter(&self.tail, b"\"usage\"");
        for i in at {
            let rest = &self.tail[i + b"\"usage\"".len()..];
            let Some(colon) = rest.iter().position(|&b| b == b':') else {
                continue;
            };
            let mut values =
                serde_json::Deserializer::from_slice(&rest[colon + 1..]).into_iter::<Reported>();
            if let Some(Ok(u)) = values.next() {
                return (u.prompt_tokens, u.completion_tokens);
            }
        }
        let completion = if self.events > 0 {
            // The last event of an OpenAI stream is `[DONE]`.
            self.events.saturating_sub(1).max(1)
        } else {
            self.bytes / 4
        };
        (prompt_estimate, completion)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(pieces: &[&[u8]]) -> Usage {
        let mut u = Usage::default();
        for p in pieces {
            u.saw(p);
        }
        u
    }

    #[test]
    fn a_whole_answers_usage_is_read_from_its_end() {
        let body = br#"{"id":"x","choices":[{"text":"usage: none here"}],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}"#;
        let (a, b) = body.split_at(70);
        assert_eq!(read(&[a, b]).tokens(99), (12, 5));
    }

    #[test]
    fn a_streams_last_usage_object_counts_and_null_ones_do_not() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        let u = read(&stream.chunks(9).collect::<Vec<_>>());
        assert_eq!(u.tokens(99), (7, 2));
    }

    #[test]
    fn without_usage_a_stream_is_charged_a_token_an_event() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"c\"}}]}\n\ndata: [DONE]\n\n";
        // Split inside "data:" too: each event is counted once.
        let u = read(&stream.chunks(3).collect::<Vec<_>>());
        assert_eq!(u.tokens(40), (40, 3));
        assert_eq!(read(&[b"{\"choices\":[]}"]).tokens(8), (8, 3));
    }
}
