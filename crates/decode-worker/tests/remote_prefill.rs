//! A prefill worker and decode workers in one process, on memory discovery and events, over
//! real gRPC on loopback: a remote prefill decodes exactly like a local one, a dead prefill
//! worker means a local fallback, and a dropped stream frees every block it held.

use std::sync::Arc;
use std::time::Duration;

use tandem_kv_transfer::{RegionDescriptor, Transport, TransportConfig, TransportKind};
use tandem_protocol::ErrorClass;
use tandem_protocol::grpc::{
    AbortPrefillReply, AbortPrefillRequest, GenerateChunk, GenerateRequest, HealthReply,
    HealthRequest, KvEventsReply, KvEventsRequest, KvLanded, PrefillChunk, PrefillOutcome,
    PrefillRequest, RemotePrefillTarget, Sampling, kv_events_reply, prefill_chunk,
    worker_client::WorkerClient, worker_server,
};
use tandem_protocol::{Envelope, KvEvent, WorkerId, WorkerRole};
use tandem_runtime::discovery::MemoryDiscovery;
use tandem_runtime::events::{MemoryEventPlane, subjects};
use tandem_runtime::shutdown::Shutdown;
use tandem_worker::{WorkerConfig, WorkerDeps};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

struct Running {
    addr: String,
    stop: CancellationToken,
    task: JoinHandle<Result<(), tandem_worker::WorkerError>>,
}

fn deps() -> WorkerDeps {
    WorkerDeps {
        discovery: Arc::new(MemoryDiscovery::new()),
        events: Arc::new(MemoryEventPlane::new()),
        transport: None,
    }
}

/// A KV transport of `kind` for this process (UCX on loopback only).
async fn transport(kind: TransportKind) -> Arc<dyn Transport> {
    let mut cfg = TransportConfig::default();
    cfg.ucx.net_devices = Some("lo".into());
    tandem_kv_transfer::open(kind, &cfg).await.unwrap()
}

fn config(id: u64, role: WorkerRole) -> WorkerConfig {
    let mut c = WorkerConfig::new(WorkerId(id), role);
    c.engine.pool.device_blocks = 256;
    c.engine.mocker.speedup_ratio = 20.0;
    c.load_interval = Duration::from_millis(50);
    c.prefill_timeout = Duration::from_secs(5);
    c.drain_timeout = Duration::from_secs(5);
    c
}

async fn start(id: u64, role: WorkerRole, deps: &WorkerDeps) -> Running {
    start_with(config(id, role), deps).await
}

async fn start_with(cfg: WorkerConfig, deps: &WorkerDeps) -> Running {
    let role = cfg.role;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let s = Shutdown::new();
    let stop = s.drain_token().clone();
    let deps = deps.clone();
    let task = tokio::spawn(async move {
        match role {
            WorkerRole::Prefill => tandem_prefill_worker::run(cfg, listener, deps, s).await,
            _ => tandem_decode_worker::run(cfg, listener, deps, s).await,
        }
    });
    Running { addr, stop, task }
}

async fn client(addr: &str) -> WorkerClient<Channel> {
    let ch = tandem_runtime::grpc::connect_channel(addr, Duration::from_secs(5))
        .await
        .unwrap();
    WorkerClient::new(ch)
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed.wrapping_mul(7919) + i * 31) % 32000)
        .collect()
}

fn request(id: u64, prompt: Vec<u32>, remote: Option<&Running>) -> GenerateRequest {
    GenerateRequest {
        request_id: id,
        prompt,
        sampling: Some(Sampling {
            max_tokens: 24,
            seed: 7,
            temperature: 0.0,
            stop_token: None,
            ignore_eos: true,
            top_p: None,
            ..Default::default()
        }),
        hash_seed: tandem_protocol::HashSeed::UNSALTED.0,
        remote_prefill: remote.map(|p| RemotePrefillTarget {
            worker_id: 1,
            address: p.addr.clone(),
        }),
        cache_salt: String::new(),
        lora_adapter: String::new(),
        text: None,
        whole: false,
    }
}

async fn generate(c: &mut WorkerClient<Channel>, req: GenerateRequest) -> Vec<GenerateChunk> {
    let mut stream = c.generate(req).await.unwrap().into_inner();
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        chunks.push(chunk);
    }
    chunks
}

