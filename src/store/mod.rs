//! Where admission state lives. One atomic "check every level and commit" call per decision.
//!
//! [`MemoryStore`] keeps state in this process (the default); a Redis store shares it between
//! replicas. Every store runs the same pure decision ([`crate::admission::engine::decide`]) and
//! passes the same conformance suite.

mod memory;
#[cfg(feature = "redis")]
pub mod redis;

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

#[cfg(feature = "redis")]
pub use self::redis::RedisStore;
pub use crate::admission::engine::{Admission, Stored};
pub use crate::admission::CallKeys;
pub use crate::key::Name;
pub use memory::MemoryStore;

use crate::admission::engine::Plan;
use crate::admission::Refusal;
use crate::clock::Timestamp;

/// The store's answer to a call.
#[derive(Clone, Debug)]
pub enum Decision {
    /// Admitted and committed: one admission per plan, in the plans' order.
    Admitted(Admissions),
    /// Refused; nothing was charged.
    Refused(Refusal),
}

impl Decision {
    /// The first plan's admission (the only one of a call charged to one tool), or the
    /// refusal.
    pub fn into_first(self) -> Result<Arc<Admission>, Refusal> {
        match self {
            Decision::Admitted(a) => Ok(a.first),
            Decision::Refused(r) => Err(r),
        }
    }
}

/// What a store admitted for one call: an admission per tool it was charged to, in the
/// order of the plans. Most calls are charged to one tool, held without another allocation.
#[derive(Clone, Debug)]
pub struct Admissions {
    first: Arc<Admission>,
    rest: Vec<Arc<Admission>>,
}

impl Admissions {
    /// A call charged to one tool.
    pub fn one(admission: Arc<Admission>) -> Self {
        Admissions {
            first: admission,
            rest: Vec::new(),
        }
    }

    /// The admissions of a call's plans, in order; `None` when there are none.
    pub fn of(all: impl IntoIterator<Item = Arc<Admission>>) -> Option<Self> {
        let mut all = all.into_iter();
        let first = all.next()?;
        Some(Admissions {
            first,
            rest: all.collect(),
        })
    }

    /// The first plan's admission (the only one of a call charged to one tool).
    pub fn first(&self) -> &Arc<Admission> {
        &self.first
    }

    /// The first plan's admission, taken (the only one of a call charged to one tool).
    pub fn into_first(self) -> Arc<Admission> {
        self.first
    }

    /// Every admission, in the plans' order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Admission>> {
        std::iter::once(&self.first).chain(&self.rest)
    }

    /// How many tools the call was charged to.
    pub fn len(&self) -> usize {
        1 + self.rest.len()
    }

    /// Always false: a call is charged to one tool at least.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl IntoIterator for Admissions {
    type Item = Arc<Admission>;
    type IntoIter =
        std::iter::Chain<std::iter::Once<Arc<Admission>>, std::vec::IntoIter<Arc<Admission>>>;

    fn into_iter(self) -> Self::IntoIter {
        std::iter::once(self.first).chain(self.rest)
    }
}

/// A store could not decide. Backend errors convert into this one enum.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend did not answer in time.
    #[error("the rate-limit store did not answer within {0:?}: check its health and network, or raise the timeout")]
    Timeout(std::time::Duration),
    /// The backend could not be reached or failed.
    #[error("the rate-limit store is unavailable: {0}")]
    Unavailable(String),
    /// The backend answered something this crate does not understand.
    #[error("the rate-limit store answered unexpectedly: {0}")]
    Protocol(String),
}

/// A store's work that waits for I/O: it owns what it needs, so a caller may keep it, hand it
/// to a task, or drop it (which cancels it, as any future).
pub type Pending<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;

/// What a store answers: at once (the in-process store always), or once its I/O is done.
/// `.await` it for the result either way.
pub enum Answer<T> {
    /// Done.
    Now(Result<T, StoreError>),
    /// Waiting for I/O.
    Later(Pending<T>),
}

impl<T> Answer<T> {
    /// An answer that waits for `work`.
    pub fn later(work: impl Future<Output = Result<T, StoreError>> + Send + 'static) -> Self {
        Answer::Later(Box::pin(work))
    }
}

