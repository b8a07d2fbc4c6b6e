//! The registration API through real sockets (127.0.0.1, port 0) with the
//! typed client: routing, the one bearer-token check on both servers,
//! malformed bodies, TTL expiry, batching and timed compaction.

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use meshless_control::api::{BulkInput, EndpointInput, ErrorReply, ServiceInput, ServicePort};
use meshless_control::client::{ApiClient, ClientError};
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;

const SVC: &str = "shop/cart";

fn config(extra: &str) -> ControlConfig {
    let text = format!("api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\n{extra}");
    ControlConfig::parse(&text, "test").expect("config")
}

async fn start(extra: &str) -> (ControlPlane, ApiClient) {
    let plane = ControlPlane::start(config(extra)).await.expect("start");
    let client = ApiClient::new(plane.api_addr());
    (plane, client)
}

fn ep(i: u32) -> EndpointInput {
    EndpointInput::new(format!("cart-{i}"), [10, 0, 0, i as u8].into(), 8080)
}

/// Polls `check` until it holds; fails after 20 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn refused(e: ClientError) -> (StatusCode, String) {
    match e {
        ClientError::Refused { status, error, .. } => (status, error),
        other => panic!("expected a refusal, got {other}"),
    }
}

async fn raw_error(
    c: &ApiClient,
    method: Method,
    path: &str,
    body: &'static str,
) -> (StatusCode, String) {
    let (status, bytes) = c.raw(method, path, body).await.expect("answer");
    let e: ErrorReply = serde_json::from_slice(&bytes).expect("error json");
    (status, e.error)
}

#[tokio::test]
async fn routes_answer_with_versions_views_and_errors_that_name_the_problem() {
    let (plane, c) = start("").await;
    c.ready().await.expect("ready");
    let v1 = c
        .put_service(
            SVC,
            &ServiceInput {
                ports: vec![ServicePort::tcp(80)],
                ..ServiceInput::default()
            },
        )
        .await
        .expect("service");
    let v2 = c.put_endpoint(SVC, &ep(1)).await.expect("endpoint");
    assert!(v2 > v1, "versions grow");
    let bulk = BulkInput {
        put: vec![ep(2), ep(3)],
        delete: vec!["cart-1".into()],
    };
    let v3 = c.bulk(SVC, &bulk).await.expect("bulk");
    assert!(v3 > v2);
    let view = c.service(SVC).await.expect("view");
    let ids: Vec<&str> = view.endpoints.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["cart-2", "cart-3"]);
    assert!(
        view.endpoints.iter().all(|e| e.slice.is_some()),
        "reconciled at once"
    );
    let list = c.services().await.expect("list");
    assert_eq!(list.services.len(), 1);
    assert_eq!(list.services[0].service, SVC);

    let (s, e) = raw_error(
        &c,
        Method::PUT,
        "/v1/services/shop/cart/endpoints/other",
        r#"{"id":"cart-9","addresses":["10.0.0.9"],"port":1}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.starts_with("id:"), "{e}");
    let (s, e) = refused(c.delete_endpoint(SVC, "ghost").await.expect_err("404"));
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(e.contains("ghost"), "{e}");
    let (s, _) = refused(c.service("shop/none").await.expect_err("404"));
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, e) = raw_error(&c, Method::GET, "/v2/nothing", "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(e.starts_with("routes:"), "{e}");
    let (s, e) = refused(
        c.put_endpoint(SVC, &EndpointInput { weight: 0, ..ep(4) })
            .await
            .expect_err("weight"),
    );
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        e.starts_with("weight: "),
        "a single PUT names its body's field: {e}"
    );
    let (s, e) = raw_error(
        &c,
        Method::PUT,
        "/v1/services/shop/cart/endpoints/cart-9",
        r#"{"id":"cart-9","addresses":[],"port":1}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.starts_with("addresses: at least one"), "{e}");
    let (s, e) = raw_error(
        &c,
        Method::POST,
        "/v1/services/shop/cart/endpoints",
        r#"{"put":[{"id":"d","addresses":["10.0.0.1"],"port":1},{"id":"d","addresses":["10.0.0.1"],"port":1}]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        e.starts_with("put[1].id: duplicate"),
        "bulk names put[i]: {e}"
    );
    // A known path with another method: 405 with Allow, not 404.
    for (method, path, allow) in [
        (Method::PATCH, "/v1/services/shop/cart", "GET, PUT, DELETE"),
        (
            Method::GET,
            "/v1/services/shop/cart/endpoints/cart-2",
            "PUT, DELETE",
        ),
        (Method::GET, "/v1/services/shop/cart/endpoints", "POST"),
    ] {
        let (s, e) = raw_error(&c, method.clone(), path, "").await;
        assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}: {e}");
        assert!(e.ends_with(allow), "{method} {path}: {e}");
    }
    let v4 = c.delete_service(SVC).await.expect("delete");
    assert!(v4 > v3);
    assert!(c.services().await.expect("list").services.is_empty());
    plane.shutdown().await;
}

