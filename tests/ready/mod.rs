//! Polls a future once: the in-process store answers every call at once, so its futures are
//! ready at their first poll and a test needs no runtime to drive them.

use std::future::{Future, IntoFuture};
use std::pin::pin;
use std::task::{Context, Poll, Waker};

/// The output of `f`, which must be ready at its first poll.
pub fn now<F: IntoFuture>(f: F) -> F::Output {
    match pin!(f.into_future())
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the memory store never waits"),
    }
}
