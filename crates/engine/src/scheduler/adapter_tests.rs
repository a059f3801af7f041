//! LoRA adapter slots in the scheduler: a request whose adapter has no slot is passed over
//! and keeps its place; loads are counted per step and reported.

use tandem_protocol::RequestId;

use super::tests::{req, run_to_end, sched, step};
use super::*;

fn on(id: u64, prompt_len: u32, max_tokens: u32, adapter: &str) -> EngineRequest {
    EngineRequest {
        adapter: Some(adapter.to_string()),
        ..req(id, prompt_len, max_tokens)
    }
}

fn running(s: &Scheduler) -> Vec<u64> {
    let mut v: Vec<u64> = s.running.iter().map(|r| r.0).collect();
    v.sort_unstable();
    v
}

#[test]
fn a_request_without_a_slot_waits_and_others_pass_it() {
    let cfg = SchedulerConfig {
        max_loras: 1,
        ..SchedulerConfig::default()
    };
    let mut s = sched(256, cfg);
    s.add_request(on(1, 8, 20, "a"), 0).unwrap();
    s.add_request(on(2, 8, 20, "b"), 0).unwrap();
    s.add_request(req(3, 8, 20), 0).unwrap();
    s.add_request(on(4, 8, 20, "a"), 0).unwrap();
    s.schedule(0);
    // "a" takes the one slot: 2 (on "b") waits, the base-model 3 and 4 (on "a") pass it.
    assert_eq!(running(&s), vec![1, 3, 4]);
    assert_eq!(s.plan().adapter_loads, 1);
    assert_eq!(s.waiting.iter().map(|r| r.0).collect::<Vec<_>>(), vec![2]);
    let report = s.load_report(WorkerId(7), 0);
    assert_eq!(report.adapters.max_loaded, 1);
    assert_eq!(report.adapters.resident, vec!["a".to_string()]);
    // When "a"'s requests end, "b" replaces it.
    let outputs = run_to_end(&mut s);
    let finished: Vec<u64> = outputs
        .iter()
        .filter(|o| o.finish.is_some())
        .map(|o| o.id.0)
        .collect();
    assert_eq!(finished.len(), 4);
    assert_eq!(*finished.last().unwrap(), 2, "the request on b ran last");
    assert_eq!(s.stats().adapter_loads, 2);
    let report = s.load_report(WorkerId(7), 0);
    assert_eq!(report.adapters.resident, vec!["b".to_string()]);
}

#[test]
fn a_resident_adapter_is_not_loaded_again_and_no_limit_loads_nothing() {
    let cfg = SchedulerConfig {
        max_loras: 2,
        ..SchedulerConfig::default()
    };
    let mut s = sched(256, cfg);
    s.add_request(on(1, 8, 2, "a"), 0).unwrap();
    run_to_end(&mut s);
    s.add_request(on(2, 8, 2, "a"), 100_000).unwrap();
    step(&mut s, 100_000);
    assert_eq!(s.plan().adapter_loads, 0);
    run_to_end(&mut s);
    assert_eq!(s.stats().adapter_loads, 1);
    // max_loras 0: adapters are not limited and cost nothing.
    let mut s = sched(256, SchedulerConfig::default());
    for i in 0..4 {
        s.add_request(on(i, 8, 2, &format!("x{i}")), 0).unwrap();
    }
    s.schedule(0);
    assert_eq!(running(&s), vec![0, 1, 2, 3]);
    assert_eq!(s.plan().adapter_loads, 0);
    assert!(s.load_report(WorkerId(7), 0).adapters.resident.is_empty());
    let _ = RequestId(0);
}
