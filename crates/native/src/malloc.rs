//! One process-wide setting for a process that runs the forward pass: glibc's malloc arenas
//! capped at the machine's cores.
//!
//! glibc gives a thread that allocates while another thread holds the arena it wanted an
//! arena of its own, up to eight per core, and an arena keeps the pages it has touched. A
//! served engine has more threads than cores (the runtime's workers, the blocking-pool
//! thread a step computes on, the team's members), each allocating step buffers: `tandem up
//! --model` with 256 MB of KV held 453 MB after `scripts/bench-serve.sh`'s runs, 419 MB with
//! arenas capped at the two cores, its rates the same (crates/native/BENCHMARKS.md). The cap
//! is what `MALLOC_ARENA_MAX` sets, applied from inside the process so that nobody has to
//! know to export it.
#![allow(unsafe_code)]

/// Caps glibc's malloc arenas at `arenas` (at least 1) for the rest of the process; arenas
/// already made stay. True when the C library took the setting; false (and nothing changes)
/// on other C libraries and targets.
pub fn cap_arenas(arenas: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let n = i32::try_from(arenas.max(1)).unwrap_or(i32::MAX);
        // SAFETY: `mallopt` takes two integers and only changes the allocator's parameters
        // (glibc takes its own lock for it); `M_ARENA_MAX` is one of the parameters it
        // defines, and any positive value is valid for it.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, n) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = arenas;
        false
    }
}

#[cfg(test)]
mod tests {
    /// glibc takes the cap (this crate's tests run on glibc Linux in CI); elsewhere nothing
    /// changes and the call says so.
    #[test]
    fn the_cap_is_taken_where_glibc_is() {
        let taken = super::cap_arenas(64);
        assert_eq!(taken, cfg!(all(target_os = "linux", target_env = "gnu")));
        // Allocation goes on as before.
        let v: Vec<u8> = vec![7; 1 << 20];
        assert_eq!(v.iter().map(|&b| b as usize).sum::<usize>(), 7 << 20);
    }
}
