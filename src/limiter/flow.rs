//! One request's decision, from its preparation to its resolved outcome, as one flow every door
//! starts and none steers: waiting for units a take in flight brings, asking the store (again,
//! for its cost alone, when a take of units ahead is refused), waiting for a concurrency slot,
//! and a reserved admission's delay. It ends [`Resolved`]: admitted, with what the admission holds,
//! or answered by the limiter.
//!
//! A decision that needs no wait (an in-process store, units in hand, an answer at once) is
//! [`Decided::Now`]: no box, no poll. Otherwise [`Deciding`] is the future that waits, small
//! enough to sit in a response future (what only some requests need is boxed).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use super::{Admission, Answered, Ask, Limiter, OnResponse, Prepared, UnitsWait, Verdict};
use axum::body::Body;
use http::Response;

use crate::decision::Decision;
use crate::store::{CheckFuture, StoreError};

/// How a request's decision ends: what a door turns into its own answer.
#[allow(
    clippy::large_enum_variant,
    reason = "returned at once and taken apart: boxing the admission would allocate per request"
)]
pub(crate) enum Resolved {
    /// Admitted: call the service, with what the admission holds.
    Admitted(Admission),
    /// Answered by the limiter (a refusal, a denial, a store that fails closed).
    Answered(Answered),
}

/// A decision as far as it went without waiting.
#[allow(
    clippy::large_enum_variant,
    reason = "returned at once and taken apart: boxing the admission would allocate per request"
)]
pub(crate) enum Decided {
    /// Resolved already.
    Now(Resolved),
    /// Waiting for something: the store's answer, units in flight, a slot, a delay.
    Later(Deciding),
}

/// What a layer does with a request: call its service, the response getting what the
/// admission holds; answer it; or wait for the decision (see [`Limiter::decide_layered`]).
#[allow(
    clippy::large_enum_variant,
    reason = "returned at once and taken apart: boxing the wait would allocate per request"
)]
pub(crate) enum Layered {
    /// Admitted: call the service; its response gets this.
    Call(OnResponse),
    /// Answered by the limiter (a refusal, a denial, a store that fails closed).
    Answer(Response<Body>),
    /// Deciding: wait for it.
    Wait(Deciding),
}

impl Layered {
    /// What a layer does with the request of `extensions` (where an admission puts what its
    /// handler reads: a meter's `Usage`), as far as the flow `decided` it.
    pub(super) fn of(decided: Decided, extensions: &mut http::Extensions) -> Self {
        match decided {
            Decided::Now(Resolved::Admitted(admission)) => {
                Layered::Call(admission.on_call(extensions))
            }
            Decided::Now(Resolved::Answered(answered)) => Layered::Answer(answered.response()),
            Decided::Later(deciding) => Layered::Wait(deciding),
        }
    }
}

impl Decided {
    /// The resolved outcome, once any wait is over.
    pub(crate) async fn outcome(self) -> Resolved {
        match self {
            Decided::Now(resolved) => resolved,
            Decided::Later(deciding) => deciding.await,
        }
    }
}

/// A request's decision that waits (see the [module docs](self)); a future of its [`Resolved`].
pub(crate) struct Deciding(Step);

/// [`wait_for_slot`]'s future: the verdict once a slot is had (or time is up), and the
/// request it was for.
pub(super) type SlotWait = Pin<Box<dyn Future<Output = (Verdict, Ask)> + Send>>;

/// What a decision waits for.
#[allow(
    clippy::large_enum_variant,
    reason = "most decisions that wait, wait for the store: boxing its step would allocate per request"
)]
enum Step {
    /// The store's answer.
    Checking {
        limiter: Arc<Limiter>,
        ask: Ask,
        check: CheckFuture,
    },
    /// Units a take in flight brings (a prefetching policy's hot identity).
    AwaitingUnits {
        limiter: Arc<Limiter>,
        wait: UnitsWait,
    },
    /// A concurrency slot (delay mode).
    WaitingForSlot {
        limiter: Arc<Limiter>,
        wait: SlotWait,
    },
    /// The time a reserved admission was given.
    Delaying {
        sleep: Pin<Box<tokio::time::Sleep>>,
        admission: Box<Admission>,
    },
    /// Nothing: resolved.
    Done,
}

