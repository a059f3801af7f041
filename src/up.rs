//! `tandem up`: a whole cluster on one machine.
//!
//! - Default: one process, in-memory discovery and event plane, real gRPC on loopback between
//!   the frontend and `--prefill` prefill and `--decode` decode workers.
//! - `--processes`: starts etcd and nats-server (from PATH) on free loopback ports with
//!   temporary data directories, then every role as its own `tandem` process on them.
//!
//! Ctrl-C (or SIGTERM) stops everything: the frontend drains first, then the workers.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tandem_protocol::{WorkerId, WorkerRole};
use tandem_runtime::discovery::MemoryDiscovery;
use tandem_runtime::events::MemoryEventPlane;
use tandem_runtime::external::{EtcdOptions, EtcdServer, NatsOptions, NatsServer, ProcessGroup};
use tandem_runtime::shutdown::Shutdown;
use tandem_worker::WorkerDeps;
use tokio::net::TcpListener;

use crate::args::engine::EngineArgs;
use crate::args::routing::RoutingArgs;
use crate::model_file::{ModelFile, available_cores};
use crate::serve::{HttpArgs, frontend_config};

#[derive(Args, Debug, Clone)]
pub struct UpArgs {
    /// HTTP port of the frontend (0: any free port).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Address the frontend binds.
    #[arg(long, env = "TANDEM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// API keys and tenants, the admin key, TLS, and where the status page, /status.json and
    /// /metrics are served (default: 127.0.0.1, --port + 1), as `tandem frontend` takes them.
    #[command(flatten)]
    pub access: crate::access::AccessArgs,
    /// Prefill workers (0: aggregated serving).
    #[arg(long, env = "TANDEM_PREFILL", default_value_t = 2)]
    pub prefill: u32,
    /// Decode workers.
    #[arg(long, env = "TANDEM_DECODE", default_value_t = 2)]
    pub decode: u32,
    /// Each role as its own process, on etcd and nats-server started from PATH.
    #[arg(long, default_value_t = false)]
    pub processes: bool,
    /// Worker threads of this process's async runtime (0: one per CPU). One by default: the
    /// frontend and the in-process workers' hosts hand each request to each other, and on
    /// one thread that costs no wake-up of another (a third less CPU per request than on two,
    /// BENCHMARKS.md); the engines' forward passes run on threads of their own either way.
    /// More threads pass more requests a second through many fast mocker workers.
    #[arg(long, env = "TANDEM_RUNTIME_THREADS", default_value_t = 1)]
    pub runtime_threads: usize,
    /// What computes the tokens: `native`, tandem's engine on the GGUF model `--model` names
    /// (a path, or a named model fetched on first use; smollm2-135m-instruct unless --model
    /// says otherwise), or `mocker`, modelled timing and random words (timing studies, the
    /// simulator's twin), serving `--model` as a name.
    #[arg(long = "engine", env = "TANDEM_ENGINE", default_value = "native", value_parser = ["native", "mocker"])]
    pub engine_kind: String,
    /// The prefill workers' --kv-dtype, when it is not the decode workers' (a prefill pool
    /// of another KV type: the decode workers convert what it sends).
    #[arg(long, env = "TANDEM_PREFILL_KV_DTYPE")]
    pub prefill_kv_dtype: Option<tandem_native::KvDtype>,
    #[command(flatten)]
    pub model_cache: crate::models::ModelCacheArgs,
    #[command(flatten)]
    pub routing: RoutingArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub flow: crate::args::flow::FlowArgs,
    /// How KV moves from prefill to decode workers. In one process the default is `local`
    /// (an in-process copy) and `tcp`, `ucx` or `inline` run the path separate machines
    /// take; with `--processes` each worker gets the flag (unset: ucx where UCX initialises,
    /// else tcp).
    #[command(flatten)]
    pub kv: crate::args::kv_transport::KvTransportArgs,
    /// Fault injection: the prefill workers corrupt one byte of every KV transfer after its
    /// digest is taken (as `tandem prefill --inject-kv-corruption`).
    #[arg(long, hide = true, default_value_t = false)]
    pub inject_kv_corruption: bool,
    /// Log one JSON object per line.
    #[arg(long, env = "TANDEM_LOG_JSON", default_value_t = false)]
    pub log_json: bool,
    /// Export traces over OTLP gRPC to this collector (e.g. `http://127.0.0.1:4317`), as the
    /// roles' own `--otlp-endpoint` does; in one process, every span is `service.name`
    /// `tandem`.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Fraction of the traces begun here that are exported, 0–1.
    #[arg(long, env = "TANDEM_OTLP_SAMPLING_RATIO", default_value_t = 1.0)]
    pub otlp_sampling_ratio: f64,
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let _telemetry = tandem_runtime::telemetry::init(tandem_runtime::telemetry::TelemetryConfig {
        json: args.log_json,
        filter: None,
        otlp: args
            .otlp_endpoint
            .as_ref()
            .map(|endpoint| tandem_runtime::telemetry::OtlpConfig {
                sampling_ratio: args.otlp_sampling_ratio,
                ..tandem_runtime::telemetry::OtlpConfig::new(endpoint, "tandem")
            }),
    })?;
    if args.decode == 0 {
        anyhow::bail!("--decode must be at least 1");
    }
    // The frontend's access flags, checked before anything starts (a model loads, etcd,
    // NATS, workers): a bad key pair fails here, not in the frontend (a child process with
    // --processes) once the rest is up.
    args.access.access()?;
    args.access.tls()?;
    let root = Shutdown::new();
    tandem_runtime::shutdown::shutdown_on_signals(root.clone());
    if args.processes {
        run_processes(args, root).await
    } else {
        run_embedded(args, root).await
    }
}

