//! The gateway's connection slots, and which open connections have not sent a whole request
//! head yet.
//!
//! Past the cap, a new connection takes the slot of the oldest connection that has not sent a
//! whole request head: a flood of clients that trickle their heads cannot keep one that sends
//! its request at once waiting. When every open connection has sent a request, a new one
//! waits for a slot (and the connections behind it wait in the kernel's listen queue).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;
use tower_service::Service;

/// The slots, and the open connections still waiting for their first request head (by the
/// order they were accepted in; the handle closes one).
pub(super) struct Connections {
    slots: Arc<Semaphore>,
    waiting: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    next: u64,
    /// `None` for a connection whose task is not spawned yet.
    handles: BTreeMap<u64, Option<AbortHandle>>,
}

impl Connections {
    /// Room for `max` connections at once (at least one).
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Connections {
            slots: Arc::new(Semaphore::new(max.max(1))),
            waiting: Mutex::new(Waiting::default()),
        })
    }

    /// A slot for a connection just accepted: a free one, else the one of the oldest connection
    /// that has not sent a request head (closed for it), else the next one given back.
    pub(super) async fn slot(&self) -> OwnedSemaphorePermit {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return slot;
        }
        let oldest = {
            let mut waiting = self.lock();
            waiting.handles.pop_first().and_then(|(_, handle)| handle)
        };
        if let Some(handle) = oldest {
            // The slot comes back when the aborted task is dropped.
            handle.abort();
        }
        (self.slots.clone().acquire_owned().await).expect("the semaphore is never closed")
    }

    /// Numbers a connection about to be served; it stays in line to be closed for a newer one
    /// until [`Connections::heard`] or [`Connections::ended`].
    pub(super) fn open(&self) -> u64 {
        let mut waiting = self.lock();
        let id = waiting.next;
        waiting.next += 1;
        waiting.handles.insert(id, None);
        id
    }

    /// How to close connection `id` (if it still waits for its first request head).
    pub(super) fn spawned(&self, id: u64, handle: AbortHandle) {
        if let Some(slot) = self.lock().handles.get_mut(&id) {
            *slot = Some(handle);
        }
    }

    /// Connection `id` sent a whole request head: it is no longer closed for a newer one.
    pub(super) fn heard(&self, id: u64) {
        self.lock().handles.remove(&id);
    }

    /// Connection `id` is closed.
    pub(super) fn ended(&self, id: u64) {
        self.heard(id);
    }

    /// How many open connections have not sent a request head yet.
    #[cfg(test)]
    pub(super) fn waiting(&self) -> usize {
        self.lock().handles.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        // The map holds no invariant a panic could break halfway.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `inner`, telling `connections` that connection `id` sent a request head when it is called.
#[derive(Clone)]
pub(super) struct Heard<S> {
    pub(super) inner: S,
    pub(super) id: u64,
    pub(super) connections: Arc<Connections>,
}

impl<S: Service<R>, R> Service<R> for Heard<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.connections.heard(self.id);
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_takes_the_slot_of_the_oldest_that_sent_no_head() {
        let connections = Connections::new(2);
        let mut tasks = Vec::new();
        for _ in 0..2 {
            let slot = connections.slot().await;
            let id = connections.open();
            let task = tokio::spawn(async move {
                let _slot = slot;
                std::future::pending::<()>().await;
            });
            connections.spawned(id, task.abort_handle());
            tasks.push((id, task));
        }
        // The first one sent a head; the second did not.
        connections.heard(tasks[0].0);
        let slot = tokio::time::timeout(Duration::from_secs(1), connections.slot())
            .await
            .expect("no slot for a new connection while one sent no head");
        let (_, second) = tasks.pop().unwrap();
        assert!(second.await.unwrap_err().is_cancelled());
        assert_eq!(connections.waiting(), 0);
        // Every open connection has sent a head now: the next one waits.
        assert!(
            tokio::time::timeout(Duration::from_secs(60), connections.slot())
                .await
                .is_err(),
            "a connection that sent a head was closed for a new one"
        );
        drop(slot);
    }
}
