//! Session affinity in the routing replica: a session stays on its worker while that worker
//! can take it, and moves when it cannot.

use tandem_protocol::{WorkerId, WorkerRole};

use super::replica::{BS, input, join, kv_only, prompt, replica};
use crate::{RoutingConfig, Rule, SessionKey, SessionOutcome};

fn routing() -> RoutingConfig {
    let mut r = kv_only();
    r.pool.warmup_ms = 0;
    r
}

#[test]
fn a_session_stays_on_its_worker_against_the_cost_and_moves_when_excluded_or_busy() {
    let session = SessionKey::new(None, "conversation-1");
    let (a, a_hashes) = prompt(8 * BS, 1);
    let (b, b_hashes) = prompt(64 * BS, 2);
    let mut cfg = routing();
    cfg.pool.busy_prefill_tokens = Some(10_000);
    let mut r = replica(cfg);
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    // Worker 2 holds prompt `b` entirely: `kv` would pick it for `b`.
    join(&mut r, 2, WorkerRole::Aggregated, 0, &b_hashes);
    // First turn on an empty cluster, steered to worker 1 by excluding 2.
    let mut first = input(1, &a, &a_hashes);
    first.session = Some(session);
    let plan = r.route(&first, &[WorkerId(2)], 10).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(1));
    assert_eq!(plan.session, Some(SessionOutcome::New));
    r.finish(plan.flight, 20);
    // Next turn: without the session, `b` goes to worker 2 (its cache)…
    let plan = r.route(&input(2, &b, &b_hashes), &[], 30).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(2));
    assert_eq!(plan.session, None);
    r.finish(plan.flight, 31);
    // …with it, to the session's worker 1, and the decision says why.
    let mut turn = input(3, &b, &b_hashes);
    turn.session = Some(session);
    let plan = r.route(&turn, &[], 40).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(1));
    assert_eq!(plan.decision.decode.rule, Rule::Session);
    assert_eq!(plan.decision.decode.explain.len(), 1);
    assert_eq!(plan.session, Some(SessionOutcome::Hit));
    r.finish(plan.flight, 41);
    // Worker 1 failed this request (excluded): the policy chooses, the session moves.
    let mut retry = input(4, &b, &b_hashes);
    retry.session = Some(session);
    let plan = r.route(&retry, &[WorkerId(1)], 50).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(2));
    assert_eq!(plan.session, Some(SessionOutcome::Moved));
    assert_ne!(plan.decision.decode.rule, Rule::Session);
    r.finish(plan.flight, 51);
    // Now pinned to 2. Make 2 busy (over 10,000 pending prefill tokens) with other work: the
    // session escapes to 1.
    let (big, big_hashes) = prompt(700 * BS, 3);
    let plan = r
        .route(&input(5, &big, &big_hashes), &[WorkerId(1)], 60)
        .unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(2));
    let busy = plan.flight;
    let mut turn = input(6, &a, &a_hashes);
    turn.session = Some(session);
    let plan = r.route(&turn, &[], 70).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(1));
    assert_eq!(plan.session, Some(SessionOutcome::Moved));
    r.finish(plan.flight, 71);
    r.finish(busy, 72);
    let stats = r.sessions().stats();
    assert_eq!((stats.new, stats.hits, stats.moves), (1, 1, 2));
}

#[test]
fn sessions_expire_off_and_leave_with_their_worker() {
    let session = SessionKey::new(Some("tenant"), "s");
    let (a, a_hashes) = prompt(8 * BS, 1);
    let mut cfg = routing();
    cfg.sessions.ttl_ms = 100;
    let mut r = replica(cfg);
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    join(&mut r, 2, WorkerRole::Aggregated, 0, &[]);
    let mut turn = input(1, &a, &a_hashes);
    turn.session = Some(session);
    let plan = r.route(&turn, &[], 0).unwrap();
    r.finish(plan.flight, 10);
    assert_eq!(r.sessions().len(), 1);
    // Past the TTL after its last request ended: forgotten.
    turn.request = tandem_protocol::RequestId(2);
    let plan = r.route(&turn, &[], 111).unwrap();
    assert_eq!(plan.session, Some(SessionOutcome::New));
    r.finish(plan.flight, 112);
    // Its worker leaves: the session goes with it.
    let pinned = plan.decode_worker();
    r.apply(crate::Input::Left { worker: pinned }, 113).unwrap();
    assert!(r.sessions().is_empty());
    // Affinity off: a session is ignored.
    let mut off = routing();
    off.sessions.enabled = false;
    let mut r = replica(off);
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    turn.request = tandem_protocol::RequestId(3);
    let plan = r.route(&turn, &[], 0).unwrap();
    assert_eq!(plan.session, None);
    r.finish(plan.flight, 1);
    assert!(r.sessions().is_empty());
}
