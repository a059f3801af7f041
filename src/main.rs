//! The `tandem` binary: parses flags and hands them to the library code that does the work.

mod replay;

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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => replay::run(args),
    }
}
