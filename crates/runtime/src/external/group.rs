//! [`ProcessGroup`]: named child processes started together and stopped together — the local
//! multi-process mode's roles (`tandem up --processes`).
//!
//! Children are killed when the group is dropped (`kill_on_drop`); [`ProcessGroup::stop`]
//! asks each to drain first (SIGTERM), in the reverse order of their start, and kills the ones
//! still running after the grace period.

use std::ffi::OsStr;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::error::RuntimeError;

/// Children started by name, stopped in reverse order.
#[derive(Debug, Default)]
pub struct ProcessGroup {
    children: Vec<(String, Child)>,
}

impl ProcessGroup {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts `program args..` as `name`, its output shared with ours.
    pub fn spawn<S: AsRef<OsStr>>(
        &mut self,
        name: impl Into<String>,
        program: impl AsRef<OsStr>,
        args: impl IntoIterator<Item = S>,
    ) -> Result<(), RuntimeError> {
        self.spawn_with_env(name, program, args, std::iter::empty::<(&str, &str)>())
    }

    /// [`spawn`](Self::spawn), with `env` added to the environment the child inherits (where
    /// secrets go: a command line is visible to every user of the machine).
    pub fn spawn_with_env<S: AsRef<OsStr>, K: AsRef<OsStr>, V: AsRef<OsStr>>(
        &mut self,
        name: impl Into<String>,
        program: impl AsRef<OsStr>,
        args: impl IntoIterator<Item = S>,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Result<(), RuntimeError> {
        let child = Command::new(program)
            .args(args)
            .envs(env)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(RuntimeError::io("starting a child process"))?;
        self.children.push((name.into(), child));
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.children.len()
    }

    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }

    /// Resolves with the name of the first child that exits (never, for an empty group).
    pub async fn wait_any(&mut self) -> String {
        if self.children.is_empty() {
            return std::future::pending().await;
        }
        let exits = self.children.iter_mut().map(|(name, child)| {
            Box::pin(async move {
                let _ = child.wait().await;
                name.clone()
            })
        });
        futures::future::select_all(exits).await.0
    }

    /// Stops every child, the last started first: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        for (name, child) in self.children.iter_mut().rev() {
            if let Some(pid) = child.id() {
                terminate(pid);
            }
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                tracing::warn!(%name, "did not stop in time: killing");
                let _ = child.kill().await;
            }
        }
    }
}

/// Sends SIGTERM to `pid`; a process that is already gone is no error worth reporting.
pub fn terminate(pid: u32) {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_exit_is_named_and_the_rest_are_stopped() {
        let mut group = ProcessGroup::new();
        group.spawn("sleeper", "sleep", ["30"]).expect("sleep");
        group
            .spawn("quick", "true", std::iter::empty::<&str>())
            .expect("true");
        let first = tokio::time::timeout(Duration::from_secs(10), group.wait_any()).await;
        assert_eq!(first.expect("an exit"), "quick");
        let started = tokio::time::Instant::now();
        group.stop(Duration::from_secs(10)).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "SIGTERM ends sleep at once"
        );
        assert_eq!(group.len(), 2);
    }

    #[tokio::test]
    async fn a_missing_program_is_an_error() {
        let mut group = ProcessGroup::new();
        let e = group
            .spawn("ghost", "/nonexistent/tandem", ["up"])
            .expect_err("no such program");
        assert!(e.to_string().contains("starting a child process"), "{e}");
        assert!(group.is_empty());
    }
}
