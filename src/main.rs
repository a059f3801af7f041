//! The `tandem` binary: parses flags and hands them to the library code that does the work.

mod replay;
mod sim;

use clap::{Parser, Subcommand};

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
    /// Replay a Mooncake trace through mocker engines in virtual time, routed with the global
    /// KV index, and report prefix-cache hit rate and latency per routing policy.
    Replay(replay::ReplayArgs),
    /// Simulate a cluster in virtual time: real mocker engines and the real router (policies,
    /// KV index, tracker, disaggregation), a simulated event plane; latency percentiles,
    /// goodput under an SLO, prefix hit rate, load spread; rate sweeps and SVG plots.
    Sim(Box<sim::SimArgs>),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => replay::run(args),
        Command::Sim(args) => sim::run(*args),
    }
}
