//! The decode side of a remote prefill: ask the prefill worker for the prompt's KV, which it
//! writes into the blocks reserved here (through the KV transport, or inline on the stream),
//! check the digest, hand back the first token. Any failure is the caller's cue to prefill
//! locally; the blocks of an abandoned transfer stay out of use until [`fence`] knows nothing
//! more of it can arrive.

use std::time::Duration;

use hashbrown::HashMap;
use parking_lot::Mutex;
use tandem_engine::RemotePrefill;
use tandem_protocol::ErrorClass;
use tandem_protocol::RequestId;
use tandem_protocol::grpc::{
    AbortPrefillRequest, PrefillRequest, RemotePrefillTarget, prefill_chunk, worker_client,
};
use tandem_worker::{EngineHost, ExposedArena, KvDigest, WorkerError};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::transport::Channel;

/// Most prefill workers kept connected; beyond it the map starts over (connections are
/// re-made lazily).
const MAX_CLIENTS: usize = 1024;

/// gRPC clients of the prefill workers this worker has used, by address.
#[derive(Debug, Default)]
pub struct PrefillClients {
    clients: Mutex<HashMap<String, worker_client::WorkerClient<Channel>>>,
}

impl PrefillClients {
    fn client(
        &self,
        address: &str,
        connect_timeout: Duration,
    ) -> Result<worker_client::WorkerClient<Channel>, WorkerError> {
        let mut clients = self.clients.lock();
        if let Some(c) = clients.get(address) {
            return Ok(c.clone());
        }
        if clients.len() >= MAX_CLIENTS {
            clients.clear();
        }
        let channel = tandem_runtime::grpc::lazy_channel(address, connect_timeout)?;
        let client = worker_client::WorkerClient::new(channel).max_decoding_message_size(64 << 20);
        clients.insert(address.to_string(), client.clone());
        Ok(client)
    }
}

/// Destination blocks a prefill worker may write through the transport: held in the pool
/// (out of use, even after the request ends) until the transfer is known to be over.
#[derive(Debug)]
pub struct TransferHold {
    host: EngineHost,
    blocks: Vec<u32>,
    held: bool,
}

impl TransferHold {
    pub fn new(host: EngineHost, blocks: Vec<u32>) -> Self {
        TransferHold {
            host,
            blocks,
            held: true,
        }
    }

    pub fn is_held(&self) -> bool {
        self.held
    }

    /// Nothing more can reach the blocks: they go back to the request (or the free list).
    pub fn release(&mut self) {
        if std::mem::take(&mut self.held)
            && let Err(e) = self.host.release_hold(&self.blocks)
        {
            tracing::error!(error = %e, "releasing the blocks of a finished transfer");
        }
    }
}

/// A block of KV whose elements are of another width than this worker's (`own_element`
/// bytes, `own_bytes` a block), converted to this worker's (f32 to f16 rounds to nearest even);
/// a block of another shape, or of a width the engine does not store, is refused.
fn convert(data: &[u8], own_bytes: usize, own_element: usize) -> Result<Vec<u8>, WorkerError> {
    use tandem_native::KvDtype;
    let elements = own_bytes / own_element.max(1);
    let theirs = (elements > 0 && data.len().is_multiple_of(elements))
        .then(|| KvDtype::of_bytes(data.len() / elements))
        .flatten();
    let (Some(from), Some(to)) = (theirs, KvDtype::of_bytes(own_element)) else {
        return Err(WorkerError::BadTransfer(format!(
            "a KV block of {} bytes cannot become one of this worker's ({own_bytes} bytes of \
             {own_element}-byte elements): another model shape, or an element type this \
             engine does not store",
            data.len()
        )));
    };
    let mut out = vec![0u8; own_bytes];
    tandem_native::kv::convert(data, from, &mut out, to);
    Ok(out)
}

/// The first token a prefill worker drew, and its logprobs when asked for.
pub type FirstToken = (u32, Option<Box<tandem_engine::TokenLogprobs>>);