impl<T> std::fmt::Debug for Answer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Answer::Now(_) => "Answer::Now",
            Answer::Later(_) => "Answer::Later",
        })
    }
}

impl<T> IntoFuture for Answer<T> {
    type Output = Result<T, StoreError>;
    type IntoFuture = Answering<T>;

    fn into_future(self) -> Answering<T> {
        Answering(match self {
            Answer::Now(r) => Awaited::Now(Some(r)),
            Answer::Later(work) => Awaited::Later(work),
        })
    }
}

/// The future of an [`Answer`] (what `.await` on one polls): an answer given at once is ready
/// at the first poll, with nothing allocated; else the store's work, polled.
#[must_use = "an answer is read only when awaited"]
pub struct Answering<T>(Awaited<T>);

enum Awaited<T> {
    Now(Option<Result<T, StoreError>>),
    Later(Pending<T>),
}

/// The answer is moved out, never pinned: the future may move whatever `T` is.
impl<T> Unpin for Answering<T> {}

impl<T> Future for Answering<T> {
    type Output = Result<T, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            Awaited::Now(r) => Poll::Ready(r.take().expect("an answer polled after it was read")),
            Awaited::Later(work) => work.as_mut().poll(cx),
        }
    }
}

impl<T> std::fmt::Debug for Answering<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Awaited::Now(_) => "Answering::Now",
            Awaited::Later(_) => "Answering::Later",
        })
    }
}

