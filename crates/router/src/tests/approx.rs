//! Approximate KV mode in the routing replica: workers that publish no KV events, whose
//! overlap comes from the replica's own decisions for a TTL.

use tandem_indexer::{OverlapScores, TierCounts};
use tandem_protocol::{LoadReport, WorkerId, WorkerRole};

use super::replica::{BS, input, join, kv_only, prompt, replica, stored};
use super::tiers;
use crate::{
    ApproxConfig, ConfigError, DisaggMode, Input, KvSource, ReplicaConfig, RouterId, RoutingConfig,
    RoutingReplica,
};

const TTL: u64 = 1_000;

/// `kv` policy, no warm-up, an approximate index with a TTL of [`TTL`].
fn approx_routing() -> RoutingConfig {
    let mut routing = kv_only();
    routing.pool.warmup_ms = 0;
    routing.disagg.decode_pool.warmup_ms = 0;
    routing.disagg.prefill_pool.warmup_ms = 0;
    routing.approx = ApproxConfig {
        ttl_ms: TTL,
        max_entries: 10_000,
    };
    routing
}

/// Joins an approximate worker: nothing to dump, so no repair.
fn join_approx(r: &mut RoutingReplica, worker: u64, role: WorkerRole, now: u64) {
    let joined = Input::Joined {
        worker: WorkerId(worker),
        role,
        kv: KvSource::Approximate,
        device_blocks: 0,
    };
    let repairs = r.apply(joined, now).unwrap();
    assert!(repairs.is_empty(), "an approximate worker is not dumped");
}

fn device(n: usize) -> TierCounts {
    tiers(n as u32, 0, 0)
}

/// The overlap the decision's explanation shows for `worker`.
fn seen(d: &crate::Decision, worker: WorkerId) -> TierCounts {
    d.explain
        .iter()
        .find(|t| t.worker == worker)
        .map(|t| t.overlap)
        .unwrap()
}

fn other(w: WorkerId) -> WorkerId {
    WorkerId(3 - w.0)
}

#[test]
fn a_repeated_prompt_returns_to_its_approximate_worker_until_the_ttl() {
    let (tokens, hashes) = prompt(64 * BS, 1);
    let (small, small_hashes) = prompt(4 * BS, 2);
    let mut r = replica(approx_routing());
    join_approx(&mut r, 1, WorkerRole::Aggregated, 0);
    join_approx(&mut r, 2, WorkerRole::Aggregated, 0);

    // Nothing known yet: either worker, and the decision records the prompt there.
    let plan = r.route(&input(1, &tokens, &hashes), &[], 10).unwrap();
    let x = plan.decode_worker();
    assert_eq!(seen(&plan.decision.decode, x), TierCounts::default());
    let mut flight = plan.flight;
    r.first_token(&mut flight, 20);
    r.finish(flight, 30);
    assert_eq!(r.approx().len(), hashes.len());

    // Keep a small request on `x`, so that without its overlap `x` costs more than the other.
    let plan = r
        .route(&input(2, &small, &small_hashes), &[other(x)], 40)
        .unwrap();
    assert_eq!(plan.decode_worker(), x);
    let mut small_flight = plan.flight;
    r.first_token(&mut small_flight, 41);

    // While the TTL lasts the kv policy sees the whole prompt on device at `x`, and picks it.
    let d = r
        .decide(&input(3, &tokens, &hashes), &[], 10 + TTL - 1)
        .unwrap();
    assert_eq!(d.decode_worker(), x);
    assert_eq!(seen(&d.decode, x), device(hashes.len()));
    assert_eq!(seen(&d.decode, other(x)), TierCounts::default());
    let terms = d.decode.chosen_terms().unwrap();
    assert!(terms.credit > 0.0, "{terms:?}");
    assert_eq!(
        r.overlap(&hashes, 10 + TTL - 1).get(x),
        Some(device(hashes.len()))
    );

    // `decide` records nothing: at the TTL the record has expired and the load decides.
    let d = r
        .decide(&input(3, &tokens, &hashes), &[], 10 + TTL)
        .unwrap();
    assert_eq!(d.decode_worker(), other(x));
    assert!(d.decode.explain.iter().all(|t| t.overlap.total() == 0));
    assert!(r.overlap(&hashes, 10 + TTL).get(x).is_none());
    // What is left is the small prompt's record (recorded at 40).
    assert_eq!(r.approx().len(), small_hashes.len());
    r.finish(small_flight, 10 + TTL);
}

