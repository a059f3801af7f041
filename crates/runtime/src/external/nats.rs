//! A nats-server on loopback (core NATS only).

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use super::{
    Launch, Process, StartFailure, free_port, relaunch, start_on_free_ports, tcp_accepts, temp_dir,
    unique_name, wait_ready,
};
use crate::error::RuntimeError;

/// How to start nats-server.
#[derive(Clone, Debug)]
pub struct NatsOptions {
    /// The binary: a name looked up on PATH, or a path. Default `nats-server`.
    pub binary: PathBuf,
    /// Extra command-line arguments (e.g. `--user u --pass p`).
    pub extra_args: Vec<String>,
    /// How long to wait for the server to greet a client.
    pub ready_timeout: Duration,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            binary: PathBuf::from("nats-server"),
            extra_args: Vec::new(),
            ready_timeout: Duration::from_secs(10),
        }
    }
}

/// A running nats-server; killed and reaped on drop.
#[derive(Debug)]
pub struct NatsServer {
    options: NatsOptions,
    /// Holds `nats.log`.
    dir: tempfile::TempDir,
    port: u16,
    /// `--name`, unique: the readiness probe checks the greeting carries it.
    server_name: String,
    process: Option<Process>,
}

impl NatsServer {
    /// Starts nats-server on a free loopback port and waits for its INFO greeting.
    pub async fn start(options: NatsOptions) -> Result<Self, RuntimeError> {
        let dir = temp_dir("tandem-nats-")?;
        let mut server = NatsServer {
            options,
            dir,
            port: 0,
            server_name: unique_name("tandem-nats"),
            process: None,
        };
        start_on_free_ports(&mut server).await?;
        Ok(server)
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats.log")
    }

    /// The process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Process::pid)
    }

    /// Kills the server (SIGKILL) and reaps it.
    pub fn stop(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill();
        }
    }

    /// Stops and starts again on the same port.
    pub async fn restart(&mut self) -> Result<(), RuntimeError> {
        self.stop();
        relaunch(self).await
    }
}

impl Launch for NatsServer {
    const WHAT: &'static str = "nats-server";

    fn pick_ports(&mut self) -> Result<(), RuntimeError> {
        self.port = free_port()?;
        Ok(())
    }

    async fn launch(&mut self) -> Result<(), StartFailure> {
        let log = self.log_path();
        let mut args = vec![
            "--addr".to_string(),
            "127.0.0.1".into(),
            "--port".into(),
            self.port.to_string(),
            "--name".into(),
            self.server_name.clone(),
        ];
        args.extend(self.options.extra_args.iter().cloned());
        let mut process = Process::spawn(&self.options.binary, &args, &log, "nats-server")
            .map_err(StartFailure::Fatal)?;
        let port = self.port;
        let name = &self.server_name;
        wait_ready(
            &mut process,
            "nats-server",
            &log,
            self.options.ready_timeout,
            || probe(port, name),
        )
        .await?;
        self.process = Some(process);
        Ok(())
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Ready = accepts TCP and greets with an `INFO {...}` line naming our server.
async fn probe(port: u16, name: &str) -> bool {
    let Some(stream) = tcp_accepts(port).await else {
        return false;
    };
    let mut line = String::new();
    let mut reader = BufReader::new(stream);
    let read = tokio::time::timeout(Duration::from_secs(1), reader.read_line(&mut line)).await;
    matches!(read, Ok(Ok(n)) if n > 0)
        && line.starts_with("INFO ")
        && line.contains(&format!("\"server_name\":\"{name}\""))
}
