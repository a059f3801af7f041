//! The least an HTTP/1.1 proxy built on hyper costs: the floor under every gateway in
//! `scripts/bench-gateways.sh` (its `floor` row), to read each gateway's own work off.
//!
//! It passes each request's body to one server and the answer's body back, parsing neither:
//! no routing, no tokens, no metrics. Each of `THREADS` threads runs a single-threaded
//! runtime with its own listener on the one port (`SO_REUSEPORT`: the kernel spreads the
//! connections) and its own keep-alive connections to the server, as tandem's serving
//! threads do (`tandem_runtime::serving`).
//!
//! Usage: `tandem-floor-proxy LISTEN SERVER [THREADS]`, e.g.
//! `tandem-floor-proxy 127.0.0.1:8001 127.0.0.1:8000 2`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;

type Sender = SendRequest<Full<Bytes>>;

/// One thread's idle connections to the server (a lock no other thread takes).
type Idle = Arc<Mutex<Vec<Sender>>>;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, server, rest @ ..] = &args[..] else {
        anyhow::bail!("usage: tandem-floor-proxy LISTEN SERVER [THREADS]");
    };
    let listen: SocketAddr = listen.parse().context("LISTEN")?;
    let server: SocketAddr = server.parse().context("SERVER")?;
    let threads: usize = match rest.first() {
        Some(n) => n.parse().context("THREADS")?,
        None => 2,
    };
    let handles: Vec<_> = (0..threads.max(1))
        .map(|_| std::thread::spawn(move || serve(listen, server)))
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("a serving thread panicked"))??;
    }
    Ok(())
}

/// One thread: accepts on its own listener and serves each connection on its runtime.
fn serve(listen: SocketAddr, server: SocketAddr) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Tasks spawned on a single-threaded runtime stay on its thread.
    rt.block_on(async move {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.bind(listen)?;
        let listener = socket.listen(1024)?;
        let idle: Idle = Arc::default();
        let host = HeaderValue::from_str(&server.to_string())?;
        loop {
            let (tcp, _) = listener.accept().await?;
            tcp.set_nodelay(true)?;
            let (idle, host) = (idle.clone(), host.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    pass(req, idle.clone(), server, host.clone())
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    })
}

/// Sends one request on to the server and its answer back; a 502 when the server fails.
async fn pass(
    req: Request<hyper::body::Incoming>,
    idle: Idle,
    server: SocketAddr,
    host: HeaderValue,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let answer = async {
        let (parts, body) = req.into_parts();
        let body = body.collect().await?.to_bytes();
        let mut sender = connection(&idle, server).await?;
        let mut out = Request::builder().method(parts.method).uri(parts.uri);
        out = out.header(HOST, host);
        if let Some(t) = parts.headers.get(CONTENT_TYPE) {
            out = out.header(CONTENT_TYPE, t);
        }
        let resp = sender.send_request(out.body(Full::new(body))?).await?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        idle.lock().push(sender);
        Ok::<_, anyhow::Error>(Response::from_parts(parts, Full::new(body)))
    };
    Ok(answer.await.unwrap_or_else(|e| {
        let mut r = Response::new(Full::new(Bytes::from(e.to_string())));
        *r.status_mut() = StatusCode::BAD_GATEWAY;
        r
    }))
}

/// An idle connection to the server that is still open, else a new one.
async fn connection(idle: &Idle, server: SocketAddr) -> anyhow::Result<Sender> {
    loop {
        let Some(mut sender) = idle.lock().pop() else {
            break;
        };
        if sender.ready().await.is_ok() {
            return Ok(sender);
        }
    }
    let tcp = tokio::net::TcpStream::connect(server).await?;
    tcp.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}
