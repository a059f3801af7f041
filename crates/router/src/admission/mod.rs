//! Admission: what waits and what is refused before a request is routed. The frontend's flow
//! gate holds requests in a [`FlowQueue`](flow::FlowQueue) (bounded, priority bands, tenant
//! fairness, per-tenant rate limits in `flow/buckets.rs`) while every decode worker is
//! saturated ([`SaturationConfig`](saturation::SaturationConfig)), and the replica routes a
//! queued request only to an unsaturated worker (`replica/admit.rs`). Sans-IO like the rest
//! of the crate: the frontend owns the waiting, this module the decisions.

pub mod flow;
pub mod saturation;
