//! The decision shortcut ([`crate::replica`]'s `candidates.rs`): over random histories, a
//! replica that scores only holders and the least loaded non-holders picks exactly the
//! workers one that scores every member picks.

use tandem_protocol::{Rng, SequenceHash, WorkerId, WorkerRole};

use super::replica::{BS, input, join, kv_only, prompt, replica, stored};
use crate::{InFlight, Input, RoutingConfig, RoutingReplica, SessionKey};

fn routing(full_scan: bool) -> RoutingConfig {
    let mut r = kv_only();
    r.pool.warmup_ms = 0;
    if full_scan {
        // Never busy, so the same decisions; but a busy threshold turns the shortcut off.
        r.pool.busy_prefill_tokens = Some(u64::MAX);
    }
    r
}

/// A prompt's sequence hashes at the tests' block size.
fn hashes_of(tokens: &[u32]) -> Vec<SequenceHash> {
    tandem_protocol::hashing::compute_block_hashes(
        tokens,
        super::bs(BS),
        tandem_protocol::HashSeed::UNSALTED,
    )
    .iter()
    .map(|h| h.sequence)
    .collect()
}

/// One random history played on both replicas; returns how many decisions were compared.
fn play(seed: u64) -> usize {
    let mut rng = Rng::seed_from_u64(seed);
    let workers = 3 + rng.below(30) as u64;
    let (mut fast, mut full) = (replica(routing(false)), replica(routing(true)));
    // A few shared prefixes cached on random workers, the rest of the prompts fresh.
    let prefixes: Vec<(Vec<u32>, Vec<SequenceHash>)> =
        (0..6).map(|p| prompt(BS * (4 + p * 3), 900 + p)).collect();
    for w in 0..workers {
        let cached: Vec<SequenceHash> = if rng.below(3) == 0 {
            prefixes[rng.below(prefixes.len())].1.clone()
        } else {
            Vec::new()
        };
        for r in [&mut fast, &mut full] {
            join(r, w, WorkerRole::Aggregated, 0, &cached);
        }
    }
    let mut flights: Vec<(InFlight, InFlight)> = Vec::new();
    let mut event_id = vec![1u64; workers as usize];
    let mut compared = 0;
    for i in 0..300u64 {
        let now = 10 + i;
        match rng.below(10) {
            // End a request (first token, then finish).
            0..=2 if !flights.is_empty() => {
                let (mut a, mut b) = flights.swap_remove(rng.below(flights.len()));
                fast.first_token(&mut a, now);
                full.first_token(&mut b, now);
                if rng.below(2) == 0 {
                    fast.finish(a, now);
                    full.finish(b, now);
                } else {
                    flights.push((a, b));
                }
            }
            // A worker caches a prefix.
            3 => {
                let w = rng.below(workers as usize);
                event_id[w] += 1;
                let hashes = &prefixes[rng.below(prefixes.len())].1;
                let ev = stored(w as u64, event_id[w], hashes);
                for r in [&mut fast, &mut full] {
                    r.apply(Input::KvEvents(std::slice::from_ref(&ev)), now)
                        .unwrap();
                }
            }
            // Route a request: on a cached prefix plus its own tail, or fresh.
            _ => {
                let (mut tokens, _) = prompt(BS * (1 + rng.below(12) as u32), 5_000 + i as u32);
                if rng.below(2) == 0 {
                    let mut p = prefixes[rng.below(prefixes.len())].0.clone();
                    p.extend_from_slice(&tokens);
                    tokens = p;
                }
                let hashes = hashes_of(&tokens);
                let mut inp = input(i + 1, &tokens, &hashes);
                if rng.below(5) == 0 {
                    inp.session = Some(SessionKey(rng.below(4) as u64));
                }
                let excluded: Vec<WorkerId> = if rng.below(6) == 0 {
                    vec![WorkerId(rng.below(workers as usize) as u64)]
                } else {
                    Vec::new()
                };
                let (a, b) = (
                    route(&mut fast, &inp, &excluded, now),
                    route(&mut full, &inp, &excluded, now),
                );
                match (a, b) {
                    (Some(a), Some(b)) => {
                        assert_eq!(
                            a.1, b.1,
                            "seed {seed}, decision {i}: the shortcut chose otherwise"
                        );
                        compared += 1;
                        flights.push((a.0, b.0));
                    }
                    (None, None) => {}
                    other => panic!("seed {seed}, decision {i}: {other:?}"),
                }
            }
        }
    }
    compared
}

