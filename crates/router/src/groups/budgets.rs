//! Token budgets, sans-IO: how many tokens (prompt and completion) a tenant, a session or a
//! task may spend, over a window or in total, and whether a request may go now.
//!
//! - A rule ([`BudgetConfig`]) counts per tenant, per session of a tenant or per task of a
//!   tenant (the `x-tandem-task` header): two tenants never share a count, even with the
//!   same session or task id. A rule may name one tenant; otherwise each tenant has its own
//!   count under it. A request with no session (or no task) is not counted by a session (or
//!   task) rule.
//! - A windowed count starts at its first spend and starts again once the window has passed
//!   (the budget resets; LiteLLM's `budget_duration`); without a window the count is a total
//!   since the process started (or the file was reloaded).
//! - A request is checked against what was spent before it ([`Budgets::check`]) and its
//!   tokens are counted once its answer says them ([`Budgets::spend`]): requests in flight
//!   when a count reaches its limit still finish, so a count may end above its limit by
//!   what they used, as LiteLLM's and the hosted APIs' spend limits do.
//! - Memory is bounded: each rule keeps at most [`BudgetConfig::max_keys`] counts and, full,
//!   forgets the least recently used one (whose next request starts a fresh count).
//!
//! Time is milliseconds passed in.

use std::collections::BTreeSet;

use hashbrown::HashMap;
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

/// What one budget rule counts per.
#[derive(Clone, Copy, Debug, Deserialize, serde::Serialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum BudgetScope {
    Tenant,
    Session,
    Task,
}

impl BudgetScope {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetScope::Tenant => "tenant",
            BudgetScope::Session => "session",
            BudgetScope::Task => "task",
        }
    }
}

/// One budget rule (`[[budget]]` in the groups file).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    /// What is counted: each tenant, each session of a tenant, or each task of a tenant.
    pub per: BudgetScope,
    /// Tokens (prompt and completion) each count may reach.
    pub tokens: u64,
    /// Seconds after a count's first spend at which it starts again; none: a total.
    #[serde(default)]
    pub window_seconds: Option<f64>,
    /// Only this tenant's requests (default: every tenant's, each its own count).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Counts kept at most (least recently used forgotten first).
    #[serde(default = "default_max_keys")]
    pub max_keys: usize,
}

fn default_max_keys() -> usize {
    100_000
}

impl BudgetConfig {
    /// Why the rule cannot be used, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.tokens == 0 {
            return Err("tokens must be > 0".into());
        }
        if let Some(w) = self.window_seconds
            && !(w.is_finite() && w > 0.0)
        {
            return Err(format!("window_seconds must be a number > 0, got {w}"));
        }
        if self.max_keys == 0 {
            return Err("max_keys must be > 0".into());
        }
        if self.tenant.as_deref() == Some("") {
            return Err("tenant, where given, is a tenant's name".into());
        }
        Ok(())
    }

    fn window_ms(&self) -> Option<u64> {
        self.window_seconds.map(|s| (s * 1000.0).max(1.0) as u64)
    }
}

/// Who a request is charged to.
#[derive(Clone, Copy, Debug)]
pub struct Charge<'a> {
    /// The tenant's name (the API keys file's; one name for every request without a key).
    pub tenant: &'a str,
    pub session: Option<&'a str>,
    /// The `x-tandem-task` header.
    pub task: Option<&'a str>,
}

/// A request's budget is spent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exceeded {
    /// The rule's index in the config.
    pub rule: usize,
    pub per: BudgetScope,
    /// Its limit, and what was spent against it.
    pub tokens: u64,
    pub spent: u64,
    /// When the count starts again (a windowed rule).
    pub retry_after_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Count {
    since_ms: u64,
    tokens: u64,
    last_ms: u64,
}

#[derive(Debug)]
struct Rule {
    cfg: BudgetConfig,
    window_ms: Option<u64>,
    counts: HashMap<u64, Count>,
    /// `(last use, key)`: the order in which counts are forgotten when the rule is full.
    order: BTreeSet<(u64, u64)>,
}

impl Rule {
    /// The key `charge` is counted under, if this rule counts it.
    fn key(&self, charge: &Charge<'_>) -> Option<u64> {
        if self
            .cfg
            .tenant
            .as_deref()
            .is_some_and(|t| t != charge.tenant)
        {
            return None;
        }
        let id = match self.cfg.per {
            BudgetScope::Tenant => "",
            BudgetScope::Session => charge.session?,
            BudgetScope::Task => charge.task?,
        };
        // The tenant's name and the id, split by a byte neither holds.
        let mut bytes = Vec::with_capacity(charge.tenant.len() + id.len() + 1);
        bytes.extend_from_slice(charge.tenant.as_bytes());
        bytes.push(0x1f);
        bytes.extend_from_slice(id.as_bytes());
        Some(xxh3_64(&bytes))
    }

