//! The stand-in's HTTP API (see the crate doc for the vLLM fields it follows).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tandem_engine::{EngineRequest, SamplingParams};
use tandem_protocol::{HashSeed, RequestId};
use tandem_worker::{HostOutput, RequestHandle};

use crate::Shared;
use crate::connector::{decode_from_remote, prefill_for_remote, pull_kv};
use crate::request::{Completion, Follow, error, now_s};
use crate::text::token_text;

pub(crate) fn app(shared: Arc<Shared>) -> Router {
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/metrics", get(metrics))
        .route("/standin/kv/{id}", get(pull_kv))
        .route("/standin/drop-next-event", post(drop_next_event))
        .route("/standin/health/{state}", post(set_health));
    let c = &shared.config;
    let router = match c.no_health {
        true => router,
        false => router.route("/health", get(health)),
    };
    let router = match c.no_models {
        true => router,
        false => router.route("/v1/models", get(models)),
    };
    router
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(shared)
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    if s.healthy.load(Ordering::Acquire) {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

async fn set_health(State(s): State<Arc<Shared>>, Path(state): Path<String>) -> Response {
    s.healthy.store(state == "ok", Ordering::Release);
    StatusCode::OK.into_response()
}

async fn drop_next_event(State(s): State<Arc<Shared>>) -> Response {
    match &s.publisher {
        Some(p) => {
            p.drop_next();
            StatusCode::OK.into_response()
        }
        None => error(StatusCode::BAD_REQUEST, "no KV event publisher configured"),
    }
}

/// vLLM's `show_available_models`: the base model, then each LoRA adapter with `parent`.
async fn models(State(s): State<Arc<Shared>>) -> Response {
    s.interrupts.fetch_add(1, Ordering::AcqRel);
    // Without /health, the model list is how a client sees the server is up.
    if s.config.no_health && !s.healthy.load(Ordering::Acquire) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the server is not ready");
    }
    let created = now_s();
    let base = &s.config.model;
    let mut data = vec![json!({
        "id": base, "object": "model", "created": created, "owned_by": "tandem-standin",
        "root": base, "parent": null, "max_model_len": s.config.max_model_len,
    })];
    data.extend(s.config.lora_modules.iter().map(|l| {
        json!({
            "id": l, "object": "model", "created": created, "owned_by": "tandem-standin",
            "root": l, "parent": base, "max_model_len": null,
        })
    }));
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let now = s.host.now_us();
    let load = s.host.with_engine(|e| e.load_report(now));
    let labels = format!("engine=\"0\",model_name=\"{}\"", s.config.model);
    let usage = load.kv_usage();
    let c = &s.counters;
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, v: f64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}\n"
        ));
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        f64::from(load.running_requests),
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        f64::from(load.waiting_requests),
    );
    gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        usage,
    );
    let counters = [
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prompt_tokens.load(Ordering::Relaxed),
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            c.cached_tokens.load(Ordering::Relaxed),
        ),
        (
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            c.prompt_tokens.load(Ordering::Relaxed),
        ),
        (
            "vllm:request_success",
            "Count of successfully processed requests.",
            c.finished.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, v) in counters {
        out.push_str(&format!(
            "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {v}\n"
        ));
    }
    out.push_str(&format!(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",\
         enable_prefix_caching=\"True\",engine=\"0\",num_cpu_blocks=\"None\",\
         num_gpu_blocks=\"{}\"}} 1.0\n",
        s.config.block_size, s.config.device_blocks
    ));
    if !s.config.lora_modules.is_empty() {
        out.push_str(&lora_info(s.config.max_loras, &load.adapters.resident));
    }
    out.push_str(&format!(
        "# TYPE standin:untranslated_blocks_total counter\nstandin:untranslated_blocks_total {}\n\
         # TYPE standin:kv_pulls_total counter\nstandin:kv_pulls_total {}\n\
         # TYPE standin:kv_pull_failures_total counter\nstandin:kv_pull_failures_total {}\n\
         # TYPE standin:streamed_requests_total counter\nstandin:streamed_requests_total {}\n\
         # TYPE standin:whole_requests_total counter\nstandin:whole_requests_total {}\n",
        c.untranslated_blocks.load(Ordering::Relaxed),
        c.kv_pulls.load(Ordering::Relaxed),
        c.kv_pull_failures.load(Ordering::Relaxed),
        c.streamed.load(Ordering::Relaxed),
        c.whole.load(Ordering::Relaxed),
    ));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

