use proptest::prelude::*;
use tandem_protocol::{RequestId, SequenceHash, WorkerId};

use super::bs;
use crate::{ActiveSequences, NewSequence, RouterId, SyncMessage, TrackedLoad, TrackerConfig};

const ME: RouterId = RouterId(1);
const PEER: RouterId = RouterId(2);

fn tracker() -> ActiveSequences {
    ActiveSequences::new(
        ME,
        TrackerConfig {
            ttl_ms: 1000,
            tombstone_ms: 1000,
        },
    )
}

fn seq(request: u64, worker: u64, blocks: &[u64], prefill: u64, private: u64) -> NewSequence {
    NewSequence {
        request: RequestId(request),
        worker: WorkerId(worker),
        blocks: blocks.iter().copied().map(SequenceHash).collect(),
        prefill_tokens: prefill,
        private_blocks: private,
    }
}

fn load(prefill: u64, blocks: u64, requests: u64) -> TrackedLoad {
    TrackedLoad {
        active_prefill_tokens: prefill,
        potential_decode_blocks: blocks,
        active_requests: requests,
    }
}

#[test]
fn shared_blocks_count_once_and_leave_with_the_last_holder() {
    let mut t = tracker();
    let w = WorkerId(7);
    t.add(seq(1, 7, &[10, 11, 12], 48, 1), 0);
    t.add(seq(2, 7, &[10, 11, 13], 20, 2), 0);
    // Distinct blocks 10, 11, 12, 13 plus 1 + 2 private.
    assert_eq!(t.load(w), load(68, 7, 2));
    t.prefill_done(RequestId(1), 1);
    assert_eq!(t.load(w), load(20, 7, 2));
    t.free(RequestId(1), 2);
    assert_eq!(t.load(w), load(20, 5, 1));
    t.free(RequestId(2), 3);
    assert_eq!(t.load(w), TrackedLoad::default());
    assert_eq!(t.active_requests(), 0);
    // The same blocks on another worker are that worker's own.
    t.add(seq(3, 8, &[10, 11], 0, 0), 4);
    assert_eq!(t.load(WorkerId(8)), load(0, 2, 1));
    assert_eq!(t.load(w), TrackedLoad::default());
}

#[test]
fn prompts_count_their_shared_prefix_once_whatever_order_they_come_and_go() {
    let mut t = tracker();
    let w = WorkerId(4);
    // Sorted, [1,2,3] and [1,2,4] share 2 blocks, [1,2,4] and [1,5] one: 1..=5 distinct.
    t.add(seq(1, 4, &[1, 2, 4], 0, 0), 0);
    t.add(seq(2, 4, &[1, 5], 0, 0), 0);
    t.add(seq(3, 4, &[1, 2, 3], 0, 0), 0);
    assert_eq!(t.load(w).potential_decode_blocks, 5);
    // The same prompt twice adds nothing; its blocks stay until both leave.
    t.add(seq(4, 4, &[1, 2, 3], 0, 0), 0);
    assert_eq!(t.load(w).potential_decode_blocks, 5);
    t.free(RequestId(3), 1);
    assert_eq!(t.load(w).potential_decode_blocks, 5);
    t.free(RequestId(1), 1);
    assert_eq!(t.load(w).potential_decode_blocks, 4, "1, 2, 3 and 5");
    t.free(RequestId(4), 1);
    assert_eq!(t.load(w).potential_decode_blocks, 2, "1 and 5");
    t.free(RequestId(2), 1);
    assert_eq!(t.load(w).potential_decode_blocks, 0);
    // Hashes that do not chain (a malformed peer message) count their distinct prefixes,
    // and leave nothing behind.
    t.add(seq(5, 4, &[7, 8], 0, 0), 2);
    t.add(seq(6, 4, &[9, 8], 0, 0), 2);
    assert_eq!(t.load(w).potential_decode_blocks, 4);
    t.free(RequestId(5), 3);
    t.free(RequestId(6), 3);
    assert_eq!(t.load(w), TrackedLoad::default());
}

#[test]
fn private_blocks_cover_the_partial_block_and_the_expected_output() {
    // 40 prompt tokens (2 full blocks of 16) + 30 output: 70 tokens need 5 blocks, 3 private.
    assert_eq!(NewSequence::private_blocks_for(40, 30, bs(16)), 3);
    assert_eq!(NewSequence::private_blocks_for(32, 0, bs(16)), 0);
    assert_eq!(NewSequence::private_blocks_for(33, 0, bs(16)), 1);
}

