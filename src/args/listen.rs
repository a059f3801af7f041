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

/// The admin listener's address (the status page, `/status.json`, `/metrics`): `flag`
/// (`--admin-listen`) as given, none for `off`, else on loopback at the public port + 1 (any
/// free port when the public one is 0).
pub fn admin_addr(flag: Option<&str>, public: &str) -> anyhow::Result<Option<String>> {
    match flag {
        Some("off") => return Ok(None),
        Some(addr) => return Ok(Some(addr.to_string())),
        None => {}
    }
    let port: u16 = public
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .with_context(|| format!("the listen address {public:?} has no port"))?;
    let admin = match port {
        0 | u16::MAX => 0,
        p => p + 1,
    };
    Ok(Some(format!("127.0.0.1:{admin}")))
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

    #[test]
    fn the_admin_listener_is_on_loopback_beside_the_public_port() {
        let admin = |flag, public| admin_addr(flag, public).unwrap();
        assert_eq!(
            admin(None, "0.0.0.0:8000").as_deref(),
            Some("127.0.0.1:8001")
        );
        assert_eq!(admin(None, "127.0.0.1:0").as_deref(), Some("127.0.0.1:0"));
        assert_eq!(admin(None, "[::]:65535").as_deref(), Some("127.0.0.1:0"));
        assert_eq!(
            admin(Some("0.0.0.0:9100"), "0.0.0.0:8000").as_deref(),
            Some("0.0.0.0:9100")
        );
        assert_eq!(admin(Some("off"), "0.0.0.0:8000"), None);
    }
}
