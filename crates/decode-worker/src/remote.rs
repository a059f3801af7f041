//! The decode side of a remote prefill: ask the prefill worker for the prompt's KV, write
//! each block it streams into the blocks reserved here, check the digest, hand back the
//! first token. Any failure is the caller's cue to prefill locally.

use std::time::Duration;

use hashbrown::HashMap;
use parking_lot::Mutex;
use tandem_engine::RemotePrefill;
use tandem_protocol::RequestId;
use tandem_protocol::grpc::{PrefillRequest, RemotePrefillTarget, prefill_chunk, worker_client};
use tandem_worker::{EngineHost, KvDigest, KvLanding, WorkerError};
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

/// Fetches the KV of `rp` from `target` into this worker's reserved blocks; the first token
/// on success. With a landing region the prefill worker writes the blocks there (same block
/// indices) through the KV transport; they are checked against the digest and moved into
/// the engine's arena when it is done. Blocks sent inline are written as they come.
pub async fn fetch(
    clients: &PrefillClients,
    host: &EngineHost,
    landing: Option<&KvLanding>,
    target: &RemotePrefillTarget,
    request: PrefillRequest,
    rp: &RemotePrefill,
    connect_timeout: Duration,
) -> Result<u32, WorkerError> {
    let id = RequestId(request.request_id);
    let mut client = clients.client(&target.address, connect_timeout)?;
    let mut stream = client
        .prefill(request)
        .await
        .map_err(|s| WorkerError::BadTransfer(format!("prefill worker refused: {s}")))?
        .into_inner();
    let mut digest = KvDigest::default();
    loop {
        let chunk = stream
            .message()
            .await
            .map_err(|s| WorkerError::BadTransfer(format!("prefill stream failed: {s}")))?
            .ok_or_else(|| WorkerError::BadTransfer("prefill stream ended early".into()))?;
        match chunk.item {
            Some(prefill_chunk::Item::Block(b)) => {
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
                host.write_block(id, *dst, &b.data)?;
                digest.update(&b.data);
            }
            Some(prefill_chunk::Item::Done(done)) => {
                if digest.blocks() == 0
                    && !rp.blocks.is_empty()
                    && let Some(landing) = landing
                {
                    tandem_worker::cpu_bound(|| land(host, landing, id, &rp.blocks, &mut digest))?;
                }
                if done.blocks as usize != rp.blocks.len() || done.blocks != digest.blocks() {
                    return Err(WorkerError::BadTransfer(format!(
                        "{} blocks received, {} sent, {} expected",
                        digest.blocks(),
                        done.blocks,
                        rp.blocks.len()
                    )));
                }
                if done.digest != digest.value() {
                    return Err(WorkerError::BadTransfer(
                        "digest mismatch: the received KV differs from what was sent".into(),
                    ));
                }
                return Ok(done.first_token);
            }
            None => return Err(WorkerError::BadTransfer("empty prefill chunk".into())),
        }
    }
}

/// Moves blocks the transport wrote into the landing region into the engine's arena,
/// hashing them on the way: one copy per block, straight from the region (a locked block
/// guard, no staging buffer).
fn land(
    host: &EngineHost,
    landing: &KvLanding,
    id: RequestId,
    blocks: &[u32],
    digest: &mut KvDigest,
) -> Result<(), WorkerError> {
    for &b in blocks {
        let landed = landing
            .region
            .lock_block(b)
            .map_err(|e| WorkerError::BadTransfer(format!("reading landed block {b}: {e}")))?;
        digest.update(&landed);
        host.write_block(id, b, &landed)?;
    }
    Ok(())
}
