#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointPort};
use proptest::prelude::*;

use super::*;
use crate::objects::{PodState, pod_endpoint, service, slice};

fn ids(d: &Desired) -> Vec<&str> {
    d.endpoints.iter().map(|e| e.id.as_str()).collect()
}

fn ep(pod: &str, ip: &str) -> SliceEndpoint {
    pod_endpoint(pod, ip, PodState::Ready, "n1", "z1")
}

#[test]
fn a_service_without_slices_has_no_endpoints_and_slices_without_a_service_are_not_served() {
    let mut c = SliceCache::default();
    c.apply_slice(slice(
        "ns",
        "web-a",
        "web",
        "IPv4",
        ("http", 8080),
        vec![ep("p1", "10.0.0.1")],
    ));
    assert_eq!(c.desired("ns/web"), None, "no Service yet");
    c.apply_service(service("ns", "web", &[("http", 80)]));
    let d = c.desired("ns/web").unwrap();
    assert_eq!(ids(&d), ["p1"]);
    assert_eq!(d.endpoints[0].port, 8080, "the slice's (target) port");
    assert_eq!(d.spec.ports[0].port, 80);
    assert_eq!(d.endpoints[0].node.as_deref(), Some("n1"));
    assert_eq!(d.endpoints[0].zone.as_deref(), Some("z1"));
}

#[test]
fn conditions_follow_the_api_defaults_and_stay_consistent() {
    let mut e = ep("p", "10.0.0.1");
    e.conditions = None;
    assert_eq!(conditions(&e), Conditions::READY, "all absent: ready");
    e.conditions = Some(EndpointConditions {
        ready: Some(true),
        serving: None,
        terminating: Some(true),
    });
    let c = conditions(&e);
    assert!(!c.ready && c.serving && c.terminating, "{c:?}");
    e.conditions = Some(EndpointConditions {
        ready: Some(false),
        serving: None,
        terminating: None,
    });
    assert_eq!(
        conditions(&e),
        Conditions {
            ready: false,
            serving: false,
            terminating: false
        }
    );
}

#[test]
fn ports_are_matched_by_name_and_the_annotation_chooses_one() {
    let mut c = SliceCache::default();
    let mut svc = service("ns", "web", &[("http", 80), ("admin", 9000)]);
    c.apply_service(svc.clone());
    let mut s = slice(
        "ns",
        "web-a",
        "web",
        "IPv4",
        ("admin", 9901),
        vec![ep("p1", "10.0.0.1")],
    );
    s.ports.as_mut().unwrap().push(EndpointPort {
        name: Some("http".into()),
        port: Some(8080),
        protocol: Some("TCP".into()),
        app_protocol: None,
    });
    c.apply_slice(s);
    assert_eq!(c.desired("ns/web").unwrap().endpoints[0].port, 8080);
    svc.metadata.annotations = Some(BTreeMap::from([(PORT_ANNOTATION.into(), "admin".into())]));
    c.apply_service(svc.clone());
    assert_eq!(c.desired("ns/web").unwrap().endpoints[0].port, 9901);
    svc.metadata.annotations = Some(BTreeMap::from([(PORT_ANNOTATION.into(), "9000".into())]));
    c.apply_service(svc);
    assert_eq!(
        c.desired("ns/web").unwrap().endpoints[0].port,
        9901,
        "by number"
    );
}

#[test]
fn fqdn_slices_and_unparsable_addresses_are_skipped_and_counted() {
    let mut c = SliceCache::default();
    c.apply_service(service("ns", "web", &[("http", 80)]));
    c.apply_slice(slice(
        "ns",
        "web-f",
        "web",
        "FQDN",
        ("http", 80),
        vec![ep("p1", "db.example")],
    ));
    c.apply_slice(slice(
        "ns",
        "web-a",
        "web",
        "IPv4",
        ("http", 80),
        vec![ep("p2", "not-an-ip"), ep("p3", "10.0.0.3")],
    ));
    let d = c.desired("ns/web").unwrap();
    assert_eq!(ids(&d), ["p3"]);
    assert_eq!(d.skipped, 2);
}

#[test]
fn dual_stack_slices_name_one_endpoint_with_both_addresses() {
    let mut c = SliceCache::default();
    c.apply_service(service("ns", "web", &[("http", 80)]));
    c.apply_slice(slice(
        "ns",
        "web-4",
        "web",
        "IPv4",
        ("http", 80),
        vec![ep("p1", "10.0.0.1")],
    ));
    c.apply_slice(slice(
        "ns",
        "web-6",
        "web",
        "IPv6",
        ("http", 80),
        vec![ep("p1", "fd00::1")],
    ));
    let d = c.desired("ns/web").unwrap();
    assert_eq!(ids(&d), ["p1"]);
    assert_eq!(d.endpoints[0].addresses.len(), 2);
}

#[test]
fn a_relabelled_slice_leaves_its_old_service() {
    let mut c = SliceCache::default();
    c.apply_service(service("ns", "a", &[("http", 80)]));
    c.apply_service(service("ns", "b", &[("http", 80)]));
    c.apply_slice(slice(
        "ns",
        "s1",
        "a",
        "IPv4",
        ("http", 80),
        vec![ep("p1", "10.0.0.1")],
    ));
    let changed = c.apply_slice(slice(
        "ns",
        "s1",
        "b",
        "IPv4",
        ("http", 80),
        vec![ep("p1", "10.0.0.1")],
    ));
    assert_eq!(changed, ["ns/a", "ns/b"]);
    assert!(c.desired("ns/a").unwrap().endpoints.is_empty());
    assert_eq!(ids(&c.desired("ns/b").unwrap()), ["p1"]);
}