/// Fetches the KV of `rp` from `target` into this worker's reserved blocks; the first token
/// (with its logprobs when the request asked for them) on success. With an exposed arena the prefill worker writes the blocks straight into it
/// through the KV transport; `PrefillDone` means its writes are flushed, so the hold ends and
/// the blocks are checked against the digest in place. Blocks sent inline are written as
/// they come.
#[allow(clippy::too_many_arguments)]
pub async fn fetch(
    clients: &PrefillClients,
    host: &EngineHost,
    exposed: Option<&ExposedArena>,
    hold: Option<&mut TransferHold>,
    target: &RemotePrefillTarget,
    request: PrefillRequest,
    rp: &RemotePrefill,
    connect_timeout: Duration,
) -> Result<FirstToken, WorkerError> {
    let id = RequestId(request.request_id);
    let wants_logprobs = request.logprobs.is_some();
    let check = !request.skip_digest;
    let own_bytes = request.bytes_per_block as usize;
    let own_element = request.kv_element_bytes as usize;
    let mut client = clients.client(&target.address, connect_timeout)?;
    let mut call = tonic::Request::new(request);
    tandem_runtime::telemetry::inject_metadata(&tracing::Span::current(), call.metadata_mut());
    let mut stream = client
        .prefill(call)
        .await
        .map_err(|s| WorkerError::BadTransfer(format!("prefill worker refused: {s}")))?
        .into_inner();
    let mut digest = KvDigest::default();
    // Blocks came on the stream (the prefill worker has no transport into this region).
    let mut inline = false;
    loop {
        let chunk = stream
            .message()
            .await
            .map_err(|s| WorkerError::BadTransfer(format!("prefill stream failed: {s}")))?
            .ok_or_else(|| WorkerError::BadTransfer("prefill stream ended early".into()))?;
        match chunk.item {
            Some(prefill_chunk::Item::Block(b)) => {
                inline = true;
                if b.index != digest.blocks() {
                    return Err(WorkerError::BadTransfer(format!(
                        "block {} arrived, expected block {}",
                        b.index,
                        digest.blocks()
                    )));
                }
                let dst = rp.blocks.get(b.index as usize).ok_or_else(|| {
                    WorkerError::BadTransfer(format!(
                        "block {} beyond the {} reserved",
                        b.index,
                        rp.blocks.len()
                    ))
                })?;
                if b.data.len() == own_bytes {
                    host.write_block(id, *dst, &b.data)?;
                } else {
                    host.write_block(id, *dst, &convert(&b.data, own_bytes, own_element)?)?;
                }
                if check {
                    digest.update(&b.data);
                } else {
                    digest.count();
                }
            }
            Some(prefill_chunk::Item::Landed(landed)) => {
                // Blocks up to `landed.blocks` are flushed into the region: checked now,
                // while the prefill worker computes the rest.
                let upto = landed.blocks as usize;
                let from = digest.blocks() as usize;
                let Some(exposed) = exposed.filter(|_| check) else {
                    continue;
                };
                if upto < from || upto > rp.blocks.len() {
                    return Err(WorkerError::BadTransfer(format!(
                        "{upto} blocks landed, after {from}, of {} reserved",
                        rp.blocks.len()
                    )));
                }
                tandem_worker::cpu_bound(|| {
                    tandem_worker::digest_blocks(
                        &exposed.region,
                        &rp.blocks[from..upto],
                        &mut digest,
                    )
                })
                .map_err(|e| WorkerError::BadTransfer(format!("reading received KV: {e}")))?;
            }
            Some(prefill_chunk::Item::Done(done)) => {
                // The prefill worker flushed its writer before saying so: nothing more of
                // this transfer can arrive.
                if let Some(hold) = hold {
                    hold.release();
                }
                // Through the region: what no `KvLanded` covered is checked now.
                let from = digest.blocks() as usize;
                if let Some(exposed) = exposed
                    && from < rp.blocks.len()
                    && !inline
                {
                    if check {
                        tandem_worker::cpu_bound(|| {
                            tandem_worker::digest_blocks(
                                &exposed.region,
                                &rp.blocks[from..],
                                &mut digest,
                            )
                        })
                        .map_err(|e| {
                            WorkerError::BadTransfer(format!("reading received KV: {e}"))
                        })?;
                    } else {
                        rp.blocks[from..].iter().for_each(|_| digest.count());
                    }
                }
                if done.blocks as usize != rp.blocks.len() || done.blocks != digest.blocks() {
                    return Err(WorkerError::BadTransfer(format!(
                        "{} blocks received, {} sent, {} expected",
                        digest.blocks(),
                        done.blocks,
                        rp.blocks.len()
                    )));
                }
                if check && done.digest != digest.value() {
                    return Err(WorkerError::BadTransfer(
                        "digest mismatch: the received KV differs from what was sent".into(),
                    ));
                }
                let logprobs = match (&done.first_token_logprobs, wants_logprobs) {
                    (Some(l), true) => Some(tandem_worker::logprobs_from_wire(l)?),
                    (None, true) => {
                        return Err(WorkerError::BadTransfer(
                            "the prefill worker sent no logprobs for the first token".into(),
                        ));
                    }
                    (_, false) => None,
                };
                return Ok((done.first_token, logprobs));
            }
            None => return Err(WorkerError::BadTransfer("empty prefill chunk".into())),
        }
    }
}

