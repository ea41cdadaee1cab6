//! Group commit: the checks that arrive while a script call is in flight wait, and go out together
//! as the next call, which runs them one after another in arrival order (`lua/batch.lua`).
//!
//! A check that finds no call in flight goes at once, from its own task, alone: a lone request
//! waits for nothing. While its call is in flight, later checks queue. When it returns, the queue
//! (as much of it as fits [`MAX_CHECKS`], [`MAX_KEYS`] and [`MAX_BYTES`]) becomes the next call,
//! sent from a task of its own that keeps sending until the queue is empty; the waiting checks get
//! their decisions through a channel each, handed out once the next call has gone, so Redis works
//! on it meanwhile (a hot key's concurrency lease and release: 0.50x → 0.60x a plain check's
//! requests a second). So Redis's fixed cost per script call (and per `TIME`)
//! and the client's per-command work are paid once per batch, and the batch grows with the load:
//! one check per call when the store is idle, about as many as arrived during one round trip
//! when it is busy.
//!
//! One call is in flight at a time per store ([`MAX_IN_FLIGHT`]). Two in flight measured about
//! 5 % more requests per second on one app server (`benches/load_peers.sh`, 64 connections) but
//! 7 % more Redis CPU per check, as batches halve: app servers scale out, the one Redis they share
//! doesn't, so Redis's cost per check decides.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Poll;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::Shared;
use super::command::Member;
use crate::decision::Decision;
use crate::store::{Answered, Deferred, StoreError};

/// At most this many checks go in one script call (a lease's release is not counted: it costs
/// Redis about a tenth of a check, and a hot key's go as one entry; the keys bound them).
const MAX_CHECKS: usize = 128;
/// At most this many keys go in one script call (unless one check alone has more).
const MAX_KEYS: usize = 1024;
/// At most this many bytes of keys and arguments go in one script call (unless one check alone
/// has more).
const MAX_BYTES: usize = 256 * 1024;

/// A queued check and where its decision goes.
struct Waiter {
    member: Member,
    decision: Reply,
}

/// Where a queued check's decision goes: to the request waiting for it, or, for a call nobody
/// waits for (a give-back, a settle, a release), into what is done with it, run by the task
/// that sends the batch (no task, channel or wake-up of its own).
enum Reply {
    Waiting(oneshot::Sender<Result<Decision, StoreError>>),
    Then(Answered),
}

impl Reply {
    fn send(self, decision: Result<Decision, StoreError>) {
        match self {
            // A check that stopped waiting doesn't want its decision.
            Reply::Waiting(sender) => drop(sender.send(decision)),
            // What is done with a give-back's answer must not take the batch's other checks
            // down with it.
            Reply::Then(answered) => {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answered(decision)))
                    .is_err()
                {
                    tracing::error!("what was done with a store call's answer panicked");
                }
            }
        }
    }

    /// Whether nobody wants the decision any more (a request dropped while it waited).
    fn is_closed(&self) -> bool {
        match self {
            Reply::Waiting(sender) => sender.is_closed(),
            Reply::Then(_) => false,
        }
    }
}

/// The queue of one store's connection.
#[derive(Default)]
pub(super) struct Batcher {
    queue: Mutex<Queue>,
    /// Woken when the last batch handed to a sender has been answered (see
    /// [`Batcher::is_idle`]); only the tests' builds keep count.
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    idle: tokio::sync::Notify,
}

/// At most this many script calls are in flight at once per store (see the module's notes).
const MAX_IN_FLIGHT: usize = 1;

#[derive(Default)]
struct Queue {
    /// Script calls in flight (or about to be sent).
    in_flight: usize,
    /// When the call in flight gives up at the latest: a check queued with a later deadline needs
    /// no timer of its own (see [`Shared::check_batched`]).
    in_flight_deadline: Option<Instant>,
    waiting: VecDeque<Waiter>,
    /// Batches taken from the queue (or sent alone) whose answers are not all handed out yet:
    /// counted once per batch, so that a test can wait for every call to land, answers applied
    /// (`RedisStore::until_calls_land_for_tests`). Only the tests' builds keep count.
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    landing: usize,
}

