//! Mocker and `MockEngine` tests: timing, determinism, cache hits, corruption, pressure.

use std::collections::BTreeMap;

use tandem_protocol::{BlockSize, HashSeed, RequestId, WorkerId};

use super::*;
use crate::engine::{EngineError, MockEngine, MockEngineConfig};
use crate::pool::BlockPoolConfig;
use crate::scheduler::{
    EngineRequest, FinishReason, RequestOutput, SchedulerConfig, TokenLogprobs,
};

pub(super) fn engine(
    device_blocks: u32,
    bs: u32,
    sched: SchedulerConfig,
    shape: KvShape,
) -> MockEngine {
    let mut pool = BlockPoolConfig::new(WorkerId(3), device_blocks);
    pool.block_size = BlockSize::new(bs).unwrap();
    let mut cfg = MockEngineConfig::new(pool);
    cfg.scheduler = sched;
    cfg.mocker.kv_shape = shape;
    MockEngine::new(cfg).unwrap()
}

fn small(device_blocks: u32) -> MockEngine {
    engine(
        device_blocks,
        4,
        SchedulerConfig::default(),
        KvShape::MOCKER_DEFAULT,
    )
}

pub(super) fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed.wrapping_mul(7919) + i * 31) % 32000)
        .collect()
}

pub(super) fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    let mut r = EngineRequest::new(RequestId(id), prompt, max_tokens);
    r.sampling_seed = 42;
    r
}

/// Runs the engine until idle, checking the pool after every step; tokens per request.
pub(super) fn drain(e: &mut MockEngine, now: &mut u64) -> BTreeMap<RequestId, Vec<u32>> {
    let mut out: BTreeMap<RequestId, Vec<u32>> = BTreeMap::new();
    for _ in 0..100_000 {
        let Some(step) = e.begin_step(*now) else {
            assert!(!e.has_work(), "idle with work queued");
            return out;
        };
        *now += step.duration_us();
        for o in e.finish_step(*now) {
            out.entry(o.id).or_default().push(o.token);
        }
        e.pool().check_invariants().unwrap();
    }
    panic!("engine did not drain");
}

fn run_one(e: &mut MockEngine, r: EngineRequest) -> Vec<u32> {
    let id = r.id;
    let mut now = 0;
    e.add_request(r, now).unwrap();
    drain(e, &mut now).remove(&id).unwrap()
}

#[test]
fn timing_formula_matches_hand_computed_values() {
    let t = TimingModel::default();
    // 4.209989e-7·1e6 + 1.518344e-2·1000 + 16.50142 = 0.4209989 + 15.18344 + 16.50142
    assert!((t.prefill_ms(1000) - 32.1058589).abs() < 1e-9);
    assert_eq!(t.prefill_ms(0), 0.0);
    // −25.74·0.25 + 54.01·0.5 + 5.74 = −6.435 + 27.005 + 5.74
    assert!((t.decode_ms(0.5) - 26.31).abs() < 1e-9);
    assert!((t.decode_ms(0.0) - 5.74).abs() < 1e-12);
    assert!((t.decode_ms(1.0) - 34.01).abs() < 1e-9);
    // At p = 3 the polynomial is negative (−231.66 + 162.03 + 5.74): the floor holds.
    assert_eq!(t.decode_ms(3.0), 1.0);
    assert!((t.step_ms(1000, true, 0.5, 2.0) - (32.1058589 + 26.31) / 2.0).abs() < 1e-9);
    assert_eq!(t.step_ms(0, false, 0.5, 1.0), 0.0);
}

