//! The factory: [`open`] a transport by kind, and the process's [`default_kind`]. It imports
//! every implementation; they import only the traits (`transport.rs`).

use std::sync::{Arc, OnceLock};

use crate::descriptor::TransportKind;
use crate::error::TransferError;
#[cfg(feature = "ucx")]
use crate::transport::UcxConfig;
use crate::transport::{Transport, TransportConfig};

/// Opens a transport of `kind`. Call from within a tokio runtime (the TCP listener and the
/// timeouts use it). [`TransferError::Unsupported`] for `ucx` in a build without the `ucx`
/// feature; [`TransferError::UcxNotFound`] (or [`TransferError::UcxTooOld`]) when libucp cannot
/// be loaded at run time; a UCX initialisation failure is [`TransferError::Ucx`].
pub async fn open(
    kind: TransportKind,
    config: &TransportConfig,
) -> Result<Arc<dyn Transport>, TransferError> {
    config.validate()?;
    match kind {
        TransportKind::Local => Ok(Arc::new(crate::local::LocalTransport::new())),
        TransportKind::Tcp => Ok(Arc::new(crate::tcp::TcpTransport::new(config.clone()))),
        TransportKind::Ucx => {
            #[cfg(feature = "ucx")]
            {
                // UCX start-up (context, worker, thread) takes milliseconds: off the runtime.
                let config = config.clone();
                let t = tokio::task::spawn_blocking(move || crate::ucx::UcxTransport::new(config))
                    .await
                    .map_err(|e| TransferError::Ucx {
                        op: "start",
                        detail: e.to_string(),
                    })??;
                Ok(Arc::new(t))
            }
            #[cfg(not(feature = "ucx"))]
            {
                Err(TransferError::Unsupported(
                    "tandem-kv-transfer was built without the `ucx` feature".into(),
                ))
            }
        }
    }
}

/// `ucx` when UCX initialises in this process (probed once, with UCX's default selection),
/// else `tcp`: also when libucp is not installed ("UCX not found, using tcp"). Logs the choice
/// and the reason once. The first call blocks for the probe
/// (milliseconds): make it at start-up, not on a hot path.
pub fn default_kind() -> TransportKind {
    static KIND: OnceLock<TransportKind> = OnceLock::new();
    *KIND.get_or_init(|| {
        #[cfg(feature = "ucx")]
        match crate::ucx::probe(&UcxConfig::default()) {
            Ok(version) => {
                tracing::info!(%version, "kv transfer: using ucx by default");
                TransportKind::Ucx
            }
            Err(e @ TransferError::UcxNotFound { .. }) => {
                tracing::warn!(error = %e, "kv transfer: UCX not found, using tcp");
                TransportKind::Tcp
            }
            Err(e) => {
                tracing::warn!(error = %e, "kv transfer: UCX unavailable, using tcp by default");
                TransportKind::Tcp
            }
        }
        #[cfg(not(feature = "ucx"))]
        {
            tracing::info!("kv transfer: built without ucx, using tcp by default");
            TransportKind::Tcp
        }
    })
}