fn tokens(chunks: &[GenerateChunk]) -> Vec<u32> {
    chunks.iter().flat_map(|c| c.tokens.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_decodes_like_local_inline() {
    remote_prefill_decodes_like_local_and_falls_back_when_the_prefill_worker_dies(deps(), true)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_decodes_like_local_over_each_transport() {
    for kind in [TransportKind::Local, TransportKind::Tcp, TransportKind::Ucx] {
        let mut d = deps();
        d.transport = Some(transport(kind).await);
        remote_prefill_decodes_like_local_and_falls_back_when_the_prefill_worker_dies(d, true)
            .await;
    }
    // Layer streaming off: every block goes whole when its step ends, the same tokens.
    let mut d = deps();
    d.transport = Some(transport(TransportKind::Tcp).await);
    remote_prefill_decodes_like_local_and_falls_back_when_the_prefill_worker_dies(d, false).await;
}

/// The value of counter `name` on a worker's `/metrics` at `addr` (a plain HTTP/1.0 GET).
async fn scrape_counter(addr: &str, name: &str) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {body}"))
}

async fn remote_prefill_decodes_like_local_and_falls_back_when_the_prefill_worker_dies(
    deps: WorkerDeps,
    stream_layers: bool,
) {
    let metrics = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap().to_string()
    };
    let mut prefill = config(1, WorkerRole::Prefill);
    prefill.metrics_listen = Some(metrics.clone());
    prefill.kv_layer_streaming = stream_layers;
    let p = start_with(prefill, &deps).await;
    let d1 = start(2, WorkerRole::Decode, &deps).await;
    let d2 = start(3, WorkerRole::Decode, &deps).await;
    let (mut c1, mut c2) = (client(&d1.addr).await, client(&d2.addr).await);

    let long = prompt(5, 300);
    let local = generate(&mut c1, request(10, long.clone(), None)).await;
    assert_eq!(local[0].prefill, PrefillOutcome::Local as i32);
    assert_eq!(local.len(), 24);
    assert_eq!(local.last().unwrap().finish, 1, "length");

    let remote = generate(&mut c2, request(11, long.clone(), Some(&p))).await;
    assert_eq!(remote[0].prefill, PrefillOutcome::Remote as i32);
    assert_eq!(
        tokens(&remote),
        tokens(&local),
        "remote prefill = local prefill"
    );
    // Through a transport, the blocks' first layers left while the step computed the rest
    // (the mocker's step is timed: its layers are told over the step's modelled time).
    let early = scrape_counter(&metrics, "tandem_worker_kv_transfer_early_bytes_total").await;
    if deps.transport.is_some() && stream_layers {
        assert!(early > 0.0, "layers streamed ahead of the step's end");
    } else {
        assert_eq!(early, 0.0, "inline, or streaming off: blocks go whole");
    }

    // The received blocks are in d2's prefix cache and published as stored.
    let mut sub_check = c2
        .kv_events(KvEventsRequest {
            after: 0,
            dump: true,
        })
        .await
        .unwrap()
        .into_inner();
    let Some(kv_events_reply::Body::Dump(bytes)) = sub_check.body.take() else {
        panic!("asked for a dump");
    };
    let dump = tandem_protocol::KvDump::decode(&bytes).unwrap();
    assert!(!dump.events.is_empty(), "d2 caches the prompt's blocks");

    // A prefix d2 now holds: only the rest would travel; the output is still the same.
    let again = generate(&mut c2, request(12, long.clone(), Some(&p))).await;
    assert_eq!(again[0].cached_tokens, 288, "18 full blocks cached on d2");
    assert_eq!(tokens(&again), tokens(&local));
    // Nothing stays pinned or held on either side once the transfers are over (reports
    // from now on only).
    let mut loads = deps
        .events
        .subscribe(&subjects::load_reports("default"))
        .await
        .unwrap();
    for w in [1, 3] {
        report_where(&mut loads, w, Duration::from_secs(2), |r| {
            r.kv_active_blocks == 0 && r.running_requests == 0
        })
        .await;
    }

    // The prefill worker goes away: d1 falls back to a local prefill, same tokens.
    let gone = Running {
        addr: p.addr.clone(),
        stop: p.stop.clone(),
        task: tokio::spawn(async { Ok(()) }),
    };
    p.stop.cancel();
    p.task.await.unwrap().unwrap();
    let other = prompt(9, 200);
    let expected = generate(&mut c1, request(13, other.clone(), None)).await;
    let fallback = generate(&mut c2, request(14, other, Some(&gone))).await;
    assert_eq!(fallback[0].prefill, PrefillOutcome::Fallback as i32);
    assert_eq!(tokens(&fallback), tokens(&expected));

    for w in [d1, d2] {
        w.stop.cancel();
        w.task.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_reach_the_event_plane_and_a_dropped_stream_frees_its_blocks() {
    let deps = deps();
    let mut sub = deps
        .events
        .subscribe(&subjects::kv_events("default"))
        .await
        .unwrap();
    let d = start(2, WorkerRole::Decode, &deps).await;
    let mut c = client(&d.addr).await;
    let mut req = request(20, prompt(3, 160), None);
    req.sampling.as_mut().unwrap().max_tokens = 3000;
    let mut stream = c.generate(req).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.prompt_tokens, 160);
    drop(stream);

    // Events flow, numbered from 1 without gaps; after the drop, the request's blocks are
    // released: every stored block of the prompt is eventually either still cached
    // (evictable) or removed, and the worker reports no active blocks.
    let mut next_id = 1;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut load_sub = deps
        .events
        .subscribe(&subjects::load_reports("default"))
        .await
        .unwrap();
    while next_id < 2 {
        let bytes = tokio::time::timeout_at(deadline, sub.next())
            .await
            .unwrap()
            .unwrap();
        for ev in Vec::<KvEvent>::decode(&bytes).unwrap() {
            assert_eq!(ev.event_id, next_id);
            next_id += 1;
        }
    }
    loop {
        let bytes = tokio::time::timeout_at(deadline, load_sub.next())
            .await
            .expect("an idle load report within 5 s")
            .unwrap();
        let report = tandem_protocol::LoadReport::decode(&bytes).unwrap();
        if report.running_requests == 0 && report.kv_active_blocks == 0 {
            break;
        }
    }
    d.stop.cancel();
    d.task.await.unwrap().unwrap();
    assert!(
        deps.discovery.list().await.unwrap().is_empty(),
        "deregistered"
    );
}

/// Waits for a load report of `worker` satisfying `f`, for at most `within`.
async fn report_where(
    sub: &mut tandem_runtime::events::Subscription,
    worker: u64,
    within: Duration,
    f: impl Fn(&tandem_protocol::LoadReport) -> bool,
) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let bytes = tokio::time::timeout_at(deadline, sub.next())
            .await
            .expect("a matching load report in time")
            .unwrap();
        let r = tandem_protocol::LoadReport::decode(&bytes).unwrap();
        if r.worker_id.0 == worker && f(&r) {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_transfer_frees_the_blocks_on_both_workers() {
    let deps = deps();
    let mut loads = deps
        .events
        .subscribe(&subjects::load_reports("default"))
        .await
        .unwrap();
    // A slow prefill worker: 12 chunks of 256 tokens, about 0.4 s each.
    let mut pcfg = config(1, WorkerRole::Prefill);
    pcfg.engine.mocker.speedup_ratio = 0.05;
    pcfg.engine.scheduler.max_num_batched_tokens = 256;
    let p = start_with(pcfg, &deps).await;
    let d = start(2, WorkerRole::Decode, &deps).await;
    let mut c = client(&d.addr).await;
    let stream = c
        .generate(request(30, prompt(4, 3000), Some(&p)))
        .await
        .unwrap()
        .into_inner();
    // Both hold blocks for it: the prefill is under way, the decode worker awaits the KV.
    report_where(&mut loads, 1, Duration::from_secs(2), |r| {
        r.kv_active_blocks > 0
    })
    .await;
    report_where(&mut loads, 2, Duration::from_secs(2), |r| {
        r.kv_active_blocks == 188
    })
    .await;
    drop(stream);
    // Long before the prefill would have finished (~4.8 s), both are empty again.
    for w in [1, 2] {
        report_where(&mut loads, w, Duration::from_secs(3), |r| {
            r.kv_active_blocks == 0 && r.running_requests == 0 && r.waiting_requests == 0
        })
        .await;
    }
    for w in [p, d] {
        w.stop.cancel();
        w.task.await.unwrap().unwrap();
    }
}

/// One corrupted byte in a transfer (injected by the prefill worker after the digest) is
/// caught by the decode worker's digest check: it prefills locally and the output is still
/// exactly the local one — inline and over every transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_transfer_is_detected_and_served_by_a_local_prefill() {
    for kind in [
        None,
        Some(TransportKind::Local),
        Some(TransportKind::Tcp),
        Some(TransportKind::Ucx),
    ] {
        let mut deps = deps();
        if let Some(kind) = kind {
            deps.transport = Some(transport(kind).await);
        }
        let mut pcfg = config(1, WorkerRole::Prefill);
        pcfg.corrupt_transfers = true;
        let p = start_with(pcfg, &deps).await;
        let d1 = start(2, WorkerRole::Decode, &deps).await;
        let d2 = start(3, WorkerRole::Decode, &deps).await;
        let (mut c1, mut c2) = (client(&d1.addr).await, client(&d2.addr).await);
        let long = prompt(8, 250);
        let local = generate(&mut c1, request(40, long.clone(), None)).await;
        let remote = generate(&mut c2, request(41, long, Some(&p))).await;
        assert_eq!(
            remote[0].prefill,
            PrefillOutcome::Fallback as i32,
            "{kind:?}: the digest check caught the corruption"
        );
        assert_eq!(tokens(&remote), tokens(&local), "{kind:?}");
        for w in [p, d1, d2] {
            w.stop.cancel();
            w.task.await.unwrap().unwrap();
        }
    }
}

/// `--kv-digest=false`: neither worker hashes the KV. A clean transfer decodes like a local
/// prefill; a corrupted one is not caught (the remote outcome stands): the check is off, as
/// asked, for fabrics that check what they carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_digest_nothing_is_hashed_or_checked() {
    for kind in [None, Some(TransportKind::Local), Some(TransportKind::Tcp)] {
        for corrupt in [false, true] {
            let mut deps = deps();
            if let Some(kind) = kind {
                deps.transport = Some(transport(kind).await);
            }
            let mut pcfg = config(1, WorkerRole::Prefill);
            pcfg.corrupt_transfers = corrupt;
            let p = start_with(pcfg, &deps).await;
            let d1 = start(2, WorkerRole::Decode, &deps).await;
            let mut dcfg = config(3, WorkerRole::Decode);
            dcfg.kv_digest = false;
            let d2 = start_with(dcfg, &deps).await;
            let (mut c1, mut c2) = (client(&d1.addr).await, client(&d2.addr).await);
            let long = prompt(9, 250);
            let local = generate(&mut c1, request(50, long.clone(), None)).await;
            let remote = generate(&mut c2, request(51, long, Some(&p))).await;
            assert_eq!(
                remote[0].prefill,
                PrefillOutcome::Remote as i32,
                "{kind:?}, corrupt {corrupt}: no digest, no fallback"
            );
            if !corrupt {
                assert_eq!(tokens(&remote), tokens(&local), "{kind:?}");
            }
            for w in [p, d1, d2] {
                w.stop.cancel();
                w.task.await.unwrap().unwrap();
            }
        }
    }
}

/// A prefill worker gone wrong, for the transfer fence: on `Prefill` it connects to the
/// destination region and keeps overwriting every destination block with garbage, never
/// finishing; `AbortPrefill` lets it go on for `abort_delay` (a writer slow to stop), then
/// stops it, flushes it, and only then answers — or, with `answer_aborts` false, never
/// answers.
#[derive(Clone)]
struct RogueWriter {
    transport: Arc<dyn Transport>,
    answer_aborts: bool,
    abort_delay: Duration,
    stop_writing: CancellationToken,
    writer_task: Arc<tokio::sync::Mutex<Option<JoinHandle<()>>>>,
    aborts: Arc<std::sync::atomic::AtomicUsize>,
    /// Says this many blocks have landed, first thing (a lie past the reserved blocks).
    landed: Option<u32>,
}

impl RogueWriter {
    fn new(transport: Arc<dyn Transport>, answer_aborts: bool, abort_delay: Duration) -> Self {
        RogueWriter {
            transport,
            answer_aborts,
            abort_delay,
            stop_writing: CancellationToken::new(),
            writer_task: Arc::default(),
            aborts: Arc::default(),
            landed: None,
        }
    }
}

type ChunkStream<T> =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl worker_server::Worker for RogueWriter {
    type GenerateStream = ChunkStream<GenerateChunk>;
    type PrefillStream = ChunkStream<PrefillChunk>;

    async fn generate(
        &self,
        _: tonic::Request<GenerateRequest>,
    ) -> Result<tonic::Response<Self::GenerateStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("rogue"))
    }

    async fn prefill(
        &self,
        request: tonic::Request<PrefillRequest>,
    ) -> Result<tonic::Response<Self::PrefillStream>, tonic::Status> {
        let req = request.into_inner();
        let remote = RegionDescriptor::from_compact(&req.destination).unwrap();
        let mut writer = self.transport.connect(&remote).await.unwrap();
        let garbage = vec![0xEE; req.bytes_per_block as usize];
        let stop = self.stop_writing.clone();
        let task = tokio::spawn(async move {
            while !stop.is_cancelled() {
                for &b in &req.destination_blocks {
                    writer.put(b, &garbage).await.unwrap();
                }
                writer.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await; // a rogue, not a spinner
            }
        });
        *self.writer_task.lock().await = Some(task);
        let landed = self.landed.map(|blocks| {
            Ok(PrefillChunk {
                item: Some(prefill_chunk::Item::Landed(KvLanded { blocks })),
            })
        });
        use futures::StreamExt as _;
        let chunks = futures::stream::iter(landed).chain(futures::stream::pending());
        Ok(tonic::Response::new(Box::pin(chunks)))
    }

    async fn abort_prefill(
        &self,
        _: tonic::Request<AbortPrefillRequest>,
    ) -> Result<tonic::Response<AbortPrefillReply>, tonic::Status> {
        self.aborts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if !self.answer_aborts {
            futures::future::pending::<()>().await;
        }
        tokio::time::sleep(self.abort_delay).await;
        self.stop_writing.cancel();
        if let Some(task) = self.writer_task.lock().await.take() {
            task.await.unwrap();
        }
        Ok(tonic::Response::new(AbortPrefillReply {
            was_running: true,
        }))
    }

    async fn kv_events(
        &self,
        _: tonic::Request<KvEventsRequest>,
    ) -> Result<tonic::Response<KvEventsReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("rogue"))
    }

    async fn health(
        &self,
        _: tonic::Request<HealthRequest>,
    ) -> Result<tonic::Response<HealthReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("rogue"))
    }
}