#[test]
fn peer_messages_are_idempotent_and_own_echoes_ignored() {
    let mut mine = tracker();
    let mut peer = ActiveSequences::new(
        PEER,
        TrackerConfig {
            ttl_ms: 1000,
            tombstone_ms: 1000,
        },
    );
    let add = peer.add(seq(1, 3, &[1, 2], 32, 0), 0);
    assert_eq!(add.router(), PEER);
    assert!(mine.apply(&add, 0));
    assert!(!mine.apply(&add, 0), "a duplicate add changes nothing");
    assert_eq!(mine.load(WorkerId(3)), load(32, 2, 1));
    // Our own message echoed back by the event plane is ignored.
    let own = mine.add(seq(1, 3, &[1, 2], 32, 0), 0);
    assert_eq!(mine.load(WorkerId(3)), load(64, 2, 2));
    assert!(!mine.apply(&own, 0));
    assert_eq!(mine.load(WorkerId(3)), load(64, 2, 2));
    // A free of an unknown request is harmless.
    let unknown = SyncMessage::Free {
        router: PEER,
        request: RequestId(99),
    };
    assert!(!mine.apply(&unknown, 0));
    let free = peer.free(RequestId(1), 5);
    assert!(mine.apply(&free, 5));
    assert!(!mine.apply(&free, 5));
    // Replaying the add after its free does not resurrect the request.
    assert!(!mine.apply(&add, 6));
    assert_eq!(mine.load(WorkerId(3)), load(32, 2, 1));
    // Nor does a late add whose free came first.
    let early_free = SyncMessage::Free {
        router: PEER,
        request: RequestId(2),
    };
    mine.apply(&early_free, 7);
    mine.apply(&peer.add(seq(2, 3, &[9], 1, 0), 7), 7);
    assert_eq!(mine.load(WorkerId(3)), load(32, 2, 1));
}

#[test]
fn stale_sequences_expire_and_tombstones_are_forgotten() {
    let mut t = tracker(); // TTL 1000
    t.add(seq(1, 1, &[1], 10, 0), 0);
    t.add(seq(2, 1, &[2], 10, 0), 500);
    t.expire(999);
    assert_eq!(t.load(WorkerId(1)).active_requests, 2);
    t.expire(1000);
    assert_eq!(t.load(WorkerId(1)), load(10, 1, 1), "the first add expired");
    t.free(RequestId(2), 1200);
    assert_eq!(t.len(), 2, "two tombstones");
    t.expire(2200);
    assert!(t.is_empty());
    // A clock that goes backwards is treated as the latest time seen.
    t.add(seq(3, 1, &[1], 10, 0), 100);
    t.expire(3199);
    assert_eq!(t.active_requests(), 1, "added at 2200, not 100");
    t.expire(3200);
    assert_eq!(t.active_requests(), 0);
    assert_eq!(t.len(), 1, "expired into a tombstone");
}

#[test]
fn a_removed_worker_leaves_nothing_behind() {
    let mut t = tracker();
    t.add(seq(1, 1, &[1, 2], 10, 1), 0);
    t.add(seq(2, 2, &[1], 10, 1), 0);
    t.remove_worker(WorkerId(1));
    assert_eq!(t.load(WorkerId(1)), TrackedLoad::default());
    assert_eq!(t.load(WorkerId(2)), load(10, 2, 1));
    t.free(RequestId(1), 1);
    assert_eq!(t.active_requests(), 1);
}

#[test]
fn sync_messages_round_trip_through_serde() {
    let m = SyncMessage::Add {
        router: PEER,
        request: RequestId(5),
        worker: WorkerId(6),
        blocks: vec![SequenceHash(1), SequenceHash(u64::MAX)],
        prefill_tokens: 7,
        private_blocks: 8,
    };
    let json = serde_json::to_string(&m).unwrap();
    assert_eq!(serde_json::from_str::<SyncMessage>(&json).unwrap(), m);
    let f = SyncMessage::PrefillDone {
        router: PEER,
        request: RequestId(5),
    };
    assert_eq!(
        serde_json::from_str::<SyncMessage>(&serde_json::to_string(&f).unwrap()).unwrap(),
        f
    );
}

/// One peer request's life: how far it got.
#[derive(Clone, Debug)]
struct Life {
    router: u64,
    worker: u64,
    blocks: Vec<u64>,
    prefill: u64,
    private: u64,
    prefill_done: bool,
    freed: bool,
}

fn life() -> impl Strategy<Value = Life> {
    (
        1u64..4,
        0u64..3,
        proptest::collection::vec(0u64..6, 0..5),
        0u64..100,
        0u64..4,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(router, worker, blocks, prefill, private, prefill_done, freed)| {
                // Sequence hashes chain: a prompt's i-th hash names its first i + 1 blocks
                // (here the path of choices, in base 4 with digits 1..=3), so prompts share
                // exactly their common prefix.
                let blocks = blocks
                    .iter()
                    .scan(0u64, |h, &c| {
                        *h = *h * 4 + c % 3 + 1;
                        Some(*h)
                    })
                    .collect();
                Life {
                    router,
                    worker,
                    blocks,
                    prefill,
                    private,
                    prefill_done,
                    freed,
                }
            },
        )
}

