//! [`Model`]: what computes a scheduler step. The mocker is one model (a timing polynomial and
//! derived KV bytes and tokens); the native engine's transformer is another. Pool, scheduler,
//! prefix cache, export, remote prefill and KV events live in [`crate::Engine`], shared by all.

use tandem_protocol::RequestId;

use crate::arena::KvShape;
use crate::scheduler::{ModelView, SampledToken, StepPlan};

/// Computes the scheduler's in-flight step.
///
/// [`crate::Engine`] plans a step, asks the model how long it takes
/// ([`step_duration_ms`](Model::step_duration_ms)), has it compute the step
/// ([`compute`](Model::compute)), then completes the step with the sampled tokens. A model may
/// keep state per request (the mocker's digests, a real model's nothing beyond the arena);
/// [`forget`](Model::forget) says when a request's state is void.
pub trait Model: std::fmt::Debug + Send {
    /// Bytes of KV per token and layer, which size the arena's blocks.
    fn kv_shape(&self) -> KvShape;

    /// How long `plan` takes, in milliseconds, for a model that times its steps (the mocker's
    /// polynomial); 0 for a model whose steps take the time their compute takes.
    /// `kv_capacity_tokens` is the device arena's size in tokens.
    fn step_duration_ms(&self, plan: &StepPlan, kv_capacity_tokens: usize) -> f64;

    /// Computes the in-flight step: for every entry of `view.plan`, the K/V of its new tokens
    /// into the arena through its block table, and for every entry that samples, one token
    /// pushed to `sampled`, in plan order.
    fn compute(&mut self, view: ModelView<'_>, sampled: &mut Vec<SampledToken>);

    /// Request `id`'s KV state is void: it finished, was aborted, or its KV is about to be
    /// written by a remote prefill.
    fn forget(&mut self, id: RequestId);
}

/// A model chosen at run time (the worker hosts whichever its flags name).
impl Model for Box<dyn Model> {
    fn kv_shape(&self) -> KvShape {
        (**self).kv_shape()
    }

    fn step_duration_ms(&self, plan: &StepPlan, kv_capacity_tokens: usize) -> f64 {
        (**self).step_duration_ms(plan, kv_capacity_tokens)
    }

    fn compute(&mut self, view: ModelView<'_>, sampled: &mut Vec<SampledToken>) {
        (**self).compute(view, sampled)
    }

    fn forget(&mut self, id: RequestId) {
        (**self).forget(id)
    }
}

/// Scales `v` to length 1, as embeddings are returned (a zero vector stays zero).
pub fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        for x in v {
            *x = (f64::from(*x) / norm) as f32;
        }
    }
}