async fn start_rogue(rogue: RogueWriter) -> (Running, CancellationToken) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let router =
        tonic::transport::Server::builder().add_service(worker_server::WorkerServer::new(rogue));
    let serve = tandem_runtime::grpc::serve_tonic(router, listener, stop.clone());
    let task = tokio::spawn(async move { serve.await.map_err(tandem_worker::WorkerError::from) });
    (
        Running {
            addr,
            stop: stop.clone(),
            task,
        },
        stop,
    )
}

/// The blocks of an abandoned transfer are not reused while the prefill worker may still
/// write them: a prefill worker that keeps overwriting the destination blocks until it is
/// told to stop does not corrupt the local fallback (whose blocks would otherwise be the
/// very blocks just freed), over every transport. `AbortPrefill` is what releases them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_transfer_cannot_corrupt_the_blocks_used_after_it() {
    for kind in [TransportKind::Local, TransportKind::Tcp, TransportKind::Ucx] {
        let mut deps = deps();
        let transport = transport(kind).await;
        deps.transport = Some(transport.clone());
        let rogue = RogueWriter::new(transport, true, Duration::from_millis(400));
        let (p, _) = start_rogue(rogue.clone()).await;
        let mut dcfg = config(2, WorkerRole::Decode);
        dcfg.prefill_timeout = Duration::from_millis(300);
        let d = start_with(dcfg, &deps).await;
        let reference = start(3, WorkerRole::Decode, &deps).await;
        let mut c = client(&d.addr).await;
        let mut r = client(&reference.addr).await;

        let long = prompt(9, 300);
        let expected = generate(&mut r, request(60, long.clone(), None)).await;
        let got = generate(&mut c, request(61, long.clone(), Some(&p))).await;
        assert_eq!(got[0].prefill, PrefillOutcome::Fallback as i32, "{kind:?}");
        assert_eq!(
            tokens(&got),
            tokens(&expected),
            "{kind:?}: fallback KV intact"
        );
        // More requests after it, while the rogue may still be writing: all intact.
        for (i, seed) in [10u32, 11, 12].into_iter().enumerate() {
            let other = prompt(seed, 200);
            let want = generate(&mut r, request(70 + i as u64, other.clone(), None)).await;
            let have = generate(&mut c, request(80 + i as u64, other, None)).await;
            assert_eq!(
                tokens(&have),
                tokens(&want),
                "{kind:?}: request {i} after it"
            );
        }
        tokio::time::timeout(Duration::from_secs(3), rogue.stop_writing.cancelled())
            .await
            .expect("the decode worker aborted the transfer");
        assert_eq!(
            rogue.aborts.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "{kind:?}: one AbortPrefill"
        );
        for w in [p, d, reference] {
            w.stop.cancel();
            w.task.await.unwrap().unwrap();
        }
    }
}

