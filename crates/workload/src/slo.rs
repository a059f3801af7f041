//! [`Slo`]: the service-level objective behind goodput, in `tandem sim`, `tandem size` and
//! `tandem bench` alike.

use serde::Serialize;

use crate::config::positive;
use crate::error::WorkloadError;

/// Bounds on one request's latency, and the fraction of requests that must keep them.
///
/// A request *meets* the SLO when it completed, its TTFT ≤ `ttft_ms` and its TPOT (mean time
/// per output token after the first) ≤ `tpot_ms`; a request with a single output token has no
/// TPOT and is judged on its TTFT. A run *attains* the SLO when at least `attainment` of its
/// requests meet it (sweeps' capacity, `tandem size`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: f64,
    /// `tandem sim --slo-itl-ms` (alias `--slo-tpot-ms`), `tandem bench --slo-tpot-ms`; the
    /// simulator's report calls it `slo_itl_ms`.
    pub tpot_ms: f64,
    /// In (0, 1].
    pub attainment: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Slo {
            ttft_ms: 2000.0,
            tpot_ms: 25.0,
            attainment: 0.9,
        }
    }
}

impl Slo {
    /// Checks every field; the message names the flags.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if !(positive(self.ttft_ms) && positive(self.tpot_ms)) {
            return Err(WorkloadError::InvalidConfig(
                "--slo-ttft-ms and --slo-tpot-ms must be positive numbers".into(),
            ));
        }
        if !(self.attainment > 0.0 && self.attainment <= 1.0) {
            return Err(WorkloadError::InvalidConfig(
                "--slo-attainment must be in (0, 1]".into(),
            ));
        }
        Ok(())
    }

    /// Whether a completed request with this TTFT and TPOT (None: fewer than two output
    /// tokens) meets the bounds.
    pub fn met(&self, ttft_ms: f64, tpot_ms: Option<f64>) -> bool {
        ttft_ms <= self.ttft_ms && tpot_ms.is_none_or(|t| t <= self.tpot_ms)
    }

    /// Whether a run in which `fraction` of the requests met the bounds attains the SLO.
    pub fn attained(&self, fraction: f64) -> bool {
        fraction >= self.attainment
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_attainment() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 10.0,
            attainment: 0.5,
        };
        assert!(slo.met(100.0, Some(10.0)));
        assert!(slo.met(50.0, None), "one token: no TPOT to judge");
        assert!(!slo.met(100.1, None));
        assert!(!slo.met(50.0, Some(10.5)));
        assert!(slo.attained(0.5) && !slo.attained(0.49));
        assert!(Slo::default().validate().is_ok());
        let bad = |s: Slo| s.validate().unwrap_err().to_string();
        assert!(
            bad(Slo {
                tpot_ms: 0.0,
                ..slo
            })
            .contains("--slo-tpot-ms")
        );
        assert!(
            bad(Slo {
                ttft_ms: f64::NAN,
                ..slo
            })
            .contains("--slo-ttft-ms")
        );
        assert!(
            bad(Slo {
                attainment: 1.5,
                ..slo
            })
            .contains("--slo-attainment")
        );
    }
}
