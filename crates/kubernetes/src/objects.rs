//! Builders of the Kubernetes objects meshless reads, with the fields the
//! API server fills in: used by the fake API server's scenarios, the demo
//! and tests. Real k8s-openapi types, so their JSON is the API's.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ObjectReference, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::slices_cache::SERVICE_NAME_LABEL;

fn meta(namespace: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: Some(namespace.to_owned()),
        name: Some(name.to_owned()),
        ..ObjectMeta::default()
    }
}

/// A ClusterIP Service with one TCP port per `(name, port)`.
pub fn service(namespace: &str, name: &str, ports: &[(&str, i32)]) -> Service {
    Service {
        metadata: meta(namespace, name),
        spec: Some(ServiceSpec {
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| ServicePort {
                        name: (!n.is_empty()).then(|| (*n).to_owned()),
                        port: *p,
                        protocol: Some("TCP".into()),
                        ..ServicePort::default()
                    })
                    .collect(),
            ),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// A slice of `service` with one TCP port (`port_name`, `port`) and these endpoints.
pub fn slice(
    namespace: &str,
    name: &str,
    service: &str,
    address_type: &str,
    port: (&str, i32),
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    let mut m = meta(namespace, name);
    m.labels = Some(BTreeMap::from([
        (SERVICE_NAME_LABEL.to_owned(), service.to_owned()),
        (
            "endpointslice.kubernetes.io/managed-by".to_owned(),
            "endpointslice-controller.k8s.io".to_owned(),
        ),
    ]));
    EndpointSlice {
        metadata: m,
        address_type: address_type.to_owned(),
        endpoints,
        ports: Some(vec![EndpointPort {
            name: Some(port.0.to_owned()),
            port: Some(port.1),
            protocol: Some("TCP".into()),
            app_protocol: None,
        }]),
    }
}

/// The state of a pod's endpoint, as the EndpointSlice controller writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodState {
    /// Running, not yet passing its readiness probe.
    Starting,
    /// Ready.
    Ready,
    /// Being deleted, still answering.
    Terminating,
}

/// The endpoint of pod `pod` at `ip` on `node` in `zone`.
pub fn pod_endpoint(pod: &str, ip: &str, state: PodState, node: &str, zone: &str) -> Endpoint {
    let (ready, serving, terminating) = match state {
        PodState::Starting => (false, false, false),
        PodState::Ready => (true, true, false),
        PodState::Terminating => (false, true, true),
    };
    Endpoint {
        addresses: vec![ip.to_owned()],
        conditions: Some(EndpointConditions {
            ready: Some(ready),
            serving: Some(serving),
            terminating: Some(terminating),
        }),
        node_name: Some(node.to_owned()),
        zone: Some(zone.to_owned()),
        target_ref: Some(ObjectReference {
            kind: Some("Pod".into()),
            name: Some(pod.to_owned()),
            ..ObjectReference::default()
        }),
        ..Endpoint::default()
    }
}

/// A Node labelled with its zone (`topology.kubernetes.io/zone`).
pub fn node(name: &str, zone: &str) -> k8s_openapi::api::core::v1::Node {
    k8s_openapi::api::core::v1::Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(ZONE_LABEL.to_owned(), zone.to_owned())])),
            ..ObjectMeta::default()
        },
        ..k8s_openapi::api::core::v1::Node::default()
    }
}

/// The well-known label of a Node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
