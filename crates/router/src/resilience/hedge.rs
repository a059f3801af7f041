//! [`TtftHistory`]: recent times to first token by prompt size, for hedging (docs/ARCHITECTURE.md §10):
//! a request with no first token after the p95 of requests of its size is started on a second
//! worker. Sans-IO: the caller passes the numbers.

use std::collections::VecDeque;

/// Samples kept per size class.
const SAMPLES: usize = 256;

/// Prompt-size classes: powers of two of tokens, up to 2^20 and beyond.
const CLASSES: usize = 21;

/// Recent TTFTs per prompt-size class (powers of two of prompt tokens).
#[derive(Clone, Debug)]
pub struct TtftHistory {
    classes: Vec<VecDeque<u32>>,
    /// Samples a class needs before it answers.
    min_samples: usize,
}

impl TtftHistory {
    pub fn new(min_samples: usize) -> Self {
        TtftHistory {
            classes: vec![VecDeque::new(); CLASSES],
            min_samples: min_samples.clamp(1, SAMPLES),
        }
    }

    fn class(prompt_tokens: u64) -> usize {
        (64 - prompt_tokens.max(1).leading_zeros() as usize - 1).min(CLASSES - 1)
    }

    /// A request of `prompt_tokens` got its first token after `ttft_ms`.
    pub fn record(&mut self, prompt_tokens: u64, ttft_ms: u64) {
        let c = &mut self.classes[Self::class(prompt_tokens)];
        if c.len() == SAMPLES {
            c.pop_front();
        }
        c.push_back(u32::try_from(ttft_ms).unwrap_or(u32::MAX));
    }

    /// The `q` quantile (0..=1) of recent TTFTs of requests the size of `prompt_tokens`; None
    /// until the class has enough samples.
    pub fn quantile_ms(&self, prompt_tokens: u64, q: f64) -> Option<u64> {
        let c = &self.classes[Self::class(prompt_tokens)];
        if c.len() < self.min_samples {
            return None;
        }
        let mut v: Vec<u32> = c.iter().copied().collect();
        v.sort_unstable();
        let i = ((q.clamp(0.0, 1.0) * (v.len() - 1) as f64).round() as usize).min(v.len() - 1);
        Some(u64::from(v[i]))
    }
}
