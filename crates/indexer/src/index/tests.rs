//! Unit and property tests of [`KvIndex`].

use proptest::prelude::*;
use tandem_protocol::{
    KvDump, KvEvent, KvEventKind, LocalBlockHash, SequenceHash, StorageTier, StoredBlock, WorkerId,
};

use super::*;

pub(super) const D: StorageTier = StorageTier::Device;
pub(super) const H: StorageTier = StorageTier::Host;
pub(super) const K: StorageTier = StorageTier::Disk;

pub(super) fn sh(i: u64) -> SequenceHash {
    SequenceHash(i)
}

pub(super) fn stored(
    w: u64,
    id: u64,
    tier: StorageTier,
    parent: Option<u64>,
    blocks: &[u64],
) -> KvEvent {
    KvEvent {
        worker_id: WorkerId(w),
        event_id: id,
        tier,
        kind: KvEventKind::Stored {
            parent: parent.map(SequenceHash),
            blocks: blocks
                .iter()
                .map(|&b| StoredBlock {
                    sequence_hash: sh(b),
                    local_hash: LocalBlockHash(b),
                })
                .collect(),
        },
    }
}

pub(super) fn removed(w: u64, id: u64, tier: StorageTier, blocks: &[u64]) -> KvEvent {
    KvEvent {
        worker_id: WorkerId(w),
        event_id: id,
        tier,
        kind: KvEventKind::Removed {
            blocks: blocks.iter().copied().map(sh).collect(),
        },
    }
}

fn cleared(w: u64, id: u64, tier: StorageTier) -> KvEvent {
    KvEvent {
        worker_id: WorkerId(w),
        event_id: id,
        tier,
        kind: KvEventKind::Cleared,
    }
}

pub(super) fn prompt(blocks: impl IntoIterator<Item = u64>) -> Vec<SequenceHash> {
    blocks.into_iter().map(sh).collect()
}

pub(super) fn tc(device: u32, host: u32, disk: u32) -> TierCounts {
    TierCounts { device, host, disk }
}

/// The reference answer: walk every worker over every block.
pub(super) fn naive(index: &KvIndex, hashes: &[SequenceHash]) -> OverlapScores {
    let mut scores = Vec::new();
    for w in index.workers() {
        let blocks = index.worker_blocks(w).unwrap();
        let mut counts = TierCounts::default();
        for h in hashes {
            match StorageTier::ALL
                .into_iter()
                .find(|&t| blocks.tier(t).contains(h))
            {
                Some(D) => counts.device += 1,
                Some(H) => counts.host += 1,
                Some(K) => counts.disk += 1,
                None => break,
            }
        }
        if counts.total() > 0 {
            scores.push((w, counts));
        }
    }
    OverlapScores { scores }
}

#[test]
fn first_event_must_be_one_and_duplicates_are_ignored() {
    let mut idx = KvIndex::new();
    assert_eq!(
        idx.apply(&stored(1, 2, D, None, &[10])),
        ApplyOutcome::Gap {
            expected: 1,
            got: 2
        }
    );
    assert_eq!(
        idx.last_event_id(WorkerId(1)),
        None,
        "a gap creates no worker"
    );
    assert_eq!(
        idx.apply(&stored(1, 0, D, None, &[10])),
        ApplyOutcome::Duplicate
    );
    assert_eq!(
        idx.apply(&stored(1, 1, D, None, &[10])),
        ApplyOutcome::Applied
    );
    assert_eq!(
        idx.apply(&stored(1, 1, D, None, &[99])),
        ApplyOutcome::Duplicate
    );
    assert_eq!(idx.last_event_id(WorkerId(1)), Some(1));
    assert!(
        idx.worker_blocks(WorkerId(1))
            .unwrap()
            .device
            .contains(&sh(10))
    );
    assert!(
        !idx.worker_blocks(WorkerId(1))
            .unwrap()
            .device
            .contains(&sh(99))
    );
    assert_eq!(idx.num_entries(), 1);
}

