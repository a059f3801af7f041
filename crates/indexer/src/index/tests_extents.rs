//! Tests of [`KvIndex::find_extents`]: hand-computed groups, and `find_matches` as the
//! reference on random prefix-closed clusters (with flagged workers among them).

use std::collections::BTreeSet;

use proptest::prelude::*;
use tandem_protocol::{SequenceHash, StorageTier, WorkerId};

use super::tests::{D, H, K, World, build, node_hash, path, prompt, removed, stored, tc, world};
use super::*;

/// Everything an answer must satisfy, `find_matches` being the reference.
fn check(idx: &KvIndex, q: &[SequenceHash]) {
    let m = idx.find_matches(q);
    let e = idx.find_extents(q);
    assert_eq!(e.to_scores(), m, "query {q:?}: {e:?}");
    assert_eq!(e.num_workers(), m.len());
    let mut seen = BTreeSet::new();
    let mut counts = BTreeSet::new();
    for g in e.iter() {
        assert!(!g.is_empty(), "empty group {g:?}");
        assert!(
            counts.insert(extents::rank(&g.counts())),
            "two groups with {:?}",
            g.counts()
        );
        let ws: Vec<WorkerId> = g.workers().collect();
        assert_eq!(ws.len(), g.len(), "{g:?}");
        for w in ws {
            assert!(seen.insert(w), "{w:?} in two groups");
            assert!(g.contains(w));
        }
    }
    let ranks: Vec<_> = e.iter().map(|g| extents::rank(&g.counts())).collect();
    assert!(ranks.windows(2).all(|p| p[0] < p[1]), "groups best first");
    for w in idx.workers().chain([WorkerId(u64::MAX)]) {
        assert_eq!(e.get(w), m.get(w), "{w:?}");
        assert!(
            e.iter()
                .all(|g| g.contains(w) == (Some(g.counts()) == m.get(w)))
        );
    }
}

/// The groups as (counts, sorted worker ids).
fn groups(e: &Extents<'_>) -> Vec<(TierCounts, Vec<u64>)> {
    e.iter()
        .map(|g| {
            let mut ws: Vec<u64> = g.workers().map(|w| w.0).collect();
            ws.sort_unstable();
            (g.counts(), ws)
        })
        .collect()
}

fn chain(idx: &mut KvIndex, w: u64, tier: StorageTier, parent: Option<u64>, blocks: &[u64]) {
    let id = idx.last_event_id(WorkerId(w)).unwrap_or(0) + 1;
    assert_eq!(
        idx.apply(&stored(w, id, tier, parent, blocks)),
        ApplyOutcome::Applied
    );
}

/// The Mooncake shape: everyone shares a system prompt, one worker holds the conversation.
#[test]
fn a_shared_prefix_is_one_lazy_group() {
    let mut idx = KvIndex::new();
    let system: Vec<u64> = (1..=8).collect();
    for w in 0..20u64 {
        let own: Vec<u64> = (0..8).map(|i| 1000 * (w + 1) + i).collect();
        chain(&mut idx, w, D, None, &system);
        chain(&mut idx, w, D, Some(8), &own);
    }
    assert_eq!(
        idx.spills.len(),
        1,
        "the system prompt's blocks share one holder list"
    );
    let q = prompt(system.iter().copied().chain((0..8).map(|i| 6000 + i)));
    let e = idx.find_extents(&q);
    let others: Vec<u64> = (0..20).filter(|&w| w != 5).collect();
    assert_eq!(
        groups(&e),
        vec![(tc(16, 0, 0), vec![5]), (tc(8, 0, 0), others)]
    );
    // The 19 are one reference into the system prompt's holder list; the owner is explicit.
    assert_eq!(
        e.shape(),
        (2, 0),
        "both lazy: the owner is the bulk that goes on"
    );
    check(&idx, &q);
    // A prompt nobody continues: the whole cluster in one group, and nobody explicit.
    let q = prompt(system.iter().copied().chain([77, 78]));
    let e = idx.find_extents(&q);
    assert_eq!(groups(&e), vec![(tc(8, 0, 0), (0..20).collect())]);
    assert_eq!(e.shape(), (1, 0));
    check(&idx, &q);
    // Everyone holds all of it.
    let e = idx.find_extents(&prompt(1..=8));
    assert_eq!(groups(&e), vec![(tc(8, 0, 0), (0..20).collect())]);
    assert_eq!(e.shape(), (1, 0));
    assert!(idx.find_extents(&prompt([99, 1])).is_empty());
    assert!(idx.find_extents(&[]).is_empty());
}

