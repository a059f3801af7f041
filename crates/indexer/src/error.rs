//! Typed errors of the index.

use tandem_protocol::WorkerId;

/// Why the index refused an input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// A dump for one worker carried an event of another; the dump is corrupt or misrouted.
    /// Class: invalid input; nothing was changed.
    #[error("dump for worker {dump} contains an event of worker {event}")]
    ForeignEvent { dump: WorkerId, event: WorkerId },
}