/// Keeps admission state and applies decisions atomically.
///
/// A store implements one atomic operation per decision: read the state of every level the
/// call touches — of every tool it is charged to — run
/// [`decide`](crate::admission::engine::decide) for each tool's plan, and write the results
/// back only if every plan was admitted, without any other decision interleaving. Corrections and permit releases are separate,
/// later calls. Each method answers at once ([`Answer::Now`]) when it can, or with its work
/// that waits for I/O ([`Answer::Later`]): the caller waits only when there is something to
/// wait for. A `Later` answer does nothing until it is polled: a caller that will not wait
/// (`Limiter::try_admit`) drops it unstarted.
///
/// **Cancellation.** The work of [`decide`](Self::decide) may be dropped at any await point
/// (a client disconnects, a timeout fires). A store whose decision can still take effect after
/// that — a command already sent to a server — must finish it and, if it was admitted, give
/// back what it charged and the permits it took: no path may leak a permit or a unit.
pub trait Store: Send + Sync + 'static {
    /// A short name for metrics labels (`memory`, `redis`, ...).
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// Decides one call and commits it if admitted. `plans` holds one plan per tool the call
    /// is charged to (one, for most calls; never two of one tool; tools of one
    /// [group](crate::policy::ToolPolicy::group)), all at one `now`: the call is admitted only
    /// if every plan is, and a refusal — the first plan's that refuses — charges nothing
    /// anywhere.
    fn decide(&self, plans: &[Plan<'_>]) -> Answer<Decision>;

    /// Corrects an admitted call's charge by `factor` × what it charged (−1.0 refunds it
    /// entirely; 0.5 charges half again). Never touches a window that has closed.
    fn adjust(&self, admission: &Arc<Admission>, factor: f64, now: Timestamp) -> Answer<()>;

    /// Returns the concurrency permits an admitted call took.
    fn release(&self, admission: &Arc<Admission>) -> Answer<()>;

    /// The stored state of the tool, tenant and instance levels of `keys` (`None` where
    /// nothing is stored) and the tool's plans' counts, as the store holds them: not brought
    /// up to date. For diagnostics and tests.
    fn inspect(&self, keys: &CallKeys) -> Answer<Stored>;

    /// The same states as [`inspect`](Self::inspect), as a decision at `now` reads them: calls
    /// in flight are the permits that have not lapsed by then (a store whose permits never
    /// lapse, like the memory store, answers as `inspect`). Writes nothing. What
    /// [`Limiter::explain`](crate::Limiter::explain) and the console read.
    fn inspect_at(&self, keys: &CallKeys, now: Timestamp) -> Answer<Stored> {
        let _ = now;
        self.inspect(keys)
    }

    /// The work this store finishes in the background — permits of calls that ended given
    /// back, charges of callers that left refunded — done, for a graceful shutdown
    /// ([`Limiter::shutdown`](crate::Limiter::shutdown)). The default has none.
    fn flush(&self) -> Answer<()> {
        Answer::Now(Ok(()))
    }

    /// Told the policy this process enforces, when the limiter is made and at every reload.
    /// A store shared by replicas publishes each tool's [fingerprint](crate::policy::ToolPolicy::fingerprint)
    /// so that replicas enforcing different policies are found (see
    /// [`policy_disagreements`](Self::policy_disagreements)). The default does nothing.
    fn policy_in_force(&self, policy: &crate::Policy) {
        let _ = policy;
    }

    /// The tools whose policy the live replicas sharing this store enforce differently, as
    /// last checked (a store of one process, the default, has none).
    fn policy_disagreements(&self) -> Vec<PolicyDisagreement> {
        Vec::new()
    }
}

impl<S: Store> Store for Arc<S> {
    fn kind(&self) -> &'static str {
        (**self).kind()
    }
    fn decide(&self, plans: &[Plan<'_>]) -> Answer<Decision> {
        (**self).decide(plans)
    }
    fn adjust(&self, admission: &Arc<Admission>, factor: f64, now: Timestamp) -> Answer<()> {
        (**self).adjust(admission, factor, now)
    }
    fn release(&self, admission: &Arc<Admission>) -> Answer<()> {
        (**self).release(admission)
    }
    fn inspect(&self, keys: &CallKeys) -> Answer<Stored> {
        (**self).inspect(keys)
    }
    fn inspect_at(&self, keys: &CallKeys, now: Timestamp) -> Answer<Stored> {
        (**self).inspect_at(keys, now)
    }
    fn flush(&self) -> Answer<()> {
        (**self).flush()
    }
    fn policy_in_force(&self, policy: &crate::Policy) {
        (**self).policy_in_force(policy)
    }
    fn policy_disagreements(&self) -> Vec<PolicyDisagreement> {
        (**self).policy_disagreements()
    }
}

/// Replicas sharing a store that enforce different policies for one tool: during a rolling
/// reload for a moment, for good when one replica was given another file.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PolicyDisagreement {
    /// The tool.
    pub tool: String,
    /// This replica's fingerprint of the tool's policy; `None` when its policy has no such
    /// tool.
    pub fingerprint: Option<u64>,
    /// Each fingerprint the live replicas enforce (`None`: they have no such tool) with how
    /// many replicas, this one included.
    pub replicas: Vec<(Option<u64>, usize)>,
    /// How long this replica has seen them disagree.
    pub for_how_long: std::time::Duration,
    /// Whether that is longer than the grace time a rolling reload is given.
    pub past_grace: bool,
}

#[cfg(test)]
mod tests {
    use std::future::{Future, IntoFuture};
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use super::{Answer, StoreError};

    #[test]
    fn an_answer_given_at_once_is_ready_at_the_first_poll_and_a_later_one_polls_its_work() {
        let mut cx = Context::from_waker(Waker::noop());
        let now = pin!(Answer::Now(Ok::<u8, StoreError>(7)).into_future());
        assert!(matches!(now.poll(&mut cx), Poll::Ready(Ok(7))));
        let later = Answer::later(async { Err::<u8, _>(StoreError::Protocol("x".into())) });
        let later = pin!(later.into_future());
        assert!(matches!(
            later.poll(&mut cx),
            Poll::Ready(Err(StoreError::Protocol(_)))
        ));
    }

    #[test]
    #[should_panic(expected = "an answer polled after it was read")]
    fn an_answer_read_twice_is_a_bug() {
        let mut cx = Context::from_waker(Waker::noop());
        let mut now = pin!(Answer::Now(Ok::<u8, StoreError>(7)).into_future());
        let _ = now.as_mut().poll(&mut cx);
        let _ = now.as_mut().poll(&mut cx);
    }
}
