//! Concurrency slots on the limiter's side: the lease an admitted request holds until its body
//! ends ([`lease`]), and the queues of this instance's requests waiting for a slot ([`queue`]).

mod lease;
mod queue;

pub(crate) use lease::Lease;
pub(crate) use queue::SlotQueues;