#[test]
fn engine_steps_take_the_modelled_time() {
    // 100 blocks × 4 tokens = 400 KV tokens of capacity.
    let mut e = small(100);
    e.add_request(request(1, prompt(1, 100), 3), 0).unwrap();
    let s = e.begin_step(0).unwrap();
    assert!((s.duration_ms - TimingModel::default().prefill_ms(100)).abs() < 1e-12);
    assert_eq!(s.duration_us(), 18_024); // 0.004209989 + 1.518344 + 16.50142 ms
    e.finish_step(18_024);
    let s = e.begin_step(18_024).unwrap();
    // Decode of token 101: the running request attends over 101 KV tokens of 400.
    assert_eq!(
        (s.prefill_tokens, s.decode_tokens, s.kv_tokens),
        (0, 1, 101)
    );
    assert!((s.duration_ms - TimingModel::default().decode_ms(101.0 / 400.0)).abs() < 1e-12);

    let mut cfg = MockEngineConfig::new(BlockPoolConfig::new(WorkerId(1), 10));
    cfg.mocker.speedup_ratio = 0.0;
    assert!(matches!(
        MockEngine::new(cfg),
        Err(EngineError::InvalidConfig(_))
    ));
}

#[test]
fn identical_prompts_give_identical_tokens_across_engines() {
    let a = run_one(&mut small(64), request(1, prompt(5, 23), 12));
    let b = run_one(&mut small(64), request(9, prompt(5, 23), 12));
    assert_eq!(a, b);
    assert_eq!(a.len(), 12);
    let c = run_one(&mut small(64), request(1, prompt(6, 23), 12));
    assert_ne!(a, c, "a different prompt gives different tokens");
    let mut r = request(1, prompt(5, 23), 12);
    r.sampling_seed = 43;
    assert_ne!(
        a,
        run_one(&mut small(64), r),
        "a different sampling seed too"
    );
    let mut r = request(1, prompt(5, 23), 12);
    r.hash_seed = HashSeed::from_salt(Some(b"tenant"));
    assert_ne!(
        a,
        run_one(&mut small(64), r),
        "and a different cache namespace"
    );
}

#[test]
fn a_prefix_cache_hit_gives_the_cold_run_tokens() {
    let mut e = small(64);
    let cold = run_one(&mut e, request(1, prompt(5, 23), 8));
    let mut now = 0;
    e.add_request(request(2, prompt(5, 23), 8), now).unwrap();
    let first = e.begin_step(now).unwrap();
    assert_eq!(
        first.prefill_tokens, 3,
        "20 of 23 tokens come from the cache"
    );
    now += first.duration_us();
    let outs = e.finish_step(now);
    assert_eq!(outs[0].cached_tokens, 20);
    let mut warm = vec![outs[0].token];
    warm.extend(drain(&mut e, &mut now).remove(&RequestId(2)).unwrap());
    assert_eq!(warm, cold);
}

#[test]
fn corrupting_a_cached_block_changes_the_tokens() {
    let mut e = small(64);
    let cold = run_one(&mut e, request(1, prompt(5, 23), 8));
    // Flip one byte of the prompt's second block where it sits in the cache.
    let hashes = tandem_protocol::hashing::compute_block_hashes(
        &prompt(5, 23),
        BlockSize::new(4).unwrap(),
        HashSeed::UNSALTED,
    );
    let probe = RequestId(99);
    e.pool_mut().acquire_prefix(probe, &hashes, 2).unwrap();
    let block = e.pool().block_table(probe).unwrap()[1];
    e.pool_mut().free(probe).unwrap();
    e.pool_mut()
        .device_arena_mut()
        .with_block_mut(block, |b| b[77] ^= 1);
    let warm = run_one(&mut e, request(2, prompt(5, 23), 8));
    assert_ne!(warm, cold);
    assert!(
        e.stats().cached_tokens >= 20,
        "the corrupted block was reused, not recomputed"
    );
}

