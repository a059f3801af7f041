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
//! A region waits for its work, not for its members: a member joins a region only while it is
//! open, and the caller closes it when its own share is done (with [`Team::for_each`], when
//! every item is taken), then waits only for the members inside. On a machine whose cores
//! the serving threads share, a member the scheduler has preempted used to hold every region
//! until it ran again, and the others waited at each of a step's ~150 joins; now the threads
//! that run take its share (a served decode at batch 1 on two cores: see
//! crates/native/BENCHMARKS.md).
//!
//! The one `unsafe` of this crate outside the kernels is here: a region's closure lives on
//! the caller's stack and the members call it through a pointer; [`Team::run`] returns only
//! after every member that joined has finished with it, and none joins after (see the SAFETY
//! note there).
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
    /// Bumped once per region: a member runs each epoch's job at most once.
    epoch: AtomicU64,
    /// The current region's job and its epoch.
    job: Mutex<Option<(u64, JobPtr)>>,
    /// The current region takes members (set by `run` once its job is published, cleared
    /// when the caller's own call returns).
    open: AtomicBool,
    /// Members that joined the current region and have not finished its job.
    inside: AtomicUsize,
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
            open: AtomicBool::new(false),
            inside: AtomicUsize::new(0),
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

    /// Calls `f(0)` on the caller and `f(i)` on each member `i` that is free while the caller's
    /// call runs (at most once each), and returns when every call has returned: `f` must
    /// leave no work to a member that never comes ([`for_each`](Self::for_each) hands its
    /// items to whoever asks). A panic in any of them is raised here.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        // SAFETY: the pointer's lifetime is erased so the members can hold it. A member calls
        // it only after joining the region (`inside` incremented, then `open` seen true, both
        // SeqCst) and before leaving it (`inside` decremented). This function clears `open`
        // (SeqCst) after its own call and then does not return (nor unwind: its own call is
        // caught) until `inside` is 0: a member whose increment came before the clear is
        // waited for, and one whose increment came after sees `open` false and leaves
        // without calling. So `f` outlives every call through the pointer.
        let ptr: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
        let epoch = s.epoch.load(Ordering::SeqCst) + 1;
        *lock(&s.job) = Some((epoch, JobPtr(ptr)));
        s.open.store(true, Ordering::SeqCst);
        s.epoch.store(epoch, Ordering::SeqCst);
        {
            let _guard = lock(&s.sleeping);
            s.wake.notify_all();
        }
        let own = catch_unwind(AssertUnwindSafe(|| f(0)));
        s.open.store(false, Ordering::SeqCst);
        let mut spins = 0u32;
        while s.inside.load(Ordering::SeqCst) > 0 {
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
    // The last region seen, and the last whose job this member ran.
    let (mut seen, mut ran) = (0u64, 0u64);
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
        // Join the region if it still takes members (see the SAFETY note in `Team::run`),
        // and run its job unless this member already ran that one.
        s.inside.fetch_add(1, Ordering::SeqCst);
        if s.open.load(Ordering::SeqCst)
            && let Some((job_epoch, JobPtr(ptr))) = *lock(&s.job)
            && job_epoch > ran
        {
            ran = job_epoch;
            seen = seen.max(job_epoch);
            // SAFETY: see `Team::run`: this member is inside an open region, so the caller
            // waits for the decrement below before its job can go.
            let f = unsafe { &*ptr };
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// A region whose caller waits until every member has come: each runs it exactly once.
    fn everyone(team: &Team, calls: &[AtomicU32]) {
        let came = AtomicUsize::new(0);
        team.run(&|i| {
            calls[i].fetch_add(1, Ordering::Relaxed);
            came.fetch_add(1, Ordering::SeqCst);
            if i == 0 {
                while came.load(Ordering::SeqCst) < calls.len() {
                    std::thread::yield_now();
                }
            }
        });
    }

    #[test]
    fn every_member_runs_every_region_once() {
        let team = Team::new(3).unwrap();
        let calls: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
        for _ in 0..1000 {
            everyone(&team, &calls);
        }
        // Regions far apart: every member has gone to sleep in between.
        for _ in 0..3 {
            let deadline = Instant::now() + Duration::from_secs(10);
            while team.shared.asleep.load(Ordering::SeqCst) < 2 {
                assert!(Instant::now() < deadline, "the members never went to sleep");
                std::thread::yield_now();
            }
            everyone(&team, &calls);
        }
        for c in &calls {
            assert_eq!(c.load(Ordering::Relaxed), 1003);
        }
    }

    /// Items go to whoever asks, each exactly once, whether the member joins a region early,
    /// late or not at all (the caller's share done, a region closes without it).
    #[test]
    fn every_item_once_whoever_comes() {
        let team = Team::new(2).unwrap();
        for round in 0..2000 {
            let mut items = vec![0u32; 7];
            team.for_each(&mut items, |i, x| *x += i as u32 + round);
            let want: Vec<u32> = (0..7).map(|i| i + round).collect();
            assert_eq!(items, want);
        }
        let n = AtomicU32::new(0);
        team.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert!((1..=2).contains(&n.load(Ordering::Relaxed)));
    }

    #[test]
    fn a_panic_in_a_member_reaches_the_caller_and_the_team_goes_on() {
        let team = Team::new(2).unwrap();
        let came = AtomicBool::new(false);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.run(&|i| {
                if i == 1 {
                    came.store(true, Ordering::SeqCst);
                    panic!("member 1 fails");
                }
                while !came.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
            });
        }));
        assert!(r.is_err());
        let calls: Vec<AtomicU32> = (0..2).map(|_| AtomicU32::new(0)).collect();
        everyone(&team, &calls);
        assert!(calls.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }
}
