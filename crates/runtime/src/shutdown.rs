//! Cancellation as a tree, signal handling and graceful drain.
//!
//! The binary makes one root [`CancellationToken`], hands `root.child_token()` to each subsystem
//! (and each subsystem one per request), and calls [`shutdown_on_signals`] so SIGTERM / SIGINT
//! cancel the root. Every spawned task has an owner: a [`TaskTracker`] (or a `JoinSet`). On
//! cancellation, a service stops accepting work and [`drain`]s its tracker: in-flight work gets a
//! grace period, after which the caller decides (usually: exit anyway).

use std::time::Duration;

use tokio::task::JoinHandle;
pub use tokio_util::sync::{CancellationToken, DropGuard};
pub use tokio_util::task::TaskTracker;

/// Spawns a task that cancels `root` on the first SIGTERM or SIGINT (ctrl-c). The task ends
/// when `root` is cancelled by anyone. The handlers are installed before this returns, so a
/// signal sent right after is not missed. Must be called within a tokio runtime.
pub fn shutdown_on_signals(root: CancellationToken) -> JoinHandle<()> {
    let signals = Signals::install();
    tokio::spawn(async move {
        let mut signals = match signals {
            Ok(signals) => signals,
            Err(error) => {
                tracing::warn!(%error, "cannot install signal handlers; signals will not shut down");
                return;
            }
        };
        tokio::select! {
            _ = root.cancelled() => {}
            name = signals.recv() => {
                tracing::info!(signal = name, "shutting down");
                root.cancel();
            }
        }
    })
}

#[cfg(unix)]
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn install() -> std::io::Result<Self> {
        Ok(Signals)
    }

    async fn recv(&mut self) -> &'static str {
        match tokio::signal::ctrl_c().await {
            Ok(()) => "ctrl-c",
            Err(_) => std::future::pending().await,
        }
    }
}

/// How a drain ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainOutcome {
    /// Every tracked task finished within the grace period.
    Complete,
    /// The grace period passed with `remaining` tasks still running.
    TimedOut { remaining: usize },
}

/// Closes `tracker` (no new tasks are waited for after the last one ends) and waits up to
/// `grace` for its tasks to finish.
pub async fn drain(tracker: &TaskTracker, grace: Duration) -> DrainOutcome {
    tracker.close();
    match tokio::time::timeout(grace, tracker.wait()).await {
        Ok(()) => DrainOutcome::Complete,
        Err(_) => DrainOutcome::TimedOut {
            remaining: tracker.len(),
        },
    }
}

/// A subsystem's shutdown kit: its token, the tracker owning its tasks, its grace period.
#[derive(Clone, Debug)]
pub struct Drain {
    token: CancellationToken,
    tracker: TaskTracker,
    grace: Duration,
}

impl Drain {
    /// A kit cancelled with `token` (typically a child of the root), draining for `grace`.
    pub fn new(token: CancellationToken, grace: Duration) -> Self {
        Drain {
            token,
            tracker: TaskTracker::new(),
            grace,
        }
    }

    /// The subsystem's token; hand out `child_token()`s of it per request.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// The tracker owning the subsystem's tasks.
    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }

    /// Spawns `task` owned by this subsystem.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task)
    }

    /// Waits for cancellation, then drains the tracked tasks for the grace period.
    pub async fn wait(&self) -> DrainOutcome {
        self.token.cancelled().await;
        let outcome = drain(&self.tracker, self.grace).await;
        if let DrainOutcome::TimedOut { remaining } = outcome {
            tracing::warn!(remaining, grace = ?self.grace, "drain timed out with tasks still running");
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn drain_completes_when_tasks_finish_in_time() {
        let kit = Drain::new(CancellationToken::new(), Duration::from_secs(5));
        let token = kit.token().child_token();
        kit.spawn(async move {
            token.cancelled().await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        });
        kit.token().cancel();
        assert_eq!(kit.wait().await, DrainOutcome::Complete);
    }

    #[tokio::test(start_paused = true)]
    async fn drain_times_out_and_counts_stragglers() {
        let kit = Drain::new(CancellationToken::new(), Duration::from_secs(5));
        kit.spawn(async { tokio::time::sleep(Duration::from_secs(60)).await });
        kit.spawn(async {});
        kit.token().cancel();
        let started = tokio::time::Instant::now();
        assert_eq!(kit.wait().await, DrainOutcome::TimedOut { remaining: 1 });
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test]
    async fn signal_task_ends_when_root_is_cancelled_elsewhere() {
        let root = CancellationToken::new();
        let task = shutdown_on_signals(root.clone());
        root.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("task ends")
            .expect("no panic");
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn sigterm_cancels_the_root() {
        let root = CancellationToken::new();
        let task = shutdown_on_signals(root.clone());
        // The handler is installed: SIGTERM to ourselves no longer kills the test process.
        let status = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(5), root.cancelled())
            .await
            .expect("root cancelled by SIGTERM");
        task.await.expect("no panic");
    }
}
