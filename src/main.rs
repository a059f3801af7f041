//! The `tandem` binary: parses flags and hands them to the library code that does the work.

// The global allocator: glibc's malloc unless a feature picks another (the `jemalloc` and
// `mimalloc` features; docs/RELIABILITY.md, Memory, has the soak that compares them).
#[cfg(all(feature = "jemalloc", feature = "mimalloc"))]
compile_error!("the `jemalloc` and `mimalloc` features each set the global allocator: pick one");
#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod access;
mod args;
mod backends;
mod bench;
mod epp;
mod model_file;
mod models;
mod planner;
mod serve;
mod sim;
mod size;
mod up;

use clap::{Parser, Subcommand};
use tandem_protocol::WorkerRole;

#[derive(Parser, Debug)]
#[command(
    name = "tandem",
    version,
    about = "Disaggregated prefill/decode LLM serving runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Simulate a cluster in virtual time: real mocker engines and the real router (policies,
    /// KV index, tracker, disaggregation), a simulated event plane; latency percentiles,
    /// goodput under an SLO, prefix hit rate, load spread; rate sweeps and SVG plots.
    Sim(Box<sim::SimArgs>),
    /// A whole cluster on this machine: frontend, prefill and decode mocker workers in one
    /// process (in-memory discovery and events, real gRPC), or each as its own process on
    /// etcd and NATS with `--processes`.
    Up(Box<up::UpArgs>),
    /// The OpenAI-compatible frontend with the KV-aware router, on etcd and NATS; or, with
    /// `--backend-url`, straight in front of OpenAI-compatible servers.
    Frontend(Box<serve::FrontendArgs>),
    /// A prefill worker (the mocker engine, or a sidecar to vLLM / SGLang with `--engine`), on
    /// etcd and NATS.
    Prefill(Box<serve::WorkerArgs>),
    /// A decode worker (the mocker engine, or a sidecar to vLLM / SGLang with `--engine`), on
    /// etcd and NATS.
    Decode(Box<serve::WorkerArgs>),
    /// The global KV index as a standalone gRPC service shared by frontend replicas.
    Indexer(Box<serve::IndexerArgs>),
    /// Open-loop load against any OpenAI-compatible endpoint (the workloads of `tandem sim`):
    /// TTFT, TPOT, ITL and E2E percentiles, goodput under an SLO, the prefix-cache hit rate;
    /// rate sweeps, JSON, SVG plots.
    Bench(Box<bench::BenchArgs>),
    /// How many workers a load needs to meet its SLO, aggregated and split into prefill and
    /// decode pools: `tandem sim` over candidate clusters (offline; `planner` scales a live
    /// cluster). `plan` is its former name.
    #[command(alias = "plan")]
    Size(Box<size::SizeArgs>),
    /// The router as a Gateway API Inference Extension endpoint picker (Envoy ext_proc) for
    /// an InferencePool: picks the model server (a sidecar's engine) for each request.
    Epp(Box<epp::EppArgs>),
    /// The online planner: reads the frontends' metrics every interval, forecasts the load
    /// and sets the prefill and decode replica counts (local worker processes, or the
    /// Kubernetes scale subresource), with hysteresis.
    Planner(Box<planner::PlannerArgs>),
    /// Fetches a named model into the cache, as `--model NAME` does on first use (a step for
    /// an image or an init container), and prints the GGUF file's path.
    Fetch(models::FetchArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Sim(args) => sim::run(*args),
        Command::Up(args) => {
            let threads = args.runtime_threads;
            run_on(threads, up::run(*args))
        }
        Command::Frontend(args) => block_on(serve::run_frontend(*args)),
        Command::Prefill(args) => block_on(serve::run_worker(*args, WorkerRole::Prefill)),
        Command::Decode(args) => block_on(serve::run_worker(*args, WorkerRole::Decode)),
        Command::Indexer(args) => block_on(serve::run_indexer(*args)),
        Command::Bench(args) => block_on(bench::run(*args)),
        Command::Size(args) => size::run(*args),
        Command::Epp(args) => block_on(epp::run(*args)),
        Command::Planner(args) => block_on(planner::run(*args)),
        Command::Fetch(args) => block_on(models::run(args)),
    }
}

fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(f: F) -> anyhow::Result<()> {
    run_on(0, f)
}

