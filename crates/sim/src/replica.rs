//! What the simulated event plane carries to a router replica, and how a replica's repairs are
//! answered. The replicas are the production [`RoutingReplica`]s; this is only their shell.

use tandem_protocol::{KvDump, KvEvent};
use tandem_router::{Input, RepairReply, RoutingReplica};

use crate::error::SimError;

/// What a replica received from one worker in one delivery.
#[derive(Debug)]
pub(crate) enum KvPayload {
    Events(Vec<KvEvent>),
    /// The worker's whole state, sent instead of events its ring no longer held.
    Dump(KvDump),
}

/// Delivers one worker's payload to a replica. A repair the replica asks for (a gap: only
/// possible when the engine's event ring overflowed between two deliveries) is answered at
/// once with `dump_now`, the worker's current state, as a worker answers the indexer's
/// `KvEvents` when its ring no longer has the range. Returns the repairs made (unasked dumps
/// included), for the report's `index_gaps_repaired`.
pub(crate) fn deliver(
    replica: &mut RoutingReplica,
    payload: &KvPayload,
    now_ms: u64,
    dump_now: impl Fn() -> KvDump,
) -> Result<u64, SimError> {
    let repairs = match payload {
        KvPayload::Dump(d) => {
            let worker = d.worker_id;
            let reply = RepairReply::Dump(d.clone());
            replica.apply(Input::Repaired { worker, reply }, now_ms)?;
            return Ok(1);
        }
        KvPayload::Events(evs) => replica.apply(Input::KvEvents(evs), now_ms)?,
    };
    let n = repairs.len() as u64;
    for r in repairs {
        let reply = RepairReply::Dump(dump_now());
        let worker = r.worker;
        replica.apply(Input::Repaired { worker, reply }, now_ms)?;
    }
    Ok(n)
}
