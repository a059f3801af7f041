use tandem_protocol::{LoadReport, WorkerId};

use super::{loaded, req, tiers, view};
use crate::{
    PolicyConfig, PolicyKind, PoolConfig, Rng, Router, RouterConfig, WorkerLoad, prepare_candidates,
};

fn router(kind: PolicyKind, pool: PoolConfig) -> Router {
    Router::new(RouterConfig {
        policy: PolicyConfig::new(kind),
        pool,
    })
    .unwrap()
}

#[test]
fn a_warming_worker_counts_as_the_median_load() {
    let mut ws = vec![loaded(1, 2), loaded(2, 5), loaded(3, 9), loaded(4, 0)];
    ws[3].warming_up = true;
    let c = prepare_candidates(&PoolConfig::default(), &ws);
    assert_eq!(c.views[3].load.active_requests, 5);
    // Least-loaded now prefers the real idle-ish worker over the empty newcomer.
    let mut r = router(PolicyKind::LeastLoaded, PoolConfig::default());
    for s in 0..20 {
        let d = r
            .select(&req(16, 16), &ws, &mut Rng::seed_from_u64(s))
            .unwrap();
        assert_eq!(d.worker, WorkerId(1));
        assert_eq!(
            d.explain[3].active_requests, 5,
            "explain shows the lifted load"
        );
    }
    // Even count: the lower median. A warming worker busier than the median keeps its load.
    let mut ws = vec![loaded(1, 2), loaded(2, 6), loaded(3, 0), loaded(4, 9)];
    ws[2].warming_up = true;
    ws[3].warming_up = true;
    let c = prepare_candidates(&PoolConfig::default(), &ws);
    assert_eq!(c.views[2].load.active_requests, 2);
    assert_eq!(c.views[3].load.active_requests, 9);
    // Nobody to take a median of: loads stay as they are.
    let mut ws = vec![loaded(1, 3)];
    ws[0].warming_up = true;
    assert_eq!(
        prepare_candidates(&PoolConfig::default(), &ws).views[0]
            .load
            .active_requests,
        3
    );
}

#[test]
fn the_warm_up_lifts_every_kv_load_term() {
    let mut ws = vec![
        view(1, tiers(0, 0, 0), 160, 10, 1),
        view(2, tiers(0, 0, 0), 0, 0, 0),
    ];
    ws[1].warming_up = true;
    let mut r = router(PolicyKind::Kv, PoolConfig::default());
    let d = r
        .select(&req(16, 16), &ws, &mut Rng::seed_from_u64(0))
        .unwrap();
    // Equal costs after lifting: a tie, not a preference for the empty newcomer.
    assert_eq!(d.explain[0].cost, d.explain[1].cost);
    let cfg = PoolConfig {
        warmup_ms: 1000,
        ..PoolConfig::default()
    };
    assert!(cfg.is_warming_up(5_000, 5_999));
    assert!(!cfg.is_warming_up(5_000, 6_000));
    assert!(
        cfg.is_warming_up(5_000, 4_000),
        "a clock behind the join is still warm-up"
    );
}

#[test]
fn busy_workers_are_skipped_while_others_are_free() {
    let pool = PoolConfig {
        busy_kv_usage: Some(0.9),
        busy_prefill_tokens: Some(1000),
        ..PoolConfig::default()
    };
    let mut ws = vec![loaded(1, 0), loaded(2, 5), loaded(3, 7)];
    ws[0].load.kv_usage = 0.95;
    ws[1].load.active_prefill_tokens = 1001;
    let c = prepare_candidates(&pool, &ws);
    assert_eq!(c.excluded_busy, [WorkerId(1), WorkerId(2)]);
    let mut r = router(PolicyKind::LeastLoaded, pool);
    let d = r
        .select(&req(16, 16), &ws, &mut Rng::seed_from_u64(0))
        .unwrap();
    assert_eq!(d.worker, WorkerId(3));
    assert_eq!(d.excluded_busy, [WorkerId(1), WorkerId(2)]);
    // Everyone busy: everyone stays.
    ws[2].load.kv_usage = 1.0;
    let c = prepare_candidates(&pool, &ws);
    assert!(c.excluded_busy.is_empty());
    assert_eq!(c.views.len(), 3);
    let d = r
        .select(&req(16, 16), &ws, &mut Rng::seed_from_u64(0))
        .unwrap();
    assert_eq!(d.worker, WorkerId(1));
    // At the threshold is not over it.
    assert!(!pool.is_busy(&WorkerLoad {
        kv_usage: 0.9,
        active_prefill_tokens: 1000,
        ..WorkerLoad::default()
    }));
}

#[test]
fn a_load_report_can_only_raise_the_tracked_load() {
    let mut l = WorkerLoad {
        active_prefill_tokens: 500,
        potential_decode_blocks: 10,
        active_requests: 3,
        kv_usage: 0.0,
    };
    l.merge_report(&LoadReport {
        worker_id: WorkerId(1),
        timestamp_ms: 0,
        running_requests: 2,
        waiting_requests: 4,
        pending_prefill_tokens: 100,
        kv_active_blocks: 50,
        kv_total_blocks: 100,
        last_kv_event_id: 0,
        ..LoadReport::default()
    });
    assert_eq!(l.active_prefill_tokens, 500);
    assert_eq!(l.active_requests, 6);
    assert_eq!(l.potential_decode_blocks, 50);
    assert_eq!(l.kv_usage, 0.5);
}