fn route(
    r: &mut RoutingReplica,
    inp: &crate::RouteInput<'_>,
    excluded: &[WorkerId],
    now: u64,
) -> Option<(InFlight, WorkerId)> {
    let plan = r.route(inp, excluded, now).ok()?;
    Some((plan.flight, plan.decode_worker()))
}

#[test]
fn the_shortcut_picks_what_the_full_scan_picks() {
    let compared: usize = (0..40).map(play).sum();
    assert!(compared > 40 * 150, "{compared} decisions compared");
}

#[test]
fn the_shortcut_scores_few_workers_when_loads_differ() {
    // 200 idle-free workers with distinct loads: a fresh prompt is scored on one or two.
    let mut r = replica(routing(false));
    for w in 0..200 {
        join(&mut r, w, WorkerRole::Aggregated, 0, &[]);
    }
    let mut flights = Vec::new();
    for i in 0..400u64 {
        let (tokens, hashes) = prompt(BS * (1 + (i % 7) as u32), 10 + i as u32);
        let plan = r.route(&input(i + 1, &tokens, &hashes), &[], 1).unwrap();
        flights.push(plan.flight);
    }
    let (tokens, hashes) = prompt(BS * 3, 7);
    let plan = r.route(&input(10_000, &tokens, &hashes), &[], 2).unwrap();
    let scored = plan.decision.decode.explain.len();
    assert!(scored < 20, "{scored} of 200 scored");
    // The full scan scores all of them.
    let mut all = replica(routing(true));
    for w in 0..200 {
        join(&mut all, w, WorkerRole::Aggregated, 0, &[]);
    }
    let plan = all.route(&input(1, &tokens, &hashes), &[], 1).unwrap();
    assert_eq!(plan.decision.decode.explain.len(), 200);
    drop(flights);
}

#[test]
fn many_idle_workers_are_sampled_and_picked_uniformly() {
    let mut r = replica(routing(false));
    for w in 0..200 {
        join(&mut r, w, WorkerRole::Aggregated, 0, &[]);
    }
    let mut picks = std::collections::BTreeMap::<WorkerId, u32>::new();
    for i in 0..600u64 {
        let (tokens, hashes) = prompt(BS * 4, 10 + i as u32);
        let plan = r.route(&input(i + 1, &tokens, &hashes), &[], 1).unwrap();
        assert!(plan.decision.decode.explain.len() <= 16);
        *picks.entry(plan.decode_worker()).or_default() += 1;
        r.finish(plan.flight, 1);
    }
    // Uniform over 200: about 190 distinct workers in 600 picks, none picked often.
    assert!(picks.len() > 170, "{} distinct", picks.len());
    assert!(picks.values().all(|&n| n <= 12), "{picks:?}");
}

#[test]
fn a_prefix_most_of_an_idle_pool_holds_is_sampled_among_its_idle_holders() {
    // 190 of 200 idle workers hold a shared prefix (a system prompt): a prompt on it is
    // scored on a sample, not on every holder, and goes to a holder, uniformly.
    let mut r = replica(routing(false));
    let (prefix, prefix_hashes) = prompt(BS * 4, 900);
    for w in 0..200 {
        let cached = if w < 190 { &prefix_hashes[..] } else { &[] };
        join(&mut r, w, WorkerRole::Aggregated, 0, cached);
    }
    let mut picks = std::collections::BTreeMap::<WorkerId, u32>::new();
    for i in 0..600u64 {
        let mut tokens = prefix.clone();
        tokens.extend_from_slice(&prompt(BS * 2, 10 + i as u32).0);
        let hashes = hashes_of(&tokens);
        let plan = r.route(&input(i + 1, &tokens, &hashes), &[], 1).unwrap();
        let scored = plan.decision.decode.explain.len();
        assert!(scored <= 40, "{scored} of 200 scored");
        let w = plan.decode_worker();
        assert!(w.0 < 190, "{w:?} holds nothing of the prompt");
        *picks.entry(w).or_default() += 1;
        r.finish(plan.flight, 1);
    }
    assert!(picks.len() > 150, "{} distinct", picks.len());
    assert!(picks.values().all(|&n| n <= 12), "{picks:?}");
}