#[tokio::test]
async fn malformed_and_truncated_json_is_400_naming_the_problem() {
    let (plane, c) = start("max_body_bytes: 256\n").await;
    c.put_service(SVC, &ServiceInput::default())
        .await
        .expect("service");
    let bulk = "/v1/services/shop/cart/endpoints";
    let (s, e) = raw_error(
        &c,
        Method::POST,
        bulk,
        r#"{"put":[{"id":"a","addresses":["10.0.0.1"],"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        e.starts_with("body:") && e.contains("EOF"),
        "truncated: {e}"
    );
    let (s, e) = raw_error(
        &c,
        Method::POST,
        bulk,
        r#"{"put":[{"id":"a","addresses":["10.0.0.1"],"port":"80"}]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.contains("put[0].port"), "wrong type: {e}");
    let (s, e) = raw_error(&c, Method::POST, bulk, r#"{"put":[],"remove":[]}"#).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.contains("unknown field `remove`"), "{e}");
    let (s, e) = raw_error(&c, Method::POST, bulk, "not json").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.contains("line 1"), "{e}");
    let big = Box::leak(format!(r#"{{"delete":["{}"]}}"#, "x".repeat(300)).into_boxed_str());
    let (s, e) = raw_error(&c, Method::POST, bulk, big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(e.contains("256"), "{e}");
    assert!(
        c.service(SVC).await.expect("view").endpoints.is_empty(),
        "nothing stored"
    );
    plane.shutdown().await;
}

#[tokio::test]
async fn one_token_guards_the_api_and_the_stream_but_not_ready_or_metrics() {
    let dir = tempfile::Builder::new()
        .prefix("meshless-api-token-")
        .tempdir()
        .expect("dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n").expect("token");
    let (plane, open) = start(&format!("token_file: \"{}\"\n", token_file.display())).await;
    open.ready().await.expect("ready needs no token");
    open.metrics().await.expect("metrics need no token");
    let (s, e) = refused(open.services().await.expect_err("no token"));
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(e.contains("bearer token"), "{e}");
    let wrong = ApiClient::new(plane.api_addr()).with_token("s3cre");
    assert_eq!(
        refused(wrong.services().await.expect_err("wrong")).0,
        StatusCode::UNAUTHORIZED
    );
    let right = ApiClient::new(plane.api_addr()).with_token("s3cret");
    right.services().await.expect("right token");
    // The stream: no token, unauthenticated before any message is read.
    let mut grpc =
        meshless_api::DistributionClient::connect(format!("http://{}", plane.grpc_addr()))
            .await
            .expect("connect");
    let (_tx, rx) = tokio::sync::mpsc::channel::<meshless_api::v1::ClientMessage>(1);
    let status = grpc
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect_err("no token");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    plane.shutdown().await;
}

#[tokio::test]
async fn ttl_endpoints_expire_unless_renewed_and_renewal_errors_name_the_cause() {
    let (plane, c) = start("").await;
    c.put_service(SVC, &ServiceInput::default())
        .await
        .expect("service");
    c.put_endpoint(
        SVC,
        &EndpointInput {
            ttl_seconds: Some(1),
            ..ep(1)
        },
    )
    .await
    .expect("ttl");
    c.put_endpoint(SVC, &ep(2)).await.expect("no ttl");
    c.renew(SVC, "cart-1").await.expect("renew");
    let (s, e) = refused(c.renew(SVC, "cart-2").await.expect_err("no ttl"));
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.starts_with("ttl_seconds"), "{e}");
    assert_eq!(
        refused(c.renew(SVC, "ghost").await.expect_err("ghost")).0,
        StatusCode::NOT_FOUND
    );
    eventually("cart-1 to expire", || async {
        let v = c.service(SVC).await.expect("view");
        v.endpoints.iter().map(|e| e.id.as_str()).eq(["cart-2"])
    })
    .await;
    // Counted once the housekeeping task has the commit's answer, which
    // may be after the view shows the expiry.
    eventually("the expiry counted", || async {
        c.metrics()
            .await
            .expect("metrics")
            .contains("meshless_control_expired_endpoints_total 1")
    })
    .await;
    plane.shutdown().await;
}

#[tokio::test]
async fn with_a_batch_period_writes_are_reconciled_by_the_batch_task() {
    let (plane, c) = start("batch_period: 50ms\n").await;
    c.put_service(SVC, &ServiceInput::default())
        .await
        .expect("service");
    for i in 0..5 {
        c.put_endpoint(SVC, &ep(i)).await.expect("put");
    }
    eventually("every endpoint in a slice", || async {
        let v = c.service(SVC).await.expect("view");
        v.endpoints.len() == 5 && v.endpoints.iter().all(|e| e.slice.is_some())
    })
    .await;
    plane.shutdown().await;
}

#[tokio::test]
async fn sparse_slices_are_compacted_once_the_service_is_quiet() {
    let (plane, c) = start("max_endpoints_per_slice: 10\ncompact_after: 1s\n").await;
    c.put_service(SVC, &ServiceInput::default())
        .await
        .expect("service");
    let put = (0..30).map(ep).collect();
    c.bulk(
        SVC,
        &BulkInput {
            put,
            delete: Vec::new(),
        },
    )
    .await
    .expect("bulk");
    let view = c.service(SVC).await.expect("view");
    assert_eq!(view.slices.len(), 3);
    let delete = view
        .slices
        .iter()
        .flat_map(|s| s.endpoints[1..].to_vec())
        .collect();
    c.bulk(
        SVC,
        &BulkInput {
            put: Vec::new(),
            delete,
        },
    )
    .await
    .expect("delete");
    eventually("one slice", || async {
        c.service(SVC).await.expect("view").slices.len() == 1
    })
    .await;
    let v = c.service(SVC).await.expect("view");
    assert_eq!(v.endpoints.len(), 3);
    assert!(
        v.endpoints
            .iter()
            .all(|e| e.slice.as_deref() == Some(v.slices[0].name.as_str()))
    );
    plane.shutdown().await;
}

/// Bulk calls are all or nothing and agree with single calls: an unknown
/// delete is a 404 naming its index (no write, no version), an id both put
/// and deleted is a 400; ids must be addressable by path; a body with
/// anything after its JSON value is a 400.
#[tokio::test]
async fn bulk_calls_agree_with_single_calls_and_ids_and_bodies_are_checked() {
    let (plane, c) = start("").await;
    c.put_service(SVC, &ServiceInput::default())
        .await
        .expect("service");
    let v1 = c.put_endpoint(SVC, &ep(1)).await.expect("endpoint");
    let bulk = "/v1/services/shop/cart/endpoints";

    // C10: unknown delete, alone or with puts: 404, nothing written.
    let (s, e) = raw_error(&c, Method::POST, bulk, r#"{"delete":["nosuch"]}"#).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(e.starts_with("delete[0]:") && e.contains("nosuch"), "{e}");
    let (s, e) = raw_error(
        &c,
        Method::POST,
        bulk,
        r#"{"put":[{"id":"cart-5","addresses":["10.0.0.5"],"port":80}],"delete":["cart-1","nosuch"]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(e.starts_with("delete[1]:"), "{e}");
    let (s, e) = raw_error(
        &c,
        Method::POST,
        bulk,
        r#"{"put":[{"id":"cart-1","addresses":["10.0.0.1"],"port":80}],"delete":["cart-1"]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.starts_with("delete[0]:") && e.contains("put[0]"), "{e}");
    let view = c.service(SVC).await.expect("view");
    let ids: Vec<&str> = view.endpoints.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["cart-1"], "nothing of the refused calls applied");
    assert_eq!(view.version, v1, "no version consumed by refused calls");

    // C7: ids that cannot be addressed by path.
    for (body, at) in [
        (
            r#"{"put":[{"id":"a/b","addresses":["10.0.0.1"],"port":80}]}"#,
            "put[0].id:",
        ),
        (
            r#"{"put":[{"id":" ","addresses":["10.0.0.1"],"port":80}]}"#,
            "put[0].id:",
        ),
        (
            r#"{"put":[{"id":"..","addresses":["10.0.0.1"],"port":80}]}"#,
            "put[0].id:",
        ),
        (
            r#"{"put":[{"id":"a\tb","addresses":["10.0.0.1"],"port":80}]}"#,
            "put[0].id:",
        ),
        (r#"{"delete":["a%2Fb"]}"#, "delete[0]:"),
    ] {
        let (s, e) = raw_error(&c, Method::POST, bulk, body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
        assert!(e.starts_with(at), "{body}: {e}");
    }
    let long = Box::leak(
        format!(
            r#"{{"put":[{{"id":"{}","addresses":["10.0.0.1"],"port":80}}]}}"#,
            "a".repeat(254)
        )
        .into_boxed_str(),
    );
    let (s, e) = raw_error(&c, Method::POST, bulk, long).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.starts_with("put[0].id:") && e.contains("253"), "{e}");
    // Kubernetes-like names and IP-address ids are fine.
    let ok = r#"{"put":[{"id":"cart-7d9f8b6c5d-x2k4q","addresses":["10.0.0.2"],"port":80},{"id":"fd00::1","addresses":["fd00::1"],"port":80},{"id":"Pod_1.a","addresses":["10.0.0.3"],"port":80}]}"#;
    let (s, _) = c.raw(Method::POST, bulk, ok).await.expect("answer");
    assert_eq!(s, StatusCode::OK);

    // C6: trailing garbage or a second value after the body.
    for body in [
        r#"{"id":"cart-8","addresses":["10.0.0.8"],"port":80}garbage"#,
        r#"{"id":"cart-8","addresses":["10.0.0.8"],"port":80}{"id":"cart-8","addresses":["10.0.0.8"],"port":81}"#,
    ] {
        let (s, e) = raw_error(
            &c,
            Method::PUT,
            "/v1/services/shop/cart/endpoints/cart-8",
            body,
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(e.starts_with("body: trailing characters"), "{e}");
    }
    let view = c.service(SVC).await.expect("view");
    assert!(
        view.endpoints.iter().all(|e| e.id != "cart-8"),
        "not stored"
    );
    plane.shutdown().await;
}

/// Addresses a proxy cannot dial as an instance, duplicated addresses,
/// duplicate or malformed port names and over-long zones are refused with
/// the field at fault.
#[tokio::test]
async fn addresses_and_port_names_are_checked_like_kubernetes() {
    let (plane, c) = start("").await;
    let svc = "/v1/services/shop/cart";
    for (body, field) in [
        (
            r#"{"ports":[{"name":"http","port":80},{"name":"http","port":81}]}"#,
            "ports[1].name",
        ),
        (r#"{"ports":[{"name":"","port":80}]}"#, "ports[0].name"),
        (r#"{"ports":[{"name":"HTTP!","port":80}]}"#, "ports[0].name"),
    ] {
        let (s, e) = raw_error(&c, Method::PUT, svc, body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
        assert!(e.starts_with(field), "{body}: {e}");
    }
    let (s, _) = c
        .raw(
            Method::PUT,
            svc,
            r#"{"ports":[{"name":"http","port":80},{"name":"grpc","port":81},{"port":82}]}"#,
        )
        .await
        .expect("answer");
    assert_eq!(s, StatusCode::OK);
    let path = "/v1/services/shop/cart/endpoints/x";
    for (body, field) in [
        (
            r#"{"id":"x","addresses":["0.0.0.0"],"port":80}"#,
            "addresses[0]",
        ),
        (r#"{"id":"x","addresses":["::"],"port":80}"#, "addresses[0]"),
        (
            r#"{"id":"x","addresses":["255.255.255.255"],"port":80}"#,
            "addresses[0]",
        ),
        (
            r#"{"id":"x","addresses":["224.0.0.1"],"port":80}"#,
            "addresses[0]",
        ),
        (
            r#"{"id":"x","addresses":["10.0.0.1","10.0.0.1"],"port":80}"#,
            "addresses[1]",
        ),
        (
            r#"{"id":"x","addresses":["10.0.0.1"],"port":80,"node":"bad node\n"}"#,
            "node",
        ),
    ] {
        let (s, e) = raw_error(&c, Method::PUT, path, body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
        assert!(e.starts_with(&format!("{field}:")), "{body}: {e}");
    }
    let long_zone = Box::leak(
        format!(
            r#"{{"id":"x","addresses":["10.0.0.1"],"port":80,"zone":"{}"}}"#,
            "z".repeat(64)
        )
        .into_boxed_str(),
    );
    let (s, e) = raw_error(&c, Method::PUT, path, long_zone).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e.starts_with("zone:"), "{e}");
    assert!(c.service(SVC).await.expect("view").endpoints.is_empty());
    let (s, _) = c
        .raw(
            Method::PUT,
            path,
            r#"{"id":"x","addresses":["10.0.0.1","fd00::1"],"port":80,"zone":"us-east-1a","node":"ip-10-0-12-34.ec2.internal"}"#,
        )
        .await
        .expect("answer");
    assert_eq!(s, StatusCode::OK);
    plane.shutdown().await;
}
