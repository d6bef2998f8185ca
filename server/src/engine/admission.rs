//! The bound on tasks waiting for a slot. llama-server queues without limit; here a request
//! that would take the queue past `--max-queued` tasks gets 503 with Retry-After at once, so a
//! flood of requests costs a counter, not memory. A task counts from submission until it starts
//! on a slot or is dropped (its client went away while it waited).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Default `--max-queued`: far above what interactive clients queue, so ordinary use never
/// meets it; a batch client that submits more at once sees 503 and retries.
pub const DEFAULT_MAX_QUEUED: usize = 4096;

/// Seconds a refused client is told to wait.
pub const RETRY_AFTER_S: u64 = 1;

#[derive(Debug)]
pub struct Admission {
    bound: usize,
    queued: AtomicUsize,
}

/// A refusal: the queue holds `queued` tasks of `bound`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full {
    pub queued: usize,
    pub bound: usize,
}

impl Admission {
    pub fn new(bound: usize) -> Self {
        Self { bound, queued: AtomicUsize::new(0) }
    }

    /// Admits all `n` tasks of one request, or none.
    pub fn try_admit(&self, n: usize) -> Result<(), Full> {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| q.checked_add(n).filter(|&t| t <= self.bound))
            .map(|_| ())
            .map_err(|q| Full { queued: q, bound: self.bound })
    }

    /// `n` tasks left the queue (started, dropped, or never sent).
    pub fn leave(&self, n: usize) {
        let _ = self.queued.fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| Some(q.saturating_sub(n)));
    }

    #[cfg(test)]
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_bound_and_refuses_past_it() {
        let a = Admission::new(3);
        assert_eq!(a.try_admit(2), Ok(()));
        assert_eq!(a.try_admit(2), Err(Full { queued: 2, bound: 3 }), "all of a request or none");
        assert_eq!(a.try_admit(1), Ok(()));
        assert_eq!(a.try_admit(1), Err(Full { queued: 3, bound: 3 }));
        a.leave(1);
        assert_eq!(a.try_admit(1), Ok(()));
        assert_eq!(a.queued(), 3);
    }

    #[test]
    fn leaving_never_underflows_and_frees_room() {
        let a = Admission::new(1);
        a.leave(5);
        assert_eq!(a.queued(), 0);
        assert_eq!(a.try_admit(1), Ok(()));
        a.leave(1);
        assert_eq!(a.try_admit(1), Ok(()));
    }

    #[test]
    fn a_request_larger_than_the_bound_is_refused_even_when_empty() {
        let a = Admission::new(2);
        assert_eq!(a.try_admit(3), Err(Full { queued: 0, bound: 2 }));
        assert_eq!(a.try_admit(usize::MAX), Err(Full { queued: 0, bound: 2 }));
    }

    #[test]
    fn concurrent_admissions_never_pass_the_bound() {
        let a = std::sync::Arc::new(Admission::new(100));
        let admitted: usize = (0..8)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || (0..50).filter(|_| a.try_admit(1).is_ok()).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum();
        assert_eq!(admitted, 100);
        assert_eq!(a.queued(), 100);
    }
}
