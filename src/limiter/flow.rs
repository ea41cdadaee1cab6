//! [`Deciding`]: one request's decision, from its preparation to its settled outcome, as one
//! future every door starts and none steers: waiting for units a take in flight brings, asking the
//! store (again, for its cost alone, when a take of units ahead is refused), waiting for a
//! concurrency slot, and a reserved admission's delay. It ends [`Settled`]: admitted, with what
//! the admission holds, or answered by the limiter.
//!
//! A decision that needs no wait (an in-process store, units in hand, an answer at once) is
//! settled when [`Deciding`] is made: no box, no poll.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::{Admission, Answered, Checked, Limiter, Prepared, UnitsWait, Verdict};
use crate::store::CheckFuture;

/// How a request's decision ends: what a door turns into its own answer.
#[allow(
    clippy::large_enum_variant,
    reason = "returned at once and taken apart: boxing the admission would allocate per request"
)]
pub(crate) enum Settled {
    /// Admitted: call the service, with what the admission holds.
    Admitted(Admission),
    /// Answered by the limiter (a refusal, a denial, a store that fails closed).
    Answered(Answered),
}

/// A request's decision under way (see the [module docs](self)); a future of its [`Settled`].
pub(crate) struct Deciding(Step);

/// [`Limiter::wait_for_slot`]'s future: the verdict once a slot is had (or time is up), and the
/// request it was for.
pub(super) type SlotWait = Pin<Box<dyn Future<Output = (Verdict, Checked)> + Send>>;

/// Where a decision stands.
#[allow(
    clippy::large_enum_variant,
    reason = "the step is the future's own state: boxing it would allocate per request"
)]
enum Step {
    /// Waiting for the store's answer.
    Checking {
        limiter: Arc<Limiter>,
        checked: Checked,
        check: CheckFuture,
    },
    /// Waiting for units a take in flight brings (a prefetching policy's hot identity).
    AwaitingUnits {
        limiter: Arc<Limiter>,
        wait: UnitsWait,
    },
    /// Waiting for a concurrency slot (delay mode); boxed, as only such requests pay for it.
    WaitingForSlot {
        limiter: Arc<Limiter>,
        wait: SlotWait,
    },
    /// Admitted by reservation: waiting for the reserved time (the timer is boxed: only delayed
    /// requests pay for its size).
    Delaying {
        sleep: Pin<Box<tokio::time::Sleep>>,
        admission: Admission,
    },
    /// Decided; `None` once the outcome is taken.
    Settled(Option<Settled>),
}

impl Deciding {
    /// The decision about a request `limiter` prepared, carried as far as it goes without waiting.
    pub(super) fn start(limiter: &Arc<Limiter>, prepared: Prepared) -> Self {
        Deciding(Step::prepared(limiter, prepared))
    }

    /// The outcome, if it was known without waiting (taken: the future is then spent).
    pub(crate) fn settled(&mut self) -> Option<Settled> {
        match &mut self.0 {
            Step::Settled(settled) => settled.take(),
            _ => None,
        }
    }
}

impl Step {
    fn settled(settled: Settled) -> Self {
        Step::Settled(Some(settled))
    }

    /// The step after preparing a request (with `limiter`, unless an override's limiter took it).
    fn prepared(limiter: &Arc<Limiter>, prepared: Prepared) -> Self {
        match prepared {
            Prepared::Check(checked) => Step::checking(limiter, checked),
            Prepared::CheckBy(own, checked) => Step::checking(&own, checked),
            Prepared::Unlimited => Step::settled(Settled::Admitted(Admission::unchecked())),
            Prepared::Admit(admission) => Step::settled(Settled::Admitted(admission)),
            Prepared::Respond(answer) => Step::settled(Settled::Answered(Answered {
                by: limiter.clone(),
                answer,
            })),
            Prepared::RespondBy(by, answer) => {
                Step::settled(Settled::Answered(Answered { by, answer }))
            }
            Prepared::AwaitUnits(wait) => Step::AwaitingUnits {
                limiter: limiter.clone(),
                wait,
            },
        }
    }

