//! The routing replica: membership, the index feed, routing and the request lifecycle in the
//! tracker.

use tandem_indexer::RepairReply;
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{
    HashSeed, KvDump, KvEvent, KvEventKind, LoadReport, RequestId, SequenceHash, StorageTier,
    StoredBlock, WorkerId, WorkerRole,
};

use super::bs;
use crate::{
    DisaggMode, Input, KvSource, PolicyConfig, PolicyKind, ReplicaConfig, RouteError, RouteInput,
    RouteRequest, RouterId, RoutingConfig, RoutingReplica, SyncMessage,
};

pub(super) const BS: u32 = 16;

pub(super) fn replica(routing: RoutingConfig) -> RoutingReplica {
    RoutingReplica::new(ReplicaConfig {
        router_id: RouterId(1),
        seed: 42,
        routing,
    })
    .unwrap()
}

/// Joins `worker` and answers its dump with `blocks` stored on device.
pub(super) fn join(
    r: &mut RoutingReplica,
    worker: u64,
    role: WorkerRole,
    now: u64,
    blocks: &[SequenceHash],
) {
    let w = WorkerId(worker);
    let repairs = r
        .apply(
            Input::Joined {
                worker: w,
                role,
                kv: KvSource::Events,
                device_blocks: 0,
            },
            now,
        )
        .unwrap();
    assert_eq!(repairs.len(), 1, "a joining worker is dumped");
    assert!(repairs[0].dump);
    let events = if blocks.is_empty() {
        vec![]
    } else {
        vec![stored(worker, 1, blocks)]
    };
    let dump = KvDump {
        worker_id: w,
        last_event_id: events.len() as u64,
        events,
    };
    let reply = RepairReply::Dump(dump);
    r.apply(Input::Repaired { worker: w, reply }, now).unwrap();
}

pub(super) fn stored(worker: u64, event_id: u64, blocks: &[SequenceHash]) -> KvEvent {
    KvEvent {
        worker_id: WorkerId(worker),
        event_id,
        tier: StorageTier::Device,
        kind: KvEventKind::Stored {
            parent: None,
            blocks: blocks
                .iter()
                .map(|&h| StoredBlock {
                    sequence_hash: h,
                    local_hash: tandem_protocol::LocalBlockHash(h.0),
                })
                .collect(),
        },
    }
}

pub(super) fn prompt(n: u32, salt: u32) -> (Vec<u32>, Vec<SequenceHash>) {
    let tokens: Vec<u32> = (0..n).map(|i| i + salt * 100_000).collect();
    let hashes = compute_block_hashes(&tokens, bs(BS), HashSeed::UNSALTED)
        .iter()
        .map(|h| h.sequence)
        .collect();
    (tokens, hashes)
}

pub(super) fn input<'a>(id: u64, tokens: &[u32], hashes: &'a [SequenceHash]) -> RouteInput<'a> {
    RouteInput {
        request: RequestId(id),
        route: RouteRequest::from_tokens(tokens, bs(BS), HashSeed::UNSALTED),
        hashes,
        expected_output_tokens: 16,
        overlap: None,
        session: None,
    }
}

/// The kv policy in Dynamo's configuration (prefill and decode blocks weighed alike), the
/// costs these tests spell out.
pub(super) fn kv_only() -> RoutingConfig {
    RoutingConfig {
        policy: PolicyConfig {
            kv: crate::KvConfig::dynamo(),
            ..PolicyConfig::new(PolicyKind::Kv)
        },
        ..RoutingConfig::default()
    }
}

#[test]
fn routes_to_the_worker_holding_the_prompt_and_books_it() {
    let (tokens, hashes) = prompt(64 * BS, 1);
    let mut r = replica(kv_only());
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    join(&mut r, 2, WorkerRole::Aggregated, 0, &hashes);
    let plan = r.route(&input(7, &tokens, &hashes), &[], 100).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(2));
    assert_eq!(plan.prefill_worker(), None);
    assert_eq!(plan.sync.len(), 1);
    let load = r.tracker().load(WorkerId(2));
    assert_eq!(load.active_requests, 1);
    // The whole prompt is cached but its last block: only that block's tokens are prefill.
    assert_eq!(load.active_prefill_tokens, 0);
    let mut flight = plan.flight;
    let first = r.first_token(&mut flight, 150);
    assert!(matches!(first[..], [SyncMessage::PrefillDone { .. }]));
    assert!(r.first_token(&mut flight, 151).is_empty(), "once only");
    let end = r.finish(flight, 200);
    assert!(matches!(end[..], [SyncMessage::Free { .. }]));
    assert_eq!(r.tracker().load(WorkerId(2)).active_requests, 0);
}

