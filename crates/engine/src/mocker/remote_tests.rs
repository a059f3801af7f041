//! Remote prefill between mock engines, byte for byte: a prefill engine P runs the prompt as a
//! one-token request, the test moves P's KV bytes into the blocks a decode engine D names, and
//! D must then produce exactly the tokens of an engine A that prefilled locally.

use tandem_protocol::{RequestId, StorageTier, WorkerId};

use super::tests::{drain, engine, prompt, request};
use super::*;
use crate::engine::{ExportedBlock, MockEngine, MockEngineConfig};
use crate::pool::BlockPoolConfig;
use crate::scheduler::{EngineRequest, RemotePrefill, SchedulerConfig, SchedulerError};

const BS: usize = 4;
const ID: RequestId = RequestId(1);

fn small(device_blocks: u32) -> MockEngine {
    engine(
        device_blocks,
        BS as u32,
        SchedulerConfig::default(),
        KvShape::MOCKER_DEFAULT,
    )
}

/// Tokens of `r` prefilled and decoded locally on a fresh engine.
fn local(r: EngineRequest) -> Vec<u32> {
    let mut a = small(64);
    let id = r.id;
    a.add_request(r, 0).unwrap();
    drain(&mut a, &mut 0).remove(&id).unwrap()
}

/// The prefill worker's side: runs the prompt of `r` with max_tokens 1. Returns the first
/// token and the block table the prompt's KV was written into (its bytes stay in P's arena
/// after the request is freed, as nothing else runs on P).
pub(super) fn prefill_on(p: &mut MockEngine, mut r: EngineRequest) -> (u32, Vec<u32>) {
    r.max_tokens = 1;
    let id = r.id;
    p.add_request(r, 0).unwrap();
    let (mut now, mut table, mut first) = (0, Vec::new(), None);
    while let Some(step) = p.begin_step(now) {
        table = p.pool().block_table(id).unwrap().to_vec();
        now += step.duration_us();
        for o in p.finish_step(now) {
            assert!(o.first_token && o.finish.is_some());
            first = Some(o.token);
        }
    }
    (first.expect("the prefill produced a token"), table)
}

/// The transport: P's blocks for the transferred positions into D's destination blocks.
fn transfer(p: &MockEngine, p_table: &[u32], d: &mut MockEngine, rp: &RemotePrefill) {
    let first = rp.cached_tokens / BS;
    for (k, &dst) in rp.blocks.iter().enumerate() {
        let bytes = p.pool().device_arena().block_bytes(p_table[first + k]);
        d.pool_mut().device_arena_mut().write_block(dst, &bytes);
    }
}

/// Finishes the remote prefill on D with P's first token and decodes to the end.
fn finish_and_decode(d: &mut MockEngine, id: RequestId, first: u32) -> Vec<u32> {
    let out = d.finish_remote_prefill(id, first, None, 1_000).unwrap();
    assert!(out.first_token);
    d.pool().check_invariants().unwrap();
    let mut tokens = vec![out.token];
    if out.finish.is_none() {
        tokens.extend(drain(d, &mut 1_000).remove(&id).unwrap());
    }
    tokens
}

#[test]
fn a_remote_prefill_decodes_exactly_like_a_local_one() {
    for len in [23, 24, 3] {
        let expected = local(request(1, prompt(5, len), 12));
        for p_budget in [8192, 8] {
            let mut p = engine(
                64,
                BS as u32,
                SchedulerConfig {
                    max_num_batched_tokens: p_budget,
                    ..Default::default()
                },
                KvShape::MOCKER_DEFAULT,
            );
            let (first, p_table) = prefill_on(&mut p, request(1, prompt(5, len), 12));
            assert_eq!(first, expected[0], "P's first token is A's");
            let mut d = small(64);
            let rp = d
                .begin_remote_prefill(request(1, prompt(5, len), 12), 0)
                .unwrap();
            assert_eq!((rp.cached_tokens, rp.blocks.len()), (0, len.div_ceil(BS)));
            assert!(
                d.begin_step(0).is_none(),
                "nothing to compute while awaiting KV"
            );
            transfer(&p, &p_table, &mut d, &rp);
            let got = finish_and_decode(&mut d, ID, first);
            assert_eq!(got, expected, "prompt {len}, P budget {p_budget}");
            assert_eq!(d.stats().prefill_tokens, 0, "D computed no prompt token");
            assert_eq!(d.pool().active_blocks(), 0);
            // The received blocks are in D's prefix cache with the right bytes: a later local
            // run of the prompt on D reuses them and still gives A's tokens.
            assert_eq!(
                d.pool().cached_count(StorageTier::Device),
                (len + 11) / BS,
                "the prompt's and the decoded tokens' full blocks"
            );
            d.add_request(request(2, prompt(5, len), 12), 2_000)
                .unwrap();
            let again = drain(&mut d, &mut 2_000).remove(&RequestId(2)).unwrap();
            assert_eq!(again, expected);
        }
    }
}