#[test]
fn routing_again_refreshes_the_record() {
    let (tokens, hashes) = prompt(32 * BS, 3);
    let mut r = replica(approx_routing());
    join_approx(&mut r, 1, WorkerRole::Aggregated, 0);
    join_approx(&mut r, 2, WorkerRole::Aggregated, 0);
    let first = r.route(&input(1, &tokens, &hashes), &[], 0).unwrap();
    let x = first.decode_worker();
    r.finish(first.flight, 1);
    let again = r.route(&input(2, &tokens, &hashes), &[], TTL - 1).unwrap();
    assert_eq!(again.decode_worker(), x);
    r.finish(again.flight, TTL - 1);
    // Past the first record's TTL, within the second's.
    let d = r
        .decide(&input(3, &tokens, &hashes), &[], TTL + 10)
        .unwrap();
    assert_eq!(d.decode_worker(), x);
    assert_eq!(seen(&d.decode, x), device(hashes.len()));
}

#[test]
fn a_leaver_and_a_restarted_worker_lose_their_records() {
    let (tokens, hashes) = prompt(16 * BS, 4);
    let mut r = replica(approx_routing());
    join_approx(&mut r, 1, WorkerRole::Aggregated, 0);
    join_approx(&mut r, 2, WorkerRole::Aggregated, 0);
    for (id, excluded) in [(1, WorkerId(2)), (2, WorkerId(1))] {
        let plan = r
            .route(&input(id, &tokens, &hashes), &[excluded], 5)
            .unwrap();
        r.finish(plan.flight, 6);
    }
    assert_eq!(r.approx().len(), 2 * hashes.len());
    r.apply(
        Input::Left {
            worker: WorkerId(1),
        },
        7,
    )
    .unwrap();
    assert_eq!(r.approx().len(), hashes.len());
    let scores = r.overlap(&hashes, 8);
    assert_eq!(scores.get(WorkerId(1)), None);
    assert_eq!(scores.get(WorkerId(2)), Some(device(hashes.len())));
    // A re-join under the same id is a new cache.
    join_approx(&mut r, 2, WorkerRole::Aggregated, 9);
    assert!(r.approx().is_empty());
    assert!(r.overlap(&hashes, 10).is_empty());
    // A decision made before a leave and committed after it records nothing.
    let d = r.decide(&input(3, &tokens, &hashes), &[], 11).unwrap();
    r.apply(
        Input::Left {
            worker: d.decode_worker(),
        },
        12,
    )
    .unwrap();
    let plan = r.commit(&input(3, &tokens, &hashes), d, 13).unwrap();
    r.finish(plan.flight, 14);
    assert!(r.approx().is_empty());
}

#[test]
fn mixed_pools_read_each_workers_own_source() {
    let (a_tokens, a) = prompt(32 * BS, 5);
    let (b_tokens, b) = prompt(32 * BS, 6);
    let mut r = replica(approx_routing());
    // Worker 1 publishes events and holds `a`; worker 2 publishes none.
    join(&mut r, 1, WorkerRole::Aggregated, 0, &a);
    join_approx(&mut r, 2, WorkerRole::Aggregated, 0);
    assert_eq!(r.kv_source(WorkerId(1)), Some(KvSource::Events));
    assert_eq!(r.kv_source(WorkerId(2)), Some(KvSource::Approximate));

    // `b` goes to worker 2 once; from then on both prompts have a home.
    let plan = r
        .route(&input(1, &b_tokens, &b), &[WorkerId(1)], 10)
        .unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(2));
    r.finish(plan.flight, 11);
    for id in 2..6 {
        let plan = r.route(&input(id, &a_tokens, &a), &[], 20).unwrap();
        assert_eq!(plan.decode_worker(), WorkerId(1));
        assert_eq!(seen(&plan.decision.decode, WorkerId(1)), device(a.len()));
        assert_eq!(seen(&plan.decision.decode, WorkerId(2)), device(0));
        r.finish(plan.flight, 21);
        let plan = r.route(&input(10 + id, &b_tokens, &b), &[], 20).unwrap();
        assert_eq!(plan.decode_worker(), WorkerId(2));
        assert_eq!(seen(&plan.decision.decode, WorkerId(2)), device(b.len()));
        assert_eq!(seen(&plan.decision.decode, WorkerId(1)), device(0));
        r.finish(plan.flight, 21);
    }
    // Decisions for the event worker are not recorded: its events are the truth.
    assert_eq!(r.approx().len(), b.len());
    let scores = r.overlap(&a, 30);
    assert_eq!(
        scores.iter().map(|s| s.0).collect::<Vec<_>>(),
        [WorkerId(1)]
    );
    assert_eq!(r.overlap(&b, 30).get(WorkerId(2)), Some(device(b.len())));

    // Events an approximate worker sends anyway are dropped, without repairs.
    let repairs = r.apply(Input::KvEvents(&[stored(2, 5, &a)]), 31).unwrap();
    assert!(repairs.is_empty());
    assert_eq!(r.overlap(&a, 31).get(WorkerId(2)), None);

    // A standalone indexer's overlap counts for event workers only.
    let external = OverlapScores {
        scores: vec![
            (WorkerId(1), device(b.len())),
            (WorkerId(2), device(a.len())),
        ],
    };
    let mut with_external = input(30, &a_tokens, &a);
    with_external.overlap = Some(&external);
    let d = r.decide(&with_external, &[], 32).unwrap();
    assert_eq!(seen(&d.decode, WorkerId(1)), device(b.len()));
    assert_eq!(seen(&d.decode, WorkerId(2)), device(0));
}