/// vLLM's `vllm:lora_requests_info` (`vllm/v1/metrics/loggers.py`): labels `max_lora`,
/// `running_lora_adapters`, `waiting_lora_adapters` (comma-joined names), the value the time
/// it was set. The stand-in lists the adapters its engine holds as running (vLLM lists
/// those of its running requests) and none waiting.
fn lora_info(max_loras: usize, resident: &[String]) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    format!(
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
         # TYPE vllm:lora_requests_info gauge\n\
         vllm:lora_requests_info{{max_lora=\"{max_loras}\",running_lora_adapters=\"{}\",\
         waiting_lora_adapters=\"\"}} {now:e}\n",
        resident.join(",")
    )
}

fn parse(s: &Shared, v: &Value) -> Result<Completion, String> {
    let lora = match v.get("model").and_then(Value::as_str) {
        None => None,
        Some(m) if m == s.config.model => None,
        Some(m) if s.config.lora_modules.iter().any(|l| l == m) => Some(m.to_string()),
        Some(m) => return Err(format!("The model `{m}` does not exist.")),
    };
    let ids = |p: &Value| -> Option<Vec<u32>> {
        p.as_array()?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let prompt = match v.get("prompt") {
        Some(Value::String(text)) if s.config.text_prompts => Some(crate::text::tokenize(text)),
        Some(p)
            if p.as_array()
                .is_some_and(|a| a.len() == 1 && a[0].is_array()) =>
        {
            ids(&p[0])
        }
        Some(p) => ids(p),
        None => None,
    }
    .ok_or("the stand-in takes `prompt` as a list of token ids")?;
    if prompt.is_empty() {
        return Err("empty prompt".into());
    }
    let prompt = match s.config.add_bos {
        Some(bos) => std::iter::once(bos).chain(prompt).collect(),
        None => prompt,
    };
    let max_tokens = v
        .get("max_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .clamp(1, u64::from(u32::MAX)) as u32;
    if prompt.len() as u64 + u64::from(max_tokens) > u64::from(s.config.max_model_len) {
        return Err(format!(
            "This model's maximum context length is {} tokens. However, you requested {} \
             tokens ({} in the messages, {max_tokens} in the completion).",
            s.config.max_model_len,
            prompt.len() as u64 + u64::from(max_tokens),
            prompt.len()
        ));
    }
    Ok(Completion {
        prompt,
        max_tokens,
        seed: v.get("seed").and_then(Value::as_u64).unwrap_or(0),
        stop_token: v
            .get("stop_token_ids")
            .and_then(|s| s.get(0))
            .and_then(Value::as_u64)
            .and_then(|t| u32::try_from(t).ok()),
        ignore_eos: v
            .get("ignore_eos")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: v
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        // A text-only stand-in plays a plain OpenAI server: it knows no `return_token_ids`.
        return_token_ids: !s.config.text_only
            && !s.config.text_prompts
            && v.get("return_token_ids")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        cache_salt: v
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_string),
        lora,
        kv: v
            .get("kv_transfer_params")
            .filter(|k| k.is_object())
            .cloned(),
        logprobs: match v.get("logprobs") {
            None | Some(Value::Null) => None,
            // vLLM's default `--max-logprobs` is 20.
            Some(n) => Some(
                n.as_u64()
                    .filter(|&n| n <= 20)
                    .ok_or("logprobs must be an integer from 0 to 20")? as u8,
            ),
        },
        tokens_as_ids: v
            .get("return_tokens_as_token_ids")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        chat: false,
    })
}

async fn completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    if s.config.text_prompts && !v.get("prompt").is_some_and(Value::is_string) {
        return crate::text::not_a_string(v.get("prompt"));
    }
    match parse(&s, &v) {
        Ok(c) => complete(s, c).await,
        Err(m) => error(StatusCode::BAD_REQUEST, m),
    }
}

/// A chat (served in every mode, as vLLM does): its messages rendered with the stand-in's own
/// template and read with its own tokenizer, then answered as a completion in chat
/// completions' shape.
async fn chat_completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let mut v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    let prompt = match crate::text::render_chat(v.get("messages")) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    v["prompt"] = Value::from(crate::text::tokenize(&prompt));
    // Chat's `logprobs` is a flag and `top_logprobs` the count (OpenAI's chat API); the
    // completion the chat becomes takes the count in `logprobs`.
    v["logprobs"] = match v.get("logprobs") {
        Some(Value::Bool(true)) => v.get("top_logprobs").cloned().unwrap_or(Value::from(0)),
        _ => Value::Null,
    };
    match parse(&s, &v) {
        Ok(c) => complete(s, Completion { chat: true, ..c }).await,
        Err(m) => error(StatusCode::BAD_REQUEST, m),
    }
}

