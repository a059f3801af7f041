//! A whole tandem cluster as real processes for the multi-process tests: etcd and
//! nats-server (through `tandem_runtime::external`), prefill and decode workers and a
//! frontend (more replicas with [`Cluster::spawn_frontend`]), each the built `tandem` binary
//! with its output in a log file.
//!
//! - Every process is killed and reaped when the [`Cluster`] (or the [`Proc`], `proc.rs`) is dropped;
//!   when that happens during a panic the logs' tails are printed, so a failing test shows
//!   what the processes said.
//! - Worker ids are fixed ([`decode_id`], [`prefill_id`]) so that the `x-tandem-*-worker`
//!   headers name processes.
//! - Readiness is observable state only: `/health` is 200 and `/metrics` counts the workers
//!   ([`Metrics`], in `metrics.rs`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tandem_runtime::external::{EtcdOptions, EtcdServer, NatsOptions, NatsServer, free_port};

use super::http::{self, Response};
pub use super::metrics::Metrics;
use super::openai::ChatCompletion;
use super::standin::Engine;
pub use crate::proc::Proc;

/// Worker id of the `i`-th decode worker (0-based).
pub fn decode_id(i: usize) -> u64 {
    11 + i as u64
}

/// Worker id of the `i`-th prefill worker (0-based).
pub fn prefill_id(i: usize) -> u64 {
    21 + i as u64
}

/// Polls `check` every 50 ms until it returns `Some`, or panics after `timeout` naming
/// `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How to start a cluster.
#[derive(Clone, Debug)]
pub struct Options {
    pub prefill: usize,
    pub decode: usize,
    /// `--disagg` of the frontend.
    pub disagg: &'static str,
    pub speedup: f64,
    pub device_blocks: u32,
    pub lease_ttl_s: u64,
    pub drain_timeout_s: u64,
    pub load_interval_ms: u64,
    /// More frontend flags.
    pub frontend_args: Vec<String>,
    /// Run a standalone `tandem indexer` and point the frontend at it (`--indexer-url`).
    pub indexer: bool,
    /// Workers' `--kv-transport` (`ucx`, `tcp`, `inline`); UCX runs on `lo`.
    pub kv_transport: &'static str,
    /// Prefill workers corrupt one byte of every transfer (fault injection).
    pub corrupt_transfers: bool,
    /// Workers front an external engine of this kind (`vllm`): each is a `tandem-standin`
    /// process plus a sidecar (`tandem decode --engine vllm …`) in front of it.
    pub engine: Option<&'static str>,
    /// More worker flags (every worker).
    pub worker_args: Vec<String>,
    /// More stand-in engine flags (every engine, with `engine`).
    pub engine_args: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            prefill: 0,
            decode: 1,
            disagg: "isl-bounding",
            speedup: 10.0,
            device_blocks: 4096,
            lease_ttl_s: 3,
            drain_timeout_s: 20,
            load_interval_ms: 100,
            frontend_args: Vec::new(),
            indexer: false,
            kv_transport: "ucx",
            corrupt_transfers: false,
            engine: None,
            worker_args: Vec::new(),
            engine_args: Vec::new(),
        }
    }
}

/// A chat completion and where the frontend sent it.
#[derive(Debug)]
pub struct Routed {
    pub decode: u64,
    /// Set when the prefill was remote.
    pub prefill: Option<u64>,
    pub cached: u32,
    pub completion: ChatCompletion,
}

impl Routed {
    pub fn content(&self) -> &str {
        self.completion.choices[0]
            .message
            .content
            .as_deref()
            .unwrap_or("")
    }
}

