//! One client's outgoing queue, bounded in bytes.
//!
//! A frame's bytes count against the queue from the moment it is pushed until the
//! connection has written it; a publisher that finds no room waits (the broker stops
//! reading its socket, so TCP slows it down) instead of the broker buffering without
//! limit or dropping what was accepted. The limit is shared by every queue of a broker
//! and may be raised while clients are connected, once a job knows its largest transfer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio::sync::Notify;

/// Bytes to write: a header built for this client (a publish's packet id differs per
/// client) and a body shared by every client the message goes to.
#[derive(Debug, Clone)]
pub(super) struct Frame {
    pub(super) head: Bytes,
    pub(super) body: Bytes,
}

impl Frame {
    pub(super) fn control(head: Bytes) -> Self {
        Self { head, body: Bytes::new() }
    }

    pub(super) fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }
}

/// The queue was closed: its client is gone.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Closed;

#[derive(Debug, Default)]
struct State {
    frames: VecDeque<Frame>,
    /// Bytes pushed and not yet [`Queue::release`]d: queued or being written.
    bytes: usize,
    closed: bool,
}

#[derive(Debug)]
pub(super) struct Queue {
    state: Mutex<State>,
    limit: Arc<AtomicUsize>,
    readable: Notify,
    writable: Notify,
}

impl Queue {
    pub(super) fn new(limit: Arc<AtomicUsize>) -> Self {
        Self { state: Mutex::default(), limit, readable: Notify::new(), writable: Notify::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `frame`, waiting for room. An empty queue takes any frame, so a frame
    /// larger than the limit still passes, alone.
    pub(super) async fn push(&self, frame: Frame) -> Result<(), Closed> {
        loop {
            let room = self.writable.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.try_push_within(&frame, self.limit.load(Ordering::Relaxed))? {
                return Ok(());
            }
            room.await;
        }
    }

    /// Queues a small reply (an acknowledgement) without waiting, allowing `slack` bytes
    /// past the limit; `Ok(false)` when even that is full, which only a client that
    /// sends and never reads reaches.
    pub(super) fn push_reply(&self, frame: Frame, slack: usize) -> Result<bool, Closed> {
        self.try_push_within(&frame, self.limit.load(Ordering::Relaxed) + slack)
    }

    fn try_push_within(&self, frame: &Frame, limit: usize) -> Result<bool, Closed> {
        let mut s = self.lock();
        if s.closed {
            return Err(Closed);
        }
        if s.bytes != 0 && s.bytes + frame.len() > limit {
            return Ok(false);
        }
        s.bytes += frame.len();
        s.frames.push_back(frame.clone());
        drop(s);
        self.readable.notify_one();
        Ok(true)
    }

    /// The next frame to write, waiting for one; `None` once closed. Its bytes stay
    /// counted until [`Queue::release`].
    pub(super) async fn pop(&self) -> Option<Frame> {
        loop {
            let data = self.readable.notified();
            tokio::pin!(data);
            data.as_mut().enable();
            {
                let mut s = self.lock();
                if s.closed {
                    return None;
                }
                if let Some(frame) = s.frames.pop_front() {
                    return Some(frame);
                }
            }
            data.await;
        }
    }

    /// The next frame if one is queued, without waiting.
    pub(super) fn try_pop(&self) -> Option<Frame> {
        let mut s = self.lock();
        if s.closed {
            return None;
        }
        s.frames.pop_front()
    }

    /// `bytes` were written: make room for publishers.
    pub(super) fn release(&self, bytes: usize) {
        let mut s = self.lock();
        s.bytes = s.bytes.saturating_sub(bytes);
        drop(s);
        self.writable.notify_waiters();
    }

    /// Drops every queued frame and refuses new ones; wakes everyone waiting.
    pub(super) fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.frames = VecDeque::new();
        s.bytes = 0;
        drop(s);
        self.readable.notify_waiters();
        self.readable.notify_one();
        self.writable.notify_waiters();
    }

    /// Bytes pushed and not yet released.
    pub(super) fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn frame(n: usize) -> Frame {
        Frame { head: Bytes::from_static(b"h"), body: Bytes::from(vec![0u8; n - 1]) }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn a_full_queue_holds_the_publisher_until_the_writer_releases_room() {
        runtime().block_on(async {
            let q = Arc::new(Queue::new(Arc::new(AtomicUsize::new(100))));
            q.push(frame(60)).await.unwrap();
            let waiting = tokio::time::timeout(Duration::from_millis(50), q.push(frame(60))).await;
            assert!(waiting.is_err(), "a push past the limit did not wait");
            assert_eq!(q.bytes(), 60);

            let pusher = tokio::spawn({
                let q = q.clone();
                async move { q.push(frame(60)).await }
            });
            let first = q.pop().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(!pusher.is_finished(), "popping alone made room: bytes count until written");
            q.release(first.len());
            pusher.await.unwrap().unwrap();
            assert_eq!(q.bytes(), 60);
        });
    }

    #[test]
    fn an_empty_queue_takes_a_frame_larger_than_its_limit() {
        runtime().block_on(async {
            let q = Queue::new(Arc::new(AtomicUsize::new(10)));
            q.push(frame(1000)).await.unwrap();
            assert!(!q.push_reply(frame(4), 2).unwrap(), "a reply past limit + slack was taken");
        });
    }

    #[test]
    fn raising_the_shared_limit_lets_a_waiting_publisher_in() {
        runtime().block_on(async {
            let limit = Arc::new(AtomicUsize::new(100));
            let q = Arc::new(Queue::new(limit.clone()));
            q.push(frame(80)).await.unwrap();
            assert!(!q.push_reply(frame(80), 0).unwrap());
            limit.store(200, Ordering::Relaxed);
            assert!(q.push_reply(frame(80), 0).unwrap());
        });
    }

    #[test]
    fn closing_frees_the_frames_and_wakes_publisher_and_writer() {
        runtime().block_on(async {
            let q = Arc::new(Queue::new(Arc::new(AtomicUsize::new(10))));
            q.push(frame(10)).await.unwrap();
            let pusher = tokio::spawn({
                let q = q.clone();
                async move { q.push(frame(10)).await }
            });
            tokio::time::sleep(Duration::from_millis(10)).await;
            q.close();
            assert_eq!(pusher.await.unwrap(), Err(Closed));
            assert_eq!(q.bytes(), 0);
            assert!(q.pop().await.is_none());
        });
    }
}
