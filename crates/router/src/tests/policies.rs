use std::collections::HashSet;

use tandem_protocol::{HashSeed, WorkerId};

use super::{loaded, req, tiers, view};
use crate::prefix_hash::PrefixHashPolicy;
use crate::{
    CacheAwareConfig, CacheAwarePolicy, ConfigError, Policy, PolicyConfig, PolicyKind,
    PrefixHashConfig, Rng, RouteRequest, Router, RouterConfig, Rule, WorkerView, prefix_key,
};

fn pick(p: &mut dyn Policy, r: &RouteRequest, ws: &[WorkerView], seed: u64) -> (WorkerId, Rule) {
    let d = p.select(r, ws, &mut Rng::seed_from_u64(seed)).unwrap();
    assert!(ws.iter().any(|v| v.id == d.worker));
    (d.worker, d.rule)
}

#[test]
fn names_parse_and_unknown_names_list_the_valid_ones() {
    for k in PolicyKind::ALL {
        assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        let mut router = Router::new(RouterConfig {
            policy: PolicyConfig::new(k),
            ..RouterConfig::default()
        })
        .unwrap();
        assert_eq!(router.policy_name(), k.name());
        let ws = [loaded(1, 0), loaded(2, 3)];
        let d = router
            .select(&req(64, 16), &ws, &mut Rng::seed_from_u64(3))
            .unwrap();
        assert_eq!(d.explain.len(), 2);
        assert!(
            router
                .select(&req(64, 16), &[], &mut Rng::seed_from_u64(3))
                .is_err()
        );
    }
    let e = "kv-aware".parse::<PolicyKind>().unwrap_err();
    assert!(matches!(e, ConfigError::UnknownPolicy { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("kv-aware") && msg.contains("round-robin, random"),
        "{msg}"
    );
    assert!(msg.contains("prefix-hash"), "{msg}");
}

#[test]
fn round_robin_rotates_by_id_across_membership_changes() {
    let mut p = PolicyConfig::new(PolicyKind::RoundRobin).build().unwrap();
    let r = req(16, 16);
    let ws = [loaded(3, 0), loaded(1, 9), loaded(2, 0)];
    let order: Vec<u64> = (0..4).map(|s| pick(p.as_mut(), &r, &ws, s).0.0).collect();
    assert_eq!(order, [1, 2, 3, 1]);
    // Worker 2 leaves, 5 joins: the rotation continues after the last pick (1).
    let ws = [loaded(3, 0), loaded(1, 0), loaded(5, 0)];
    let order: Vec<u64> = (0..4).map(|s| pick(p.as_mut(), &r, &ws, s).0.0).collect();
    assert_eq!(order, [3, 5, 1, 3]);
}

#[test]
fn random_covers_every_worker() {
    let mut p = PolicyConfig::new(PolicyKind::Random).build().unwrap();
    let ws = [loaded(1, 0), loaded(2, 100), loaded(3, 5)];
    let seen: HashSet<WorkerId> = (0..100)
        .map(|s| pick(p.as_mut(), &req(1, 16), &ws, s).0)
        .collect();
    assert_eq!(seen.len(), 3);
}

#[test]
fn least_loaded_picks_the_fewest_requests_and_spreads_ties() {
    let mut p = PolicyConfig::new(PolicyKind::LeastLoaded).build().unwrap();
    let ws = [loaded(1, 4), loaded(2, 1), loaded(3, 1), loaded(4, 2)];
    let seen: HashSet<WorkerId> = (0..100)
        .map(|s| pick(p.as_mut(), &req(1, 16), &ws, s).0)
        .collect();
    assert_eq!(seen, HashSet::from([WorkerId(2), WorkerId(3)]));
    let d = p
        .select(&req(1, 16), &ws, &mut Rng::seed_from_u64(0))
        .unwrap();
    let probs: Vec<f64> = d.explain.iter().map(|t| t.probability.unwrap()).collect();
    assert_eq!(probs, [0.0, 0.5, 0.5, 0.0]);
}

#[test]
fn power_of_two_never_picks_the_more_loaded_of_its_pair() {
    let mut p = PolicyConfig::new(PolicyKind::PowerOfTwo).build().unwrap();
    // With distinct loads the most loaded worker loses every pair it is in.
    let ws = [loaded(1, 0), loaded(2, 5), loaded(3, 10)];
    let mut seen = HashSet::new();
    for s in 0..300 {
        let (w, rule) = pick(p.as_mut(), &req(1, 16), &ws, s);
        assert_ne!(w, WorkerId(3));
        assert_eq!(rule, Rule::PowerOfTwo);
        seen.insert(w);
    }
    assert_eq!(seen, HashSet::from([WorkerId(1), WorkerId(2)]));
    // Two workers: always the less loaded; one worker: that one.
    for s in 0..50 {
        assert_eq!(pick(p.as_mut(), &req(1, 16), &ws[1..], s).0, WorkerId(2));
        assert_eq!(pick(p.as_mut(), &req(1, 16), &ws[2..], s).0, WorkerId(3));
    }
}

fn cache_aware() -> CacheAwarePolicy {
    CacheAwarePolicy::new(CacheAwareConfig::default()).unwrap()
}

#[test]
fn cache_aware_balances_when_load_is_imbalanced() {
    // 100 − 0 > 64 and 100 > 1.5 × 0: least loaded, though worker 1 holds the whole prompt.
    let ws = [
        view(1, tiers(10, 0, 0), 0, 0, 100),
        view(2, tiers(0, 0, 0), 0, 0, 0),
    ];
    assert_eq!(
        pick(&mut cache_aware(), &req(160, 16), &ws, 0),
        (WorkerId(2), Rule::Imbalanced)
    );
    // A large gap with a small ratio (280 vs 200) is not imbalance: affinity wins.
    let ws = [
        view(1, tiers(10, 0, 0), 0, 0, 280),
        view(2, tiers(0, 0, 0), 0, 0, 200),
    ];
    assert_eq!(
        pick(&mut cache_aware(), &req(160, 16), &ws, 0),
        (WorkerId(1), Rule::PrefixMatch)
    );
    // A large ratio with a small gap (60 vs 0) is not imbalance either.
    let ws = [
        view(1, tiers(10, 0, 0), 0, 0, 60),
        view(2, tiers(0, 0, 0), 0, 0, 0),
    ];
    assert_eq!(
        pick(&mut cache_aware(), &req(160, 16), &ws, 0),
        (WorkerId(1), Rule::PrefixMatch)
    );
}

#[test]
fn cache_aware_needs_a_match_rate_above_the_threshold() {
    // 10-block prompt: 4 blocks matched (0.4 > 0.3) → best match, whatever the tier.
    let ws = [
        view(1, tiers(0, 4, 0), 0, 0, 9),
        view(2, tiers(2, 0, 0), 0, 0, 1),
        view(3, tiers(0, 0, 0), 0, 0, 0),
    ];
    assert_eq!(
        pick(&mut cache_aware(), &req(160, 16), &ws, 0),
        (WorkerId(1), Rule::PrefixMatch)
    );
    // 3 of 10 is not above 0.3: least loaded.
    let ws = [
        view(1, tiers(3, 0, 0), 0, 0, 9),
        view(2, tiers(0, 0, 0), 0, 0, 0),
    ];
    assert_eq!(
        pick(&mut cache_aware(), &req(160, 16), &ws, 0),
        (WorkerId(2), Rule::LowMatch)
    );
    // Equal best matches: the less loaded of them.
    let ws = [
        view(1, tiers(8, 0, 0), 0, 0, 9),
        view(2, tiers(8, 0, 0), 0, 0, 2),
        view(3, tiers(0, 0, 0), 0, 0, 0),
    ];
    let d = cache_aware()
        .select(&req(160, 16), &ws, &mut Rng::seed_from_u64(0))
        .unwrap();
    assert_eq!(d.worker, WorkerId(2));
    let probs: Vec<f64> = d.explain.iter().map(|t| t.probability.unwrap()).collect();
    assert_eq!(probs, [0.0, 1.0, 0.0]);
}

fn ring(n: u64) -> Vec<WorkerView> {
    (1..=n).map(|i| loaded(i, 0)).collect()
}

fn keyed(key: u64) -> RouteRequest {
    RouteRequest {
        prefix_key: key,
        ..req(256, 16)
    }
}

#[test]
fn prefix_hash_is_stable_and_moves_about_one_nth_of_keys() {
    let cfg = PrefixHashConfig::default();
    let mut a = PrefixHashPolicy::new(cfg).unwrap();
    let mut b = PrefixHashPolicy::new(cfg).unwrap();
    let ten = ring(10);
    let mut eleven = ring(11);
    eleven.reverse(); // candidate order must not matter
    let keys: Vec<u64> = (0..10_000u32)
        .map(|i| prefix_key(&[i, i + 1, 7], 256, HashSeed::UNSALTED))
        .collect();
    // Each policy keeps one ring: query all keys on one set before switching sets.
    let before: Vec<(WorkerId, Rule)> = keys
        .iter()
        .map(|&k| pick(&mut a, &keyed(k), &ten, 0))
        .collect();
    let again: Vec<(WorkerId, Rule)> = keys
        .iter()
        .map(|&k| pick(&mut b, &keyed(k), &ten, 99))
        .collect();
    assert_eq!(before, again, "same key, same worker");
    let after: Vec<WorkerId> = keys
        .iter()
        .map(|&k| pick(&mut b, &keyed(k), &eleven, 0).0)
        .collect();
    let mut moved = 0;
    let mut owners = HashSet::new();
    for ((w, rule), new) in before.iter().zip(&after) {
        assert_eq!(*rule, Rule::RingOwner);
        owners.insert(*w);
        if new != w {
            moved += 1;
            assert_eq!(*new, WorkerId(11), "keys only move to the new worker");
        }
    }
    assert_eq!(owners.len(), 10);
    // Expect 1/11 ≈ 909 of 10,000.
    assert!((500..1400).contains(&moved), "{moved} keys moved");
}

#[test]
fn prefix_hash_escapes_an_overloaded_owner() {
    let mut p = PrefixHashPolicy::new(PrefixHashConfig::default()).unwrap();
    let mut ws = ring(4);
    let owner = pick(&mut p, &keyed(42), &ws, 0).0;
    let i = ws.iter().position(|v| v.id == owner).unwrap();
    // Everyone at 4: the owner is at the mean, no escape.
    for v in &mut ws {
        v.load.active_requests = 4;
    }
    assert_eq!(pick(&mut p, &keyed(42), &ws, 0), (owner, Rule::RingOwner));
    // Owner 10, one at 1, two at 2: mean 3.75, bound 4.69, so the least loaded takes it.
    for v in &mut ws {
        v.load.active_requests = 2;
    }
    ws[i].load.active_requests = 10;
    ws[(i + 1) % 4].load.active_requests = 1;
    let (w, rule) = pick(&mut p, &keyed(42), &ws, 0);
    assert_eq!(rule, Rule::BoundedLoadEscape);
    assert_eq!(w, ws[(i + 1) % 4].id);
    assert!(
        PrefixHashPolicy::new(PrefixHashConfig {
            virtual_nodes: 0,
            ..PrefixHashConfig::default()
        })
        .is_err()
    );
}

#[test]
fn prefix_key_covers_only_the_first_k_tokens() {
    let s = HashSeed::UNSALTED;
    let a: Vec<u32> = (0..300).collect();
    let mut b = a.clone();
    b[299] = 7;
    assert_eq!(prefix_key(&a, 256, s), prefix_key(&b, 256, s));
    b[10] = 7;
    assert_ne!(prefix_key(&a, 256, s), prefix_key(&b, 256, s));
    assert_ne!(
        prefix_key(&a, 256, s),
        prefix_key(&a, 256, HashSeed::from_salt(Some(b"t")))
    );
    let r = RouteRequest::from_tokens(&a, super::bs(16), s);
    assert_eq!(r.prompt_tokens, 300);
    assert_eq!(r.prefix_key, prefix_key(&a, 256, s));
    let cfg = PrefixHashConfig {
        prefix_tokens: 8,
        ..PrefixHashConfig::default()
    };
    assert_eq!(cfg.key(&a, s), prefix_key(&a[..8], 1000, s));
}