/// Runs `f` on a multi-threaded runtime of `threads` workers (0: tokio's default, one per
/// CPU or `TOKIO_WORKER_THREADS`). Multi-threaded even with one: `block_in_place` needs it.
fn run_on<F: std::future::Future<Output = anyhow::Result<()>>>(
    threads: usize,
    f: F,
) -> anyhow::Result<()> {
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        rt.worker_threads(threads);
    }
    rt.enable_all().build()?.block_on(f)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every subcommand's flags are well formed (no two share a name): clap checks it only
    /// when a subcommand is first parsed, which would otherwise be at a user's first run.
    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }

    /// `tandem size` answers to its former name too: scripts written for `tandem plan` work.
    #[test]
    fn size_keeps_plan_as_an_alias() {
        use clap::Parser;
        for name in ["size", "plan"] {
            let cli = super::Cli::try_parse_from(["tandem", name, "--workers", "4"]).unwrap();
            assert!(matches!(cli.command, super::Command::Size(_)), "{name}");
        }
    }

    /// The repository stands alone (docs/CONVENTIONS.md §16): no file reads or cites what
    /// lies beside a clone of it.
    #[test]
    fn the_repository_cites_only_itself() {
        fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for entry in std::fs::read_dir(dir).unwrap().flatten() {
                let path = entry.path();
                let name = entry.file_name().to_string_lossy().to_string();
                if path.is_dir() {
                    if !name.starts_with('.') && name != "target" {
                        walk(&path, out);
                    }
                } else if [".rs", ".md", ".sh", ".py", ".toml", ".yaml", ".yml"]
                    .iter()
                    .any(|ext| name.ends_with(ext))
                {
                    out.push(path);
                }
            }
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        walk(root, &mut files);
        assert!(files.len() > 100, "walked {} files", files.len());
        // Spelled in two parts so that this file does not match itself.
        let outside = [concat!("../", "shared"), concat!("DESIGN", ".md")];
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            for needle in outside {
                assert!(
                    !text.contains(needle),
                    "{} cites {needle}, which a clone of the repository does not have",
                    file.display()
                );
            }
        }
    }

    /// A flag means one thing on every role: its environment variable is its name
    /// (`--kv-dtype`: `TANDEM_KV_DTYPE`), in a tool's own scope where the tool keeps its
    /// settings apart from a serving environment's (`tandem sim --block-size`:
    /// `TANDEM_SIM_BLOCK_SIZE`), and one variable names one flag everywhere. Every role that
    /// listens takes `--host` and `--port` (with `--listen` as their alias), and none names
    /// its address any other way.
    #[test]
    fn flags_with_one_meaning_have_one_name_on_every_role() {
        use std::collections::HashMap;
        const SCOPES: [&str; 7] = [
            "",
            "SIM_",
            "PLAN_",
            "BENCH_",
            "PLANNER_",
            "WORKLOAD_",
            "EPP_",
        ];
        // Variables other programs define, read as they mean them.
        const STANDARD: [&str; 1] = ["OTEL_EXPORTER_OTLP_ENDPOINT"];
        let cli = super::Cli::command();
        let mut long_of: HashMap<String, (String, String)> = HashMap::new();
        for role in cli.get_subcommands() {
            let name = role.get_name().to_string();
            let longs: Vec<&str> = role.get_arguments().filter_map(|a| a.get_long()).collect();
            if longs.contains(&"listen") {
                assert!(
                    longs.contains(&"host") && longs.contains(&"port"),
                    "tandem {name} takes --listen without --host and --port"
                );
            }
            for synonym in ["bind", "address", "listen-addr", "http-port", "grpc-port"] {
                assert!(
                    !longs.contains(&synonym),
                    "tandem {name} names its address --{synonym}: use --host / --port"
                );
            }
            for arg in role.get_arguments() {
                let (Some(long), Some(env)) = (arg.get_long(), arg.get_env()) else {
                    continue;
                };
                let env = env.to_string_lossy().to_string();
                let snake = long.to_uppercase().replace('-', "_");
                let named = STANDARD.contains(&env.as_str())
                    || SCOPES.iter().any(|scope| {
                        let want = format!("TANDEM_{scope}{snake}");
                        // A flag that takes a list may name its variable in the plural.
                        env == want || env == format!("{want}S")
                    });
                assert!(named, "tandem {name} --{long} reads {env}");
                let first = long_of
                    .entry(env.clone())
                    .or_insert_with(|| (name.clone(), long.to_string()));
                assert_eq!(
                    first.1, long,
                    "{env}: --{} on tandem {}, --{long} on tandem {name}",
                    first.1, first.0
                );
            }
        }
    }
}
