//! LoRA-aware routing: the adapter table's fits, the `kv` term by hand, and the replica
//! gathering an adapter's requests.

use tandem_protocol::{AdapterId, AdapterLoad, LoadReport, WorkerId, WorkerRole};

use super::replica::{BS, input, join, kv_only, prompt, replica};
use super::{close, loaded, req};
use crate::kv::kv_terms;
use crate::{AdapterConfig, AdapterFit, Adapters, Input, KvConfig, RoutingConfig};

const A: &str = "sql-lora";
const B: &str = "chat-lora";

fn load(max: u32, resident: &[&str]) -> AdapterLoad {
    AdapterLoad {
        max_loaded: max,
        resident: resident.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn fits_follow_reports_flights_and_slots() {
    let (a, b, c) = (AdapterId::of(A), AdapterId::of(B), AdapterId::of("other"));
    let w = WorkerId(1);
    let mut t = Adapters::new(AdapterConfig {
        ttl_ms: 1_000,
        ..AdapterConfig::default()
    });
    // No adapter: always resident. Unknown worker: loadable.
    assert_eq!(t.fit(w, None, 0), AdapterFit::Resident);
    assert_eq!(t.fit(w, Some(a), 0), AdapterFit::Loadable);
    // Two slots, `a` reported resident: `a` resident, `b` loadable.
    t.report(w, &load(2, &[A]));
    assert_eq!(t.fit(w, Some(a), 0), AdapterFit::Resident);
    assert_eq!(t.fit(w, Some(b), 0), AdapterFit::Loadable);
    // A request on `b` starts there: `b` resident, `a` still (2 slots), and `c` would have
    // to evict the idle `a`.
    t.start(w, b, 100);
    assert_eq!(t.fit(w, Some(b), 100), AdapterFit::Resident);
    assert_eq!(t.fit(w, Some(a), 100), AdapterFit::Resident);
    assert_eq!(t.fit(w, Some(c), 100), AdapterFit::Evicts);
    // One on `c` too: both slots are in use by requests in flight, `a` is out, and any
    // other adapter finds the worker full.
    t.start(w, c, 200);
    assert_eq!(t.fit(w, Some(a), 200), AdapterFit::Full);
    assert_eq!(t.fit(w, Some(c), 200), AdapterFit::Resident);
    // `b`'s request ends: its slot can be had by evicting it; `b` (used at 300) and `c` are
    // the likely two.
    t.end(w, b, 300);
    assert_eq!(t.fit(w, Some(b), 300), AdapterFit::Resident);
    assert_eq!(t.fit(w, Some(a), 300), AdapterFit::Evicts);
    // Past the TTL `b` only counts if reported; a new report says `a` and `b`, with `c`
    // still in flight: `c` first, then the report's `a` fills the second slot.
    t.report(w, &load(2, &[A, B]));
    assert_eq!(t.fit(w, Some(c), 1_400), AdapterFit::Resident);
    assert_eq!(t.fit(w, Some(a), 1_400), AdapterFit::Resident);
    assert_eq!(t.fit(w, Some(b), 1_400), AdapterFit::Evicts);
    // No slot count reported: never full, nothing capped.
    t.report(w, &load(0, &[A, B]));
    assert_eq!(t.fit(w, Some(b), 1_400), AdapterFit::Resident);
    assert_eq!(
        t.fit(w, Some(AdapterId::of("new")), 1_400),
        AdapterFit::Loadable
    );
    // Gone: unknown again, and a late end is ignored.
    t.remove(w);
    t.end(w, c, 1_500);
    assert_eq!(t.fit(w, Some(c), 1_500), AdapterFit::Loadable);
    // The cost of each fit.
    let cfg = AdapterConfig::default();
    assert_eq!(cfg.cost(AdapterFit::Resident), 0.0);
    assert_eq!(cfg.cost(AdapterFit::Loadable), 96.0);
    assert_eq!(cfg.cost(AdapterFit::Evicts), 144.0);
    assert_eq!(cfg.cost(AdapterFit::Full), 224.0);
    assert!(
        AdapterConfig {
            load_cost: -1.0,
            ..cfg
        }
        .validate()
        .is_err()
    );
}

#[test]
fn the_kv_cost_adds_the_adapter_term_after_the_speed() {
    // 10 prompt blocks, no load: cost = s·10 + adapter. Speed 2 halves only the load part.
    let r = req(160, 16);
    let mut v = vec![loaded(1, 0), loaded(2, 0)];
    v[1].speed = 2.0;
    v[0].adapter_cost = 32.0;
    v[1].adapter_cost = 160.0;
    let t = kv_terms(&KvConfig::dynamo(), &r, &v);
    assert!(close(t[0].cost, 10.0 + 32.0), "{}", t[0].cost);
    assert!(close(t[1].cost, 10.0 / 2.0 + 160.0), "{}", t[1].cost);
    assert!(close(t[0].adapter, 32.0) && close(t[1].adapter, 160.0));
}

fn routing() -> RoutingConfig {
    let mut r = kv_only();
    r.pool.warmup_ms = 0;
    r.sessions.enabled = false;
    r.adapters.load_cost = 32.0;
    r.adapters.full_cost = 128.0;
    r
}

fn report(worker: u64, adapters: AdapterLoad) -> LoadReport {
    LoadReport {
        worker_id: WorkerId(worker),
        adapters,
        ..LoadReport::default()
    }
}

#[test]
fn requests_gather_where_their_adapter_is() {
    // Each request: 8 prompt blocks to prefill and 9 decode blocks booked, so a worker with
    // n of them costs 8 + 17·n for the next; a load costs 32: an adapter's requests gather
    // on its worker until it has two more than an idle one.
    let mut r = replica(routing());
    for w in 1..=4 {
        join(&mut r, w, WorkerRole::Aggregated, 0, &[]);
    }
    // Worker 3 holds adapter A; each holds one at most.
    for w in [1, 2, 4] {
        r.apply(Input::LoadReport(&report(w, load(1, &[]))), 0)
            .unwrap();
    }
    r.apply(Input::LoadReport(&report(3, load(1, &[A]))), 0)
        .unwrap();
    let on = |id: u64, salt: u32, adapter: &str, r: &mut crate::RoutingReplica, now: u64| {
        let (tokens, hashes) = prompt(8 * BS, salt);
        let mut inp = input(id, &tokens, &hashes);
        inp.route.adapter = Some(AdapterId::of(adapter));
        r.route(&inp, &[], now).unwrap()
    };
    for i in 0..2 {
        let plan = on(u64::from(i) + 1, 10 + i, A, &mut r, 10);
        assert_eq!(plan.decode_worker(), WorkerId(3), "request {i}");
        assert_eq!(plan.decision.decode.chosen_terms().unwrap().adapter, 0.0);
    }
    // The third: 8 + 34 on 3 against 8 + 32 elsewhere. The load wins; A is loaded there.
    let plan = on(3, 12, A, &mut r, 10);
    let a_second = plan.decode_worker();
    assert_ne!(a_second, WorkerId(3));
    assert_eq!(plan.decision.decode.chosen_terms().unwrap().adapter, 32.0);
    // A prompt on B goes to a worker whose one slot is free, not to those A holds…
    let plan = on(4, 20, B, &mut r, 20);
    let b_worker = plan.decode_worker();
    assert!(![WorkerId(3), a_second].contains(&b_worker));
    let explain = &plan.decision.decode.explain;
    for full in [WorkerId(3), a_second] {
        let t = explain.iter().find(|t| t.worker == full).unwrap();
        assert_eq!(t.adapter, 32.0 + 128.0, "every slot of {full} is taken");
    }
    // …and the next one on B follows it there, loaded as it is (25 against 40): B was routed
    // to it before any report said so.
    let plan = on(5, 21, B, &mut r, 30);
    assert_eq!(plan.decode_worker(), b_worker);
    // The base model sees no adapter term: it goes to the one idle worker.
    let (tokens, hashes) = prompt(8 * BS, 22);
    let plan = r.route(&input(12, &tokens, &hashes), &[], 40).unwrap();
    assert!(![WorkerId(3), a_second, b_worker].contains(&plan.decode_worker()));
    assert!(
        plan.decision
            .decode
            .explain
            .iter()
            .all(|t| t.adapter == 0.0)
    );
    // Load costs nothing when the knob is 0: A's requests spread like any other.
    let mut cfg = routing();
    cfg.adapters.load_cost = 0.0;
    cfg.adapters.full_cost = 0.0;
    let mut r = replica(cfg);
    for w in 1..=3 {
        join(&mut r, w, WorkerRole::Aggregated, 0, &[]);
    }
    r.apply(Input::LoadReport(&report(3, load(1, &[A]))), 0)
        .unwrap();
    let mut chosen = std::collections::BTreeSet::new();
    for i in 0..3 {
        let (tokens, hashes) = prompt(8 * BS, 30 + i);
        let mut inp = input(u64::from(i) + 1, &tokens, &hashes);
        inp.route.adapter = Some(AdapterId::of(A));
        chosen.insert(r.route(&inp, &[], 10).unwrap().decode_worker());
    }
    assert_eq!(chosen.len(), 3);
    // A worker that leaves takes its adapters with it.
    r.apply(
        Input::Left {
            worker: WorkerId(3),
        },
        50,
    )
    .unwrap();
    assert_eq!(
        r.adapters().fit(WorkerId(3), Some(AdapterId::of(A)), 50),
        AdapterFit::Loadable
    );
    join(&mut r, 3, WorkerRole::Aggregated, 60, &[]);
    assert_eq!(
        r.adapters().fit(WorkerId(3), Some(AdapterId::of(A)), 60),
        AdapterFit::Loadable
    );
}