impl Deciding {
    fn later(step: Step) -> Decided {
        Decided::Later(Deciding(step))
    }
}

/// The decision about a request `limiter` prepared, carried as far as it goes without waiting.
#[inline]
pub(super) fn start(limiter: &Arc<Limiter>, prepared: Prepared) -> Decided {
    match prepared {
        Prepared::Check(ask) => checking(limiter, ask),
        Prepared::CheckBy(own, ask) => checking(&own, ask),
        Prepared::Unlimited => Decided::Now(Resolved::Admitted(Admission::let_through(limiter))),
        Prepared::Admit(admission) => Decided::Now(Resolved::Admitted(admission)),
        Prepared::Respond(refusal, protocol) => Decided::Now(Resolved::Answered(Answered {
            by: limiter.clone(),
            refusal,
            protocol,
        })),
        Prepared::RespondBy(by, refusal, protocol) => Decided::Now(Resolved::Answered(Answered {
            by,
            refusal,
            protocol,
        })),
        Prepared::AwaitUnits(wait) => Deciding::later(Step::AwaitingUnits {
            limiter: limiter.clone(),
            wait,
        }),
    }
}

/// Asks the store about `ask`, or queues it behind the requests of its key waiting for a
/// slot.
#[inline]
fn checking(limiter: &Arc<Limiter>, ask: Ask) -> Decided {
    if queues_first(limiter, &ask) {
        let wait = Box::pin(wait_for_slot(limiter.clone(), ask, false));
        return Deciding::later(Step::WaitingForSlot {
            limiter: limiter.clone(),
            wait,
        });
    }
    asking(limiter, ask)
}

/// Asks the store about `ask`: an in-process store's answer is judged at once.
#[inline]
fn asking(limiter: &Arc<Limiter>, mut ask: Ask) -> Decided {
    loop {
        let mut check = limiter.check(&ask);
        let Some(result) = check.take_ready() else {
            return Decided::Later(awaiting(limiter, ask, check));
        };
        let verdict = limiter.judge(result, &mut ask);
        if let Some(decided) = after(limiter, verdict, &mut ask) {
            return decided;
        }
    }
}

/// The flow from the store's `result` for `ask` on (an answer had at once).
pub(super) fn judged(
    limiter: &Arc<Limiter>,
    mut ask: Ask,
    result: Result<Decision, StoreError>,
) -> Decided {
    let verdict = limiter.judge(result, &mut ask);
    match after(limiter, verdict, &mut ask) {
        Some(decided) => decided,
        None => asking(limiter, ask),
    }
}

/// The flow from the store's `check` of `ask` on, which answers later.
pub(super) fn awaiting(limiter: &Arc<Limiter>, ask: Ask, check: CheckFuture) -> Deciding {
    Deciding(Step::Checking {
        limiter: limiter.clone(),
        ask,
        check,
    })
}

/// What follows the store's `verdict` on `ask`; `None` to ask the store again (for the cost
/// alone: a take of units ahead was refused).
#[inline]
fn after(limiter: &Arc<Limiter>, verdict: Verdict, ask: &mut Ask) -> Option<Decided> {
    Some(match verdict {
        Verdict::Admit(admission) => Decided::Now(Resolved::Admitted(admission)),
        Verdict::Respond(refusal, protocol) => Decided::Now(Resolved::Answered(Answered {
            by: limiter.clone(),
            refusal,
            protocol,
        })),
        Verdict::RespondBy(by, refusal, protocol) => Decided::Now(Resolved::Answered(Answered {
            by,
            refusal,
            protocol,
        })),
        // Only delayed requests pay for the timer and the admission's box.
        Verdict::Delay(delay, admission) => Deciding::later(Step::Delaying {
            sleep: Box::pin(tokio::time::sleep(delay)),
            admission: Box::new(admission),
        }),
        Verdict::AwaitSlot => Deciding::later(Step::WaitingForSlot {
            limiter: limiter.clone(),
            wait: Box::pin(wait_for_slot(limiter.clone(), ask.clone(), true)),
        }),
        Verdict::Retake => {
            ask.exact();
            return None;
        }
    })
}

