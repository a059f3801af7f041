use std::collections::HashMap;

use tandem_protocol::WorkerId;

use super::{close, req, tiers, view};
use crate::kv::{KvConfig, KvPolicy, kv_decide};
use crate::{ErrorClass, Policy, Rng, RouteError, Rule};

fn cost_of(d: &crate::Decision, w: u64) -> f64 {
    d.explain
        .iter()
        .find(|t| t.worker == WorkerId(w))
        .unwrap()
        .cost
}

#[test]
fn tier_credits_match_the_formula() {
    // 64-token prompt, block size 16: 4 blocks.
    let ws = [
        view(1, tiers(4, 0, 0), 0, 10, 0), // raw 4, credit 4    → prefill 0, cost 10
        view(2, tiers(0, 4, 0), 0, 5, 0),  // raw 4, credit 3.4  → prefill 0.6, cost 5.6
        view(3, tiers(0, 0, 4), 0, 2, 0),  // raw 4, credit 2    → prefill 2, cost 4
        view(4, tiers(2, 1, 1), 32, 0, 0), // raw 6, credit 3.35 → prefill 2.65, cost 2.65
        view(5, tiers(0, 0, 0), 32, 0, 0), // raw 6, credit 0    → prefill 6, cost 6
    ];
    let d = kv_decide(
        &KvConfig::dynamo(),
        &req(64, 16),
        &ws,
        &mut Rng::seed_from_u64(1),
    )
    .unwrap();
    // Host blocks count 0.85 of a device block, disk blocks 0.5 (the defaults).
    let want = [
        (1, 4.0, 4.0, 10.0),
        (2, 4.0, 3.4, 5.6),
        (3, 4.0, 2.0, 4.0),
        (4, 6.0, 3.35, 2.65),
        (5, 6.0, 0.0, 6.0),
    ];
    for (t, (w, raw, credit, cost)) in d.explain.iter().zip(want) {
        assert_eq!(t.worker, WorkerId(w));
        assert!(close(t.raw_prefill_blocks, raw), "{t:?}");
        assert!(close(t.credit, credit), "{t:?}");
        assert!(close(t.prefill_blocks, raw - credit), "{t:?}");
        assert!(close(t.cost, cost), "{t:?}");
        assert!(close(t.decay, 1.0));
    }
    assert_eq!(d.worker, WorkerId(4));
    assert_eq!(d.rule, Rule::MinCost);
    assert_eq!(d.chosen_terms().unwrap().probability, Some(1.0));
    assert_eq!(d.explain[0].probability, Some(0.0));
}

#[test]
fn decay_shrinks_the_device_credit_of_a_backlogged_worker() {
    // 4-block prompt; worker 1 holds it all but has 8 blocks of backlog: excess = 8/4 = 2.
    let ws = [
        view(1, tiers(4, 0, 0), 128, 0, 0),
        view(2, tiers(0, 2, 0), 0, 0, 0),
    ];
    let r = req(64, 16);
    let plain = kv_decide(&KvConfig::dynamo(), &r, &ws, &mut Rng::seed_from_u64(1)).unwrap();
    assert!(close(cost_of(&plain, 1), 12.0 - 4.0));
    let cfg = KvConfig {
        decay: 1.0,
        ..KvConfig::dynamo()
    };
    let d = kv_decide(&cfg, &r, &ws, &mut Rng::seed_from_u64(1)).unwrap();
    let t1 = d.explain[0];
    assert!(close(t1.decay, 1.0 / 3.0));
    assert!(close(t1.credit, 4.0 / 3.0));
    assert!(close(t1.cost, 12.0 - 4.0 / 3.0));
    // The least backlogged worker never decays, and host credit never does.
    let t2 = d.explain[1];
    assert!(close(t2.decay, 1.0));
    assert!(close(t2.credit, 1.7));
    assert!(close(t2.cost, 2.3));
    assert_eq!(d.worker, WorkerId(2));
}

#[test]
fn active_request_weight_and_decode_blocks_add_up() {
    let cfg = KvConfig {
        active_request_weight: 2.0,
        ..KvConfig::dynamo()
    };
    // raw (16 + 32) / 16 = 3, credit 1 → 2; + 7 decode blocks + 2 × 3 requests = 15.
    let ws = [
        view(1, tiers(1, 0, 0), 16, 7, 3),
        view(2, tiers(0, 0, 0), 0, 0, 10),
    ];
    let d = kv_decide(&cfg, &req(32, 16), &ws, &mut Rng::seed_from_u64(1)).unwrap();
    assert!(close(cost_of(&d, 1), 15.0));
    assert!(close(cost_of(&d, 2), 2.0 + 20.0));
    assert_eq!(d.worker, WorkerId(1));
}

