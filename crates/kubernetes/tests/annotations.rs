//! Service annotations set balancing at the proxies: `meshless.io/policy`
//! and `meshless.io/hash-key` on a Service reach a proxy's `service:`
//! cluster with the endpoints; a bad value keeps the previous settings and
//! is counted; a proxy whose file has a `balancer:` block keeps its own.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::Service;
use meshless_kubernetes::objects::{PodState, service};
use meshless_proxy::{Proxy, ProxyConfig};

fn annotated(pairs: &[(&str, &str)]) -> Service {
    let mut s = service("shop", "cart", &[("http", 80)]);
    s.metadata.annotations = Some(
        pairs
            .iter()
            .map(|(k, v)| (format!("meshless.io/{k}"), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
    );
    s
}

/// A proxy for `shop/cart` with `extra` lines in its cluster.
async fn proxy_with(grpc: SocketAddr, extra: &str) -> (Proxy, SocketAddr) {
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{grpc}\" }}\n\
         listeners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: cart }}]\n\
         clusters:\n  - name: cart\n    service: shop/cart\n{extra}"
    );
    let p = Proxy::start(ProxyConfig::parse(&yaml, "proxy.yaml").unwrap())
        .await
        .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    (p, addr)
}

/// The backend answering a GET with `x-user: user`.
async fn backend_for(client: &TestClient, addr: SocketAddr, user: &str) -> String {
    let req = Request::get(format!("http://{addr}/"))
        .header("x-user", user)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let name = resp.headers()["x-backend"].to_str().unwrap().to_owned();
    let _ = resp.into_body().collect().await;
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotations_set_the_policy_and_a_bad_value_keeps_the_last_good_one() {
    let (a, b, c) = (pod("a").await, pod("b").await, pod("c").await);
    let cluster = Cluster::start("annotations", |fake| {
        fake.apply(&annotated(&[
            ("policy", "ring-hash"),
            ("hash-key", "header:X-User"),
        ]));
        for p in [&a, &b, &c] {
            fake.apply(&pod_slice("cart", p, PodState::Ready));
        }
    })
    .await;
    let fake = &cluster.fake;
    let grpc = cluster.plane.grpc_addr();
    let (proxy, addr) = proxy_with(grpc, "").await;
    let (own, _) = proxy_with(grpc, "    balancer: { policy: least_request }\n").await;
    wait_holds(&proxy, &[&a, &b, &c], "the three pods").await;
    eventually("the annotation's policy reaches the proxy", || async {
        let c = cart_cluster(&proxy).await;
        c["policy"] == "ring_hash" && c["hash_key"]["header"] == "x-user"
    })
    .await;

    // Affinity by header: each user stays on one pod, users spread.
    let client = client();
    let mut pods = std::collections::BTreeSet::new();
    for u in 0..24 {
        let user = format!("user-{u}");
        let first = backend_for(&client, addr, &user).await;
        for _ in 0..3 {
            assert_eq!(backend_for(&client, addr, &user).await, first, "{user}");
        }
        pods.insert(first);
    }
    assert!(pods.len() >= 2, "24 users on one pod: {pods:?}");

    // The proxy whose file has a balancer block keeps its own policy.
    wait_holds(&own, &[&a, &b, &c], "the other proxy's pods").await;
    let own_cart = cart_cluster(&own).await;
    assert_eq!(own_cart["policy"], "least_request", "{own_cart}");
    assert!(own_cart["hash_key"].is_null(), "{own_cart}");

    // A bad value: counted once, the service keeps ring_hash, and later
    // endpoint changes still flow.
    fake.apply(&annotated(&[
        ("policy", "fastest"),
        ("hash-key", "header:x-user"),
    ]));
    let series =
        "meshless_control_kubernetes_annotation_errors_total{annotation=\"meshless.io/policy\"}";
    eventually("the bad annotation is counted", || async {
        cluster.metric(series) == 1.0
    })
    .await;
    fake.delete::<k8s_openapi::api::discovery::v1::EndpointSlice>("shop", "cart-c");
    wait_holds(&proxy, &[&a, &b], "a change after the bad annotation").await;
    assert_eq!(cart_cluster(&proxy).await["policy"], "ring_hash");
    let kept = cluster
        .plane
        .state
        .lock()
        .view("shop/cart")
        .unwrap()
        .settings;
    assert_eq!(kept.policy.as_deref(), Some("ring_hash"));
    assert_eq!(cluster.metric(series), 1.0, "counted once, not per event");

    // Fixed, and the hash key dropped: round robin over both pods.
    fake.apply(&annotated(&[("policy", "round_robin")]));
    eventually("the new policy reaches the proxy", || async {
        let c = cart_cluster(&proxy).await;
        c["policy"] == "round_robin" && c["hash_key"].is_null()
    })
    .await;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..6 {
        seen.insert(backend_for(&client, addr, "user-1").await);
    }
    assert_eq!(seen.len(), 2, "round robin ignores the header: {seen:?}");

    // No annotation at all: the proxy's defaults again.
    fake.apply(&service("shop", "cart", &[("http", 80)]));
    eventually("the settings are cleared", || async {
        cart_cluster(&proxy).await["policy"] == "round_robin"
            && cluster
                .plane
                .state
                .lock()
                .view("shop/cart")
                .is_some_and(|v| v.settings.is_empty())
    })
    .await;
}

/// K2: `meshless.io/port` naming no port of the Service (a typo) is a bad
/// annotation like the others: the service keeps its endpoints, the error
/// is counted under the annotation's name; fixing it serves the port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_annotation_naming_no_port_keeps_the_endpoints() {
    let a = pod("a").await;
    let cluster = Cluster::start("port-typo", |fake| {
        fake.apply(&annotated(&[]));
        fake.apply(&pod_slice("cart", &a, PodState::Ready));
    })
    .await;
    let fake = &cluster.fake;
    let (proxy, addr) = proxy_with(cluster.plane.grpc_addr(), "").await;
    wait_holds(&proxy, &[&a], "the pod").await;
    let series =
        "meshless_control_kubernetes_annotation_errors_total{annotation=\"meshless.io/port\"}";
    fake.apply(&annotated(&[("port", "htpp")]));
    eventually("the bad port annotation is counted", || async {
        cluster.metric(series) == 1.0
    })
    .await;
    let view = cluster.plane.state.lock().view("shop/cart").unwrap();
    assert_eq!(view.endpoints.len(), 1, "kept: {view:?}");
    assert_eq!(answering(&client(), addr, 5).await.unwrap(), ["a"]);
    // The right name: valid again, the same endpoint served.
    fake.apply(&annotated(&[("port", "http")]));
    fake.apply(&annotated(&[("port", "80"), ("policy", "random")]));
    eventually("the policy of the valid annotations applies", || async {
        cart_cluster(&proxy).await["policy"] == "random"
    })
    .await;
    assert_eq!(cluster.metric(series), 1.0, "counted once");
    assert_eq!(answering(&client(), addr, 5).await.unwrap(), ["a"]);
}
