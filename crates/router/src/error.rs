//! Typed errors of the router core, each with the class that decides what the caller does.

use tandem_protocol::{RequestId, WorkerId};

pub use tandem_protocol::ErrorClass;

/// Why no decision could be made.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// The candidate list was empty. Class: unavailable.
    #[error("no workers to route to")]
    NoWorkers,
    /// Every worker of the pool is excluded (each already failed this request). Class:
    /// unavailable.
    #[error("every worker failed this request")]
    AllExcluded,
    /// A request id with the top bit set (reserved for the prefill half). Class: internal.
    #[error("request id {0} has its top bit set")]
    InvalidRequestId(RequestId),
    /// The same worker appeared twice among the candidates. Class: internal (the caller
    /// built the list wrong).
    #[error("worker {0} appears more than once among the candidates")]
    DuplicateWorker(WorkerId),
    /// A per-request override was negative, NaN or infinite. Class: invalid request.
    #[error("override {name} must be a finite number >= 0, got {value}")]
    InvalidOverride { name: &'static str, value: f64 },
    /// Every decode worker is saturated ([`crate::SaturationConfig`]): the request should
    /// wait for capacity. Class: overloaded.
    #[error("every decode worker is saturated")]
    Saturated,
    /// Every decode worker not excluded has an open circuit breaker (it failed recently).
    /// Class: unavailable.
    #[error("every decode worker's circuit breaker is open (they failed recently)")]
    CircuitOpen,
}

impl RouteError {
    pub fn class(&self) -> ErrorClass {
        match self {
            RouteError::NoWorkers | RouteError::AllExcluded | RouteError::CircuitOpen => {
                ErrorClass::Unavailable
            }
            RouteError::DuplicateWorker(_) | RouteError::InvalidRequestId(_) => {
                ErrorClass::Internal
            }
            RouteError::InvalidOverride { .. } => ErrorClass::InvalidRequest,
            RouteError::Saturated => ErrorClass::Overloaded,
        }
    }
}

/// A configuration the router refuses to start with. Class: invalid input, at startup.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown policy {got:?}; valid policies: {valid}")]
    UnknownPolicy { got: String, valid: &'static str },
    #[error("unknown disaggregation mode {got:?}; valid modes: {valid}")]
    UnknownDisaggMode { got: String, valid: &'static str },
    #[error("{name} must be {requirement}, got {value}")]
    OutOfRange {
        name: &'static str,
        requirement: &'static str,
        value: f64,
    },
}

/// Checks a finite number >= 0 (every weight, scale and temperature).
pub(crate) fn non_negative(name: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            name,
            requirement: "a finite number >= 0",
            value,
        })
    }
}