/// With `--engine native`: the model `--model` names, loaded once, and the frontend's flags
/// pointed at the same file (served name, tokenizer and chat template, context length).
async fn model_file(args: &mut UpArgs) -> anyhow::Result<Option<ModelFile>> {
    if args.engine_kind == "mocker" {
        return Ok(None);
    }
    anyhow::ensure!(
        args.http.lora_adapters.is_empty(),
        "--lora-adapters: the native engine computes no LoRA adapters (the mocker models them: \
         --engine mocker; behind vLLM, the sidecar serves the engine's)"
    );
    if args.http.model == HttpArgs::DEFAULT_MODEL {
        args.http.model = crate::models::DEFAULT_MODEL.to_string();
    }
    let model = ModelFile::from_flag(&args.http.model, &args.model_cache)
        .await?
        .with_context(|| {
            format!(
                "--engine native computes a GGUF model: --model must be a path to a .gguf file or \
             a named model ({}), got {:?} (--engine mocker serves any name)",
                crate::models::names(),
                args.http.model
            )
        })?;
    args.http.model = model.name.clone();
    if args.http.tokenizer == HttpArgs::DEFAULT_TOKENIZER {
        args.http.tokenizer = model.path.display().to_string();
    }
    args.http.context_length = args.http.context_length.min(model.context_length);
    Ok(Some(model))
}

