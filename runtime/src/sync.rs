//! The synchronization primitives of the boundary protocol: the boundary lock and the activity
//! flags ([`Control`](crate::control)) and each pool's lock ([`PhasePool`](crate::pool)).
//!
//! They are std's in every build but one: with `--cfg loom` they are the
//! [loom](https://docs.rs/loom) model checker's, and `tests/loom_boundary.rs` explores every
//! interleaving (up to a preemption bound) of the runtime's own code at these primitives: step
//! ends against raw allocations and frees, out-of-memory recovery against other threads'
//! allocations, statistics read during a release. Nothing else changes between the two builds:
//! the runtime that is checked is the runtime that ships. State behind other locks (the
//! raw-pointer table, the registry, the telemetry, the driver) is touched in single linearizable
//! operations, which the model takes as atomic steps between these primitives.
//!
//! A loom build is for those tests only: its primitives work inside `loom::model` and nowhere
//! else. `cargo xtask loom` runs them (see ARCHITECTURE.md, "The boundary protocol").

#[cfg(loom)]
pub(crate) use loom::sync::atomic::AtomicU8;
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::AtomicU8;
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// Each pool's lock: [`PoolLock`] in every build but the loom one, where it is loom's mutex so
/// that the model explores the pools' interleavings as before.
#[cfg(not(loom))]
pub(crate) type PoolMutex<T> = lock_api::Mutex<PoolLock, T>;
/// A held [`PoolMutex`].
#[cfg(not(loom))]
pub(crate) type PoolMutexGuard<'a, T> = lock_api::MutexGuard<'a, PoolLock, T>;
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex as PoolMutex, MutexGuard as PoolMutexGuard};

/// Locks a pool's mutex. A pool's operations leave its state consistent between driver calls,
/// so a loom mutex poisoned by a panic elsewhere still guards usable state (std's mutex is not
/// used for pools: [`PoolLock`] has no poisoning).
#[inline]
pub(crate) fn lock_pool<T>(mutex: &PoolMutex<T>) -> PoolMutexGuard<'_, T> {
    #[cfg(not(loom))]
    return mutex.lock();
    #[cfg(loom)]
    return mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
}

/// Locks a pool's mutex if no one holds it.
#[inline]
pub(crate) fn try_lock_pool<T>(mutex: &PoolMutex<T>) -> Option<PoolMutexGuard<'_, T>> {
    #[cfg(not(loom))]
    return mutex.try_lock();
    #[cfg(loom)]
    return match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    };
}

/// The state behind a pool's mutex, reached through exclusive access (no locking).
#[inline]
pub(crate) fn pool_state_mut<T>(mutex: &mut PoolMutex<T>) -> &mut T {
    #[cfg(not(loom))]
    return mutex.get_mut();
    #[cfg(loom)]
    return mutex.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
}

/// The lock of a pool's state, taken twice by every allocation and free the pool serves, almost
/// never contended (a pool serves one stream, which one thread drives as a rule), and held by a
/// few slow paths for as long as a driver call takes (mapping pages, waiting for the stream).
///
/// Taking it is one compare-and-swap and releasing it one store, where std's mutex releases with
/// a second atomic read-modify-write to learn whether a thread sleeps on it: two of the four
/// atomic operations of an allocation and its free, about 10 ns of a plan-served pair on the
/// machines measured (benches/README.md). The price is that a waiting thread is never woken: it
/// spins briefly, then yields, then sleeps in steps that double up to [`PoolLock::MAX_SLEEP`],
/// so under contention it may wait up to that much after the lock comes free.
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct PoolLock {
    locked: std::sync::atomic::AtomicBool,
}

#[cfg(not(loom))]
impl PoolLock {
    /// Polls of the flag, with a spin hint between them, before a waiter yields.
    const SPINS: u32 = 64;
    /// Yields of the thread before a waiter sleeps.
    const YIELDS: u32 = 16;
    /// The first sleep of a waiter that still finds the lock held.
    const MIN_SLEEP: std::time::Duration = std::time::Duration::from_micros(5);
    /// The longest sleep between two polls of a held lock.
    pub(crate) const MAX_SLEEP: std::time::Duration = std::time::Duration::from_micros(500);

