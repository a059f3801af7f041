//! Resilience: what routing does when workers fail. A circuit breaker per worker and a retry
//! budget per replica ([`breaker`]), and when a second attempt at a slow first token starts
//! ([`hedge`]). The frontend's attempts consult them; the replica keeps their state.

pub mod breaker;
pub mod hedge;
