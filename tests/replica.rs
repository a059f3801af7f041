//! "The simulator runs the production router", checked: the routing replica as the frontend
//! configures it (`BackendConfig::replica_config`, what `run_frontend` builds) and as
//! `tandem sim` configures it (`SimConfig::replica_config`, what every simulated router
//! builds) is one configuration, and one request sequence — workers joining, KV events, load
//! reports, arrivals with first tokens and finishes, remote prefills, a retry that excludes a
//! worker, a worker leaving, a peer's sync messages — gets identical decisions from both.

use tandem_frontend::BackendConfig;
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{
    BlockSize, HashSeed, KvDump, KvEvent, KvEventKind, LoadReport, LocalBlockHash, RequestId,
    SequenceHash, StorageTier, StoredBlock, WorkerId, WorkerRole,
};
use tandem_router::{
    DisaggMode, InFlight, Input, KvSource, Plan, PolicyConfig, PolicyKind, RepairReply, RouteInput,
    RouteRequest, RouterId, RoutingConfig, RoutingReplica, SyncMessage,
};
use tandem_sim::{SimConfig, SyntheticConfig};

const BS: BlockSize = BlockSize::DEFAULT;

/// The two replicas for one routing configuration, after checking the configurations agree.
fn pair(routing: RoutingConfig) -> (RoutingReplica, RoutingReplica) {
    let mut sim = SimConfig::synthetic(4, SyntheticConfig::default());
    sim.seed = 17;
    sim.routing = routing;
    sim.validate().expect("a valid simulation");
    let as_sim = sim.replica_config(0);
    // A frontend replica with the simulated router's identity and seed.
    let mut backend = BackendConfig::new(as_sim.router_id);
    backend.seed = as_sim.seed;
    backend.routing = routing;
    let as_frontend = backend.replica_config();
    assert_eq!(
        as_frontend, as_sim,
        "the frontend and the simulator configure routing alike"
    );
    (
        RoutingReplica::new(as_frontend).expect("frontend replica"),
        RoutingReplica::new(as_sim).expect("simulated replica"),
    )
}

/// One step of the sequence, and what a replica answered.
#[derive(Debug, PartialEq)]
enum Answer {
    Repairs(Vec<(WorkerId, u64, bool)>),
    Plan(Box<Plan>),
    Refused(String),
    Sync(Vec<SyncMessage>),
}

fn stored(worker: u64, event_id: u64, hashes: &[SequenceHash]) -> KvEvent {
    KvEvent {
        worker_id: WorkerId(worker),
        event_id,
        tier: StorageTier::Device,
        kind: KvEventKind::Stored {
            parent: None,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    sequence_hash: h,
                    local_hash: LocalBlockHash(h.0),
                })
                .collect(),
        },
    }
}

fn prompt(blocks: u32, family: u32, tail: u32) -> (Vec<u32>, Vec<SequenceHash>) {
    let mut tokens: Vec<u32> = (0..blocks * 16).map(|i| i + family * 1_000_000).collect();
    tokens.extend((0..tail).map(|i| 900_000_000 + i));
    let hashes = compute_block_hashes(&tokens, BS, HashSeed::UNSALTED)
        .iter()
        .map(|h| h.sequence)
        .collect();
    (tokens, hashes)
}

