//! Reading an engine's Prometheus text: its load and its cache geometry.
//!
//! Names, from the engines' sources:
//! - vLLM (`vllm/v1/metrics/loggers.py`): `vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction, 0..1; older
//!   releases `vllm:gpu_cache_usage_perc`), and the info gauge `vllm:cache_config_info`
//!   whose labels carry the cache config (`block_size`, `num_gpu_blocks`,
//!   `num_cpu_blocks`); with LoRA on, `vllm:lora_requests_info` ([`adapters`]).
//! - SGLang (`python/sglang/srt/metrics/collector.py`): `sglang:num_running_reqs`,
//!   `sglang:num_queue_reqs`, `sglang:token_usage` (a fraction of KV tokens in use).
//!
//! Several series of one name (one per model or engine label) are summed: the sidecar
//! fronts one engine.

use hashbrown::HashMap;
use tandem_protocol::AdapterLoad;

use super::engine::EngineKind;

pub use tandem_protocol::exposition::Sample;

/// Parses an engine's page (tandem-protocol's exposition parser): malformed lines skipped, so
/// an engine's one odd line does not blind the sidecar to the rest.
pub fn parse(text: &str) -> Vec<Sample> {
    tandem_protocol::exposition::parse_lenient(text)
}

/// What the sidecar reads of an engine's load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    /// Fraction of the KV cache in use, 0..=1.
    pub kv_usage: f64,
}

/// The engine's cache geometry, where its metrics say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineGeometry {
    pub block_size: Option<u32>,
    pub device_blocks: Option<u64>,
    pub host_blocks: Option<u64>,
}

fn sum(samples: &[Sample], names: &[&str]) -> Option<f64> {
    for name in names {
        let mut found = false;
        let mut total = 0.0;
        for s in samples.iter().filter(|s| s.name == *name) {
            found = true;
            total += s.value;
        }
        if found {
            return Some(total);
        }
    }
    None
}

/// The load in `samples`, by the engine's names; None when none of them is there (the
/// engine is not the kind configured, or has metrics off).
pub fn load(kind: EngineKind, samples: &[Sample]) -> Option<EngineLoad> {
    let (running, waiting, usage): (&[&str], &[&str], &[&str]) = match kind {
        EngineKind::Vllm | EngineKind::Openai => (
            &["vllm:num_requests_running"],
            &["vllm:num_requests_waiting"],
            &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        ),
        EngineKind::Sglang => (
            &["sglang:num_running_reqs"],
            &["sglang:num_queue_reqs"],
            &["sglang:token_usage"],
        ),
    };
    let r = sum(samples, running);
    let w = sum(samples, waiting);
    let u = sum(samples, usage);
    if r.is_none() && w.is_none() && u.is_none() {
        return None;
    }
    let count = |v: Option<f64>| v.unwrap_or(0.0).clamp(0.0, f64::from(u32::MAX)) as u32;
    Some(EngineLoad {
        running: count(r),
        waiting: count(w),
        kv_usage: u.unwrap_or(0.0).clamp(0.0, 1.0),
    })
}

/// vLLM's `vllm:cache_config_info` labels; empty for other engines.
pub fn geometry(samples: &[Sample]) -> EngineGeometry {
    let mut g = EngineGeometry::default();
    let Some(info) = samples.iter().find(|s| s.name == "vllm:cache_config_info") else {
        return g;
    };
    let num = |k: &str| info.label(k).and_then(|v| v.parse::<u64>().ok());
    g.block_size = num("block_size").and_then(|b| u32::try_from(b).ok());
    g.device_blocks = num("num_gpu_blocks");
    g.host_blocks = num("num_cpu_blocks");
    g
}