#[test]
fn excluded_and_missing_workers_are_errors_not_panics() {
    let (tokens, hashes) = prompt(100, 2);
    let mut r = replica(kv_only());
    let e = r.route(&input(1, &tokens, &hashes), &[], 0).unwrap_err();
    assert_eq!(e, RouteError::NoWorkers);
    join(&mut r, 1, WorkerRole::Decode, 0, &[]);
    let e = r
        .route(&input(2, &tokens, &hashes), &[WorkerId(1)], 0)
        .unwrap_err();
    assert_eq!(e, RouteError::AllExcluded);
    let e = r
        .route(&input(1 << 63, &tokens, &hashes), &[], 0)
        .unwrap_err();
    assert!(matches!(e, RouteError::InvalidRequestId(_)), "{e:?}");
}

#[test]
fn a_remote_prefill_books_both_workers_until_its_first_token() {
    let (tokens, hashes) = prompt(4096, 3);
    let mut routing = kv_only();
    routing.disagg.mode = DisaggMode::Always;
    let mut r = replica(routing);
    join(&mut r, 1, WorkerRole::Decode, 0, &[]);
    join(&mut r, 9, WorkerRole::Prefill, 0, &[]);
    let plan = r.route(&input(5, &tokens, &hashes), &[], 10).unwrap();
    assert_eq!(plan.prefill_worker(), Some(WorkerId(9)));
    assert!(plan.flight.is_remote());
    assert_eq!(plan.sync.len(), 2);
    assert_eq!(r.tracker().load(WorkerId(1)).active_prefill_tokens, 0);
    assert_eq!(r.tracker().load(WorkerId(9)).active_prefill_tokens, 4096);
    let mut flight = plan.flight;
    let msgs = r.prefill_finished(&mut flight, 20);
    assert_eq!(msgs.len(), 1);
    assert_eq!(r.tracker().load(WorkerId(9)).active_requests, 0);
    // The prefill entry is released once, whatever happens next.
    assert_eq!(r.first_token(&mut flight, 30).len(), 1);
    assert_eq!(r.finish(flight, 40).len(), 1);

    // A request that ends before its first token releases both.
    let plan = r.route(&input(6, &tokens, &hashes), &[], 50).unwrap();
    assert_eq!(r.finish(plan.flight, 60).len(), 2);
    assert_eq!(r.tracker().active_requests(), 0);
}

#[test]
fn events_move_routing_and_a_leaver_is_purged() {
    let (tokens, hashes) = prompt(32 * BS, 4);
    let mut r = replica(kv_only());
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    join(&mut r, 2, WorkerRole::Aggregated, 0, &[]);
    let repairs = r
        .apply(Input::KvEvents(&[stored(1, 1, &hashes)]), 5)
        .unwrap();
    assert!(repairs.is_empty());
    let plan = r.route(&input(1, &tokens, &hashes), &[], 10).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(1));
    // A gap is not applied past: the replica asks for the range.
    let repairs = r
        .apply(Input::KvEvents(&[stored(2, 3, &hashes)]), 11)
        .unwrap();
    assert_eq!(repairs.len(), 1);
    assert_eq!((repairs[0].worker, repairs[0].after), (WorkerId(2), 0));
    r.apply(
        Input::Left {
            worker: WorkerId(1),
        },
        12,
    )
    .unwrap();
    assert_eq!(r.decode_workers().collect::<Vec<_>>(), [WorkerId(2)]);
    assert_eq!(r.tracker().load(WorkerId(1)).active_requests, 0);
    assert_eq!(r.feed().index().last_event_id(WorkerId(1)), None);
    let plan = r.route(&input(2, &tokens, &hashes), &[], 13).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(2));
}

#[test]
fn load_reports_count_only_when_merged() {
    let (tokens, hashes) = prompt(256, 5);
    let report = |worker| LoadReport {
        worker_id: WorkerId(worker),
        running_requests: 50,
        kv_active_blocks: 900,
        kv_total_blocks: 1000,
        ..LoadReport::default()
    };
    for merge in [false, true] {
        let mut routing = RoutingConfig {
            policy: PolicyConfig::new(PolicyKind::LeastLoaded),
            merge_load_reports: merge,
            ..RoutingConfig::default()
        };
        routing.pool.warmup_ms = 0;
        let mut r = replica(routing);
        join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
        join(&mut r, 2, WorkerRole::Aggregated, 0, &[]);
        r.apply(Input::LoadReport(&report(1)), 1).unwrap();
        assert_eq!(r.report(WorkerId(1)).map(|r| r.running_requests), Some(50));
        // A report of a worker not in the pools is dropped.
        r.apply(Input::LoadReport(&report(3)), 1).unwrap();
        assert!(r.report(WorkerId(3)).is_none());
        let picks: Vec<u64> = (0..8)
            .map(|i| {
                let plan = r.route(&input(i, &tokens, &hashes), &[], 2).unwrap();
                let w = plan.decode_worker().0;
                r.finish(plan.flight, 2);
                w
            })
            .collect();
        if merge {
            assert!(picks.iter().all(|&w| w == 2), "{picks:?}");
        } else {
            assert!(picks.contains(&1) && picks.contains(&2), "{picks:?}");
        }
    }
}