#[test]
fn gaps_change_nothing_and_the_expected_event_still_applies() {
    let mut idx = KvIndex::new();
    idx.apply(&stored(1, 1, D, None, &[1, 2]));
    let before = idx.worker_blocks(WorkerId(1));
    assert_eq!(
        idx.apply(&removed(1, 3, D, &[2])),
        ApplyOutcome::Gap {
            expected: 2,
            got: 3
        }
    );
    assert_eq!(
        idx.apply(&cleared(1, 7, D)),
        ApplyOutcome::Gap {
            expected: 2,
            got: 7
        }
    );
    assert_eq!(idx.worker_blocks(WorkerId(1)), before);
    assert_eq!(idx.last_event_id(WorkerId(1)), Some(1));
    assert_eq!(
        idx.apply(&stored(1, 2, D, Some(2), &[3])),
        ApplyOutcome::Applied
    );
    assert_eq!(idx.apply(&removed(1, 3, D, &[3])), ApplyOutcome::Applied);
    assert_eq!(
        idx.find_matches(&prompt([1, 2, 3])).get(WorkerId(1)),
        Some(tc(2, 0, 0))
    );
}

#[test]
fn removing_absent_blocks_is_a_noop() {
    let mut idx = KvIndex::new();
    idx.apply(&stored(1, 1, D, None, &[1]));
    assert_eq!(idx.apply(&removed(1, 2, H, &[1, 5])), ApplyOutcome::Applied);
    assert_eq!(idx.num_entries(), 1);
    assert_eq!(idx.num_blocks(), 1);
    assert_eq!(idx.last_event_id(WorkerId(1)), Some(2));
}

#[test]
fn cleared_empties_one_tier_only() {
    let mut idx = KvIndex::new();
    idx.apply(&stored(1, 1, D, None, &[1, 2]));
    idx.apply(&stored(1, 2, H, Some(2), &[3, 4]));
    idx.apply(&stored(2, 1, H, None, &[1, 2]));
    assert_eq!(idx.num_entries(), 6);
    idx.apply(&cleared(1, 3, H));
    let b = idx.worker_blocks(WorkerId(1)).unwrap();
    assert_eq!(b.device, [sh(1), sh(2)].into());
    assert!(b.host.is_empty());
    assert_eq!(
        idx.worker_blocks(WorkerId(2)).unwrap().host,
        [sh(1), sh(2)].into()
    );
    assert_eq!(idx.num_entries(), 4);
    assert_eq!(idx.num_blocks(), 2, "blocks 3 and 4 have no holder left");
}

#[test]
fn replace_and_remove_worker() {
    let mut idx = KvIndex::new();
    idx.apply(&stored(1, 1, D, None, &[1, 2, 3]));
    idx.apply(&stored(2, 1, D, None, &[1]));
    let dump = KvDump {
        worker_id: WorkerId(1),
        last_event_id: 40,
        // Host before Device: a dump's tiers may come in any order.
        events: vec![
            stored(1, 0, H, Some(7), &[8]),
            stored(1, 0, D, None, &[1, 7]),
        ],
    };
    idx.replace_worker(&dump).unwrap();
    let b = idx.worker_blocks(WorkerId(1)).unwrap();
    assert_eq!(b.device, [sh(1), sh(7)].into());
    assert_eq!(b.host, [sh(8)].into());
    assert!(!idx.is_non_closed(WorkerId(1)));
    assert_eq!(idx.last_event_id(WorkerId(1)), Some(40));
    assert_eq!(idx.apply(&cleared(1, 40, D)), ApplyOutcome::Duplicate);
    assert_eq!(idx.num_entries(), 4);

    let foreign = KvDump {
        worker_id: WorkerId(1),
        last_event_id: 50,
        events: vec![stored(2, 0, D, None, &[9])],
    };
    assert_eq!(
        idx.replace_worker(&foreign),
        Err(IndexError::ForeignEvent {
            dump: WorkerId(1),
            event: WorkerId(2)
        })
    );
    assert_eq!(
        idx.last_event_id(WorkerId(1)),
        Some(40),
        "a refused dump changes nothing"
    );

    assert!(idx.remove_worker(WorkerId(1)));
    assert!(!idx.remove_worker(WorkerId(1)));
    assert_eq!(idx.last_event_id(WorkerId(1)), None);
    assert_eq!(idx.workers().collect::<Vec<_>>(), vec![WorkerId(2)]);
    assert_eq!(idx.num_entries(), 1);
    assert_eq!(idx.num_blocks(), 1);
    // A removed worker starts over at event 1, and its freed slot is reused cleanly.
    assert_eq!(
        idx.apply(&stored(3, 1, D, None, &[1])),
        ApplyOutcome::Applied
    );
    assert_eq!(idx.find_matches(&prompt([1])).len(), 2);
}

