//! A single-member etcd on loopback.

use std::path::PathBuf;
use std::time::Duration;

use super::{
    Launch, Process, StartFailure, free_port, relaunch, start_on_free_ports, tcp_accepts, temp_dir,
    unique_name, wait_ready,
};
use crate::discovery::etcd::client::EtcdClient;
use crate::error::RuntimeError;

/// How to start etcd.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// The binary: a name looked up on PATH, or a path. Default `etcd`.
    pub binary: PathBuf,
    /// Member name prefix; a unique suffix is added. Default `tandem-etcd`.
    pub name: String,
    /// How long to wait for etcd to answer a read.
    pub ready_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            binary: PathBuf::from("etcd"),
            name: "tandem-etcd".into(),
            ready_timeout: Duration::from_secs(20),
        }
    }
}

/// A running etcd; killed and reaped on drop, its temporary directory removed.
#[derive(Debug)]
pub struct EtcdServer {
    options: EtcdOptions,
    /// Holds `data/` (the etcd data dir) and `etcd.log`.
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    /// `--name`, unique: the readiness probe checks the member list carries it.
    member_name: String,
    process: Option<Process>,
}

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it serves reads.
    pub async fn start(options: EtcdOptions) -> Result<Self, RuntimeError> {
        let dir = temp_dir("tandem-etcd-")?;
        let member_name = unique_name(&options.name);
        let mut server = EtcdServer {
            member_name,
            options,
            dir,
            client_port: 0,
            peer_port: 0,
            process: None,
        };
        start_on_free_ports(&mut server).await?;
        Ok(server)
    }

    /// The client URL, `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.client_port
    }

    /// etcd's data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// etcd's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// The process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Process::pid)
    }

    /// Kills etcd (SIGKILL) and reaps it. The data directory stays.
    pub fn stop(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill();
        }
    }

    /// Stops and starts again on the same ports with the same data.
    pub async fn restart(&mut self) -> Result<(), RuntimeError> {
        self.stop();
        relaunch(self).await
    }

    /// Stops, wipes the data directory, and starts a brand-new cluster on the same ports.
    pub async fn restart_fresh(&mut self) -> Result<(), RuntimeError> {
        self.stop();
        let data = self.data_dir();
        if data.exists() {
            std::fs::remove_dir_all(&data).map_err(RuntimeError::io("wiping etcd data"))?;
        }
        relaunch(self).await
    }

    fn args(&self) -> Vec<String> {
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let data = self.data_dir();
        vec![
            "--name".into(),
            self.member_name.clone(),
            "--data-dir".into(),
            data.display().to_string(),
            "--listen-client-urls".into(),
            client.clone(),
            "--advertise-client-urls".into(),
            client,
            "--listen-peer-urls".into(),
            peer.clone(),
            "--initial-advertise-peer-urls".into(),
            peer.clone(),
            "--initial-cluster".into(),
            format!("{}={peer}", self.member_name),
            "--initial-cluster-state".into(),
            "new".into(),
            "--initial-cluster-token".into(),
            "tandem".into(),
        ]
    }
}

impl Launch for EtcdServer {
    const WHAT: &'static str = "etcd";

    fn pick_ports(&mut self) -> Result<(), RuntimeError> {
        self.client_port = free_port()?;
        self.peer_port = free_port()?;
        Ok(())
    }

    async fn launch(&mut self) -> Result<(), StartFailure> {
        let log = self.log_path();
        let mut process = Process::spawn(&self.options.binary, &self.args(), &log, "etcd-server")
            .map_err(StartFailure::Fatal)?;
        let endpoint = self.endpoint();
        let port = self.client_port;
        let name = &self.member_name;
        wait_ready(
            &mut process,
            "etcd",
            &log,
            self.options.ready_timeout,
            || probe(port, endpoint.clone(), name),
        )
        .await?;
        self.process = Some(process);
        Ok(())
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Ready = accepts TCP, is our member, and answers a linearizable read (so it has a leader).
async fn probe(port: u16, endpoint: String, name: &str) -> bool {
    if tcp_accepts(port).await.is_none() {
        return false;
    }
    let check = async {
        let endpoints = [endpoint];
        let mut client = EtcdClient::connect(&endpoints, Duration::from_millis(500), None)
            .await
            .ok()?;
        let members = client.member_list().await.ok()?;
        if !members.members.iter().any(|m| m.name == name) {
            return None;
        }
        client.get("/tandem/health-probe").await.ok()
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), check).await,
        Ok(Some(_))
    )
}