#[test]
fn approximate_workers_are_never_repaired() {
    let (tokens, hashes) = prompt(8 * BS, 7);
    let mut r = replica(approx_routing());
    join_approx(&mut r, 1, WorkerRole::Aggregated, 0);
    assert!(!r.feed().is_member(WorkerId(1)));
    let report = |last_kv_event_id| LoadReport {
        worker_id: WorkerId(1),
        last_kv_event_id,
        ..LoadReport::default()
    };
    // Event ids that would show trailing loss on an event worker say nothing here.
    for id in [5, 9, 100] {
        assert!(
            r.apply(Input::LoadReport(&report(id)), 1)
                .unwrap()
                .is_empty()
        );
    }
    assert_eq!(r.report(WorkerId(1)).map(|r| r.last_kv_event_id), Some(100));
    // A gap in events it sends is not a repair either.
    let repairs = r
        .apply(Input::KvEvents(&[stored(1, 7, &hashes)]), 2)
        .unwrap();
    assert!(repairs.is_empty());
    let plan = r.route(&input(1, &tokens, &hashes), &[], 3).unwrap();
    r.finish(plan.flight, 4);
    assert_eq!(r.feed().stats().repairs, 0);
    assert_eq!(r.feed().stats().gaps, 0);
}

#[test]
fn a_worker_can_switch_source_on_a_rejoin() {
    let (_, hashes) = prompt(8 * BS, 8);
    let mut r = replica(approx_routing());
    join(&mut r, 1, WorkerRole::Aggregated, 0, &hashes);
    assert_eq!(r.overlap(&hashes, 1).get(WorkerId(1)), Some(device(8)));
    // Events → approximate: its exact blocks go, and nothing is dumped.
    join_approx(&mut r, 1, WorkerRole::Aggregated, 2);
    assert!(!r.feed().is_member(WorkerId(1)));
    assert!(r.overlap(&hashes, 3).is_empty());
    assert!(r.feed().index().last_event_id(WorkerId(1)).is_none());
    // Approximate → events: dumped like any event worker, its records dropped.
    let joined = Input::Joined {
        worker: WorkerId(1),
        role: WorkerRole::Aggregated,
        kv: KvSource::default(),
        device_blocks: 0,
    };
    let repairs = r.apply(joined, 4).unwrap();
    assert_eq!(repairs.len(), 1);
    assert!(repairs[0].dump);
    assert!(r.approx().is_empty());
}

#[test]
fn a_remote_prefill_records_both_approximate_workers() {
    let (tokens, hashes) = prompt(4096, 9);
    let mut routing = approx_routing();
    routing.disagg.mode = DisaggMode::Always;
    let mut r = replica(routing);
    join_approx(&mut r, 1, WorkerRole::Decode, 0);
    join_approx(&mut r, 9, WorkerRole::Prefill, 0);
    // An event prefill worker beside it: excluded here, it must stay out of the records.
    join(&mut r, 8, WorkerRole::Prefill, 0, &[]);
    let plan = r
        .route(&input(1, &tokens, &hashes), &[WorkerId(8)], 10)
        .unwrap();
    assert_eq!(plan.prefill_worker(), Some(WorkerId(9)));
    r.finish(plan.flight, 20);
    let scores = r.overlap(&hashes, 30);
    assert_eq!(scores.get(WorkerId(1)), Some(device(hashes.len())));
    assert_eq!(scores.get(WorkerId(9)), Some(device(hashes.len())));
    assert_eq!(scores.len(), 2);
    // The next request's prefill sees its blocks at worker 9.
    let d = r.decide(&input(2, &tokens, &hashes), &[], 40).unwrap();
    let prefill = d.prefill.expect("always disaggregated");
    assert_eq!(prefill.worker, WorkerId(9));
    assert_eq!(seen(&prefill, WorkerId(9)), device(hashes.len()));
    assert_eq!(seen(&prefill, WorkerId(8)), device(0));
}