#[test]
fn matches_split_by_tier_in_prefix_order() {
    let mut idx = KvIndex::new();
    idx.apply(&stored(1, 1, D, None, &[1, 2, 3]));
    idx.apply(&stored(1, 2, H, Some(3), &[4, 5]));
    idx.apply(&stored(1, 3, K, Some(5), &[6]));
    // A host copy of a device block counts as device (the fastest tier).
    idx.apply(&stored(1, 4, H, None, &[1, 2]));
    idx.apply(&stored(2, 1, H, None, &[1, 2, 3, 4, 5, 6, 7, 8]));
    idx.apply(&stored(3, 1, D, None, &[100]));
    let m = idx.find_matches(&prompt(1..=8));
    assert_eq!(m.get(WorkerId(1)), Some(tc(3, 2, 1)));
    assert_eq!(m.get(WorkerId(2)), Some(tc(0, 8, 0)));
    assert_eq!(m.get(WorkerId(3)), None);
    assert_eq!(
        m.scores.iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![WorkerId(1), WorkerId(2)]
    );
    assert_eq!(
        idx.find_matches(&prompt([1, 2, 3, 4, 99])).get(WorkerId(1)),
        Some(tc(3, 1, 0))
    );
    assert_eq!(
        idx.find_matches(&prompt([1])).get(WorkerId(2)),
        Some(tc(0, 1, 0))
    );
    assert!(idx.find_matches(&[]).is_empty());
    assert_eq!(m, naive(&idx, &prompt(1..=8)));
}

#[test]
fn nobody_holding_the_first_block_means_no_match() {
    let mut idx = KvIndex::new();
    idx.apply(&stored(1, 1, D, Some(1), &[2, 3, 4]));
    assert!(idx.is_non_closed(WorkerId(1)));
    assert!(idx.find_matches(&prompt([1, 2, 3, 4])).is_empty());
    assert!(idx.find_matches(&prompt([7])).is_empty());
}

#[test]
fn many_holders_spill_and_all_match() {
    let mut idx = KvIndex::new();
    for w in 0..50 {
        idx.apply(&stored(w, 1, D, None, &[1, 2]));
        idx.apply(&stored(w, 2, D, Some(2), &[3 + w % 2]));
    }
    let m = idx.find_matches(&prompt([1, 2, 3]));
    assert_eq!(m.len(), 50);
    assert_eq!(m.get(WorkerId(0)), Some(tc(3, 0, 0)));
    assert_eq!(m.get(WorkerId(1)), Some(tc(2, 0, 0)));
    assert_eq!(m, naive(&idx, &prompt([1, 2, 3])));
    assert_eq!(idx.num_entries(), 150);
    assert!(idx.heap_bytes() > 0);
}

#[test]
fn non_closed_workers_get_exact_linear_answers() {
    let mut idx = KvIndex::new();
    // Worker 1 stores block 3 on device under a parent it only holds on host: flagged.
    idx.apply(&stored(1, 1, D, None, &[1]));
    idx.apply(&stored(1, 2, H, Some(1), &[2]));
    idx.apply(&stored(1, 3, D, Some(2), &[3, 4]));
    // Worker 2 has a hole at block 3 that bisection between two device ends would miss.
    idx.apply(&stored(2, 1, D, None, &[1, 2]));
    idx.apply(&stored(2, 2, D, Some(3), &[4, 5]));
    idx.apply(&stored(3, 1, D, None, &[1, 2, 3, 4, 5]));
    assert!(idx.is_non_closed(WorkerId(1)) && idx.is_non_closed(WorkerId(2)));
    assert!(!idx.is_non_closed(WorkerId(3)));
    let m = idx.find_matches(&prompt(1..=5));
    assert_eq!(
        m.get(WorkerId(1)),
        Some(tc(3, 1, 0)),
        "device, host, device, device"
    );
    assert_eq!(m.get(WorkerId(2)), Some(tc(2, 0, 0)));
    assert_eq!(m.get(WorkerId(3)), Some(tc(5, 0, 0)));
    assert_eq!(m, naive(&idx, &prompt(1..=5)));

    // A clean dump clears the flag; so does ending up with nothing.
    let dump = KvDump {
        worker_id: WorkerId(2),
        last_event_id: 9,
        events: vec![stored(2, 0, D, None, &[1])],
    };
    idx.replace_worker(&dump).unwrap();
    assert!(!idx.is_non_closed(WorkerId(2)));
    idx.apply(&cleared(1, 4, D));
    assert!(idx.is_non_closed(WorkerId(1)), "host still holds block 2");
    idx.apply(&cleared(1, 5, H));
    assert!(!idx.is_non_closed(WorkerId(1)));
    // A dump that is itself not closed leaves the flag set.
    let bad = KvDump {
        worker_id: WorkerId(3),
        last_event_id: 2,
        events: vec![stored(3, 0, D, Some(9), &[1])],
    };
    idx.replace_worker(&bad).unwrap();
    assert!(idx.is_non_closed(WorkerId(3)));
}

