//! Who may use the edge: API keys, tenants and the admin key (`auth.rs`), TLS (`tls.rs`).

pub(crate) mod auth;
pub(crate) mod tls;
