//! Next-interval load: Holt's linear trend (double exponential smoothing), stepped once per
//! interval, so that it is deterministic and needs no clock. `smoothing` (α) weighs the new
//! observation against the level, `trend` (β) the new slope against the old one; β = 0 is an
//! EWMA and α = 1, β = 0 the "constant" predictor (next = last).
//!
//! Request rate gets the trend; ISL, OSL and the hit rate are smoothed only (they are
//! properties of the traffic mix, not things that ramp). The pools' predicted loads are built
//! from them as Dynamo's planner builds its: prefill = rate × ISL × (1 − hit rate) prompt
//! tokens computed per second, decode = rate × OSL tokens generated per second.

use serde::Serialize;

use crate::observe::Observation;

/// Holt's linear trend.
#[derive(Clone, Debug)]
pub struct Holt {
    smoothing: f64,
    trend_weight: f64,
    level: Option<f64>,
    trend: f64,
}

impl Holt {
    pub fn new(smoothing: f64, trend: f64) -> Self {
        Holt {
            smoothing: smoothing.clamp(0.0, 1.0),
            trend_weight: trend.clamp(0.0, 1.0),
            level: None,
            trend: 0.0,
        }
    }

    pub fn update(&mut self, x: f64) {
        match self.level {
            None => self.level = Some(x),
            Some(level) => {
                let (a, b) = (self.smoothing, self.trend_weight);
                let next = a * x + (1.0 - a) * (level + self.trend);
                self.trend = b * (next - level) + (1.0 - b) * self.trend;
                self.level = Some(next);
            }
        }
    }

    /// The forecast one interval ahead (never below 0); None before the first update.
    pub fn forecast(&self) -> Option<f64> {
        self.level.map(|l| (l + self.trend).max(0.0))
    }
}

/// The forecast of the traffic.
#[derive(Clone, Debug)]
pub struct Forecaster {
    rate: Holt,
    isl: Holt,
    osl: Holt,
    hit: Holt,
}

/// What the next interval should bring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Forecast {
    pub rate: f64,
    pub isl: f64,
    pub osl: f64,
    pub hit_rate: f64,
    pub prefill_load: f64,
    pub decode_load: f64,
}

impl Forecaster {
    pub fn new(smoothing: f64, trend: f64) -> Self {
        Forecaster {
            rate: Holt::new(smoothing, trend),
            isl: Holt::new(smoothing, 0.0),
            osl: Holt::new(smoothing, 0.0),
            hit: Holt::new(smoothing, 0.0),
        }
    }

    /// Feeds one interval; a mix (ISL, OSL, hit rate) is only learnt from intervals that
    /// finished requests.
    pub fn update(&mut self, o: &Observation) -> Forecast {
        self.rate.update(o.rate);
        if let Some(v) = o.isl {
            self.isl.update(v);
        }
        if let Some(v) = o.osl {
            self.osl.update(v);
        }
        if let Some(v) = o.hit_rate {
            self.hit.update(v);
        }
        let rate = self.rate.forecast().unwrap_or(0.0);
        let isl = self.isl.forecast().unwrap_or(0.0);
        let osl = self.osl.forecast().unwrap_or(0.0);
        let hit_rate = self.hit.forecast().unwrap_or(0.0).min(1.0);
        Forecast {
            rate,
            isl,
            osl,
            hit_rate,
            prefill_load: rate * isl * (1.0 - hit_rate),
            decode_load: rate * osl,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holt_follows_a_ramp_by_hand() {
        // α = 0.5, β = 0.5 on 10, 20, 30:
        // l1 = 10, b = 0; l2 = 0.5·20 + 0.5·10 = 15, b = 0.5·5 = 2.5;
        // l3 = 0.5·30 + 0.5·(15 + 2.5) = 23.75, b = 0.5·8.75 + 0.5·2.5 = 5.625;
        // forecast 29.375.
        let mut h = Holt::new(0.5, 0.5);
        assert_eq!(h.forecast(), None);
        for x in [10.0, 20.0, 30.0] {
            h.update(x);
        }
        assert!((h.forecast().unwrap() - 29.375).abs() < 1e-12);
        // The constant predictor is the last value.
        let mut c = Holt::new(1.0, 0.0);
        c.update(3.0);
        c.update(7.0);
        assert_eq!(c.forecast(), Some(7.0));
        // A falling trend never forecasts below zero.
        let mut d = Holt::new(1.0, 1.0);
        d.update(10.0);
        d.update(1.0);
        assert_eq!(d.forecast(), Some(0.0));
    }

    #[test]
    fn pool_loads_from_rate_isl_osl_and_hits() {
        let mut f = Forecaster::new(1.0, 0.0);
        let o = Observation {
            rate: 4.0,
            isl: Some(500.0),
            osl: Some(50.0),
            hit_rate: Some(0.25),
            ..Observation::default()
        };
        let p = f.update(&o);
        assert_eq!(p.prefill_load, 4.0 * 500.0 * 0.75);
        assert_eq!(p.decode_load, 200.0);
        // An idle interval keeps the mix and forecasts no load.
        let idle = Observation::default();
        let p = f.update(&idle);
        assert_eq!((p.rate, p.isl, p.osl), (0.0, 500.0, 50.0));
        assert_eq!(p.prefill_load, 0.0);
    }
}
