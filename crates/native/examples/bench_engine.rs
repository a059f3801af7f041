//! The native engine's speed on a GGUF: prefill of a 512-token prompt, decode at batch 1
//! after a 512-token context, and 16 concurrent streams' aggregate decode rate, through
//! tandem's engine (scheduler, paged KV, sampling). scripts/bench-engine.sh runs it beside
//! llama.cpp on the same file and threads.
//!
//!     cargo run --release -p tandem-native --example bench_engine -- MODEL.gguf THREADS [ISA]
//!
//! `ISA` (`portable`, `avx2`, `avxvnni`, `avx512vnni`; default: the best the CPU has) picks the kernels, to
//! compare instruction sets on one machine. Built with `--features cuda`, `cuda` or `cuda:N`
//! computes on that GPU instead (its KV arena in device memory), and adds 64 streams.

use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{
    BlockPoolConfig, Engine, EngineConfig, EngineRequest, Model, SamplingParams, SchedulerConfig,
};
use tandem_native::{GgufFile, Isa, Kernels, NativeModel, Precision};
use tandem_protocol::{RequestId, WorkerId};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("MODEL.gguf");
    let threads: usize = args.next().map_or(2, |t| t.parse().expect("THREADS"));
    let isa_arg = args.next();
    let file = GgufFile::read(&path).expect("read the model");
    let llama = Arc::new(tandem_native::load(&file, Precision::Quantized).expect("load"));
    #[cfg(feature = "cuda")]
    if let Some(ordinal) = isa_arg
        .as_deref()
        .and_then(|a| a.parse::<tandem_native::gpu::Device>().ok())
        .and_then(|d| match d {
            tandem_native::gpu::Device::Cuda(n) => Some(n),
            tandem_native::gpu::Device::Cpu => None,
        })
    {
        use tandem_native::gpu::{DeviceArena, GpuModel, GpuWeights};
        let blocks = 2048;
        let weights = GpuWeights::upload(llama.clone(), ordinal).expect("the GPU");
        let bytes_per_block = NativeModel::kv_shape_of(&llama).bytes_per_block(16);
        let engine = move || {
            let model: Box<dyn Model> =
                Box::new(GpuModel::new(weights.clone(), 16).expect("a stream"));
            let arena = DeviceArena::new(weights.gpu(), blocks * bytes_per_block).expect("arena");
            let cfg = EngineConfig {
                pool: BlockPoolConfig::new(WorkerId(1), blocks as u32),
                scheduler: SchedulerConfig {
                    max_num_batched_tokens: 8192,
                    max_num_seqs: 256,
                    ..SchedulerConfig::default()
                },
            };
            Engine::with_model_and_storage(cfg, model, Box::new(arena)).expect("engine")
        };
        return bench(&engine, "cuda", threads, &[16, 64]);
    }
    let isa = match isa_arg.as_deref() {
        None => Isa::detect(),
        Some("portable") => Isa::Portable,
        Some("avx2") => Isa::Avx2,
        Some("avxvnni") => Isa::AvxVnni,
        Some("avx512vnni") => Isa::Avx512Vnni,
        Some(other) => panic!("unknown ISA {other}: portable, avx2, avxvnni or avx512vnni"),
    };
    let kernels = Kernels::new(isa);
    let engine = || {
        let model: Box<dyn Model> = Box::new(NativeModel::new(llama.clone(), kernels, 16, threads));
        let cfg = EngineConfig {
            pool: BlockPoolConfig::new(WorkerId(1), 1024),
            scheduler: SchedulerConfig::default(),
        };
        Engine::new_with_model(cfg, model).expect("engine")
    };
    bench(&engine, &format!("{:?}", kernels.isa()), threads, &[16]);
}

type AnyEngine = Engine<Box<dyn Model>>;

/// Prefill, decode at batch 1 and the aggregate rate of `streams` concurrent streams on
/// engines from `engine`, printed as one JSON line.
fn bench(engine: &dyn Fn() -> AnyEngine, isa: &str, threads: usize, streams: &[u64]) {
    let request = |id: u64, len: usize, max_tokens: u32| {
        let prompt = (0..len as u32).map(|i| 200 + (i * 7919 + id as u32 * 31) % 40_000);
        let mut r = EngineRequest::new(RequestId(id), prompt.collect(), max_tokens);
        r.sampling = SamplingParams::GREEDY;
        r.ignore_eos = true;
        r
    };
    let step = |e: &mut AnyEngine, t: &mut u64| -> usize {
        e.begin_step(*t).expect("work");
        *t += 1;
        e.finish_step(*t).len()
    };

    // Prefill: one 512-token prompt in one step (best of 3).
    let mut prefill_s = f64::MAX;
    for i in 0..3 {
        let mut e = engine();
        e.add_request(request(i, 512, 1), 0).unwrap();
        let start = Instant::now();
        let mut t = 0;
        while step(&mut e, &mut t) == 0 {}
        prefill_s = prefill_s.min(start.elapsed().as_secs_f64());
    }

    // Decode at batch 1: 64 tokens after a 512-token prompt.
    let mut e = engine();
    e.add_request(request(9, 512, 65), 0).unwrap();
    let mut t = 0;
    while step(&mut e, &mut t) == 0 {}
    let start = Instant::now();
    let mut decoded = 0;
    while e.has_work() {
        decoded += step(&mut e, &mut t);
    }
    let decode_s = start.elapsed().as_secs_f64();

    // Decode at batch 1 after a 16-token prompt (what attention costs, by difference).
    let mut e = engine();
    e.add_request(request(8, 16, 33), 0).unwrap();
    let mut t = 0;
    while step(&mut e, &mut t) == 0 {}
    let start = Instant::now();
    let mut short = 0;
    while e.has_work() {
        short += step(&mut e, &mut t);
    }
    let short_s = start.elapsed().as_secs_f64();

    // Concurrent streams: 128-token prompts prefilled first, then 64 tokens each, every step
    // computing all the rows.
    let mut aggregate = serde_json::Map::new();
    for &n in streams {
        let mut e = engine();
        for i in 0..n {
            e.add_request(request(100 + i, 128, 65), 0).unwrap();
        }
        let mut t = 0;
        let mut firsts = 0;
        while firsts < n as usize {
            firsts += step(&mut e, &mut t);
        }
        let start = Instant::now();
        let mut batch_tokens = 0;
        while e.has_work() {
            batch_tokens += step(&mut e, &mut t);
        }
        let rate = batch_tokens as f64 / start.elapsed().as_secs_f64();
        aggregate.insert(format!("decode_b{n}_aggregate_tok_s"), rate.into());
    }

    let mut out = serde_json::json!({
        "engine": "tandem",
        "isa": isa,
        "threads": threads,
        "prefill_512_tok_s": 512.0 / prefill_s,
        "decode_b1_ctx512_tok_s": decoded as f64 / decode_s,
        "decode_b1_ctx16_tok_s": short as f64 / short_s,
    });
    out.as_object_mut().expect("an object").extend(aggregate);
    println!("{out}");
}
