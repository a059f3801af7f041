//! [`RequestHandle`]: one request's outputs from an [`EngineHost`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tandem_protocol::RequestId;
use tokio::sync::mpsc;

use super::{EngineHost, HostOutput};
use crate::error::WorkerError;

/// A request's outputs. Dropping it before the last token aborts the request.
pub struct RequestHandle {
    pub(super) id: RequestId,
    pub(super) rx: mpsc::Receiver<HostOutput>,
    pub(super) overflowed: Arc<AtomicBool>,
    pub(super) buffer: usize,
    pub(super) host: EngineHost,
    pub(super) ended: bool,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle")
            .field("id", &self.id)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl RequestHandle {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next output; None after the last token (or if the host stopped); an error once,
    /// when the request was aborted because this handle fell too far behind.
    pub async fn next(&mut self) -> Option<Result<HostOutput, WorkerError>> {
        if self.ended {
            return None;
        }
        let out = self.rx.recv().await;
        match &out {
            Some(HostOutput::Token(o)) if o.finish.is_some() => self.ended = true,
            None => {
                self.ended = true;
                if self.overflowed.load(Ordering::Acquire) {
                    return Some(Err(WorkerError::Overloaded(format!(
                        "request {} aborted: its consumer fell {} outputs behind",
                        self.id.0, self.buffer
                    ))));
                }
            }
            _ => {}
        }
        out.map(Ok)
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.host.release(self.id);
    }
}
