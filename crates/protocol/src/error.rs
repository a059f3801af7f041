//! [`ErrorClass`]: the one classification of errors every tandem crate uses (docs/CONVENTIONS.md §4).
//! Each crate's error type says which class each of its errors is in (`fn class(&self)`); the
//! class alone decides what a caller does — retry elsewhere, retry later, give up — and what a
//! client sees. With the `grpc` feature it also has the one mapping to and from gRPC status
//! codes, so that a worker and the frontend agree on the meaning of a status without either
//! encoding the other's codes by hand.

use std::fmt;

/// How a caller should treat an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The input is wrong (bad argument, bad config, impossible request); the same input fails
    /// everywhere: do not retry it unchanged. HTTP 4xx.
    InvalidRequest,
    /// A bound was hit (a full queue, no free KV blocks): retry later, or elsewhere. HTTP 429.
    Overloaded,
    /// A dependency or a peer cannot be reached right now (dead worker, timeout, etcd or NATS
    /// down, draining): retry elsewhere or later. HTTP 503.
    Unavailable,
    /// The operation was cancelled by its owner (client gone, shutdown).
    Cancelled,
    /// A bug, a broken contract or an environment problem that retrying the same way will not
    /// fix. HTTP 500.
    Internal,
}

impl ErrorClass {
    pub const fn name(self) -> &'static str {
        match self {
            ErrorClass::InvalidRequest => "invalid_request",
            ErrorClass::Overloaded => "overloaded",
            ErrorClass::Unavailable => "unavailable",
            ErrorClass::Cancelled => "cancelled",
            ErrorClass::Internal => "internal",
        }
    }

    /// Whether the same request may succeed if sent to another worker: every class but
    /// [`ErrorClass::InvalidRequest`]. A worker's internal failure or cancellation (e.g. a
    /// broken transfer, a worker shutting down) is that worker's, not the request's.
    pub const fn may_succeed_elsewhere(self) -> bool {
        !matches!(self, ErrorClass::InvalidRequest)
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(feature = "grpc")]
mod grpc {
    use tonic::{Code, Status};

    use super::ErrorClass;

    impl ErrorClass {
        /// The gRPC status code a server answers with for an error of this class.
        pub const fn code(self) -> Code {
            match self {
                ErrorClass::InvalidRequest => Code::InvalidArgument,
                ErrorClass::Overloaded => Code::ResourceExhausted,
                ErrorClass::Unavailable => Code::Unavailable,
                ErrorClass::Cancelled => Code::Cancelled,
                ErrorClass::Internal => Code::Internal,
            }
        }

        /// The class of a status a client received, from any gRPC server (codes are read by
        /// their meaning in gRPC's status code guide, `doc/statuscodes.md`).
        pub const fn of_code(code: Code) -> ErrorClass {
            match code {
                Code::InvalidArgument
                | Code::OutOfRange
                | Code::AlreadyExists
                | Code::NotFound
                | Code::FailedPrecondition
                | Code::PermissionDenied
                | Code::Unauthenticated => ErrorClass::InvalidRequest,
                Code::ResourceExhausted => ErrorClass::Overloaded,
                Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Unknown => {
                    ErrorClass::Unavailable
                }
                Code::Cancelled => ErrorClass::Cancelled,
                Code::Internal | Code::DataLoss | Code::Unimplemented | Code::Ok => {
                    ErrorClass::Internal
                }
            }
        }

        /// A status of this class carrying `message`.
        pub fn status(self, message: impl Into<String>) -> Status {
            Status::new(self.code(), message)
        }

        pub fn of_status(status: &Status) -> ErrorClass {
            ErrorClass::of_code(status.code())
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        const ALL: [ErrorClass; 5] = [
            ErrorClass::InvalidRequest,
            ErrorClass::Overloaded,
            ErrorClass::Unavailable,
            ErrorClass::Cancelled,
            ErrorClass::Internal,
        ];

        #[test]
        fn every_class_survives_the_wire() {
            for class in ALL {
                let status = class.status("why");
                assert_eq!(ErrorClass::of_status(&status), class);
                assert_eq!(status.message(), "why");
            }
        }

        #[test]
        fn foreign_codes_land_in_the_class_of_their_meaning() {
            assert_eq!(
                ErrorClass::of_code(Code::AlreadyExists),
                ErrorClass::InvalidRequest
            );
            assert_eq!(
                ErrorClass::of_code(Code::DeadlineExceeded),
                ErrorClass::Unavailable
            );
            assert_eq!(ErrorClass::of_code(Code::Unknown), ErrorClass::Unavailable);
            assert_eq!(ErrorClass::of_code(Code::DataLoss), ErrorClass::Internal);
            assert!(!ErrorClass::of_code(Code::OutOfRange).may_succeed_elsewhere());
            assert!(ErrorClass::of_code(Code::Internal).may_succeed_elsewhere());
        }
    }
}
