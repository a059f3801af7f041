//! External engines behind a worker (vLLM, SGLang, any OpenAI-compatible server with vLLM's
//! token-id extension): their HTTP API ([`engine`]), their Prometheus text ([`prom`]), their
//! ZMQ KV events relayed as tandem's ([`events`]), and the sidecar worker that puts them
//! together ([`sidecar`]), served through the same lifecycle and gRPC service as tandem's own
//! engines (`tandem_worker::served`).

pub mod engine;
pub mod events;
pub mod prom;
pub mod sidecar;

pub use engine::{EngineApi, EngineError, EngineKind};
pub use sidecar::{Sidecar, SidecarConfig, SidecarStats};