/// A prefill worker that says more blocks landed than were reserved fails its transfer at
/// once (not at the prefill timeout): the decode worker aborts it and prefills locally, the
/// same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landed_count_past_the_reserved_blocks_fails_the_transfer_at_once() {
    let mut deps = deps();
    let transport = transport(TransportKind::Tcp).await;
    deps.transport = Some(transport.clone());
    let mut rogue = RogueWriter::new(transport, true, Duration::ZERO);
    rogue.landed = Some(10_000);
    let (p, _) = start_rogue(rogue.clone()).await;
    let mut dcfg = config(2, WorkerRole::Decode);
    dcfg.prefill_timeout = Duration::from_secs(60);
    let d = start_with(dcfg, &deps).await;
    let reference = start(3, WorkerRole::Decode, &deps).await;
    let (mut c, mut r) = (client(&d.addr).await, client(&reference.addr).await);
    let long = prompt(21, 300);
    let expected = generate(&mut r, request(95, long.clone(), None)).await;
    let started = std::time::Instant::now();
    let got = generate(&mut c, request(96, long, Some(&p))).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "failed at once, not at the timeout"
    );
    assert_eq!(got[0].prefill, PrefillOutcome::Fallback as i32);
    assert_eq!(tokens(&got), tokens(&expected));
    assert_eq!(rogue.aborts.load(std::sync::atomic::Ordering::SeqCst), 1);
    for w in [p, d, reference] {
        w.stop.cancel();
        w.task.await.unwrap().unwrap();
    }
}

