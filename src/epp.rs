//! `tandem epp`: the frontend's router as a Gateway API Inference Extension endpoint picker
//! (Envoy ext_proc). Flags become [`tandem_frontend::epp::EppConfig`]; the service is
//! [`tandem_frontend::epp::run_epp`].

use std::time::Duration;

use anyhow::Context;
use clap::{ArgAction, Args};
use tandem_frontend::epp::{EppConfig, run_epp};
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;

use crate::serve::{HttpArgs, PlaneArgs, frontend_config};

/// `tandem epp`. Only decode workers that register an HTTP endpoint can be picked: sidecars
/// in front of vLLM or SGLang (`tandem decode --engine vllm …`, whose engine's address is
/// `--engine-url`'s or `--engine-advertise`); mocker workers cannot.
#[derive(Args, Debug, Clone)]
pub struct EppArgs {
    #[command(flatten)]
    pub plane: PlaneArgs,
    #[command(flatten)]
    pub routing: crate::args::routing::RoutingArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub flow: crate::args::flow::FlowArgs,
    /// gRPC listen address (ext_proc and grpc.health.v1; or --host and --port); GIE's default
    /// port is 9002.
    #[arg(long, env = "TANDEM_LISTEN", default_value = "0.0.0.0:9002")]
    pub listen: String,
    #[command(flatten)]
    pub host_port: crate::args::listen::HostPort,
    /// Serve Prometheus `GET /metrics` on this address (unset: no metrics listener).
    #[arg(long, env = "TANDEM_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Tokens per KV block (must match the workers').
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// Endpoints named after the chosen one in `x-gateway-destination-endpoint`, for the
    /// gateway to fall back on (the policy's next choices).
    #[arg(long, env = "TANDEM_EPP_FALLBACKS", default_value_t = 1)]
    pub fallbacks: usize,
    /// Share active-sequence deltas with frontends and other pickers of the namespace.
    #[arg(long, env = "TANDEM_REPLICA_SYNC", default_value_t = true, action = ArgAction::Set)]
    pub replica_sync: bool,
}

pub async fn run(args: EppArgs) -> anyhow::Result<()> {
    let _telemetry = args.plane.init_telemetry("tandem-epp", None)?;
    let mut fc = frontend_config(
        &args.plane.namespace,
        &args.routing,
        &args.http,
        args.block_size,
        None,
        args.replica_sync,
    )?;
    args.flow.apply(&mut fc)?;
    let cfg = EppConfig {
        view: fc.view,
        http: fc.http,
        tokenizer: fc.tokenizer,
        backend: fc.backend,
        fallbacks: args.fallbacks,
        drain_timeout: Duration::from_secs(args.http.drain_timeout_s),
    };
    let listen = args.host_port.resolve(&args.listen)?;
    let listener = TcpListener::bind(&listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let metrics = match &args.metrics_addr {
        Some(a) => Some(
            TcpListener::bind(a)
                .await
                .with_context(|| format!("binding {a}"))?,
        ),
        None => None,
    };
    let deps = args.plane.connect("epp").await?;
    let shutdown = Shutdown::new();
    tandem_runtime::shutdown::shutdown_on_signals(shutdown.clone());
    run_epp(cfg, listener, metrics, deps, shutdown).await?;
    Ok(())
}
