//! vLLM's KV connector protocol as the stand-in plays it (the fields of
//! `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`'s `kv_transfer_params`): a
//! prefill request with `do_remote_decode` computes the prompt and keeps its KV for the decode
//! stand-in, which pulls it over a side channel of its own (HTTP here, NIXL in vLLM) into
//! blocks it reserved, and continues from the prefill's first token.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use hashbrown::HashMap;
use serde_json::{Value, json};
use tandem_engine::{EngineRequest, ExportedBlock};
use tandem_protocol::RequestId;
use tandem_worker::{HostOutput, RequestHandle};

use crate::Shared;
use crate::request::{Completion, Follow, error, now_s};

/// Prefilled KV kept for a decode stand-in to pull, by `remote_request_id`.
#[derive(Debug, Default)]
pub(crate) struct Exports {
    by_id: HashMap<String, Export>,
}

#[derive(Debug)]
struct Export {
    blocks: Vec<ExportedBlock>,
    first_token: u32,
    made: Instant,
}

/// Exports no decode stand-in pulled are dropped after this long (vLLM's NIXL connector
/// frees them after `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).
const EXPORT_TTL: Duration = Duration::from_secs(120);
const MAX_EXPORTS: usize = 4096;

impl Exports {
    fn put(&mut self, id: String, export: Export) {
        self.by_id.retain(|_, e| e.made.elapsed() < EXPORT_TTL);
        if self.by_id.len() >= MAX_EXPORTS {
            return;
        }
        self.by_id.insert(id, export);
    }
}

