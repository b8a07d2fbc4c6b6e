//! The registration API over HTTP/1.1 and h2c: a small router over
//! `/v1/services`, `/metrics` and `/ready`, JSON in and out (types in
//! [`crate::api`]), one bearer-token check ([`crate::state::Auth`]) for
//! everything under `/v1`, and bodies limited to `max_body_bytes`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use meshless_model::EndpointId;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::api::{
    BulkInput, EndpointInput, ErrorReply, RemoteLoad, RenewReply, ServiceInput, ServiceList,
    ServiceListItem, ServiceSpec, VersionReply, check_endpoint_id,
};
use crate::registry::RegistryError;
use crate::state::{PlaneState, UNAUTHENTICATED};

type Reply = Response<Full<Bytes>>;

/// After a failed accept (EMFILE, ENFILE, ENOBUFS...), wait this long
/// before the next one, doubling up to [`ACCEPT_BACKOFF_MAX`]; reset by a
/// successful accept. Without it a full descriptor table spins a core.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
/// Longest pause between failed accepts.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The pause after `failures` accept errors in a row (0 = none).
pub fn accept_backoff(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    ACCEPT_BACKOFF_MIN
        .saturating_mul(1 << (failures - 1).min(16))
        .min(ACCEPT_BACKOFF_MAX)
}

/// Serves the API on `listener` until `stop` changes.
pub async fn serve(listener: TcpListener, state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    let mut failures = 0u32;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                failures = 0;
                stream
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                let pause = accept_backoff(failures);
                tracing::warn!(error = %e, pause_ms = pause.as_millis() as u64, "API accept failed");
                tokio::select! {
                    _ = tokio::time::sleep(pause) => continue,
                    _ = stop.changed() => return,
                }
            }
        };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(Arc::clone(&state), req));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(state: Arc<PlaneState>, req: Request<Incoming>) -> Result<Reply, Infallible> {
    Ok(route(&state, req).await.unwrap_or_else(|r| r))
}

/// A JSON reply.
pub fn json(status: StatusCode, value: &impl Serialize) -> Reply {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// `{"error": message}` with `status`.
pub fn error(status: StatusCode, message: impl std::fmt::Display) -> Reply {
    json(
        status,
        &ErrorReply {
            error: message.to_string(),
        },
    )
}

fn registry_error(e: RegistryError) -> Reply {
    let status = match e {
        RegistryError::Invalid(_) => StatusCode::BAD_REQUEST,
        RegistryError::UnknownService(_)
        | RegistryError::UnknownEndpoint { .. }
        | RegistryError::UnknownEndpointAt { .. } => StatusCode::NOT_FOUND,
        RegistryError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e)
}

/// Decodes a JSON body of at most `max` bytes: 413 when larger, 400
/// naming the field (or line and column) at fault when malformed.
pub async fn read_json<T, B>(body: B, max: usize) -> Result<T, Reply>
where
    T: serde::de::DeserializeOwned,
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let body = Limited::new(body, max)
        .collect()
        .await
        .map_err(|_| {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body over {max} bytes"),
            )
        })?
        .to_bytes();
    let de = &mut serde_json::Deserializer::from_slice(&body);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        error(
            StatusCode::BAD_REQUEST,
            format!("body: {path}: {}", e.into_inner()),
        )
    })?;
    // One JSON value and nothing after it but whitespace: `{..}garbage`
    // or two concatenated objects are refused, not half-read.
    de.end().map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("body: trailing characters after the JSON value: {e}"),
        )
    })?;
    Ok(value)
}

fn version(v: u64) -> Reply {
    json(StatusCode::OK, &VersionReply { version: v })
}

const ROUTES: &str = "routes: GET /v1/services, GET|PUT|DELETE /v1/services/NS/NAME, \
     PUT|DELETE /v1/services/NS/NAME/endpoints/ID, POST /v1/services/NS/NAME/endpoints (bulk), \
     POST /v1/services/NS/NAME/endpoints/ID/renew, GET /metrics, GET /ready";

/// A reply for a call the runtime's shutdown cut.
fn shutting_down() -> Reply {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "control plane shutting down",
    )
}

