//! Local mode: each replica is a `tandem prefill` / `tandem decode` child process.
//!
//! - A child runs in its own process group (a Ctrl-C at the planner's terminal does not reach
//!   it: the planner drains its workers itself), with the pool's flags: `common_args`, then
//!   the pool's own (`--worker-args`, `--prefill-args`, `--decode-args`), and its output in
//!   `<log_dir>/<role>-<n>.log` (or the planner's own).
//! - Scale-down takes the newest worker: SIGTERM to its group (the worker deregisters,
//!   refuses new requests, finishes the ones in flight and exits), then waits for it in the
//!   background; SIGKILL only after `drain_timeout`. A draining worker no longer counts.
//! - A worker that exits on its own is reaped and logged; the pool is short by one until the
//!   planner sets the count again (a count below the minimum is restored at once).
//! - Dropping [`Local`] kills what is left (`kill_on_drop`); [`Actuator::shutdown`] drains
//!   everything first.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

use super::Actuator;
use crate::Pool;
use crate::error::PlannerError;

/// How to start workers.
#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// The `tandem` binary.
    pub program: PathBuf,
    /// Flags of every worker after the subcommand (etcd, NATS, engine settings, …).
    pub common_args: Vec<String>,
    pub prefill_args: Vec<String>,
    pub decode_args: Vec<String>,
    /// Each worker's output in `<dir>/<role>-<n>.log`; None: inherited.
    pub log_dir: Option<PathBuf>,
    /// How long a worker may take to drain before it is killed.
    pub drain_timeout: Duration,
}

#[derive(Debug)]
struct Worker {
    name: String,
    child: Child,
}

/// The local actuator.
#[derive(Debug)]
pub struct Local {
    cfg: LocalConfig,
    /// Running workers per pool, oldest first.
    pools: [Vec<Worker>; 2],
    /// Workers draining, each awaited (and killed past the timeout) by its own task.
    draining: JoinSet<()>,
    started: u64,
}

impl Local {
    pub fn new(cfg: LocalConfig) -> Self {
        Local {
            cfg,
            pools: [Vec::new(), Vec::new()],
            draining: JoinSet::new(),
            started: 0,
        }
    }

    /// Process ids of the pool's running workers, oldest first.
    pub fn pids(&self, pool: Pool) -> Vec<u32> {
        self.pools[pool.index()]
            .iter()
            .filter_map(|w| w.child.id())
            .collect()
    }

    /// Workers still draining.
    pub fn draining(&self) -> usize {
        self.draining.len()
    }

    /// Drops workers that exited on their own, and finished drains.
    fn reap(&mut self) {
        while let Some(done) = self.draining.try_join_next() {
            if let Err(e) = done {
                tracing::warn!(error = %e, "a drain task failed");
            }
        }
        for pool in Pool::ALL {
            self.pools[pool.index()].retain_mut(|w| match w.child.try_wait() {
                Ok(None) => true,
                Ok(Some(status)) => {
                    tracing::warn!(worker = %w.name, %status, "worker exited on its own");
                    false
                }
                Err(e) => {
                    tracing::warn!(worker = %w.name, error = %e, "cannot wait for worker");
                    false
                }
            });
        }
    }

    fn spawn(&mut self, pool: Pool) -> Result<(), PlannerError> {
        self.started += 1;
        let name = format!("{pool}-{}", self.started);
        let own = match pool {
            Pool::Prefill => &self.cfg.prefill_args,
            Pool::Decode => &self.cfg.decode_args,
        };
        let mut cmd = Command::new(&self.cfg.program);
        cmd.arg(pool.as_str())
            .args(&self.cfg.common_args)
            .args(own)
            .stdin(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(dir) = &self.cfg.log_dir {
            let path = dir.join(format!("{name}.log"));
            let io = |source| PlannerError::Io {
                what: format!("creating {}", path.display()),
                source,
            };
            let out = std::fs::File::create(&path).map_err(io)?;
            let err = out.try_clone().map_err(io)?;
            cmd.stdout(out).stderr(err);
        }
        let child = cmd.spawn().map_err(|source| PlannerError::Io {
            what: format!("starting {} {pool}", self.cfg.program.display()),
            source,
        })?;
        tracing::info!(worker = %name, pid = child.id(), "worker started");
        self.pools[pool.index()].push(Worker { name, child });
        Ok(())
    }

    /// SIGTERM to the worker's process group, then await its exit in the background.
    fn drain(&mut self, mut w: Worker) {
        let timeout = self.cfg.drain_timeout;
        match w.child.id() {
            Some(pid) => terminate_group(pid),
            None => return,
        }
        tracing::info!(worker = %w.name, "draining worker (SIGTERM)");
        self.draining.spawn(async move {
            match tokio::time::timeout(timeout, w.child.wait()).await {
                Ok(Ok(status)) => tracing::info!(worker = %w.name, %status, "worker drained"),
                Ok(Err(e)) => tracing::warn!(worker = %w.name, error = %e, "waiting for worker"),
                Err(_) => {
                    tracing::warn!(worker = %w.name, ?timeout, "drain timed out: killing");
                    let _ = w.child.kill().await;
                }
            }
        });
    }
}

/// SIGTERM to the process group led by `pid` (the worker and anything it started).
fn terminate_group(pid: u32) {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::TERM);
    }
}

