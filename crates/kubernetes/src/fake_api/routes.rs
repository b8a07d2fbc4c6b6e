//! The fake API server's HTTP routes: `/api/v1/...` and
//! `/apis/GROUP/VERSION/...`, then `[namespaces/NS/]RESOURCE[/NAME[/scale]]`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::store::{Selector, WatchScope};
use super::{Body, Shared};

/// Largest accepted request body.
const MAX_BODY: usize = 1 << 20;

/// What a path names.
#[derive(Debug, Default)]
struct Target {
    resource: String,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

fn parse_path(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest = match parts.as_slice() {
        ["api", "v1", rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
        _ => (None, rest),
    };
    let owned = |s: &&str| (*s).to_owned();
    match rest {
        [resource, tail @ ..] if tail.len() <= 2 => Some(Target {
            resource: (*resource).to_owned(),
            namespace,
            name: tail.first().map(owned),
            subresource: tail.get(1).map(owned),
        }),
        _ => None,
    }
}

fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), decode(v)))
        .collect()
}

/// Percent-decoding of a query value (selectors carry `=` and `,`).
fn decode(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn reply(status: StatusCode, body: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// A `Status` object, as the API server reports failures.
fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    reply(code, &status_json(code.as_u16(), reason, message))
}

fn status_json(code: u16, reason: &str, message: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// Serves one request.
pub async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let line = format!(
        "{} {}",
        req.method(),
        req.uri().path_and_query().map_or("", |p| p.as_str())
    );
    shared
        .requests
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(line);
    let Some(target) = parse_path(req.uri().path()) else {
        return status(StatusCode::NOT_FOUND, "NotFound", "no such path");
    };
    let q = query(&req);
    let method = req.method().clone();
    match (method, target.name.is_some(), target.subresource.as_deref()) {
        (Method::GET, false, None)
            if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) =>
        {
            watch(shared, &target, &q)
        }
        (Method::GET, false, None) => list(&shared, &target, &q),
        (Method::GET, true, None) => get(&shared, &target),
        (Method::GET, true, Some("scale")) => scale(&shared, &target, None),
        (Method::PUT | Method::PATCH, true, Some("scale")) => match body(req).await {
            Ok(b) => scale(&shared, &target, Some(b)),
            Err(r) => r,
        },
        (Method::POST, false, None) | (Method::PUT, true, None) => match body(req).await {
            Ok(b) => write(&shared, &target, b),
            Err(r) => r,
        },
        (Method::DELETE, true, None) => delete(&shared, &target),
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "not supported by the fake",
        ),
    }
}

async fn body(req: Request<Incoming>) -> Result<Value, Response<Body>> {
    let bytes = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|_| {
            status(
                StatusCode::PAYLOAD_TOO_LARGE,
                "RequestEntityTooLarge",
                "body too large",
            )
        })?
        .to_bytes();
    serde_json::from_slice(&bytes)
        .map_err(|e| status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()))
}

fn selector(q: &BTreeMap<String, String>) -> Result<Selector, String> {
    Selector::parse(q.get("labelSelector").map_or("", String::as_str))
}

fn list(shared: &Shared, t: &Target, q: &BTreeMap<String, String>) -> Response<Body> {
    let sel = match selector(q) {
        Ok(s) => s,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e),
    };
    let store = shared.store();
    let items = store.list(&t.resource, t.namespace.as_deref(), &sel);
    let (api_version, kind) = store.kinds.get(&t.resource).cloned().unwrap_or_default();
    reply(
        StatusCode::OK,
        &json!({"apiVersion": api_version, "kind": format!("{kind}List"),
                "metadata": {"resourceVersion": store.version.to_string()}, "items": items}),
    )
}

fn key(t: &Target) -> (String, String, String) {
    (
        t.resource.clone(),
        t.namespace.clone().unwrap_or_default(),
        t.name.clone().unwrap_or_default(),
    )
}

fn not_found(t: &Target) -> Response<Body> {
    let name = t.name.as_deref().unwrap_or_default();
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{} {name:?} not found", t.resource),
    )
}

fn get(shared: &Shared, t: &Target) -> Response<Body> {
    match shared.store().objects.get(&key(t)) {
        Some(o) => reply(StatusCode::OK, o),
        None => not_found(t),
    }
}

/// Create (POST) or replace (PUT): a replace naming a `resourceVersion`
/// other than the stored one is a 409 Conflict, as optimistic concurrency
/// (leases rely on it) requires.
fn write(shared: &Shared, t: &Target, mut object: Value) -> Response<Body> {
    if let Some(ns) = &t.namespace {
        object["metadata"]["namespace"] = json!(ns);
    }
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let k = (
        t.resource.clone(),
        t.namespace.clone().unwrap_or_default(),
        name.clone(),
    );
    let created = t.name.is_none();
    if created && let Some(refused) = refusal(shared, &t.resource) {
        return refused;
    }
    let mut store = shared.store();
    let stored = store
        .objects
        .get(&k)
        .map(|o| o["metadata"]["resourceVersion"].clone());
    match (created, stored) {
        (true, Some(_)) => {
            return status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("{name:?} already exists"),
            );
        }
        (false, None) => return not_found(t),
        (false, Some(rv)) => {
            let asked = object.pointer("/metadata/resourceVersion").cloned();
            if asked.is_some_and(|a| a != rv) {
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    "the object has been modified",
                );
            }
        }
        (true, None) => {}
    }
    let saved = store.apply(&t.resource, object);
    drop(store);
    shared.notify();
    reply(
        if created {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        },
        &saved,
    )
}