#[test]
fn a_corrupted_transferred_byte_changes_the_tokens() {
    let expected = local(request(1, prompt(5, 23), 12));
    let mut p = small(64);
    let (first, p_table) = prefill_on(&mut p, request(1, prompt(5, 23), 12));
    // A full block (any byte is folded) and the partial last block (its first token's bytes
    // are read when sampling, and folded once the block fills).
    for (block, byte) in [(1, 77), (5, 0)] {
        let mut d = small(64);
        let rp = d
            .begin_remote_prefill(request(1, prompt(5, 23), 12), 0)
            .unwrap();
        transfer(&p, &p_table, &mut d, &rp);
        d.pool_mut()
            .device_arena_mut()
            .with_block_mut(rp.blocks[block], |b| b[byte] ^= 1);
        let got = finish_and_decode(&mut d, ID, first);
        assert_eq!(got[0], expected[0], "the first token is P's");
        assert_ne!(got[1..], expected[1..], "block {block} byte {byte}");
    }
}

#[test]
fn a_failed_transfer_falls_back_to_a_local_prefill_with_the_same_tokens() {
    let expected = local(request(1, prompt(5, 23), 12));
    let mut p = small(64);
    let (_, p_table) = prefill_on(&mut p, request(1, prompt(5, 23), 12));
    let mut d = small(64);
    let rp = d
        .begin_remote_prefill(request(1, prompt(5, 23), 12), 0)
        .unwrap();
    // Half a transfer, then garbage: none of it may survive.
    transfer(&p, &p_table, &mut d, &rp);
    for &b in &rp.blocks[3..] {
        d.pool_mut()
            .device_arena_mut()
            .with_block_mut(b, |blk| blk.fill(0xAB));
    }
    d.fail_remote_prefill(ID, 10).unwrap();
    assert_eq!(d.pool().active_blocks(), 0);
    assert_eq!(d.pool().cached_count(StorageTier::Device), 0);
    d.pool().check_invariants().unwrap();
    let got = drain(&mut d, &mut 10).remove(&ID).unwrap();
    assert_eq!(got, expected);
    assert_eq!(d.stats().remote_prefill_fallbacks, 1);
    assert_eq!(d.stats().prefill_tokens, 23);
}

#[test]
fn a_prefix_cached_on_the_decode_worker_is_not_transferred() {
    let expected = local(request(1, prompt(5, 23), 12));
    let mut p = small(64);
    let (first, p_table) = prefill_on(&mut p, request(1, prompt(5, 23), 12));
    // D caches the first 3 blocks (a 12-token prefix of the prompt).
    let mut d = small(64);
    d.add_request(request(7, prompt(5, 12), 1), 0).unwrap();
    drain(&mut d, &mut 0);
    let rp = d
        .begin_remote_prefill(request(1, prompt(5, 23), 12), 0)
        .unwrap();
    assert_eq!(rp.cached_tokens, 12);
    assert_eq!(rp.transfer(), 12..23);
    assert_eq!(rp.blocks.len(), 3);
    transfer(&p, &p_table, &mut d, &rp);
    let got = finish_and_decode(&mut d, ID, first);
    assert_eq!(got, expected);

    // A prompt cached whole on D (block-aligned): nothing travels but the first token.
    let expected = local(request(1, prompt(6, 16), 5));
    let (first, _) = prefill_on(&mut small(64), request(1, prompt(6, 16), 5));
    let mut d = small(64);
    d.add_request(request(7, prompt(6, 16), 1), 0).unwrap();
    drain(&mut d, &mut 0);
    let rp = d
        .begin_remote_prefill(request(1, prompt(6, 16), 5), 0)
        .unwrap();
    assert_eq!((rp.cached_tokens, rp.blocks.len()), (16, 0));
    assert_eq!(finish_and_decode(&mut d, ID, first), expected);
}

