//! [`WorkloadConfig`]: where requests come from (a Mooncake trace, or a synthetic workload),
//! as plain data, validated by [`WorkloadConfig::validate`] before anything is generated.
//!
//! Validation messages name the command-line flags that fill each field (`--rate`, `--isl`,
//! …): `tandem sim` and `tandem bench` share those flags, and a message that names the flag is
//! the one a user can act on.

use std::path::PathBuf;

use crate::error::WorkloadError;

/// Where requests come from.
#[derive(Clone, Debug)]
pub enum WorkloadConfig {
    Trace(TraceWorkload),
    Synthetic(SyntheticConfig),
}

impl WorkloadConfig {
    /// Checks every field; the first problem comes back as [`WorkloadError::InvalidConfig`].
    pub fn validate(&self) -> Result<(), WorkloadError> {
        match self {
            WorkloadConfig::Trace(t) if !positive(t.arrival_speedup) => {
                invalid("--arrival-speedup must be a positive number")
            }
            WorkloadConfig::Trace(_) => Ok(()),
            WorkloadConfig::Synthetic(s) => s.validate(),
        }
    }

    /// The rate this workload offers: a synthetic workload's requests per second, or a
    /// trace's arrival speedup (the knob a rate sweep turns).
    pub fn rate(&self) -> f64 {
        match self {
            WorkloadConfig::Trace(t) => t.arrival_speedup,
            WorkloadConfig::Synthetic(s) => s.rate,
        }
    }

    /// The same workload at another [`rate`](Self::rate).
    pub fn with_rate(&self, rate: f64) -> WorkloadConfig {
        let mut cfg = self.clone();
        match &mut cfg {
            WorkloadConfig::Trace(t) => t.arrival_speedup = rate,
            WorkloadConfig::Synthetic(s) => s.rate = rate,
        }
        cfg
    }

    /// What [`rate`](Self::rate) counts: `requests_per_second` or `arrival_speedup`.
    pub fn rate_unit(&self) -> &'static str {
        match self {
            WorkloadConfig::Trace(_) => "arrival_speedup",
            WorkloadConfig::Synthetic(_) => "requests_per_second",
        }
    }
}

/// A Mooncake trace replayed (see `traces/README.md`).
#[derive(Clone, Debug)]
pub struct TraceWorkload {
    pub path: PathBuf,
    /// Inter-arrival times are divided by this.
    pub arrival_speedup: f64,
    /// Only the first N requests (None: all).
    pub limit: Option<usize>,
}

/// A generated workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticConfig {
    pub requests: usize,
    /// Mean arrival rate, requests per second.
    pub rate: f64,
    pub arrival: ArrivalProcess,
    /// Prompt length (for multi-turn: the new user text of each turn).
    pub isl: LengthDist,
    pub osl: LengthDist,
    pub shape: PromptShape,
    /// The LoRA adapters requests run on (none by default).
    pub adapters: AdapterMix,
}

/// How requests spread over LoRA adapters: `count` adapters (0: every request on the base
/// model), adapter `k` (from 0) drawn with weight `1 / (k + 1)^skew` — Zipf, as adapter
/// popularity is in multi-tenant LoRA serving (a few hot adapters, a long tail). A session
/// keeps its adapter across its turns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdapterMix {
    pub count: u32,
    pub skew: f64,
}

impl Default for AdapterMix {
    fn default() -> Self {
        AdapterMix {
            count: 0,
            skew: 1.0,
        }
    }
}

impl AdapterMix {
    /// The name of adapter `k`, as requests and workers know it.
    pub fn name(k: u32) -> String {
        format!("lora-{k}")
    }
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            requests: 1000,
            rate: 10.0,
            arrival: ArrivalProcess::Poisson,
            isl: LengthDist::fixed(1024),
            osl: LengthDist::fixed(128),
            shape: PromptShape::Random,
            adapters: AdapterMix::default(),
        }
    }
}

