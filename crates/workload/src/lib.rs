//! Request workloads for the simulator, the benchmarks and the demo.
//!
//! - [`trace`]: Mooncake request traces (`shared/traces/`): one JSON object a line with
//!   `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, one id per 512-token
//!   block of the prompt. [`trace::expand_tokens`] turns the ids into token ids, a fixed
//!   function of each id, so that requests sharing leading ids share exactly those prefixes at
//!   any smaller KV block size.
//!
//! Pure data: no I/O beyond reading the file the caller names, no clocks.

pub mod trace;

pub use trace::{TraceError, TraceRecord, expand_tokens, load_trace, parse_trace};