impl Future for Deciding {
    type Output = Resolved;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Resolved> {
        loop {
            let decided = match &mut self.0 {
                Step::Checking {
                    limiter,
                    ask,
                    check,
                } => {
                    let result = ready!(Pin::new(&mut *check).poll(cx));
                    let verdict = limiter.judge(result, ask);
                    match after(limiter, verdict, ask) {
                        Some(decided) => decided,
                        None => {
                            *check = limiter.check(ask);
                            continue;
                        }
                    }
                }
                Step::AwaitingUnits { limiter, wait } => {
                    let prepared = ready!(wait.as_mut().poll(cx));
                    start(limiter, prepared)
                }
                Step::WaitingForSlot { limiter, wait } => {
                    let (verdict, mut ask) = ready!(wait.as_mut().poll(cx));
                    match after(limiter, verdict, &mut ask) {
                        Some(decided) => decided,
                        None => asking(limiter, ask),
                    }
                }
                Step::Delaying { sleep, admission } => {
                    ready!(sleep.as_mut().poll(cx));
                    let admission = std::mem::replace(&mut **admission, Admission::unchecked());
                    Decided::Now(Resolved::Admitted(admission))
                }
                Step::Done => panic!("a decision polled after it settled"),
            };
            match decided {
                Decided::Now(settled) => {
                    self.0 = Step::Done;
                    return Poll::Ready(settled);
                }
                Decided::Later(Deciding(step)) => self.0 = step,
            }
        }
    }
}

/// The first pause of a request polling for a concurrency slot; it doubles up to [`MAX_SLOT_POLL`].
const FIRST_SLOT_POLL: Duration = Duration::from_millis(5);

/// The longest pause of a request polling for a concurrency slot released by another instance.
const MAX_SLOT_POLL: Duration = Duration::from_millis(100);

/// Whether a request should queue behind others of its key waiting for a slot, rather than
/// ask the store before them (first come, first served).
fn queues_first(limiter: &Limiter, ask: &Ask) -> bool {
    limiter.may_wait_for_slots() && limiter.slot_queues.is_waiting(ask.key.as_str())
}

/// Waits for a concurrency slot, up to the policy's `max_delay` from the request's arrival,
/// first come first served among this instance's requests of the key: the head of the key's
/// queue asks the store again when this instance releases a slot of the key, and otherwise
/// polls (every [`FIRST_SLOT_POLL`], doubling up to [`MAX_SLOT_POLL`]) for slots released
/// elsewhere or by a lease's expiry. `just_refused` says the store has just refused the
/// request, so the head waits before asking again.
async fn wait_for_slot(limiter: Arc<Limiter>, mut ask: Ask, just_refused: bool) -> (Verdict, Ask) {
    let arrived =
        tokio::time::Instant::now() - ask.started.map_or(Duration::ZERO, |at| at.elapsed());
    let deadline = arrived + limiter.policy.mode().max_delay();
    let place = limiter.slot_queues.join(ask.key.as_str());
    let (_turn, mut wait_first) = match place.try_turn() {
        Some(turn) => (turn, just_refused),
        None => match tokio::time::timeout_at(deadline, place.turn()).await {
            // The requests ahead have asked the store since: ask at once.
            Ok(turn) => (turn, false),
            // Out of time in the queue: one last look (it may admit, without a delay).
            Err(_) => {
                ask.asked_again();
                let result = limiter.check_within(&ask, Duration::ZERO).await;
                let waited = arrived.elapsed();
                let verdict = limiter.judge_after(result, &mut ask, Duration::ZERO, waited);
                return (verdict, ask);
            }
        },
    };
    let mut poll = FIRST_SLOT_POLL;
    loop {
        if wait_first {
            let pause = poll.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            // Woken by a release here, or polling for one elsewhere.
            let _ = tokio::time::timeout(pause, place.freed()).await;
            poll = (poll * 2).min(MAX_SLOT_POLL);
        }
        wait_first = true;
        let budget = deadline.saturating_duration_since(tokio::time::Instant::now());
        ask.asked_again();
        let result = limiter.check_within(&ask, budget).await;
        match limiter.judge_after(result, &mut ask, budget, arrived.elapsed()) {
            Verdict::AwaitSlot => continue,
            verdict => return (verdict, ask),
        }
    }
}