/// A prefill worker that never confirms: the blocks stay held (the worker reports them
/// active with nothing running) until the fence timeout, then come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_transfer_blocks_come_back_after_the_fence_timeout() {
    let mut deps = deps();
    let transport = transport(TransportKind::Tcp).await;
    deps.transport = Some(transport.clone());
    let mut loads = deps
        .events
        .subscribe(&subjects::load_reports("default"))
        .await
        .unwrap();
    let rogue = RogueWriter::new(transport, false, Duration::ZERO);
    let (p, _) = start_rogue(rogue.clone()).await;
    let mut dcfg = config(2, WorkerRole::Decode);
    dcfg.prefill_timeout = Duration::from_millis(200);
    dcfg.transfer_fence_timeout = Duration::from_secs(4);
    let d = start_with(dcfg, &deps).await;
    let mut c = client(&d.addr).await;
    let got = generate(&mut c, request(90, prompt(13, 300), Some(&p))).await;
    assert_eq!(got[0].prefill, PrefillOutcome::Fallback as i32);
    // The request is over; its 19 destination blocks are still held (the prompt's own
    // blocks are cached, not active).
    report_where(&mut loads, 2, Duration::from_secs(3), |r| {
        r.running_requests == 0 && r.kv_active_blocks == 19
    })
    .await;
    assert!(rogue.aborts.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    report_where(&mut loads, 2, Duration::from_secs(8), |r| {
        r.running_requests == 0 && r.kv_active_blocks == 0
    })
    .await;
    rogue.stop_writing.cancel();
    for w in [p, d] {
        w.stop.cancel();
        w.task.await.unwrap().unwrap();
    }
}

