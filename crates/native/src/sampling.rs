//! Choosing the next token from a row's logits: greedy, or a seeded draw after temperature,
//! top-k, top-p and min-p, as vLLM and llama.cpp apply them.
//!
//! The draw for position `p` of a request is a function of the request's seed and `p` alone,
//! so any worker that holds the same logits — after a migration, a remote prefill, a replay —
//! draws the same token.

use tandem_engine::{SamplingParams, TokenLogprobs};
use xxhash_rust::xxh3::xxh3_64;

/// Reused buffers.
#[derive(Debug, Default)]
pub struct Sampler {
    candidates: Vec<(u32, f32)>,
}

/// The token chosen and, when asked, log-probabilities under the model's raw distribution.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub token: u32,
    /// When `params.logprobs` asked for them: the chosen token's and the most likely
    /// tokens'. Not asked, they cost nothing (a normalizer is an exp per vocabulary entry:
    /// a tenth of a small model's decode step).
    pub logprobs: Option<Box<TokenLogprobs>>,
}

impl Sampler {
    /// The token at position `pos` of a request with `params` and `seed`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        seed: u64,
        pos: u64,
    ) -> Choice {
        let token = if params.temperature <= 0.0 {
            argmax(logits)
        } else {
            self.draw(logits, params, uniform(seed, pos))
        };
        let logprobs = params.logprobs.map(|n| {
            let norm = log_normalizer(logits);
            Box::new(TokenLogprobs {
                logprob: (f64::from(logits[token as usize]) - norm) as f32,
                top: top_n(logits, usize::from(n))
                    .into_iter()
                    .map(|(t, l)| (t, (f64::from(l) - norm) as f32))
                    .collect(),
            })
        });
        Choice { token, logprobs }
    }

    fn draw(&mut self, logits: &[f32], p: &SamplingParams, u: f64) -> u32 {
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, ((l - max) * inv_t).exp())),
        );
        // Most likely first, ties by token id: one total order, so the same logits always
        // give the same candidate list.
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = if p.top_k > 0 {
            (p.top_k as usize).min(self.candidates.len())
        } else {
            self.candidates.len()
        };
        if k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(k - 1, by_prob);
            self.candidates.truncate(k);
        }
        self.candidates.sort_unstable_by(by_prob);
        let total: f64 = self.candidates.iter().map(|c| f64::from(c.1)).sum();
        // min-p: drop what is less likely than `min_p` times the most likely.
        if p.min_p > 0.0 {
            let floor = self.candidates[0].1 * p.min_p;
            let keep = self.candidates.iter().take_while(|c| c.1 >= floor).count();
            self.candidates.truncate(keep.max(1));
        }
        // top-p: the smallest prefix whose mass reaches `top_p` of the whole.
        if p.top_p < 1.0 {
            let target = f64::from(p.top_p) * total;
            let mut acc = 0.0;
            let mut keep = self.candidates.len();
            for (i, c) in self.candidates.iter().enumerate() {
                acc += f64::from(c.1);
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            self.candidates.truncate(keep.max(1));
        }
        let kept: f64 = self.candidates.iter().map(|c| f64::from(c.1)).sum();
        let mut acc = 0.0;
        let target = u * kept;
        for c in &self.candidates {
            acc += f64::from(c.1);
            if target < acc {
                return c.0;
            }
        }
        self.candidates.last().map_or(0, |c| c.0)
    }
}

/// The highest logit's token, the lowest id among equals.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `log softmax(logits)[i]`, summed in index order.
pub fn log_softmax_at(logits: &[f32], i: usize) -> f32 {
    (f64::from(logits[i]) - log_normalizer(logits)) as f32
}

/// `log Σ exp(logits)`, in f64, summed in index order: `logit - this` is a log-probability.
fn log_normalizer(logits: &[f32]) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| f64::from(v - max).exp()).sum();
    f64::from(max) + sum.ln()
}

/// The `n` highest logits with their tokens, highest first, ties by lower id (one pass; `n`
/// is small: OpenAI allows at most 20).
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &v) in logits.iter().enumerate() {
        if top.len() == n && top.last().is_some_and(|&(_, low)| v <= low) {
            continue;
        }
        // After every equal one: ids ascend within a tie.
        let at = top.partition_point(|&(_, l)| l >= v);
        top.insert(at, (i as u32, v));
        top.truncate(n);
    }
    top
}