impl Queue {
    /// A batch taken from the queue, or sent alone (see [`Queue::landing`]).
    #[inline]
    fn took(&mut self) {
        #[cfg(any(debug_assertions, feature = "test-hooks"))]
        {
            self.landing += 1;
        }
    }
}

impl Batcher {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next batch from the queue, bounded, and when its call must give up: when the most
    /// hurried check it carries or leaves waiting must have its answer. None (and nothing in
    /// flight) when the queue is empty. Checks that stopped waiting (their request was dropped)
    /// are left out; those whose time ran out while they waited get their timeout.
    fn next_batch(&self) -> Option<(Vec<Waiter>, Instant)> {
        // Those that ran out of time are answered once the queue is let go: what is done with an
        // answer runs outside the lock every check takes.
        let mut timed_out = Vec::new();
        let next = self.next_batch_locked(&mut timed_out);
        for waiter in timed_out {
            let timeout = StoreError::Timeout(waiter.member.timeout);
            waiter.decision.send(Err(timeout));
        }
        next
    }

    /// [`Batcher::next_batch`] under the queue's lock; the checks that ran out of time go to
    /// `timed_out`.
    fn next_batch_locked(&self, timed_out: &mut Vec<Waiter>) -> Option<(Vec<Waiter>, Instant)> {
        let mut queue = self.lock();
        let now = Instant::now();
        let (mut checks, mut keys, mut bytes) = (0, 0, 0);
        let mut batch = Vec::new();
        while let Some(waiter) = queue.waiting.front() {
            if waiter.decision.is_closed() || waiter.member.deadline <= now {
                timed_out.extend(queue.waiting.pop_front());
                continue;
            }
            let (more_keys, more_bytes) =
                (waiter.member.check.key_count(), waiter.member.check.len());
            // A lease's release costs Redis a tenth of a check, and a hot key's go as one entry
            // (`merge.rs`): it counts against the keys and bytes, not the checks.
            let more_checks = usize::from(!waiter.member.check.releases());
            if !batch.is_empty()
                && (checks + more_checks > MAX_CHECKS
                    || keys + more_keys > MAX_KEYS
                    || bytes + more_bytes > MAX_BYTES)
            {
                break;
            }
            checks += more_checks;
            keys += more_keys;
            bytes += more_bytes;
            batch.extend(queue.waiting.pop_front());
        }
        if batch.is_empty() {
            queue.in_flight -= 1;
            queue.in_flight_deadline = None;
            return None;
        }
        let deadline = batch
            .iter()
            .chain(&queue.waiting)
            .map(|waiter| waiter.member.deadline)
            .min()
            .expect("a batch of at least one check");
        queue.in_flight_deadline = Some(deadline);
        queue.took();
        Some((batch, deadline))
    }

    /// A batch taken from the queue (or sent alone) has been answered, every answer handed out.
    /// Counted in the tests' builds only (see [`Queue::landing`]): production pays no lock for it.
    fn landed(&self) {
        #[cfg(any(debug_assertions, feature = "test-hooks"))]
        {
            let idle = {
                let mut queue = self.lock();
                debug_assert!(queue.landing > 0, "a batch landed that was never taken");
                queue.landing = queue.landing.saturating_sub(1);
                queue.landing == 0 && queue.waiting.is_empty()
            };
            if idle {
                self.idle.notify_waiters();
            }
        }
    }

    /// Whether nothing is queued and every batch taken has been answered.
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    pub(super) fn is_idle(&self) -> bool {
        let queue = self.lock();
        queue.landing == 0 && queue.waiting.is_empty()
    }