    #[cold]
    fn lock_contended(&self) {
        use std::sync::atomic::Ordering;
        let mut polls = 0u32;
        let mut sleep = Self::MIN_SLEEP;
        loop {
            // Read before trying, so waiters share the flag's cache line until it changes.
            if !self.locked.load(Ordering::Relaxed) && lock_api::RawMutex::try_lock(self) {
                return;
            }
            if polls < Self::SPINS {
                std::hint::spin_loop();
            } else if polls < Self::SPINS + Self::YIELDS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(Self::MAX_SLEEP);
            }
            polls = polls.saturating_add(1);
        }
    }
}

// SAFETY: the flag is set by exactly one successful compare-and-swap from false to true
// (acquire) and cleared only by `unlock` (release), which lock_api calls once per successful
// `lock` or `try_lock` by the holder: at most one holder at a time, and everything it wrote
// happens before the next holder's acquire.
#[cfg(not(loom))]
unsafe impl lock_api::RawMutex for PoolLock {
    #[allow(clippy::declare_interior_mutable_const)] // lock_api's initializer of a new lock
    const INIT: Self = Self { locked: std::sync::atomic::AtomicBool::new(false) };

    // A pool's guard is dropped by the thread that took it, but nothing depends on that.
    type GuardMarker = lock_api::GuardSend;

    #[inline]
    fn lock(&self) {
        if !self.try_lock() {
            self.lock_contended();
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.locked.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    #[inline]
    unsafe fn unlock(&self) {
        self.locked.store(false, std::sync::atomic::Ordering::Release);
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.locked.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Barrier};

    use super::{PoolMutex, lock_pool};

    #[test]
    fn a_waiter_gets_the_pool_lock_only_after_the_holder_lets_go_and_sees_its_writes() {
        for _ in 0..20 {
            let state = Arc::new(PoolMutex::new(0u64));
            let released = Arc::new(AtomicBool::new(false));
            let (held, tried) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
            let waiter = {
                let (state, released, held, tried) = (state.clone(), released.clone(), held.clone(), tried.clone());
                std::thread::spawn(move || {
                    held.wait();
                    // The interleaving under test: the lock is held by the other thread now.
                    assert!(state.try_lock().is_none(), "the holder's lock was taken twice");
                    tried.wait();
                    let value = *lock_pool(&state);
                    assert!(released.load(Ordering::Relaxed), "the waiter ran before the holder let go");
                    value
                })
            };
            let mut guard = lock_pool(&state);
            held.wait();
            tried.wait();
            // Long enough that the waiter spins, yields and sleeps, as a driver call would make it.
            std::thread::sleep(std::time::Duration::from_millis(2));
            *guard = 42;
            released.store(true, Ordering::Relaxed);
            drop(guard);
            assert_eq!(waiter.join().unwrap(), 42, "the waiter saw the holder's write");
        }
    }

    #[test]
    fn threads_that_share_a_pool_lock_never_lose_an_update() {
        const THREADS: u64 = 4;
        const ROUNDS: u64 = 20_000;
        // A loaded machine may run the threads one after another: each goes on past its rounds
        // until some thread has found the lock held, up to this many rounds.
        const MOST_ROUNDS: u64 = 500 * ROUNDS;
        let state = Arc::new(PoolMutex::new((0u64, 0u64)));
        let contended = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(THREADS as usize));
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                let (state, contended, start) = (state.clone(), contended.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let mut rounds = 0;
                    while rounds < ROUNDS || (!contended.load(Ordering::Relaxed) && rounds < MOST_ROUNDS) {
                        let mut guard = state.try_lock().unwrap_or_else(|| {
                            contended.store(true, Ordering::Relaxed);
                            lock_pool(&state)
                        });
                        // Two writes a reader outside the lock could see apart; now and then the
                        // holder is descheduled between them, as a driver call would keep it.
                        guard.0 += 1;
                        if rounds % 512 == 0 {
                            std::thread::yield_now();
                        }
                        guard.1 += 1;
                        assert_eq!(guard.0, guard.1, "another holder's half-done update was seen");
                        rounds += 1;
                    }
                    rounds
                })
            })
            .collect();
        let rounds: u64 = threads.into_iter().map(|thread| thread.join().unwrap()).sum();
        let total = *lock_pool(&state);
        assert_eq!(total, (rounds, rounds), "every thread's updates are counted");
        assert!(contended.load(Ordering::Relaxed), "no thread ever found the lock held: nothing was tested");
    }
}
