//! Remote prefill on the decode side, with the stand-in model of `tests.rs`. The byte-level
//! equivalence with a local prefill is tested with the mocker (`mocker/remote_tests.rs`).

use tandem_protocol::{KvEventKind, RequestId, WorkerId};

use super::tests::{fake_tokens, req, run_to_end, sched, step};
use super::*;

fn with_id(mut r: EngineRequest, id: u64) -> EngineRequest {
    r.id = RequestId(id);
    r
}

#[test]
fn begin_reserves_the_uncached_prompt_and_finish_decodes_on() {
    let mut s = sched(32, SchedulerConfig::default());
    // Request 1's 8-token prompt leaves 2 blocks cached; request 2 shares them and has 6
    // more tokens: 1 full block and a partial one to transfer.
    s.add_request(req(1, 8, 1), 0).unwrap();
    run_to_end(&mut s);
    let events = s.pool().last_event_id();
    let rp = s
        .begin_remote_prefill(with_id(req(1, 14, 5), 2), 100)
        .unwrap();
    let id = RequestId(2);
    assert_eq!((rp.id, rp.prompt_tokens, rp.cached_tokens), (id, 14, 8));
    assert_eq!(rp.transfer(), 8..14);
    let table = s.pool().block_table(id).unwrap().to_vec();
    assert_eq!(table.len(), 4);
    assert_eq!(table[2..], rp.blocks[..]);
    assert_eq!(s.phase(id), Some(RequestPhase::AwaitingKv));
    assert_eq!(
        (s.num_awaiting_kv(), s.num_running(), s.num_waiting()),
        (1, 0, 0)
    );
    assert!(s.has_work());
    let r = s.load_report(WorkerId(7), 100);
    assert_eq!(
        (
            r.running_requests,
            r.waiting_requests,
            r.pending_prefill_tokens,
            r.kv_active_blocks
        ),
        (1, 0, 0, 4)
    );
    assert_eq!(
        s.pool().last_event_id(),
        events,
        "nothing is published before the KV is in"
    );
    assert!(
        s.schedule(101).is_empty(),
        "a request awaiting KV is never scheduled"
    );
    s.pool().check_invariants().unwrap();

    // The prefill worker's logprobs for the token it drew come out with it.
    let logprobs = TokenLogprobs::certain(777, 1);
    let out = s
        .finish_remote_prefill(id, 777, Some(logprobs.clone()), 150)
        .unwrap();
    assert_eq!(
        out,
        RequestOutput {
            id,
            token: 777,
            first_token: true,
            cached_tokens: 8,
            prompt_tokens: 14,
            completion_tokens: 1,
            finish: None,
            time_to_first_token_us: Some(50),
            logprobs: Some(logprobs),
            embedding: None,
        }
    );
    // The one received full block is now cached and published; the partial one is not.
    let stored: Vec<_> = s
        .pool()
        .events_since(events)
        .unwrap()
        .into_iter()
        .filter(|e| matches!(e.kind, KvEventKind::Stored { .. }))
        .collect();
    assert_eq!(stored.len(), 1);
    assert_eq!(s.pool().committed_blocks(id), Some(3));
    assert_eq!(s.phase(id), Some(RequestPhase::Decoding));
    assert_eq!((s.num_awaiting_kv(), s.num_running()), (0, 1));
    assert_eq!(s.sequence(id).unwrap().computed(), 14);
    s.pool().check_invariants().unwrap();

    // It decodes from the first token on: the KV of position 14 (the token 777) first.
    let plan = s.schedule(200);
    assert_eq!(plan.entries[0].kind, StepKind::Decode { position: 14 });
    assert_eq!(plan.prefill_tokens, 0);
    let toks = fake_tokens(&s);
    let mut outs = s.complete_step(&toks, 201).unwrap();
    outs.extend(run_to_end(&mut s));
    assert_eq!(
        outs.iter().map(|o| o.completion_tokens).collect::<Vec<_>>(),
        vec![2, 3, 4, 5]
    );
    assert!(outs.iter().all(|o| !o.first_token));
    assert_eq!(outs[3].finish, Some(FinishReason::Length));
    assert_eq!(s.pool().active_blocks(), 0);
    let st = s.stats();
    assert_eq!(
        (st.remote_prefills, st.finished, st.prefill_tokens),
        (1, 2, 8)
    );
    assert_eq!(st.cached_tokens, 8);
}