/// `AbortPrefill` on a real prefill worker: it stops a running transfer and answers once the
/// writer is closed; a prefill for an aborted (request, destination) is refused, whether it
/// was running or had not arrived yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_prefill_stops_the_writer_and_refuses_late_prefills() {
    let mut deps = deps();
    let transport = transport(TransportKind::Tcp).await;
    deps.transport = Some(transport.clone());
    let mut pcfg = config(1, WorkerRole::Prefill);
    pcfg.engine.mocker.speedup_ratio = 0.1; // ~0.2 s per 256-token chunk
    pcfg.engine.scheduler.max_num_batched_tokens = 256;
    let p = start_with(pcfg, &deps).await;
    let mut c = client(&p.addr).await;
    let region = transport.alloc_region(256, 8192).await.unwrap();
    let destination = transport.expose(region).await.unwrap().to_compact();
    let prefill = |id: u64| PrefillRequest {
        request_id: id,
        prompt: prompt(14, 3000),
        hash_seed: tandem_protocol::HashSeed::UNSALTED.0,
        sampling_seed: 7,
        from_token: 0,
        block_size: 16,
        bytes_per_block: 8192,
        destination_blocks: (0..188).collect(),
        destination: destination.clone(),
        ..Default::default()
    };
    let abort = |id: u64| AbortPrefillRequest {
        request_id: id,
        destination: destination.clone(),
    };

    let mut running = c.prefill(prefill(1)).await.unwrap().into_inner();
    let reply = c.abort_prefill(abort(1)).await.unwrap().into_inner();
    assert!(reply.was_running);
    let ended = running.message().await.unwrap_err();
    assert_eq!(
        ErrorClass::of_status(&ended),
        ErrorClass::Cancelled,
        "{ended}"
    );
    let again = c.prefill(prefill(1)).await.unwrap_err();
    assert_eq!(
        ErrorClass::of_status(&again),
        ErrorClass::Cancelled,
        "{again}"
    );

    // Aborted before it arrived: nothing to stop, and refused when it comes.
    let reply = c.abort_prefill(abort(2)).await.unwrap().into_inner();
    assert!(!reply.was_running);
    let late = c.prefill(prefill(2)).await.unwrap_err();
    assert_eq!(
        ErrorClass::of_status(&late),
        ErrorClass::Cancelled,
        "{late}"
    );
    p.stop.cancel();
    p.task.await.unwrap().unwrap();
}

