//! Property test: random arrivals (prefilled here or remotely), transfers that end or fail,
//! aborts and steps on small pools keep the pool consistent, and every request that is not
//! aborted finishes with the tokens it gets when run alone.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use proptest::prelude::*;
use tandem_protocol::{BlockSize, RequestId, WorkerId};

use super::remote_tests::prefill_on;
use super::tests::{drain, engine, request};
use super::*;
use crate::engine::{MockEngine, MockEngineConfig};
use crate::pool::BlockPoolConfig;
use crate::scheduler::{
    EngineRequest, RemotePrefill, RequestOutput, SchedulerConfig, SchedulerError,
};

#[derive(Clone, Debug)]
enum Op {
    /// A request from one of a few prompt families sharing their first 8 tokens.
    Arrive {
        family: u8,
        len: u8,
        max_tokens: u8,
    },
    /// The same, prefilled by another engine: the KV is reserved now and arrives later.
    ArriveRemote {
        family: u8,
        len: u8,
        max_tokens: u8,
    },
    /// The oldest pending transfer ends: its bytes are written and it finishes, or it fails.
    Transfer {
        ok: bool,
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
        2 => (0u8..3, 1u8..20, 1u8..12)
            .prop_map(|(family, len, max_tokens)| Op::ArriveRemote { family, len, max_tokens }),
        2 => prop_oneof![4 => Just(true), 1 => Just(false)].prop_map(|ok| Op::Transfer { ok }),
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

/// A transfer in flight: the request's destination blocks and what the prefill worker made.
struct Pending {
    rp: RemotePrefill,
    first_token: u32,
    /// KV bytes of every prompt block, as the prefill worker computed them.
    blocks: Vec<Vec<u8>>,
}

fn remote_prefill(r: &EngineRequest, rp: RemotePrefill) -> Pending {
    let mut p = engine(64, 4, SchedulerConfig::default(), KvShape::MOCKER_DEFAULT);
    let (first_token, table) = prefill_on(&mut p, r.clone());
    let blocks = table
        .iter()
        .map(|&b| p.pool().device_arena().block_bytes(b))
        .collect();
    Pending {
        rp,
        first_token,
        blocks,
    }
}

/// Writes the transferred blocks into the decode engine and finishes the remote prefill.
fn land(e: &mut MockEngine, t: Pending, now: u64) -> RequestOutput {
    let first = t.rp.cached_tokens / 4;
    for (k, &dst) in t.rp.blocks.iter().enumerate() {
        e.pool_mut()
            .device_arena_mut()
            .write_block(dst, &t.blocks[first + k]);
    }
    e.finish_remote_prefill(t.rp.id, t.first_token, None, now)
        .unwrap()
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
        let mut transfers: VecDeque<Pending> = VecDeque::new();
        for op in ops {
            match op {
                Op::Arrive { family, len, max_tokens } => {
                    let r = request(next_id, family_prompt(family, len, next_id), u32::from(max_tokens));
                    e.add_request(r.clone(), now).unwrap();
                    reqs.insert(r.id, r);
                    live.push(next_id);
                    next_id += 1;
                }
                Op::ArriveRemote { family, len, max_tokens } => {
                    let r = request(next_id, family_prompt(family, len, next_id), u32::from(max_tokens));
                    match e.begin_remote_prefill(r.clone(), now) {
                        Ok(rp) => transfers.push_back(remote_prefill(&r, rp)),
                        Err(SchedulerError::NoRoomForKv { .. }) => {
                            e.add_request(r.clone(), now).unwrap();
                        }
                        Err(err) => return Err(TestCaseError::fail(err.to_string())),
                    }
                    reqs.insert(r.id, r);
                    live.push(next_id);
                    next_id += 1;
                }
                Op::Transfer { ok } => {
                    if let Some(t) = transfers.pop_front() {
                        if ok {
                            let o = land(&mut e, t, now);
                            got.entry(o.id).or_default().push(o.token);
                        } else {
                            e.fail_remote_prefill(t.rp.id, now).unwrap();
                        }
                    }
                }
                Op::Abort { nth } => {
                    if !live.is_empty() {
                        let id = live.remove(nth as usize % live.len());
                        transfers.retain(|t| t.rp.id != RequestId(id));
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
        prop_assert_eq!(e.num_awaiting_kv(), transfers.len());
        for t in std::mem::take(&mut transfers) {
            let o = land(&mut e, t, now);
            got.entry(o.id).or_default().push(o.token);
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