/// A running cluster. Dropping it stops every process it started.
pub struct Cluster {
    pub name: String,
    pub namespace: String,
    pub dir: super::TestDir,
    pub addr: SocketAddr,
    pub opts: Options,
    /// None only while starting.
    frontend: Option<Proc>,
    /// Frontend replicas after the first ([`Cluster::spawn_frontend`]): frontend `i` is
    /// `more_frontends[i - 1]`.
    more_frontends: Vec<(Proc, SocketAddr)>,
    /// Each frontend's admin listener (its status page, `/status.json` and `/metrics`), by
    /// frontend index.
    admins: Vec<SocketAddr>,
    pub workers: Vec<Proc>,
    /// The stand-in engines behind the workers (`Options::engine`), by worker id.
    pub engines: Vec<Engine>,
    pub etcd: EtcdServer,
    pub nats: NatsServer,
    /// Runs the external servers' async API.
    pub rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("name", &self.name)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Starts etcd, NATS, the workers and the frontend, and waits until the frontend is
    /// healthy and sees every worker.
    pub fn start(name: &str, opts: Options) -> Cluster {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let dir = super::temp_dir(&format!("cluster-{name}"));
        let (etcd, nats) = rt.block_on(async {
            let etcd = EtcdServer::start(EtcdOptions::default())
                .await
                .expect("starting etcd");
            let nats = NatsServer::start(NatsOptions::default())
                .await
                .expect("starting nats-server");
            (etcd, nats)
        });
        let namespace = format!("t-{name}");
        let mut cluster = Cluster {
            name: name.to_string(),
            namespace,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            frontend: None,
            more_frontends: Vec::new(),
            admins: vec![SocketAddr::from(([127, 0, 0, 1], 0))],
            dir,
            opts: opts.clone(),
            workers: Vec::new(),
            engines: Vec::new(),
            etcd,
            nats,
            rt,
        };
        for i in 0..opts.prefill {
            cluster.spawn_worker("prefill", prefill_id(i));
        }
        for i in 0..opts.decode {
            cluster.spawn_worker("decode", decode_id(i));
        }
        if opts.indexer {
            let addr = cluster.spawn_indexer();
            cluster
                .opts
                .frontend_args
                .push(format!("--indexer-url={addr}"));
        }
        cluster.start_frontend();
        cluster
    }

    /// Starts a standalone indexer on a free port, once it listens; its address. (Another
    /// process may take the port between its choice and the indexer's bind: then the
    /// indexer exits and starts again on another.)
    pub fn spawn_indexer(&mut self) -> String {
        for attempt in 0..3 {
            let addr = format!("127.0.0.1:{}", free_port().unwrap());
            let mut args = vec!["indexer".to_string()];
            args.extend(self.plane_args());
            args.extend(["--listen".to_string(), addr.clone()]);
            let log = self.dir.join(format!("indexer-{attempt}.log"));
            let mut p = Proc::spawn("indexer", "indexer", &args, &log);
            let listening = wait_for(
                "the indexer to listen or exit",
                Duration::from_secs(30),
                || {
                    if p.exited().is_some() {
                        return Some(false);
                    }
                    std::net::TcpStream::connect(&addr).ok().map(|_| true)
                },
            );
            if listening {
                self.workers.push(p);
                return addr;
            }
            p.print_tail();
        }
        panic!("the indexer did not start");
    }

    /// Flags every process needs to find etcd and NATS.
    pub fn plane_args(&self) -> Vec<String> {
        vec![
            "--etcd-endpoints".into(),
            self.etcd.endpoint(),
            "--nats-url".into(),
            self.nats.url(),
            "--namespace".into(),
            self.namespace.clone(),
            "--lease-ttl-s".into(),
            self.opts.lease_ttl_s.to_string(),
        ]
    }