async fn complete(s: Arc<Shared>, c: Completion) -> Response {
    s.interrupts.fetch_add(1, Ordering::AcqRel);
    match c.stream {
        true => &s.counters.streamed,
        false => &s.counters.whole,
    }
    .fetch_add(1, Ordering::Relaxed);
    let flag = |k: &str| {
        c.kv.as_ref()
            .and_then(|p| p.get(k))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let req = EngineRequest {
        id: RequestId(id),
        prompt: c.prompt.clone(),
        max_tokens: c.max_tokens,
        hash_seed: HashSeed::for_request(
            c.cache_salt.as_deref().map(str::as_bytes),
            c.lora.as_deref(),
        ),
        sampling_seed: c.seed,
        // The stand-in's engine is the mocker, whose tokens ignore the sampling parameters;
        // it reports logprobs when asked (every token certain).
        sampling: SamplingParams {
            logprobs: c.logprobs,
            ..SamplingParams::default()
        },
        stop_token: c.stop_token,
        ignore_eos: c.ignore_eos,
        adapter: c.lora.clone(),
    };
    s.registry
        .lock()
        .learn(&c.prompt, c.cache_salt.as_deref(), c.lora.as_deref());
    if flag("do_remote_decode") {
        return prefill_for_remote(s, c, req).await;
    }
    let handle = if flag("do_remote_prefill") {
        match decode_from_remote(&s, &c, req) {
            Ok(h) => h,
            Err(r) => return *r,
        }
    } else {
        match s.host.submit(req) {
            Ok(h) => h,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    };
    let meta = Meta {
        id: format!("cmpl-standin-{id}"),
        // vLLM answers with the name asked for: the adapter's, on one.
        model: c.lora.clone().unwrap_or_else(|| s.config.model.clone()),
        created: now_s(),
    };
    if c.stream {
        stream_response(s, c, meta, handle)
    } else {
        whole_response(s, c, meta, handle).await
    }
}

struct Meta {
    id: String,
    model: String,
    created: u64,
}

fn stream_response(s: Arc<Shared>, c: Completion, meta: Meta, handle: RequestHandle) -> Response {
    let include_usage = c.include_usage;
    let return_ids = c.return_token_ids;
    let prompt = c.prompt.clone();
    // With `interrupting`: the count of requests at this one's start; another one arriving
    // ends this stream.
    let epoch = s
        .config
        .interrupting
        .then(|| s.interrupts.load(Ordering::Acquire));
    let follow = Follow::new(s, &c);
    let c = Arc::new(c);
    let state = (handle, follow, meta, false, false);
    let events = futures::stream::unfold(state, move |(mut h, mut f, meta, first_sent, done)| {
        let prompt = prompt.clone();
        let c = c.clone();
        async move {
            if done {
                return None;
            }
            if epoch.is_some_and(|e| f.s.interrupts.load(Ordering::Acquire) != e) {
                // llama-cpp-python's `get_event_publisher`: `[DONE]`, then it stops.
                let done = Bytes::from_static(b"data: [DONE]\n\n");
                return Some((Ok(done), (h, f, meta, true, true)));
            }
            let object = if c.chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let chunk = |choices: Value, usage: Value| {
                json!({
                    "id": meta.id, "object": object, "created": meta.created,
                    "model": meta.model, "choices": choices, "usage": usage,
                })
            };
            loop {
                match h.next().await {
                    Some(Ok(HostOutput::Token(o))) => {
                        let finish = f.token(&o);
                        let text = token_text(&[o.token]);
                        let logprobs = crate::logprobs::completion_logprobs(
                            c.logprobs,
                            c.tokens_as_ids,
                            &[&o],
                            f.text_len,
                        );
                        f.text_len += text.len();
                        let mut choice = if c.chat {
                            json!({
                                "index": 0, "delta": {"content": text}, "logprobs": null,
                                "finish_reason": finish,
                            })
                        } else {
                            json!({
                                "index": 0, "text": text, "logprobs": logprobs,
                                "finish_reason": finish, "stop_reason": null,
                            })
                        };
                        if return_ids {
                            choice["token_ids"] = json!([o.token]);
                            if !first_sent {
                                choice["prompt_token_ids"] = json!(prompt);
                            }
                        }
                        let mut text = format!("data: {}\n\n", chunk(json!([choice]), Value::Null));
                        let done = finish.is_some();
                        if done {
                            if include_usage {
                                text.push_str(&format!(
                                    "data: {}\n\n",
                                    chunk(json!([]), f.usage())
                                ));
                            }
                            text.push_str("data: [DONE]\n\n");
                        }
                        return Some((
                            Ok::<_, Infallible>(Bytes::from(text)),
                            (h, f, meta, true, done),
                        ));
                    }
                    Some(Ok(HostOutput::Blocks(_) | HostOutput::Computed { .. })) => continue,
                    Some(Err(e)) => {
                        let text = format!(
                            "data: {}\n\ndata: [DONE]\n\n",
                            json!({"error": {"message": e.to_string(), "code": 500}})
                        );
                        return Some((Ok(Bytes::from(text)), (h, f, meta, true, true)));
                    }
                    None => return None,
                }
            }
        }
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(events),
    )
        .into_response()
}

async fn whole_response(
    s: Arc<Shared>,
    c: Completion,
    meta: Meta,
    mut handle: RequestHandle,
) -> Response {
    let mut follow = Follow::new(s, &c);
    let mut tokens = Vec::new();
    let mut outs = Vec::new();
    let mut finish = None;
    while let Some(out) = handle.next().await {
        match out {
            Ok(HostOutput::Token(o)) => {
                tokens.push(o.token);
                finish = follow.token(&o);
                outs.push(o);
                if finish.is_some() {
                    break;
                }
            }
            Ok(HostOutput::Blocks(_) | HostOutput::Computed { .. }) => {}
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
    let outs: Vec<&tandem_engine::RequestOutput> = outs.iter().collect();
    if c.chat {
        return axum::Json(json!({
            "id": meta.id, "object": "chat.completion", "created": meta.created,
            "model": meta.model, "usage": follow.usage(),
            "choices": [{
                "index": 0, "finish_reason": finish, "logprobs": null,
                "message": {"role": "assistant", "content": token_text(&tokens)},
            }],
        }))
        .into_response();
    }
    let mut choice = json!({
        "index": 0, "text": token_text(&tokens), "logprobs": crate::logprobs::completion_logprobs(c.logprobs, c.tokens_as_ids, &outs, 0),
        "finish_reason": finish, "stop_reason": null,
    });
    if c.return_token_ids {
        choice["token_ids"] = json!(tokens);
        choice["prompt_token_ids"] = json!(c.prompt);
    }
    axum::Json(json!({
        "id": meta.id, "object": "text_completion", "created": meta.created,
        "model": meta.model, "choices": [choice], "usage": follow.usage(),
        "kv_transfer_params": null,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use tandem_external::prom;
    use tandem_protocol::AdapterLoad;

    #[test]
    fn lora_info_reads_back_as_vllm_s() {
        let text = super::lora_info(2, &["sql-lora".into(), "chat-lora".into()]);
        assert_eq!(
            prom::adapters(&prom::parse(&text)),
            Some(AdapterLoad {
                max_loaded: 2,
                resident: vec!["sql-lora".into(), "chat-lora".into()],
            })
        );
        let idle = super::lora_info(1, &[]);
        assert_eq!(
            prom::adapters(&prom::parse(&idle)).map(|a| a.resident),
            Some(Vec::new())
        );
    }
}