#[test]
fn chunked_prefill_spreads_a_long_prompt_and_keeps_its_tokens() {
    let whole = run_one(&mut small(128), request(1, prompt(8, 300), 5));
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 64,
        ..Default::default()
    };
    let mut e = engine(128, 4, cfg, KvShape::MOCKER_DEFAULT);
    e.add_request(request(1, prompt(8, 300), 5), 0).unwrap();
    let mut now = 0;
    let mut prefill_steps = 0;
    let mut tokens = Vec::new();
    while let Some(s) = e.begin_step(now) {
        assert!(s.prefill_tokens + s.decode_tokens <= 64);
        prefill_steps += usize::from(s.prefill_tokens > 0);
        now += s.duration_us();
        tokens.extend(e.finish_step(now).iter().map(|o| o.token));
    }
    assert_eq!(prefill_steps, 5, "300 tokens in chunks of 64");
    assert_eq!(tokens, whole);
}

#[test]
fn max_num_seqs_is_respected() {
    let cfg = SchedulerConfig {
        max_num_seqs: 4,
        ..Default::default()
    };
    let mut e = engine(256, 4, cfg, KvShape::MOCKER_DEFAULT);
    for id in 0..12 {
        e.add_request(request(id, prompt(id as u32, 9), 6), 0)
            .unwrap();
    }
    let mut now = 0;
    while let Some(s) = e.begin_step(now) {
        assert!(s.num_requests <= 4 && e.num_running() <= 4);
        now += s.duration_us();
        e.finish_step(now);
    }
    assert_eq!(e.stats().finished, 12);
}

#[test]
fn preemption_under_pressure_keeps_every_token() {
    let reqs: Vec<EngineRequest> = (0..8)
        .map(|i| request(i, prompt(i as u32 % 3, 14 + i as usize), 20))
        .collect();
    let mut roomy = small(512);
    let mut tight = small(24);
    let mut now = (0, 0);
    for r in &reqs {
        roomy.add_request(r.clone(), 0).unwrap();
        tight.add_request(r.clone(), 0).unwrap();
    }
    let expected = drain(&mut roomy, &mut now.0);
    let got = drain(&mut tight, &mut now.1);
    assert_eq!(roomy.stats().preemptions, 0);
    assert!(
        tight.stats().preemptions > 0,
        "24 blocks cannot hold 8 growing requests"
    );
    assert_eq!(got, expected);
    assert!(got.values().all(|t| t.len() == 20));
    assert_eq!(tight.pool().active_blocks(), 0);
}

#[test]
fn abort_leaves_no_active_blocks() {
    let mut e = small(64);
    for id in 0..4 {
        e.add_request(request(id, prompt(id as u32, 17), 50), 0)
            .unwrap();
    }
    let mut now = 0;
    for _ in 0..3 {
        now += e.begin_step(now).unwrap().duration_us();
        e.finish_step(now);
    }
    e.begin_step(now).unwrap();
    for id in 0..4 {
        assert!(e.abort(RequestId(id)));
    }
    assert!(e.finish_step(now + 1).is_empty());
    assert_eq!(e.pool().active_blocks(), 0);
    assert!(!e.has_work());
    assert!(e.begin_step(now + 2).is_none());
    e.pool().check_invariants().unwrap();
}

#[test]
fn stop_token_and_max_tokens_end_requests() {
    let mut e = small(64);
    let free_run = run_one(&mut e, request(1, prompt(2, 10), 12));
    assert_eq!(free_run.len(), 12);
    let stop = free_run[4];
    let first_stop = free_run.iter().position(|&t| t == stop).unwrap();
    let mut r = request(2, prompt(2, 10), 12);
    r.stop_token = Some(stop);
    e.add_request(r, 0).unwrap();
    let mut now = 0;
    let mut outs: Vec<RequestOutput> = Vec::new();
    while let Some(s) = e.begin_step(now) {
        now += s.duration_us();
        outs.extend(e.finish_step(now));
    }
    assert_eq!(outs.len(), first_stop + 1);
    assert_eq!(outs.last().unwrap().finish, Some(FinishReason::Stop));
    assert!(outs.iter().all(|o| o.token < 32000));
}

