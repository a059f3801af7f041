//! Where replica counts take effect: the [`Actuator`] trait and its two implementations,
//! [`local::Local`] (child processes on this machine) and [`kubernetes::Kubernetes`] (the
//! `scale` subresource of two Deployments).

pub mod kubernetes;
pub mod local;

use async_trait::async_trait;

use crate::Pool;
use crate::error::PlannerError;

/// Sets and reads the replica count of each pool.
#[async_trait]
pub trait Actuator: Send {
    /// The count the pool has now: the one last set, less workers that went away on their
    /// own (local mode), or the Deployment's `spec.replicas` (Kubernetes).
    async fn replicas(&mut self, pool: Pool) -> Result<u32, PlannerError>;
    /// Asks for `n` replicas. Taking workers away drains them; it need not wait for that.
    async fn set(&mut self, pool: Pool, n: u32) -> Result<(), PlannerError>;
    /// The planner stops: release what this actuator holds (local mode drains its workers;
    /// Kubernetes leaves the Deployments as they are).
    async fn shutdown(&mut self) -> Result<(), PlannerError>;
}