async fn route(state: &Arc<PlaneState>, req: Request<Incoming>) -> Result<Reply, Reply> {
    let path = req.uri().path().trim_matches('/').to_owned();
    let parts: Vec<&str> = path.split('/').collect();
    let method = req.method().clone();
    match (&method, parts.as_slice()) {
        (&Method::GET, ["metrics"]) => return Ok(metrics(state)),
        (&Method::GET, ["ready"]) => {
            // Not Ready before the Kubernetes source's first lists: a
            // snapshot served now would miss every service not yet listed.
            return Ok(if state.metrics.store_failing.get() != 0 {
                json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &serde_json::json!({"ready": false, "reason": "the data store refuses writes (meshless_control_store_failing)"}),
                )
            } else if state.distributor.is_synced() {
                json(StatusCode::OK, &serde_json::json!({"ready": true}))
            } else {
                json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &serde_json::json!({"ready": false, "reason": "kubernetes source not listed yet"}),
                )
            });
        }
        _ => {}
    }
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !state.auth.allows(authorization) {
        return Err(error(StatusCode::UNAUTHORIZED, UNAUTHENTICATED));
    }
    match (&method, parts.as_slice()) {
        (&Method::GET, ["v1", "services"]) => list(state).await,
        (&Method::POST, ["v1", "services", ns, name, "load"]) => {
            let report: RemoteLoad =
                read_json(req.into_body(), state.config.max_body_bytes).await?;
            state
                .distributor
                .record_remote_load(&format!("{ns}/{name}"), &report)
                .await;
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        (&Method::GET, ["v1", "services", ns, name]) => view(state, format!("{ns}/{name}")).await,
        (_, ["v1", "services", ns, name, rest @ ..]) => {
            let (ns, name) = ((*ns).to_owned(), (*name).to_owned());
            let rest: Vec<String> = rest.iter().map(|s| (*s).to_owned()).collect();
            write(state, req, &ns, &name, &rest).await
        }
        _ => Err(error(StatusCode::NOT_FOUND, ROUTES)),
    }
}

fn metrics(state: &PlaneState) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(state.metrics.encode())));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    r
}

async fn list(state: &Arc<PlaneState>) -> Result<Reply, Reply> {
    let (version, keys) = state
        .with_registry(|_, reg| (reg.version(), reg.service_keys()))
        .await
        .ok_or_else(shutting_down)?;
    let services = keys
        .into_iter()
        .map(|service| ServiceListItem { service })
        .collect();
    Ok(json(StatusCode::OK, &ServiceList { version, services }))
}

async fn view(state: &Arc<PlaneState>, key: String) -> Result<Reply, Reply> {
    let view = state
        .with_registry({
            let key = key.clone();
            move |_, reg| reg.view(&key)
        })
        .await
        .ok_or_else(shutting_down)?;
    match view {
        Some(v) => Ok(json(StatusCode::OK, &v)),
        None => Err(error(
            StatusCode::NOT_FOUND,
            format!("unknown service {key:?}"),
        )),
    }
}