#[test]
fn a_relist_in_one_namespace_leaves_the_others_alone() {
    let mut c = SliceCache::default();
    for ns in ["a", "b"] {
        c.apply_service(service(ns, "web", &[("http", 80)]));
        c.apply_slice(slice(
            ns,
            "web-1",
            "web",
            "IPv4",
            ("http", 80),
            vec![ep("p1", "10.0.0.1")],
        ));
    }
    let touched = c.replace_slices(Some("a"), Vec::new());
    assert_eq!(touched, ["a/web"]);
    assert!(c.desired("a/web").unwrap().endpoints.is_empty());
    assert_eq!(ids(&c.desired("b/web").unwrap()), ["p1"]);
    let touched = c.replace_services(Some("b"), Vec::new());
    assert_eq!(touched, ["b/web"]);
    assert_eq!(c.desired("b/web"), None);
    assert!(c.desired("a/web").is_some());
}

/// A slice as a test case: name suffix and its pods (pod index, ready).
type SliceCase = (u8, Vec<(u8, bool)>);

fn build(case: &SliceCase) -> EndpointSlice {
    let eps = case
        .1
        .iter()
        .map(|(pod, ready)| {
            let state = if *ready {
                PodState::Ready
            } else {
                PodState::Starting
            };
            pod_endpoint(
                &format!("p{pod}"),
                &format!("10.0.0.{pod}"),
                state,
                "n",
                "z",
            )
        })
        .collect();
    slice(
        "ns",
        &format!("web-{}", case.0),
        "web",
        "IPv4",
        ("", 8080),
        eps,
    )
}

fn cases() -> impl Strategy<Value = Vec<SliceCase>> {
    prop::collection::vec(
        (
            0u8..6,
            prop::collection::vec((0u8..12, any::<bool>()), 0..6),
        ),
        0..6,
    )
}

proptest! {
    /// kube-proxy's merge: a service's endpoints are the union over its
    /// current slices (the last version of each slice name), each id once,
    /// whatever order the slices arrived in.
    #[test]
    fn endpoints_are_the_union_of_the_latest_slices_each_once(cases in cases(), seed in any::<u64>()) {
        let mut c = SliceCache::default();
        c.apply_service(service("ns", "web", &[("", 80)]));
        let mut order: Vec<&SliceCase> = cases.iter().collect();
        let mut latest: BTreeMap<u8, &SliceCase> = BTreeMap::new();
        // Shuffle deterministically: the merge must not depend on arrival order
        // beyond "the last version of each slice name".
        let n = order.len().max(1);
        order.rotate_left((seed as usize) % n);
        for case in order {
            c.apply_slice(build(case));
            latest.insert(case.0, case);
        }
        let want: BTreeSet<String> = latest
            .values()
            .flat_map(|s| s.1.iter().map(|(p, _)| format!("p{p}")))
            .collect();
        let d = c.desired("ns/web").unwrap();
        let got: Vec<String> = d.endpoints.iter().map(|e| e.id.clone()).collect();
        let got_set: BTreeSet<String> = got.iter().cloned().collect();
        prop_assert_eq!(got.len(), got_set.len(), "an id twice");
        prop_assert_eq!(got_set, want);
    }

    /// The EndpointSlice controller moves an endpoint by adding it to the
    /// new slice before removing it from the old: it is never absent.
    #[test]
    fn an_endpoint_moving_between_slices_is_never_absent(pods in prop::collection::vec(0u8..12, 1..8), moved in 0usize..8) {
        let moved = pods[moved % pods.len()];
        let mut c = SliceCache::default();
        c.apply_service(service("ns", "web", &[("", 80)]));
        let old: Vec<(u8, bool)> = pods.iter().map(|p| (*p, true)).collect();
        c.apply_slice(build(&(0, old.clone())));
        let present = |c: &SliceCache| c.desired("ns/web").unwrap().endpoints.iter().any(|e| e.id == format!("p{moved}"));
        prop_assert!(present(&c));
        c.apply_slice(build(&(1, vec![(moved, true)])));
        prop_assert!(present(&c));
        let rest: Vec<(u8, bool)> = old.into_iter().filter(|(p, _)| *p != moved).collect();
        c.apply_slice(build(&(0, rest)));
        prop_assert!(present(&c));
    }

    /// A full relist leaves the same state as applying the listed objects
    /// to an empty cache: nothing from before survives unless listed.
    #[test]
    fn a_relist_equals_a_fresh_cache(before in cases(), after in cases()) {
        let mut c = SliceCache::default();
        c.apply_service(service("ns", "web", &[("", 80)]));
        for s in &before {
            c.apply_slice(build(s));
        }
        c.replace_slices(None, after.iter().map(build).collect());
        let mut fresh = SliceCache::default();
        fresh.apply_service(service("ns", "web", &[("", 80)]));
        for s in &after {
            fresh.apply_slice(build(s));
        }
        prop_assert_eq!(c.desired("ns/web"), fresh.desired("ns/web"));
    }
}
