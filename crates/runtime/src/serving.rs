//! [`ServingThreads`]: threads that each run a single-threaded tokio runtime, among which a
//! server spreads its connections, so that one request's work — reading it, routing it,
//! calling the engine, writing the answer — runs on one thread from start to end.
//!
//! # Why
//!
//! On tokio's multi-threaded runtime a task woken by I/O may be stolen by another worker,
//! and a worker that finds work wakes a parked one to share it: at a few hundred requests a
//! second each proxied request paid about one extra thread wake-up (`futex`, an `eventfd`
//! write, an `epoll_wait`), 8.5 system calls a request against 5.5 on one thread, and
//! ~6 % more CPU (BENCHMARKS.md, 2026-12-07). Servers built for this pin a connection to a
//! thread instead: actix-web runs one single-threaded runtime per core, Pingora offers the
//! same ("no steal" runtimes). Connections are spread round robin when accepted; a
//! connection stays on its thread.
//!
//! Code that wants a per-thread resource (the engine client's connection pool, so that a
//! pooled connection's task runs on the thread that uses it) asks [`serving_index`].

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio::task::JoinHandle as TaskHandle;
use tokio_util::sync::CancellationToken;

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// The serving thread this code runs on, counted from 1; 0 on any other thread.
pub fn serving_index() -> usize {
    INDEX.with(Cell::get)
}

/// Threads with a single-threaded runtime each (see the module doc). Dropping it stops
/// them: tasks still running on them are dropped.
#[derive(Debug)]
pub struct ServingThreads {
    handles: Vec<Handle>,
    next: AtomicUsize,
    stop: CancellationToken,
    threads: Vec<JoinHandle<()>>,
}

impl ServingThreads {
    /// Starts `n` threads (at least one), named `{name}-{i}`.
    pub fn start(n: usize, name: &str) -> std::io::Result<ServingThreads> {
        let stop = CancellationToken::new();
        let mut handles = Vec::with_capacity(n.max(1));
        let mut threads = Vec::with_capacity(n.max(1));
        for i in 0..n.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(rt.handle().clone());
            let stop = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || {
                        INDEX.with(|c| c.set(i + 1));
                        rt.block_on(stop.cancelled());
                        // Blocking work still running (a long tokenization) is not waited for.
                        rt.shutdown_timeout(std::time::Duration::from_secs(1));
                    })?,
            );
        }
        Ok(ServingThreads {
            handles,
            next: AtomicUsize::new(0),
            stop,
            threads,
        })
    }

    /// How many threads.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Never: there is at least one thread.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Runs the future `make` returns on the next thread, round robin. `make` runs on that
    /// thread, inside its runtime: what it creates (a socket registered with the runtime's
    /// I/O driver, a timer) belongs to that thread.
    pub fn spawn<F, Fut>(&self, make: F) -> TaskHandle<Fut::Output>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        // The future is made when the task first runs, on its thread.
        self.handles[i].spawn(async move { make().await })
    }
}

impl Drop for ServingThreads {
    fn drop(&mut self) {
        self.stop.cancel();
        for t in self.threads.drain(..) {
            // A thread that panicked has nothing left to stop.
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_is_spread_over_the_threads_and_each_knows_its_index() {
        let threads = ServingThreads::start(3, "test-serve").unwrap();
        assert_eq!(threads.len(), 3);
        assert_eq!(serving_index(), 0);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let seen: Vec<(usize, String)> = rt.block_on(async {
            let tasks: Vec<_> = (0..6)
                .map(|_| {
                    threads.spawn(|| async {
                        // Timers and I/O work there: the runtime has its drivers.
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                        let name = std::thread::current().name().unwrap_or("").to_string();
                        (serving_index(), name)
                    })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        let indexes: Vec<usize> = seen.iter().map(|s| s.0).collect();
        assert_eq!(indexes, [1, 2, 3, 1, 2, 3]);
        for (i, name) in &seen {
            assert_eq!(name, &format!("test-serve-{}", i - 1));
        }
        drop(threads);
    }
}