    /// Starts a stand-in engine for worker `id`, once it answers `/health`; its HTTP address
    /// and ZMQ endpoints. (A port taken between its choice and the engine's bind makes the
    /// engine exit: it starts again on others.)
    pub fn spawn_engine(&mut self, id: u64) -> Engine {
        for attempt in 0..3 {
            let http = free_port().unwrap();
            let (kv, replay) = (free_port().unwrap(), free_port().unwrap());
            let mut args: Vec<String> = [
                "--listen".to_string(),
                format!("127.0.0.1:{http}"),
                "--kv-events".into(),
                format!("tcp://127.0.0.1:{kv}"),
                "--kv-replay".into(),
                format!("tcp://127.0.0.1:{replay}"),
                "--speedup-ratio".into(),
                self.opts.speedup.to_string(),
                "--device-blocks".into(),
                self.opts.device_blocks.to_string(),
                "--engine-id".into(),
                format!("standin-{id}"),
            ]
            .into();
            args.extend(self.opts.engine_args.iter().cloned());
            let name = format!("engine-{id}");
            let log = self.dir.join(format!("{name}-{attempt}.log"));
            let mut p = Proc::spawn_bin(super::bin("tandem-standin"), &name, "engine", &args, &log);
            p.worker_id = Some(id);
            let addr = SocketAddr::from(([127, 0, 0, 1], http));
            let healthy = wait_for(
                "the stand-in engine's /health",
                Duration::from_secs(30),
                || {
                    if p.exited().is_some() {
                        return Some(false);
                    }
                    http::get(addr, "/health")
                        .ok()
                        .filter(|r| r.status == 200)
                        .map(|_| true)
                },
            );
            if healthy {
                return Engine {
                    id,
                    addr,
                    kv_events: format!("tcp://127.0.0.1:{kv}"),
                    kv_replay: format!("tcp://127.0.0.1:{replay}"),
                    proc: p,
                };
            }
            p.print_tail();
        }
        panic!("stand-in engine {id} did not start");
    }

    /// The stand-in engine behind worker `id`.
    pub fn engine(&mut self, id: u64) -> &mut Engine {
        self.engines
            .iter_mut()
            .find(|e| e.id == id)
            .unwrap_or_else(|| panic!("no engine {id}"))
    }

    /// Starts one more worker process (`role` is `prefill` or `decode`).
    pub fn spawn_worker(&mut self, role: &'static str, id: u64) {
        let external = self.opts.engine.map(|kind| (kind, self.spawn_engine(id)));
        let o = &self.opts;
        let mut args = vec![role.to_string()];
        args.extend(self.plane_args());
        if let Some((kind, engine)) = &external {
            args.extend([
                format!("--engine={kind}"),
                format!("--engine-url=http://{}", engine.addr),
                format!("--engine-kv-events={}", engine.kv_events),
                format!("--engine-kv-replay={}", engine.kv_replay),
                "--engine-health-interval-ms=100".into(),
                "--engine-health-failures=3".into(),
            ]);
        }
        args.extend(
            [
                "--worker-id",
                &id.to_string(),
                "--listen",
                "127.0.0.1:0",
                "--speedup-ratio",
                &o.speedup.to_string(),
                "--device-blocks",
                &o.device_blocks.to_string(),
                "--drain-timeout-s",
                &o.drain_timeout_s.to_string(),
                "--load-interval-ms",
                &o.load_interval_ms.to_string(),
                "--kv-transport",
                o.kv_transport,
                "--ucx-net-devices",
                "lo",
            ]
            .map(String::from),
        );
        if o.corrupt_transfers {
            args.push("--inject-kv-corruption".into());
        }
        args.extend(o.worker_args.iter().cloned());
        let name = format!("{role}-{id}");
        let log = self.dir.join(format!("{name}.log"));
        let mut p = Proc::spawn(&name, role, &args, &log);
        p.worker_id = Some(id);
        self.workers.push(p);
        if let Some((_, engine)) = external {
            self.engines.push(engine);
        }
    }

    fn start_frontend(&mut self) {
        let (proc, addr, admin) = self.launch_frontend("frontend");
        self.frontend = Some(proc);
        self.addr = addr;
        self.admins[0] = admin;
    }

    /// Starts one more frontend replica on the same etcd and NATS, with the same flags
    /// (`Options::frontend_args`; its router id is its own, drawn at random), and waits until
    /// it is healthy and sees every worker; its index for [`Cluster::addr_of`] and the other
    /// `_of`/`_to`/`_via` methods (the first frontend is 0).
    pub fn spawn_frontend(&mut self) -> usize {
        let i = self.more_frontends.len() + 1;
        let (proc, addr, admin) = self.launch_frontend(&format!("frontend{i}"));
        self.more_frontends.push((proc, addr));
        self.admins.push(admin);
        i
    }

