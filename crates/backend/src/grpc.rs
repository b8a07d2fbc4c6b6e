//! The backend's gRPC mode, served on the same port as HTTP: requests with
//! `content-type: application/grpc*` go to `grpc.health.v1.Health` and to
//! `meshless.echo.v1.Echo`, whose replies and response metadata
//! (`x-backend`) name the backend.
//!
//! In failing mode (`/admin/fail`, [`crate::Backend::set_failing`]) every
//! echo call answers `UNAVAILABLE` and the health service `NOT_SERVING`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status, Streaming};

use crate::State;

#[allow(
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used
)]
pub mod health {
    //! `grpc.health.v1`, the standard health checking protocol.
    tonic::include_proto!("grpc.health.v1");
}

#[allow(
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used
)]
pub mod echo {
    //! `meshless.echo.v1`, the demo echo service.
    tonic::include_proto!("meshless.echo.v1");
}

use echo::echo_server::{Echo, EchoServer};
use echo::{EchoReply, EchoRequest};
use health::health_check_response::ServingStatus;
use health::health_server::{Health, HealthServer};
use health::{HealthCheckRequest, HealthCheckResponse};

/// The service name the health service reports on besides `""`.
pub const ECHO_SERVICE: &str = "meshless.echo.v1.Echo";

/// Most replies one server-streaming call sends.
const MAX_STREAMED: u32 = 10_000;

/// The gRPC services of a backend.
pub(crate) fn routes(state: &Arc<State>) -> tonic::service::Routes {
    tonic::service::Routes::new(HealthServer::new(HealthService(Arc::clone(state))))
        .add_service(EchoServer::new(EchoService(Arc::clone(state))))
}

#[derive(Debug)]
struct HealthService(Arc<State>);

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        req: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = req.into_inner().service;
        if !service.is_empty() && service != ECHO_SERVICE {
            return Err(Status::not_found(format!("unknown service {service:?}")));
        }
        let status = if self.0.failing.load(Ordering::Relaxed) {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        };
        Ok(Response::new(HealthCheckResponse {
            status: status.into(),
        }))
    }
}

#[derive(Debug)]
struct EchoService(Arc<State>);

type ReplyStream = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send>>;

impl EchoService {
    /// The status a call answers with instead of a reply, if any.
    fn refusal(&self, fail_code: u32) -> Option<Status> {
        if self.0.failing.load(Ordering::Relaxed) {
            return Some(Status::unavailable(format!("{} failing", self.0.name)));
        }
        let code = Code::from(i32::try_from(fail_code).unwrap_or(i32::MAX));
        // The details (`grpc-status-details-bin`) carry the name too.
        (code != Code::Ok).then(|| {
            Status::with_details(
                code,
                format!("{} fails as asked", self.0.name),
                bytes::Bytes::from(self.0.name.clone()),
            )
        })
    }

    fn reply(&self, message: String, received: u32) -> EchoReply {
        EchoReply {
            message,
            backend: self.0.name.clone(),
            received,
        }
    }

    /// `inner` with `x-backend: NAME` in its metadata.
    fn named<T>(&self, inner: T) -> Response<T> {
        let mut resp = Response::new(inner);
        if let Ok(v) = self.0.name.parse() {
            resp.metadata_mut().insert("x-backend", v);
        }
        resp
    }

    /// A refusal as a status carrying `x-backend` too.
    fn refused(&self, mut status: Status) -> Status {
        if let Ok(v) = self.0.name.parse() {
            status.metadata_mut().insert("x-backend", v);
        }
        status
    }
}

async fn pause(ms: u32) {
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(u64::from(ms))).await;
    }
}

#[tonic::async_trait]
impl Echo for EchoService {
    async fn unary(&self, req: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let r = req.into_inner();
        pause(r.delay_ms).await;
        if let Some(s) = self.refusal(r.fail_code) {
            return Err(self.refused(s));
        }
        Ok(self.named(self.reply(r.message, 1)))
    }

    type ServerStreamStream = ReplyStream;

    async fn server_stream(
        &self,
        req: Request<EchoRequest>,
    ) -> Result<Response<ReplyStream>, Status> {
        let r = req.into_inner();
        if let Some(s) = self.refusal(r.fail_code) {
            return Err(self.refused(s));
        }
        let count = r.count.clamp(1, MAX_STREAMED);
        let (name, delay) = (self.0.name.clone(), r.delay_ms);
        let stream = tokio_stream::iter(0..count).then(move |i| {
            let (name, message) = (name.clone(), format!("{} {i}", r.message));
            async move {
                pause(delay).await;
                Ok(EchoReply {
                    message,
                    backend: name,
                    received: 1,
                })
            }
        });
        Ok(self.named(Box::pin(stream) as ReplyStream))
    }

    async fn client_stream(
        &self,
        req: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<EchoReply>, Status> {
        let mut stream = req.into_inner();
        let (mut received, mut last) = (0u32, String::new());
        while let Some(r) = stream.message().await? {
            if let Some(s) = self.refusal(r.fail_code) {
                return Err(self.refused(s));
            }
            received = received.saturating_add(1);
            last = r.message;
        }
        Ok(self.named(self.reply(last, received)))
    }

    type BidiStream = ReplyStream;

    async fn bidi(
        &self,
        req: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let state = Arc::clone(&self.0);
        let stream = req.into_inner().then(move |r| {
            let name = state.name.clone();
            async move {
                let r = r?;
                pause(r.delay_ms).await;
                Ok(EchoReply {
                    message: r.message,
                    backend: name,
                    received: 1,
                })
            }
        });
        Ok(self.named(Box::pin(stream) as ReplyStream))
    }
}
