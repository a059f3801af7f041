//! The frontend's queue: bands, the starvation guard, VTC fairness, the bound and
//! displacement, deadlines, rate limits, `Retry-After`, and its memory bound; saturation.

use std::sync::Arc;

use proptest::prelude::*;
use tandem_protocol::{LoadReport, RequestId, WorkerId, WorkerRole};

use crate::flow::{Meta, TokenBucket};
use crate::{
    FlowConfig, FlowQueue, Input, KvSource, Priority, RejectReason, ReplicaConfig, RouteError,
    RouteInput, RouterId, RoutingConfig, RoutingReplica, SaturationConfig, TenantLimits,
};

fn meta(tenant: &str, priority: Priority, prompt: u64, now: u64) -> Meta {
    Meta {
        tenant: Arc::from(tenant),
        priority,
        prompt_tokens: prompt,
        arrived_ms: now,
        deadline_ms: now + 60_000,
    }
}

fn queue(cfg: FlowConfig) -> FlowQueue<u32> {
    FlowQueue::new(cfg).unwrap()
}

/// Dispatches everything, returning the items in order.
fn drain(q: &mut FlowQueue<u32>, now: u64) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(t) = q.peek(now) {
        out.push(q.dispatch(t, now).unwrap().item);
    }
    out
}

#[test]
fn bands_are_strict() {
    let mut q = queue(FlowConfig::default());
    q.enqueue(meta("a", Priority::Batch, 10, 0), 1, 0).unwrap();
    q.enqueue(meta("a", Priority::Standard, 10, 0), 2, 0)
        .unwrap();
    q.enqueue(meta("a", Priority::Interactive, 10, 0), 3, 0)
        .unwrap();
    q.enqueue(meta("a", Priority::Standard, 10, 0), 4, 0)
        .unwrap();
    assert_eq!(q.len(), 4);
    assert_eq!(q.len_band(Priority::Standard), 2);
    assert_eq!(drain(&mut q, 1), vec![3, 2, 4, 1]);
    assert!(q.is_empty());
}

#[test]
fn the_least_served_tenant_goes_next() {
    let mut q = queue(FlowConfig::default());
    for i in 0..3 {
        q.enqueue(meta("a", Priority::Standard, 100, 0), i, 0)
            .unwrap();
    }
    for i in 0..3 {
        q.enqueue(meta("b", Priority::Standard, 100, 0), 10 + i, 0)
            .unwrap();
    }
    // Each dispatch charges its tenant 100: the two alternate instead of first come, first
    // served (ties go to the older request).
    assert_eq!(drain(&mut q, 1), vec![0, 10, 1, 11, 2, 12]);
    // A tenant already served more waits behind one served less.
    q.dispatch_direct(&Arc::from("a"), 1000, 2);
    q.enqueue(meta("b", Priority::Standard, 100, 2), 20, 2)
        .unwrap();
    q.enqueue(meta("a", Priority::Standard, 100, 2), 21, 2)
        .unwrap();
    q.enqueue(meta("b", Priority::Standard, 100, 2), 22, 2)
        .unwrap();
    assert_eq!(drain(&mut q, 3), vec![20, 22, 21]);
}

#[test]
fn output_tokens_count_twice_by_default() {
    let mut q = queue(FlowConfig::default());
    q.dispatch_direct(&Arc::from("a"), 100, 0);
    q.charge_output("a", 50);
    assert_eq!(q.counter("a"), 200.0);
}

#[test]
fn a_tenant_returning_from_quiet_is_lifted_to_the_least_waiting_counter() {
    let mut q = queue(FlowConfig::default());
    let (a, b) = (Arc::<str>::from("a"), Arc::<str>::from("b"));
    // a is busy and waits; it has been served 5,000 tokens.
    q.dispatch_direct(&a, 5000, 0);
    q.enqueue(meta("a", Priority::Standard, 10, 0), 1, 0)
        .unwrap();
    // b was quiet (counter 0); when it starts waiting it is lifted to a's 5,000: it cannot
    // bank its idle time and then take the whole capacity.
    q.enqueue(meta("b", Priority::Standard, 10, 0), 2, 0)
        .unwrap();
    assert_eq!(q.counter(&b), 5000.0);
    // Equal counters: the older request first.
    assert_eq!(drain(&mut q, 1), vec![1, 2]);
    let _ = a;
}