/// Every route that changes a service: `rest` is the path after `NS/NAME`.
async fn write(
    state: &Arc<PlaneState>,
    req: Request<Incoming>,
    ns: &str,
    name: &str,
    rest: &[String],
) -> Result<Reply, Reply> {
    let key = format!("{ns}/{name}");
    let owner = state
        .with_registry({
            let key = key.clone();
            move |_, reg| reg.owner(&key).map(str::to_owned)
        })
        .await
        .ok_or_else(shutting_down)?;
    if let Some(origin) = owner {
        return Err(error(
            StatusCode::CONFLICT,
            format!("service {key} comes from {origin} and is read-only here: change it there"),
        ));
    }
    let max = state.config.max_body_bytes;
    let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
    match (req.method().clone(), rest.as_slice()) {
        (Method::PUT, []) => {
            let body: ServiceInput = read_json(req.into_body(), max).await?;
            let spec = ServiceSpec {
                namespace: ns.to_owned(),
                name: name.to_owned(),
                ports: body.ports,
                settings: body.settings,
            };
            let (v, _) = state
                .write_grouped(move |r| r.put_service(spec))
                .await
                .map_err(registry_error)?;
            Ok(version(v))
        }
        (Method::DELETE, []) => {
            let committed = Instant::now();
            // Its own store transaction (and fsync): off the executor.
            let deleted = state
                .with_registry_offloaded(move |state, reg| {
                    let delta = reg.delete_service(&key)?;
                    state.distributor.publish(&delta, committed);
                    Ok(delta.version)
                })
                .await
                .ok_or_else(shutting_down)?;
            Ok(version(deleted.map_err(registry_error)?))
        }
        (Method::PUT, ["endpoints", id]) => {
            let body: EndpointInput = read_json(req.into_body(), max).await?;
            if body.id != *id {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("id: body says {:?}, path says {id:?}", body.id),
                ));
            }
            check_endpoint_id(&body.id)
                .map_err(|reason| error(StatusCode::BAD_REQUEST, format!("id: {reason}")))?;
            let (_, v) = state
                .write_grouped(move |r| r.put_endpoints(&key, vec![body]))
                .await
                .map_err(|e| registry_error(single_endpoint(e)))?;
            Ok(version(v))
        }
        (Method::DELETE, ["endpoints", id]) => {
            let ids = [EndpointId::new(*id)];
            let (_, v) = state
                .write_grouped(move |r| r.delete_endpoints(&key, &ids, true))
                .await
                .map_err(registry_error)?;
            Ok(version(v))
        }
        (Method::POST, ["endpoints", id, "renew"]) => {
            let id = EndpointId::new(*id);
            state
                .with_registry({
                    let id = id.clone();
                    move |_, reg| reg.renew(&key, &id)
                })
                .await
                .ok_or_else(shutting_down)?
                .map_err(registry_error)?;
            state.metrics.renewals.inc();
            let renewed = id.to_string();
            Ok(json(StatusCode::OK, &RenewReply { renewed }))
        }
        (Method::POST, ["endpoints"]) => {
            let body: BulkInput = read_json(req.into_body(), max).await?;
            Ok(bulk(state, key, body).await)
        }
        (_, rest) => Err(match allowed(rest) {
            Some(allow) => {
                let mut reply = error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    format!("method {} not allowed here: {allow}", req.method()),
                );
                reply
                    .headers_mut()
                    .insert(header::ALLOW, header::HeaderValue::from_static(allow));
                reply
            }
            None => error(StatusCode::NOT_FOUND, ROUTES),
        }),
    }
}

/// The methods a path under `/v1/services/NS/NAME` (`rest` after it)
/// answers, for a 405's `Allow`; `None`: no such path (404).
fn allowed(rest: &[&str]) -> Option<&'static str> {
    match rest {
        [] => Some("GET, PUT, DELETE"),
        ["endpoints"] | ["load"] | ["endpoints", _, "renew"] => Some("POST"),
        ["endpoints", _] => Some("PUT, DELETE"),
        _ => None,
    }
}

/// A single PUT's error names the fields of its body, not the bulk call's
/// `put[0]` the registry names them by.
fn single_endpoint(e: RegistryError) -> RegistryError {
    match e {
        RegistryError::Invalid(mut f) => {
            if let Some(rest) = f.path.strip_prefix("put[0].") {
                f.path = rest.to_owned();
            } else if f.path == "put[0]" {
                f.path = meshless_model::field_error::TOP_LEVEL.to_owned();
            }
            RegistryError::Invalid(f)
        }
        other => other,
    }
}

/// Why a bulk call is refused before it reaches the registry: an id that
/// cannot be addressed, or one both put and deleted (contradictory).
fn check_bulk(body: &BulkInput) -> Result<(), String> {
    for (i, e) in body.put.iter().enumerate() {
        check_endpoint_id(&e.id).map_err(|reason| format!("put[{i}].id: {reason}"))?;
    }
    for (i, id) in body.delete.iter().enumerate() {
        check_endpoint_id(id).map_err(|reason| format!("delete[{i}]: {reason}"))?;
        if let Some(p) = body.put.iter().position(|e| e.id == *id) {
            return Err(format!(
                "delete[{i}]: {id:?} is also put (put[{p}]): one call either puts or deletes an id"
            ));
        }
    }
    Ok(())
}

