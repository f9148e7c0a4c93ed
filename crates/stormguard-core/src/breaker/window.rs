//! The sliding window of outcomes: ten time buckets, each one atomic.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::sync::AtomicU64;

/// How many time buckets the window is cut into.
const BUCKETS: u64 = 10;

// A window bucket: one `AtomicU64` holding its epoch's tag and its two counters, so a
// bucket is recycled for a new epoch with one compare-and-swap and no count is lost.
//
//   bits 0..22   failures
//   bits 22..44  calls
//   bits 44..64  tag: the bucket's epoch (time since the origin / bucket width), mod 2^20
//
// A bucket stops counting at COUNT_CAP calls (about two million per tenth of the
// window), half the field, so concurrent increments can never carry into the tag; past
// that, the bucket keeps the ratio of its first two million calls.
const FAILURE_ONE: u64 = 1;
const CALL_ONE: u64 = 1 << 22;
const COUNT_MASK: u64 = (1 << 22) - 1;
const COUNT_CAP: u64 = 1 << 21;
const TAG_SHIFT: u32 = 44;
const TAG_MASK: u64 = (1 << 20) - 1;

fn tag(epoch: u64) -> u64 {
    epoch & TAG_MASK
}

/// The sliding window: `BUCKETS` buckets in a ring, indexed by epoch.
pub(super) struct Window {
    buckets: [AtomicU64; BUCKETS as usize],
    /// The newest epoch any caller has recorded in. Never moves backwards.
    head: AtomicU64,
    /// The width of a bucket, in nanoseconds (at least a millisecond).
    width: u64,
}

impl Window {
    pub(super) fn new(window: Duration) -> Self {
        let width = u64::try_from(window.as_nanos() / u128::from(BUCKETS)).unwrap_or(u64::MAX);
        Window {
            buckets: Default::default(),
            head: AtomicU64::new(0),
            width: width.max(1),
        }
    }

    /// The epoch of `nanos`, given `head` as a guess: nearly every call lands in the
    /// head's epoch, which a multiplication confirms without a division.
    fn epoch(&self, nanos: u64, head: u64) -> u64 {
        match head.checked_mul(self.width) {
            Some(start) if nanos >= start && nanos - start < self.width => head,
            _ => nanos / self.width,
        }
    }

    fn slot(&self, epoch: u64) -> &AtomicU64 {
        &self.buckets[(epoch % BUCKETS) as usize]
    }

    /// Counts one call (and one failure if `failure`) made `nanos` after the origin in
    /// the bucket of its epoch, or of the head if the clock seems to have gone
    /// backwards; returns its epoch.
    pub(super) fn record(&self, nanos: u64, failure: bool) -> u64 {
        let delta = CALL_ONE + if failure { FAILURE_ONE } else { 0 };
        let mut head = self.head.load(Ordering::SeqCst);
        let own = self.epoch(nanos, head);
        // Each retry means another thread moved the bucket on meanwhile; after a few,
        // dropping one count is better than spinning.
        for _ in 0..4 {
            let epoch = own.max(head);
            if epoch > head {
                self.advance(head, epoch);
            }
            let slot = self.slot(epoch);
            let word = slot.load(Ordering::SeqCst);
            if word >> TAG_SHIFT == tag(epoch) {
                if (word >> 22) & COUNT_MASK < COUNT_CAP {
                    slot.fetch_add(delta, Ordering::SeqCst);
                }
                return own;
            }
            if self.claim(slot, word, epoch, delta) {
                return own;
            }
            head = self.head.load(Ordering::SeqCst);
        }
        own
    }

    /// Replaces `word`, a bucket left from an earlier epoch, with a fresh bucket for
    /// `epoch` holding `counts`, unless the slot has been taken by a newer epoch.
    fn claim(&self, slot: &AtomicU64, word: u64, epoch: u64, counts: u64) -> bool {
        // `word` was loaded before `head`: if a newer epoch had written it, the head
        // already shows that epoch.
        if self.head.load(Ordering::SeqCst) >= epoch.saturating_add(BUCKETS) {
            return false;
        }
        let fresh = (tag(epoch) << TAG_SHIFT) | counts;
        slot.compare_exchange(word, fresh, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Moves the head from `head` to `epoch`, first emptying the buckets of the epochs
    /// in between (at most `BUCKETS` of them, however long the silence was).
    ///
    /// Nobody counts in an epoch before the head has reached it, so while the head is
    /// short of `e` the bucket of `e` can only hold counts from an earlier lap, even if
    /// its tag matches (tags wrap): it is emptied whatever its tag. That is what keeps
    /// counts from a lap long ago from passing for current ones.
    fn advance(&self, head: u64, epoch: u64) {
        let first = head
            .saturating_add(1)
            .max(epoch.saturating_sub(BUCKETS - 1));
        for e in first..=epoch {
            let slot = self.slot(e);
            let empty = tag(e) << TAG_SHIFT;
            for _ in 0..4 {
                // Load the bucket before the head: if the bucket holds counts of `e`,
                // the head already shows `e`.
                let word = slot.load(Ordering::SeqCst);
                if word == empty || self.head.load(Ordering::SeqCst) >= e {
                    break;
                }
                if slot
                    .compare_exchange(word, empty, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    break;
                }
            }
        }
        self.head.fetch_max(epoch, Ordering::SeqCst);
    }

    /// The calls and failures over the window ending at the head (or `epoch`, if later).
    pub(super) fn sum(&self, epoch: u64) -> (u64, u64) {
        let head = self.head.load(Ordering::SeqCst).max(epoch);
        let (mut calls, mut failures) = (0, 0);
        for e in head.saturating_sub(BUCKETS - 1)..=head {
            let word = self.slot(e).load(Ordering::SeqCst);
            if word >> TAG_SHIFT == tag(e) {
                calls += (word >> 22) & COUNT_MASK;
                failures += word & COUNT_MASK;
            }
        }
        (calls, failures)
    }

    pub(super) fn clear(&self) {
        let head = self.head.load(Ordering::SeqCst);
        for e in head.saturating_sub(BUCKETS - 1)..=head {
            self.slot(e).store(tag(e) << TAG_SHIFT, Ordering::SeqCst);
        }
    }
}
