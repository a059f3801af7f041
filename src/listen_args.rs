//! `--host` and `--port` on every role that listens, as vLLM's and SGLang's servers take
//! them; `--listen HOST:PORT` stays, as an alias for both. Each role keeps its own default
//! address (in its `--listen`'s default); `--host` or `--port` replaces that part of it, or
//! of the `--listen` given (on the command line or as `TANDEM_LISTEN`).
//!
//! They read no environment variable: `TANDEM_LISTEN` is the environment's form. Kubernetes
//! defines `TANDEM_PORT=tcp://…` in every pod of a namespace with a Service named `tandem`
//! (its service links), which a `TANDEM_PORT` flag would fail to parse.

use anyhow::Context as _;
use clap::Args;

/// The address a role binds, in parts.
#[derive(Args, Debug, Clone, Default)]
pub struct HostPort {
    /// Address to bind (default: the host of --listen).
    #[arg(long)]
    pub host: Option<String>,
    /// Port to bind, 0 for any free one (default: the port of --listen).
    #[arg(long)]
    pub port: Option<u16>,
}

impl HostPort {
    /// The address to bind: `listen` (the role's `--listen`, given or default) with the host
    /// and port replaced where given.
    pub fn resolve(&self, listen: &str) -> anyhow::Result<String> {
        if self.host.is_none() && self.port.is_none() {
            return Ok(listen.to_string());
        }
        let (host, port) = listen
            .rsplit_once(':')
            .with_context(|| format!("--listen {listen:?} is not HOST:PORT"))?;
        let host = self.host.as_deref().unwrap_or(host);
        let port = self
            .port
            .map_or_else(|| port.to_string(), |p| p.to_string());
        // An IPv6 literal takes brackets before a port.
        Ok(if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(host: Option<&str>, port: Option<u16>) -> HostPort {
        HostPort {
            host: host.map(str::to_string),
            port,
        }
    }

    #[test]
    fn host_and_port_replace_their_part_of_the_default() {
        assert_eq!(
            hp(None, None).resolve("0.0.0.0:8000").unwrap(),
            "0.0.0.0:8000"
        );
        assert_eq!(
            hp(None, Some(9000)).resolve("0.0.0.0:8000").unwrap(),
            "0.0.0.0:9000"
        );
        assert_eq!(
            hp(Some("127.0.0.1"), None).resolve("0.0.0.0:8000").unwrap(),
            "127.0.0.1:8000"
        );
        assert_eq!(
            hp(Some("::1"), Some(0)).resolve("[::]:7000").unwrap(),
            "[::1]:0"
        );
        assert_eq!(
            hp(Some("[::1]"), None).resolve("[::]:7000").unwrap(),
            "[::1]:7000"
        );
        assert!(hp(None, Some(1)).resolve("nonsense").is_err());
    }
}