#[test]
fn timing_only_mode_writes_nothing_and_stays_deterministic() {
    let mk = || engine(64, 16, SchedulerConfig::default(), KvShape::TIMING_ONLY);
    let mut e = mk();
    assert!(e.pool().device_arena().len_bytes() == 0);
    let a = run_one(&mut e, request(1, prompt(4, 40), 10));
    assert_eq!(a, run_one(&mut mk(), request(2, prompt(4, 40), 10)));
    // A prefix hit (the first two blocks) gives the same tokens here too.
    assert_eq!(a, run_one(&mut e, request(3, prompt(4, 40), 10)));
    assert_ne!(a, run_one(&mut e, request(4, prompt(5, 40), 10)));
}

#[test]
fn kv_bytes_depend_on_the_prefix_only() {
    // Two sequences share their first 8 tokens: their first two blocks hold equal bytes,
    // whether computed in one chunk or several.
    let mut shared = prompt(3, 8);
    let mut a = shared.clone();
    a.extend([1, 2, 3]);
    shared.extend([4, 5, 6]);
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 3,
        ..Default::default()
    };
    let mut e1 = engine(16, 4, SchedulerConfig::default(), KvShape::MOCKER_DEFAULT);
    let mut e2 = engine(16, 4, cfg, KvShape::MOCKER_DEFAULT);
    run_one(&mut e1, request(1, a, 1));
    run_one(&mut e2, request(1, shared, 1));
    // Blocks are handed out from 0 up: the prompt's blocks are 0, 1 and 2 in both engines.
    let bytes = |e: &MockEngine, i: u32| e.pool().device_arena().block_bytes(i);
    assert_eq!(bytes(&e1, 0), bytes(&e2, 0));
    assert_eq!(bytes(&e1, 1), bytes(&e2, 1));
    assert_ne!(bytes(&e1, 2), bytes(&e2, 2));
}

/// The KV bytes change no figure: with and without them (timing-only), the same requests take
/// the same steps, hit the same cached prefixes and end at the same times. What the simulator
/// relies on when it runs timing-only engines.
#[test]
fn timing_only_engines_time_and_cache_exactly_like_byte_engines() {
    let timeline = |shape: KvShape| {
        let mut e = engine(256, 16, SchedulerConfig::default(), shape);
        let shared = prompt(9, 96);
        let mut out = Vec::new();
        let mut now = 0;
        for i in 0..24u64 {
            let mut p = if i % 3 == 0 {
                prompt(i as u32, 40 + i as usize)
            } else {
                shared.clone()
            };
            p.extend(prompt(100 + i as u32, 8 * (i as usize % 5)));
            e.add_request(request(i, p, 4 + (i as u32 % 7)), now)
                .unwrap();
            // Arrivals interleave with steps.
            if let Some(step) = e.begin_step(now) {
                now += step.duration_us();
                for o in e.finish_step(now) {
                    out.push((
                        now,
                        o.id,
                        o.first_token,
                        o.cached_tokens,
                        o.finish.is_some(),
                    ));
                }
            }
        }
        while let Some(step) = e.begin_step(now) {
            now += step.duration_us();
            for o in e.finish_step(now) {
                out.push((
                    now,
                    o.id,
                    o.first_token,
                    o.cached_tokens,
                    o.finish.is_some(),
                ));
            }
        }
        (out, e.stats().preemptions)
    };
    let (bytes, p1) = timeline(KvShape::MOCKER_DEFAULT);
    let (timing, p2) = timeline(KvShape::TIMING_ONLY);
    assert!(bytes.iter().any(|o| o.3 > 0), "some prefix hits");
    assert_eq!(bytes, timing);
    assert_eq!(p1, p2);
}