async fn run_embedded(mut args: UpArgs, root: Shutdown) -> anyhow::Result<()> {
    let model = model_file(&mut args).await?;
    // The workers share the machine's cores.
    let threads = (available_cores() / (args.prefill + args.decode) as usize).max(1);
    let discovery = Arc::new(MemoryDiscovery::new());
    let events = Arc::new(MemoryEventPlane::new());
    // One process: by default KV moves by an in-process copy into the decode worker's
    // region; `--kv-transport` takes another path (all workers share the one transport).
    let transport = match args.kv.kv_transport {
        None => Some(
            tandem_kv_transfer::open(
                tandem_kv_transfer::TransportKind::Local,
                &tandem_kv_transfer::TransportConfig::default(),
            )
            .await?,
        ),
        Some(_) => args.kv.open().await?,
    };
    let deps = WorkerDeps {
        discovery: discovery.clone(),
        events: events.clone(),
        transport,
    };
    // The workers drain once the frontend has (it may still need them for its streams).
    let workers_stop = root.under();
    let mut workers = tokio::task::JoinSet::new();
    let roles = (0..args.prefill)
        .map(|_| WorkerRole::Prefill)
        .chain((0..args.decode).map(|_| WorkerRole::Decode));
    let (mut prefills, mut decodes) = (0, 0);
    for (i, role) in roles.enumerate() {
        let counter = if role == WorkerRole::Prefill {
            &mut prefills
        } else {
            &mut decodes
        };
        let name = format!(
            "{}-{counter}",
            if role == WorkerRole::Prefill {
                "prefill"
            } else {
                "decode"
            }
        );
        *counter += 1;
        let mut engine = args.engine.for_worker(&name);
        if let (WorkerRole::Prefill, Some(kv)) = (role, args.prefill_kv_dtype) {
            engine.kv_dtype = kv;
        }
        let mut cfg = engine.config(role, WorkerId(i as u64 + 1), &args.http.model, "default")?;
        if let Some(model) = &model {
            model.configure(&mut cfg, &engine.native(), threads)?;
        }
        cfg.corrupt_transfers = args.inject_kv_corruption && role == WorkerRole::Prefill;
        cfg.kv_digest = args.kv.kv_digest;
        cfg.kv_layer_streaming = args.kv.kv_layer_streaming;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let (deps, stop) = (deps.clone(), workers_stop.clone());
        workers.spawn(async move {
            match role {
                WorkerRole::Prefill => tandem_prefill_worker::run(cfg, listener, deps, stop).await,
                _ => tandem_decode_worker::run(cfg, listener, deps, stop).await,
            }
        });
    }
    let mut cfg = frontend_config(
        "default",
        &args.routing,
        &args.http,
        args.engine.block_size,
        None,
        false,
    )?;
    args.flow.apply(&mut cfg)?;
    args.access.apply(&mut cfg.http)?;
    let scheme = if cfg.http.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let admin = match admin_addr(&args)? {
        // The default address beside the port taken: one machine's laptop cluster should
        // not fail for its status page, so any free port (printed below) serves it.
        Some(a) if args.access.admin_listen.is_none() => match TcpListener::bind(&a).await {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(addr = %a, error = %e, "admin listener: using a free port");
                Some(TcpListener::bind("127.0.0.1:0").await?)
            }
        },
        Some(a) => Some(
            TcpListener::bind(&a)
                .await
                .with_context(|| format!("binding {a} (--admin-listen)"))?,
        ),
        None => None,
    };
    println!(
        "tandem up: {scheme}://{addr}/v1  ({} prefill, {} decode workers, policy {}, disagg {}; Ctrl-C stops)",
        args.prefill, args.decode, args.routing.policy, args.routing.disagg
    );
    if let Some(a) = admin.as_ref().map(TcpListener::local_addr).transpose()? {
        println!("tandem up: status page and /metrics on http://{a}/");
    }
    let cluster = tandem_frontend::ClusterDeps { discovery, events };
    let served = tandem_frontend::run_frontend(cfg, listener, admin, cluster, root.child()).await;
    workers_stop.drain();
    while let Some(r) = workers.join_next().await {
        if let Ok(Err(e)) = r {
            tracing::warn!(error = %e, "worker stopped with an error");
        }
    }
    served?;
    Ok(())
}