    /// Ready when the last batch in flight has been answered.
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    pub(super) fn idle(&self) -> tokio::sync::futures::Notified<'_> {
        self.idle.notified()
    }

    /// Gives up the queue when no task can send it (the runtime is shutting down): the waiting
    /// checks get a store error and the next check goes at once.
    fn abandon(&self) {
        let mut queue = self.lock();
        queue.in_flight = queue.in_flight.saturating_sub(1);
        queue.in_flight_deadline = None;
        queue.waiting.clear();
        // The sender dropped had one batch taken; a sender that finished is handing out its
        // last answers meanwhile, and still counts.
        #[cfg(any(debug_assertions, feature = "test-hooks"))]
        {
            queue.landing = queue.landing.saturating_sub(1);
            if queue.landing == 0 {
                self.idle.notify_waiters();
            }
        }
    }
}

impl Shared {
    /// Decides `member` through the group commit.
    ///
    /// A queued check waits for its answer without a timer of its own when the call in flight
    /// gives up before its deadline (the common case: checks share the store's timeout and queue
    /// in arrival order): the sender then answers it by its deadline, since every call gives up
    /// when the most hurried check it carries or leaves waiting must have its answer. Only a
    /// check more hurried than the call in flight (a clone of the store with a shorter timeout)
    /// arms a timer.
    pub(super) async fn check_batched(
        self: &Arc<Self>,
        member: Member,
    ) -> Result<Decision, StoreError> {
        let (deadline, timeout) = (member.deadline, member.timeout);
        let waiting = {
            let mut queue = self.batcher.lock();
            if queue.in_flight >= MAX_IN_FLIGHT {
                let (sender, receiver) = oneshot::channel();
                let answered_in_time = queue
                    .in_flight_deadline
                    .is_some_and(|in_flight| in_flight <= deadline);
                queue.waiting.push_back(Waiter {
                    member,
                    decision: Reply::Waiting(sender),
                });
                Ok((receiver, answered_in_time))
            } else {
                queue.in_flight += 1;
                queue.in_flight_deadline = Some(deadline);
                queue.took();
                Err(member)
            }
        };
        let dropped = || {
            StoreError::Unavailable(
                "the batch this check was in was dropped (the runtime is shutting down)".into(),
            )
        };
        match waiting {
            Ok((receiver, true)) => receiver.await.unwrap_or_else(|_| Err(dropped())),
            Ok((receiver, false)) => {
                match Box::pin(tokio::time::timeout_at(deadline, receiver)).await {
                    Ok(Ok(decision)) => decision,
                    Ok(Err(_)) => Err(dropped()),
                    Err(_elapsed) => Err(StoreError::Timeout(timeout)),
                }
            }
            Err(member) => {
                // Whether this call completes or its request is dropped, the queue goes on.
                let _hand_over = HandOver(self);
                // Boxed: a script call's future is about 2.5 KB, which every queued check's
                // future would otherwise carry, and copy, for nothing.
                Box::pin(self.call_alone(&member)).await
            }
        }
    }