#[test]
fn a_new_worker_warms_up_at_the_median_load() {
    let (tokens, hashes) = prompt(256, 6);
    let mut routing = RoutingConfig {
        policy: PolicyConfig::new(PolicyKind::LeastLoaded),
        ..RoutingConfig::default()
    };
    routing.pool.warmup_ms = 1_000;
    let mut r = replica(routing);
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    join(&mut r, 2, WorkerRole::Aggregated, 0, &[]);
    let mut flights = Vec::new();
    for i in 0..4 {
        flights.push(
            r.route(&input(i, &tokens, &hashes), &[], 2_000)
                .unwrap()
                .flight,
        );
    }
    join(&mut r, 3, WorkerRole::Aggregated, 2_000, &[]);
    // Worker 3 is empty but counts as loaded as the others while it warms up.
    let plan = r.route(&input(10, &tokens, &hashes), &[], 2_100).unwrap();
    let terms = plan.decision.decode.explain;
    let w3 = terms.iter().find(|t| t.worker == WorkerId(3)).unwrap();
    assert_eq!(w3.active_requests, 2);
    // After its warm-up it is seen as it is.
    r.finish(plan.flight, 2_100);
    let plan = r.route(&input(11, &tokens, &hashes), &[], 3_500).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(3));
}

#[test]
fn peers_moves_count_and_our_echo_does_not() {
    let (tokens, hashes) = prompt(256, 7);
    let mut a = replica(kv_only());
    let mut b = RoutingReplica::new(ReplicaConfig {
        router_id: RouterId(2),
        seed: 1,
        routing: kv_only(),
    })
    .unwrap();
    for r in [&mut a, &mut b] {
        join(r, 1, WorkerRole::Aggregated, 0, &[]);
    }
    let plan = a.route(&input(1, &tokens, &hashes), &[], 1).unwrap();
    for m in &plan.sync {
        a.apply(Input::PeerSync(m), 1).unwrap();
        b.apply(Input::PeerSync(m), 1).unwrap();
    }
    assert_eq!(a.tracker().load(WorkerId(1)).active_requests, 1);
    assert_eq!(b.tracker().load(WorkerId(1)).active_requests, 1);
    for m in a.finish(plan.flight, 2) {
        b.apply(Input::PeerSync(&m), 2).unwrap();
    }
    assert_eq!(b.tracker().load(WorkerId(1)).active_requests, 0);
}

#[test]
fn capacity_weights_come_from_load_reports() {
    let mut cfg = kv_only();
    cfg.pool.warmup_ms = 0;
    cfg.capacity.enabled = true;
    let mut r = replica(cfg);
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    join(&mut r, 2, WorkerRole::Aggregated, 0, &[]);
    join(&mut r, 3, WorkerRole::Aggregated, 0, &[]);
    // Workers 1 and 2 compute 1 token per busy µs, worker 3 three.
    for (w, speed) in [(1u64, 1u64), (2, 1), (3, 3)] {
        for (tokens, busy) in [(0, 1), (1_000_000 * speed, 1_000_001)] {
            let report = LoadReport {
                worker_id: WorkerId(w),
                prefill_tokens_total: tokens,
                busy_us_total: busy,
                ..LoadReport::default()
            };
            r.apply(Input::LoadReport(&report), 1).unwrap();
        }
    }
    // Four 32-block prompts, nothing cached; each routed one adds 32 prefill blocks and 33
    // decode blocks (prompt + 16 output tokens) to its worker. Cost of a fresh worker: 32.
    // Worker 3 after k of them: (32 + 65k) / 3 — 10.7 (k = 0) wins, 32.3 (k = 1) loses to the
    // empty workers 1 and 2, and once they hold one each (32 + 65 = 97) wins again.
    let mut picks = Vec::new();
    for i in 0..4 {
        let (t, h) = prompt(32 * BS, 10 + i);
        let plan = r.route(&input(100 + i as u64, &t, &h), &[], 10).unwrap();
        picks.push(plan.decode_worker().0);
        let chosen = plan.decision.decode.chosen_terms().unwrap();
        assert_eq!(
            chosen.speed,
            if chosen.worker == WorkerId(3) {
                3.0
            } else {
                1.0
            }
        );
        let want = [32.0 / 3.0, 32.0, 32.0, 97.0 / 3.0][i as usize];
        assert!((chosen.cost - want).abs() < 1e-9, "{chosen:?}");
    }
    assert_eq!(picks[0], 3, "{picks:?}");
    assert_eq!(&picks[3..], &[3], "{picks:?}");
    let mut middle = picks[1..3].to_vec();
    middle.sort_unstable();
    assert_eq!(middle, [1, 2], "{picks:?}");
}