#[test]
fn weights_scale_a_tenants_share() {
    let mut q = queue(FlowConfig::default());
    q.set_tenant_limits([(
        Arc::from("gold"),
        TenantLimits {
            weight: 2.0,
            ..Default::default()
        },
    )])
    .unwrap();
    for i in 0..20 {
        q.enqueue(meta("gold", Priority::Standard, 100, 0), i, 0)
            .unwrap();
        q.enqueue(meta("free", Priority::Standard, 100, 0), 100 + i, 0)
            .unwrap();
    }
    let first: Vec<u32> = drain(&mut q, 1).into_iter().take(15).collect();
    let gold = first.iter().filter(|&&i| i < 100).count();
    // 2:1 in tokens served: 10 of the first 15.
    assert_eq!(gold, 10, "{first:?}");
}

#[test]
fn a_starving_band_gets_its_share_and_no_more() {
    let cfg = FlowConfig {
        starvation_ms: 1000,
        starvation_every: 3,
        ..FlowConfig::default()
    };
    let mut q = queue(cfg);
    for i in 0..5 {
        q.enqueue(meta("b", Priority::Batch, 10, 0), 100 + i, 0)
            .unwrap();
    }
    for i in 0..12 {
        q.enqueue(meta("i", Priority::Interactive, 10, 2000), i, 2000)
            .unwrap();
    }
    // Not starving yet at t=500: interactive only.
    let t = q.peek(500).unwrap();
    assert_eq!(q.dispatch(t, 500).unwrap().item, 0);
    // At t=2000 batch has waited 2 s: one batch dispatch after every 3 interactive ones.
    let order: Vec<u32> = drain(&mut q, 2000);
    let positions: Vec<usize> = order
        .iter()
        .enumerate()
        .filter(|(_, i)| **i >= 100)
        .map(|(p, _)| p)
        .collect();
    assert_eq!(&positions[..3], &[3, 7, 11], "{order:?}");
}

#[test]
fn a_full_queue_sheds_the_newest_lower_band_request_first() {
    let cfg = FlowConfig {
        max_queued: 3,
        ..FlowConfig::default()
    };
    let mut q = queue(cfg);
    q.enqueue(meta("a", Priority::Batch, 10, 0), 1, 0).unwrap();
    q.enqueue(meta("a", Priority::Batch, 10, 0), 2, 0).unwrap();
    q.enqueue(meta("a", Priority::Standard, 10, 0), 3, 0)
        .unwrap();
    // A batch request finds no room.
    let (r, item) = q
        .enqueue(meta("a", Priority::Batch, 10, 0), 4, 0)
        .unwrap_err();
    assert_eq!((r.reason, item), (RejectReason::QueueFull, 4));
    assert!(r.retry_after_ms >= 1000);
    // An interactive one displaces the newest batch request.
    let (_, displaced) = q
        .enqueue(meta("a", Priority::Interactive, 10, 0), 5, 0)
        .unwrap();
    assert_eq!(displaced.map(|(_, i)| i), Some(2));
    // A standard one displaces the remaining batch request, then nothing is below it.
    let (_, displaced) = q
        .enqueue(meta("a", Priority::Standard, 10, 0), 6, 0)
        .unwrap();
    assert_eq!(displaced.map(|(_, i)| i), Some(1));
    let (r, _) = q
        .enqueue(meta("a", Priority::Standard, 10, 0), 7, 0)
        .unwrap_err();
    assert_eq!(r.reason, RejectReason::QueueFull);
    assert_eq!(drain(&mut q, 1), vec![5, 3, 6]);
}

