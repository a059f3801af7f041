//! The block pool's allocate/free path: a 64-block sequence (1024 tokens) whose first 32
//! blocks are cached, on a 16k-block pool. Each iteration acquires the cached prefix,
//! allocates the rest, commits all 64 blocks and frees the sequence. The tail blocks are new
//! every iteration, so once the pool is full each iteration also evicts 32 LRU blocks: the
//! steady state of a busy worker.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tandem_engine::pool::synthetic_hash;
use tandem_engine::{BlockPool, BlockPoolConfig};
use tandem_protocol::{BlockHashes, RequestId, WorkerId};

const BLOCKS: usize = 64;
const BLOCK_SIZE: usize = 16;

fn pool_cycle(c: &mut Criterion) {
    let mut pool = BlockPool::new(BlockPoolConfig::new(WorkerId(1), 16384)).expect("valid pool");
    let mut hashes: Vec<BlockHashes> = (0..BLOCKS as u64)
        .map(|i| synthetic_hash(i + 1, i + 1))
        .collect();
    // Cache the shared half once.
    let warm = RequestId(0);
    pool.acquire_prefix(warm, &hashes, 0).expect("new sequence");
    pool.allocate(warm, BLOCKS / 2 * BLOCK_SIZE).expect("room");
    pool.commit(warm, &hashes[..BLOCKS / 2])
        .expect("table holds them");
    pool.free(warm).expect("known");
    let mut n = 1u64;
    c.bench_function(
        "pool/acquire_allocate_commit_free/64_blocks_half_cached",
        |b| {
            b.iter(|| {
                n += 1;
                for (j, h) in hashes[BLOCKS / 2..].iter_mut().enumerate() {
                    let v = (n << 8) | j as u64;
                    *h = synthetic_hash(v, v);
                }
                let seq = RequestId(n);
                let hit = pool
                    .acquire_prefix(seq, &hashes, BLOCKS)
                    .expect("new sequence");
                pool.allocate(seq, BLOCKS * BLOCK_SIZE).expect("room");
                pool.commit(seq, &hashes).expect("table holds them");
                pool.free(seq).expect("known");
                black_box(hit)
            })
        },
    );
    assert!(pool.check_invariants().is_ok());
}

criterion_group!(benches, pool_cycle);
criterion_main!(benches);
