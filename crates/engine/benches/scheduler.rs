//! One engine step (`begin_step` + `finish_step`) of the mock engine:
//! - 256 running sequences decoding one token each (256-token prompts), with and without KV
//!   bytes in the arena;
//! - a mixed step: 128 decoding sequences plus a new request's 2048-token prefill chunk.
//!
//! Sequences grow by one token per step, so the engine is rebuilt (outside the timed region)
//! every 500 steps to keep the measured state the same.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tandem_engine::{BlockPoolConfig, EngineRequest, KvShape, MockEngine, MockEngineConfig};
use tandem_protocol::{RequestId, WorkerId};

const REBUILD_EVERY: u32 = 500;

/// Distinct ids give distinct first tokens, so no two prompts share a cached block.
fn prompt(id: u64, len: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..len as u64)
        .map(|i| ((id * 7919 + i * 31) % 32000) as u32)
        .collect();
    p[0] = id as u32;
    p
}

/// An engine with `seqs` requests all past their prefill.
fn decoding_engine(seqs: u64, shape: KvShape) -> (MockEngine, u64) {
    let mut cfg = MockEngineConfig::new(BlockPoolConfig::new(WorkerId(1), 16384));
    cfg.mocker.kv_shape = shape;
    let mut e = MockEngine::new(cfg).expect("valid config");
    for id in 0..seqs {
        e.add_request(EngineRequest::new(RequestId(id), prompt(id, 256), 1000), 0)
            .expect("fits");
    }
    let mut now = 0;
    while e.plan().decode_tokens < seqs as usize {
        let s = e.begin_step(now).expect("work queued");
        now += s.duration_us();
        e.finish_step(now);
    }
    (e, now)
}

fn timed_steps(
    iters: u64,
    mut build: impl FnMut() -> (MockEngine, u64),
    mut before: impl FnMut(&mut MockEngine, u64, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let (mut e, mut now) = build();
    let mut since = 0;
    for i in 0..iters {
        if since == REBUILD_EVERY {
            (e, now) = build();
            since = 0;
        }
        before(&mut e, now, i);
        let t = Instant::now();
        let s = e.begin_step(now).expect("work queued");
        now += s.duration_us();
        black_box(e.finish_step(now));
        total += t.elapsed();
        since += 1;
    }
    total
}

fn decode_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("step");
    for (name, shape) in [
        ("timing_only", KvShape::TIMING_ONLY),
        ("kv_bytes", KvShape::MOCKER_DEFAULT),
    ] {
        g.bench_function(format!("decode_256/{name}"), |b| {
            b.iter_custom(|iters| timed_steps(iters, || decoding_engine(256, shape), |_, _, _| {}))
        });
    }
    for (name, shape) in [
        ("timing_only", KvShape::TIMING_ONLY),
        ("kv_bytes", KvShape::MOCKER_DEFAULT),
    ] {
        g.bench_function(format!("mixed_128_decode_2048_prefill/{name}"), |b| {
            b.iter_custom(|iters| {
                timed_steps(
                    iters,
                    || decoding_engine(128, shape),
                    |e, now, i| {
                        // A fresh prompt each step (no cache hit), done after its first token.
                        let id = 1_000_000 + i;
                        let r = EngineRequest::new(RequestId(id), prompt(id, 2048), 1);
                        e.add_request(r, now).expect("fits");
                    },
                )
            })
        });
    }
    g.finish();
}

criterion_group!(benches, decode_steps);
criterion_main!(benches);