#[test]
fn deadlines_take_requests_out() {
    let mut q = queue(FlowConfig::default());
    let mut m = meta("a", Priority::Standard, 10, 0);
    m.deadline_ms = 100;
    q.enqueue(m.clone(), 1, 0).unwrap();
    m.deadline_ms = 300;
    q.enqueue(m, 2, 0).unwrap();
    assert!(q.expire(99).is_empty());
    let gone: Vec<u32> = q.expire(100).into_iter().map(|(_, i)| i).collect();
    assert_eq!(gone, vec![1]);
    assert_eq!(q.len(), 1);
    let (t, _) = q
        .enqueue(meta("a", Priority::Standard, 10, 0), 3, 0)
        .unwrap();
    assert_eq!(q.remove(t).map(|(_, i)| i), Some(3));
    assert_eq!(q.remove(t), None);
    assert_eq!(drain(&mut q, 1), vec![2]);
}

#[test]
fn requests_per_minute_refuse_with_the_time_to_the_next_one() {
    let cfg = FlowConfig {
        limits: TenantLimits {
            requests_per_minute: Some(2),
            ..Default::default()
        },
        ..FlowConfig::default()
    };
    let mut q = queue(cfg);
    let a = Arc::<str>::from("a");
    q.check_limits(&a, 10, 0).unwrap();
    q.check_limits(&a, 10, 0).unwrap();
    let r = q.check_limits(&a, 10, 0).unwrap_err();
    assert_eq!(r.reason, RejectReason::RequestsPerMinute);
    // 2 per minute: one every 30 s.
    assert_eq!(r.retry_after_ms, 30_000);
    // Another tenant has its own bucket.
    q.check_limits(&Arc::from("b"), 10, 0).unwrap();
    q.check_limits(&a, 10, 30_000).unwrap();
}

#[test]
fn tokens_per_minute_are_charged_up_front_and_refunded() {
    let cfg = FlowConfig {
        limits: TenantLimits {
            tokens_per_minute: Some(1000),
            ..Default::default()
        },
        ..FlowConfig::default()
    };
    let mut q = queue(cfg);
    let a = Arc::<str>::from("a");
    q.check_limits(&a, 800, 0).unwrap();
    let r = q.check_limits(&a, 400, 0).unwrap_err();
    assert_eq!(r.reason, RejectReason::TokensPerMinute);
    // 200 missing at 1,000 per minute: 12 s.
    assert_eq!(r.retry_after_ms, 12_000);
    // The first request generated less than its max_tokens: 300 come back.
    q.refund_tokens("a", 300, 0);
    q.check_limits(&a, 400, 0).unwrap();
    // A request larger than the budget waits for a full bucket, not forever.
    let r = q.check_limits(&a, 5000, 0).unwrap_err();
    assert!(r.retry_after_ms <= 60_000);
    q.check_limits(&a, 5000, 60_000).unwrap();
}

#[test]
fn token_buckets_refill_exactly() {
    let mut b = TokenBucket::per_minute(60, 0);
    b.take(60, 0);
    assert_eq!(b.available(0), 0);
    assert_eq!(b.wait_ms(1, 0), 1000);
    assert_eq!(b.available(30_000), 30);
    assert!(!b.is_full(59_999));
    assert!(b.is_full(60_000));
    b.give_back(1000, 60_000);
    assert_eq!(b.available(60_000), 60);
}

#[test]
fn retry_after_follows_the_drain_rate() {
    let cfg = FlowConfig {
        max_queued: 50,
        ..FlowConfig::default()
    };
    let mut q = queue(cfg);
    // 10 dispatches a second for 10 s.
    for ms in (0..10_000).step_by(100) {
        q.dispatch_direct(&Arc::from("a"), 1, ms);
    }
    for i in 0..50 {
        q.enqueue(meta("a", Priority::Standard, 1, 10_000), i, 10_000)
            .unwrap();
    }
    let (r, _) = q
        .enqueue(meta("a", Priority::Standard, 1, 10_000), 99, 10_000)
        .unwrap_err();
    // 50 ahead at about 10 a second (the window is the last ten whole seconds).
    assert!(
        (5000..=5600).contains(&r.retry_after_ms),
        "{}",
        r.retry_after_ms
    );
}