#[test]
fn a_peers_add_for_a_worker_that_left_is_not_load() {
    let (_, hashes) = prompt(8 * BS, 3);
    let mut r = replica(kv_only());
    join(&mut r, 1, WorkerRole::Aggregated, 0, &[]);
    let add = |request: u64, worker: u64| SyncMessage::Add {
        router: RouterId(9),
        request: RequestId(request),
        worker: WorkerId(worker),
        blocks: hashes.clone(),
        prefill_tokens: 128,
        private_blocks: 2,
    };
    r.apply(Input::PeerSync(&add(1, 1)), 1).unwrap();
    assert_eq!(r.tracker().load(WorkerId(1)).active_requests, 1);
    // Worker 1 leaves; a late Add for it, and one for a worker never seen, change nothing.
    r.apply(
        Input::Left {
            worker: WorkerId(1),
        },
        2,
    )
    .unwrap();
    r.apply(Input::PeerSync(&add(2, 1)), 3).unwrap();
    r.apply(Input::PeerSync(&add(3, 7)), 3).unwrap();
    assert_eq!(r.tracker().load(WorkerId(1)).active_requests, 0);
    assert_eq!(r.tracker().load(WorkerId(7)).active_requests, 0);
    // It rejoins under the same id: it starts with no phantom load.
    join(&mut r, 1, WorkerRole::Aggregated, 4, &[]);
    assert_eq!(r.tracker().load(WorkerId(1)).active_requests, 0);
}

/// A worker is one record in its pool: a leave takes all the replica kept of it (its report,
/// placement, breaker, tracked load, index entries), and a re-join keeps what outlives a
/// restart (when it first joined, its latest report, where it runs) and forgets the rest.
#[test]
fn a_leave_takes_everything_a_rejoin_keeps_the_record() {
    let mut r = replica(kv_only());
    let (tokens, hashes) = prompt(8 * BS, 1);
    join(&mut r, 1, WorkerRole::Decode, 0, &hashes);
    join(&mut r, 2, WorkerRole::Decode, 0, &[]);
    let report = LoadReport {
        worker_id: WorkerId(1),
        kv_total_blocks: 100,
        ..LoadReport::default()
    };
    r.apply(Input::LoadReport(&report), 1).unwrap();
    let here = tandem_protocol::Placement::here("h1", "r1");
    let placed = Input::Placed {
        worker: WorkerId(1),
        placement: &here,
    };
    r.apply(placed, 1).unwrap();
    let plan = r.route(&input(7, &tokens, &hashes), &[], 2).unwrap();
    assert_eq!(plan.decode_worker(), WorkerId(1), "it holds the prompt");
    for _ in 0..20 {
        r.worker_failed(WorkerId(1), 2);
    }
    assert_ne!(r.breaker(WorkerId(1), 2), crate::BreakerState::Closed);
    // A re-join (a restart): the record stays, the process's state goes.
    let rejoin = Input::Joined {
        worker: WorkerId(1),
        role: WorkerRole::Decode,
        kv: KvSource::Events,
        device_blocks: 0,
    };
    r.apply(rejoin.clone(), 3).unwrap();
    assert_eq!(r.report(WorkerId(1)), Some(&report));
    assert_eq!(r.breaker(WorkerId(1), 3), crate::BreakerState::Closed);
    // A leave: nothing of it is left.
    r.apply(
        Input::Left {
            worker: WorkerId(1),
        },
        4,
    )
    .unwrap();
    assert_eq!(r.report(WorkerId(1)), None);
    assert_eq!(r.kv_source(WorkerId(1)), None);
    assert_eq!(r.decode_workers().collect::<Vec<_>>(), vec![WorkerId(2)]);
    assert!(r.feed().find_matches(&hashes).iter().next().is_none());
    assert_eq!(
        r.tracker()
            .load(WorkerId(1))
            .to_worker_load()
            .active_requests,
        0
    );
    // Back under the same id: a new record, no report until one comes.
    r.apply(rejoin, 5).unwrap();
    assert_eq!(r.report(WorkerId(1)), None);
    r.finish(plan.flight, 6);
}