/// `--kv-memory cuda` on a machine without a GPU (or a build without the `cuda` feature) is
/// refused at start with an error that says why.
#[cfg(not(feature = "cuda"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_arenas_without_cuda_are_a_clear_start_error() {
    let mut cfg = config(2, WorkerRole::Decode);
    cfg.kv_memory = tandem_worker::KvMemory::Cuda { ordinal: 0 };
    let err = start_with(cfg, &deps())
        .await
        .task
        .await
        .unwrap()
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("--kv-memory cuda:0") && msg.contains("`cuda` feature"),
        "{msg}"
    );
}

/// With a GPU (scripts/gpu-check.sh): both workers keep their KV arenas in CUDA memory and
/// the remote prefill still decodes exactly like a local one. Over `local` and `tcp`; `ucx`
/// needs a UCX built with CUDA support to register device memory (Debian's is not: the
/// worker then refuses to start, saying so).
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_arenas_decode_like_local_over_each_transport() {
    for kind in [TransportKind::Local, TransportKind::Tcp] {
        let mut deps = deps();
        deps.transport = Some(transport(kind).await);
        let gpu = |id, role| {
            let mut c = config(id, role);
            c.kv_memory = tandem_worker::KvMemory::Cuda { ordinal: 0 };
            c
        };
        let p = start_with(gpu(1, WorkerRole::Prefill), &deps).await;
        let d = start_with(gpu(2, WorkerRole::Decode), &deps).await;
        let reference = start(3, WorkerRole::Decode, &deps).await;
        let (mut c, mut r) = (client(&d.addr).await, client(&reference.addr).await);
        let long = prompt(15, 300);
        let expected = generate(&mut r, request(100, long.clone(), None)).await;
        let got = generate(&mut c, request(101, long, Some(&p))).await;
        assert_eq!(got[0].prefill, PrefillOutcome::Remote as i32, "{kind:?}");
        assert_eq!(tokens(&got), tokens(&expected), "{kind:?}");
        for w in [p, d, reference] {
            w.stop.cancel();
            w.task.await.unwrap().unwrap();
        }
    }
}