#[test]
fn idle_tenants_are_pruned_and_the_tenant_count_is_bounded() {
    let cfg = FlowConfig {
        max_tenants: 3,
        limits: TenantLimits {
            requests_per_minute: Some(60),
            ..Default::default()
        },
        ..FlowConfig::default()
    };
    let mut q = queue(cfg);
    for t in ["a", "b", "c"] {
        q.check_limits(&Arc::from(t), 1, 0).unwrap();
    }
    // Buckets still refilling: no room for a fourth tenant.
    let r = q.check_limits(&Arc::from("d"), 1, 0).unwrap_err();
    assert_eq!(r.reason, RejectReason::TooManyTenants);
    // A second later the buckets are full again: the idle tenants go.
    q.check_limits(&Arc::from("d"), 1, 1000).unwrap();
    q.prune(1000);
    assert_eq!(q.tenants(), 1);
    // A running tenant is kept.
    q.dispatch_direct(&Arc::from("d"), 1, 5000);
    q.begin("d");
    q.prune(120_000);
    assert_eq!(q.tenants(), 1);
    q.finished("d");
    q.prune(120_000);
    assert_eq!(q.tenants(), 0);
}

#[test]
fn bad_limits_are_refused() {
    let mut q = queue(FlowConfig::default());
    let zero = TenantLimits {
        weight: 0.0,
        ..Default::default()
    };
    assert!(q.set_tenant_limits([(Arc::from("a"), zero)]).is_err());
    let no_rpm = TenantLimits {
        requests_per_minute: Some(0),
        ..Default::default()
    };
    assert!(q.set_tenant_limits([(Arc::from("a"), no_rpm)]).is_err());
    assert!(
        FlowQueue::<u32>::new(FlowConfig {
            output_weight: f64::NAN,
            ..FlowConfig::default()
        })
        .is_err()
    );
}

#[derive(Clone, Debug)]
enum Op {
    Enqueue { tenant: u8, band: u8, deadline: u16 },
    Dispatch,
    Remove(u8),
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4, 0u8..3, 0u16..2000).prop_map(|(tenant, band, deadline)| Op::Enqueue {
            tenant,
            band,
            deadline
        }),
        Just(Op::Dispatch),
        (0u8..50).prop_map(Op::Remove),
        Just(Op::Expire),
    ]
}

proptest! {
    /// Whatever happens, the queue stays within its bound, every request leaves exactly once,
    /// each tenant's requests of a band leave in arrival order, and nothing outlives its
    /// deadline past an expire.
    #[test]
    fn the_queue_keeps_its_invariants(ops in proptest::collection::vec(op(), 1..200)) {
        let cfg = FlowConfig { max_queued: 8, starvation_ms: 300, ..FlowConfig::default() };
        let mut q: FlowQueue<(u8, u8, u32)> = FlowQueue::new(cfg).unwrap();
        let mut tickets = Vec::new();
        let mut out = std::collections::HashSet::new();
        let mut last_seen = std::collections::HashMap::new();
        for (step, o) in ops.into_iter().enumerate() {
            let now = step as u64 * 10;
            match o {
                Op::Enqueue { tenant, band, deadline } => {
                    let m = Meta {
                        tenant: Arc::from(format!("t{tenant}")),
                        priority: Priority::ALL[band as usize],
                        prompt_tokens: 10,
                        arrived_ms: now,
                        deadline_ms: now + u64::from(deadline),
                    };
                    match q.enqueue(m, (tenant, band, step as u32), now) {
                        Ok((t, displaced)) => {
                            tickets.push(t);
                            if let Some((m, item)) = displaced {
                                prop_assert!(m.priority.band() > band as usize);
                                prop_assert!(out.insert(item.2));
                            }
                        }
                        Err((_, item)) => prop_assert!(out.insert(item.2)),
                    }
                }
                Op::Dispatch => {
                    if let Some(t) = q.peek(now) {
                        let d = q.dispatch(t, now).unwrap();
                        let (tenant, band, seq) = d.item;
                        prop_assert!(out.insert(seq));
                        let prev = last_seen.insert((tenant, band), seq);
                        prop_assert!(prev.is_none_or(|p| p < seq));
                    }
                }
                Op::Remove(i) => {
                    if let Some(t) = tickets.get(i as usize)
                        && let Some((_, item)) = q.remove(*t)
                    {
                        prop_assert!(out.insert(item.2));
                    }
                }
                Op::Expire => {
                    for (m, item) in q.expire(now) {
                        prop_assert!(m.deadline_ms <= now);
                        prop_assert!(out.insert(item.2));
                    }
                }
            }
            prop_assert!(q.len() <= 8);
            let bands: usize = Priority::ALL.iter().map(|p| q.len_band(*p)).sum();
            prop_assert_eq!(bands, q.len());
        }
    }
}