/// Drives `r` through the sequence; returns every answer in order.
fn drive(r: &mut RoutingReplica) -> Vec<Answer> {
    let mut out = Vec::new();
    let apply = |r: &mut RoutingReplica, input: Input<'_>, now: u64, out: &mut Vec<Answer>| {
        let repairs = r.apply(input, now).expect("input applied");
        out.push(Answer::Repairs(
            repairs
                .iter()
                .map(|x| (x.worker, x.after, x.dump))
                .collect(),
        ));
        repairs
    };
    // Three decode workers and two prefill workers join; each is dumped (empty).
    for (w, role) in [
        (1, WorkerRole::Decode),
        (2, WorkerRole::Decode),
        (3, WorkerRole::Decode),
        (8, WorkerRole::Prefill),
        (9, WorkerRole::Prefill),
    ] {
        let worker = WorkerId(w);
        for rep in apply(
            r,
            Input::Joined {
                worker,
                role,
                kv: KvSource::Events,
                device_blocks: 0,
            },
            0,
            &mut out,
        ) {
            let dump = KvDump {
                worker_id: rep.worker,
                last_event_id: 0,
                events: vec![],
            };
            let reply = RepairReply::Dump(dump);
            apply(r, Input::Repaired { worker, reply }, 0, &mut out);
        }
    }
    let (short_t, short_h) = prompt(8, 1, 5);
    let (long_t, long_h) = prompt(300, 2, 0);
    // Worker 2 caches the long prompt's first 200 blocks; prefill worker 9 all of it.
    apply(
        r,
        Input::KvEvents(&[stored(2, 1, &long_h[..200])]),
        5,
        &mut out,
    );
    apply(r, Input::KvEvents(&[stored(9, 1, &long_h)]), 5, &mut out);
    // Worker 3's event 3 arrives without event 2: a repair is asked, events dropped meanwhile.
    apply(
        r,
        Input::KvEvents(&[stored(3, 1, &short_h[..4])]),
        6,
        &mut out,
    );
    apply(r, Input::KvEvents(&[stored(3, 3, &short_h)]), 6, &mut out);
    let report = LoadReport {
        worker_id: WorkerId(1),
        running_requests: 3,
        waiting_requests: 2,
        pending_prefill_tokens: 9000,
        kv_active_blocks: 700,
        kv_total_blocks: 1000,
        last_kv_event_id: 0,
        timestamp_ms: 7,
        ..LoadReport::default()
    };
    apply(r, Input::LoadReport(&report), 7, &mut out);

    let mut flights: Vec<InFlight> = Vec::new();
    let mut next_id = 1u64;
    let mut route = |r: &mut RoutingReplica,
                     tokens: &[u32],
                     hashes: &[SequenceHash],
                     excluded: &[WorkerId],
                     now: u64,
                     out: &mut Vec<Answer>|
     -> Option<InFlight> {
        let input = RouteInput {
            request: RequestId(next_id),
            route: RouteRequest::from_tokens(tokens, BS, HashSeed::UNSALTED),
            hashes,
            expected_output_tokens: 64,
            overlap: None,
            session: None,
        };
        next_id += 1;
        match r.route(&input, excluded, now) {
            Ok(plan) => {
                let flight = plan.flight;
                out.push(Answer::Plan(Box::new(plan)));
                Some(flight)
            }
            Err(e) => {
                out.push(Answer::Refused(e.to_string()));
                None
            }
        }
    };
    for k in 0..12u64 {
        let (t, h) = if k % 3 == 0 {
            (&long_t, &long_h)
        } else {
            (&short_t, &short_h)
        };
        flights.extend(route(r, t, h, &[], 10 + k, &mut out));
    }
    // A retry after worker 2 failed the request; then every decode worker excluded.
    flights.extend(route(r, &long_t, &long_h, &[WorkerId(2)], 30, &mut out));
    let all = [WorkerId(1), WorkerId(2), WorkerId(3)];
    flights.extend(route(r, &short_t, &short_h, &all, 31, &mut out));
    // First tokens for half, ends for a third.
    for (i, f) in flights.iter_mut().enumerate() {
        if i % 2 == 0 {
            out.push(Answer::Sync(r.first_token(f, 40 + i as u64)));
        }
    }
    for f in flights.drain(..).step_by(3) {
        out.push(Answer::Sync(r.finish(f, 60)));
    }
    // A peer routed to worker 3; worker 1 leaves; routing goes on.
    let peer = SyncMessage::Add {
        router: RouterId(99),
        request: RequestId(5),
        worker: WorkerId(3),
        blocks: short_h.clone(),
        prefill_tokens: 5000,
        private_blocks: 4,
    };
    apply(r, Input::PeerSync(&peer), 70, &mut out);
    apply(
        r,
        Input::Left {
            worker: WorkerId(1),
        },
        71,
        &mut out,
    );
    for k in 0..6u64 {
        route(r, &long_t, &long_h, &[], 80 + k, &mut out);
    }
    out
}

#[test]
fn frontend_and_simulator_replicas_decide_alike() {
    let mut routings = Vec::new();
    for kind in PolicyKind::ALL {
        routings.push(RoutingConfig {
            policy: PolicyConfig::new(kind),
            ..RoutingConfig::default()
        });
    }
    for mode in DisaggMode::ALL {
        let mut r = RoutingConfig::default();
        r.disagg.mode = mode;
        routings.push(r);
    }
    let mut warm = RoutingConfig {
        merge_load_reports: true,
        ..RoutingConfig::default()
    };
    warm.pool.warmup_ms = 0;
    warm.disagg.decode_pool.warmup_ms = 0;
    warm.disagg.decode_pool.busy_kv_usage = Some(0.5);
    warm.policy.kv.temperature = 0.7;
    routings.push(warm);

    for routing in routings {
        let (mut frontend, mut sim) = pair(routing);
        let (a, b) = (drive(&mut frontend), drive(&mut sim));
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x, y, "step {i} differs under {routing:?}");
        }
        let plans = a.iter().filter(|x| matches!(x, Answer::Plan(_))).count();
        assert!(plans >= 18, "the sequence routes ({plans} plans)");
    }
}

#[test]
fn the_sequence_exercises_both_pools_and_both_refusals() {
    // The sequence is only worth comparing if it reaches the paths that could differ.
    let mut r = RoutingConfig::default();
    r.disagg.mode = DisaggMode::IslBounding;
    let (mut frontend, _) = pair(r);
    let answers = drive(&mut frontend);
    let plans: Vec<&Plan> = answers
        .iter()
        .filter_map(|x| match x {
            Answer::Plan(p) => Some(&**p),
            _ => None,
        })
        .collect();
    assert!(
        plans.iter().any(|p| p.prefill_worker().is_some()),
        "a remote prefill"
    );
    assert!(
        plans.iter().any(|p| p.prefill_worker().is_none()),
        "a local prefill"
    );
    assert!(
        answers
            .iter()
            .any(|x| matches!(x, Answer::Refused(m) if m.contains("every worker")))
    );
    assert!(
        answers
            .iter()
            .any(|x| matches!(x, Answer::Repairs(r) if r.iter().any(|&(w, after, dump)| w == WorkerId(3) && after == 1 && !dump))),
        "the gap asks for a range"
    );
    // After worker 1 left, nothing goes to it.
    let last: Vec<WorkerId> = plans
        .iter()
        .rev()
        .take(6)
        .map(|p| p.decode_worker())
        .collect();
    assert!(!last.contains(&WorkerId(1)), "{last:?}");
}
