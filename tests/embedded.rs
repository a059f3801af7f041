//! The frontend's cluster view against a real decode worker in one process, on memory
//! discovery and an event plane that loses KV events on demand: the index follows the
//! worker's cache through a dump at join, streamed events, a lost trailing batch (found by
//! the load reports and repaired over `KvEvents`), and a purge when the worker leaves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tandem_frontend::cluster::{BackendConfig, ClusterView, ViewConfig};
use tandem_protocol::grpc::{GenerateRequest, Sampling, worker_client::WorkerClient};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{BlockSize, HashSeed, SequenceHash, WorkerId, WorkerRole};
use tandem_router::{RouterId, RoutingReplica};
use tandem_runtime::RuntimeError;
use tandem_runtime::discovery::MemoryDiscovery;
use tandem_runtime::events::{EventPlane, MemoryEventPlane, Subscription};
use tandem_runtime::shutdown::Shutdown;
use tandem_worker::{WorkerConfig, WorkerDeps};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A memory event plane that drops KV-event batches while `lose` is set.
struct LossyPlane {
    inner: MemoryEventPlane,
    lose: AtomicBool,
}

impl LossyPlane {
    /// A plane that loses nothing until told to.
    fn new() -> Arc<LossyPlane> {
        Arc::new(LossyPlane {
            inner: MemoryEventPlane::new(),
            lose: AtomicBool::new(false),
        })
    }
}

#[async_trait]
impl EventPlane for LossyPlane {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), RuntimeError> {
        if subject.ends_with(".kv-events") && self.lose.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.publish(subject, payload).await
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, RuntimeError> {
        self.inner.subscribe(subject).await
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed.wrapping_mul(7919) + i * 31) % 32000)
        .collect()
}

fn hashes(tokens: &[u32]) -> Vec<SequenceHash> {
    compute_block_hashes(tokens, BlockSize::DEFAULT, HashSeed::UNSALTED)
        .iter()
        .map(|h| h.sequence)
        .collect()
}