#[test]
fn a_prefix_on_the_host_tier_is_promoted_and_not_transferred() {
    let expected = local(request(1, prompt(5, 23), 12));
    let mut p = small(64);
    let (first, p_table) = prefill_on(&mut p, request(1, prompt(5, 23), 12));
    let mut pool = BlockPoolConfig::new(WorkerId(4), 10);
    pool.block_size = tandem_protocol::BlockSize::new(BS as u32).unwrap();
    pool.host_blocks = 16;
    let mut d = MockEngine::new(MockEngineConfig::new(pool)).unwrap();
    d.add_request(request(7, prompt(5, 12), 1), 0).unwrap();
    drain(&mut d, &mut 0);
    // Another prompt fills the device: the cached prefix moves to host.
    d.add_request(request(8, prompt(9, 40), 1), 0).unwrap();
    drain(&mut d, &mut 0);
    assert_eq!(d.pool().cached_count(StorageTier::Host), 3);
    let rp = d
        .begin_remote_prefill(request(1, prompt(5, 23), 12), 0)
        .unwrap();
    assert_eq!(rp.cached_tokens, 12);
    assert_eq!(d.pool().stats().host_promotions, 3);
    transfer(&p, &p_table, &mut d, &rp);
    assert_eq!(finish_and_decode(&mut d, ID, first), expected);
}

#[test]
fn abort_while_awaiting_kv_leaves_no_active_blocks() {
    let mut d = small(64);
    d.add_request(request(2, prompt(1, 9), 4), 0).unwrap();
    d.begin_step(0).unwrap();
    d.begin_remote_prefill(request(1, prompt(5, 23), 12), 0)
        .unwrap();
    assert!(d.abort(ID));
    d.finish_step(10);
    drain(&mut d, &mut 10);
    assert_eq!(d.pool().active_blocks(), 0);
    assert_eq!(d.num_awaiting_kv(), 0);
    assert!(!d.has_work());
    d.pool().check_invariants().unwrap();
}

#[test]
fn a_full_pool_refuses_the_reservation_and_a_local_prefill_still_serves() {
    let expected = local(request(1, prompt(5, 23), 12));
    // 10 blocks; a running request holds 5 of them.
    let mut d = small(10);
    d.add_request(request(2, prompt(1, 17), 4), 0).unwrap();
    let mut now = d.begin_step(0).unwrap().duration_us();
    d.finish_step(now);
    let before = (d.pool().last_event_id(), d.pool().available_blocks());
    let e = d
        .begin_remote_prefill(request(1, prompt(5, 23), 12), now)
        .unwrap_err();
    assert!(matches!(e, SchedulerError::NoRoomForKv { needed: 6, .. }));
    assert_eq!(
        (d.pool().last_event_id(), d.pool().available_blocks()),
        before
    );
    assert_eq!(d.num_awaiting_kv(), 0);
    d.pool().check_invariants().unwrap();
    d.add_request(request(1, prompt(5, 23), 12), now).unwrap();
    let got = drain(&mut d, &mut now).remove(&ID).unwrap();
    assert_eq!(got, expected);
}

/// The prefill worker's export path: blocks copied out step by step (a small token budget
/// makes the prompt span several chunks), from the decode worker's first uncached block on,
/// while other requests run on P and reuse freed blocks.
#[test]
fn exported_blocks_decode_exactly_like_a_local_prefill() {
    let expected = local(request(1, prompt(5, 23), 12));
    let mut p = engine(
        64,
        BS as u32,
        SchedulerConfig {
            max_num_batched_tokens: 5,
            ..Default::default()
        },
        KvShape::MOCKER_DEFAULT,
    );
    // P caches the first 2 blocks already: exported from its cache, not recomputed.
    p.add_request(request(9, prompt(5, 8), 1), 0).unwrap();
    drain(&mut p, &mut 0);
    // D caches the first 3 blocks: only blocks 3.. travel.
    let mut d = small(64);
    d.add_request(request(7, prompt(5, 12), 1), 0).unwrap();
    drain(&mut d, &mut 0);
    let rp = d
        .begin_remote_prefill(request(1, prompt(5, 23), 12), 0)
        .unwrap();
    assert_eq!(rp.cached_tokens, 12);

    let mut r = request(1, prompt(5, 23), 12);
    r.max_tokens = 1;
    p.add_request(r, 0).unwrap();
    p.export_kv(ID, rp.cached_tokens);
    p.add_request(request(3, prompt(8, 30), 6), 0).unwrap();
    let (mut now, mut got_blocks, mut first, mut steps_with_blocks) = (0, Vec::new(), None, 0);
    while let Some(step) = p.begin_step(now) {
        now += step.duration_us();
        for o in p.finish_step(now) {
            if o.id == ID {
                first = Some(o.token);
            }
        }
        if let Some((blocks, finished)) = p.take_exported(ID) {
            steps_with_blocks += usize::from(!blocks.is_empty());
            got_blocks.extend(blocks);
            if finished {
                assert!(p.take_exported(ID).is_none(), "forgotten once finished");
            }
        }
    }
    assert!(steps_with_blocks > 1, "blocks leave as chunks finish");
    let idx: Vec<usize> = got_blocks.iter().map(|b| b.index).collect();
    assert_eq!(
        idx,
        vec![0, 1, 2],
        "blocks 3, 4 and the partial 5, in order"
    );
    for (b, &dst) in got_blocks.iter().zip(&rp.blocks) {
        d.pool_mut().device_arena_mut().write_block(dst, &b.bytes);
    }
    let got = finish_and_decode(&mut d, ID, first.unwrap());
    assert_eq!(got, expected);
}