    /// Sends `member` through the group commit, its decision handed to `answered` by the task that
    /// sends its batch: queued behind the call in flight, or, when none is, sent at once from a
    /// task of its own, which then sends what queues meanwhile. Without a runtime to start that
    /// task from, nothing is sent.
    pub(super) fn send_then(self: &Arc<Self>, member: Member, answered: Answered) {
        let deadline = member.deadline;
        let waiter = Waiter {
            member,
            decision: Reply::Then(answered),
        };
        let runtime = {
            let mut queue = self.batcher.lock();
            if queue.in_flight >= MAX_IN_FLIGHT {
                queue.waiting.push_back(waiter);
                return;
            }
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return;
            };
            queue.in_flight += 1;
            queue.in_flight_deadline = Some(deadline);
            queue.took();
            runtime
        };
        let abandon = Abandon::new(self.clone());
        runtime.spawn(self.clone().send_batches(vec![waiter], deadline, abandon));
    }

    /// Sends batches until the queue is empty.
    ///
    /// `abandon` gives the queue up if the task is dropped before it is empty: made before the
    /// task is spawned, so that a task a runtime shutting down drops unpolled gives it up too.
    async fn send_batches(
        self: Arc<Self>,
        batch: Vec<Waiter>,
        deadline: Instant,
        mut abandon: Abandon,
    ) {
        let mut call = Call::start(&self, batch, deadline);
        loop {
            let (replies, decisions) = call.answers().await;
            let Some((next, next_deadline)) = self.batcher.next_batch() else {
                answer(replies, decisions);
                self.batcher.landed();
                break;
            };
            // The next call goes out before this one's answers are handed out (waking the
            // requests that waited, running what is done with the others): Redis works on it
            // meanwhile, rather than after.
            call = Call::start(&self, next, next_deadline);
            call.send().await;
            answer(replies, decisions);
            self.batcher.landed();
        }
        abandon.armed = false;
    }
}

/// Hands each of a call's decisions to where it goes.
fn answer(replies: Vec<Reply>, decisions: Vec<Result<Decision, StoreError>>) {
    for (reply, decision) in replies.into_iter().zip(decisions) {
        reply.send(decision);
    }
}

/// What a call of a batch answers: where each decision goes, and the decisions.
type Answers = (Vec<Reply>, Vec<Result<Decision, StoreError>>);

/// One script call of the group commit, from its first poll (which packs and sends it) to its
/// answers.
enum Call {
    Flying(Pin<Box<dyn Future<Output = Answers> + Send>>),
    Answered(Answers),
}

impl Call {
    fn start(shared: &Arc<Shared>, batch: Vec<Waiter>, deadline: Instant) -> Call {
        let shared = shared.clone();
        Call::Flying(Box::pin(async move {
            let (members, replies): (Vec<Member>, Vec<_>) = batch
                .into_iter()
                .map(|waiter| (waiter.member, waiter.decision))
                .unzip();
            let decisions = shared.call(&members, deadline).await;
            (replies, decisions)
        }))
    }

    /// Polls it once: its command is on its way (or, rarely, already answered).
    async fn send(&mut self) {
        std::future::poll_fn(|cx| {
            if let Call::Flying(call) = self
                && let Poll::Ready(answers) = call.as_mut().poll(cx)
            {
                *self = Call::Answered(answers);
            }
            Poll::Ready(())
        })
        .await;
    }

    async fn answers(self) -> Answers {
        match self {
            Call::Flying(call) => call.await,
            Call::Answered(answers) => answers,
        }
    }
}

/// A call of the group commit not sent yet (see [`Deferred`]): a give-back, an overdraw, a
/// release.
pub(super) struct Batched {
    pub(super) shared: Arc<Shared>,
    pub(super) member: Member,
}

impl Deferred for Batched {
    fn into_future(
        self: Box<Self>,
    ) -> Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>> {
        let Batched { shared, member } = *self;
        Box::pin(async move { shared.check_batched(member).await })
    }

    fn send_then(self: Box<Self>, answered: Answered) {
        let Batched { shared, member } = *self;
        shared.send_then(member, answered);
    }
}

/// Passes the queue on when a lone check's call ends: to a task that sends it, or, when it is
/// empty, to the next check that arrives.
struct HandOver<'a>(&'a Arc<Shared>);

impl Drop for HandOver<'_> {
    fn drop(&mut self) {
        if let Some((batch, deadline)) = self.0.batcher.next_batch() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let abandon = Abandon::new(self.0.clone());
                    runtime.spawn(self.0.clone().send_batches(batch, deadline, abandon));
                }
                Err(_) => self.0.batcher.abandon(),
            }
        }
        // The lone call has landed (or was given up with its request), and what queued behind
        // it is taken, or answered if it ran out of time: said last, as `send_batches` does.
        self.0.batcher.landed();
    }
}