async fn run_processes(mut args: UpArgs, root: Shutdown) -> anyhow::Result<()> {
    let scheme = if args.access.tls()?.is_some() {
        "https"
    } else {
        "http"
    };
    // With a GGUF model, the workers compute it (each loads the file: a named model is in the
    // cache by now) and the frontend takes the served name, tokenizer and context length from
    // it.
    let model = model_file(&mut args).await?;
    // The default admin address beside a taken port: a free one instead, as in process (the
    // child frontend is told which; another process could still take it before the child
    // binds it).
    if args.access.admin_listen.is_none()
        && let Some(a) = admin_addr(&args)?
        && std::net::TcpListener::bind(&a).is_err()
    {
        let free = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        tracing::warn!(addr = %a, free = %free, "admin listener: using a free port");
        args.access.admin_listen = Some(free.to_string());
    }
    let gguf = model.as_ref().map(|m| m.flag.clone());
    let worker_model = match gguf {
        Some(gguf) => ["--engine=native".to_string(), format!("--model={gguf}")]
            .into_iter()
            .chain(args.model_cache.to_args())
            .collect(),
        None => vec![format!("--model={}", args.http.model)],
    };
    // The workers share the machine's cores, unless --threads says otherwise.
    if model.is_some() && args.engine.threads.is_none() {
        args.engine.threads =
            Some((available_cores() / (args.prefill + args.decode) as usize).max(1));
    }
    drop(model);
    let etcd = EtcdServer::start(EtcdOptions::default()).await?;
    let nats = NatsServer::start(NatsOptions::default()).await?;
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut plane = vec![
        "--etcd-endpoints".to_string(),
        etcd.endpoint(),
        "--nats-url".to_string(),
        nats.url(),
    ];
    // Each process exports its own spans, as its role.
    if let Some(endpoint) = &args.otlp_endpoint {
        plane.push(format!("--otlp-endpoint={endpoint}"));
        plane.push(format!(
            "--otlp-sampling-ratio={}",
            args.otlp_sampling_ratio
        ));
    }
    let mut roles = ProcessGroup::new();
    for (role, n) in [("prefill", args.prefill), ("decode", args.decode)] {
        for i in 0..n {
            let name = format!("{role}-{i}");
            let flags = worker_args(&args, &worker_model, role, &name);
            roles.spawn(name, &exe, flags.into_iter().chain(plane.clone()))?;
        }
    }
    roles.spawn_with_env(
        "frontend",
        &exe,
        frontend_args(&args).into_iter().chain(plane),
        frontend_env(&args),
    )?;
    println!(
        "tandem up --processes: {scheme}://{}:{}/v1  (etcd {}, nats {}; {} prefill, {} decode \
         processes; Ctrl-C stops)",
        args.host,
        args.port,
        etcd.endpoint(),
        nats.url(),
        args.prefill,
        args.decode
    );
    if let Some(a) = admin_addr(&args)? {
        println!("tandem up --processes: status page and /metrics on http://{a}/");
    }
    tokio::select! {
        () = root.draining() => {}
        exited = roles.wait_any() => {
            tracing::error!(role = %exited, "a role exited: stopping the cluster");
        }
    }
    // The frontend first (started last), then the workers: each drains within its own
    // drain timeout (30 s by default) before it is killed.
    roles.stop(Duration::from_secs(35)).await;
    drop((etcd, nats));
    Ok(())
}

/// The frontend's admin listener (`--admin-listen`, else beside --port).
fn admin_addr(args: &UpArgs) -> anyhow::Result<Option<String>> {
    crate::args::listen::admin_addr(
        args.access.admin_listen.as_deref(),
        &format!("{}:{}", args.host, args.port),
    )
}

/// The command line of worker `name` (`prefill-0`, …) of `up --processes`: `role`, every
/// engine and KV-transport flag of `up` (its disk tier in a directory of its own, a prefill
/// pool's own --kv-dtype), then `model` (what it computes or serves).
fn worker_args(args: &UpArgs, model: &[String], role: &str, name: &str) -> Vec<String> {
    let mut engine = args.engine.for_worker(name);
    if let ("prefill", Some(kv)) = (role, args.prefill_kv_dtype) {
        engine.kv_dtype = kv;
    }
    let corrupt = (args.inject_kv_corruption && role == "prefill")
        .then(|| "--inject-kv-corruption".to_string());
    // Explicit, so that a TANDEM_LISTEN in `up`'s environment does not reach a worker.
    [
        role.to_string(),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
    ]
    .into_iter()
    .chain(engine.to_args())
    .chain(args.kv.to_worker_args())
    .chain(model.iter().cloned())
    .chain(corrupt)
    .collect()
}

