//! Logging setup: `tracing` with an env filter, text or JSON lines on stderr.
//!
//! The filter is the configured one, else the `RUST_LOG` environment variable (read by
//! `tracing_subscriber::EnvFilter`: the one place this crate reads the environment), else
//! `info`. Logs go to stderr so that a command's results on stdout stay clean.

use std::sync::atomic::{AtomicBool, Ordering};

use tracing_subscriber::EnvFilter;

use crate::error::RuntimeError;

/// How to log.
#[derive(Clone, Debug, Default)]
pub struct TelemetryConfig {
    /// One JSON object per line instead of human-readable text.
    pub json: bool,
    /// An `EnvFilter` directive string (e.g. `info,tandem_router=debug`); overrides `RUST_LOG`.
    pub filter: Option<String>,
}

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Installs the global subscriber. Idempotent: once a subscriber is installed (by an earlier
/// call or by anyone else, e.g. a test harness), later calls do nothing and return `Ok`.
/// An invalid filter is a [`RuntimeError::Config`].
pub fn init(config: TelemetryConfig) -> Result<(), RuntimeError> {
    let filter = match &config.filter {
        Some(directives) => EnvFilter::try_new(directives)
            .map_err(|e| RuntimeError::Config(format!("log filter {directives:?}: {e}")))?,
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    if INSTALLED.load(Ordering::Acquire) {
        return Ok(());
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = if config.json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    // An error here only means a global subscriber exists already: that is the no-op case.
    let _ = installed;
    INSTALLED.store(true, Ordering::Release);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_idempotent_and_checks_the_filter() {
        let bad = TelemetryConfig {
            json: false,
            filter: Some("info,[".into()),
        };
        assert!(init(bad).is_err());
        let config = TelemetryConfig {
            json: true,
            filter: Some("warn".into()),
        };
        assert!(init(config.clone()).is_ok());
        assert!(init(config).is_ok());
        assert!(init(TelemetryConfig::default()).is_ok());
        tracing::info!("telemetry test line");
    }
}
