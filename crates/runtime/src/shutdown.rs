//! Cancellation as a tree, signal handling and graceful drain.
//!
//! The binary makes one [`Shutdown`] per process and hands each service its own part of it
//! ([`Shutdown::child`], or [`Shutdown::under`] for one that must drain later than the others).
//! A `Shutdown` is two signals: *drain* (stop taking work, let the work in flight finish) and
//! *stop* (end everything now). A service waits for [`Shutdown::draining`], drains, then ends
//! its own tasks; every [`CancellationToken`] it makes — for its background tasks, per request
//! — descends from [`Shutdown::stop_token`], so stopping the process reaches all of them, and
//! nothing a library starts outlives the tree. Every spawned task has an owner: a
//! [`TaskTracker`] (or a `JoinSet`). [`shutdown_on_signals`] drains the process on the first
//! SIGTERM / SIGINT and stops it on the second.

use std::time::Duration;

use tokio::task::JoinHandle;
pub use tokio_util::sync::{CancellationToken, DropGuard};
pub use tokio_util::task::TaskTracker;

/// A service's two shutdown signals (see the module docs). Cheap to clone; clones are the same
/// signals.
#[derive(Clone, Debug)]
pub struct Shutdown {
    stop: CancellationToken,
    drain: CancellationToken,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A root: the process's, or a test's.
    pub fn new() -> Self {
        let stop = CancellationToken::new();
        Shutdown {
            drain: stop.child_token(),
            stop,
        }
    }

    /// A part of this shutdown that drains and stops with it (and can be drained or stopped
    /// alone).
    pub fn child(&self) -> Shutdown {
        Shutdown {
            stop: self.stop.child_token(),
            drain: self.drain.child_token(),
        }
    }

    /// A part that stops with this one but drains only when told to: for a service that must
    /// keep serving while another drains (the workers behind a draining frontend).
    pub fn under(&self) -> Shutdown {
        let stop = self.stop.child_token();
        Shutdown {
            drain: stop.child_token(),
            stop,
        }
    }

    /// Asks for a drain.
    pub fn drain(&self) {
        self.drain.cancel();
    }

    /// Asks to stop now (drains too).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    pub fn is_draining(&self) -> bool {
        self.drain.is_cancelled() || self.stop.is_cancelled()
    }

    /// Resolves once a drain (or a stop) is asked.
    pub async fn draining(&self) {
        tokio::select! {
            _ = self.drain.cancelled() => {}
            _ = self.stop.cancelled() => {}
        }
    }

    /// Resolves once a stop is asked.
    pub async fn stopped(&self) {
        self.stop.cancelled().await;
    }

    /// The parent of every token the service makes: cancelled when the service must stop.
    pub fn stop_token(&self) -> &CancellationToken {
        &self.stop
    }

    /// Cancelled when a drain is asked (and, for a root or an [`Shutdown::under`] part, when
    /// a stop is): for servers that stop on a token, and for tests.
    pub fn drain_token(&self) -> &CancellationToken {
        &self.drain
    }
}

/// Spawns a task that drains `shutdown` on the first SIGTERM or SIGINT (ctrl-c) and stops it
/// on the second. The task ends when `shutdown` stops, by a signal or anyone else. The
/// handlers are installed before this returns, so a signal sent right after is not missed.
/// Must be called within a tokio runtime.
pub fn shutdown_on_signals(shutdown: Shutdown) -> JoinHandle<()> {
    let signals = Signals::install();
    tokio::spawn(async move {
        let mut signals = match signals {
            Ok(signals) => signals,
            Err(error) => {
                tracing::warn!(%error, "cannot install signal handlers; signals will not shut down");
                return;
            }
        };
        for drained in [false, true] {
            tokio::select! {
                _ = shutdown.stopped() => return,
                name = signals.recv() => {
                    if drained {
                        tracing::warn!(signal = name, "second signal: stopping now");
                        shutdown.stop();
                    } else {
                        tracing::info!(signal = name, "draining (a second signal stops at once)");
                        shutdown.drain();
                    }
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn drain_completes_when_tasks_finish_in_time() {
        let tracker = TaskTracker::new();
        tracker.spawn(tokio::time::sleep(Duration::from_secs(1)));
        assert_eq!(
            drain(&tracker, Duration::from_secs(5)).await,
            DrainOutcome::Complete
        );
    }

    #[tokio::test(start_paused = true)]
    async fn drain_times_out_and_counts_stragglers() {
        let tracker = TaskTracker::new();
        tracker.spawn(tokio::time::sleep(Duration::from_secs(60)));
        tracker.spawn(async {});
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        let outcome = drain(&tracker, Duration::from_secs(5)).await;
        assert_eq!(outcome, DrainOutcome::TimedOut { remaining: 1 });
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[test]
    fn a_tree_stops_downwards_and_drains_where_told() {
        let root = Shutdown::new();
        let frontend = root.child();
        let workers = root.under();
        let request = workers.stop_token().child_token();
        root.drain();
        assert!(frontend.is_draining(), "a child drains with its parent");
        assert!(!workers.is_draining(), "`under` drains when told");
        assert!(!request.is_cancelled());
        workers.drain();
        assert!(
            workers.is_draining() && !request.is_cancelled(),
            "draining stops nothing"
        );
        root.stop();
        assert!(
            request.is_cancelled(),
            "stopping the root reaches every token"
        );
        // Stopping a part leaves the rest alone.
        let root = Shutdown::new();
        let part = root.child();
        part.stop();
        assert!(part.is_draining() && !root.is_draining());
    }

    #[tokio::test]
    async fn signal_task_ends_when_root_is_stopped_elsewhere() {
        let root = Shutdown::new();
        let task = shutdown_on_signals(root.clone());
        root.stop();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("task ends")
            .expect("no panic");
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn sigterm_drains_then_a_second_one_stops() {
        let root = Shutdown::new();
        let task = shutdown_on_signals(root.clone());
        // The handler is installed: SIGTERM to ourselves no longer kills the test process.
        let term = || crate::external::terminate(std::process::id());
        term();
        tokio::time::timeout(Duration::from_secs(5), root.draining())
            .await
            .expect("drained by SIGTERM");
        assert!(!root.stop_token().is_cancelled());
        term();
        tokio::time::timeout(Duration::from_secs(5), root.stopped())
            .await
            .expect("stopped by the second SIGTERM");
        task.await.expect("no panic");
    }
}
