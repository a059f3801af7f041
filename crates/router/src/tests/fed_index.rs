//! [`FedIndex`]: the index a standalone indexer holds is the one a routing replica fed the
//! same inputs holds, and the repairs each asks for are the same.

use tandem_indexer::RepairReply;
use tandem_protocol::{KvDump, LoadReport, SequenceHash, WorkerId, WorkerRole};

use super::replica::{BS, prompt, replica, stored};
use crate::{FedIndex, Input, KvSource, RoutingConfig};

#[test]
fn an_index_alone_keeps_what_the_replica_keeps() {
    let mut routing = replica(RoutingConfig::default());
    let mut alone = FedIndex::new();
    let (_, a) = prompt(4 * BS, 1);
    let (_, b) = prompt(4 * BS, 2);
    let report = |worker: u64, last_kv_event_id: u64| LoadReport {
        worker_id: WorkerId(worker),
        last_kv_event_id,
        ..LoadReport::default()
    };
    let (r1, r2) = (report(1, 9), report(2, 5));
    let dump = KvDump {
        worker_id: WorkerId(1),
        last_event_id: 1,
        events: vec![stored(1, 1, &a[..2])],
    };
    let next = [stored(1, 2, &a[2..])];
    let approximate = [stored(2, 1, &b)];
    let gap = [stored(1, 5, &b)];
    let inputs = [
        Input::Joined {
            worker: WorkerId(1),
            role: WorkerRole::Decode,
            kv: KvSource::Events,
            device_blocks: 0,
        },
        Input::Joined {
            worker: WorkerId(2),
            role: WorkerRole::Prefill,
            kv: KvSource::Approximate,
            device_blocks: 0,
        },
        Input::Repaired {
            worker: WorkerId(1),
            reply: RepairReply::Dump(dump),
        },
        Input::KvEvents(&next),
        // An approximate worker's events are dropped, its report says nothing.
        Input::KvEvents(&approximate),
        Input::LoadReport(&r2),
        // A gap: events from 3 to 4 missing.
        Input::KvEvents(&gap),
        Input::RepairFailed {
            worker: WorkerId(1),
        },
        // Reports of events past what was applied: the first may have overtaken the events
        // it counts; when the next still does, asked again.
        Input::LoadReport(&r1),
        Input::LoadReport(&r1),
        Input::Left {
            worker: WorkerId(1),
        },
    ];
    let held = |feed: &tandem_indexer::IndexFeed, hashes: &[SequenceHash]| {
        let scores = feed.find_matches(hashes);
        let mut v: Vec<_> = scores.iter().map(|(w, s)| (*w, s.device)).collect();
        v.sort();
        v
    };
    let mut seen = Vec::new();
    for (i, input) in inputs.into_iter().enumerate() {
        let want = routing.apply(input.clone(), i as u64).unwrap();
        let got = alone.apply(input).unwrap();
        assert_eq!(got, want, "input {i}");
        for hashes in [&a, &b] {
            assert_eq!(
                held(alone.feed(), hashes),
                held(routing.feed(), hashes),
                "input {i}"
            );
        }
        seen.push((held(alone.feed(), &a), got.len()));
    }
    // What happened along the way: the dump and the next events put all of `a` on worker 1,
    // the gap and the report asked for repairs, and the leave purged it.
    assert_eq!(seen[0].1, 1, "a joining event worker is dumped");
    assert_eq!(seen[1].1, 0, "an approximate worker is not");
    assert_eq!(seen[3].0, vec![(WorkerId(1), 4)]);
    assert_eq!(seen[6].1, 1, "a gap asks for a repair");
    assert_eq!(seen[8].1, 0, "one report may overtake its events");
    assert_eq!(
        seen[9].1, 1,
        "a report still past the applied events asks again"
    );
    assert!(seen[10].0.is_empty(), "a worker that left holds nothing");
}
