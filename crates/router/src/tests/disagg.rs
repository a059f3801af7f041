use tandem_protocol::{Distance, WorkerId};

use super::{req, tiers, view};
use crate::disagg::{decide, effective_prompt_tokens};
use crate::{
    ConfigError, DisaggConfig, DisaggDecision, DisaggMode, DisaggReason, KvConfig, Rng, RouteError,
    RouteRequest, WorkerView,
};

/// `mode` with both pools scored by Dynamo's configuration (prefill and decode blocks weighed
/// alike), the costs these tests spell out.
fn dynamo(mode: DisaggMode) -> DisaggConfig {
    DisaggConfig {
        mode,
        decode_kv: KvConfig::dynamo(),
        prefill_kv: KvConfig::dynamo(),
        ..DisaggConfig::default()
    }
}

fn run(mode: DisaggMode, r: &RouteRequest, d: &[WorkerView], p: &[WorkerView]) -> DisaggDecision {
    let cfg = dynamo(mode);
    cfg.validate().unwrap();
    decide(&cfg, r, d, p, &near, &mut Rng::seed_from_u64(5)).unwrap()
}

/// Every pair of workers in one process: transfers cost nothing, only the rule counts.
fn near(_: WorkerId, _: WorkerId) -> Distance {
    Distance::SameProcess
}

fn idle(id: u64) -> WorkerView {
    view(id, tiers(0, 0, 0), 0, 0, 0)
}

/// A prefill worker with `backlog` pending prefill tokens.
fn prefill(id: u64, backlog: u64) -> WorkerView {
    view(id, tiers(0, 0, 0), backlog, 0, 0)
}

#[test]
fn modes_parse_by_name() {
    for m in DisaggMode::ALL {
        assert_eq!(m.name().parse::<DisaggMode>().unwrap(), m);
    }
    assert_eq!(DisaggMode::default(), DisaggMode::IslBounding);
    let e = "sometimes".parse::<DisaggMode>().unwrap_err();
    assert!(matches!(e, ConfigError::UnknownDisaggMode { .. }));
    assert!(
        e.to_string()
            .contains("isl-bounding, prefill-load, isl-or-load, always, never")
    );
}

#[test]
fn no_prefill_pool_or_never_means_local() {
    let r = req(10_000, 16);
    for mode in DisaggMode::ALL {
        let d = run(mode, &r, &[idle(1)], &[]);
        assert_eq!(d.why, DisaggReason::NoPrefillPool);
        assert!(!d.is_remote());
    }
    let d = run(DisaggMode::Never, &r, &[idle(1)], &[prefill(9, 0)]);
    assert_eq!((d.why, d.prefill_worker()), (DisaggReason::Never, None));
    let cfg = DisaggConfig::default();
    let e = decide(
        &cfg,
        &r,
        &[],
        &[prefill(9, 0)],
        &near,
        &mut Rng::seed_from_u64(0),
    )
    .unwrap_err();
    assert_eq!(e, RouteError::NoWorkers);
}

#[test]
fn a_request_that_asks_to_prefill_where_it_decodes_does_in_every_mode() {
    let r = RouteRequest {
        local_prefill: true,
        ..req(10_000, 16)
    };
    for mode in DisaggMode::ALL {
        let d = run(mode, &r, &[idle(1)], &[prefill(9, 0)]);
        assert!(!d.is_remote(), "{mode:?}");
        assert_eq!(d.why, DisaggReason::LocalOnly, "{mode:?}");
    }
    // Not asked: the same prompt goes remote under `always`.
    let d = run(
        DisaggMode::Always,
        &req(10_000, 16),
        &[idle(1)],
        &[prefill(9, 0)],
    );
    assert!(d.is_remote());
}

#[test]
fn always_picks_decode_on_load_alone_and_prefill_by_overlap() {
    // 4096-token prompt = 256 blocks. D1 caches it all but has 5 decode blocks; D2 is empty.
    let decode = [view(1, tiers(256, 0, 0), 0, 5, 0), idle(2)];
    let pool = [prefill(8, 0), view(9, tiers(200, 40, 16), 0, 0, 0)];
    let mut r = req(4096, 16);
    r.overrides.overlap_credit = Some(1.0); // ignored for D under `always`
    let d = run(DisaggMode::Always, &r, &decode, &pool);
    assert_eq!(d.why, DisaggReason::Always);
    assert_eq!(d.decode_worker(), WorkerId(2));
    assert_eq!(d.decode.explain[0].credit, 0.0);
    assert_eq!(d.decode.explain[0].cost, 256.0 + 5.0);
    assert_eq!(d.decode.explain[1].cost, 256.0);
    // P9: credit 200 + 0.85 × 40 + 0.5 × 16 = 242, cost 14; P8: 256.
    assert_eq!(d.prefill_worker(), Some(WorkerId(9)));
    assert!((d.prefill.as_ref().unwrap().explain[1].cost - 14.0).abs() < 1e-9);
    // The conditional modes use D's cache: D1 wins (cost 5) and prefills locally (all cached).
    let d = run(DisaggMode::IslBounding, &req(4096, 16), &decode, &pool);
    assert_eq!(d.decode_worker(), WorkerId(1));
    assert_eq!(
        d.why,
        DisaggReason::ShortEffectivePrompt {
            effective_tokens: 0
        }
    );
    assert!(!d.is_remote());
}

