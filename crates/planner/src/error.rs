//! The planner's one error type.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    #[error("metrics line {line}: {why}")]
    Metrics { line: usize, why: String },
    #[error("GET {url}: {source}")]
    Scrape {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{method} {url}: HTTP {status}: {body}")]
    Status {
        method: &'static str,
        url: String,
        status: u16,
        body: String,
    },
    #[error("{method} {url}: {source}")]
    Http {
        method: &'static str,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("writing decisions to {path}: {source}")]
    Decisions {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid planner configuration: {0}")]
    Config(String),
}