/// The prefill side of vLLM's connector protocol: compute the prompt, keep its KV for the
/// decode engine to pull, answer with the handshake.
pub(crate) async fn prefill_for_remote(
    s: Arc<Shared>,
    c: Completion,
    mut req: EngineRequest,
) -> Response {
    req.max_tokens = 1;
    let id = req.id;
    let mut handle = match s.host.submit_exporting(req, 0, false) {
        Ok(h) => h,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let mut follow = Follow::new(s.clone(), &c);
    let mut blocks = Vec::new();
    let mut first = None;
    while let Some(out) = handle.next().await {
        match out {
            Ok(HostOutput::Blocks(b)) => blocks.extend(b),
            // Copies, not references: never told ahead of the step's end.
            Ok(HostOutput::Computed { .. }) => {}
            Ok(HostOutput::Token(o)) => {
                first = Some(o.token);
                follow.token(&o);
                break;
            }
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
    drop(handle);
    let Some(first) = first else {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "prefill ended without a token",
        );
    };
    s.host.release_export(id);
    blocks.sort_by_key(|b| b.index);
    let remote_request_id = format!("standin-{}-{}", s.port, id.0);
    let block_ids: Vec<u32> = blocks.iter().map(|b| b.block).collect();
    s.exports.lock().put(
        remote_request_id.clone(),
        Export {
            blocks,
            first_token: first,
            made: Instant::now(),
        },
    );
    let mut choice = json!({
        "index": 0, "text": "", "logprobs": null, "finish_reason": "length", "stop_reason": null,
    });
    if c.return_token_ids {
        choice["token_ids"] = json!([first]);
    }
    axum::Json(json!({
        "id": format!("cmpl-standin-{}", id.0), "object": "text_completion",
        "created": now_s(), "model": s.config.model, "choices": [choice],
        "usage": follow.usage(),
        "kv_transfer_params": {
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": block_ids,
            "remote_engine_id": s.config.engine_id,
            "remote_request_id": remote_request_id,
            "remote_host": s.config.advertise_host,
            "remote_port": s.port,
            "tp_size": 1,
        },
    }))
    .into_response()
}

/// The side channel: the exported blocks of `id`, once. Body: u32 LE count, u32 LE bytes
/// per block, u32 LE first token, then each block's bytes in prompt order.
pub(crate) async fn pull_kv(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let Some(export) = s.exports.lock().by_id.remove(&id) else {
        return error(StatusCode::NOT_FOUND, format!("no prefilled KV for {id}"));
    };
    let per = export.blocks.first().map_or(0, |b| b.bytes.len());
    let mut out = Vec::with_capacity(12 + per * export.blocks.len());
    out.extend_from_slice(&(export.blocks.len() as u32).to_le_bytes());
    out.extend_from_slice(&(per as u32).to_le_bytes());
    out.extend_from_slice(&export.first_token.to_le_bytes());
    for b in &export.blocks {
        out.extend_from_slice(&b.bytes);
    }
    ([(header::CONTENT_TYPE, "application/octet-stream")], out).into_response()
}

/// The decode side: reserve blocks, pull the prefilled KV into them, continue from the
/// prefill's first token; a pull that fails prefills here instead (as vLLM does when a
/// NIXL read fails and the request is recomputed).
pub(crate) fn decode_from_remote(
    s: &Arc<Shared>,
    c: &Completion,
    req: EngineRequest,
) -> Result<RequestHandle, Box<Response>> {
    let kv = c.kv.clone().unwrap_or(Value::Null);
    let host_port = kv
        .get("remote_host")
        .and_then(Value::as_str)
        .zip(kv.get("remote_port").and_then(Value::as_u64));
    let remote_id = kv.get("remote_request_id").and_then(Value::as_str);
    let (Some((host, port)), Some(remote_id)) = (host_port, remote_id) else {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "kv_transfer_params with do_remote_prefill needs remote_host, remote_port and \
             remote_request_id",
        )));
    };
    let id = req.id;
    let (handle, rp) = match s.host.begin_remote(req, false) {
        Ok(x) => x,
        Err(e) => {
            return Err(Box::new(error(
                StatusCode::SERVICE_UNAVAILABLE,
                e.to_string(),
            )));
        }
    };
    let url = format!("http://{host}:{port}/standin/kv/{remote_id}");
    let shared = s.clone();
    s.tasks.spawn(async move {
        shared.counters.kv_pulls.fetch_add(1, Ordering::Relaxed);
        let pulled = pull(&shared, &url, id, rp.cached_tokens, &rp.blocks).await;
        let host = &shared.host;
        let result = match pulled {
            Ok(first) => host.finish_remote(id, first, None),
            Err(why) => {
                tracing::warn!(%why, "stand-in: KV pull failed, prefilling locally");
                shared
                    .counters
                    .kv_pull_failures
                    .fetch_add(1, Ordering::Relaxed);
                host.fail_remote(id)
            }
        };
        if let Err(e) = result {
            tracing::debug!(error = %e, "stand-in: remote prefill settled after the request ended");
        }
    });
    Ok(handle)
}

async fn pull(
    s: &Shared,
    url: &str,
    id: RequestId,
    cached_tokens: usize,
    blocks: &[u32],
) -> Result<u32, String> {
    let body = s
        .http
        .get(url)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .error_for_status()
        .map_err(|e| e.to_string())?
        .bytes()
        .await
        .map_err(|e| e.to_string())?;
    let word = |i: usize| -> Result<u32, String> {
        body.get(i * 4..i * 4 + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(|| "truncated KV header".to_string())
    };
    let (count, per, first) = (word(0)? as usize, word(1)? as usize, word(2)?);
    if body.len() != 12 + count * per {
        return Err(format!(
            "KV body of {} bytes for {count} × {per}",
            body.len()
        ));
    }
    let skip = cached_tokens / s.config.block_size as usize;
    for (k, dest) in blocks.iter().enumerate() {
        let i = skip + k;
        if i >= count {
            return Err(format!("block {i} not in the {count} pulled"));
        }
        let bytes = &body[12 + i * per..12 + (i + 1) * per];
        s.host
            .write_block(id, *dest, bytes)
            .map_err(|e| e.to_string())?;
    }
    Ok(first)
}
