//! Random draws of a synthetic workload: lengths, and arrival times (Poisson, gamma, constant
//! gaps). Every draw comes from the caller's [`Rng`], in a fixed order, so a seed fixes the
//! workload.

use tandem_protocol::Rng;

use crate::config::{ArrivalProcess, LengthDist};

/// A length drawn from `d` (no draw when it is fixed).
pub(crate) fn draw(d: LengthDist, rng: &mut Rng) -> u32 {
    if d.spread == 0.0 {
        return d.mean;
    }
    let m = f64::from(d.mean);
    let x = m * (1.0 - d.spread) + rng.unit_f64() * 2.0 * d.spread * m;
    (x.round() as u32).max(1)
}

/// The arrival process, in µs from the first arrival.
pub(crate) struct Arrivals {
    process: ArrivalProcess,
    rate: f64,
    t: f64,
}

impl Arrivals {
    pub(crate) fn new(process: ArrivalProcess, rate: f64) -> Self {
        Arrivals {
            process,
            rate,
            t: 0.0,
        }
    }

    /// The next arrival, µs (the first at 0).
    pub(crate) fn next(&mut self, rng: &mut Rng) -> u64 {
        let at = self.t;
        let mean_gap = 1e6 / self.rate;
        self.t += match self.process {
            ArrivalProcess::Constant => mean_gap,
            ArrivalProcess::Poisson => -(1.0 - rng.unit_f64()).ln() * mean_gap,
            ArrivalProcess::Gamma { shape } => gamma(shape, rng) / shape * mean_gap,
        };
        at.round() as u64
    }
}

/// A Gamma(shape, 1) draw (Marsaglia–Tsang; shapes below 1 boosted by `U^(1/shape)`).
fn gamma(shape: f64, rng: &mut Rng) -> f64 {
    if shape < 1.0 {
        let u = 1.0 - rng.unit_f64();
        return gamma(shape + 1.0, rng) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = 1.0 - rng.unit_f64();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut Rng) -> f64 {
    let u1 = 1.0 - rng.unit_f64();
    let u2 = rng.unit_f64();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}