async fn bulk(state: &Arc<PlaneState>, key: String, body: BulkInput) -> Reply {
    if let Err(e) = check_bulk(&body) {
        return error(StatusCode::BAD_REQUEST, e);
    }
    let ids: Vec<EndpointId> = body.delete.into_iter().map(EndpointId::new).collect();
    let written = state
        .write_grouped(move |r| {
            // All or nothing: an unknown delete refuses the puts too (as a
            // single DELETE of it is a 404), and nothing is written.
            r.require_endpoints(&key, &ids)?;
            let mut v = r.version();
            if !body.put.is_empty() {
                v = r.put_endpoints(&key, body.put)?;
            }
            if !ids.is_empty() {
                v = r.delete_endpoints(&key, &ids, true)?;
            }
            Ok(v)
        })
        .await;
    match written {
        Ok((_, v)) => version(v),
        Err(e) => registry_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_from_the_minimum_to_the_maximum() {
        assert_eq!(accept_backoff(0), Duration::ZERO);
        assert_eq!(accept_backoff(1), ACCEPT_BACKOFF_MIN);
        assert_eq!(accept_backoff(2), ACCEPT_BACKOFF_MIN * 2);
        for n in 1..100 {
            assert!(accept_backoff(n + 1) >= accept_backoff(n));
            assert!(accept_backoff(n) <= ACCEPT_BACKOFF_MAX);
        }
        assert_eq!(accept_backoff(u32::MAX), ACCEPT_BACKOFF_MAX);
    }

    fn body(text: &'static str) -> Full<Bytes> {
        Full::new(Bytes::from_static(text.as_bytes()))
    }

    async fn status_and_error<T: serde::de::DeserializeOwned + std::fmt::Debug>(
        text: &'static str,
        max: usize,
    ) -> (StatusCode, String) {
        let reply = read_json::<T, _>(body(text), max)
            .await
            .expect_err("rejected");
        let status = reply.status();
        let bytes = reply.into_body().collect().await.expect("body").to_bytes();
        let e: ErrorReply = serde_json::from_slice(&bytes).expect("error json");
        (status, e.error)
    }

    #[tokio::test]
    async fn trailing_characters_after_the_body_are_400() {
        let spaced = " {\"id\":\"x\",\"addresses\":[\"10.0.0.1\"],\"port\":80} \n";
        let read = read_json::<EndpointInput, _>(body(spaced), 1024).await;
        assert!(read.is_ok(), "whitespace around the value is fine");
        for text in [
            r#"{"id":"x","addresses":["10.0.0.1"],"port":80}garbage"#,
            r#"{"id":"x","addresses":["10.0.0.1"],"port":80}{"id":"y","addresses":["10.0.0.1"],"port":80}"#,
        ] {
            let (s, e) = status_and_error::<EndpointInput>(text, 1024).await;
            assert_eq!(s, StatusCode::BAD_REQUEST);
            assert!(e.starts_with("body: trailing characters"), "{e}");
        }
    }

    #[tokio::test]
    async fn malformed_bodies_are_400_and_name_the_problem() {
        let (s, e) = status_and_error::<EndpointInput>(
            r#"{"id":"a","addresses":["10.0.0.1"],"port":"x"}"#,
            1024,
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(e.starts_with("body: port:"), "{e}");
        let (s, e) = status_and_error::<BulkInput>(
            r#"{"put":[{"id":"a","addresses":["nope"],"port":1}]}"#,
            1024,
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(e.contains("put[0].addresses[0]"), "{e}");
        let (s, e) = status_and_error::<BulkInput>(r#"{"put":[{"id":"a","#, 1024).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(e.contains("EOF"), "truncated: {e}");
        let (s, e) = status_and_error::<BulkInput>(r#"{"puts":[]}"#, 1024).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(e.contains("unknown field `puts`"), "{e}");
        let (s, _) = status_and_error::<BulkInput>(r#"{"put":[]}"#, 4).await;
        assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    }
}