/// Runs `tokens` to the end on the worker (2 output tokens).
async fn run(client: &mut WorkerClient<tonic::transport::Channel>, id: u64, tokens: Vec<u32>) {
    let req = GenerateRequest {
        request_id: id,
        prompt: tokens,
        sampling: Some(Sampling {
            max_tokens: 2,
            seed: 1,
            temperature: 0.0,
            stop_token: None,
            ignore_eos: true,
            top_p: None,
            ..Default::default()
        }),
        hash_seed: HashSeed::UNSALTED.0,
        remote_prefill: None,
        cache_salt: String::new(),
        lora_adapter: String::new(),
        text: None,
        whole: false,
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
}

/// A cluster view with an embedded index on `discovery` and `plane`.
async fn start_view(
    discovery: &MemoryDiscovery,
    plane: Arc<dyn EventPlane>,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> Arc<ClusterView> {
    let cfg = ViewConfig {
        namespace: "default".into(),
        model: Some("mocker".into()),
        block_size: BlockSize::DEFAULT,
        connect_timeout: Duration::from_secs(2),
        embedded_index: true,
    };
    let replica = RoutingReplica::new(BackendConfig::new(RouterId(1)).replica_config()).unwrap();
    ClusterView::start(
        cfg,
        replica,
        Arc::new(discovery.clone()),
        plane,
        tasks.clone(),
        stop.clone(),
    )
    .await
    .unwrap()
}

/// Polls `f` every 20 ms until it holds, for at most 10 s.
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn matched(view: &ClusterView, h: &[SequenceHash]) -> u32 {
    view.find_matches(h)
        .get(WorkerId(7))
        .map_or(0, |c| c.total())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_a_worker_through_lost_events_and_its_departure() {
    let discovery = MemoryDiscovery::new();
    let plane = LossyPlane::new();
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());

    // The worker caches a prompt before the view exists: the dump at join brings it in.
    let (mut client, worker_stop, worker) = start_worker(7, &discovery, plane.clone()).await;
    let before = prompt(1, 160);
    run(&mut client, 1, before.clone()).await;

    let view = start_view(&discovery, plane.clone(), &tasks, &stop).await;
    eventually("the worker joins and is dumped", || {
        view.registry().decode.len() == 1 && matched(&view, &hashes(&before)) == 10
    })
    .await;
    assert!(view.feed_stats().dumps_applied >= 1);

    // Streamed events.
    let streamed = prompt(2, 96);
    run(&mut client, 2, streamed.clone()).await;
    eventually("streamed events are applied", || {
        matched(&view, &hashes(&streamed)) == 6
    })
    .await;

    // A lost trailing batch: no later event shows the gap; the load reports do.
    plane.lose.store(true, Ordering::SeqCst);
    let lost = prompt(3, 128);
    run(&mut client, 3, lost.clone()).await;
    // The batch may be repaired before events flow again (the load reports notice it): the
    // counters below show it came through a repair, not the stream.
    eventually("the gap is repaired from the worker", || {
        matched(&view, &hashes(&lost)) == 8
    })
    .await;
    plane.lose.store(false, Ordering::SeqCst);
    let stats = view.feed_stats();
    assert!(stats.gaps >= 1 && stats.repairs >= 1, "{stats:?}");
    let last = view.last_event_id(WorkerId(7)).unwrap();

    // Events flow on from the repaired id.
    let after = prompt(4, 64);
    run(&mut client, 4, after.clone()).await;
    eventually("events after the repair apply", || {
        matched(&view, &hashes(&after)) == 4
    })
    .await;
    assert!(view.last_event_id(WorkerId(7)).unwrap() > last);

    // The lease lapses: the worker and its blocks leave the view.
    assert!(discovery.expire(WorkerId(7)));
    eventually("the worker is purged", || {
        view.registry().decode.is_empty() && view.index_size() == (0, 0)
    })
    .await;
    assert_eq!(view.feed_stats().workers_purged, 1);

    worker_stop.drain();
    worker.await.unwrap().unwrap();
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standalone_indexer_answers_find_matches_from_the_event_plane() {
    use tandem_frontend::ClusterDeps;
    use tandem_protocol::grpc::FindMatchesRequest;
    use tandem_protocol::grpc::indexer_client::IndexerClient;

    let discovery = MemoryDiscovery::new();
    let plane = Arc::new(MemoryEventPlane::new());
    let indexer_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let indexer_addr = indexer_listener.local_addr().unwrap().to_string();
    let indexer_stop = Shutdown::new();
    let cfg = ViewConfig {
        namespace: "default".into(),
        model: None,
        block_size: BlockSize::DEFAULT,
        connect_timeout: Duration::from_secs(2),
        embedded_index: true,
    };
    let deps = ClusterDeps {
        discovery: Arc::new(discovery.clone()),
        events: plane.clone(),
    };
    let indexer = tokio::spawn(tandem_frontend::run_indexer(
        cfg,
        indexer_listener,
        deps,
        indexer_stop.clone(),
    ));

    let mut wcfg = WorkerConfig::new(WorkerId(7), WorkerRole::Decode);
    wcfg.engine.pool.device_blocks = 512;
    wcfg.engine.mocker.speedup_ratio = 20.0;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let worker_stop = Shutdown::new();
    let worker = tokio::spawn(tandem_decode_worker::run(
        wcfg,
        listener,
        WorkerDeps {
            discovery: Arc::new(discovery.clone()),
            events: plane.clone(),
            transport: None,
        },
        worker_stop.clone(),
    ));
    let ch = tandem_runtime::grpc::connect_channel(&addr, Duration::from_secs(5))
        .await
        .unwrap();
    let tokens = prompt(5, 200);
    run(&mut WorkerClient::new(ch), 1, tokens.clone()).await;

    let ch = tandem_runtime::grpc::connect_channel(&indexer_addr, Duration::from_secs(5))
        .await
        .unwrap();
    let mut client = IndexerClient::new(ch);
    let query = FindMatchesRequest {
        sequence_hashes: hashes(&tokens).iter().map(|h| h.0).collect(),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = client
            .find_matches(query.clone())
            .await
            .unwrap()
            .into_inner();
        if let Some(w) = reply.workers.first() {
            assert_eq!((w.worker_id, w.device, w.host), (7, 12, 0));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the indexer never saw the blocks"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worker_stop.drain();
    worker.await.unwrap().unwrap();
    indexer_stop.drain();
    indexer.await.unwrap().unwrap();
}

/// Starts decode worker `id` on memory `discovery` and `plane`; its client and stop token.
async fn start_worker(
    id: u64,
    discovery: &MemoryDiscovery,
    plane: Arc<dyn EventPlane>,
) -> (
    WorkerClient<tonic::transport::Channel>,
    Shutdown,
    tokio::task::JoinHandle<Result<(), tandem_worker::WorkerError>>,
) {
    let mut cfg = WorkerConfig::new(WorkerId(id), WorkerRole::Decode);
    cfg.engine.pool.device_blocks = 512;
    cfg.engine.mocker.speedup_ratio = 20.0;
    cfg.load_interval = Duration::from_millis(30);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = Shutdown::new();
    let deps = WorkerDeps {
        discovery: Arc::new(discovery.clone()),
        events: plane,
        transport: None,
    };
    let task = tokio::spawn(tandem_decode_worker::run(cfg, listener, deps, stop.clone()));
    let ch = tandem_runtime::grpc::connect_channel(&addr, Duration::from_secs(5))
        .await
        .unwrap();
    (WorkerClient::new(ch), stop, task)
}

/// The cache health's `events_gapped`: a worker whose KV events keep getting lost on the
/// event plane is named (an occasional loss, repaired, is not). Each loss here is real: the
/// plane drops the worker's batches while `lose` is set, the index finds out from the load
/// reports or the next batch, and repairs from the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_events_keep_getting_lost_is_named_in_the_cache_health() {
    use tandem_frontend::cluster::cache_health::{Cause, stream_findings};

    let discovery = MemoryDiscovery::new();
    let plane = LossyPlane::new();
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let (mut client, worker_stop, worker) = start_worker(7, &discovery, plane.clone()).await;
    let view = start_view(&discovery, plane.clone(), &tasks, &stop).await;
    eventually("the worker joins", || view.registry().decode.len() == 1).await;

    for (round, seed) in [11u32, 12, 13].into_iter().enumerate() {
        plane.lose.store(true, Ordering::SeqCst);
        let lost = prompt(seed, 64);
        run(&mut client, u64::from(seed), lost.clone()).await;
        eventually("the lost batch is repaired from the worker", || {
            matched(&view, &hashes(&lost)) == 4
        })
        .await;
        plane.lose.store(false, Ordering::SeqCst);
        let troubled = view.troubled_streams();
        if round == 0 {
            assert!(troubled.is_empty(), "one loss is no finding: {troubled:?}");
        }
    }
    let troubled = view.troubled_streams();
    assert_eq!(troubled.len(), 1, "{troubled:?}");
    let (w, h) = troubled[0];
    assert_eq!(w, WorkerId(7));
    assert!(h.gaps + h.behind >= 3, "{h:?}");
    let findings = stream_findings(&troubled);
    assert_eq!(findings[0].cause, Cause::EventsGapped);
    assert!(
        findings[0].detail.contains("keep getting lost"),
        "{}",
        findings[0].detail
    );

    worker_stop.drain();
    worker.await.unwrap().unwrap();
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

/// A worker that comes back under the same id before its old registration is gone (a crash
/// and restart within the lease TTL) has an empty cache and numbers its events from 1: the
/// view must drop what the old one held and follow the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_under_the_same_id_replaces_its_old_cache() {
    let discovery = MemoryDiscovery::new();
    let plane: Arc<dyn EventPlane> = Arc::new(MemoryEventPlane::new());
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let view = start_view(&discovery, plane.clone(), &tasks, &stop).await;
    let (mut old, old_stop, old_task) = start_worker(7, &discovery, plane.clone()).await;
    let a = prompt(11, 320);
    run(&mut old, 1, a.clone()).await;
    eventually("the old incarnation's blocks", || {
        matched(&view, &hashes(&a)) == 20
    })
    .await;

    let (mut new, new_stop, new_task) = start_worker(7, &discovery, plane.clone()).await;
    eventually("the old cache is dropped", || {
        matched(&view, &hashes(&a)) == 0
    })
    .await;
    let b = prompt(12, 64);
    run(&mut new, 2, b.clone()).await;
    eventually("the new incarnation's events apply", || {
        matched(&view, &hashes(&b)) == 4
    })
    .await;

    for (s, t) in [(old_stop, old_task), (new_stop, new_task)] {
        s.drain();
        t.await.unwrap().unwrap();
    }
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}