    /// What `key` has spent in its current window (0 once the window passed).
    fn spent(&self, key: u64, now_ms: u64) -> Option<Count> {
        let c = *self.counts.get(&key)?;
        match self.window_ms {
            Some(w) if now_ms >= c.since_ms.saturating_add(w) => None,
            _ => Some(c),
        }
    }

    fn add(&mut self, key: u64, tokens: u64, now_ms: u64) {
        let fresh = Count {
            since_ms: now_ms,
            tokens: 0,
            last_ms: now_ms,
        };
        let mut count = self.spent(key, now_ms).unwrap_or(fresh);
        if let Some(old) = self.counts.get(&key) {
            self.order.remove(&(old.last_ms, key));
        } else if self.counts.len() >= self.cfg.max_keys
            && let Some((_, oldest)) = self.order.pop_first()
        {
            self.counts.remove(&oldest);
        }
        count.tokens = count.tokens.saturating_add(tokens);
        count.last_ms = count.last_ms.max(now_ms);
        self.order.insert((count.last_ms, key));
        self.counts.insert(key, count);
    }
}

/// Every rule's counts (see the module docs).
#[derive(Debug)]
pub struct Budgets {
    rules: Vec<Rule>,
}

impl Rule {
    fn new(cfg: &BudgetConfig) -> Rule {
        Rule {
            window_ms: cfg.window_ms(),
            cfg: cfg.clone(),
            counts: HashMap::new(),
            order: BTreeSet::new(),
        }
    }
}

impl Budgets {
    /// Counts for rules that passed [`BudgetConfig::check`].
    pub fn new(rules: &[BudgetConfig]) -> Budgets {
        Budgets {
            rules: rules.iter().map(Rule::new).collect(),
        }
    }

