//! tandem-runtime: the distributed plumbing every tandem service stands on.
//!
//! **Job.** Discovery (who serves, where), the event plane (KV events, load reports, router
//! replica sync), gRPC plumbing for the request plane, the cancellation tree with graceful
//! drain, logging setup, and real etcd / nats-server processes for the local multi-process mode
//! and the integration tests. No business logic lives here: codecs and policies sit above.
//!
//! **Layout.**
//! - [`discovery`]: the [`Discovery`] trait; [`EtcdDiscovery`] (leased keys
//!   `/tandem/<ns>/workers/<role>/<id>`, JSON values; over our own small etcd v3 gRPC client,
//!   generated from proto/etcd/ without protoc) and [`MemoryDiscovery`].
//! - [`events`]: the [`EventPlane`] trait over bytes; [`NatsEventPlane`] (core pub/sub) and
//!   [`MemoryEventPlane`]; subject names in [`events::subjects`].
//! - [`shutdown`]: [`Shutdown`] (drain, then stop; the root of every service's cancellation
//!   tree), re-exported `CancellationToken` / `TaskTracker`, [`shutdown_on_signals`],
//!   [`shutdown::drain`].
//! - [`telemetry`]: [`telemetry::init`], idempotent.
//! - [`serving`]: [`serving::ServingThreads`], one single-threaded runtime per thread, for
//!   servers that keep each connection on one thread; [`serving::serving_index`].
//! - [`grpc`]: [`grpc::serve_tonic`] on a caller-bound listener, [`grpc::connect_channel`].
//! - [`external`]: [`EtcdServer`] and [`NatsServer`] child processes, and
//!   [`external::ProcessGroup`] for `tandem up --processes`' roles.
//! - [`error`]: [`RuntimeError`] and its [`ErrorClass`]; [`EtcdError`] for etcd failures.
//!
//! **Invariants.**
//! - Every transport has an in-memory twin with the same contract (docs/CONVENTIONS.md §6).
//! - Losing etcd or NATS is survived, not fatal: a registration re-establishes itself forever,
//!   a discovery watch re-lists and emits the difference (a removal is never missed), NATS
//!   subscriptions resume after a reconnect. Failures are logged at `warn`.
//! - Bounded everything: watch channels, event buffers, publish waits, reconnect backoff, and
//!   every etcd call runs under a timeout.
//! - The event plane is at most once; consumers detect gaps by event ids (docs/CONVENTIONS.md §7).
//! - No process started by [`external`] outlives its handle.
//! - Library code reads no environment variables, except `RUST_LOG` in [`telemetry`].

pub mod discovery;
pub mod error;
pub mod events;
pub mod external;
pub mod grpc;
pub mod serving;
pub mod shutdown;
pub mod telemetry;

pub use discovery::{
    Discovery, DiscoveryEvent, DiscoveryWatch, EtcdConfig, EtcdDiscovery, MemoryDiscovery,
    Registration, WorkerView,
};
pub use error::{ErrorClass, EtcdError, RuntimeError};
pub use events::{
    EventPlane, MemoryEventPlane, NatsAuth, NatsConfig, NatsEventPlane, Subscription, subjects,
};
pub use external::{EtcdOptions, EtcdServer, NatsOptions, NatsServer};
pub use shutdown::{CancellationToken, Shutdown, TaskTracker, shutdown_on_signals};
pub use telemetry::TelemetryConfig;