// ---------------------------------------------------------------------------------------
// Saturation
// ---------------------------------------------------------------------------------------

fn replica(saturation: SaturationConfig) -> RoutingReplica {
    let routing = RoutingConfig {
        saturation,
        ..RoutingConfig::default()
    };
    let mut r = RoutingReplica::new(ReplicaConfig {
        router_id: RouterId(1),
        seed: 7,
        routing,
    })
    .unwrap();
    for id in [1, 2] {
        r.apply(
            Input::Joined {
                worker: WorkerId(id),
                role: WorkerRole::Decode,
                kv: KvSource::Events,
                device_blocks: 0,
            },
            0,
        )
        .unwrap();
        let report = LoadReport {
            worker_id: WorkerId(id),
            kv_total_blocks: 100,
            ..Default::default()
        };
        r.apply(Input::LoadReport(&report), 0).unwrap();
    }
    r
}

/// A request of `prompt_tokens` whose full blocks have hashes of their own.
fn input(request: u64, prompt_tokens: u64) -> (RouteInput<'static>, u64) {
    let route = crate::tests::req(prompt_tokens, 16);
    let hashes: Vec<tandem_protocol::SequenceHash> = (0..prompt_tokens / 16)
        .map(|i| tandem_protocol::SequenceHash(request * 1_000_000 + i))
        .collect();
    (
        RouteInput {
            request: RequestId(request),
            route,
            hashes: Box::leak(hashes.into_boxed_slice()),
            expected_output_tokens: 0,
            overlap: None,
            session: None,
        },
        prompt_tokens,
    )
}

#[test]
fn saturated_workers_are_left_out_and_then_the_request_waits() {
    let mut r = replica(SaturationConfig {
        requests: Some(2),
        ..SaturationConfig::OFF
    });
    let mut held = Vec::new();
    // Four requests fit (two per worker); each lands on a worker below the bound.
    for i in 0..4 {
        let (inp, _) = input(i, 64);
        let plan = r.route_admitted(&inp, &[], 0).unwrap();
        held.push(plan.flight);
    }
    assert!(r.is_saturated(WorkerId(1)) && r.is_saturated(WorkerId(2)));
    assert!(!r.has_capacity());
    let (inp, _) = input(10, 64);
    assert_eq!(r.route_admitted(&inp, &[], 0), Err(RouteError::Saturated));
    // A started request's retry still goes somewhere.
    let retry = r.route(&inp, &[], 0).unwrap();
    r.finish(retry.flight, 1);
    // One ends: room again.
    let f = held.pop().unwrap();
    r.finish(f, 1);
    assert!(r.has_capacity());
    let (inp, _) = input(11, 64);
    assert!(r.route_admitted(&inp, &[], 1).is_ok());
}

