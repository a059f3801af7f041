//! tandem's frontend (docs/ARCHITECTURE.md §1, §9, §10): the async shell around the routing core.
//!
//! - [`http`]: the OpenAI-compatible HTTP edge — validation into a [`http::ValidRequest`],
//!   the chat template and tokenizer, responses and SSE streams, one place for error
//!   statuses, `/health`, `/metrics` — over the [`http::Backend`] trait.
//! - [`cluster`]: the backend over a live cluster. [`cluster::ClusterView`] feeds a
//!   [`tandem_router::RoutingReplica`] from discovery and the event plane and performs the
//!   index repairs it asks for; [`cluster::ClusterBackend`] turns the replica's plans into
//!   gRPC calls to decode workers, with re-routing before the first token, migration after it,
//!   streaming, and replica sync with peer frontends. [`cluster::run_frontend`] and
//!   [`cluster::run_indexer`] are the services (`tandem frontend`, `tandem indexer`).
//!
//! - [`epp`]: the same routing as a Gateway API Inference Extension endpoint picker (Envoy
//!   ext_proc), [`epp::run_epp`] (`tandem epp`).
//!
//! What stays here is what needs I/O; what decides lives in `tandem-router`, so that
//! `tandem sim` runs the same decisions in virtual time.

pub mod cluster;
pub mod epp;
pub mod http;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;

pub use cluster::{
    BackendConfig, ClusterBackend, ClusterDeps, ClusterView, FrontendConfig, ServiceError,
    ViewConfig, run_frontend, run_indexer,
};