#[test]
fn nested_prefixes_are_nested_lazy_groups() {
    let mut idx = KvIndex::new();
    for w in 0..30u64 {
        chain(&mut idx, w, D, None, &[1, 2, 3, 4]);
        if w < 12 {
            chain(&mut idx, w, D, Some(4), &[5, 6, 7, 8]);
        }
        if w == 3 {
            chain(&mut idx, w, D, Some(8), &[9, 10, 11, 12]);
        }
    }
    let q = prompt(1..=12);
    let e = idx.find_extents(&q);
    assert_eq!(
        groups(&e),
        vec![
            (tc(12, 0, 0), vec![3]),
            (tc(8, 0, 0), (0..12).filter(|&w| w != 3).collect()),
            (tc(4, 0, 0), (12..30).collect()),
        ]
    );
    assert_eq!(e.shape(), (3, 0));
    check(&idx, &q);
}

#[test]
fn tiers_split_groups() {
    let mut idx = KvIndex::new();
    for w in 0..10u64 {
        chain(&mut idx, w, D, None, &[1, 2, 3, 4]);
    }
    for w in 10..15u64 {
        chain(&mut idx, w, H, None, &[1, 2, 3, 4]);
    }
    // Worker 2 goes on in host memory, worker 11 on disk, worker 4 keeps a disk copy.
    chain(&mut idx, 2, H, Some(4), &[5, 6]);
    chain(&mut idx, 11, K, Some(4), &[5]);
    chain(&mut idx, 4, K, None, &[1, 2]);
    let q = prompt(1..=6);
    let e = idx.find_extents(&q);
    assert_eq!(
        groups(&e),
        vec![
            (tc(4, 2, 0), vec![2]),
            (tc(0, 4, 1), vec![11]),
            (tc(4, 0, 0), vec![0, 1, 3, 4, 5, 6, 7, 8, 9]),
            (tc(0, 4, 0), vec![10, 12, 13, 14]),
        ]
    );
    check(&idx, &q);
    assert_eq!(e.get(WorkerId(11)), Some(tc(0, 4, 1)));
    assert_eq!(e.get(WorkerId(99)), None);
}

#[test]
fn flagged_workers_are_walked_and_others_skipped() {
    let mut idx = KvIndex::new();
    for w in 0..12u64 {
        chain(&mut idx, w, D, None, &[1, 2, 3, 4]);
    }
    // 20 holds 1 and then 3, 4 without 2; 21 holds 2.. without 1: both flagged.
    chain(&mut idx, 20, D, None, &[1]);
    chain(&mut idx, 20, D, Some(2), &[3, 4]);
    chain(&mut idx, 21, D, Some(1), &[2, 3, 4]);
    assert!(idx.is_non_closed(WorkerId(20)) && idx.is_non_closed(WorkerId(21)));
    let q = prompt(1..=4);
    let e = idx.find_extents(&q);
    assert_eq!(
        groups(&e),
        vec![(tc(4, 0, 0), (0..12).collect()), (tc(1, 0, 0), vec![20])]
    );
    check(&idx, &q);
    check(&idx, &prompt(2..=4));
}

/// The merge path: lists of comparable lengths, workers leaving one or a few at a time.
#[test]
fn gradual_drops_are_exact() {
    let mut idx = KvIndex::new();
    for w in 0..40u64 {
        let len = 1 + w % 13;
        chain(&mut idx, w, D, None, &(1..=len).collect::<Vec<_>>());
        if w % 5 == 0 && len > 2 {
            let id = idx.last_event_id(WorkerId(w)).unwrap() + 1;
            idx.apply(&removed(w, id, D, &[len]));
            chain(&mut idx, w, H, Some(len - 1), &[len]);
        }
    }
    for n in [1, 2, 7, 13, 20] {
        check(&idx, &prompt(1..=n));
    }
}