/// A uniform draw in `[0, 1)` for (seed, position).
fn uniform(seed: u64, pos: u64) -> f64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&seed.to_le_bytes());
    buf[8..].copy_from_slice(&pos.to_le_bytes());
    (xxh3_64(&buf) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::default();
        let asked = SamplingParams {
            logprobs: Some(0),
            ..params(0.0)
        };
        let c = s.sample(&[0.5, 2.0, 2.0, -1.0], &asked, 1, 0);
        assert_eq!(c.token, 1);
        let p: f32 = [0.5f32, 2.0, 2.0, -1.0]
            .iter()
            .map(|v| (v - 2.0).exp())
            .sum();
        assert!((c.logprobs.expect("asked").logprob - (-p.ln())).abs() < 1e-6);
    }

    #[test]
    fn a_draw_is_a_function_of_seed_and_position() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut s = Sampler::default();
        let draws = |s: &mut Sampler, seed| -> Vec<u32> {
            (0..40)
                .map(|p| s.sample(&logits, &params(0.8), seed, p).token)
                .collect()
        };
        let a = draws(&mut s, 42);
        assert_eq!(a, draws(&mut s, 42), "same seed, same draws");
        assert_ne!(a, draws(&mut s, 43), "another seed, other draws");
        assert!(
            a.iter().any(|&t| t != a[0]),
            "a temperature draw varies: {a:?}"
        );
    }

    #[test]
    fn top_k_top_p_and_min_p_keep_only_the_likely() {
        // Probabilities ∝ e^l: token 3 ≫ token 1 > the rest.
        let logits = [0.0f32, 3.0, 0.0, 6.0, 0.0];
        let mut s = Sampler::default();
        let seen = |s: &mut Sampler, p: SamplingParams| -> std::collections::BTreeSet<u32> {
            // Tokens 0, 2 and 4 come up once in ~430 draws each.
            (0..4000)
                .map(|pos| s.sample(&logits, &p, 9, pos).token)
                .collect()
        };
        let all = seen(&mut s, params(1.0));
        assert_eq!(all.len(), 5, "{all:?}");
        let k1 = SamplingParams {
            top_k: 1,
            ..params(1.0)
        };
        assert_eq!(seen(&mut s, k1), [3].into());
        let k2 = SamplingParams {
            top_k: 2,
            ..params(1.0)
        };
        assert_eq!(seen(&mut s, k2), [1, 3].into());
        // Token 3 alone holds ~0.94 of the mass.
        let p9 = SamplingParams {
            top_p: 0.9,
            ..params(1.0)
        };
        assert_eq!(seen(&mut s, p9), [3].into());
        let p99 = SamplingParams {
            top_p: 0.99,
            ..params(1.0)
        };
        assert_eq!(seen(&mut s, p99), [1, 3].into());
        // e^3 / e^6 ≈ 0.05: min_p 0.01 keeps token 1, 0.1 does not.
        let m = SamplingParams {
            min_p: 0.01,
            ..params(1.0)
        };
        assert_eq!(seen(&mut s, m), [1, 3].into());
        let m = SamplingParams {
            min_p: 0.1,
            ..params(1.0)
        };
        assert_eq!(seen(&mut s, m), [3].into());
    }

    #[test]
    fn logprobs_are_the_raw_distribution_and_its_top_tokens() {
        let logits = [0.5f32, 2.0, 2.0, -1.0, 1.0];
        let mut s = Sampler::default();
        let asked = SamplingParams {
            logprobs: Some(3),
            ..params(0.7)
        };
        let c = s.sample(&logits, &asked, 4, 9);
        let lp = c.logprobs.clone().expect("asked for");
        assert_eq!(lp.logprob, log_softmax_at(&logits, c.token as usize));
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 4], "most likely first, ties by id");
        for &(t, l) in &lp.top {
            assert!((l - log_softmax_at(&logits, t as usize)).abs() < 1e-6);
        }
        // The same draw with or without logprobs; none when not asked; all of them at most.
        assert_eq!(s.sample(&logits, &params(0.7), 4, 9).token, c.token);
        assert_eq!(s.sample(&logits, &params(0.7), 4, 9).logprobs, None);
        let all = SamplingParams {
            logprobs: Some(20),
            ..params(0.0)
        };
        let lp = s.sample(&logits, &all, 4, 9).logprobs.expect("asked for");
        assert_eq!(lp.top.len(), logits.len());
        let mass: f64 = lp.top.iter().map(|&(_, l)| f64::from(l).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-6, "{mass}");
        let none = SamplingParams {
            logprobs: Some(0),
            ..params(0.0)
        };
        assert!(
            s.sample(&logits, &none, 4, 9)
                .logprobs
                .unwrap()
                .top
                .is_empty()
        );
    }

    #[test]
    fn a_low_temperature_concentrates_and_a_high_one_spreads() {
        let logits = [1.0f32, 1.5, 0.5];
        let mut s = Sampler::default();
        let share = |s: &mut Sampler, t: f32| {
            (0..2000)
                .filter(|&pos| s.sample(&logits, &params(t), 5, pos).token == 1)
                .count()
        };
        let (cold, hot) = (share(&mut s, 0.1), share(&mut s, 5.0));
        assert!(cold > 1900, "{cold}");
        assert!(hot < 1000, "{hot}");
    }
}