#[async_trait]
impl Actuator for Local {
    async fn replicas(&mut self, pool: Pool) -> Result<u32, PlannerError> {
        self.reap();
        Ok(self.pools[pool.index()].len() as u32)
    }

    async fn set(&mut self, pool: Pool, n: u32) -> Result<(), PlannerError> {
        self.reap();
        while self.pools[pool.index()].len() < n as usize {
            self.spawn(pool)?;
        }
        while self.pools[pool.index()].len() > n as usize {
            let newest = self.pools[pool.index()]
                .pop()
                .expect("more than n ≥ 0 workers");
            self.drain(newest);
        }
        Ok(())
    }

    async fn shutdown(&mut self) -> Result<(), PlannerError> {
        for pool in Pool::ALL {
            self.set(pool, 0).await?;
        }
        while let Some(done) = self.draining.join_next().await {
            if let Err(e) = done {
                tracing::warn!(error = %e, "a drain task failed");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// A local actuator whose "binary" is a shell script (called as `script <role>`).
    fn with_script(tag: &str, script: &str, drain_timeout: Duration) -> (Local, PathBuf) {
        let dir = std::env::temp_dir().join(format!("tandem-planner-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let program = dir.join("worker.sh");
        std::fs::write(&program, format!("#!/bin/sh\n{script}\n")).unwrap();
        let mut perms = std::fs::metadata(&program).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&program, perms).unwrap();
        let local = Local::new(LocalConfig {
            program,
            common_args: vec!["--common".into()],
            prefill_args: vec!["--p".into()],
            decode_args: vec!["--d".into()],
            log_dir: Some(dir.clone()),
            drain_timeout,
        });
        (local, dir)
    }

    /// Waits until `file` in `dir` contains `what` (the script has set its traps).
    async fn wait_for(dir: &std::path::Path, file: &str, what: &str) {
        let started = Instant::now();
        while !std::fs::read_to_string(dir.join(file))
            .unwrap_or_default()
            .contains(what)
        {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{file}: no {what:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn alive(pid: u32) -> bool {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z ")
    }

    #[tokio::test]
    async fn scale_up_and_down_drains_the_newest() {
        // Prints its arguments, exits 0 on SIGTERM.
        let (mut local, dir) = with_script(
            "drain",
            "trap 'echo drained; exit 0' TERM; echo \"$@\" ready; while :; do sleep 0.05; done",
            Duration::from_secs(20),
        );
        local.set(Pool::Decode, 3).await.unwrap();
        local.set(Pool::Prefill, 1).await.unwrap();
        assert_eq!(local.replicas(Pool::Decode).await.unwrap(), 3);
        assert_eq!(local.replicas(Pool::Prefill).await.unwrap(), 1);
        let pids = local.pids(Pool::Decode);
        for n in 1..=3 {
            wait_for(&dir, &format!("decode-{n}.log"), "ready").await;
        }
        local.set(Pool::Decode, 1).await.unwrap();
        assert_eq!(local.replicas(Pool::Decode).await.unwrap(), 1);
        assert_eq!(local.pids(Pool::Decode), pids[..1], "the oldest stays");
        let started = Instant::now();
        while local.draining() > 0 {
            assert!(started.elapsed() < Duration::from_secs(10), "drains finish");
            tokio::time::sleep(Duration::from_millis(20)).await;
            local.reap();
        }
        assert!(!alive(pids[1]) && !alive(pids[2]));
        assert!(alive(pids[0]));
        // Each got its role and flags, and the drained ones saw SIGTERM (not SIGKILL).
        let log = |n| std::fs::read_to_string(dir.join(format!("decode-{n}.log"))).unwrap();
        assert!(log(1).starts_with("decode --common --d"), "{}", log(1));
        assert!(log(2).contains("drained") && log(3).contains("drained"));
        let p = std::fs::read_to_string(dir.join("prefill-4.log")).unwrap();
        assert!(p.starts_with("prefill --common --p"), "{p}");
        local.shutdown().await.unwrap();
        assert!(!alive(pids[0]));
        assert_eq!(local.replicas(Pool::Prefill).await.unwrap(), 0);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_worker_that_will_not_drain_is_killed_past_the_timeout() {
        // Ignores SIGTERM (the ignored disposition is inherited by `sleep` too).
        let (mut local, dir) = with_script(
            "stubborn",
            "trap '' TERM; echo ready; while :; do sleep 0.05; done",
            // Long enough that the check below runs before the kill on a stalled machine.
            Duration::from_secs(2),
        );
        local.set(Pool::Prefill, 1).await.unwrap();
        let pid = local.pids(Pool::Prefill)[0];
        wait_for(&dir, "prefill-1.log", "ready").await;
        local.set(Pool::Prefill, 0).await.unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(alive(pid), "SIGTERM alone does not stop it");
        let started = Instant::now();
        local.shutdown().await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(!alive(pid), "killed after the drain timeout");
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_worker_that_exits_on_its_own_stops_counting() {
        let (mut local, dir) = with_script("exit", "exit 3", Duration::from_secs(1));
        local.set(Pool::Decode, 2).await.unwrap();
        let started = Instant::now();
        while local.replicas(Pool::Decode).await.unwrap() > 0 {
            assert!(started.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::remove_dir_all(dir).ok();
    }
}