fn messages(lives: &[Life]) -> Vec<SyncMessage> {
    let mut out = Vec::new();
    for (i, l) in lives.iter().enumerate() {
        let (router, request) = (RouterId(l.router), RequestId(i as u64));
        out.push(SyncMessage::Add {
            router,
            request,
            worker: WorkerId(l.worker),
            blocks: l.blocks.iter().copied().map(SequenceHash).collect(),
            prefill_tokens: l.prefill,
            private_blocks: l.private,
        });
        if l.prefill_done {
            out.push(SyncMessage::PrefillDone { router, request });
        }
        if l.freed {
            out.push(SyncMessage::Free { router, request });
        }
    }
    out
}

fn loads(t: &ActiveSequences) -> Vec<TrackedLoad> {
    (0..3).map(|w| t.load(WorkerId(w))).collect()
}

proptest! {
    #[test]
    fn any_interleaving_with_duplicates_gives_the_same_loads(
        lives in proptest::collection::vec(life(), 0..24),
        order in proptest::collection::vec(any::<u64>(), 0..200),
        dups in proptest::collection::vec(any::<u16>(), 0..40),
    ) {
        let msgs = messages(&lives);
        // Reference: each message once, in causal order.
        let mut once = tracker();
        for m in &msgs {
            once.apply(m, 0);
        }
        // The same messages plus duplicates, in a shuffled order.
        let mut shuffled: Vec<SyncMessage> = msgs.clone();
        for d in &dups {
            if !msgs.is_empty() {
                shuffled.push(msgs[usize::from(*d) % msgs.len()].clone());
            }
        }
        let mut keyed: Vec<(u64, SyncMessage)> = shuffled
            .into_iter()
            .enumerate()
            .map(|(i, m)| (order.get(i).copied().unwrap_or(i as u64), m))
            .collect();
        keyed.sort_by_key(|(k, _)| *k);
        let mut any = tracker();
        for (_, m) in &keyed {
            any.apply(m, 0);
        }
        prop_assert_eq!(loads(&any), loads(&once));
        // And the loads are what the lives say, counted by hand (router 1 is us: ignored).
        for w in 0..3u64 {
            let live: Vec<&Life> = lives
                .iter()
                .filter(|l| l.router != ME.0 && l.worker == w && !l.freed)
                .collect();
            let mut distinct: Vec<u64> = live.iter().flat_map(|l| l.blocks.clone()).collect();
            distinct.sort_unstable();
            distinct.dedup();
            let pending: u64 = live.iter().filter(|l| !l.prefill_done).map(|l| l.prefill).sum();
            let private: u64 = live.iter().map(|l| l.private).sum();
            let want = TrackedLoad {
                active_prefill_tokens: pending,
                potential_decode_blocks: distinct.len() as u64 + private,
                active_requests: live.len() as u64,
            };
            prop_assert_eq!(any.load(WorkerId(w)), want);
        }
    }
}

#[test]
fn finished_requests_are_forgotten_after_the_tombstone_time_not_the_ttl() {
    let mut t = ActiveSequences::new(
        ME,
        TrackerConfig {
            ttl_ms: 600_000,
            tombstone_ms: 1000,
        },
    );
    // A long-lived request keeps its place in the TTL queue ahead of everything.
    t.add(seq(0, 7, &[1, 2], 10, 1), 0);
    for i in 1..=1000u64 {
        t.add(seq(i, 7, &[100 + i, 200 + i], 32, 1), i);
        t.free(RequestId(i), i);
    }
    assert_eq!(t.len(), 1001);
    t.expire(1000 + 1000);
    // The tombstones went after 1 s although the first request's TTL is 10 minutes away.
    assert_eq!(t.len(), 1);
    assert_eq!(t.load(WorkerId(7)), load(10, 3, 1));
    // A late add from a peer for a freed request is neither counted nor kept.
    let mut p = ActiveSequences::new(
        PEER,
        TrackerConfig {
            ttl_ms: 600_000,
            tombstone_ms: 1000,
        },
    );
    let msgs = [p.add(seq(5, 8, &[9], 16, 1), 0), p.free(RequestId(5), 1)];
    t.apply(&msgs[1], 2001);
    t.apply(&msgs[0], 2002);
    assert_eq!(t.load(WorkerId(8)), TrackedLoad::default());
    t.expire(3002);
    assert_eq!(t.len(), 1);
}

#[test]
fn the_expiry_queue_is_bounded_by_what_is_tracked() {
    let mut t = ActiveSequences::new(
        ME,
        TrackerConfig {
            ttl_ms: 600_000,
            tombstone_ms: 10,
        },
    );
    for i in 0..100_000u64 {
        t.add(seq(i, 7, &[i], 16, 1), i);
        t.free(RequestId(i), i);
        t.expire(i);
    }
    // 100,000 requests in 100 s of a 10-minute TTL: the tombstones are gone, and so are
    // their queue items.
    assert!(t.len() <= 20, "{}", t.len());
    assert!(
        t.expiry_len() <= 2 * t.len() + 1024 + 1,
        "{}",
        t.expiry_len()
    );
}
