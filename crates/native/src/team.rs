//! The threads a worker's forward pass splits its work over: a fork-join team built for the
//! many short parallel regions of a step (a decode step of this crate's models has about 150:
//! Q/K/V, attention, the output projection, gate/up and down in every layer).
//!
//! Why not rayon's pool, which the first version used: its idle threads go to sleep on a
//! futex within microseconds, and waking them for each region cost more than the region's
//! work at batch 1 (measured here: two threads decoded no faster than one, where llama.cpp's
//! spinning pool is 1.9× faster). A team member here spins for a short while after each
//! region ([`SPIN`]), so the next region of the same step finds it awake, then keeps looking
//! for a while longer, yielding the core between looks ([`LINGER`]), so the next step of a
//! served engine finds it awake too (a member asleep between steps cost a served decode at
//! batch 1 a quarter of its rate: the wake-up, at every step), then sleeps on a condition
//! variable: on a worker with nothing to do it costs nothing, and workers sharing cores give
//! way to each other while they linger.
//!
//! The one `unsafe` of this crate outside the kernels is here: a region's closure lives on
//! the caller's stack and the members call it through a pointer; [`Team::run`] returns only
//! after every member has finished with it (see the SAFETY note there).
#![allow(unsafe_code)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a member spins for the next region before it yields between looks.
pub const SPIN: Duration = Duration::from_micros(100);

/// How long a member keeps looking for the next region (yielding the core to whatever else
/// is runnable between looks) before it sleeps: longer than the gap between two steps of a
/// served engine (its outputs handed to the serving threads, the next step planned), so a
/// busy engine's members never need waking, while a yielding member costs a thread that
/// wants the core almost nothing.
pub const LINGER: Duration = Duration::from_millis(2);

/// A region's work: called once with each member's index (the caller is 0).
type Job = dyn Fn(usize) + Sync;

/// The current region's closure, as a pointer whose lifetime [`Team::run`] guarantees.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);

// SAFETY: the pointee is `Sync` (shared calls from several threads are what it is for), and
// the pointer is only dereferenced while `Team::run` keeps the pointee alive.
unsafe impl Send for JobPtr {}

struct Shared {
    /// Bumped once per region: a member runs each epoch's job once.
    epoch: AtomicU64,
    job: Mutex<Option<JobPtr>>,
    /// Members still running the current region's job.
    remaining: AtomicUsize,
    /// Members asleep on `wake` (the tests wait on it).
    asleep: AtomicUsize,
    /// A member's job panicked.
    panicked: AtomicBool,
    stop: AtomicBool,
    sleeping: Mutex<()>,
    wake: Condvar,
}

/// `n` threads: the caller of [`run`](Team::run) and `n - 1` members.
pub struct Team {
    shared: Arc<Shared>,
    members: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("threads", &self.threads())
            .finish()
    }
}

impl Team {
    /// A team of `threads` (at least 2: one thread needs no team), its members named
    /// `tandem-native-<i>`. `None` if the system refuses a thread.
    pub fn new(threads: usize) -> Option<Team> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            remaining: AtomicUsize::new(0),
            asleep: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleeping: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut members = Vec::new();
        for i in 1..threads.max(2) {
            let s = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("tandem-native-{i}"))
                .spawn(move || member(&s, i))
                .ok()?;
            members.push(handle);
        }
        Some(Team { shared, members })
    }

    pub fn threads(&self) -> usize {
        self.members.len() + 1
    }

    /// Calls `f(i)` once for every member index `i` in `0..threads()`, the caller itself
    /// being 0, and returns when all have returned. A panic in any of them is raised here.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        // SAFETY: the pointer's lifetime is erased so the members can hold it; they call it
        // only after the epoch below is published and before they decrement `remaining`, and
        // this function does not return (nor unwind: the caller's own call is caught) until
        // `remaining` is back at 0, so `f` outlives every call through the pointer.
        let ptr: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
        *lock(&s.job) = Some(JobPtr(ptr));
        s.remaining.store(self.members.len(), Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _guard = lock(&s.sleeping);
            s.wake.notify_all();
        }
        let own = catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) > 0 {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *lock(&s.job) = None;
        if let Err(panic) = own {
            std::panic::resume_unwind(panic);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a tandem-native thread panicked in a parallel region");
        }
    }
}

impl Team {
    /// `f(i, &mut items[i])` for every item, the items handed out one at a time to whichever
    /// thread of the team is free (each item exactly once).
    pub fn for_each<T: Send>(&self, items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
        let cells: Vec<Mutex<&mut T>> = items.iter_mut().map(Mutex::new).collect();
        let next = AtomicUsize::new(0);
        self.run(&|_| {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(cell) = cells.get(i) else { break };
                f(i, &mut lock(cell));
            }
        });
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _guard = lock(&self.shared.sleeping);
            self.shared.wake.notify_all();
        }
        for m in self.members.drain(..) {
            let _ = m.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> parking_lot::MutexGuard<'_, T> {
    m.lock()
}

fn member(s: &Shared, i: usize) {
    let mut seen = 0u64;
    loop {
        // Spin a little for the next region, then sleep until one comes.
        let start = Instant::now();
        let mut epoch = s.epoch.load(Ordering::SeqCst);
        while epoch == seen && !s.stop.load(Ordering::Relaxed) {
            let waited = start.elapsed();
            if waited < SPIN {
                std::hint::spin_loop();
            } else if waited < LINGER {
                std::thread::yield_now();
            } else {
                break;
            }
            epoch = s.epoch.load(Ordering::SeqCst);
        }
        if epoch == seen {
            let mut guard = lock(&s.sleeping);
            loop {
                epoch = s.epoch.load(Ordering::SeqCst);
                if epoch != seen || s.stop.load(Ordering::SeqCst) {
                    break;
                }
                s.asleep.fetch_add(1, Ordering::SeqCst);
                s.wake.wait(&mut guard);
                s.asleep.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        seen = epoch;
        let job = *lock(&s.job);
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: see `Team::run`: the job is alive until `remaining` reaches 0, which
            // needs this member's decrement below.
            let f = unsafe { &*ptr };
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_member_runs_every_region_once() {
        let team = Team::new(3).unwrap();
        let calls: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
        for _ in 0..1000 {
            team.run(&|i| {
                calls[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        // Regions far apart: every member has gone to sleep in between.
        for _ in 0..3 {
            let deadline = Instant::now() + Duration::from_secs(10);
            while team.shared.asleep.load(Ordering::SeqCst) < 2 {
                assert!(Instant::now() < deadline, "the members never went to sleep");
                std::thread::yield_now();
            }
            team.run(&|i| {
                calls[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        for c in &calls {
            assert_eq!(c.load(Ordering::Relaxed), 1003);
        }
    }

    #[test]
    fn a_panic_in_a_member_reaches_the_caller_and_the_team_goes_on() {
        let team = Team::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.run(&|i| assert!(i != 1, "member 1 fails"));
        }));
        assert!(r.is_err());
        let n = AtomicU32::new(0);
        team.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}