#[test]
fn kv_saturation_counts_what_requests_will_hold_and_one_always_runs() {
    let mut r = replica(SaturationConfig {
        kv_fraction: Some(0.5),
        ..SaturationConfig::OFF
    });
    // 100 device blocks per worker; a prompt of 60 blocks is over half of them, but a worker
    // with nothing in flight is never saturated.
    let (a, _) = input(1, 60 * 16);
    let pa = r.route_admitted(&a, &[], 0).unwrap();
    let (b, _) = input(2, 60 * 16);
    let pb = r.route_admitted(&b, &[], 0).unwrap();
    assert_ne!(pa.decode_worker(), pb.decode_worker());
    let (c, _) = input(3, 16);
    assert_eq!(r.route_admitted(&c, &[], 0), Err(RouteError::Saturated));
    // No workers at all is not saturation.
    let mut empty = RoutingReplica::new(ReplicaConfig {
        router_id: RouterId(1),
        seed: 7,
        routing: RoutingConfig::default(),
    })
    .unwrap();
    assert_eq!(empty.route_admitted(&c, &[], 0), Err(RouteError::NoWorkers));
}

#[test]
fn reported_waiting_requests_saturate_a_worker() {
    let mut r = replica(SaturationConfig {
        waiting: Some(3),
        ..SaturationConfig::OFF
    });
    let (a, _) = input(1, 64);
    let p = r.route_admitted(&a, &[], 0).unwrap();
    let w = p.decode_worker();
    let report = LoadReport {
        worker_id: w,
        waiting_requests: 3,
        kv_total_blocks: 100,
        ..Default::default()
    };
    r.apply(Input::LoadReport(&report), 1).unwrap();
    assert!(r.is_saturated(w));
    let (b, _) = input(2, 64);
    assert_ne!(r.route_admitted(&b, &[], 1).unwrap().decode_worker(), w);
}

#[test]
fn reported_waiting_requests_leave_the_count_as_requests_end() {
    let mut r = replica(SaturationConfig {
        waiting: Some(3),
        ..SaturationConfig::OFF
    });
    let (a, _) = input(1, 64);
    let first = r.route_admitted(&a, &[], 0).unwrap();
    let w = first.decode_worker();
    // Three more on the same worker (the other is out of the way).
    let other = r.decode_workers().find(|&x| x != w).unwrap();
    let mut flights = vec![first.flight];
    for i in 2..5 {
        let (inp, _) = input(i, 64);
        flights.push(r.route_admitted(&inp, &[other], 0).unwrap().flight);
    }
    let report = |waiting_requests| LoadReport {
        worker_id: w,
        waiting_requests,
        kv_total_blocks: 100,
        ..Default::default()
    };
    // 4 waiting: saturated until 2 of its requests end, however late the next report.
    r.apply(Input::LoadReport(&report(4)), 1).unwrap();
    assert!(r.is_saturated(w));
    r.finish(flights.pop().unwrap(), 2);
    assert!(r.is_saturated(w), "3 left waiting");
    let (e, _) = input(5, 64);
    assert_eq!(
        r.route_admitted(&e, &[], 2).unwrap().decode_worker(),
        other,
        "a saturated worker is passed over"
    );
    r.finish(flights.pop().unwrap(), 3);
    assert!(
        !r.is_saturated(w),
        "each one that ended made room for one waiting"
    );
    // Requests routed after a report are the next report's to count.
    r.apply(Input::LoadReport(&report(2)), 4).unwrap();
    for i in 6..9 {
        let (inp, _) = input(i, 64);
        let p = r.route_admitted(&inp, &[other], 4).unwrap();
        assert_eq!(p.decode_worker(), w);
        flights.push(p.flight);
    }
    assert!(!r.is_saturated(w));
    r.apply(Input::LoadReport(&report(3)), 5).unwrap();
    assert!(r.is_saturated(w));
}

// ---------------------------------------------------------------------------------------
// Breakers and the retry budget
// ---------------------------------------------------------------------------------------

