//! The binary's flags, one file per concern, each a clap `Args` group the roles flatten in
//! and a `config()` into the library's configuration (and `to_args()` back, for `tandem up
//! --processes`): `listen` (--host/--port), `routing` (every knob of the routing core),
//! `flow` (admission), `engine` (the engine a worker runs), `kv_transport` (how KV moves), `semantic_cache` (the frontend's semantic cache),
//! `workload` (the traces and synthetic loads of `sim` and `bench`).

pub mod engine;
pub mod flow;
pub mod kv_transport;
pub mod listen;
pub mod routing;
pub mod semantic_cache;
pub mod workload;
