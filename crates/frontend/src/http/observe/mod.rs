//! What the edge shows its operator: Prometheus metrics (`metrics.rs`), recent latency
//! (`recent.rs`), the status page and its data (`status.rs`, `status.html`), spans (`trace.rs`).

pub(crate) mod metrics;
pub(crate) mod recent;
pub(crate) mod status;
pub(crate) mod trace;