/// Storage a transport would register: here a plain buffer behind the trait.
struct External(Vec<u8>);

impl crate::arena::ArenaStorage for External {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        f(&self.0[offset..offset + len]);
    }
    fn write(&mut self, offset: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        f(&mut self.0[offset..offset + len]);
    }
    fn read_many(&self, offsets: &[usize], len: usize, f: &mut dyn FnMut(&[&[u8]])) {
        self.0.read_many(offsets, len, f)
    }
}

#[test]
fn a_device_arena_in_external_storage_serves_like_the_default_one() {
    let expected = local(request(1, prompt(5, 23), 12));
    let mut pool = BlockPoolConfig::new(WorkerId(3), 64);
    pool.block_size = tandem_protocol::BlockSize::new(BS as u32).unwrap();
    let cfg = MockEngineConfig::new(pool);
    let bytes = 64 * MockEngine::bytes_per_block(&cfg);
    let mut d =
        MockEngine::with_device_storage(cfg.clone(), Box::new(External(vec![7; bytes]))).unwrap();
    d.add_request(request(1, prompt(5, 23), 12), 0).unwrap();
    assert_eq!(drain(&mut d, &mut 0).remove(&ID).unwrap(), expected);

    let short = Box::new(External(vec![0; bytes - 1]));
    let e = MockEngine::with_device_storage(cfg, short).unwrap_err();
    assert!(e.to_string().contains("needs"), "{e}");
}

