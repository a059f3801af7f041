//! Scheduler unit tests with a stand-in model that emits `500 + sequence length`.

use tandem_protocol::{BlockSize, RequestId, WorkerId};

use super::*;
use crate::pool::BlockPoolConfig;

pub(super) const BS: u32 = 4;

pub(super) fn sched(device_blocks: u32, cfg: SchedulerConfig) -> Scheduler {
    let mut p = BlockPoolConfig::new(WorkerId(7), device_blocks);
    p.block_size = BlockSize::new(BS).unwrap();
    Scheduler::new(cfg, BlockPool::new(p).unwrap()).unwrap()
}

pub(super) fn req(id: u64, prompt_len: u32, max_tokens: u32) -> EngineRequest {
    EngineRequest::new(
        RequestId(id),
        (0..prompt_len).map(|t| t + 1000 * id as u32).collect(),
        max_tokens,
    )
}

/// A stand-in model: the token is a function of the request and its length.
pub(super) fn fake_tokens(s: &Scheduler) -> Vec<SampledToken> {
    s.plan()
        .entries
        .iter()
        .filter(|e| e.samples)
        .map(|e| SampledToken {
            id: e.id,
            token: 500 + e.tokens().end as u32,
            logprobs: None,
            embedding: None,
        })
        .collect()
}

/// One step with the fake model.
pub(super) fn step(s: &mut Scheduler, now: u64) -> Vec<RequestOutput> {
    if s.schedule(now).is_empty() {
        return Vec::new();
    }
    let toks = fake_tokens(s);
    s.complete_step(&toks, now + 1).unwrap()
}

pub(super) fn run_to_end(s: &mut Scheduler) -> Vec<RequestOutput> {
    let mut all = Vec::new();
    for t in 0..10_000 {
        if !s.has_work() {
            return all;
        }
        all.extend(step(s, t * 10));
        s.pool().check_invariants().unwrap();
    }
    panic!("did not drain");
}

#[test]
fn invalid_requests_are_refused_with_typed_errors() {
    let mut s = sched(
        4,
        SchedulerConfig {
            max_waiting: 2,
            ..Default::default()
        },
    );
    let e = s
        .add_request(EngineRequest::new(RequestId(1), vec![], 4), 0)
        .unwrap_err();
    assert_eq!(e, SchedulerError::EmptyPrompt(RequestId(1)));
    assert_eq!(e.class(), ErrorClass::InvalidRequest);
    assert_eq!(
        s.add_request(req(1, 4, 0), 0),
        Err(SchedulerError::ZeroMaxTokens(RequestId(1)))
    );
    // 4 blocks of 4 tokens: 16 tokens; 10 + 8 - 1 = 17 can never fit.
    assert_eq!(
        s.add_request(req(1, 10, 8), 0),
        Err(SchedulerError::TooLong {
            id: RequestId(1),
            needed: 17,
            capacity: 16
        })
    );
    s.add_request(req(1, 10, 7), 0).unwrap();
    assert_eq!(
        s.add_request(req(1, 3, 1), 0),
        Err(SchedulerError::DuplicateRequest(RequestId(1)))
    );
    s.add_request(req(2, 3, 1), 0).unwrap();
    let full = s.add_request(req(3, 3, 1), 0).unwrap_err();
    assert_eq!(full, SchedulerError::QueueFull(2));
    assert_eq!(full.class(), ErrorClass::Overloaded);

    let mut s = sched(
        64,
        SchedulerConfig {
            enable_chunked_prefill: false,
            max_num_batched_tokens: 8,
            ..Default::default()
        },
    );
    assert!(matches!(
        s.add_request(req(1, 6, 4), 0),
        Err(SchedulerError::ExceedsStepBudget { .. })
    ));
    let pool = BlockPool::new(BlockPoolConfig::new(WorkerId(1), 4)).unwrap();
    let bad = Scheduler::new(
        SchedulerConfig {
            max_num_seqs: 0,
            ..Default::default()
        },
        pool,
    );
    assert!(matches!(bad, Err(SchedulerError::InvalidConfig(_))));
}