#[test]
fn a_first_token_that_ends_the_request_frees_it_at_once() {
    let mut s = sched(32, SchedulerConfig::default());
    s.begin_remote_prefill(req(1, 9, 1), 0).unwrap();
    let out = s.finish_remote_prefill(RequestId(1), 5, None, 10).unwrap();
    assert_eq!(out.finish, Some(FinishReason::Length));
    assert!(!s.has_work());
    assert_eq!(s.pool().active_blocks(), 0);
    // Its two full blocks stay cached for later requests.
    assert_eq!(
        s.pool().cached_count(tandem_protocol::StorageTier::Device),
        2
    );

    let mut r = req(2, 9, 10);
    r.stop_token = Some(5);
    s.begin_remote_prefill(r, 20).unwrap();
    let out = s.finish_remote_prefill(RequestId(2), 5, None, 30).unwrap();
    assert_eq!(out.finish, Some(FinishReason::Stop));
    assert!(!s.has_work());
    assert_eq!(s.stats().finished, 2);
    s.pool().check_invariants().unwrap();
}

#[test]
fn fail_falls_back_to_a_local_prefill_at_the_front_of_the_queue() {
    let mut s = sched(32, SchedulerConfig::default());
    s.add_request(req(3, 5, 2), 0).unwrap();
    s.begin_remote_prefill(req(2, 10, 3), 10).unwrap();
    s.fail_remote_prefill(RequestId(2), 40).unwrap();
    assert_eq!(s.phase(RequestId(2)), Some(RequestPhase::Waiting));
    assert_eq!((s.num_waiting(), s.num_awaiting_kv()), (2, 0));
    assert_eq!(s.pool().active_blocks(), 0);
    s.pool().check_invariants().unwrap();
    let plan = s.schedule(50);
    assert_eq!(
        plan.entries.iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![RequestId(2), RequestId(3)],
        "the fallen-back request goes first"
    );
    assert_eq!(
        plan.entries[0].kind,
        StepKind::Prefill { start: 0, len: 10 }
    );
    let toks = fake_tokens(&s);
    let first = s.complete_step(&toks, 60).unwrap();
    assert!(first[0].first_token);
    assert_eq!(
        first[0].time_to_first_token_us,
        Some(50),
        "TTFT counts from the remote prefill's start"
    );
    let mut all = first;
    all.extend(run_to_end(&mut s));
    assert_eq!(all.iter().filter(|o| o.id == RequestId(2)).count(), 3);
    assert_eq!(s.stats().remote_prefill_fallbacks, 1);
    assert_eq!(s.stats().finished, 2);
    assert_eq!(s.pool().active_blocks(), 0);
}

#[test]
fn abort_while_awaiting_kv_or_queued_frees_the_blocks() {
    let mut s = sched(
        32,
        SchedulerConfig {
            max_num_seqs: 1,
            ..Default::default()
        },
    );
    s.begin_remote_prefill(req(1, 10, 4), 0).unwrap();
    assert_eq!(s.pool().active_blocks(), 3);
    assert!(s.abort(RequestId(1)));
    assert_eq!(s.pool().active_blocks(), 0);
    assert_eq!((s.num_awaiting_kv(), s.has_work()), (0, false));
    s.pool().check_invariants().unwrap();
    assert_eq!(
        s.finish_remote_prefill(RequestId(1), 3, None, 1),
        Err(SchedulerError::NotAwaitingKv(RequestId(1)))
    );
    assert_eq!(
        s.fail_remote_prefill(RequestId(1), 1),
        Err(SchedulerError::NotAwaitingKv(RequestId(1)))
    );
    // A finished remote prefill queued for a seat (the only seat is taken).
    s.add_request(req(2, 4, 10), 0).unwrap();
    step(&mut s, 1);
    s.begin_remote_prefill(req(3, 6, 4), 2).unwrap();
    s.finish_remote_prefill(RequestId(3), 1, None, 3).unwrap();
    assert_eq!(s.num_prefilled_queued(), 1);
    assert_eq!(
        s.fail_remote_prefill(RequestId(3), 4),
        Err(SchedulerError::NotAwaitingKv(RequestId(3))),
        "past the transfer there is nothing to fail"
    );
    assert!(s.abort(RequestId(3)));
    assert!(s.abort(RequestId(2)));
    assert_eq!(s.num_prefilled_queued(), 0);
    assert_eq!(s.pool().active_blocks(), 0);
    s.pool().check_invariants().unwrap();
}