/// The secrets of `up`'s access flags, for its frontend process's environment (where `ps`
/// does not show them): the API keys and the admin key, under the variables that
/// `tandem frontend` reads them from.
fn frontend_env(args: &UpArgs) -> Vec<(&'static str, String)> {
    let keys = (!args.access.api_keys.is_empty())
        .then(|| ("TANDEM_API_KEYS", args.access.api_keys.join(",")));
    let admin = args
        .access
        .admin_key
        .clone()
        .map(|k| ("TANDEM_ADMIN_KEY", k));
    keys.into_iter().chain(admin).collect()
}

/// The `tandem frontend` command line of `up --processes`: every flag of `up` that configures
/// a frontend (the HTTP APIs, access, routing, flow control), so the child serves as the
/// in-process frontend of the same `up` would; the secrets go by [`frontend_env`].
fn frontend_args(args: &UpArgs) -> Vec<String> {
    [
        "frontend".to_string(),
        format!("--host={}", args.host),
        format!("--port={}", args.port),
        format!(
            "--admin-listen={}",
            admin_addr(args)
                .ok()
                .flatten()
                .unwrap_or_else(|| "off".into())
        ),
        format!("--block-size={}", args.engine.block_size),
    ]
    .into_iter()
    .chain(
        args.access
            .api_keys_file
            .iter()
            .map(|f| format!("--api-keys-file={}", f.display())),
    )
    .chain(
        [
            ("tls-cert", &args.access.tls_cert),
            ("tls-key", &args.access.tls_key),
        ]
        .into_iter()
        .filter_map(|(flag, f)| f.as_ref().map(|f| format!("--{flag}={}", f.display()))),
    )
    .chain(args.http.to_args())
    .chain(args.routing.to_args())
    .chain(args.flow.to_args())
    .collect()
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::access::AccessArgs;
    use crate::args::flow::FlowArgs;
    use crate::serve::FrontendArgs;

    #[derive(Parser)]
    struct Up {
        #[command(flatten)]
        up: UpArgs,
    }

    #[derive(Parser)]
    struct Frontend {
        #[command(flatten)]
        frontend: FrontendArgs,
    }

    #[derive(Parser)]
    struct Worker {
        #[command(flatten)]
        worker: crate::serve::WorkerArgs,
    }

    /// The long flags of one group of arguments.
    fn longs<A: clap::Args>() -> Vec<String> {
        A::augment_args(clap::Command::new("t"))
            .get_arguments()
            .filter_map(|a| a.get_long().map(str::to_string))
            .collect()
    }

    /// The flags of `longs` that `argv` does not give.
    fn not_in(argv: &[String], longs: Vec<String>) -> Vec<String> {
        longs
            .into_iter()
            .map(|long| format!("--{long}"))
            .filter(|flag| {
                !argv
                    .iter()
                    .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
            })
            .collect()
    }

    /// `up`'s flags that configure its frontend, none at its default.
    const SET: &[&str] = &[
        "--port=9123",
        "--host=127.0.0.2",
        "--block-size=32",
        "--model=served",
        "--tokenizer=o200k_base",
        "--context-length=4096",
        "--drain-timeout-s=7",
        "--lora-adapters=a,b",
        "--chat-template=/tmp/t.jinja",
        "--chat-template-name=tool_use",
        "--tool-call-parser=hermes",
        "--responses-store-max=5",
        "--responses-store-max-bytes=4096",
        "--session-field=none",
        "--groups=/tmp/groups.toml",
        "--semantic-cache",
        "--semantic-cache-threshold=0.1",
        "--semantic-cache-ttl-s=60",
        "--semantic-cache-max-entries=50",
        "--semantic-cache-messages=2",
        "--semantic-cache-include-system=true",
        "--semantic-cache-vary-by=x-team,x-lang",
        "--semantic-cache-embeddings-url=http://127.0.0.1:9/v1/embeddings",
        "--semantic-cache-embeddings-model=e5",
        "--semantic-cache-embeddings-key-env=HOME",
        "--request-timeout=30",
        "--queue-max=3",
        "--queue-timeout=2.5",
        "--queue-starvation-ms=900",
        "--queue-starvation-every=5",
        "--fair-input-weight=0.5",
        "--fair-output-weight=3",
        "--tenant-requests-per-minute=60",
        "--tenant-tokens-per-minute=6000",
        "--saturation-kv-fraction=0.8",
        "--saturation-waiting=2",
        "--saturation-prefill-tokens=100",
        "--saturation-requests=9",
        "--saturation-prefill-pool-tokens=1000",
        "--max-attempts=2",
        "--max-migrations=1",
        "--retry-budget=0.3",
        "--retry-budget-min=4",
        "--retry-backoff-ms=10",
        "--breaker-failures=7",
        "--breaker-failure-ratio=0.4",
        "--breaker-window-s=12",
        "--breaker-window-min-requests=6",
        "--breaker-open-ms=700",
        "--breaker-max-open-ms=9000",
        "--hedge",
        "--hedge-quantile=0.9",
        "--hedge-min-delay-ms=40",
        "--session-max-concurrent=2",
        "--policy=cache-aware",
        "--disagg=never",
        "--temperature=0.5",
        "--busy-kv-usage=0.9",
        "--busy-prefill-tokens=5000",
        "--isl-max-local-fraction=0.5",
        "--api-keys=sk-a=acme,sk-b==beta",
        "--api-keys-file=/tmp/keys.json",
        "--admin-key=sk-admin",
        "--tls-cert=/tmp/cert.pem",
        "--tls-key=/tmp/key.pem",
        "--serving-threads=3",
    ];

    fn child_of(flags: &[&str]) -> (UpArgs, FrontendArgs) {
        let up = Up::try_parse_from(std::iter::once("up").chain(flags.iter().copied()))
            .unwrap()
            .up;
        let argv = frontend_args(&up);
        assert_eq!(argv[0], "frontend");
        let child = Frontend::try_parse_from(argv.iter().map(String::as_str))
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"))
            .frontend;
        (up, child)
    }

    #[test]
    fn every_frontend_flag_of_up_reaches_the_frontend_process() {
        for flags in [SET, &[]] {
            let (up, child) = child_of(flags);
            // The same flags, so the same configuration (`frontend_config` and
            // `FlowArgs::apply` build both from them).
            assert_eq!(format!("{:?}", child.http), format!("{:?}", up.http));
            assert_eq!(format!("{:?}", child.flow), format!("{:?}", up.flow));
            assert_eq!(format!("{:?}", child.routing), format!("{:?}", up.routing));
            assert_eq!(child.block_size, up.engine.block_size);
            assert_eq!(
                child.access.admin_listen,
                admin_addr(&up).unwrap().or(Some("off".into()))
            );
            assert_eq!(
                child.host_port.resolve(&child.listen).unwrap(),
                format!("{}:{}", up.host, up.port)
            );
        }
        // A flag added to one of these groups and not to its `to_args` fails here.
        let (up, _) = child_of(SET);
        let argv = frontend_args(&up);
        let groups = [
            longs::<HttpArgs>(),
            longs::<FlowArgs>(),
            longs::<RoutingArgs>(),
        ];
        let missing = not_in(&argv, groups.concat());
        assert!(
            missing.is_empty(),
            "not passed to `tandem up --processes`'s frontend: {missing:?}"
        );
        // Access: the files and the listener's by flag, the keys by the child's environment.
        let env = frontend_env(&up);
        let unpassed: Vec<String> = AccessArgs::augment_args(clap::Command::new("t"))
            .get_arguments()
            .filter(|a| {
                let long = a.get_long().unwrap_or_default();
                let by_flag = argv.iter().any(|x| x.starts_with(&format!("--{long}=")));
                let by_env = a
                    .get_env()
                    .is_some_and(|var| env.iter().any(|(k, _)| var == *k));
                !by_flag && !by_env
            })
            .map(|a| a.get_id().to_string())
            .collect();
        assert!(unpassed.is_empty(), "access flags not passed: {unpassed:?}");
        let mut with_env = argv.clone();
        with_env.extend(env.iter().map(|(var, value)| {
            let flag = var
                .trim_start_matches("TANDEM_")
                .to_lowercase()
                .replace('_', "-");
            format!("--{flag}={value}")
        }));
        let child = Frontend::try_parse_from(with_env.iter().map(String::as_str))
            .unwrap()
            .frontend;
        assert_eq!(child.access.access().unwrap(), up.access.access().unwrap());
        assert_eq!(child.access.tls().unwrap(), up.access.tls().unwrap());
        assert!(
            !argv
                .iter()
                .any(|a| a.contains("sk-a=acme") || a.contains("sk-admin")),
            "a key on the command line: {argv:?}"
        );
        Up::command().debug_assert();
    }

    #[test]
    fn every_engine_and_kv_flag_of_up_reaches_each_worker_process() {
        let set = [
            "--block-size=32",
            "--device-blocks=100",
            "--host-blocks=50",
            "--max-batched-tokens=256",
            "--max-num-seqs=8",
            "--max-waiting=9",
            "--speedup-ratio=2",
            "--max-loras=2",
            "--adapter-load-ms=5",
            "--threads=3",
            "--kv-memory-mb=64",
            "--kv-disk-dir=/tmp/kv",
            "--kv-disk-mb=10",
            "--kv-dtype=f32",
            "--prefill-kv-dtype=f16",
            "--kv-transport=tcp",
            "--ucx-net-devices=lo",
            "--ucx-tls=tcp",
            "--kv-advertise-host=10.0.0.1",
            "--kv-digest=false",
            "--kv-layer-streaming=false",
            "--inject-kv-corruption",
        ];
        let up = Up::try_parse_from(std::iter::once("up").chain(set))
            .unwrap()
            .up;
        let model = ["--model=m".to_string()];
        for (role, name) in [("prefill", "prefill-0"), ("decode", "decode-1")] {
            let argv = worker_args(&up, &model, role, name);
            let child = Worker::try_parse_from(argv.iter().map(String::as_str))
                .unwrap_or_else(|e| panic!("{argv:?}: {e}"))
                .worker;
            let mut want = up.engine.for_worker(name);
            if role == "prefill" {
                want.kv_dtype = tandem_native::KvDtype::F16;
            }
            assert_eq!(format!("{:?}", child.engine), format!("{want:?}"));
            assert_eq!(
                child.engine.kv_disk_dir,
                Some(std::path::PathBuf::from("/tmp/kv").join(name))
            );
            assert_eq!(child.kv.to_worker_args(), up.kv.to_worker_args());
            assert_eq!(child.inject_kv_corruption, role == "prefill");
            assert_eq!(child.model, "m");
            let mut groups = [
                longs::<crate::args::engine::EngineArgs>(),
                longs::<crate::args::kv_transport::KvTransportArgs>(),
            ]
            .concat();
            // Each worker's own listener.
            groups.retain(|long| long != "kv-listen");
            let missing = not_in(&argv, groups);
            assert!(missing.is_empty(), "not passed to {name}: {missing:?}");
        }
    }
}