#[test]
fn isl_bounding_prefills_short_uncached_prompts_locally() {
    let pool = [prefill(9, 0)];
    // Dynamo's rule: 1000 uncached tokens < 2048, local, cached or not.
    let d = run(DisaggMode::IslBounding, &req(1000, 16), &[idle(1)], &pool);
    assert_eq!(
        d.why,
        DisaggReason::ShortEffectivePrompt {
            effective_tokens: 1000
        }
    );
    // A 10-token "Hello" too (it went remote under the old fraction rule).
    let d = run(DisaggMode::IslBounding, &req(10, 16), &[idle(1)], &pool);
    assert!(!d.is_remote(), "{:?}", d.why);
    // 2048 uncached: remote.
    let d = run(DisaggMode::IslBounding, &req(2048, 16), &[idle(1)], &pool);
    assert_eq!(
        d.why,
        DisaggReason::LongEffectivePrompt {
            effective_tokens: 2048
        }
    );
}

#[test]
fn isl_bounding_with_the_fraction_needs_a_short_and_mostly_cached_prompt() {
    let pool = [prefill(9, 0)];
    let run = |r: &RouteRequest, d: &[WorkerView]| {
        let cfg = DisaggConfig {
            isl_max_local_fraction: Some(0.7),
            ..DisaggConfig::default()
        };
        cfg.validate().unwrap();
        decide(&cfg, r, d, &pool, &near, &mut Rng::seed_from_u64(5)).unwrap()
    };
    // 1000 uncached tokens: under 2048 but not under 0.7 × 1000.
    let d = run(&req(1000, 16), &[idle(1)]);
    assert_eq!(
        d.why,
        DisaggReason::LongEffectivePrompt {
            effective_tokens: 1000
        }
    );
    assert_eq!(d.prefill_worker(), Some(WorkerId(9)));
    // 3000 tokens with 125 blocks (2000 tokens) cached: 1000 < 2048 and < 2100.
    let cached = [view(1, tiers(100, 20, 5), 0, 0, 0)];
    let d = run(&req(3000, 16), &cached);
    assert_eq!(
        d.why,
        DisaggReason::ShortEffectivePrompt {
            effective_tokens: 1000
        }
    );
    assert!(!d.is_remote());
    // 10,000 tokens with the same 2000 cached: 8000 uncached.
    let d = run(&req(10_000, 16), &cached);
    assert_eq!(
        d.why,
        DisaggReason::LongEffectivePrompt {
            effective_tokens: 8000
        }
    );
    // Exactly at the bounds is not below them.
    let mut cfg = DisaggConfig::default();
    assert!(!cfg.isl_says_local(2048, 100_000));
    assert!(cfg.isl_says_local(2047, 100_000));
    // Dynamo's rule: a fresh 10-token prompt (nothing cached) prefills on its decode worker.
    assert!(cfg.isl_says_local(10, 10));
    assert!(cfg.isl_says_local(2047, 2047));
    // The opt-in fraction: local only when the decode worker holds more than 30 %.
    cfg.isl_max_local_fraction = Some(0.7);
    assert!(!cfg.isl_says_local(10, 10));
    assert!(!cfg.isl_says_local(70, 100));
    assert!(cfg.isl_says_local(69, 100));
    assert!(!cfg.isl_says_local(2048, 100_000));
    cfg.isl_max_local_fraction = Some(1.5);
    assert!(cfg.validate().is_err());
    cfg.isl_max_local_fraction = Some(f64::NAN);
    assert!(cfg.validate().is_err());
    cfg.isl_max_local_fraction = Some(1.0);
    assert!(cfg.validate().is_ok());
    assert_eq!(effective_prompt_tokens(&req(40, 16), 5), 0);
}

#[test]
fn prefill_load_goes_local_when_the_best_prefill_worker_is_busy() {
    let r = req(1000, 16);
    // The kv pick is P8 (9000 backlog beats 10,000), and 9000 > 8192: local.
    let busy = [prefill(8, 9000), prefill(9, 10_000)];
    let d = run(DisaggMode::PrefillLoad, &r, &[idle(1)], &busy);
    assert_eq!(
        d.why,
        DisaggReason::PrefillBusy {
            backlog_tokens: 9000
        }
    );
    assert!(!d.is_remote());
    // At the threshold: remote.
    let d = run(DisaggMode::PrefillLoad, &r, &[idle(1)], &[prefill(8, 8192)]);
    assert_eq!(
        d.why,
        DisaggReason::PrefillAvailable {
            backlog_tokens: 8192
        }
    );
    assert_eq!(d.prefill_worker(), Some(WorkerId(8)));
    // Short prompts go remote too under prefill-load: only the load counts.
    let d = run(
        DisaggMode::PrefillLoad,
        &req(16, 16),
        &[idle(1)],
        &[prefill(8, 0)],
    );
    assert!(d.is_remote());
}