impl SyntheticConfig {
    /// Checks every field; the first problem comes back as [`WorkloadError::InvalidConfig`].
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.requests == 0 {
            return invalid("--requests must be at least 1");
        }
        if !positive(self.rate) {
            return invalid("--rate must be a positive number");
        }
        if let ArrivalProcess::Gamma { shape } = self.arrival
            && !positive(shape)
        {
            return invalid("--burstiness (gamma shape) must be a positive number");
        }
        for (name, d) in [("--isl", self.isl), ("--osl", self.osl)] {
            if d.mean == 0 || !(0.0..=1.0).contains(&d.spread) {
                return Err(WorkloadError::InvalidConfig(format!(
                    "{name} must be at least 1 and its spread in [0, 1]"
                )));
            }
        }
        if !(self.adapters.skew.is_finite() && self.adapters.skew >= 0.0) {
            return invalid("--adapter-skew must be a finite number, not negative");
        }
        match self.shape {
            PromptShape::SharedPrefix { groups: 0, .. } => {
                invalid("--prefix-groups must be at least 1")
            }
            PromptShape::MultiTurn { turns: 0, .. } => invalid("--turns must be at least 1"),
            _ => Ok(()),
        }
    }
}

/// Inter-arrival times.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ArrivalProcess {
    /// Exponential gaps.
    Poisson,
    /// Gamma gaps with this shape (< 1: burstier than Poisson; 1: Poisson).
    Gamma { shape: f64 },
    /// Equal gaps.
    Constant,
}

/// A length: `mean`, drawn uniformly from `[mean·(1−spread), mean·(1+spread)]` (at least 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LengthDist {
    pub mean: u32,
    pub spread: f64,
}

impl LengthDist {
    pub const fn fixed(mean: u32) -> Self {
        LengthDist { mean, spread: 0.0 }
    }
}

/// How synthetic prompts relate to each other.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PromptShape {
    /// Every prompt unique.
    Random,
    /// Each request picks one of `groups` shared prefixes of `prefix_len` tokens uniformly,
    /// followed by its own ISL-long suffix.
    SharedPrefix { groups: u32, prefix_len: u32 },
    /// Sessions of `turns` requests; turn k's prompt is the whole conversation so far (earlier
    /// user texts and answers) plus a new ISL-long text, sent `think_time_us` after the
    /// previous turn was sent (open loop). Sessions start at the arrival process's times.
    MultiTurn { turns: u32, think_time_us: u64 },
}

/// A finite number above 0.
pub(crate) fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

fn invalid(what: &str) -> Result<(), WorkloadError> {
    Err(WorkloadError::InvalidConfig(what.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_fields_name_their_flags() {
        let bad = |f: &dyn Fn(&mut SyntheticConfig)| {
            let mut s = SyntheticConfig::default();
            f(&mut s);
            WorkloadConfig::Synthetic(s)
                .validate()
                .unwrap_err()
                .to_string()
        };
        assert!(bad(&|s| s.requests = 0).contains("--requests"));
        assert!(bad(&|s| s.rate = f64::NAN).contains("--rate"));
        assert!(
            bad(&|s| s.arrival = ArrivalProcess::Gamma { shape: 0.0 }).contains("--burstiness")
        );
        assert!(bad(&|s| s.osl.spread = 2.0).contains("--osl"));
        assert!(
            bad(&|s| s.shape = PromptShape::SharedPrefix {
                groups: 0,
                prefix_len: 1
            })
            .contains("--prefix-groups")
        );
        let trace = WorkloadConfig::Trace(TraceWorkload {
            path: "t.jsonl".into(),
            arrival_speedup: 0.0,
            limit: None,
        });
        assert!(
            trace
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--arrival-speedup")
        );
        assert!(
            WorkloadConfig::Synthetic(SyntheticConfig::default())
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn the_rate_is_the_request_rate_or_the_trace_speedup() {
        let s = WorkloadConfig::Synthetic(SyntheticConfig::default());
        assert_eq!((s.rate(), s.with_rate(3.0).rate()), (10.0, 3.0));
        assert_eq!(s.rate_unit(), "requests_per_second");
        let t = WorkloadConfig::Trace(TraceWorkload {
            path: "t.jsonl".into(),
            arrival_speedup: 2.0,
            limit: None,
        });
        assert_eq!((t.rate(), t.with_rate(4.0).rate()), (2.0, 4.0));
        assert_eq!(t.rate_unit(), "arrival_speedup");
    }
}