/// vLLM's LoRA adapters, from its `vllm:lora_requests_info` gauge; None without one (LoRA
/// off, or another engine).
///
/// vLLM (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`: `gauge_lora_info`, set in
/// `record`) labels it `max_lora` (its `--max-loras`: adapters one batch may use),
/// `running_lora_adapters` and `waiting_lora_adapters` (the adapters of the running and the
/// waiting requests, each `",".join(...)` of their names, empty when none), and sets it to
/// the current time (`set_to_current_time`) at every logged step. Each label set is its own
/// series and old ones stay in the exposition, so the series with the largest value is the
/// latest. Resident adapters are running ∪ waiting: a waiting request's adapter is being
/// loaded or is about to be.
pub fn adapters(samples: &[Sample]) -> Option<AdapterLoad> {
    let latest = samples
        .iter()
        .filter(|s| s.name == "vllm:lora_requests_info" && !s.value.is_nan())
        .max_by(|a, b| a.value.total_cmp(&b.value))?;
    let max_loaded = latest
        .label("max_lora")
        .and_then(|m| m.trim().parse::<u32>().ok())
        .unwrap_or(0);
    let mut resident: Vec<String> = Vec::new();
    for key in ["running_lora_adapters", "waiting_lora_adapters"] {
        let names = latest.label(key).unwrap_or("");
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if !resident.iter().any(|r| r == name) {
                resident.push(name.to_string());
            }
        }
    }
    Some(AdapterLoad {
        max_loaded,
        resident,
    })
}

/// Counts by name (for tests and the stand-in's own checks).
pub fn by_name(samples: &[Sample]) -> HashMap<&str, f64> {
    let mut m = HashMap::new();
    for s in samples {
        *m.entry(s.name.as_str()).or_insert(0.0) += s.value;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_cpu_blocks="None",num_gpu_blocks="27000"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1.2e+06
weird line without value
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="a \"quoted\" name"} 7
"#;

    #[test]
    fn reads_vllm_load_and_geometry() {
        let s = parse(VLLM);
        assert_eq!(
            load(EngineKind::Vllm, &s),
            Some(EngineLoad {
                running: 3,
                waiting: 2,
                kv_usage: 0.25
            })
        );
        let g = geometry(&s);
        assert_eq!(g.block_size, Some(16));
        assert_eq!(g.device_blocks, Some(27000));
        assert_eq!(g.host_blocks, None, "\"None\" is not a number");
        let named = by_name(&s);
        assert_eq!(named["vllm:prompt_tokens_total"], 1.2e6);
        let q = s
            .iter()
            .find(|s| s.name == "vllm:e2e_request_latency_seconds_bucket")
            .unwrap();
        assert_eq!(q.label("model_name"), Some("a \"quoted\" name"));
        assert_eq!(q.label("le"), Some("+Inf"));
    }

    #[test]
    fn reads_sglang_load() {
        let s = parse(
            "sglang:num_running_reqs{model_name=\"q\"} 5\nsglang:num_queue_reqs{model_name=\"q\"} 1\n\
             sglang:token_usage{model_name=\"q\"} 0.5\n",
        );
        assert_eq!(
            load(EngineKind::Sglang, &s),
            Some(EngineLoad {
                running: 5,
                waiting: 1,
                kv_usage: 0.5
            })
        );
        assert_eq!(load(EngineKind::Vllm, &s), None, "another engine's names");
    }

    /// As vLLM's `prometheus_client` writes it with `--enable-lora --max-loras 4`: one series
    /// per label set seen, each stamped with the time it was last set.
    const VLLM_LORA: &str = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7471562e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="sql-lora, tool-lora,"} 1.7471563127e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7471562998e+09
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
"#;

    #[test]
    fn reads_vllm_lora_adapters_from_the_latest_series() {
        let s = parse(VLLM_LORA);
        assert_eq!(
            adapters(&s),
            Some(AdapterLoad {
                max_loaded: 4,
                resident: vec!["sql-lora".into(), "chat-lora".into(), "tool-lora".into()],
            })
        );
        // Idle: the latest series lists none.
        let idle = parse(
            "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 100\n\
             vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 200\n",
        );
        assert_eq!(
            adapters(&idle),
            Some(AdapterLoad {
                max_loaded: 2,
                resident: Vec::new(),
            })
        );
        // No LoRA (or not vLLM): nothing to say.
        assert_eq!(adapters(&parse(VLLM)), None);
        // A label missing or not a number: no slot count, the names still count.
        let odd = parse("vllm:lora_requests_info{running_lora_adapters=\" x \"} 1\n");
        assert_eq!(
            adapters(&odd),
            Some(AdapterLoad {
                max_loaded: 0,
                resident: vec!["x".into()],
            })
        );
    }

    #[test]
    fn garbage_never_panics() {
        for text in [
            "{",
            "a{b=\"c",
            "a{b=\"c\"} x",
            "a{=}",
            "\u{0}\u{1}{{}}",
            "a{b=\"\\",
        ] {
            let _ = parse(text);
        }
        assert!(parse("x 1\ny{a=\"1\"} 2").len() == 2);
    }
}