    /// Asks the store about `checked`, or queues it behind the requests of its key waiting for a
    /// slot; an in-process store's answer is settled at once.
    fn checking(limiter: &Arc<Limiter>, checked: Checked) -> Self {
        if limiter.queues_first(&checked) {
            let wait = Box::pin(limiter.clone().wait_for_slot(checked, false));
            return Step::WaitingForSlot {
                limiter: limiter.clone(),
                wait,
            };
        }
        Step::asking(limiter, checked)
    }

    /// Asks the store about `checked`.
    fn asking(limiter: &Arc<Limiter>, mut checked: Checked) -> Self {
        let mut check = limiter.check(&checked);
        match check.take_ready() {
            Some(result) => {
                let verdict = limiter.settle(result, &mut checked);
                Step::after(limiter, verdict, checked)
            }
            None => Step::Checking {
                limiter: limiter.clone(),
                checked,
                check,
            },
        }
    }

    /// The step after the store's `verdict` on `checked`.
    fn after(limiter: &Arc<Limiter>, verdict: Verdict, mut checked: Checked) -> Self {
        match verdict {
            Verdict::Admit(admission) => Step::settled(Settled::Admitted(admission)),
            Verdict::Delay(delay, admission) => Step::Delaying {
                sleep: Box::pin(tokio::time::sleep(delay)),
                admission,
            },
            Verdict::Respond(answer) => Step::settled(Settled::Answered(Answered {
                by: limiter.clone(),
                answer,
            })),
            Verdict::AwaitSlot => Step::WaitingForSlot {
                limiter: limiter.clone(),
                wait: Box::pin(limiter.clone().wait_for_slot(checked, true)),
            },
            // A take of units ahead was refused: ask for the cost alone.
            Verdict::Retake => {
                checked.exact();
                Step::asking(limiter, checked)
            }
        }
    }

    /// Waits for what this step waits for: the next step once it is there (`Ready`), else
    /// this one (`Pending`).
    fn poll_next(self, cx: &mut Context<'_>) -> (Step, Poll<()>) {
        match self {
            Step::Checking {
                limiter,
                mut checked,
                mut check,
            } => match Pin::new(&mut check).poll(cx) {
                Poll::Ready(result) => {
                    let verdict = limiter.settle(result, &mut checked);
                    (Step::after(&limiter, verdict, checked), Poll::Ready(()))
                }
                Poll::Pending => (
                    Step::Checking {
                        limiter,
                        checked,
                        check,
                    },
                    Poll::Pending,
                ),
            },
            Step::AwaitingUnits { limiter, mut wait } => match wait.as_mut().poll(cx) {
                Poll::Ready(prepared) => (Step::prepared(&limiter, prepared), Poll::Ready(())),
                Poll::Pending => (Step::AwaitingUnits { limiter, wait }, Poll::Pending),
            },
            Step::WaitingForSlot { limiter, mut wait } => match wait.as_mut().poll(cx) {
                Poll::Ready((verdict, checked)) => {
                    (Step::after(&limiter, verdict, checked), Poll::Ready(()))
                }
                Poll::Pending => (Step::WaitingForSlot { limiter, wait }, Poll::Pending),
            },
            Step::Delaying {
                mut sleep,
                admission,
            } => match sleep.as_mut().poll(cx) {
                Poll::Ready(()) => (Step::settled(Settled::Admitted(admission)), Poll::Ready(())),
                Poll::Pending => (Step::Delaying { sleep, admission }, Poll::Pending),
            },
            settled @ Step::Settled(_) => (settled, Poll::Ready(())),
        }
    }
}

impl Future for Deciding {
    type Output = Settled;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Settled> {
        loop {
            if let Some(settled) = self.settled() {
                return Poll::Ready(settled);
            }
            let step = std::mem::replace(&mut self.0, Step::Settled(None));
            assert!(
                !matches!(step, Step::Settled(None)),
                "a decision polled after it settled"
            );
            let (next, moved) = step.poll_next(cx);
            self.0 = next;
            if moved.is_pending() {
                return Poll::Pending;
            }
        }
    }
}