#[test]
fn isl_or_load_is_local_if_either_rule_says_so() {
    let cached = [view(1, tiers(125, 0, 0), 0, 0, 0)];
    // Length says local (1000 of 3000 uncached) even with an idle prefill pool.
    let d = run(
        DisaggMode::IslOrLoad,
        &req(3000, 16),
        &cached,
        &[prefill(9, 0)],
    );
    assert_eq!(
        d.why,
        DisaggReason::ShortEffectivePrompt {
            effective_tokens: 1000
        }
    );
    // Length says remote, load says local.
    let d = run(
        DisaggMode::IslOrLoad,
        &req(10_000, 16),
        &cached,
        &[prefill(9, 9000)],
    );
    assert_eq!(
        d.why,
        DisaggReason::PrefillBusy {
            backlog_tokens: 9000
        }
    );
    assert!(!d.is_remote());
    // Both say remote.
    let d = run(
        DisaggMode::IslOrLoad,
        &req(10_000, 16),
        &cached,
        &[prefill(9, 100)],
    );
    assert_eq!(
        d.why,
        DisaggReason::LongPromptPrefillAvailable {
            effective_tokens: 8000,
            backlog_tokens: 100
        }
    );
    assert_eq!(d.prefill_worker(), Some(WorkerId(9)));
}

/// `decide` for one request at seed 1 with a distance rule.
fn decide_with(
    cfg: &DisaggConfig,
    tokens: u64,
    decode: &[WorkerView],
    prefill: &[WorkerView],
    distance: &dyn Fn(WorkerId, WorkerId) -> Distance,
) -> DisaggDecision {
    decide(
        cfg,
        &req(tokens, 16),
        decode,
        prefill,
        distance,
        &mut Rng::seed_from_u64(1),
    )
    .unwrap()
}

#[test]
fn the_prefill_choice_counts_the_transfer_to_the_decode_worker() {
    // 1,024-token prompt: 64 blocks, nothing cached on D1. P8 holds 16 of them and sits in
    // another rack (0.5 per moved block); P9 holds none and shares D1's host (0.06).
    // P8: (64 − 16) + 64 × 0.5 = 80; P9: 64 + 64 × 0.06 = 67.84 → P9, though P8 caches more.
    let cfg = dynamo(DisaggMode::Always);
    let pool = [view(8, tiers(16, 0, 0), 0, 0, 0), prefill(9, 0)];
    let distance = |p: WorkerId, _d: WorkerId| {
        if p == WorkerId(9) {
            Distance::SameHost
        } else {
            Distance::Other
        }
    };
    let d = decide_with(&cfg, 1024, &[idle(1)], &pool, &distance);
    let p = d.prefill.as_ref().unwrap();
    assert_eq!(p.worker, WorkerId(9));
    assert!(
        (p.explain[0].cost - 80.0).abs() < 1e-9,
        "{:?}",
        p.explain[0]
    );
    assert!(
        (p.explain[1].cost - 67.84).abs() < 1e-9,
        "{:?}",
        p.explain[1]
    );
    assert!((p.explain[0].transfer - 32.0).abs() < 1e-9);
    // In one process nothing moves: P8's cache wins (48 < 64).
    let d = decide_with(&cfg, 1024, &[idle(1)], &pool, &near);
    assert_eq!(d.prefill_worker(), Some(WorkerId(8)));
}

#[test]
fn compare_local_keeps_a_prefill_on_the_decode_worker_when_that_is_sooner() {
    // 4,096-token prompt (256 blocks), nothing cached: isl-bounding says remote (4096 ≥ 2048).
    // P9 has 4,096 tokens queued (256 blocks) and is in another rack: 256 + 256 + 128 = 640.
    // D1 is idle: 256. With the comparison on, D1 prefills it.
    let pool = [prefill(9, 4096)];
    let mut cfg = DisaggConfig::default();
    let far = |_: WorkerId, _: WorkerId| Distance::Other;
    let d = decide_with(&cfg, 4096, &[idle(1)], &pool, &far);
    assert!(d.is_remote());
    cfg.isl_compare_local = true;
    let d = decide_with(&cfg, 4096, &[idle(1)], &pool, &far);
    assert_eq!(
        d.why,
        DisaggReason::LocalSooner {
            remote_cost: 640.0,
            local_cost: 256.0
        }
    );
    // An idle prefill worker on D's host: 256 + 15.36 > 256 still: local. With D busy (8,192
    // tokens of its own queued: 768), remote wins.
    let near_host = |_: WorkerId, _: WorkerId| Distance::SameHost;
    let d = decide_with(
        &cfg,
        4096,
        &[view(1, tiers(0, 0, 0), 8192, 0, 0)],
        &[prefill(9, 0)],
        &near_host,
    );
    assert!(d.is_remote(), "{:?}", d.why);
}
