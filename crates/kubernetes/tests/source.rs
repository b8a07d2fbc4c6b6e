//! The Kubernetes source end to end: the fake API server (real HTTP, the
//! JSON of k8s-openapi types), `meshless control` watching it through a
//! kubeconfig file, and a real proxy subscribed to the control plane,
//! asserting what the proxy routes to after each step of a scenario.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::*;
use http::{Method, StatusCode};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use meshless_kubernetes::objects::{PodState, service};

fn slice_lists(fake: &meshless_kubernetes::fake_api::FakeApiServer) -> usize {
    fake.requests()
        .iter()
        .filter(|r| {
            r.starts_with("GET /apis/discovery.k8s.io/v1/endpointslices")
                && !r.contains("watch=true")
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_watch_bookmark_410_outage_and_deletion_reach_the_proxy() {
    let (a, b, c) = (pod("a").await, pod("b").await, pod("c").await);
    let cluster = Cluster::start("scenario", |fake| {
        fake.apply(&service("shop", "cart", &[("http", 80)]));
        fake.apply(&pod_slice("cart", &a, PodState::Ready));
        fake.apply(&pod_slice("cart", &b, PodState::Ready));
    })
    .await;
    let fake = &cluster.fake;
    let (proxy, addr) = proxy(cluster.plane.grpc_addr()).await;
    let client = client();

    // 1. Initial list: both ready pods.
    wait_holds(&proxy, &[&a, &b], "the initial list").await;
    assert_eq!(answering(&client, addr, 20).await.unwrap(), ["a", "b"]);

    // 2. Watch: a new pod is not routed while starting, then is once ready.
    fake.apply(&pod_slice("cart", &c, PodState::Starting));
    eventually("the starting pod reaches the registry", || async {
        let view = cluster.plane.state.lock().view("shop/cart");
        view.is_some_and(|v| v.endpoints.len() == 3)
    })
    .await;
    assert_eq!(
        cluster_addresses(&proxy).await.len(),
        2,
        "not ready: not routed"
    );
    fake.apply(&pod_slice("cart", &c, PodState::Ready));
    wait_holds(&proxy, &[&a, &b, &c], "the pod once ready").await;

    // 3. A bookmark moves the watch on without a relist.
    let lists = slice_lists(fake);
    fake.bookmark();
    fake.apply(&pod_slice("cart", &c, PodState::Terminating));
    wait_holds(
        &proxy,
        &[&a, &b],
        "a terminating pod is not routed while others are ready",
    )
    .await;
    assert_eq!(slice_lists(fake), lists, "no relist after a bookmark");

    // 4. The API server goes down: the proxy keeps routing (static
    // stability). While it is down, a slice is deleted and the history
    // compacted, so the watcher's resume gets 410 Gone and must relist to
    // learn of the deletion.
    fake.set_down(true);
    eventually("an error is counted", || async {
        cluster.metric("meshless_control_kubernetes_errors_total") >= 1.0
    })
    .await;
    assert_eq!(
        answering(&client, addr, 20).await.unwrap(),
        ["a", "b"],
        "static stability"
    );
    fake.delete::<EndpointSlice>("shop", "cart-c");
    fake.delete::<EndpointSlice>("shop", "cart-b");
    fake.compact();
    let relists = cluster.metric("meshless_control_kubernetes_relists_total");
    fake.set_down(false);
    wait_holds(
        &proxy,
        &[&a],
        "the relist after 410 drops the deleted slices",
    )
    .await;
    assert!(cluster.metric("meshless_control_kubernetes_relists_total") > relists);
    assert!(
        fake.requests().iter().any(|r| r.contains("watch=true")),
        "watched, not polled"
    );

    // 5. The watch stream ends (server timeout): the watcher resumes.
    fake.end_watches();
    fake.apply(&pod_slice("cart", &b, PodState::Ready));
    wait_holds(&proxy, &[&a, &b], "a change after the stream ended").await;

    // 6. The registration API refuses writes to a Kubernetes service.
    let api = cluster.plane.api_addr();
    let (status, body) = send(
        &client,
        Method::PUT,
        &format!("http://{api}/v1/services/shop/cart/endpoints/x"),
        r#"{"id":"x","addresses":["127.0.0.1"],"port":1}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body.contains("Kubernetes Service shop/cart"), "{body}");

    // 7. The Service is deleted: the service leaves the registry.
    fake.delete::<Service>("shop", "cart");
    eventually("the service leaves the registry", || async {
        cluster.plane.state.lock().view("shop/cart").is_none()
    })
    .await;
    let page = cluster.plane.state.metrics.encode();
    assert!(
        page.contains("meshless_control_kubernetes_events_total"),
        "{page}"
    );
    assert!(cluster.metric("meshless_control_kubernetes_last_sync_timestamp_seconds") > 0.0);
}

/// A rolling update (surge one, then retire one, as a Deployment with
/// `maxSurge: 1, maxUnavailable: 0` does) while clients send requests
/// without pause: no request fails. A retired pod is marked terminating,
/// then its slice is deleted, then it is stopped (closing every
/// connection, like a crash): a proxy that still sent to it would fail
/// requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_under_traffic_fails_no_request() {
    let mut old = vec![pod("v1-a").await, pod("v1-b").await];
    let cluster = Cluster::start("rolling", |fake| {
        fake.apply(&service("shop", "cart", &[("http", 80)]));
        for p in &old {
            fake.apply(&pod_slice("cart", p, PodState::Ready));
        }
    })
    .await;
    let fake = &cluster.fake;
    let (proxy, addr) = proxy(cluster.plane.grpc_addr()).await;
    wait_holds(&proxy, &[&old[0], &old[1]], "the initial pods").await;

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut clients = Vec::new();
    for _ in 0..2 {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        clients.push(tokio::spawn(async move {
            let client = client();
            while !stop.load(Ordering::Relaxed) {
                match routed(&client, addr).await {
                    Some(_) => ok.fetch_add(1, Ordering::Relaxed),
                    None => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }

    let mut new = Vec::new();
    for name in ["v2-a", "v2-b"] {
        let surge = pod(name).await;
        fake.apply(&pod_slice("cart", &surge, PodState::Starting));
        fake.apply(&pod_slice("cart", &surge, PodState::Ready));
        new.push(surge);
        let live: Vec<&meshless_backend::Backend> = old.iter().chain(&new).collect();
        wait_holds(&proxy, &live, "the surge pod is routed").await;
        let retired = old.remove(0);
        fake.apply(&pod_slice("cart", &retired, PodState::Terminating));
        let live: Vec<&meshless_backend::Backend> = old.iter().chain(&new).collect();
        wait_holds(&proxy, &live, "the retired pod is no longer routed").await;
        fake.delete::<EndpointSlice>("shop", &format!("cart-{}", retired.name()));
        eventually("the retired pod leaves the registry", || async {
            let view = cluster.plane.state.lock().view("shop/cart").unwrap();
            view.endpoints.iter().all(|e| e.id != retired.name())
        })
        .await;
        retired.stop().await;
    }
    let before = ok.load(Ordering::Relaxed);
    eventually("requests flow after the rollout", || async {
        ok.load(Ordering::Relaxed) > before + 20
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "{} ok",
        ok.load(Ordering::Relaxed)
    );
    assert_eq!(
        answering(&client(), addr, 20).await.unwrap(),
        ["v2-a", "v2-b"]
    );
}