#[test]
fn the_cap_bounds_the_records() {
    let mut routing = approx_routing();
    routing.approx.max_entries = 50;
    let mut r = replica(routing);
    join_approx(&mut r, 1, WorkerRole::Aggregated, 0);
    join_approx(&mut r, 2, WorkerRole::Aggregated, 0);
    for i in 0..40u32 {
        let (tokens, hashes) = prompt(16 * BS, 100 + i);
        let plan = r
            .route(&input(u64::from(i), &tokens, &hashes), &[], u64::from(i))
            .unwrap();
        r.finish(plan.flight, u64::from(i));
        assert!(r.approx().len() <= 50);
    }
    // The latest prompt is kept whole.
    let (_, hashes) = prompt(16 * BS, 139);
    let scores = r.overlap(&hashes, 40);
    assert_eq!(scores.iter().map(|s| s.1.total()).max(), Some(16));
}

#[test]
fn a_zero_ttl_or_cap_is_refused() {
    for approx in [
        ApproxConfig {
            ttl_ms: 0,
            max_entries: 10,
        },
        ApproxConfig {
            ttl_ms: 10,
            max_entries: 0,
        },
    ] {
        let routing = RoutingConfig {
            approx,
            ..RoutingConfig::default()
        };
        let e = RoutingReplica::new(ReplicaConfig {
            router_id: RouterId(1),
            seed: 1,
            routing,
        })
        .unwrap_err();
        assert!(matches!(e, ConfigError::OutOfRange { .. }), "{e:?}");
    }
    assert_eq!(RoutingConfig::default().approx, ApproxConfig::default());
    assert_eq!(RoutingConfig::default().approx.ttl_ms, 120_000);
}

#[test]
fn event_workers_are_unaffected() {
    // Same seed, same events, same requests: with the approximate index idle, decisions match
    // a replica whose approximate settings differ.
    let (tokens, hashes) = prompt(32 * BS, 10);
    let mut a = replica(kv_only());
    let mut other = kv_only();
    other.approx.ttl_ms = 1;
    let mut b = replica(other);
    for r in [&mut a, &mut b] {
        join(r, 1, WorkerRole::Aggregated, 0, &[]);
        join(r, 2, WorkerRole::Aggregated, 0, &hashes[..4]);
    }
    let picks = |r: &mut RoutingReplica| -> Vec<WorkerId> {
        (0..20)
            .map(|i| {
                let plan = r.route(&input(i, &tokens, &hashes), &[], 100 + i).unwrap();
                plan.decode_worker()
            })
            .collect()
    };
    assert_eq!(picks(&mut a), picks(&mut b));
    assert!(a.approx().is_empty() && b.approx().is_empty());
}

#[test]
fn approximate_kv_routes_event_workers_on_decisions() {
    // `--kv-events false`: workers joining as event workers are approximate all the same.
    let (tokens, hashes) = prompt(32 * BS, 9);
    let mut routing = approx_routing();
    routing.approximate_kv = true;
    let mut r = replica(routing);
    for w in [1, 2] {
        let joined = Input::Joined {
            worker: WorkerId(w),
            role: WorkerRole::Aggregated,
            kv: KvSource::Events,
            device_blocks: 0,
        };
        assert!(r.apply(joined, 0).unwrap().is_empty(), "no dump asked");
        assert!(!r.feed().is_member(WorkerId(w)));
    }
    // Their events are dropped: the exact index stays empty.
    r.apply(Input::KvEvents(&[stored(1, 1, &hashes)]), 1)
        .unwrap();
    let plan = r.route(&input(1, &tokens, &hashes), &[], 2).unwrap();
    let x = plan.decode_worker();
    assert_eq!(
        seen(&plan.decision.decode, WorkerId(1)),
        TierCounts::default()
    );
    r.finish(plan.flight, 3);
    // The decision is what the next request sees: the whole prompt on `x`.
    let plan = r.route(&input(2, &tokens, &hashes), &[], 4).unwrap();
    assert_eq!(plan.decode_worker(), x);
    assert_eq!(seen(&plan.decision.decode, x), device(hashes.len()));
    assert_eq!(seen(&plan.decision.decode, other(x)), TierCounts::default());
}
