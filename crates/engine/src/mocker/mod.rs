//! The mocker: a model that simulates a GPU without one.
//!
//! - **Timing** ([`TimingModel`]): a step costs a prefill part, quadratic in the step's new
//!   prefill tokens, plus a decode part, quadratic in the KV usage, divided by a speedup ratio.
//! - **KV bytes** ([`kv`]): every computed token gets deterministic bytes in its block of the
//!   device arena, a function of the token's prefix hash, its position and the layer. Equal
//!   prefixes give equal bytes, so prefix-cache hits and KV transfers are checkable. With a
//!   zero-byte shape ([`KvShape::TIMING_ONLY`]) nothing is written.
//! - **Tokens**: each sequence keeps a digest of its KV *as read back from the arena*, one
//!   complete block at a time, in block order; the next token is a function of that digest,
//!   the partial last block, the sampling seed and the sequence length. Any corruption of KV
//!   bytes, local or transferred, changes the tokens that follow. A remotely prefilled
//!   sequence folds the received blocks at its first decode step, so it continues the token
//!   chain exactly as a locally prefilled one (`remote_tests.rs`). Bytes are read once per
//!   write: a block's hash is remembered until the block is written again or handed out
//!   anew ([`crate::KvArena::read_back_hash`]), and a decode step reads only the partial
//!   block's newest token.
//!
//! [`Mocker`] is this model behind [`crate::Model`]; [`crate::MockEngine`] is the engine with
//! it, behind a two-call step (`begin_step` → duration, `finish_step` → tokens) that a
//! virtual-time simulator and an async worker can both drive.

pub mod kv;
mod model;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod remote_tests;
#[cfg(test)]
mod tests;

pub use model::{EMBEDDING_DIM, Mocker, embedding};

use crate::arena::KvShape;

/// Step-time polynomials, in milliseconds. Defaults fitted to a mid-size model on one GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimingModel {
    /// `prefill_ms(t) = a·t² + b·t + c` for `t > 0` new prefill tokens, 0 for none.
    pub prefill_a: f64,
    pub prefill_b: f64,
    pub prefill_c: f64,
    /// `decode_ms(p) = max(floor, a·p² + b·p + c)` with `p` the KV usage in `[0, 1]`, when at
    /// least one request decodes.
    pub decode_a: f64,
    pub decode_b: f64,
    pub decode_c: f64,
    pub decode_floor: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        TimingModel {
            prefill_a: 4.209989e-7,
            prefill_b: 1.518344e-2,
            prefill_c: 16.50142,
            decode_a: -25.74,
            decode_b: 54.01,
            decode_c: 5.74,
            decode_floor: 1.0,
        }
    }
}

impl TimingModel {
    /// Prefill part of a step computing `tokens` new prefill tokens.
    pub fn prefill_ms(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        self.prefill_a * t * t + self.prefill_b * t + self.prefill_c
    }

    /// Decode part of a step at KV usage `p` (active KV tokens / KV capacity in tokens).
    pub fn decode_ms(&self, p: f64) -> f64 {
        (self.decode_a * p * p + self.decode_b * p + self.decode_c).max(self.decode_floor)
    }

    /// A whole step: both parts when the step mixes prefill and decode, over `speedup`.
    pub fn step_ms(
        &self,
        prefill_tokens: usize,
        decodes: bool,
        kv_usage: f64,
        speedup: f64,
    ) -> f64 {
        let decode = if decodes {
            self.decode_ms(kv_usage)
        } else {
            0.0
        };
        (self.prefill_ms(prefill_tokens) + decode) / speedup
    }
}

/// The mocker model's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MockerConfig {
    pub timing: TimingModel,
    /// Divides every step time (default 1.0): > 1 simulates a faster GPU.
    pub speedup_ratio: f64,
    /// Tokens are drawn from `0 .. vocab_size` (default 32000).
    pub vocab_size: u32,
    /// KV bytes per token; [`KvShape::TIMING_ONLY`] for no bytes at all.
    pub kv_shape: KvShape,
    /// Time a step spends loading each LoRA adapter it needs and did not hold (default 20 ms:
    /// a rank-16 adapter of a mid-size model copied from host memory), not divided by the
    /// speedup. Only with [`crate::scheduler::SchedulerConfig::max_loras`] set.
    pub adapter_load_ms: f64,
}

impl Default for MockerConfig {
    fn default() -> Self {
        MockerConfig {
            timing: TimingModel::default(),
            speedup_ratio: 1.0,
            vocab_size: 32000,
            kv_shape: KvShape::MOCKER_DEFAULT,
            adapter_load_ms: 20.0,
        }
    }
}