/// How a fence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fenced {
    /// The prefill worker confirmed its writer is closed (or never started).
    Confirmed,
    /// The prefill worker's process is gone (connection refused): it writes nothing more.
    PeerGone,
    /// No confirmation within the fence timeout: released anyway.
    TimedOut,
    /// This worker is stopping; the blocks go with it.
    Stopping,
}

impl Fenced {
    /// Its `outcome` label on `tandem_worker_transfer_fences_total`; None for a stop.
    pub fn metric_label(self) -> Option<&'static str> {
        match self {
            Fenced::Confirmed => Some("confirmed"),
            Fenced::PeerGone => Some("peer_gone"),
            Fenced::TimedOut => Some("timed_out"),
            Fenced::Stopping => None,
        }
    }
}

/// Waits until the abandoned transfer of `request_id` into `destination` can write nothing
/// more, then releases `hold`: asks the prefill worker at `address` to abort it
/// (`AbortPrefill` answers once its writer is closed), retrying with backoff; a refused
/// connection means the prefill worker's process is gone. Past `timeout` the blocks are
/// released anyway, with a warning (a prefill worker hung for that long is not expected to
/// wake up and write).
pub async fn fence(
    clients: &PrefillClients,
    address: &str,
    request: AbortPrefillRequest,
    mut hold: TransferHold,
    timeout: Duration,
    stop: CancellationToken,
) -> Fenced {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut backoff = Duration::from_millis(50);
    let outcome = loop {
        let attempt = async {
            let mut client = clients
                .client(address, FENCE_CALL_TIMEOUT)
                .map_err(|e| ErrorClass::Unavailable.status(e.to_string()))?;
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(FENCE_CALL_TIMEOUT);
            client.abort_prefill(call).await
        };
        let result = tokio::select! {
            r = tokio::time::timeout_at(deadline, attempt) => match r {
                Ok(r) => r,
                Err(_) => break Fenced::TimedOut,
            },
            () = stop.cancelled() => break Fenced::Stopping,
        };
        match result {
            Ok(_) => break Fenced::Confirmed,
            Err(status) if connection_refused(&status) => break Fenced::PeerGone,
            Err(status) => {
                tracing::debug!(request = request.request_id, %status, "transfer fence: retrying");
            }
        }
        if tokio::time::Instant::now() + backoff >= deadline {
            break Fenced::TimedOut;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = stop.cancelled() => break Fenced::Stopping,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    };
    match outcome {
        Fenced::Stopping => {}
        Fenced::TimedOut => {
            tracing::warn!(
                request = request.request_id,
                blocks = hold.blocks.len(),
                prefill_worker = address,
                "no confirmation that an abandoned KV transfer stopped writing within \
                 {timeout:?}: releasing its blocks"
            );
            hold.release();
        }
        Fenced::Confirmed | Fenced::PeerGone => hold.release(),
    }
    outcome
}

/// Longest one `AbortPrefill` call may take (the prefill worker waits up to 5 s itself).
const FENCE_CALL_TIMEOUT: Duration = Duration::from_secs(8);

/// Whether `e` comes from a refused TCP connection (nothing listens at the address).
fn connection_refused(status: &Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return true;
        }
        source = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_of_another_width_are_converted_and_other_shapes_refused() {
        // This worker: 8 f16 elements a block (16 bytes).
        let f32_block: Vec<u8> = (0..8u32)
            .flat_map(|i| (i as f32 + 0.5).to_le_bytes())
            .collect();
        let got = convert(&f32_block, 16, 2).unwrap();
        let halves: Vec<f32> = got
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(halves, (0..8).map(|i| i as f32 + 0.5).collect::<Vec<_>>());
        // 12 bytes: 1.5 bytes an element; 64: 8-byte elements, which no engine stores.
        for bad in [12, 64] {
            let e = convert(&vec![0u8; bad], 16, 2).unwrap_err().to_string();
            assert!(e.contains("cannot become one of this worker's"), "{e}");
        }
    }
}
