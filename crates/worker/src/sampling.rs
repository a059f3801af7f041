//! The sampling parameters of a request as the engine takes them, from the wire's fields
//! (the frontend validated them; a worker checks again, as every input it takes), and a
//! token's log-probabilities between the engine's form and the wire's.

use tandem_engine::{SamplingParams, TokenLogprobs};
use tandem_protocol::grpc;

use crate::error::WorkerError;

/// Most alternatives a token's logprobs may list (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The sampling fields of a `Sampling` message or a `PrefillRequest`, as sent.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WireSampling {
    /// 0: greedy.
    pub temperature: f32,
    /// Absent: 1.
    pub top_p: Option<f32>,
    /// Absent or 0: all tokens.
    pub top_k: Option<u32>,
    /// Absent or 0: no floor.
    pub min_p: Option<f32>,
    /// Absent: no logprobs.
    pub logprobs: Option<u32>,
    /// Return the prompt's embedding (never asked of a prefill worker).
    pub embed: bool,
}

impl From<&grpc::Sampling> for WireSampling {
    fn from(s: &grpc::Sampling) -> Self {
        WireSampling {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            logprobs: s.logprobs,
            embed: s.embed,
        }
    }
}

impl From<&grpc::PrefillRequest> for WireSampling {
    fn from(r: &grpc::PrefillRequest) -> Self {
        WireSampling {
            temperature: r.temperature,
            top_p: r.top_p,
            top_k: r.top_k,
            min_p: r.min_p,
            logprobs: r.logprobs,
            embed: false,
        }
    }
}

impl WireSampling {
    /// The engine's parameters on the wire (what a decode worker sends its prefill worker):
    /// defaults are left out, so an engine's own defaults apply.
    pub fn of(p: &SamplingParams) -> Self {
        WireSampling {
            temperature: p.temperature,
            top_p: (p.top_p < 1.0).then_some(p.top_p),
            top_k: (p.top_k > 0).then_some(p.top_k),
            min_p: (p.min_p > 0.0).then_some(p.min_p),
            logprobs: p.logprobs.map(u32::from),
            embed: p.embed,
        }
    }
}

/// The wire's sampling fields as engine parameters; a negative or non-finite temperature, a
/// `top_p` outside (0, 1], a `min_p` outside [0, 1] or more than [`MAX_TOP_LOGPROBS`]
/// logprobs is an invalid request.
pub fn sampling_params(w: WireSampling) -> Result<SamplingParams, WorkerError> {
    let invalid = |m: String| Err(WorkerError::InvalidRequest(m));
    let temperature = w.temperature;
    if !(temperature.is_finite() && temperature >= 0.0) {
        return invalid(format!(
            "temperature must be a finite number >= 0, got {temperature}"
        ));
    }
    let top_p = w.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return invalid(format!("top_p must be in (0, 1], got {top_p}"));
    }
    let min_p = w.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return invalid(format!("min_p must be in [0, 1], got {min_p}"));
    }
    let logprobs = match w.logprobs {
        None => None,
        Some(n) if n <= MAX_TOP_LOGPROBS => Some(n as u8),
        Some(n) => {
            return invalid(format!("at most {MAX_TOP_LOGPROBS} top logprobs, got {n}"));
        }
    };
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k: w.top_k.unwrap_or(0),
        min_p,
        logprobs,
        embed: w.embed,
    })
}

/// A token's logprobs on the wire.
pub fn logprobs_to_wire(l: &TokenLogprobs) -> grpc::TokenLogprobs {
    grpc::TokenLogprobs {
        logprob: l.logprob,
        top_tokens: l.top.iter().map(|t| t.0).collect(),
        top_logprobs: l.top.iter().map(|t| t.1).collect(),
    }
}

/// A token's logprobs off the wire; lists of different lengths, or longer than
/// [`MAX_TOP_LOGPROBS`], are a peer's error.
pub fn logprobs_from_wire(l: &grpc::TokenLogprobs) -> Result<Box<TokenLogprobs>, WorkerError> {
    let malformed = || {
        WorkerError::BadTransfer(format!(
            "malformed logprobs: {} top tokens, {} top logprobs",
            l.top_tokens.len(),
            l.top_logprobs.len()
        ))
    };
    let top = l
        .top_pairs()
        .filter(|t| t.len() <= MAX_TOP_LOGPROBS as usize)
        .ok_or_else(malformed)?;
    Ok(Box::new(TokenLogprobs {
        logprob: l.logprob,
        top,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(temperature: f32, top_p: Option<f32>) -> WireSampling {
        WireSampling {
            temperature,
            top_p,
            ..WireSampling::default()
        }
    }

    #[test]
    fn wire_values_become_engine_parameters_or_typed_errors() {
        let w = WireSampling {
            temperature: 0.8,
            top_p: Some(0.9),
            top_k: Some(40),
            min_p: Some(0.05),
            logprobs: Some(5),
            embed: true,
        };
        let p = sampling_params(w).unwrap();
        assert_eq!(
            (
                p.temperature,
                p.top_p,
                p.top_k,
                p.min_p,
                p.logprobs,
                p.embed
            ),
            (0.8, 0.9, 40, 0.05, Some(5), true)
        );
        assert_eq!(WireSampling::of(&p), w, "and back onto the wire");
        assert_eq!(
            sampling_params(wire(0.0, None)).unwrap(),
            SamplingParams::GREEDY
        );
        assert_eq!(
            WireSampling::of(&SamplingParams::GREEDY),
            WireSampling::default()
        );
        let bad = [
            wire(-1.0, None),
            wire(f32::NAN, None),
            wire(1.0, Some(0.0)),
            wire(1.0, Some(1.5)),
            WireSampling {
                min_p: Some(1.5),
                ..wire(1.0, None)
            },
            WireSampling {
                logprobs: Some(21),
                ..wire(1.0, None)
            },
        ];
        for w in bad {
            assert!(
                matches!(sampling_params(w), Err(WorkerError::InvalidRequest(_))),
                "{w:?}"
            );
        }
    }

    #[test]
    fn logprobs_cross_the_wire_unchanged_and_malformed_ones_are_refused() {
        let l = TokenLogprobs {
            logprob: -0.25,
            top: vec![(7, -0.25), (3, -1.5)],
        };
        assert_eq!(*logprobs_from_wire(&logprobs_to_wire(&l)).unwrap(), l);
        let mut bad = logprobs_to_wire(&l);
        bad.top_logprobs.pop();
        assert!(logprobs_from_wire(&bad).is_err());
    }
}