    /// Starts a frontend process named `name` on a free port (its admin listener on another)
    /// and waits until it is ready.
    fn launch_frontend(&self, name: &str) -> (Proc, SocketAddr, SocketAddr) {
        for attempt in 0..3 {
            let (port, admin_port) = (free_port().unwrap(), free_port().unwrap());
            let mut args = vec!["frontend".to_string()];
            args.extend(self.plane_args());
            args.extend(
                [
                    "--listen",
                    &format!("127.0.0.1:{port}"),
                    "--admin-listen",
                    &format!("127.0.0.1:{admin_port}"),
                    "--disagg",
                    self.opts.disagg,
                ]
                .map(String::from),
            );
            args.extend(self.opts.frontend_args.iter().cloned());
            let log = self.dir.join(format!("{name}-{attempt}.log"));
            let mut proc = Proc::spawn(name, "frontend", &args, &log);
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
            if self.wait_ready(&mut proc, addr, admin) {
                return (proc, addr, admin);
            }
            // The port was taken between picking and binding: try another.
        }
        panic!("{name} did not start");
    }

    /// Waits for `/health` at `addr` and the worker counts at `admin`; false when `proc`
    /// exited.
    fn wait_ready(&self, proc: &mut Proc, addr: SocketAddr, admin: SocketAddr) -> bool {
        let (d, p) = (self.opts.decode as u64, self.opts.prefill as u64);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = proc.exited() {
                eprintln!("{} exited during startup: {status}", proc.name);
                proc.print_tail();
                return false;
            }
            let healthy = http::get(addr, "/health").is_ok_and(|r| r.status == 200);
            if healthy
                && let Some(m) = try_metrics(admin)
                && m.0.get("tandem_workers{role=\"decode\"}") == Some(&(d as f64))
                && m.0.get("tandem_workers{role=\"prefill\"}") == Some(&(p as f64))
            {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "cluster {} not ready: {} health {healthy}, metrics {:?}",
                self.name,
                proc.name,
                try_metrics(admin).map(|m| (m.decode_workers(), m.prefill_workers()))
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn frontend(&mut self) -> &mut Proc {
        self.frontend.as_mut().expect("the frontend process")
    }

    /// How many frontend replicas the cluster started.
    pub fn frontends(&self) -> usize {
        1 + self.more_frontends.len()
    }

    /// The process of frontend `i` (0 is [`Cluster::frontend`]).
    pub fn frontend_of(&mut self, i: usize) -> &mut Proc {
        match i {
            0 => self.frontend(),
            i => {
                &mut self
                    .more_frontends
                    .get_mut(i - 1)
                    .expect("no such frontend")
                    .0
            }
        }
    }

    /// The HTTP address of frontend `i` (0 is [`Cluster::addr`]).
    /// The admin listener of frontend `i` (its status page, `/status.json`, `/metrics`).
    pub fn admin_of(&self, i: usize) -> SocketAddr {
        *self.admins.get(i).expect("no such frontend")
    }

    pub fn addr_of(&self, i: usize) -> SocketAddr {
        match i {
            0 => self.addr,
            i => self.more_frontends.get(i - 1).expect("no such frontend").1,
        }
    }

    /// Starts worker `id` again (after it was killed): a new process under the same id.
    pub fn restart_worker(&mut self, role: &'static str, id: u64) {
        self.workers.retain(|w| w.worker_id != Some(id));
        self.spawn_worker(role, id);
    }

    /// The worker process with id `id`.
    pub fn worker(&mut self, id: u64) -> &mut Proc {
        self.workers
            .iter_mut()
            .find(|w| w.worker_id == Some(id))
            .unwrap_or_else(|| panic!("no worker {id}"))
    }

    /// The `--metrics-addr` of every registered worker, with its role, from its discovery
    /// record.
    pub fn worker_metrics_addrs(&self) -> Vec<(String, String)> {
        use tandem_runtime::discovery::{Discovery, EtcdConfig, EtcdDiscovery};
        self.rt.block_on(async {
            let d = EtcdDiscovery::connect(EtcdConfig {
                endpoints: vec![self.etcd.endpoint()],
                namespace: self.namespace.clone(),
                ..Default::default()
            })
            .await
            .expect("etcd");
            let records = d.list().await.expect("listing workers");
            records
                .into_iter()
                .map(|r| {
                    let role = tandem_runtime::discovery::role_name(r.role).to_string();
                    let addr = r.addresses.metrics.unwrap_or_else(|| {
                        panic!("worker {} registered no metrics address", r.id.0)
                    });
                    (role, addr)
                })
                .collect()
        })
    }

    fn try_metrics(&self) -> Option<Metrics> {
        try_metrics(self.admin_of(0))
    }

    pub fn metrics(&self) -> Metrics {
        self.try_metrics().expect("GET /metrics")
    }

    /// `/metrics` of frontend `i`.
    pub fn metrics_of(&self, i: usize) -> Metrics {
        try_metrics(self.admin_of(i)).unwrap_or_else(|| panic!("GET /metrics of frontend {i}"))
    }

    /// Polls `/metrics` until `check` holds (up to `timeout`); returns the metrics then.
    pub fn wait_metrics(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&Metrics) -> bool,
    ) -> Metrics {
        let mut last = None;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.try_metrics() {
                if check(&m) {
                    return m;
                }
                last = Some(m);
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for {what}; last metrics: {:?}",
                last.as_ref().map(Metrics::cluster_view)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Response {
        self.post_to(0, path, body)
    }

    /// `POST path` to frontend `i`.
    pub fn post_to(&self, i: usize, path: &str, body: &serde_json::Value) -> Response {
        http::post_json(self.addr_of(i), path, &body.to_string())
            .unwrap_or_else(|e| panic!("POST {path} to frontend {i}: {e}"))
    }

    /// A chat completion that must succeed; checks that the cached-tokens header and the
    /// usage agree.
    pub fn chat(&self, body: &serde_json::Value) -> Routed {
        self.chat_via(0, body)
    }

    /// [`Cluster::chat`] through frontend `i`.
    pub fn chat_via(&self, i: usize, body: &serde_json::Value) -> Routed {
        let r = self.post_to(i, "/v1/chat/completions", body);
        assert_eq!(r.status, 200, "chat via frontend {i} failed: {}", r.text());
        routed(&r)
    }
}

/// `/metrics` at `addr`, when it answers 200.
fn try_metrics(addr: SocketAddr) -> Option<Metrics> {
    let r = http::get(addr, "/metrics").ok()?;
    (r.status == 200).then(|| Metrics::parse(&r.text()))
}

/// Reads the routing headers of a successful chat completion.
pub fn routed(r: &Response) -> Routed {
    let num = |h: &str| -> Option<u64> {
        r.header(h)
            .map(|v| v.parse().unwrap_or_else(|_| panic!("header {h}: {v:?}")))
    };
    let completion: ChatCompletion = r.json();
    let cached = num("x-tandem-cached-tokens").expect("x-tandem-cached-tokens") as u32;
    assert_eq!(
        cached, completion.usage.prompt_tokens_details.cached_tokens,
        "x-tandem-cached-tokens and usage.prompt_tokens_details.cached_tokens differ"
    );
    Routed {
        decode: num("x-tandem-decode-worker").expect("x-tandem-decode-worker"),
        prefill: num("x-tandem-prefill-worker"),
        cached,
        completion,
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "===== cluster {} failed; logs in {} =====",
                self.name,
                self.dir.display()
            );
            if let Some(f) = &self.frontend {
                f.print_tail();
            }
            for (f, _) in &self.more_frontends {
                f.print_tail();
            }
            for w in &self.workers {
                w.print_tail();
            }
            for e in &self.engines {
                e.proc.print_tail();
            }
        }
        if let Some(f) = &mut self.frontend {
            f.kill9();
        }
        for (f, _) in &mut self.more_frontends {
            f.kill9();
        }
        for w in &mut self.workers {
            w.kill9();
        }
        for e in &mut self.engines {
            e.proc.kill9();
        }
        // The directory goes with `self.dir` (kept where the test failed).
    }
}
