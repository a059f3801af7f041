//! The rates of a sweep, as `--sweep-rate` writes them: `a,b,c`, or `start:end:step`
//! (inclusive, at most 1,000 steps). Rates are requests per second (synthetic workloads) or
//! arrival speedups (traces); each must be a positive finite number.

use crate::error::WorkloadError;

/// Parses a sweep's rates (see the module docs).
pub fn parse_rates(s: &str) -> Result<Vec<f64>, WorkloadError> {
    let bad = |what: String| WorkloadError::InvalidConfig(format!("--sweep-rate: {what}"));
    let num = |x: &str| -> Result<f64, WorkloadError> {
        let v: f64 = x
            .trim()
            .parse()
            .map_err(|_| bad(format!("{x:?} is no number")))?;
        if !(v.is_finite() && v > 0.0) {
            return Err(bad(format!("rates must be positive, got {v}")));
        }
        Ok(v)
    };
    let parts: Vec<&str> = s.split(':').collect();
    if let [a, b, step] = parts[..] {
        let (a, b, step) = (num(a)?, num(b)?, num(step)?);
        if b < a || (b - a) / step > 1000.0 {
            return Err(bad(
                "start:end:step needs start ≤ end and at most 1000 steps".into(),
            ));
        }
        let n = ((b - a) / step + 1e-9).floor() as usize;
        return Ok((0..=n).map(|k| a + step * k as f64).collect());
    }
    if parts.len() != 1 {
        return Err(bad("is `a,b,c` or `start:end:step`".into()));
    }
    s.split(',').map(num).collect()
}

#[cfg(test)]
mod tests {
    use super::parse_rates;

    #[test]
    fn rates_parse_as_lists_and_ranges() {
        assert_eq!(parse_rates("1,2.5,4").unwrap(), [1.0, 2.5, 4.0]);
        assert_eq!(parse_rates("2:4:1").unwrap(), [2.0, 3.0, 4.0]);
        assert_eq!(parse_rates("0.5:0.7:0.1").unwrap().len(), 3);
        for bad in ["1,-2", "4:2:1", "1:2", "1,x", "0", "1:1000000:0.5"] {
            let e = parse_rates(bad).unwrap_err();
            assert!(e.to_string().starts_with("--sweep-rate"), "{bad}: {e}");
        }
    }
}
