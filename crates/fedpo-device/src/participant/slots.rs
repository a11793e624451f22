//! How many devices of one process may train at once.
//!
//! A simulated fleet runs every device in one process. Without a limit, all of a round's
//! selected devices build their policies and train together, so memory grows with the
//! selection (and, on few cores, they only take turns on the CPU anyway). With
//! [`TrainingSlots`], a device waits for a slot before it decodes the round's model and
//! frees it once its update is formed: memory grows with the slots instead.

use std::sync::{Condvar, Mutex};

/// A counting semaphore over training rounds.
#[derive(Debug)]
pub struct TrainingSlots {
    free: Mutex<usize>,
    freed: Condvar,
}

/// A held slot; dropping it frees it.
#[derive(Debug)]
pub struct Slot<'a>(&'a TrainingSlots);

impl TrainingSlots {
    /// `n` slots (at least one).
    pub fn new(n: usize) -> Self {
        Self { free: Mutex::new(n.max(1)), freed: Condvar::new() }
    }

    /// Waits for a free slot.
    pub fn acquire(&self) -> Slot<'_> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|e| e.into_inner());
        }
        *free -= 1;
        Slot(self)
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        *self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.0.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn no_more_than_the_slots_train_at_once_and_every_waiter_gets_a_turn() {
        let slots = Arc::new(TrainingSlots::new(2));
        let (running, most, done) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let workers: Vec<_> = (0..6)
            .map(|_| {
                let (slots, running, most, done) = (slots.clone(), running.clone(), most.clone(), done.clone());
                std::thread::spawn(move || {
                    let _slot = slots.acquire();
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    running.fetch_sub(1, Ordering::SeqCst);
                    done.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(done.load(Ordering::SeqCst), 6);
        assert_eq!(most.load(Ordering::SeqCst), 2);
        assert_eq!(slots.free(), 2);
    }
}