#[test]
fn a_step_that_loads_an_adapter_takes_the_load_time_longer() {
    let cfg = SchedulerConfig {
        max_loras: 1,
        ..SchedulerConfig::default()
    };
    let mut e = engine(64, 4, cfg, KvShape::TIMING_ONLY);
    let on = |id, adapter: Option<&str>| EngineRequest {
        adapter: adapter.map(str::to_string),
        ..request(id, prompt(id as u32, 32), 1)
    };
    e.add_request(on(1, None), 0).unwrap();
    let base = e.begin_step(0).unwrap().duration_ms;
    e.finish_step(1);
    e.add_request(on(2, Some("a")), 10).unwrap();
    let loading = e.begin_step(10).unwrap().duration_ms;
    e.finish_step(11);
    e.add_request(on(3, Some("a")), 20).unwrap();
    let resident = e.begin_step(20).unwrap().duration_ms;
    e.finish_step(21);
    let load_ms = MockerConfig::default().adapter_load_ms;
    assert!(
        (loading - base - load_ms).abs() < 1e-9,
        "{loading} vs {base}"
    );
    assert!((resident - base).abs() < 1e-9, "{resident} vs {base}");
    assert_eq!(e.load_report(30).adapters.resident, vec!["a".to_string()]);
}

/// Runs two requests added at once to the end; every output of each.
fn run_pair(
    e: &mut MockEngine,
    a: EngineRequest,
    b: EngineRequest,
) -> BTreeMap<RequestId, Vec<RequestOutput>> {
    let mut now = 0;
    e.add_request(a, now).unwrap();
    e.add_request(b, now).unwrap();
    let mut outs: BTreeMap<RequestId, Vec<RequestOutput>> = BTreeMap::new();
    while let Some(step) = e.begin_step(now) {
        now += step.duration_us();
        for o in e.finish_step(now) {
            outs.entry(o.id).or_default().push(o);
        }
    }
    outs
}

/// The mocker knows its tokens: asked for logprobs, each token comes with log-probability 0
/// and itself as the one alternative with mass; not asked, with none. The tokens are the same.
#[test]
fn logprobs_come_with_each_token_when_asked() {
    let mut e = small(64);
    let plain = request(1, prompt(3, 40), 5);
    let mut asked = request(2, prompt(3, 40), 5);
    asked.sampling.logprobs = Some(3);
    let outs = run_pair(&mut e, plain, asked);
    let (plain, asked) = (&outs[&RequestId(1)], &outs[&RequestId(2)]);
    assert_eq!(asked.len(), 5);
    for (p, a) in plain.iter().zip(asked) {
        assert_eq!(p.token, a.token);
        assert_eq!(p.logprobs, None);
        assert_eq!(a.logprobs, Some(TokenLogprobs::certain(a.token, 3)));
    }
}

/// Asked for an embedding, a request gets it with its first token only: the prompt's hashed
/// tokens at length 1 ([`crate::mocker::embedding`]); prompts sharing most of their tokens
/// lie closer than prompts sharing none. The tokens are the same as without.
#[test]
fn an_embedding_comes_with_the_first_token_when_asked() {
    let mut e = small(64);
    let p = prompt(3, 40);
    let plain = request(1, p.clone(), 3);
    let mut asked = request(2, p.clone(), 3);
    asked.sampling.embed = true;
    let outs = run_pair(&mut e, plain, asked);
    let (plain, asked) = (&outs[&RequestId(1)], &outs[&RequestId(2)]);
    assert_eq!(
        plain.iter().map(|o| o.token).collect::<Vec<_>>(),
        asked.iter().map(|o| o.token).collect::<Vec<_>>()
    );
    assert!(plain.iter().all(|o| o.embedding.is_none()));
    assert!(asked[1..].iter().all(|o| o.embedding.is_none()));
    let v = asked[0].embedding.as_deref().expect("with the first token");
    assert_eq!(v, &*crate::mocker::embedding(&p));
    assert_eq!(v.len(), crate::mocker::EMBEDDING_DIM);
    let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    let cos = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let mut near = p.clone();
    near[5] += 1;
    let near = crate::mocker::embedding(&near);
    let far = crate::mocker::embedding(&prompt(9, 40));
    assert!(cos(v, &near) > 0.9, "{}", cos(v, &near));
    assert!(
        cos(v, &near) > cos(v, &far) + 0.3,
        "{} {}",
        cos(v, &near),
        cos(v, &far)
    );
}