/// Clears the queue if the task sending it is dropped before it is empty (a runtime shutting
/// down), so the store doesn't wait for a call that will never return.
struct Abandon {
    shared: Arc<Shared>,
    /// Whether the queue is still to be given up when this is dropped.
    armed: bool,
}

impl Abandon {
    fn new(shared: Arc<Shared>) -> Self {
        Abandon {
            shared,
            armed: true,
        }
    }
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if self.armed {
            self.shared.batcher.abandon();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::policy::{Algorithm, Rule};
    use crate::store::CheckRequest;
    use crate::store::redis::RedisStore;
    use crate::store::redis::command::PackedCheck;

    /// A call handed over with nothing in flight starts a task to send it; a runtime shutting down
    /// may drop that task before it ever runs. The queue must not stay "in flight" for good
    /// then (every later check of a store shared with another runtime would wait for ever).
    #[test]
    fn a_sending_task_dropped_unpolled_gives_the_queue_up() {
        // Nothing listens there: the task never gets as far as connecting.
        let store = RedisStore::from_url("redis://127.0.0.1:1").expect("a Redis URL");
        let rules = [Rule::per_minute(10)];
        let request = CheckRequest::new("rl:{k}", &rules, Algorithm::FixedWindow).identity("k");
        let answered = Arc::new(AtomicBool::new(false));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let answered = answered.clone();
            store.shared.send_then(
                store.member(&request),
                Box::new(move |_| answered.store(true, Ordering::Relaxed)),
            );
            assert_eq!(store.shared.batcher.lock().in_flight, 1);
        });
        // The spawned task never ran: dropped with the runtime.
        drop(runtime);
        assert_eq!(store.shared.batcher.lock().in_flight, 0);
        assert!(store.shared.batcher.lock().waiting.is_empty());
        assert!(
            !answered.load(Ordering::Relaxed),
            "dropped unrun, as the docs say"
        );
    }

    /// A batch takes at most `MAX_CHECKS` checks; a lease's release (a tenth of a check's work,
    /// a hot key's merged into one entry) counts against its keys and bytes only, so a hot key's
    /// batch of leases holds as many checks as a plain one.
    #[test]
    fn a_batch_counts_checks_not_releases() {
        let rules = [Rule::per_minute(10)];
        let request = CheckRequest::new("rl:{k}", &rules, Algorithm::FixedWindow).identity("k");
        let waiter = |check: PackedCheck| Waiter {
            member: Member {
                check,
                replicas: None,
                deadline: Instant::now() + std::time::Duration::from_secs(60),
                timeout: std::time::Duration::from_secs(60),
            },
            decision: Reply::Then(Box::new(|_| {})),
        };
        let batcher = Batcher::default();
        let taken = |checks: usize, releases: usize| {
            {
                let mut queue = batcher.lock();
                queue.in_flight = 1;
                for lease in 0..releases as u64 {
                    queue
                        .waiting
                        .push_back(waiter(PackedCheck::release(&request, lease)));
                    if (lease as usize) < checks {
                        queue
                            .waiting
                            .push_back(waiter(PackedCheck::new(&request, false)));
                    }
                }
                for _ in releases..checks {
                    queue
                        .waiting
                        .push_back(waiter(PackedCheck::new(&request, false)));
                }
            }
            let (batch, _) = batcher.next_batch().expect("a batch");
            let left = batcher.lock().waiting.len();
            batcher.lock().waiting.clear();
            (batch.len(), left)
        };
        assert_eq!(taken(MAX_CHECKS + 5, 0), (MAX_CHECKS, 5));
        assert_eq!(taken(MAX_CHECKS + 5, MAX_CHECKS), (2 * MAX_CHECKS, 5));
        // Releases alone are bounded by the keys.
        assert_eq!(taken(0, MAX_KEYS + 3), (MAX_KEYS, 3));
    }
}
