//! Starting the UCX worker thread: UCP is initialised on the thread that will own it, which
//! then runs the [`Engine`] loop; the caller gets an [`EngineHandle`] once it is up.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use parking_lot::Mutex;

use super::engine::Engine;
use super::handle::{EngineHandle, Wake, WorkerPtr};
use super::ucp::Ucp;
use crate::error::TransferError;
use crate::transport::TransportConfig;

/// Starts the worker thread; returns once UCX is initialised (or failed to).
pub(crate) fn start(config: TransportConfig) -> Result<EngineHandle, TransferError> {
    static INSTANCES: AtomicUsize = AtomicUsize::new(1);
    let instance = INSTANCES.fetch_add(1, Ordering::Relaxed) as u64;
    let (tx, rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("tandem-ucx".into())
        .spawn(move || {
            let setup = Ucp::new(&config.ucx).and_then(|ucp| {
                let address = ucp.address()?;
                let efd = ucp.event_fd()?;
                Ok((ucp, address, efd))
            });
            let (ucp, address, efd) = match setup {
                Ok(v) => v,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let wake = Arc::new(Wake {
                worker: Mutex::new(Some(WorkerPtr(ucp.lib, ucp.worker))),
                queued: AtomicUsize::new(0),
                sleeping: AtomicBool::new(false),
            });
            let cuda = ucp.supports_cuda();
            if ready_tx
                .send(Ok((address, Arc::clone(&wake), cuda)))
                .is_err()
            {
                return;
            }
            Engine::new(ucp, instance, efd, rx, wake, config).run();
        })
        .map_err(|e| TransferError::Io {
            op: "spawn ucx thread",
            detail: e.to_string(),
        })?;
    match ready_rx.recv() {
        Ok(Ok((worker_address, wake, cuda_memory))) => Ok(EngineHandle {
            instance,
            tx: Some(tx),
            wake,
            thread: Some(thread),
            worker_address,
            cuda_memory,
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(TransferError::Ucx {
                op: "start",
                detail: "the UCX thread exited during start-up".into(),
            })
        }
    }
}
