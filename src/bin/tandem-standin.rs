//! `tandem-standin`: a stand-in for a vLLM server on tandem's own engine, for tests and
//! benchmarks without a GPU (see the `tandem-standin` crate).

use clap::Parser;
use tandem_external::events::WireShape;
use tandem_standin::StandinConfig;

#[derive(Parser, Debug)]
#[command(
    name = "tandem-standin",
    about = "A vLLM stand-in on tandem's own engine"
)]
struct Args {
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Served model name.
    #[arg(long, default_value = "mocker")]
    model: String,
    /// Connector engine id (`remote_engine_id`); default: from the process id.
    #[arg(long)]
    engine_id: Option<String>,
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    #[arg(long, default_value_t = 4096)]
    device_blocks: u32,
    #[arg(long, default_value_t = 32768)]
    max_model_len: u32,
    /// Divide the mocker's step times by this (1e9: answer at once).
    #[arg(long, default_value_t = 1.0)]
    speedup_ratio: f64,
    /// ZMQ PUB endpoint to bind for KV events, e.g. tcp://127.0.0.1:5557.
    #[arg(long)]
    kv_events: Option<String>,
    /// ZMQ ROUTER endpoint to bind for replay.
    #[arg(long)]
    kv_replay: Option<String>,
    #[arg(long, default_value = "")]
    kv_topic: String,
    /// Event encoding: array (older vLLM, SGLang) or map (newest vLLM).
    #[arg(long, default_value = "array")]
    kv_wire: String,
    /// Host other stand-ins reach this one's KV side channel at.
    #[arg(long, default_value = "127.0.0.1")]
    advertise_host: String,
    /// Answer text only, as a plain OpenAI server does (no `return_token_ids`).
    #[arg(long, default_value_t = false)]
    text_only: bool,
    /// No GET /health (404), as llama.cpp's Python server or Ollama: GET /v1/models answers
    /// 503 while told unhealthy instead.
    #[arg(long, default_value_t = false)]
    no_health: bool,
    /// No GET /v1/models either (404): the server is seen up only by completing.
    #[arg(long, default_value_t = false)]
    no_models: bool,
    /// Take prompts as text only, as llama.cpp's Python server: token-id prompts get its 500,
    /// text and chat messages are read with the stand-in's own tokenizer and template.
    #[arg(long, default_value_t = false)]
    text_prompts: bool,
    /// A request that arrives while a stream runs ends that stream, as llama.cpp's Python
    /// server does (its `interrupt_requests`, on by default).
    #[arg(long, default_value_t = false)]
    interrupting: bool,
    /// LoRA adapters served, comma-separated, as vLLM's --lora-modules (`NAME` or
    /// `NAME=PATH`; the path is not read).
    #[arg(long, value_delimiter = ',')]
    lora_modules: Vec<String>,
    /// LoRA adapters one step may use (vLLM's --max-loras).
    #[arg(long, default_value_t = 1)]
    max_loras: usize,
    /// Put this token before every prompt, as a server whose tokenizer adds a BOS token the
    /// frontend's does not (it counts prompts one token longer and caches shifted blocks).
    #[arg(long)]
    add_bos: Option<u32>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = tandem_runtime::telemetry::init(tandem_runtime::telemetry::TelemetryConfig {
        json: false,
        filter: None,
        otlp: None,
    })?;
    let mut c = StandinConfig::new(&args.model);
    if let Some(id) = args.engine_id {
        c.engine_id = id;
    }
    c.block_size = args.block_size;
    c.device_blocks = args.device_blocks;
    c.max_model_len = args.max_model_len;
    c.speedup_ratio = args.speedup_ratio;
    c.kv_events = args.kv_events;
    c.kv_replay = args.kv_replay;
    c.topic = args.kv_topic;
    c.wire = match args.kv_wire.as_str() {
        "array" => WireShape::ArrayLike,
        "map" => WireShape::Map,
        other => anyhow::bail!("--kv-wire {other:?}: array or map"),
    };
    c.advertise_host = args.advertise_host;
    c.text_only = args.text_only;
    c.no_health = args.no_health;
    c.no_models = args.no_models;
    c.text_prompts = args.text_prompts;
    c.interrupting = args.interrupting;
    c.lora_modules = args
        .lora_modules
        .iter()
        .map(|m| {
            m.split_once('=')
                .map_or(m.as_str(), |(name, _)| name)
                .trim()
        })
        .filter(|m| !m.is_empty())
        .map(str::to_string)
        .collect();
    c.max_loras = args.max_loras;
    c.add_bos = args.add_bos;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen).await?;
        // Tests read the bound address from this line.
        println!("standin listening on http://{}", listener.local_addr()?);
        let stop = tokio_util::sync::CancellationToken::new();
        let on_signal = stop.clone();
        tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            on_signal.cancel();
        });
        tandem_standin::run(c, listener, stop).await?;
        Ok(())
    })
}
