//! The gRPC service's answers, given only while this master still leads once they are ready.
//! Calls are checked when they arrive (the interceptor), but one can take long: a put start
//! that waits for offloads, a removal by pattern, a long poll, a large body on its way. Should
//! the lease lapse meanwhile, its answer would be a deposed term's: a removal answered "done"
//! that the next leader never hears of (the owners still hold the objects, and report them).
//! The framed adapter checks the same after each call.

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
};

use tonic::{
    body::Body,
    codegen::{http, BoxFuture, Service},
    server::NamedService,
    Status,
};

/// Wraps a gRPC service: an answer ready once `leading` says no is replaced with UNAVAILABLE
/// and `NOT_LEADING`, which clients take as "look the leader up again".
#[derive(Clone)]
pub struct AnswerWhileLeading<S> {
    inner: S,
    leading: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl<S> AnswerWhileLeading<S> {
    pub fn new(inner: S, leading: Arc<dyn Fn() -> bool + Send + Sync>) -> Self {
        AnswerWhileLeading { inner, leading }
    }
}

impl<S: NamedService> NamedService for AnswerWhileLeading<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for AnswerWhileLeading<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let answer = self.inner.call(req);
        let leading = self.leading.clone();
        Box::pin(async move {
            let answer = answer.await?;
            if leading() {
                Ok(answer)
            } else {
                Ok(Status::unavailable(crate::server::NOT_LEADING).into_http())
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[tokio::test]
    async fn an_answer_ready_after_the_lease_lapsed_is_not_given() {
        let lead = Arc::new(AtomicBool::new(true));
        let during = lead.clone();
        // A call during which the lease lapses.
        let inner = tower::service_fn(move |_: http::Request<()>| {
            let during = during.clone();
            async move {
                during.store(false, Ordering::SeqCst);
                Ok::<_, Infallible>(http::Response::new(Body::default()))
            }
        });
        let l = lead.clone();
        let mut svc = AnswerWhileLeading::new(inner, Arc::new(move || l.load(Ordering::SeqCst)));
        let answer = svc.call(http::Request::new(())).await.unwrap();
        let status = Status::from_header_map(answer.headers()).expect("a gRPC status");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains(crate::server::NOT_LEADING));
        // While it leads, answers go out as they are.
        lead.store(true, Ordering::SeqCst);
        let l = lead.clone();
        let inner = tower::service_fn(|_: http::Request<()>| async {
            Ok::<_, Infallible>(http::Response::new(Body::default()))
        });
        let mut svc = AnswerWhileLeading::new(inner, Arc::new(move || l.load(Ordering::SeqCst)));
        let answer = svc.call(http::Request::new(())).await.unwrap();
        assert!(Status::from_header_map(answer.headers()).is_none());
    }
}
