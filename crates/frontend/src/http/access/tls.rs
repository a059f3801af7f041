//! TLS on the HTTP listener: [`TlsConfig`] (PEM certificate chain and private key files,
//! read once at start), and the listener [`crate::http::serve_tls`] serves on.
//!
//! rustls with its ring provider, the crypto already in the process for the NATS client (no
//! second crypto backend), TLS 1.3 only (rustls' TLS 1.2 is a feature nothing else here
//! builds; every current client speaks 1.3), ALPN `http/1.1` (the server speaks HTTP/1.1).
//!
//! Handshakes run beside each other inside the listener, at most [`MAX_HANDSHAKES`] at once
//! and each for at most [`HANDSHAKE_TIMEOUT`], so that a slow or silent client delays no
//! other connection; a failed handshake (a plain-HTTP client, a wrong certificate on the
//! client's side) closes that connection and nothing else. TCP_NODELAY is set on every
//! accepted socket, as in [`crate::http::serve`].

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;

/// The certificate and key of the HTTP listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM: the server certificate first, then its intermediates.
    pub cert: PathBuf,
    /// PEM: the private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Why the certificate or key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS certificate {path}: {message}")]
    Cert { path: PathBuf, message: String },
    #[error("TLS private key {path}: {message}")]
    Key { path: PathBuf, message: String },
    #[error("TLS certificate {cert} with key {key}: {source}")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

/// Most handshakes in progress at once; more connections wait in the kernel's backlog.
pub const MAX_HANDSHAKES: usize = 256;
/// A client that has not finished its handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The server side of `cfg`, ready to accept.
pub fn load(cfg: &TlsConfig) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs = read_certs(&cfg.cert)?;
    let key = PrivateKeyDer::from_pem_file(&cfg.key).map_err(|e| TlsError::Key {
        path: cfg.key.clone(),
        message: pem_message(&e, "private key"),
    })?;
    let config_error = |source| TlsError::Config {
        cert: cfg.cert.clone(),
        key: cfg.key.clone(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(config_error)?
        .with_no_client_auth()
        // Also checks that the key is the certificate's.
        .with_single_cert(certs, key)
        .map_err(config_error)?;
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(server))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |message: String| TlsError::Cert {
        path: path.to_path_buf(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(pem_message(&e, "certificate")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(pem_message(&e, "certificate")))?;
    if certs.is_empty() {
        return Err(err(
            "no certificate in the file (PEM `CERTIFICATE` blocks expected)".to_string(),
        ));
    }
    Ok(certs)
}

fn pem_message(e: &rustls::pki_types::pem::Error, what: &str) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::NoItemsFound => format!("no {what} in the file (PEM expected)"),
        Error::Io(io) => io.to_string(),
        other => format!("not a PEM {what}: {other:?}"),
    }
}

type Handshake = Pin<Box<dyn Future<Output = Option<(TlsStream<TcpStream>, SocketAddr)>> + Send>>;

/// A TCP listener that yields connections after their TLS handshake (for `axum::serve`).
pub(crate) struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    handshakes: FuturesUnordered<Handshake>,
}

impl TlsListener {
    pub(crate) fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> Self {
        TlsListener {
            tcp,
            acceptor: TlsAcceptor::from(config),
            handshakes: FuturesUnordered::new(),
        }
    }

    fn start_handshake(&mut self, tcp: TcpStream, peer: SocketAddr) {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set");
        }
        let accept = self.acceptor.accept(tcp);
        self.handshakes.push(Box::pin(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept).await {
                Ok(Ok(tls)) => Some((tls, peer)),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    None
                }
            }
        }));
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    /// Cancel-safe: handshakes in progress live in `self`, and a TCP accept is cancel-safe.
    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let room = self.handshakes.len() < MAX_HANDSHAKES;
            tokio::select! {
                accepted = self.tcp.accept(), if room => match accepted {
                    Ok((tcp, peer)) => self.start_handshake(tcp, peer),
                    Err(e) => accept_error(e).await,
                },
                Some(done) = self.handshakes.next(), if !self.handshakes.is_empty() => {
                    if let Some(conn) = done {
                        return conn;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// As axum's own TCP listener: a connection that died before it was accepted is nothing;
/// anything else (out of file descriptors) is logged and waited out.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accepting a connection failed");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