mod breakers {
    use tandem_protocol::WorkerId;

    use crate::{BreakerConfig, BreakerState, Breakers, RetryBudget, RetryBudgetConfig};

    const W: WorkerId = WorkerId(7);

    #[test]
    fn failures_in_a_row_open_and_a_probe_closes() {
        let mut b = Breakers::new(BreakerConfig {
            consecutive_failures: 3,
            open_ms: 1000,
            ..BreakerConfig::default()
        });
        assert!(!b.failure(W, 0));
        b.success(W, 1);
        assert!(!b.failure(W, 2) && !b.failure(W, 3));
        assert!(b.failure(W, 4), "the third in a row opens it");
        assert_eq!(b.state(W, 5), BreakerState::Open { until_ms: 1004 });
        assert!(!b.allows(W, 1003));
        // Half-open: one probe.
        assert!(b.allows(W, 1004));
        b.on_chosen(W, 1004);
        assert_eq!(b.state(W, 1004), BreakerState::HalfOpen);
        assert!(!b.allows(W, 1005), "one probe at a time");
        b.success(W, 1100);
        assert_eq!(b.state(W, 1100), BreakerState::Closed);
        assert!(b.allows(W, 1100));
        assert_eq!(b.times_opened(W), 1);
    }

    #[test]
    fn a_failed_probe_reopens_for_longer_and_a_lost_probe_frees_the_slot() {
        let mut b = Breakers::new(BreakerConfig {
            consecutive_failures: 1,
            open_ms: 1000,
            max_open_ms: 3000,
            ..BreakerConfig::default()
        });
        assert!(b.failure(W, 0));
        b.on_chosen(W, 1000);
        assert!(b.failure(W, 1010));
        // Doubled: 2 s.
        assert_eq!(b.state(W, 1010), BreakerState::Open { until_ms: 3010 });
        b.on_chosen(W, 3010);
        assert!(b.failure(W, 3020));
        // Capped at 3 s.
        assert_eq!(b.state(W, 3020), BreakerState::Open { until_ms: 6020 });
        // A probe that never reports: after another open period a new one may go.
        b.on_chosen(W, 6020);
        assert!(!b.allows(W, 6500));
        assert!(b.allows(W, 7020));
    }

    #[test]
    fn a_high_failure_ratio_opens_it_without_a_run() {
        let mut b = Breakers::new(BreakerConfig {
            consecutive_failures: 0,
            window_min_requests: 10,
            window_failure_ratio: 0.5,
            window_ms: 10_000,
            ..BreakerConfig::default()
        });
        let mut opened = false;
        for i in 0..10u64 {
            if i % 2 == 0 {
                b.success(W, i);
            } else {
                opened |= b.failure(W, i);
            }
        }
        assert!(opened, "5 of 10 failed");
        // Old outcomes leave the window.
        let mut c = Breakers::new(*b.config());
        for i in 0..5u64 {
            c.failure(W, i);
        }
        for i in 0..9u64 {
            c.success(W, 20_000 + i);
        }
        assert!(!c.failure(W, 20_010), "1 of 10 in the window");
        // A worker that leaves forgets its breaker.
        b.remove(W);
        assert_eq!(b.state(W, 20), BreakerState::Closed);
    }

    #[test]
    fn the_retry_budget_is_a_fraction_of_recent_successes() {
        let mut r = RetryBudget::new(RetryBudgetConfig {
            ratio: 0.1,
            min_per_window: 2,
            window_ms: 10_000,
        });
        // The floor.
        assert!(r.try_retry(0) && r.try_retry(0));
        assert!(!r.try_retry(0));
        // 50 successes: 5 more.
        for _ in 0..50 {
            r.success(100);
        }
        let granted = (0..20).filter(|_| r.try_retry(200)).count();
        assert_eq!(granted, 5);
        // Ten seconds on, the window is empty again: the floor only.
        let granted = (0..20).filter(|_| r.try_retry(20_000)).count();
        assert_eq!(granted, 2);
    }
}