#[test]
fn chunked_prefill_respects_the_budget_then_decodes() {
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 8,
        ..Default::default()
    };
    let mut s = sched(64, cfg);
    s.add_request(req(1, 21, 3), 0).unwrap();
    let mut chunks = Vec::new();
    loop {
        let plan = s.schedule(0);
        assert_eq!(plan.entries.len(), 1);
        let e = plan.entries[0];
        assert!(plan.prefill_tokens <= 8);
        assert_eq!(
            plan.block_table(&e).len(),
            (e.tokens().end).div_ceil(BS as usize)
        );
        chunks.push((e.kind, e.samples));
        let out = s.complete_step(&fake_tokens(&s), 1).unwrap();
        if e.samples {
            assert_eq!(out.len(), 1);
            assert!(out[0].first_token);
            break;
        }
        assert!(out.is_empty());
        assert_eq!(s.pending_prefill_tokens(), 21 - e.tokens().end);
    }
    assert_eq!(
        chunks,
        vec![
            (StepKind::Prefill { start: 0, len: 8 }, false),
            (StepKind::Prefill { start: 8, len: 8 }, false),
            (StepKind::Prefill { start: 16, len: 5 }, true),
        ]
    );
    let plan = s.schedule(2);
    assert_eq!(plan.entries[0].kind, StepKind::Decode { position: 21 });
    assert_eq!(plan.decode_tokens, 1);
    assert_eq!(s.active_kv_tokens(), 21);
    let out = s.complete_step(&fake_tokens(&s), 3).unwrap();
    assert_eq!(out[0].completion_tokens, 2);
    let rest = run_to_end(&mut s);
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].finish, Some(FinishReason::Length));
    assert_eq!(s.pool().active_blocks(), 0);
    let st = s.stats();
    assert_eq!(
        (st.prefill_tokens, st.decode_tokens, st.finished),
        (21, 2, 1)
    );
}

#[test]
fn max_prefill_chunk_caps_one_request() {
    let cfg = SchedulerConfig {
        max_prefill_chunk: Some(5),
        ..Default::default()
    };
    let mut s = sched(64, cfg);
    s.add_request(req(1, 12, 1), 0).unwrap();
    s.add_request(req(2, 3, 1), 0).unwrap();
    let plan = s.schedule(0);
    let kinds: Vec<_> = plan.entries.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        vec![
            StepKind::Prefill { start: 0, len: 5 },
            StepKind::Prefill { start: 0, len: 3 }
        ]
    );
}

