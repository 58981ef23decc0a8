//! The future [`Limiter::admit`] returns: a call decided at its first poll, and, when its
//! store must be waited for, the rest of it polled after.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use super::{Begun, Limiter, Waiting};
use crate::clock::Clock;
use crate::identity::{Caller, Cost};
use crate::store::Store;
use crate::telemetry::decisions::Outcome;

/// The future of one call's decision, from [`Limiter::admit`].
///
/// Nothing is decided until it is polled. The first poll does every step that needs no
/// waiting (spent from the caller's lease, refused by who it is, or decided by a store that
/// answers at once); with the `tokio` feature it first spends a unit of the task's
/// cooperative budget, like any awaited operation, so a task that loops on calls answered at
/// once still lets the runtime run its other tasks. A call whose store must be waited for
/// (Redis) is waited for in the polls after; dropped then, the store's own rules for an
/// abandoned call apply.
#[must_use = "a call is decided only when its future is awaited"]
pub struct Admit<'a, S, C> {
    stage: Stage<'a, S, C>,
}

/// Where a call's future stands.
enum Stage<'a, S, C> {
    /// Not polled yet.
    Start {
        limiter: &'a Limiter<S, C>,
        caller: &'a Caller,
        tool: &'a str,
        cost: Cost,
    },
    /// Waiting for the store, and what follows its answer.
    Waiting(Waiting),
    /// Answered.
    Done,
}

impl<'a, S, C> Admit<'a, S, C> {
    /// A call of `caller` on `tool` for `cost`, to be decided by `limiter` when polled.
    pub(super) fn new(
        limiter: &'a Limiter<S, C>,
        caller: &'a Caller,
        tool: &'a str,
        cost: Cost,
    ) -> Self {
        Admit {
            stage: Stage::Start {
                limiter,
                caller,
                tool,
                cost,
            },
        }
    }
}

impl<S: Store, C: Clock> Future for Admit<'_, S, C> {
    type Output = Outcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        if let Stage::Start {
            limiter,
            caller,
            tool,
            cost,
        } = self.stage
        {
            #[cfg(feature = "tokio")]
            ready!(tokio::task::coop::poll_proceed(cx)).made_progress();
            match limiter.begin(caller, tool, cost) {
                Begun::Done(outcome) => {
                    self.stage = Stage::Done;
                    return Poll::Ready(outcome);
                }
                Begun::Waiting(rest) => self.stage = Stage::Waiting(rest),
            }
        }
        let Stage::Waiting(rest) = &mut self.stage else {
            panic!("a call's future was polled after it was answered");
        };
        let outcome = ready!(rest.as_mut().poll(cx));
        self.stage = Stage::Done;
        Poll::Ready(outcome)
    }
}

impl<S, C> std::fmt::Debug for Admit<'_, S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admit").finish_non_exhaustive()
    }
}