#[test]
fn an_open_breaker_takes_a_worker_out_until_its_probe() {
    let mut r = replica(SaturationConfig::OFF);
    for _ in 0..5 {
        r.worker_failed(WorkerId(1), 0);
    }
    for i in 0..10 {
        let (inp, _) = input(i, 64);
        let p = r.route(&inp, &[], 1).unwrap();
        assert_eq!(p.decode_worker(), WorkerId(2));
        r.finish(p.flight, 1);
    }
    for _ in 0..5 {
        r.worker_failed(WorkerId(2), 2);
    }
    let (inp, _) = input(50, 64);
    assert_eq!(r.route(&inp, &[], 3), Err(RouteError::CircuitOpen));
    // After the open period, probes go again.
    assert!(r.route(&inp, &[], 6000).is_ok());
}

#[test]
fn ttft_quantiles_are_per_prompt_size() {
    let mut h = crate::TtftHistory::new(10);
    for i in 1..=100u64 {
        h.record(1000, i * 10);
        h.record(10_000, 5_000);
    }
    assert_eq!(h.quantile_ms(1000, 0.95), Some(950));
    // 600 tokens is the same power-of-two class as 1,000? No: 512..1023 — yes.
    assert_eq!(h.quantile_ms(600, 0.5), Some(510));
    assert_eq!(h.quantile_ms(12_000, 0.95), Some(5_000));
    // Too few samples: no answer.
    h.record(100, 5);
    assert_eq!(h.quantile_ms(100, 0.95), None);
}

#[test]
fn a_saturated_prefill_pool_holds_remote_prefills_but_not_local_ones() {
    let routing = RoutingConfig {
        saturation: SaturationConfig {
            prefill_pool_tokens: Some(4000),
            ..SaturationConfig::OFF
        },
        disagg: crate::DisaggConfig {
            mode: crate::DisaggMode::Always,
            ..crate::DisaggConfig::default()
        },
        ..RoutingConfig::default()
    };
    let mut r = RoutingReplica::new(ReplicaConfig {
        router_id: RouterId(1),
        seed: 7,
        routing,
    })
    .unwrap();
    for (id, role) in [
        (1, WorkerRole::Decode),
        (8, WorkerRole::Prefill),
        (9, WorkerRole::Prefill),
    ] {
        r.apply(
            Input::Joined {
                worker: WorkerId(id),
                role,
                kv: KvSource::Events,
                device_blocks: 0,
            },
            0,
        )
        .unwrap();
    }
    // Two 3,000-token prompts take one prefill worker each; neither is saturated yet.
    let (a, _) = input(1, 3000);
    let pa = r.route_admitted(&a, &[], 0).unwrap();
    assert!(pa.prefill_worker().is_some());
    let (b, _) = input(2, 3000);
    let pb = r.route_admitted(&b, &[], 0).unwrap();
    assert_ne!(pa.prefill_worker(), pb.prefill_worker());
    // A third goes to the one of them below 4,000 pending tokens... there is none after it:
    let (c, _) = input(3, 1500);
    let pc = r.route_admitted(&c, &[], 0).unwrap();
    let busy = pc.prefill_worker().unwrap();
    assert!(r.is_prefill_saturated(busy));
    let (d, _) = input(4, 1500);
    let pd = r.route_admitted(&d, &[], 0).unwrap();
    assert_ne!(pd.prefill_worker(), Some(busy));
    // Now both are over 4,000: a request that would prefill remotely waits.
    let (e, _) = input(5, 3000);
    assert_eq!(r.route_admitted(&e, &[], 0), Err(RouteError::Saturated));
    // A prefill worker's first token frees its queue: remote prefills go again.
    let mut f = pa.flight;
    r.first_token(&mut f, 1);
    assert!(
        r.route_admitted(&e, &[], 1)
            .unwrap()
            .prefill_worker()
            .is_some()
    );
}