#[test]
fn stop_token_finishes_unless_ignored() {
    let mut s = sched(64, SchedulerConfig::default());
    // The fake model emits 500 + length: for a 4-token prompt, 504, 505, 506...
    let mut r = req(1, 4, 10);
    r.stop_token = Some(506);
    s.add_request(r.clone(), 0).unwrap();
    let out = run_to_end(&mut s);
    assert_eq!(
        out.iter().map(|o| o.token).collect::<Vec<_>>(),
        vec![504, 505, 506]
    );
    assert_eq!(out[2].finish, Some(FinishReason::Stop));
    r.id = RequestId(2);
    r.ignore_eos = true;
    s.add_request(r, 0).unwrap();
    let out = run_to_end(&mut s);
    assert_eq!(out.len(), 10);
    assert_eq!(out[9].finish, Some(FinishReason::Length));
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_block() {
    let mut s = sched(64, SchedulerConfig::default());
    s.add_request(req(1, 8, 1), 0).unwrap();
    run_to_end(&mut s);
    // Same prompt (same id-derived tokens need the same id offset: reuse id 1's tokens).
    let mut r = req(1, 8, 1);
    r.id = RequestId(2);
    s.add_request(r, 0).unwrap();
    let plan = s.schedule(5);
    assert_eq!(plan.entries[0].kind, StepKind::Prefill { start: 4, len: 4 });
    let out = s.complete_step(&fake_tokens(&s), 6).unwrap();
    assert_eq!(out[0].cached_tokens, 4);
    assert_eq!(out[0].time_to_first_token_us, Some(6));
    assert_eq!(s.stats().cached_tokens, 4);
    // A 9-token prompt reuses both full blocks and computes the ninth token only.
    let mut r = req(1, 9, 1);
    r.id = RequestId(3);
    s.add_request(r, 0).unwrap();
    assert_eq!(
        s.schedule(7).entries[0].kind,
        StepKind::Prefill { start: 8, len: 1 }
    );
}

#[test]
fn max_num_seqs_is_respected() {
    let mut s = sched(
        256,
        SchedulerConfig {
            max_num_seqs: 3,
            ..Default::default()
        },
    );
    for id in 0..10 {
        s.add_request(req(id, 5, 4), 0).unwrap();
    }
    for t in 0..200 {
        if !s.has_work() {
            break;
        }
        let n = s.schedule(t).entries.len();
        assert!(n <= 3 && s.num_running() <= 3);
        let toks = fake_tokens(&s);
        s.complete_step(&toks, t).unwrap();
    }
    assert_eq!(s.stats().finished, 10);
}

#[test]
fn preemption_takes_the_last_admitted_and_recomputes_its_tokens() {
    // 6 blocks of 4 tokens. Two requests of 8-token prompts (2 blocks each) that grow.
    let mut s = sched(6, SchedulerConfig::default());
    s.add_request(req(1, 8, 9), 0).unwrap();
    s.add_request(req(2, 8, 9), 0).unwrap();
    let mut preempted_at = None;
    let mut out = Vec::new();
    for t in 0..100 {
        if !s.has_work() {
            break;
        }
        let plan = s.schedule(t);
        if !plan.preempted.is_empty() && preempted_at.is_none() {
            assert_eq!(plan.preempted, vec![RequestId(2)]);
            preempted_at = Some(t);
            assert_eq!(s.phase(RequestId(2)), Some(RequestPhase::Waiting));
            assert_eq!(s.num_waiting(), 1);
        }
        let toks = fake_tokens(&s);
        out.extend(s.complete_step(&toks, t).unwrap());
        s.pool().check_invariants().unwrap();
    }
    assert!(preempted_at.is_some());
    assert!(s.stats().preemptions >= 1);
    // Request 2 resumed by prefilling prompt + generated tokens, then carried on where it was.
    let r2: Vec<_> = out.iter().filter(|o| o.id == RequestId(2)).collect();
    assert_eq!(r2.len(), 9);
    assert_eq!(r2.iter().filter(|o| o.first_token).count(), 1);
    assert_eq!(
        r2.iter().map(|o| o.completion_tokens).collect::<Vec<_>>(),
        (1..=9).collect::<Vec<_>>()
    );
    assert!(s.stats().prefill_tokens > 16, "recompute counts as prefill");
    assert_eq!(s.pool().active_blocks(), 0);
}

#[test]
fn abort_frees_everything_wherever_the_request_is() {
    let mut s = sched(
        16,
        SchedulerConfig {
            max_num_seqs: 1,
            ..Default::default()
        },
    );
    s.add_request(req(1, 6, 50), 0).unwrap();
    s.add_request(req(2, 6, 5), 0).unwrap();
    step(&mut s, 0);
    assert_eq!(s.phase(RequestId(2)), Some(RequestPhase::Waiting));
    assert!(s.abort(RequestId(2)));
    assert!(!s.abort(RequestId(2)));
    assert_eq!(s.num_waiting(), 0);
    // Abort while a step is in flight: the step completes without it.
    s.schedule(1);
    let toks = fake_tokens(&s);
    assert!(s.abort(RequestId(1)));
    assert_eq!(s.pool().active_blocks(), 0);
    assert!(s.complete_step(&toks, 2).unwrap().is_empty());
    assert!(!s.has_work());
    assert_eq!(s.stats().aborted, 2);
    s.pool().check_invariants().unwrap();
}

#[test]
fn complete_step_checks_outputs_against_the_plan() {
    let mut s = sched(16, SchedulerConfig::default());
    assert_eq!(s.complete_step(&[], 0), Err(SchedulerError::NoStepInFlight));
    s.add_request(req(1, 3, 5), 0).unwrap();
    s.schedule(0);
    // Scheduling again while in flight gives the same plan.
    assert_eq!(s.schedule(1).step, 1);
    assert_eq!(
        s.complete_step(&[], 1),
        Err(SchedulerError::OutputMismatch {
            expected: Some(RequestId(1)),
            got: None
        })
    );
    let wrong = [SampledToken {
        id: RequestId(9),
        token: 1,
        logprobs: None,
        embedding: None,
    }];
    assert!(s.complete_step(&wrong, 1).is_err());
    let extra = [
        SampledToken {
            id: RequestId(1),
            token: 1,
            logprobs: None,
            embedding: None,
        },
        SampledToken {
            id: RequestId(1),
            token: 2,
            logprobs: None,
            embedding: None,
        },
    ];
    assert!(s.complete_step(&extra, 1).is_err());
    assert!(s.in_flight(), "a refused completion changes nothing");
    assert_eq!(s.complete_step(&extra[..1], 1).unwrap().len(), 1);
}

#[test]
fn load_report_reflects_the_queue_and_the_pool() {
    let mut s = sched(
        32,
        SchedulerConfig {
            max_num_seqs: 1,
            ..Default::default()
        },
    );
    s.add_request(req(1, 10, 2), 0).unwrap();
    s.add_request(req(2, 7, 2), 0).unwrap();
    let r = s.load_report(WorkerId(7), 5_000);
    assert_eq!(
        (
            r.waiting_requests,
            r.running_requests,
            r.pending_prefill_tokens
        ),
        (2, 0, 17)
    );
    assert_eq!(r.timestamp_ms, 5);
    step(&mut s, 6_000);
    let r = s.load_report(WorkerId(7), 7_000);
    assert_eq!(
        (
            r.waiting_requests,
            r.running_requests,
            r.pending_prefill_tokens
        ),
        (1, 1, 7)
    );
    assert_eq!((r.kv_active_blocks, r.kv_total_blocks), (3, 32));
}

#[test]
fn a_prompt_preempted_mid_prefill_does_not_count_its_own_blocks_as_cached() {
    // 6 blocks of 4 tokens, prompts prefilled 4 tokens a step. Request 1 decodes and grows;
    // request 2's 16-token prompt is committed block by block, until request 1's growth
    // preempts it. Re-admitted, it finds its own committed blocks in the prefix cache: they
    // are no cache hit, neither in its usage nor in the hit rate's counters.
    let cfg = SchedulerConfig {
        max_prefill_chunk: Some(4),
        ..SchedulerConfig::default()
    };
    let mut s = sched(6, cfg);
    s.add_request(req(1, 4, 12), 0).unwrap();
    s.add_request(req(2, 16, 2), 0).unwrap();
    let out = run_to_end(&mut s);
    let stats = s.stats();
    assert!(stats.preemptions >= 1, "the scenario preempts: {stats:?}");
    assert!(
        stats.preempted_cached_tokens > 0,
        "the re-admission found the request's own blocks: {stats:?}"
    );
    let first = out
        .iter()
        .find(|o| o.id == RequestId(2) && o.first_token)
        .expect("request 2 produced its first token");
    assert_eq!(first.cached_tokens, 0, "a fresh prompt had nothing cached");
    assert!(
        out.iter()
            .filter(|o| o.id == RequestId(2))
            .all(|o| o.cached_tokens == 0)
    );
    assert_eq!(stats.cached_tokens, 0);
    assert_eq!(stats.queried_tokens, 4 + 16, "each prompt queried once");
}
