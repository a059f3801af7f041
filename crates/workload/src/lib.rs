//! tandem's workloads and their figures: what requests to make and when, what an SLO is, how
//! latencies are summarized, how the results are drawn. `tandem sim` (through `tandem-sim`),
//! `tandem size` and `tandem bench` (through `tandem-bench`) all take these from here, so a
//! simulated cluster and a real one see the same requests and are judged the same way.
//!
//! # Layout
//!
//! - `config.rs`: [`WorkloadConfig`] (a [`TraceWorkload`] or a [`SyntheticConfig`]: request
//!   count, rate, [`ArrivalProcess`], [`LengthDist`]s, [`PromptShape`]), validated once.
//! - [`trace`]: Mooncake request traces (`traces/`): one JSON object a line with
//!   `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, one id per 512-token
//!   block of the prompt. [`trace::expand_tokens`] turns the ids into token ids, a fixed
//!   function of each id, so that requests sharing leading ids share exactly those prefixes at
//!   any smaller KV block size.
//! - `requests.rs`: [`build`] turns a config into [`RequestSpec`]s (arrival µs, output length,
//!   a compact [`PromptSpec`] expanded into tokens only at arrival); `arrivals.rs`: the random
//!   draws (lengths, Poisson / gamma / constant gaps).
//! - `slo.rs`: [`Slo`] (TTFT and TPOT bounds, and the attainment a run needs).
//! - `latency.rs`: [`LatencyHistogram`] and its [`LatencySummary`], the one percentile type
//!   of the workspace (the simulator's report, the bench's report, the crates' benches).
//! - [`plot`]: SVG line charts (TTFT CDF, goodput against rate), [`plot::Figures`] (the plots
//!   of a run or a sweep, written to a directory) and [`plot::write_json`].
//! - `rates.rs`: [`parse_rates`], a sweep's rates as `--sweep-rate` writes them.
//! - `error.rs`: [`WorkloadError`].
//!
//! # Invariants
//!
//! - Same config and seed, same requests, bit for bit: every draw comes from
//!   [`tandem_protocol::Rng`] in a fixed order, and nothing reads a clock or the environment.
//!   The only I/O is reading the trace file the caller names, and writing the outputs it
//!   asks for.
//! - Latency memory is bounded: a [`LatencyHistogram`] is a few tens of KB whatever the
//!   number of samples.
//!
//! # Choices, measured
//!
//! - **Percentiles: `hdrhistogram`** (3 significant digits, samples in µs, auto-resizing;
//!   count, mean, min and max kept exactly beside it) instead of sorting every sample. The
//!   simulator kept every inter-token gap (one `u32` per output token) and the bench every
//!   gap of every request as `f64`s, with their records, until the end of the run; exact
//!   nearest-rank needs them all. The histogram's percentiles are within 0.1 % of the exact
//!   ones (a test checks it on 50,000 log-uniform samples). Measured on the simulator (2-core
//!   VM, 2026-12-01; commands in `crates/sim/BENCHMARKS.md`): over the 26 runs of
//!   `scripts/sim-compare.sh` the largest relative change of any percentile figure was
//!   0.095 %, the exact means moved only in their last digits (≤ 4.8·10⁻¹³ relative: the old
//!   code summed the sorted samples, the new one sums in arrival order with compensation), and
//!   no other figure moved; `tandem sim --workers 200 --requests 20000 --rate 400 --isl 512
//!   --osl 64 --seed 1` took 0.93× the wall time and 0.93× the peak RSS of the sorting code
//!   (medians of five alternated runs).
//! - **Plots: `plotters`** with only `svg_backend` and `line_series` (pure Rust, no font or
//!   system library; it estimates text widths without a font) instead of the hand-written
//!   SVG: axes with ticks, a grid, titles and a framed legend; its output was looked at as PNG
//!   (rsvg-convert) before it was kept.

mod arrivals;
mod config;
mod error;
mod latency;
pub mod plot;
mod rates;
mod requests;
mod slo;
pub mod trace;

pub use config::{
    AdapterMix, ArrivalProcess, LengthDist, PromptShape, SyntheticConfig, TraceWorkload,
    WorkloadConfig,
};
pub use error::WorkloadError;
pub use latency::{LatencyHistogram, LatencySummary, Resolution};
pub use rates::parse_rates;
pub use requests::{PromptSpec, RequestSpec, build};
pub use slo::Slo;
pub use trace::{TraceError, TraceRecord, expand_tokens, load_trace, parse_trace};