    /// New rules (a reloaded file): a rule unchanged keeps its counts, others start empty.
    pub fn reconfigure(&mut self, rules: &[BudgetConfig]) {
        let mut old = std::mem::take(&mut self.rules);
        self.rules = rules
            .iter()
            .map(|cfg| match old.iter().position(|r| r.cfg == *cfg) {
                Some(i) => old.swap_remove(i),
                None => Rule::new(cfg),
            })
            .collect();
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether a request charged to `charge` may go now: the first rule whose count for it
    /// has reached its limit, if one has.
    pub fn check(&self, charge: &Charge<'_>, now_ms: u64) -> Result<(), Exceeded> {
        for (i, rule) in self.rules.iter().enumerate() {
            let Some(key) = rule.key(charge) else {
                continue;
            };
            let Some(count) = rule.spent(key, now_ms) else {
                continue;
            };
            if count.tokens >= rule.cfg.tokens {
                return Err(Exceeded {
                    rule: i,
                    per: rule.cfg.per,
                    tokens: rule.cfg.tokens,
                    spent: count.tokens,
                    retry_after_ms: rule
                        .window_ms
                        .map(|w| count.since_ms.saturating_add(w).saturating_sub(now_ms)),
                });
            }
        }
        Ok(())
    }

    /// A request charged to `charge` used `tokens`: each rule that counts it adds them.
    pub fn spend(&mut self, charge: &Charge<'_>, tokens: u64, now_ms: u64) {
        for rule in &mut self.rules {
            if let Some(key) = rule.key(charge) {
                rule.add(key, tokens, now_ms);
            }
        }
    }

    /// The counts each rule keeps now (for the bound's tests and the status page).
    pub fn counts(&self) -> Vec<usize> {
        self.rules.iter().map(|r| r.counts.len()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(per: BudgetScope, tokens: u64, window: Option<f64>) -> BudgetConfig {
        BudgetConfig {
            per,
            tokens,
            window_seconds: window,
            tenant: None,
            max_keys: 100,
        }
    }

    fn charge<'a>(tenant: &'a str, session: Option<&'a str>, task: Option<&'a str>) -> Charge<'a> {
        Charge {
            tenant,
            session,
            task,
        }
    }

    #[test]
    fn a_tenant_over_its_total_is_refused_and_another_tenant_is_not() {
        let mut b = Budgets::new(&[rule(BudgetScope::Tenant, 100, None)]);
        let acme = charge("acme", None, None);
        let other = charge("other", None, None);
        assert_eq!(b.check(&acme, 0), Ok(()));
        b.spend(&acme, 60, 1);
        assert_eq!(b.check(&acme, 2), Ok(()), "60 of 100: still under");
        b.spend(&acme, 60, 3);
        let e = b.check(&acme, 4).unwrap_err();
        assert_eq!(
            (e.rule, e.per, e.tokens, e.spent),
            (0, BudgetScope::Tenant, 100, 120)
        );
        assert_eq!(e.retry_after_ms, None, "a total never starts again");
        assert_eq!(b.check(&other, 4), Ok(()));
        // Much later: still refused.
        assert!(b.check(&acme, 10_000_000).is_err());
    }

    #[test]
    fn a_windowed_count_starts_again_once_its_window_passed() {
        let mut b = Budgets::new(&[rule(BudgetScope::Tenant, 100, Some(60.0))]);
        let acme = charge("acme", None, None);
        b.spend(&acme, 100, 1_000);
        let e = b.check(&acme, 21_000).unwrap_err();
        assert_eq!(
            e.retry_after_ms,
            Some(40_000),
            "the window ends 60 s after its first spend"
        );
        assert_eq!(b.check(&acme, 61_000), Ok(()));
        b.spend(&acme, 30, 61_000);
        // The new window counts only what came after.
        assert_eq!(b.check(&acme, 62_000), Ok(()));
        b.spend(&acme, 70, 62_000);
        assert_eq!(
            b.check(&acme, 63_000).unwrap_err().retry_after_ms,
            Some(58_000)
        );
    }

    #[test]
    fn sessions_and_tasks_count_apart_and_per_tenant() {
        let mut b = Budgets::new(&[
            rule(BudgetScope::Session, 50, None),
            rule(BudgetScope::Task, 80, None),
        ]);
        b.spend(&charge("acme", Some("s1"), Some("t1")), 50, 0);
        // The session's budget is spent, its task's not yet.
        let e = b.check(&charge("acme", Some("s1"), None), 1).unwrap_err();
        assert_eq!((e.rule, e.per), (0, BudgetScope::Session));
        assert_eq!(b.check(&charge("acme", Some("s2"), Some("t1")), 1), Ok(()));
        // The same session id of another tenant is another session.
        assert_eq!(b.check(&charge("other", Some("s1"), Some("t1")), 1), Ok(()));
        b.spend(&charge("acme", Some("s2"), Some("t1")), 30, 2);
        let e = b
            .check(&charge("acme", Some("s3"), Some("t1")), 3)
            .unwrap_err();
        assert_eq!((e.rule, e.per, e.spent), (1, BudgetScope::Task, 80));
        // No session, no task: neither rule counts the request.
        assert_eq!(b.check(&charge("acme", None, None), 3), Ok(()));
    }

    #[test]
    fn a_rule_for_one_tenant_leaves_the_others_alone() {
        let mut r = rule(BudgetScope::Tenant, 10, None);
        r.tenant = Some("acme".into());
        let mut b = Budgets::new(&[r]);
        b.spend(&charge("acme", None, None), 10, 0);
        b.spend(&charge("other", None, None), 1_000, 0);
        assert!(b.check(&charge("acme", None, None), 1).is_err());
        assert_eq!(b.check(&charge("other", None, None), 1), Ok(()));
        assert_eq!(b.counts(), vec![1], "only acme is counted");
    }

    #[test]
    fn the_counts_are_bounded_least_recently_used_first() {
        let mut r = rule(BudgetScope::Session, 10, None);
        r.max_keys = 3;
        let mut b = Budgets::new(&[r]);
        for (t, s) in [(0, "a"), (1, "b"), (2, "c")] {
            b.spend(&charge("acme", Some(s), None), 10, t);
        }
        // "a" used again: "b" is now the least recently used.
        b.spend(&charge("acme", Some("a"), None), 1, 3);
        b.spend(&charge("acme", Some("d"), None), 1, 4);
        assert_eq!(b.counts(), vec![3]);
        assert_eq!(
            b.check(&charge("acme", Some("b"), None), 5),
            Ok(()),
            "b was forgotten"
        );
        assert!(b.check(&charge("acme", Some("a"), None), 5).is_err());
        assert!(b.check(&charge("acme", Some("c"), None), 5).is_err());
        // A flood of new sessions keeps the bound.
        for i in 0..1_000 {
            b.spend(&charge("acme", Some(&format!("x{i}")), None), 1, 10 + i);
        }
        assert_eq!(b.counts(), vec![3]);
    }

    #[test]
    fn a_reload_keeps_the_counts_of_the_rules_it_did_not_change() {
        let tenant = rule(BudgetScope::Tenant, 100, None);
        let session = rule(BudgetScope::Session, 10, None);
        let mut b = Budgets::new(&[tenant.clone(), session.clone()]);
        b.spend(&charge("acme", Some("s"), None), 100, 0);
        let mut raised = session;
        raised.tokens = 1_000;
        // The session rule changed (it starts afresh), the tenant rule did not.
        b.reconfigure(&[raised, tenant]);
        let e = b.check(&charge("acme", Some("s"), None), 1).unwrap_err();
        assert_eq!((e.rule, e.per, e.spent), (1, BudgetScope::Tenant, 100));
        assert_eq!(b.counts(), vec![0, 1]);
    }

    #[test]
    fn bad_rules_are_refused_with_why() {
        assert!(rule(BudgetScope::Tenant, 0, None).check().is_err());
        assert!(rule(BudgetScope::Tenant, 1, Some(0.0)).check().is_err());
        assert!(
            rule(BudgetScope::Tenant, 1, Some(f64::NAN))
                .check()
                .is_err()
        );
        let mut r = rule(BudgetScope::Tenant, 1, None);
        r.max_keys = 0;
        assert!(r.check().is_err());
        assert!(rule(BudgetScope::Task, 1, Some(3600.0)).check().is_ok());
    }
}