#[test]
fn no_room_is_a_typed_error_and_changes_nothing() {
    // 4 blocks; a running request holds 3.
    let mut s = sched(4, SchedulerConfig::default());
    s.add_request(req(1, 9, 4), 0).unwrap();
    step(&mut s, 0);
    assert_eq!(s.pool().available_blocks(), 1);
    let before = (
        s.pool().last_event_id(),
        s.pool().available_blocks(),
        s.stats(),
    );
    let e = s.begin_remote_prefill(req(2, 8, 1), 5).unwrap_err();
    assert_eq!(
        e,
        SchedulerError::NoRoomForKv {
            id: RequestId(2),
            needed: 2,
            available: 1
        }
    );
    assert_eq!(e.class(), ErrorClass::Overloaded);
    assert_eq!(
        (
            s.pool().last_event_id(),
            s.pool().available_blocks(),
            s.stats()
        ),
        before
    );
    assert_eq!(s.phase(RequestId(2)), None);
    assert_eq!(s.num_awaiting_kv(), 0);
    s.pool().check_invariants().unwrap();
    // Invalid requests are refused as by add_request.
    assert_eq!(
        s.begin_remote_prefill(req(1, 2, 1), 5),
        Err(SchedulerError::DuplicateRequest(RequestId(1)))
    );
    assert!(matches!(
        s.begin_remote_prefill(req(3, 12, 8), 5),
        Err(SchedulerError::TooLong { .. })
    ));
    // The caller prefills locally instead: that waits for room as usual.
    s.add_request(req(2, 8, 1), 5).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.stats().finished, 2);
}

#[test]
fn prefilled_requests_wait_for_a_seat_and_go_before_waiting_ones() {
    let mut s = sched(
        64,
        SchedulerConfig {
            max_num_seqs: 1,
            ..Default::default()
        },
    );
    s.add_request(req(1, 4, 3), 0).unwrap();
    let mut outs = step(&mut s, 0);
    s.add_request(req(3, 4, 2), 1).unwrap();
    s.begin_remote_prefill(req(2, 4, 3), 1).unwrap();
    s.finish_remote_prefill(RequestId(2), 9, None, 2).unwrap();
    assert_eq!((s.num_running(), s.num_prefilled_queued()), (1, 1));
    let r = s.load_report(WorkerId(7), 2);
    assert_eq!((r.running_requests, r.waiting_requests), (2, 1));
    outs.extend(run_to_end(&mut s));
    let order: Vec<u64> = outs.iter().map(|o| o.id.0).collect();
    assert_eq!(order, vec![1, 1, 1, 2, 2, 3, 3]);
    assert_eq!(s.pool().active_blocks(), 0);
}

#[test]
fn remote_prefills_may_come_and_go_while_a_step_is_in_flight() {
    let mut s = sched(64, SchedulerConfig::default());
    s.add_request(req(1, 6, 3), 0).unwrap();
    s.add_request(req(4, 6, 3), 0).unwrap();
    s.schedule(0);
    let toks = fake_tokens(&s);
    s.begin_remote_prefill(req(2, 6, 3), 1).unwrap();
    s.finish_remote_prefill(RequestId(2), 9, None, 2).unwrap();
    // An id aborted during the step cannot come back before the step completes.
    assert!(s.abort(RequestId(4)));
    assert_eq!(
        s.begin_remote_prefill(req(4, 6, 3), 3),
        Err(SchedulerError::DuplicateRequest(RequestId(4)))
    );
    let outs = s.complete_step(&toks, 4).unwrap();
    assert_eq!(outs.len(), 1);
    assert_eq!(outs[0].id, RequestId(1));
    let plan = s.schedule(5);
    assert_eq!(
        plan.entries.iter().map(|e| e.kind).collect::<Vec<_>>(),
        vec![
            StepKind::Decode { position: 6 },
            StepKind::Decode { position: 6 }
        ]
    );
    let toks = fake_tokens(&s);
    s.complete_step(&toks, 6).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.pool().active_blocks(), 0);
    s.pool().check_invariants().unwrap();
}
