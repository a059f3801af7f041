//! Real etcd and nats-server processes, for the local multi-process mode (`tandem up
//! --processes`) and for integration tests, and [`ProcessGroup`] for the roles of that mode.
//!
//! Each server runs on free loopback ports (bind `127.0.0.1:0`, read the port, release it;
//! retried on the rare collision), keeps its data and log in a temporary directory (never on our
//! stdout), is waited on until it answers, and is killed and reaped when stopped or dropped: no
//! process outlives its handle. `restart` keeps the ports (and, for etcd, the data unless
//! `restart_fresh`), which is what fault-injection tests need.
//!
//! Binaries are looked up on `PATH` by the OS when spawning (no environment is read here); a
//! missing one is a [`RuntimeError::MissingBinary`] naming the Debian package to install.

mod etcd;
mod group;
mod nats;

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::RuntimeError;

pub use etcd::{EtcdOptions, EtcdServer};
pub use group::{ProcessGroup, terminate};
pub use nats::{NatsOptions, NatsServer};

/// How often readiness is polled while a server starts.
const READY_POLL: Duration = Duration::from_millis(50);

/// How many times a first start picks new ports after the server died at once (port taken).
const PORT_ATTEMPTS: usize = 3;

/// A name no other server started by this process (or another) has: readiness probes check
/// it, so a server of someone else's that grabbed our port is never mistaken for ours.
fn unique_name(base: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{base}-{}-{n}", std::process::id())
}

/// Ports [`free_port`] hands out: below Linux's default ephemeral range (32768–60999), from
/// which the kernel picks the source port of every outgoing connection and the port of every
/// `bind(…:0)`. A port taken from that range and released could be reused by either before the
/// server meant for it binds it (a connection a test makes meanwhile, a worker binding port 0);
/// one from here can only be taken by a process that names it.
const PICKED_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A free TCP port on 127.0.0.1, for a server that binds it later (a child process started
/// with it on its command line). Each call in a process gets another port (a counter walks
/// [`PICKED_PORTS`] from a place set by the process id, so concurrent test processes start far
/// apart) that binds at the moment of the call. Another process may still take it before the
/// server binds it; starts retry.
pub fn free_port() -> Result<u16, RuntimeError> {
    static NEXT: AtomicU64 = AtomicU64::new(u64::MAX);
    let span = u64::from(PICKED_PORTS.end - PICKED_PORTS.start);
    let _ = NEXT.compare_exchange(
        u64::MAX,
        u64::from(std::process::id()).wrapping_mul(2_654_435_761) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = PICKED_PORTS.start + n as u16;
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(port);
        }
    }
    // Every port of the range in use: let the kernel pick one.
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(RuntimeError::io("picking a free port"))
}

/// A child process that is killed and reaped when dropped.
#[derive(Debug)]
struct Process {
    child: Child,
}

impl Process {
    /// Spawns `binary args..` with stdout and stderr appended to `log`.
    fn spawn(
        binary: &Path,
        args: &[String],
        log: &Path,
        package: &'static str,
    ) -> Result<Self, RuntimeError> {
        let log_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(RuntimeError::io("opening server log"))?;
        let log_err = log_file
            .try_clone()
            .map_err(RuntimeError::io("opening server log"))?;
        let child = Command::new(binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err)
            .spawn()
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => RuntimeError::MissingBinary {
                    binary: binary.display().to_string(),
                    package,
                },
                _ => RuntimeError::Io {
                    op: "spawning server",
                    source: e,
                },
            })?;
        Ok(Process { child })
    }

    /// The exit status if the process has ended.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills (SIGKILL: a crash, as far as the server can tell) and reaps.
    fn kill(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Why a start attempt failed.
enum StartFailure {
    /// The process exited during startup (typically: port already taken).
    Exited(String),
    /// Anything else (timeout, spawn error): not worth retrying on other ports.
    Fatal(RuntimeError),
}

impl StartFailure {
    fn into_error(self, what: &'static str) -> RuntimeError {
        match self {
            StartFailure::Fatal(e) => e,
            StartFailure::Exited(detail) => RuntimeError::StartFailed { what, detail },
        }
    }
}

/// A server process this module launches: how to pick its ports and start it once.
trait Launch {
    /// The binary's name, for errors.
    const WHAT: &'static str;
    /// Picks new free ports for the next start.
    fn pick_ports(&mut self) -> Result<(), RuntimeError>;
    /// Spawns the server on its current ports and waits until it answers.
    async fn launch(&mut self) -> Result<(), StartFailure>;
}

/// A first start: on new free ports each attempt, since a port picked free can be taken
/// before the server binds it (the server then exits at once).
async fn start_on_free_ports<S: Launch>(server: &mut S) -> Result<(), RuntimeError> {
    let mut last = String::new();
    for _ in 0..PORT_ATTEMPTS {
        server.pick_ports()?;
        match server.launch().await {
            Ok(()) => return Ok(()),
            Err(StartFailure::Exited(detail)) => last = detail,
            Err(fatal) => return Err(fatal.into_error(S::WHAT)),
        }
    }
    Err(StartFailure::Exited(last).into_error(S::WHAT))
}

/// A restart on the ports of the first start.
async fn relaunch<S: Launch>(server: &mut S) -> Result<(), RuntimeError> {
    server.launch().await.map_err(|f| f.into_error(S::WHAT))
}

/// Polls `probe` until it succeeds, the process exits, or `timeout` passes.
async fn wait_ready<F, Fut>(
    process: &mut Process,
    what: &'static str,
    log: &Path,
    timeout: Duration,
    mut probe: F,
) -> Result<(), StartFailure>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = process.exited() {
            return Err(StartFailure::Exited(format!(
                "exited with {status} during startup; log tail:\n{}",
                log_tail(log)
            )));
        }
        if probe().await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StartFailure::Fatal(RuntimeError::StartFailed {
                what,
                detail: format!("not ready after {timeout:?}; log tail:\n{}", log_tail(log)),
            }));
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

/// The last couple of KiB of a log, for error messages.
fn log_tail(path: &Path) -> String {
    const TAIL: u64 = 2048;
    let read = || -> std::io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(TAIL)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    read().unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()))
}

/// A temporary directory for a server's data and log.
fn temp_dir(prefix: &str) -> Result<tempfile::TempDir, RuntimeError> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(RuntimeError::io("creating a temporary directory"))
}

/// Whether something accepts TCP connections on 127.0.0.1:`port`.
async fn tcp_accepts(port: u16) -> Option<tokio::net::TcpStream> {
    tokio::time::timeout(
        Duration::from_millis(500),
        tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)),
    )
    .await
    .ok()
    .and_then(Result::ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picked_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ports: Vec<u16> = (0..64).map(|_| free_port().unwrap()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for p in ports {
            assert!(PICKED_PORTS.contains(&p), "{p}");
        }
        let held = TcpListener::bind((Ipv4Addr::LOCALHOST, free_port().unwrap())).unwrap();
        assert!(PICKED_PORTS.contains(&held.local_addr().unwrap().port()));
    }
}