#[test]
fn overrides_replace_credit_scale_and_temperature() {
    let ws = [
        view(1, tiers(4, 0, 0), 0, 1, 0),
        view(2, tiers(0, 0, 0), 0, 0, 0),
    ];
    let mut r = req(64, 16);
    r.overrides.overlap_credit = Some(0.5);
    r.overrides.prefill_load_scale = Some(2.0);
    let d = kv_decide(&KvConfig::dynamo(), &r, &ws, &mut Rng::seed_from_u64(1)).unwrap();
    // Worker 1: credit 2, prefill 4 − 2 = 2, cost 2·2 + 1 = 5. Worker 2: 2·4 = 8.
    assert!(close(d.explain[0].credit, 2.0));
    assert!(close(cost_of(&d, 1), 5.0));
    assert!(close(cost_of(&d, 2), 8.0));
    // A credit above 1 cannot push the prefill term below zero.
    r.overrides.overlap_credit = Some(2.0);
    let d = kv_decide(&KvConfig::dynamo(), &r, &ws, &mut Rng::seed_from_u64(1)).unwrap();
    assert!(close(d.explain[0].prefill_blocks, 0.0));
    assert!(close(cost_of(&d, 1), 1.0));
    r.overrides.temperature = Some(1.0);
    let d = kv_decide(&KvConfig::dynamo(), &r, &ws, &mut Rng::seed_from_u64(1)).unwrap();
    assert_eq!(d.rule, Rule::Sampled);
    r.overrides.temperature = Some(-1.0);
    let e = kv_decide(&KvConfig::dynamo(), &r, &ws, &mut Rng::seed_from_u64(1)).unwrap_err();
    assert!(matches!(
        e,
        RouteError::InvalidOverride {
            name: "temperature",
            ..
        }
    ));
    assert_eq!(e.class(), ErrorClass::InvalidRequest);
    r.overrides.temperature = Some(f64::NAN);
    assert!(kv_decide(&KvConfig::dynamo(), &r, &ws, &mut Rng::seed_from_u64(1)).is_err());
}

#[test]
fn argmin_breaks_ties_uniformly_and_never_picks_worse() {
    // Workers 1..=3 tie at cost 4 (different ways), worker 4 costs 4.0625.
    let ws = [
        view(1, tiers(0, 0, 0), 0, 0, 0),
        view(2, tiers(2, 0, 0), 0, 2, 0),
        view(3, tiers(0, 0, 0), 0, 0, 5),
        view(4, tiers(0, 0, 0), 1, 0, 0),
    ];
    let mut policy = KvPolicy::new(KvConfig::dynamo()).unwrap();
    let mut counts: HashMap<WorkerId, u32> = HashMap::new();
    for seed in 0..600 {
        let d = policy
            .select(&req(64, 16), &ws, &mut Rng::seed_from_u64(seed))
            .unwrap();
        *counts.entry(d.worker).or_default() += 1;
        let p: Vec<_> = d.explain.iter().map(|t| t.probability.unwrap()).collect();
        assert!(
            p[..3].iter().all(|&x| close(x, 1.0 / 3.0)) && p[3] == 0.0,
            "{p:?}"
        );
    }
    assert_eq!(counts.get(&WorkerId(4)), None);
    for w in 1..=3 {
        let c = counts[&WorkerId(w)];
        assert!(
            (140..260).contains(&c),
            "worker {w} picked {c} times of 600"
        );
    }
}

#[test]
fn temperature_samples_the_range_normalised_softmax() {
    // Costs 4, 5 and 6 (range 2): at T = 1, p ∝ 1, e^-0.5, e^-1.
    let ws = [
        view(1, tiers(0, 0, 0), 0, 0, 0),
        view(2, tiers(0, 0, 0), 0, 1, 0),
        view(3, tiers(0, 0, 0), 0, 2, 0),
    ];
    let cfg = KvConfig {
        temperature: 1.0,
        ..KvConfig::dynamo()
    };
    let w = [1.0, (-0.5f64).exp(), (-1.0f64).exp()];
    let total: f64 = w.iter().sum();
    let mut rng = Rng::seed_from_u64(7);
    let mut counts = [0u32; 3];
    let n = 30_000;
    for _ in 0..n {
        let d = kv_decide(&cfg, &req(64, 16), &ws, &mut rng).unwrap();
        for (t, wi) in d.explain.iter().zip(w) {
            assert!(close(t.probability.unwrap(), wi / total));
        }
        counts[d.worker.0 as usize - 1] += 1;
    }
    for (c, wi) in counts.iter().zip(w) {
        let f = f64::from(*c) / f64::from(n);
        assert!((f - wi / total).abs() < 0.015, "{counts:?}");
    }
    // Lower temperature sharpens: at T = 0.1 the worst has weight e^-10.
    let cold = KvConfig {
        temperature: 0.1,
        ..cfg
    };
    let d = kv_decide(&cold, &req(64, 16), &ws, &mut rng).unwrap();
    assert!(d.explain[2].probability.unwrap() < 1e-4);
}