/// The answer a scenario set for creates of `resource`, if any.
fn refusal(shared: &Shared, resource: &str) -> Option<Response<Body>> {
    let code = *shared
        .refusals
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(resource)?;
    let status_code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let reason = match code {
        403 => "Forbidden",
        409 => "AlreadyExists",
        422 => "Invalid",
        _ => "InternalError",
    };
    Some(status(
        status_code,
        reason,
        &format!("{resource} creation refused by the scenario"),
    ))
}

fn delete(shared: &Shared, t: &Target) -> Response<Body> {
    let (r, ns, name) = key(t);
    let gone = shared.store().delete(&r, &ns, &name);
    shared.notify();
    match gone {
        Some(o) => reply(StatusCode::OK, &o),
        None => not_found(t),
    }
}

/// `GET`, `PUT` or `PATCH` (merge patch) of the `scale` subresource: reads
/// or sets the object's `spec.replicas`, answers an `autoscaling/v1` Scale.
fn scale(shared: &Shared, t: &Target, change: Option<Value>) -> Response<Body> {
    let k = key(t);
    let mut store = shared.store();
    let Some(mut object) = store.objects.get(&k).cloned() else {
        return not_found(t);
    };
    if let Some(change) = change {
        let Some(replicas) = change.pointer("/spec/replicas").and_then(Value::as_i64) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "spec.replicas is required",
            );
        };
        object["spec"]["replicas"] = json!(replicas);
        object = store.apply(&t.resource, object);
        drop(store);
        shared.notify();
    }
    let replicas = object
        .pointer("/spec/replicas")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    reply(
        StatusCode::OK,
        &json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": k.2, "namespace": k.1, "resourceVersion": object["metadata"]["resourceVersion"]},
                "spec": {"replicas": replicas}, "status": {"replicas": replicas}}),
    )
}

/// A watch: JSON lines from the requested version on, until the client
/// leaves, `timeoutSeconds` passes, or the scenario ends watches.
fn watch(shared: Arc<Shared>, t: &Target, q: &BTreeMap<String, String>) -> Response<Body> {
    let selector = match selector(q) {
        Ok(s) => s,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e),
    };
    let scope = WatchScope {
        resource: t.resource.clone(),
        namespace: t.namespace.clone(),
        selector,
        bookmarks: q.get("allowWatchBookmarks").is_some_and(|v| v == "true"),
    };
    let from = q
        .get("resourceVersion")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|v| *v > 0);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(290), Duration::from_secs);
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
    tokio::spawn(stream_events(shared, scope, from, timeout, tx));
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut r = Response::new(BodyExt::boxed(body));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn line(v: &Value) -> Result<Frame<Bytes>, Infallible> {
    Ok(Frame::data(Bytes::from(format!("{v}\n"))))
}

async fn stream_events(
    shared: Arc<Shared>,
    scope: WatchScope,
    from: Option<u64>,
    timeout: Duration,
    tx: mpsc::Sender<Result<Frame<Bytes>, Infallible>>,
) {
    let epoch = shared.epoch.load(Ordering::SeqCst);
    let mut changed = shared.changed.subscribe();
    let start = {
        let store = shared.store();
        store
            .start_seq(from.unwrap_or(store.version))
            .ok_or(store.oldest)
    };
    let mut seq = match start {
        Ok(seq) => seq,
        Err(oldest) => {
            let message = format!("too old resource version: {} ({oldest})", from.unwrap_or(0));
            let gone = json!({"type": "ERROR", "object": status_json(410, "Expired", &message)});
            let _ = tx.send(line(&gone)).await;
            return;
        }
    };
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let (events, last) = shared.store().events_after(seq, &scope);
        seq = last;
        for e in &events {
            if tx.send(line(e)).await.is_err() {
                return;
            }
        }
        if shared.epoch.load(Ordering::SeqCst) != epoch || shared.down.load(Ordering::SeqCst) {
            return;
        }
        tokio::select! {
            c = changed.changed() => if c.is_err() { return },
            _ = tokio::time::sleep_until(deadline) => return,
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_resource_namespace_name_and_subresource() {
        let t = parse_path("/apis/apps/v1/namespaces/ns/deployments/web/scale").expect("path");
        assert_eq!(
            (
                t.resource.as_str(),
                t.namespace.as_deref(),
                t.name.as_deref(),
                t.subresource.as_deref()
            ),
            ("deployments", Some("ns"), Some("web"), Some("scale"))
        );
        let t = parse_path("/api/v1/services").expect("path");
        assert_eq!(
            (t.resource.as_str(), t.namespace, t.name),
            ("services", None, None)
        );
        let t = parse_path("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices").expect("path");
        assert_eq!(
            (t.resource.as_str(), t.namespace.as_deref()),
            ("endpointslices", Some("ns"))
        );
        assert!(parse_path("/healthz").is_none());
        assert_eq!(decode("a%3Db%2Cc+d"), "a=b,c d");
    }
}
