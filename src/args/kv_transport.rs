//! `--kv-transport` and the UCX / TCP settings beside it: how a worker process (or every
//! worker of `tandem up`) moves KV between workers.

use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use tandem_kv_transfer::{Transport, TransportConfig, TransportKind};

/// How KV moves between workers.
#[derive(Args, Debug, Clone)]
pub struct KvTransportArgs {
    /// ucx, tcp, local (one process), or inline (on the gRPC stream). Default: ucx when UCX
    /// initialises here, else tcp.
    #[arg(long, env = "TANDEM_KV_TRANSPORT")]
    pub kv_transport: Option<String>,
    /// UCX network devices (UCX_NET_DEVICES), e.g. `lo` or `mlx5_0:1`.
    #[arg(long, env = "TANDEM_UCX_NET_DEVICES")]
    pub ucx_net_devices: Option<String>,
    /// UCX transports (UCX_TLS), e.g. `tcp` or `rc,sm`.
    #[arg(long, env = "TANDEM_UCX_TLS")]
    pub ucx_tls: Option<String>,
    /// Host other workers reach this one's TCP KV listener at.
    #[arg(long, env = "TANDEM_KV_ADVERTISE_HOST")]
    pub kv_advertise_host: Option<String>,
    /// TCP KV listener address.
    #[arg(long, env = "TANDEM_KV_LISTEN", default_value = "127.0.0.1:0")]
    pub kv_listen: String,
    /// Decode workers check each remote prefill's KV against a digest the prefill worker
    /// computes (a corrupted transfer falls back to a local prefill). `--kv-digest=false`
    /// skips it on both sides, for fabrics that check what they carry: on a GPU the digest
    /// reads every block back to the host (crates/kv-transfer/BENCHMARKS.md).
    #[arg(long, env = "TANDEM_KV_DIGEST", default_value_t = true, action = clap::ArgAction::Set)]
    pub kv_digest: bool,
    /// Prefill workers send each layer's K/V of the blocks a step computes as soon as the
    /// layer is done, so the transfer overlaps the rest of the forward pass;
    /// `--kv-layer-streaming=false` sends each block whole when its step ends.
    #[arg(long, env = "TANDEM_KV_LAYER_STREAMING", default_value_t = true, action = clap::ArgAction::Set)]
    pub kv_layer_streaming: bool,
}

impl KvTransportArgs {
    /// The flags that give a worker process these settings (`tandem up --processes`); the
    /// listen address stays each worker's own.
    pub fn to_worker_args(&self) -> Vec<String> {
        [
            ("kv-transport", &self.kv_transport),
            ("ucx-net-devices", &self.ucx_net_devices),
            ("ucx-tls", &self.ucx_tls),
            ("kv-advertise-host", &self.kv_advertise_host),
        ]
        .into_iter()
        .filter_map(|(flag, v)| v.as_ref().map(|v| format!("--{flag}={v}")))
        .chain([
            format!("--kv-digest={}", self.kv_digest),
            format!("--kv-layer-streaming={}", self.kv_layer_streaming),
        ])
        .collect()
    }

    /// The process's KV transport; None for `inline`.
    pub async fn open(&self) -> anyhow::Result<Option<Arc<dyn Transport>>> {
        let kind = match self.kv_transport.as_deref() {
            Some("inline") => return Ok(None),
            Some(k) => k.parse::<TransportKind>().context("--kv-transport")?,
            None => tandem_kv_transfer::default_kind(),
        };
        let mut cfg = TransportConfig {
            tcp_bind: self.kv_listen.parse().context("--kv-listen")?,
            tcp_advertise_host: self.kv_advertise_host.clone(),
            ..Default::default()
        };
        cfg.ucx.net_devices = self.ucx_net_devices.clone();
        cfg.ucx.tls = self.ucx_tls.clone();
        let t = tandem_kv_transfer::open(kind, &cfg)
            .await
            .with_context(|| format!("opening the {} KV transport", kind.as_str()))?;
        Ok(Some(t))
    }
}