#[test]
fn temperature_with_equal_costs_is_uniform() {
    let ws = [
        view(1, tiers(0, 0, 0), 0, 3, 0),
        view(2, tiers(0, 0, 0), 0, 3, 0),
    ];
    let cfg = KvConfig {
        temperature: 2.0,
        ..KvConfig::dynamo()
    };
    let mut seen = [false; 2];
    for seed in 0..50 {
        let d = kv_decide(&cfg, &req(16, 16), &ws, &mut Rng::seed_from_u64(seed)).unwrap();
        assert!(d.explain.iter().all(|t| t.probability == Some(0.5)));
        seen[d.worker.0 as usize - 1] = true;
    }
    assert_eq!(seen, [true, true]);
}

#[test]
fn bad_candidate_lists_and_configs_are_errors() {
    let r = req(16, 16);
    let mut rng = Rng::seed_from_u64(0);
    let e = kv_decide(&KvConfig::dynamo(), &r, &[], &mut rng).unwrap_err();
    assert_eq!(e, RouteError::NoWorkers);
    assert_eq!(e.class(), ErrorClass::Unavailable);
    let w = view(9, tiers(0, 0, 0), 0, 0, 0);
    let e = kv_decide(&KvConfig::dynamo(), &r, &[w, w], &mut rng).unwrap_err();
    assert_eq!(e, RouteError::DuplicateWorker(WorkerId(9)));
    assert!(
        KvPolicy::new(KvConfig {
            decay: -1.0,
            ..KvConfig::dynamo()
        })
        .is_err()
    );
    assert!(
        KvPolicy::new(KvConfig {
            temperature: f64::INFINITY,
            ..KvConfig::dynamo()
        })
        .is_err()
    );
}

#[test]
fn a_prompt_under_one_block_has_no_excess_division() {
    let cfg = KvConfig {
        decay: 5.0,
        ..KvConfig::dynamo()
    };
    let ws = [
        view(1, tiers(0, 0, 0), 100, 0, 0),
        view(2, tiers(0, 0, 0), 0, 0, 0),
    ];
    let d = kv_decide(&cfg, &req(0, 16), &ws, &mut Rng::seed_from_u64(0)).unwrap();
    assert!(
        d.explain
            .iter()
            .all(|t| t.decay.is_finite() && t.cost.is_finite())
    );
    assert_eq!(d.worker, WorkerId(2));
}

#[test]
fn capacity_weights_divide_the_load_terms() {
    // 64-token prompt, 4 blocks, nothing cached. W1: 8 decode blocks at speed 2 → (4 + 8) / 2
    // = 6. W2: 2 decode blocks at speed 1 → 4 + 2 = 6. W3: 4 decode blocks, 1 active request
    // (a = 2) at speed 0.5 → (4 + 4 + 2) / 0.5 = 20.
    let mut ws = [
        view(1, tiers(0, 0, 0), 0, 8, 0),
        view(2, tiers(0, 0, 0), 0, 2, 0),
        view(3, tiers(0, 0, 0), 0, 4, 1),
    ];
    ws[0].speed = 2.0;
    ws[2].speed = 0.5;
    let cfg = KvConfig {
        active_request_weight: 2.0,
        ..KvConfig::dynamo()
    };
    let d = kv_decide(&cfg, &req(64, 16), &ws, &mut Rng::seed_from_u64(1)).unwrap();
    assert!(close(cost_of(&d, 1), 6.0));
    assert!(close(cost_of(&d, 2), 6.0));
    assert!(close(cost_of(&d, 3), 20.0));
    assert_eq!(d.explain[0].speed, 2.0);
    // W1 and W2 tie: without the weight W1 (cost 12) would lose to W2.
    assert_ne!(d.worker, WorkerId(3));
    ws[0].speed = 1.0;
    let d = kv_decide(&cfg, &req(64, 16), &ws, &mut Rng::seed_from_u64(1)).unwrap();
    assert_eq!(d.worker, WorkerId(2));
}

#[test]
fn the_band_weighs_the_decode_term() {
    // 64-token prompt (4 blocks). W1 caches it all and decodes 6 blocks: standard cost
    // 0 + 6 = 6. W2 caches nothing and decodes 3: 4 + 3 = 7 → W1.
    // Interactive (×1.5): W1 9, W2 4 + 4.5 = 8.5 → W2.
    // Batch (×0.5): W1 3, W2 5.5 → W1.
    let ws = [
        view(1, tiers(4, 0, 0), 0, 6, 0),
        view(2, tiers(0, 0, 0), 0, 3, 0),
    ];
    let pick = |p: crate::Priority| {
        let mut r = req(64, 16);
        r.priority = p;
        let d = kv_decide(&KvConfig::dynamo(), &r, &ws, &mut Rng::seed_from_u64(1)).unwrap();
        (d.worker.0, cost_of(&d, 1), cost_of(&d, 2))
    };
    assert_eq!(pick(crate::Priority::Standard), (1, 6.0, 7.0));
    assert_eq!(pick(crate::Priority::Interactive), (2, 9.0, 8.5));
    assert_eq!(pick(crate::Priority::Batch), (1, 3.0, 5.5));
}
