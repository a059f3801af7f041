//! Property test: random arrivals, aborts and steps on small pools keep the pool consistent,
//! and every request that is not aborted finishes with the tokens it gets when run alone.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use tandem_protocol::{BlockSize, RequestId, WorkerId};

use super::tests::{drain, engine, request};
use super::*;
use crate::pool::BlockPoolConfig;
use crate::scheduler::SchedulerConfig;

#[derive(Clone, Debug)]
enum Op {
    /// A request from one of a few prompt families sharing their first 8 tokens.
    Arrive {
        family: u8,
        len: u8,
        max_tokens: u8,
    },
    Abort {
        nth: u8,
    },
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 1u8..20, 1u8..12)
            .prop_map(|(family, len, max_tokens)| Op::Arrive { family, len, max_tokens }),
        1 => any::<u8>().prop_map(|nth| Op::Abort { nth }),
        5 => Just(Op::Step),
    ]
}

fn family_prompt(family: u8, len: u8, id: u64) -> Vec<u32> {
    (0..u32::from(len))
        .map(|i| {
            if i < 8 {
                u32::from(family) * 100 + i
            } else {
                10_000 + id as u32 * 50 + i
            }
        })
        .collect()
}

fn tight_engine(device: u32, host: u32, budget: usize, seqs: usize) -> MockEngine {
    let mut pool = BlockPoolConfig::new(WorkerId(5), device);
    pool.block_size = BlockSize::new(4).unwrap();
    pool.host_blocks = host;
    let mut cfg = MockEngineConfig::new(pool);
    cfg.scheduler = SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: seqs,
        ..Default::default()
    };
    MockEngine::new(cfg).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_traffic_keeps_invariants_and_tokens(
        ops in proptest::collection::vec(op(), 1..80),
        device in 8u32..24,
        host in prop_oneof![Just(0u32), 1u32..8],
        budget in 4usize..48,
        seqs in 1usize..8,
    ) {
        let mut e = tight_engine(device, host, budget, seqs);
        let mut now = 0u64;
        let mut next_id = 0u64;
        let mut live: Vec<u64> = Vec::new();
        let mut aborted = BTreeSet::new();
        let mut reqs = BTreeMap::new();
        let mut got: BTreeMap<RequestId, Vec<u32>> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Arrive { family, len, max_tokens } => {
                    let r = request(next_id, family_prompt(family, len, next_id), u32::from(max_tokens));
                    e.add_request(r.clone(), now).unwrap();
                    reqs.insert(r.id, r);
                    live.push(next_id);
                    next_id += 1;
                }
                Op::Abort { nth } => {
                    if !live.is_empty() {
                        let id = live.remove(nth as usize % live.len());
                        if e.abort(RequestId(id)) {
                            aborted.insert(RequestId(id));
                        }
                    }
                }
                Op::Step => {
                    if let Some(s) = e.begin_step(now) {
                        now += s.duration_us();
                        for o in e.finish_step(now) {
                            got.entry(o.id).or_default().push(o.token);
                        }
                    }
                }
            }
            if let Err(msg) = e.pool().check_invariants() {
                return Err(TestCaseError::fail(msg));
            }
        }
        for (id, tokens) in drain(&mut e, &mut now) {
            got.entry(id).or_default().extend(tokens);
        }
        prop_assert_eq!(e.pool().active_blocks(), 0);
        prop_assert!(!e.has_work());
        for (id, r) in &reqs {
            if aborted.contains(id) {
                continue;
            }
            let mut alone = engine(64, 4, SchedulerConfig::default(), KvShape::MOCKER_DEFAULT);
            let mut t = 0;
            alone.add_request(r.clone(), 0).unwrap();
            let expected = drain(&mut alone, &mut t).remove(id).unwrap();
            prop_assert_eq!(got.get(id), Some(&expected), "request {}", id);
        }
    }
}
