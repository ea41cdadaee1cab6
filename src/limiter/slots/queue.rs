//! [`SlotQueues`]: the requests of one instance waiting for a concurrency slot
//! ([`Mode::Delay`](crate::Mode::Delay)), first come first served per key.
//!
//! Only the head of a key's queue asks the store; the others wait their turn behind a fair
//! mutex. A slot released in this instance wakes the head at once; one released elsewhere is seen
//! at the head's next poll, so the heads of several instances compete at each poll.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{MutexGuard, Notify};

/// The queues of the keys some request of this instance waits a slot for.
#[derive(Debug, Default)]
pub(crate) struct SlotQueues {
    queues: Mutex<HashMap<String, Arc<SlotQueue>>>,
}

/// One key's queue.
#[derive(Debug, Default)]
struct SlotQueue {
    /// Held by the head; tokio's mutex hands it on in the order it was asked for.
    turn: tokio::sync::Mutex<()>,
    /// Signalled when this instance releases one of the key's slots.
    freed: Notify,
}

/// A request's place in its key's queue; it leaves the queue when dropped.
#[derive(Debug)]
pub(crate) struct WaitPlace {
    queues: Arc<SlotQueues>,
    key: String,
    queue: Option<Arc<SlotQueue>>,
}

impl SlotQueues {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<SlotQueue>>> {
        // The map is consistent after any panic: every change is a single insert or remove.
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether some request of this instance waits for a slot of `key`: a new one queues behind it.
    pub(crate) fn is_waiting(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    /// A place at the back of `key`'s queue.
    pub(crate) fn join(self: &Arc<Self>, key: &str) -> WaitPlace {
        let queue = self.lock().entry(key.to_owned()).or_default().clone();
        WaitPlace {
            queues: self.clone(),
            key: key.to_owned(),
            queue: Some(queue),
        }
    }

    /// Wakes the head of `key`'s queue, if any: this instance released one of its slots.
    pub(crate) fn freed(&self, key: &str) {
        if let Some(queue) = self.lock().get(key) {
            // A wake-up that finds the head mid-check is kept for its next wait.
            queue.freed.notify_one();
        }
    }
}

impl WaitPlace {
    fn queue(&self) -> &SlotQueue {
        self.queue
            .as_deref()
            .expect("a place has its queue until dropped")
    }

    /// The turn, if nobody holds it.
    pub(crate) fn try_turn(&self) -> Option<MutexGuard<'_, ()>> {
        self.queue().turn.try_lock().ok()
    }

    /// Waits to be the head of the queue: the turn is held until the guard is dropped.
    pub(crate) async fn turn(&self) -> MutexGuard<'_, ()> {
        self.queue().turn.lock().await
    }

    /// Waits until this instance releases a slot of the key (or returns at once if one was
    /// released since the last wait).
    pub(crate) async fn freed(&self) {
        self.queue().freed.notified().await;
    }
}

impl Drop for WaitPlace {
    fn drop(&mut self) {
        let mut queues = self.queues.lock();
        // Counted under the map's lock, where every place is made: the last one out removes it.
        drop(self.queue.take());
        if queues
            .get(&self.key)
            .is_some_and(|queue| Arc::strong_count(queue) == 1)
        {
            queues.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_queue_lives_while_someone_waits_in_it() {
        let queues = Arc::new(SlotQueues::default());
        assert!(!queues.is_waiting("k"));
        let first = queues.join("k");
        let second = queues.join("k");
        assert!(queues.is_waiting("k"));
        drop(first);
        assert!(queues.is_waiting("k"));
        drop(second);
        assert!(!queues.is_waiting("k"));
        assert!(queues.lock().is_empty());
    }

    #[tokio::test]
    async fn turns_go_in_order_of_asking() {
        let queues = Arc::new(SlotQueues::default());
        let order = Arc::new(Mutex::new(Vec::new()));
        let head = queues.join("k");
        let held = head.turn().await;
        let mut waiters = Vec::new();
        for i in 0..5 {
            let place = queues.join("k");
            let order = order.clone();
            waiters.push(tokio::spawn(async move {
                let _turn = place.turn().await;
                order.lock().unwrap().push(i);
            }));
            // Each asks for the turn before the next is spawned.
            tokio::task::yield_now().await;
        }
        drop(held);
        for waiter in waiters {
            waiter.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    }

    #[tokio::test]
    async fn a_release_wakes_the_head_even_if_it_was_not_yet_waiting() {
        let queues = Arc::new(SlotQueues::default());
        let head = queues.join("k");
        queues.freed("k");
        tokio::time::timeout(std::time::Duration::from_secs(5), head.freed())
            .await
            .expect("the stored wake-up is taken at once");
        queues.freed("other key");
    }
}