/// A random cluster: a forest of blocks, many workers each holding the root paths of a few
/// nodes (tiers non-decreasing along a path, sometimes with slower copies), so that holder
/// lists are long near the roots and short further on; plus a few workers with arbitrary
/// states (flagged by the index when they break closure). Half the clusters keep everything on
/// device, the common case the search has a shortcut for.
fn cluster() -> impl Strategy<Value = World> {
    (2usize..40, 8usize..60, 0usize..3, any::<bool>()).prop_flat_map(
        |(nodes, workers, rogues, device)| {
            let tree = (
                proptest::collection::vec(any::<prop::sample::Index>(), nodes),
                proptest::collection::vec(any::<bool>(), nodes),
            );
            let worker = (
                proptest::collection::vec(any::<prop::sample::Index>(), 1..3),
                0u8..10,
                proptest::collection::vec(0u8..12, nodes),
                0u8..8,
            );
            let rogue = proptest::collection::vec((0u8..4, 0u8..8), nodes);
            (
                tree,
                proptest::collection::vec(worker, workers),
                proptest::collection::vec(rogue, rogues),
            )
                .prop_map(move |((pidx, roots), ws, rogues)| {
                    let parents: Vec<Option<usize>> = (0..nodes)
                        .map(|i| (i != 0 && !(roots[i] && i % 3 == 0)).then(|| pidx[i].index(i)))
                        .collect();
                    let mut workers: Vec<Vec<(u8, u8)>> = ws
                        .into_iter()
                        .map(|(homes, start, steps, extra)| {
                            let mut lv = vec![(3u8, 0u8); nodes];
                            for home in homes {
                                let mut p = vec![home.index(nodes)];
                                while let Some(q) = parents[*p.last().unwrap()] {
                                    p.push(q);
                                }
                                let mut level = match start {
                                    _ if device => 0,
                                    0..=6 => 0,
                                    7..=8 => 1,
                                    _ => 2,
                                };
                                for &i in p.iter().rev() {
                                    if steps[i] == 0 {
                                        level = if device { 3 } else { (level + 1).min(3) };
                                    }
                                    lv[i].0 = lv[i].0.min(level);
                                }
                            }
                            // Closure over the union of the paths (parents have lower indices).
                            for i in 0..nodes {
                                if let Some(p) = parents[i] {
                                    lv[i].0 = lv[i].0.max(lv[p].0);
                                }
                                lv[i].1 = if extra % 3 == 0 && !device { extra } else { 0 };
                            }
                            lv
                        })
                        .collect();
                    workers.extend(rogues);
                    World { parents, workers }
                })
        },
    )
}

/// Removes every `k`-th block a worker holds that no other block of it depends on (a leaf of
/// its cache), in all its tiers: states stay prefix-closed.
fn evict_leaves(idx: &mut KvIndex, w: &World, k: usize) {
    for (wi, levels) in w.workers.iter().enumerate() {
        let worker = WorkerId(wi as u64);
        let Some(blocks) = idx.worker_blocks(worker) else {
            continue;
        };
        let held = |i: usize| levels[i].0 < 3;
        for i in (0..levels.len()).step_by(k.max(1)) {
            let leaf = held(i) && !(0..levels.len()).any(|c| w.parents[c] == Some(i) && held(c));
            if !leaf {
                continue;
            }
            for t in StorageTier::ALL {
                if blocks.tier(t).contains(&SequenceHash(node_hash(i))) {
                    let id = idx.last_event_id(worker).unwrap() + 1;
                    idx.apply(&removed(wi as u64, id, t, &[node_hash(i)]));
                }
            }
        }
    }
}

proptest! {
    #[test]
    fn extents_equal_find_matches_on_clusters(
        w in cluster(),
        queries in proptest::collection::vec((any::<prop::sample::Index>(), 0usize..3), 1..10),
        evict in 0usize..4,
    ) {
        let mut idx = build(&w);
        if evict > 0 {
            evict_leaves(&mut idx, &w, evict);
        }
        for (node, tail) in queries {
            check(&idx, &path(&w, node.index(w.parents.len()), tail));
        }
    }

    #[test]
    fn extents_equal_find_matches_on_small_worlds(
        w in prop_oneof![world(true), world(false)],
        queries in proptest::collection::vec((any::<prop::sample::Index>(), 0usize..3), 1..10),
    ) {
        let idx = build(&w);
        for (node, tail) in queries {
            check(&idx, &path(&w, node.index(w.parents.len()), tail));
        }
    }
}