#[test]
fn violations_seen_by_the_search_fall_back_to_exact() {
    let mut idx = KvIndex::new();
    for b in 1..=8 {
        let tier = if b == 8 { H } else { D };
        let parent = (b > 1).then(|| b - 1);
        idx.apply(&stored(1, b, tier, parent, &[b]));
    }
    // An interior removal is not flagged when applied...
    idx.apply(&removed(1, 9, D, &[4]));
    assert!(!idx.is_non_closed(WorkerId(1)));
    // ...but the search sees block 4 missing between device and host ends and walks exactly.
    assert_eq!(
        idx.find_matches(&prompt(1..=8)).get(WorkerId(1)),
        Some(tc(3, 0, 0))
    );
}

/// One worker's random prefix-closed state over a random forest of blocks, or an arbitrary
/// one when `closed` is false.
#[derive(Clone, Debug)]
pub(super) struct World {
    pub(super) parents: Vec<Option<usize>>,
    /// Per worker, per node: (level 0..=3, extra slower copies as a tier bit mask).
    pub(super) workers: Vec<Vec<(u8, u8)>>,
}

pub(super) fn node_hash(i: usize) -> u64 {
    // Spread like real xxh3 outputs sometimes, small integers other times.
    if i.is_multiple_of(2) {
        (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    } else {
        i as u64 + 1
    }
}

pub(super) fn world(closed: bool) -> impl Strategy<Value = World> {
    (2usize..60, 1usize..7).prop_flat_map(move |(nodes, workers)| {
        let parents = proptest::collection::vec(any::<prop::sample::Index>(), nodes);
        let levels =
            proptest::collection::vec(proptest::collection::vec((0u8..4, 0u8..8), nodes), workers);
        (
            parents,
            levels,
            proptest::collection::vec(any::<bool>(), nodes),
        )
            .prop_map(move |(pidx, raw, roots)| {
                let parents: Vec<Option<usize>> = (0..nodes)
                    .map(|i| {
                        if i == 0 || roots[i] && i % 3 == 0 {
                            None
                        } else {
                            Some(pidx[i].index(i))
                        }
                    })
                    .collect();
                let workers = raw
                    .into_iter()
                    .map(|mut lv| {
                        if closed {
                            for i in 0..nodes {
                                if let Some(p) = parents[i] {
                                    lv[i].0 = lv[i].0.max(lv[p].0);
                                }
                            }
                        }
                        lv
                    })
                    .collect();
                World { parents, workers }
            })
    })
}

pub(super) fn build(w: &World) -> KvIndex {
    let mut idx = KvIndex::new();
    for (wi, levels) in w.workers.iter().enumerate() {
        let mut id = 0;
        for (i, &(level, extra)) in levels.iter().enumerate() {
            if level == 3 {
                continue;
            }
            // Parents come first (parent index < child index), in the fastest tier first.
            for t in level..3 {
                if t == level || extra & (1 << t) != 0 {
                    id += 1;
                    let tier = StorageTier::from_index(t as usize).unwrap();
                    let parent = w.parents[i].map(node_hash);
                    let ev = stored(wi as u64, id, tier, parent, &[node_hash(i)]);
                    assert_eq!(idx.apply(&ev), ApplyOutcome::Applied);
                }
            }
        }
    }
    idx
}

/// Root-to-node path, optionally with unknown blocks after it.
pub(super) fn path(w: &World, node: usize, tail: usize) -> Vec<SequenceHash> {
    let mut p = vec![node];
    while let Some(parent) = w.parents[*p.last().unwrap()] {
        p.push(parent);
    }
    p.reverse();
    let mut out: Vec<SequenceHash> = p.into_iter().map(|i| sh(node_hash(i))).collect();
    out.extend((0..tail).map(|i| sh(u64::MAX - i as u64)));
    out
}

proptest! {
    #[test]
    fn bisection_equals_linear_walk_on_closed_states(
        w in world(true),
        queries in proptest::collection::vec((any::<prop::sample::Index>(), 0usize..3), 1..10),
    ) {
        let idx = build(&w);
        for wi in 0..w.workers.len() {
            prop_assert!(!idx.is_non_closed(WorkerId(wi as u64)), "closed stream flagged");
        }
        for (node, tail) in queries {
            let q = path(&w, node.index(w.parents.len()), tail);
            prop_assert_eq!(idx.find_matches(&q), naive(&idx, &q));
        }
    }

    #[test]
    fn arbitrary_stored_streams_are_flagged_or_exact(
        w in world(false),
        queries in proptest::collection::vec((any::<prop::sample::Index>(), 0usize..3), 1..10),
    ) {
        let idx = build(&w);
        for (node, tail) in queries {
            let q = path(&w, node.index(w.parents.len()), tail);
            prop_assert_eq!(idx.find_matches(&q), naive(&idx, &q));
        }
    }
}

/// One step of a random stream against the model.
#[derive(Clone, Debug)]
enum Op {
    Event {
        worker: u64,
        id_delta: i8,
        tier: usize,
        kind: u8,
        blocks: Vec<u64>,
    },
    Dump {
        worker: u64,
        blocks: Vec<(usize, u64)>,
    },
    Remove {
        worker: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let blocks = proptest::collection::vec(0u64..40, 0..6);
    prop_oneof![
        8 => (0u64..5, -1i8..3, 0usize..3, 0u8..5, blocks)
            .prop_map(|(worker, id_delta, tier, kind, blocks)| Op::Event { worker, id_delta, tier, kind, blocks }),
        1 => (0u64..5, proptest::collection::vec((0usize..3, 0u64..40), 0..10))
            .prop_map(|(worker, blocks)| Op::Dump { worker, blocks }),
        1 => (0u64..5).prop_map(|worker| Op::Remove { worker }),
    ]
}

type Model = std::collections::BTreeMap<u64, (u64, [std::collections::BTreeSet<u64>; 3])>;

proptest! {
    // Bookkeeping under arbitrary streams (duplicates, gaps, dumps, removals, many holders
    // per block): the index always equals a plain model, and its internal maps agree.
    #[test]
    fn apply_matches_a_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut idx = KvIndex::new();
        let mut model = Model::new();
        for op in ops {
            match op {
                Op::Event { worker, id_delta, tier, kind, blocks } => {
                    let last = model.get(&worker).map_or(0, |m| m.0);
                    let id = (last as i64 + id_delta as i64).max(0) as u64;
                    let t = StorageTier::from_index(tier).unwrap();
                    let ev = match kind {
                        0..=2 => stored(worker, id, t, blocks.first().map(|b| b + 1), &blocks),
                        3 => removed(worker, id, t, &blocks),
                        _ => cleared(worker, id, t),
                    };
                    let out = idx.apply(&ev);
                    if id <= last {
                        prop_assert_eq!(out, ApplyOutcome::Duplicate);
                    } else if id > last + 1 {
                        prop_assert_eq!(out, ApplyOutcome::Gap { expected: last + 1, got: id });
                    } else {
                        prop_assert_eq!(out, ApplyOutcome::Applied);
                        let m = model.entry(worker).or_default();
                        m.0 = id;
                        match kind {
                            0..=2 => m.1[tier].extend(blocks),
                            3 => blocks.iter().for_each(|b| { m.1[tier].remove(b); }),
                            _ => m.1[tier].clear(),
                        }
                    }
                }
                Op::Dump { worker, blocks } => {
                    let events = blocks
                        .iter()
                        .map(|&(t, b)| stored(worker, 0, StorageTier::from_index(t).unwrap(), None, &[b]))
                        .collect();
                    let dump = KvDump { worker_id: WorkerId(worker), last_event_id: 7, events };
                    idx.replace_worker(&dump).unwrap();
                    prop_assert!(!idx.is_non_closed(WorkerId(worker)));
                    let m = model.entry(worker).or_default();
                    *m = (7, Default::default());
                    for (t, b) in blocks {
                        m.1[t].insert(b);
                    }
                }
                Op::Remove { worker } => {
                    prop_assert_eq!(idx.remove_worker(WorkerId(worker)), model.remove(&worker).is_some());
                }
            }
            idx.check_invariants();
        }
        let mut entries = 0;
        let mut blocks = std::collections::BTreeSet::new();
        for (&w, (last, tiers)) in &model {
            prop_assert_eq!(idx.last_event_id(WorkerId(w)), Some(*last));
            let got = idx.worker_blocks(WorkerId(w)).unwrap();
            for t in StorageTier::ALL {
                let want: std::collections::BTreeSet<SequenceHash> =
                    tiers[t.index()].iter().copied().map(sh).collect();
                prop_assert_eq!(got.tier(t), &want);
                entries += want.len();
                blocks.extend(want);
            }
        }
        // Arbitrary states are not prefix-closed, so answers may be approximate for workers
        // the stream did not flag; they must still be well-formed and never panic.
        for len in [1u64, 2, 5, 17, 40] {
            let q = prompt(0..len);
            let m = idx.find_matches(&q);
            prop_assert!(m.scores.windows(2).all(|p| p[0].0 < p[1].0));
            for (w, c) in m.iter() {
                prop_assert!(c.total() as u64 <= len && c.total() > 0);
                prop_assert!(model.contains_key(&w.0));
            }
        }
        prop_assert_eq!(idx.num_entries(), entries);
        prop_assert_eq!(idx.num_blocks(), blocks.len());
        prop_assert_eq!(idx.workers().map(|w| w.0).collect::<Vec<_>>(), model.keys().copied().collect::<Vec<_>>());
    }
}

/// Long store/remove churn on a few workers sharing blocks: the tier logs are compacted many
/// times (stale entries and repeats of re-stored blocks) and must keep agreeing with the holder
/// lists; `Cleared` and `remove_worker` then walk logs full of stale entries.
#[test]
fn log_compaction_under_churn() {
    let mut idx = KvIndex::new();
    let mut model: [std::collections::BTreeSet<u64>; 3] = Default::default();
    let mut ids = [0u64; 3];
    for i in 0..6_000u64 {
        let w = (i % 3) as usize;
        ids[w] += 1;
        // 300 distinct blocks, shared between workers so that some lists spill.
        let b = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % 300;
        let ev = if model[w].len() < 120 || i % 2 == 0 && !model[w].contains(&b) {
            model[w].insert(b);
            stored(w as u64, ids[w], D, None, &[b])
        } else {
            let victim = *model[w]
                .iter()
                .nth((i as usize / 3) % model[w].len())
                .unwrap();
            model[w].remove(&victim);
            removed(w as u64, ids[w], D, &[victim])
        };
        assert_eq!(idx.apply(&ev), ApplyOutcome::Applied);
        if i % 500 == 0 {
            idx.check_invariants();
        }
    }
    idx.check_invariants();
    for (w, blocks) in model.iter().enumerate() {
        let got = idx.worker_blocks(WorkerId(w as u64)).unwrap().device;
        assert_eq!(got, blocks.iter().copied().map(sh).collect());
    }
    assert_eq!(
        idx.num_entries(),
        model.iter().map(|m| m.len()).sum::<usize>()
    );
    ids[0] += 1;
    idx.apply(&cleared(0, ids[0], D));
    assert!(idx.remove_worker(WorkerId(1)));
    idx.check_invariants();
    assert_eq!(idx.num_entries(), model[2].len());
    assert!(idx.worker_blocks(WorkerId(0)).unwrap().device.is_empty());
}
