//! A bounded queue whose capacity can change while it runs. Crossbeam channels cannot be
//! resized, so this is a small Mutex + Condvar queue. Shrinking never drops items: producers
//! simply wait until the fill level is below the new capacity. Every wait also watches the
//! pipeline's stop flag, so nothing blocks a shutdown.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::config::check_queue_depth;

/// Why a push or pop gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueClosed {
    /// The pipeline is stopping.
    Stopped,
    /// No more items will come (pop only).
    Drained,
}

struct Inner<T> {
    items: VecDeque<T>,
    capacity: usize,
    closed: bool,
}

/// A queue's level and name are telemetry (the screen, metrics.jsonl): defined there, below the
/// pipeline.
pub use crate::telemetry::queues::{QueueLevel, QueueName, UnknownQueue};

/// A resizable bounded FIFO queue.
pub(crate) struct ResizableQueue<T> {
    name: QueueName,
    inner: Mutex<Inner<T>>,
    not_empty: Condvar,
    not_full: Condvar,
    stop: Arc<AtomicBool>,
    pushed: AtomicU64,
    popped: AtomicU64,
}

/// How often blocked waits look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

impl<T> ResizableQueue<T> {
    pub(crate) fn new(name: QueueName, capacity: usize, stop: Arc<AtomicBool>) -> Self {
        ResizableQueue {
            name,
            inner: Mutex::new(Inner {
                items: VecDeque::new(),
                capacity: capacity.max(1),
                closed: false,
            }),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            stop,
            pushed: AtomicU64::new(0),
            popped: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        // A panic while holding this lock cannot leave the deque half-updated.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Waits for room, then appends. Gives the item back if the pipeline stops first.
    pub(crate) fn push(&self, item: T) -> Result<(), (T, QueueClosed)> {
        let mut inner = self.lock();
        loop {
            if self.stopped() {
                return Err((item, QueueClosed::Stopped));
            }
            if inner.items.len() < inner.capacity {
                inner.items.push_back(item);
                self.pushed.fetch_add(1, Ordering::Relaxed);
                self.not_empty.notify_one();
                return Ok(());
            }
            inner = self
                .not_full
                .wait_timeout(inner, STOP_POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits for an item. `Drained` once closed and empty.
    pub(crate) fn pop(&self) -> Result<T, QueueClosed> {
        let mut inner = self.lock();
        loop {
            if self.stopped() {
                return Err(QueueClosed::Stopped);
            }
            if let Some(item) = inner.items.pop_front() {
                self.popped.fetch_add(1, Ordering::Relaxed);
                self.not_full.notify_one();
                return Ok(item);
            }
            if inner.closed {
                return Err(QueueClosed::Drained);
            }
            inner = self
                .not_empty
                .wait_timeout(inner, STOP_POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits up to `timeout` for an item; true once a [`ResizableQueue::pop`] would not block
    /// (an item waits, or the queue is closed, or the pipeline stops), false if it is still
    /// empty then. For a consumer that has other things to watch between items.
    pub(crate) fn wait_for_item(&self, timeout: Duration) -> bool {
        let ready = |inner: &Inner<T>| !inner.items.is_empty() || inner.closed || self.stopped();
        let inner = self.lock();
        if ready(&inner) {
            return true;
        }
        let inner = self
            .not_empty
            .wait_timeout(inner, timeout)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        ready(&inner)
    }

    /// No more pushes will come; consumers drain what is left.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.not_empty.notify_all();
    }

    /// Sets the capacity (1..=[`crate::config::MAX_QUEUE_DEPTH`]) at once. Items above a smaller capacity stay
    /// queued.
    pub(crate) fn set_capacity(&self, capacity: usize) -> Result<(), String> {
        check_queue_depth(capacity).map_err(|e| format!("queue {}: {e}", self.name))?;
        self.lock().capacity = capacity;
        self.not_full.notify_all();
        Ok(())
    }

    pub(crate) fn level(&self) -> QueueLevel {
        let inner = self.lock();
        QueueLevel {
            name: self.name,
            len: inner.items.len(),
            capacity: inner.capacity,
            pushed: self.pushed.load(Ordering::Relaxed),
            popped: self.popped.load(Ordering::Relaxed),
        }
    }

    /// Whether no item is waiting.
    pub(crate) fn is_empty(&self) -> bool {
        self.lock().items.is_empty()
    }

    /// Wakes every waiter (after the stop flag was set).
    pub(crate) fn wake_all(&self) {
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn waiting_for_an_item_says_whether_a_pop_would_block() {
        let stop = Arc::new(AtomicBool::new(false));
        let q = ResizableQueue::new(QueueName::Feature, 2, stop.clone());
        assert!(!q.wait_for_item(Duration::from_millis(1)), "empty");
        q.push(7).unwrap();
        assert!(q.wait_for_item(Duration::from_millis(1)), "an item waits");
        assert_eq!(q.pop(), Ok(7));
        q.close();
        assert!(
            q.wait_for_item(Duration::from_millis(1)),
            "closed: pop says drained"
        );
        assert_eq!(q.pop(), Err(QueueClosed::Drained));
        let open = ResizableQueue::<i32>::new(QueueName::Feature, 2, stop.clone());
        stop.store(true, Ordering::SeqCst);
        assert!(
            open.wait_for_item(Duration::from_millis(1)),
            "stopping: pop says so"
        );
    }

    #[test]
    fn resizing_keeps_every_item_in_order() {
        let stop = Arc::new(AtomicBool::new(false));
        let q = Arc::new(ResizableQueue::new(QueueName::Batch, 8, stop.clone()));
        for i in 0..8 {
            q.push(i).unwrap();
        }
        q.set_capacity(2).unwrap();
        assert_eq!(q.level().len, 8, "shrinking drops nothing");
        let producer = {
            let q = q.clone();
            thread::spawn(move || {
                for i in 8..1000 {
                    q.push(i).unwrap();
                    if i == 500 {
                        q.set_capacity(5).unwrap();
                    }
                }
                q.close();
            })
        };
        let mut got = Vec::new();
        while let Ok(i) = q.pop() {
            assert!(q.level().len <= 8);
            got.push(i);
        }
        producer.join().unwrap();
        assert_eq!(got, (0..1000).collect::<Vec<_>>());
        assert!(q.set_capacity(0).is_err());
        assert!(q.set_capacity(crate::config::MAX_QUEUE_DEPTH + 1).is_err());
    }

    #[test]
    fn stop_wakes_blocked_producers_and_consumers() {
        let stop = Arc::new(AtomicBool::new(false));
        let q = Arc::new(ResizableQueue::<u32>::new(
            QueueName::Batch,
            1,
            stop.clone(),
        ));
        q.push(1).unwrap();
        let blocked_push = {
            let q = q.clone();
            thread::spawn(move || q.push(2).map_err(|(_, why)| why))
        };
        let empty = Arc::new(ResizableQueue::<u32>::new(
            QueueName::Feature,
            1,
            stop.clone(),
        ));
        let blocked_pop = {
            let e = empty.clone();
            thread::spawn(move || e.pop())
        };
        thread::sleep(Duration::from_millis(100));
        stop.store(true, Ordering::Relaxed);
        assert_eq!(blocked_push.join().unwrap(), Err(QueueClosed::Stopped));
        assert_eq!(blocked_pop.join().unwrap(), Err(QueueClosed::Stopped));
    }
}