/// A block that held a prefix the mocker read back, handed out again and filled by a transfer
/// behind the arena's back (as UCX and TCP write into a worker's region), is read anew: the
/// arena forgets a block's bytes when the pool hands it out.
#[test]
fn a_block_refilled_behind_the_arenas_back_is_read_anew() {
    let expected = local(request(1, prompt(5, 23), 12));
    let mut p = small(64);
    let (_, p_table) = prefill_on(&mut p, request(1, prompt(5, 23), 12));
    let mut pool = BlockPoolConfig::new(WorkerId(3), 16);
    pool.block_size = tandem_protocol::BlockSize::new(BS as u32).unwrap();
    let cfg = MockEngineConfig::new(pool);
    let per_block = MockEngine::bytes_per_block(&cfg);
    let storage = crate::arena::tests::Shared::new(16 * per_block);
    let shared = storage.bytes.clone();
    let mut d = MockEngine::with_device_storage(cfg, Box::new(storage)).unwrap();
    // D computes the prompt itself: its full blocks are read back and remembered.
    let (first, d_table) = prefill_on(&mut d, request(1, prompt(5, 23), 12));
    assert_eq!(first, expected[0]);
    d.pool_mut().clear_cache();
    let rp = d
        .begin_remote_prefill(request(2, prompt(5, 23), 12), 0)
        .unwrap();
    assert_eq!(rp.cached_tokens, 0);
    let reused: Vec<usize> = (0..23 / BS)
        .filter(|&k| rp.blocks[k] == d_table[k])
        .collect();
    assert!(!reused.is_empty(), "a full block went back to where it was");
    // The transfer: P's bytes straight into D's storage, one byte of a reused block flipped.
    for (k, &dst) in rp.blocks.iter().enumerate() {
        let mut bytes = p.pool().device_arena().block_bytes(p_table[k]);
        if k == reused[0] {
            bytes[77] ^= 1;
        }
        for (i, b) in bytes.into_iter().enumerate() {
            shared[dst as usize * per_block + i].store(b, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let got = finish_and_decode(&mut d, RequestId(2), first);
    assert_ne!(got[1..], expected[1..], "the flipped byte was read");
}

/// An export by reference names arena blocks instead of copying them; they stay pinned with
/// the bytes a copy would have had until released, even under pressure for blocks, and the
/// request id stays taken until then.
#[test]
fn an_export_by_reference_pins_its_blocks_until_released() {
    let mut copy = small(8);
    let mut r = request(1, prompt(6, 18), 1);
    copy.add_request(r.clone(), 0).unwrap();
    copy.export_kv(ID, 0);
    drain(&mut copy, &mut 0);
    let copied = copy.take_exported(ID).unwrap().0;

    let mut p = small(8);
    r.max_tokens = 1;
    p.add_request(r.clone(), 0).unwrap();
    p.export_kv_by_reference(ID, 0);
    drain(&mut p, &mut 0);
    let (named, finished) = p.take_exported(ID).unwrap();
    assert!(finished);
    assert_eq!(named.len(), copied.len());
    for (n, c) in named.iter().zip(&copied) {
        assert!(n.bytes.is_empty(), "no copy");
        assert_eq!(n.index, c.index);
        assert_eq!(p.pool().device_arena().block_bytes(n.block), c.bytes);
    }
    assert_eq!(p.pool().held_blocks(), 5, "the whole table is pinned");
    p.pool().check_invariants().unwrap();
    assert!(matches!(
        p.add_request(r.clone(), 0),
        Err(SchedulerError::DuplicateRequest(_))
    ));
    // Another request wants every block: the pinned ones are not its to take.
    p.add_request(request(2, prompt(7, 30), 1), 0).unwrap();
    let mut now = 0;
    while let Some(step) = p.begin_step(now) {
        now += step.duration_us();
        p.finish_step(now);
        if now > 10_000_000 {
            break;
        }
    }
    for (n, c) in named.iter().zip(&copied) {
        assert_eq!(
            p.pool().device_arena().block_bytes(n.block),
            c.bytes,
            "unchanged"
        );
    }
    p.release_export(ID);
    assert_eq!(p.pool().held_blocks(), 0);
    p.pool().check_invariants().unwrap();
    drain(&mut p, &mut now);
    p.add_request(r, now).unwrap();
}

/// Before a step computes, the engine names the blocks of an export by reference that the
/// step completes — exactly what `take_exported` hands over once it ends — so a host can send
/// their layers while they are computed. Exports that copy are not named (their bytes are
/// taken when the step ends).
#[test]
fn a_step_names_the_exported_blocks_it_completes_before_computing_them() {
    let sched = SchedulerConfig {
        max_num_batched_tokens: 12,
        ..SchedulerConfig::default()
    };
    let mut p = engine(64, BS as u32, sched.clone(), KvShape::MOCKER_DEFAULT);
    p.add_request(request(1, prompt(6, 41), 1), 0).unwrap();
    p.export_kv_by_reference(ID, 4);
    let (mut now, mut steps, mut taken_all) = (0, 0, Vec::new());
    while let Some(step) = p.begin_step(now) {
        let named: Vec<ExportedBlock> = p
            .step_exports()
            .into_iter()
            .filter(|(id, _)| *id == ID)
            .flat_map(|(_, blocks)| blocks)
            .collect();
        now += step.duration_us();
        p.finish_step(now);
        let (taken, finished) = p.take_exported(ID).unwrap_or_default();
        assert_eq!(named, taken, "step {steps}");
        taken_all.extend(taken);
        steps += 1;
        if finished {
            break;
        }
    }
    assert!(steps >= 4, "chunked: {steps} steps");
    // From token 4 on: blocks 1..=10 of the 41-token prompt (the last one partial).
    let indices: Vec<usize> = taken_all.iter().map(|b| b.index).collect();
    assert_eq!(indices, (0..10).collect::<Vec<_>>());
    assert!(p.step_exports().is_empty(), "no step in flight");

    let mut c = engine(64, BS as u32, sched, KvShape::MOCKER_DEFAULT);
    c.add_request(request(1, prompt(6, 41), 1), 0).unwrap();
    c.export_kv(ID, 0);
    c.begin_step(0).unwrap();
    assert!(c.step_exports().is_empty(), "copies are not named ahead");
}
