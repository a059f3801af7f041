//! The sampling parameters of a request as the engine takes them, from the wire's fields
//! (the frontend validated them; a worker checks again, as every input it takes).

use tandem_engine::SamplingParams;

use crate::error::WorkerError;

/// `temperature` (0: greedy) and `top_p` (absent: 1) as engine parameters; a negative or
/// non-finite temperature, or a `top_p` outside (0, 1], is an invalid request.
pub fn sampling_params(
    temperature: f32,
    top_p: Option<f32>,
) -> Result<SamplingParams, WorkerError> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(WorkerError::InvalidRequest(format!(
            "temperature must be a finite number >= 0, got {temperature}"
        )));
    }
    let top_p = top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(WorkerError::InvalidRequest(format!(
            "top_p must be in (0, 1], got {top_p}"
        )));
    }
    Ok(SamplingParams {
        temperature,
        top_p,
        ..SamplingParams::GREEDY
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_values_become_engine_parameters_or_typed_errors() {
        let p = sampling_params(0.8, Some(0.9)).unwrap();
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p),
            (0.8, 0.9, 0, 0.0)
        );
        assert_eq!(sampling_params(0.0, None).unwrap(), SamplingParams::GREEDY);
        for (t, p) in [
            (-1.0, None),
            (f32::NAN, None),
            (1.0, Some(0.0)),
            (1.0, Some(1.5)),
        ] {
            assert!(matches!(
                sampling_params(t, p),
                Err(WorkerError::InvalidRequest(_))
            ));
        }
    }
}
