//! find_matches against find_extents on synthetic states: 1,000 workers that all hold one
//! shared 32-block system prompt, each followed by its own conversation of 224 blocks, queried
//! with one worker's 256-block prompt (the shape of the Mooncake conversation trace); three
//! nested shared prefixes (1,000 workers share 32 blocks, 500 of them 64, one holds 256); and
//! the same query when a single worker holds the prompt.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tandem_indexer::KvIndex;
use tandem_protocol::{
    KvEvent, KvEventKind, LocalBlockHash, SequenceHash, StorageTier, StoredBlock, WorkerId,
};

fn chain(prefix: &[u64], own: u64, len: usize) -> Vec<u64> {
    let mut v = prefix.to_vec();
    v.extend((0..len as u64).map(|i| (own << 20) | (i + 1)));
    v
}

fn store(index: &mut KvIndex, worker: u64, blocks: &[u64]) {
    let ev = KvEvent {
        worker_id: WorkerId(worker),
        event_id: index.last_event_id(WorkerId(worker)).unwrap_or(0) + 1,
        tier: StorageTier::Device,
        kind: KvEventKind::Stored {
            parent: None,
            blocks: blocks
                .iter()
                .map(|&h| StoredBlock {
                    sequence_hash: SequenceHash(h),
                    local_hash: LocalBlockHash(h),
                })
                .collect(),
        },
    };
    index.apply(&ev);
}

fn bench(c: &mut Criterion) {
    let system: Vec<u64> = (0..32).map(|i| 0xabc0_0000 + i).collect();
    let mut shared = KvIndex::new();
    for w in 0..1000u64 {
        store(&mut shared, w, &chain(&system, w + 1, 224));
    }
    let q: Vec<SequenceHash> = chain(&system, 501, 224)
        .into_iter()
        .map(SequenceHash)
        .collect();
    assert_eq!(shared.find_matches(&q).len(), 1000);
    assert_eq!(shared.find_extents(&q).len(), 2);
    c.bench_function("find_matches/1000 workers share 32 of 256 blocks", |b| {
        b.iter(|| black_box(shared.find_matches(black_box(&q))))
    });
    c.bench_function("find_extents/1000 workers share 32 of 256 blocks", |b| {
        b.iter(|| black_box(shared.find_extents(black_box(&q)).len()))
    });

    // 1,000 workers share 32 blocks, the even ones 32 more, worker 500 its own 192 after that.
    let mut nested = KvIndex::new();
    let second: Vec<u64> = (0..32).map(|i| 0xdef0_0000 + i).collect();
    for w in 0..1000u64 {
        let mut blocks = system.clone();
        if w % 2 == 0 {
            blocks.extend(&second);
        }
        if w == 500 {
            blocks.extend(chain(&[], w + 1, 192));
        }
        store(&mut nested, w, &blocks);
    }
    let qn: Vec<SequenceHash> = system
        .iter()
        .chain(&second)
        .copied()
        .chain(chain(&[], 501, 192))
        .map(SequenceHash)
        .collect();
    assert_eq!(nested.find_matches(&qn).len(), 1000);
    assert_eq!(nested.find_extents(&qn).len(), 3);
    c.bench_function(
        "find_matches/1000, 500, 1 workers share 32, 64, 256 blocks",
        |b| b.iter(|| black_box(nested.find_matches(black_box(&qn)))),
    );
    c.bench_function(
        "find_extents/1000, 500, 1 workers share 32, 64, 256 blocks",
        |b| b.iter(|| black_box(nested.find_extents(black_box(&qn)).len())),
    );

    let mut single = KvIndex::new();
    for w in 0..1000u64 {
        store(&mut single, w, &chain(&[], w + 1, 256));
    }
    let q1: Vec<SequenceHash> = chain(&[], 501, 256).into_iter().map(SequenceHash).collect();
    assert_eq!(single.find_matches(&q1).len(), 1);
    c.bench_function("find_matches/1 of 1000 workers holds 256 blocks", |b| {
        b.iter(|| black_box(single.find_matches(black_box(&q1))))
    });
    c.bench_function("find_extents/1 of 1000 workers holds 256 blocks", |b| {
        b.iter(|| black_box(single.find_extents(black_box(&q1)).len()))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
