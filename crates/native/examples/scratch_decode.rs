//! The native engine's speed on a GGUF: prefill of a 512-token prompt, decode at batch 1
//! after a 512-token context, and 16 concurrent streams' aggregate decode rate, through
//! tandem's engine (scheduler, paged KV, sampling). scripts/bench-engine.sh runs it beside
//! llama.cpp on the same file and threads.
//!
//!     cargo run --release -p tandem-native --example bench_engine -- MODEL.gguf THREADS [ISA]
//!
//! `ISA` (`portable`, `avx2`, `avxvnni`, `avx512vnni`; default: the best the CPU has) picks the kernels, to
//! compare instruction sets on one machine.

use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{
    BlockPoolConfig, Engine, EngineConfig, EngineRequest, SamplingParams, SchedulerConfig,
};
use tandem_native::{GgufFile, Isa, Kernels, NativeModel, Precision};
use tandem_protocol::{RequestId, WorkerId};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("MODEL.gguf");
    let threads: usize = args.next().map_or(2, |t| t.parse().expect("THREADS"));
    let isa = match args.next().as_deref() {
        None => Isa::detect(),
        Some("portable") => Isa::Portable,
        Some("avx2") => Isa::Avx2,
        Some("avxvnni") => Isa::AvxVnni,
        Some("avx512vnni") => Isa::Avx512Vnni,
        Some(other) => panic!("unknown ISA {other}: portable, avx2, avxvnni or avx512vnni"),
    };
    let file = GgufFile::read(&path).expect("read the model");
    let llama = Arc::new(tandem_native::load(&file, Precision::Quantized).expect("load"));
    let kernels = Kernels::new(isa);
    let engine = || {
        let model = NativeModel::new(llama.clone(), kernels, 16, threads);
        let cfg = EngineConfig {
            pool: BlockPoolConfig::new(WorkerId(1), 1024),
            scheduler: SchedulerConfig::default(),
        };
        Engine::new_with_model(cfg, model).expect("engine")
    };
    let request = |id: u64, len: usize, max_tokens: u32| {
        let prompt = (0..len as u32).map(|i| 200 + (i * 7919 + id as u32 * 31) % 40_000);
        let mut r = EngineRequest::new(RequestId(id), prompt.collect(), max_tokens);
        r.sampling = SamplingParams::GREEDY;
        r.ignore_eos = true;
        r
    };
    let step = |e: &mut Engine<NativeModel>, t: &mut u64| -> usize {
        e.begin_step(*t).expect("work");
        *t += 1;
        e.finish_step(*t).len()
    };

    // Decode at batch 1: 64 tokens after a 512-token prompt.
    let mut e = engine();
    e.add_request(request(9, 512, 201), 0).unwrap();
    let mut t = 0;
    while step(&mut e, &mut t) == 0 {}
    let start = Instant::now();
    let mut decoded = 0;
    while e.has_work() {
        decoded += step(&mut e, &mut t);
    }
    let decode_s = start.elapsed().as_secs_f64();

    println!("{}", decoded as f64 / decode_s);
}
