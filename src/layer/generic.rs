//! Fair-share admission for services that do not speak HTTP: a [`Describe`] says who calls
//! which tool at what cost, refusals come back as [`FairShareError::Refused`], and permits are
//! held until the response future completes, fails or is dropped.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::{BoxFuture, Held, Limits};
use crate::clock::Clock;
use crate::identity::{Caller, Cost};
use crate::limiter::Begun;
use crate::limiter::{Limiter, Ticket};
use crate::store::Store;
use crate::Refusal;

/// Says who calls which tool at what cost, for a request type that is not HTTP.
///
/// ```
/// use std::sync::Arc;
/// use tower_fairshare::{Caller, Cost, Describe};
///
/// struct Job { tenant: String, tokens: f64 }
/// struct Jobs;
/// impl Describe<Job> for Jobs {
///     fn caller(&self, job: &Job) -> Option<Caller> { Some(Caller::new(job.tenant.as_str())) }
///     fn tool(&self, _: &Job) -> Option<Arc<str>> { Some(Arc::from("llm")) }
///     fn cost(&self, job: &Job) -> Cost { Cost(job.tokens) }
/// }
/// ```
pub trait Describe<Req>: Send + Sync + 'static {
    /// The caller; `None` when the request carries no identity.
    fn caller(&self, req: &Req) -> Option<Caller>;
    /// The tool; `None` lets the request through unmetered.
    fn tool(&self, req: &Req) -> Option<Arc<str>>;
    /// The cost (default 1).
    fn cost(&self, _req: &Req) -> Cost {
        Cost::default()
    }
}

/// The error of a [`Described`] service: refused before the inner service ran, or the inner
/// service's own error.
#[derive(Debug)]
#[non_exhaustive]
pub enum FairShareError<E> {
    /// Refused; the inner service was not called.
    Refused(Refusal),
    /// The inner service failed.
    Inner(E),
}

impl<E: fmt::Display> fmt::Display for FairShareError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FairShareError::Refused(r) => write!(f, "{r}"),
            FairShareError::Inner(e) => write!(f, "{e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for FairShareError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FairShareError::Refused(r) => Some(r),
            FairShareError::Inner(e) => Some(e),
        }
    }
}

/// A layer for non-HTTP services. Cheap to clone.
pub struct DescribedLayer<D> {
    limiter: Arc<dyn Limits>,
    describe: Arc<D>,
}

impl<D> Clone for DescribedLayer<D> {
    fn clone(&self) -> Self {
        DescribedLayer {
            limiter: self.limiter.clone(),
            describe: self.describe.clone(),
        }
    }
}

impl<D> fmt::Debug for DescribedLayer<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DescribedLayer").finish_non_exhaustive()
    }
}

impl<D> DescribedLayer<D> {
    /// Admission with `limiter`, requests described by `describe`.
    pub fn new<S: Store, C: Clock>(limiter: Limiter<S, C>, describe: D) -> Self {
        DescribedLayer {
            limiter: Arc::new(limiter),
            describe: Arc::new(describe),
        }
    }
}

impl<S, D> Layer<S> for DescribedLayer<D> {
    type Service = Described<S, D>;
    fn layer(&self, inner: S) -> Described<S, D> {
        Described {
            inner,
            limiter: self.limiter.clone(),
            describe: self.describe.clone(),
        }
    }
}

/// A non-HTTP service behind a [`DescribedLayer`].
pub struct Described<S, D> {
    inner: S,
    limiter: Arc<dyn Limits>,
    describe: Arc<D>,
}

impl<S: Clone, D> Clone for Described<S, D> {
    fn clone(&self) -> Self {
        Described {
            inner: self.inner.clone(),
            limiter: self.limiter.clone(),
            describe: self.describe.clone(),
        }
    }
}

impl<S: fmt::Debug, D> fmt::Debug for Described<S, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Described")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, D, Req> Service<Req> for Described<S, D>
where
    S: Service<Req> + Clone,
    D: Describe<Req>,
{
    type Response = S::Response;
    type Error = FairShareError<S::Error>;
    type Future = DescribedFuture<S, Req>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(FairShareError::Inner)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let Some(tool) = self.describe.tool(&req) else {
            return DescribedFuture {
                state: GenState::Calling {
                    fut: self.inner.call(req),
                    held: None,
                },
            };
        };
        let caller = self.describe.caller(&req).unwrap_or_default();
        let cost = self.describe.cost(&req);
        let state = match self.limiter.begin(&caller, &tool, cost) {
            // Decided at once: the ready service is called now, no clone needed.
            Begun::Done(Ok(ticket)) => GenState::Calling {
                held: Some(Held::new(ticket, &self.limiter)),
                fut: self.inner.call(req),
            },
            Begun::Done(Err(r)) => GenState::Refused { refusal: Some(r) },
            Begun::Waiting(admission) => {
                let clone = self.inner.clone();
                GenState::Admitting {
                    admission,
                    inner: Some(std::mem::replace(&mut self.inner, clone)),
                    req: Some(req),
                    limiter: self.limiter.clone(),
                }
            }
        };
        DescribedFuture { state }
    }
}

pin_project! {
    /// The response future of [`Described`].
    pub struct DescribedFuture<S, Req>
    where
        S: Service<Req>,
    {
        #[pin]
        state: GenState<S, Req>,
    }
}

pin_project! {
    #[project = GenProj]
    enum GenState<S, Req>
    where
        S: Service<Req>,
    {
        Admitting {
            admission: BoxFuture<Result<Ticket, Refusal>>,
            inner: Option<S>,
            req: Option<Req>,
            limiter: Arc<dyn Limits>,
        },
        Calling {
            #[pin]
            fut: S::Future,
            held: Option<Held>,
        },
        Refused {
            refusal: Option<Refusal>,
        },
    }
}

impl<S: Service<Req>, Req> fmt::Debug for DescribedFuture<S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DescribedFuture").finish_non_exhaustive()
    }
}

impl<S: Service<Req>, Req> Future for DescribedFuture<S, Req> {
    type Output = Result<S::Response, FairShareError<S::Error>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project().state.project() {
                GenProj::Admitting {
                    admission,
                    inner,
                    req,
                    limiter,
                } => match ready!(admission.as_mut().poll(cx)) {
                    Err(r) => return Poll::Ready(Err(FairShareError::Refused(r))),
                    Ok(ticket) => {
                        let (Some(mut inner), Some(req)) = (inner.take(), req.take()) else {
                            panic!("DescribedFuture polled after completion");
                        };
                        GenState::Calling {
                            held: Some(Held::new(ticket, limiter)),
                            fut: inner.call(req),
                        }
                    }
                },
                GenProj::Calling { fut, held } => {
                    let out = ready!(fut.poll(cx));
                    // Done (or failed): the call is no longer in flight.
                    held.take();
                    return Poll::Ready(out.map_err(FairShareError::Inner));
                }
                GenProj::Refused { refusal } => {
                    let r = refusal.take().expect("polled after completion");
                    return Poll::Ready(Err(FairShareError::Refused(r)));
                }
            };
            self.as_mut().project().state.set(next);
        }
    }
}
