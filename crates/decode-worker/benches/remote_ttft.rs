//! End-to-end effect of a remote prefill: time from a decode worker's `Generate` to its
//! first token for a fresh 16k-token prompt, prefilled locally vs remotely (the prefill
//! worker computes it and its KV moves over each transport, each block whole when its step
//! ends or layer by layer as the step goes), with the mocker's GPU timing (speedup 1). One
//! process, real gRPC on loopback, memory discovery and events.
//!
//! `cargo bench -p tandem-decode-worker --bench remote_ttft` — figures in
//! crates/kv-transfer/BENCHMARKS.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::KvShape;
use tandem_kv_transfer::{TransportConfig, TransportKind};
use tandem_protocol::grpc::{
    GenerateRequest, PrefillOutcome, RemotePrefillTarget, Sampling, worker_client::WorkerClient,
};
use tandem_protocol::{HashSeed, WorkerId, WorkerRole};
use tandem_runtime::discovery::MemoryDiscovery;
use tandem_runtime::events::MemoryEventPlane;
use tandem_runtime::shutdown::Shutdown;
use tandem_worker::{WorkerConfig, WorkerDeps};
use tandem_workload::LatencyHistogram;
use tokio_util::sync::CancellationToken;

const PROMPT: usize = 16_384;
const RUNS: usize = 3;

struct Worker {
    id: u64,
    addr: String,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), tandem_worker::WorkerError>>,
}

async fn start(
    id: u64,
    role: WorkerRole,
    shape: KvShape,
    stream_layers: bool,
    deps: &WorkerDeps,
) -> Worker {
    let mut cfg = WorkerConfig::new(WorkerId(id), role);
    cfg.kv_layer_streaming = stream_layers;
    cfg.engine.pool.device_blocks = (PROMPT / 16 * RUNS + 64) as u32;
    cfg.engine.mocker.kv_shape = shape;
    cfg.prefill_timeout = Duration::from_secs(60);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let s = Shutdown::new();
    let stop = s.drain_token().clone();
    let d = deps.clone();
    let task = tokio::spawn(async move {
        match role {
            WorkerRole::Prefill => tandem_prefill_worker::run(cfg, listener, d, s).await,
            _ => tandem_decode_worker::run(cfg, listener, d, s).await,
        }
    });
    Worker {
        id,
        addr,
        stop,
        task,
    }
}

/// Milliseconds from `Generate` to the first token, and how the prompt was prefilled.
async fn ttft(d: &Worker, p: &Worker, seed: u32, remote: bool) -> (f64, i32) {
    let ch = tandem_runtime::grpc::connect_channel(&d.addr, Duration::from_secs(5))
        .await
        .unwrap();
    let mut client = WorkerClient::new(ch).max_decoding_message_size(64 << 20);
    let prompt: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (seed.wrapping_mul(7919) + i * 31) % 32000)
        .collect();
    let req = GenerateRequest {
        request_id: u64::from(seed),
        prompt,
        sampling: Some(Sampling {
            max_tokens: 1,
            seed: 1,
            temperature: 0.0,
            stop_token: None,
            ignore_eos: true,
            top_p: None,
            ..Default::default()
        }),
        hash_seed: HashSeed::UNSALTED.0,
        remote_prefill: remote.then(|| RemotePrefillTarget {
            worker_id: p.id,
            address: p.addr.clone(),
        }),
        cache_salt: String::new(),
        lora_adapter: String::new(),
        text: None,
        whole: false,
    };
    let t = Instant::now();
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    (t.elapsed().as_secs_f64() * 1e3, first.prefill)
}

async fn run(shape_name: &str, shape: KvShape) {
    let kv_mib = (shape.bytes_per_token() * PROMPT) as f64 / (1 << 20) as f64;
    for kind in [
        None,
        Some(TransportKind::Local),
        Some(TransportKind::Tcp),
        Some(TransportKind::Ucx),
    ] {
        let transport = match kind {
            Some(k) => {
                let mut cfg = TransportConfig::default();
                cfg.ucx.net_devices = Some("lo".into());
                Some(tandem_kv_transfer::open(k, &cfg).await.unwrap())
            }
            None => None,
        };
        let deps = WorkerDeps {
            discovery: Arc::new(MemoryDiscovery::new()),
            events: Arc::new(MemoryEventPlane::new()),
            transport,
        };
        // Two prefill workers: one sends each block whole when its step ends, the other
        // each layer as it is computed (`--kv-layer-streaming`; inline sends go whole).
        let whole = start(1, WorkerRole::Prefill, shape, false, &deps).await;
        let streaming = start(3, WorkerRole::Prefill, shape, true, &deps).await;
        let d = start(2, WorkerRole::Decode, shape, true, &deps).await;
        let name = kind.map_or("inline (gRPC)", |k| k.as_str());
        let mut hist: [LatencyHistogram; 3] = Default::default();
        for i in 0..RUNS as u32 {
            let (ms, how) = ttft(&d, &whole, 1000 + i, false).await;
            assert_eq!(how, PrefillOutcome::Local as i32);
            hist[0].record_ms(ms);
            for (k, p) in [(1, &whole), (2, &streaming)] {
                let (ms, how) = ttft(&d, p, 2000 * k + i, true).await;
                assert_eq!(how, PrefillOutcome::Remote as i32, "{name}: fell back");
                hist[k as usize].record_ms(ms);
            }
        }
        let [l, w, y] = hist.map(|h| h.quantile_ms(0.5));
        let layered = match kind {
            Some(_) => format!("{y:.0} ({:.2}×)", y / l),
            None => String::new(),
        };
        println!(
            "| {shape_name} ({kv_mib:.0} MiB of KV) | {name} | {l:.0} | {w:.0} ({:.2}×) | {layered} |",
            w / l
        );
        for w in [whole, streaming, d] {
            w.stop.cancel();
            w.task.await.unwrap().unwrap();
        }
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "| KV shape | transport | local TTFT ms | remote, whole blocks (÷ local) | remote, layer by layer (÷ local) |"
    );
    println!("|---|---|---:|---:|---:|");
    rt.block_on(async {
        run("mocker default, 512 B/token", KvShape::MOCKER_DEFAULT).await;
        let bigger = KvShape {
            num_layers: 16,
            num_kv_heads: 4,
            head_dim: 64,
            dtype_bytes: 2,
        };
        run("16 layers × 4 heads × 64, 16 KiB/token", bigger).await;
    });
}
