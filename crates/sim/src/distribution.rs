//! The distribution model: the bytes and events that endpoint
//! changes cost under four schemes, from actually encoded objects:
//! one Kubernetes Endpoints object, EndpointSlices of S, EndpointSlices of
//! 1, and meshless deltas (protobuf, only changed endpoints).

use std::fmt;

use meshless_api::v1;
use prost::Message;
use serde::Serialize;
use serde_json::{Value, json};

use crate::SimError;

/// A scenario for [`model`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributionWorkload {
    /// Nodes, each running a proxy (watcher).
    pub nodes: u64,
    /// Endpoints of the service.
    pub endpoints: u64,
    /// Endpoints per EndpointSlice, 1..=1000.
    pub slice_size: u64,
    /// Seed of the generated names and addresses.
    pub seed: u64,
    /// Endpoints per subscriber's subset (`--subset-size`); 0 = no subset
    /// rows.
    pub subset_size: u64,
}

/// One scheme in one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub scenario: &'static str,
    pub scheme: String,
    /// Objects (or deltas) written.
    pub writes: u64,
    /// Bytes of one object or delta as sent.
    pub bytes_per_write: u64,
    /// Events one watcher receives; for subset rows, the mean over
    /// watchers rounded up (`total_events / nodes`), as watchers differ.
    pub events_per_watcher: u64,
    pub total_events: u64,
    pub total_bytes: u64,
    /// The endpoint-scaling talk's figure, where it gives one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub talk_estimate: Option<&'static str>,
}

/// Realistic generated endpoint data.
struct Pod {
    name: String,
    uid: String,
    ip: String,
    node: String,
    zone: &'static str,
}

fn pods(n: u64, seed: u64) -> Vec<Pod> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let alnum = |rng: &mut fastrand::Rng, len: usize| -> String {
        (0..len)
            .map(|_| rng.alphanumeric().to_ascii_lowercase())
            .collect()
    };
    let zones = ["us-east-1a", "us-east-1b", "us-east-1c"];
    let template = alnum(&mut rng, 10);
    (0..n)
        .map(|i| {
            let uid = format!(
                "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                rng.u32(..),
                rng.u16(..),
                rng.u16(..),
                rng.u16(..),
                rng.u64(..) & 0xffff_ffff_ffff
            );
            Pod {
                name: format!("cart-{template}-{}", alnum(&mut rng, 5)),
                uid,
                ip: format!("10.{}.{}.{}", 244 + (i >> 16) % 8, (i >> 8) & 255, i & 255),
                node: format!("ip-10-0-{}-{}.ec2.internal", rng.u8(..), rng.u8(..)),
                zone: zones[(i % 3) as usize],
            }
        })
        .collect()
}

fn target_ref(p: &Pod) -> Value {
    json!({ "kind": "Pod", "namespace": "shop", "name": p.name, "uid": p.uid })
}

/// A watch event carrying the whole Endpoints object (core/v1).
fn endpoints_object(pods: &[Pod]) -> usize {
    let addresses: Vec<Value> = pods
        .iter()
        .map(|p| json!({ "ip": p.ip, "nodeName": p.node, "targetRef": target_ref(p) }))
        .collect();
    let obj = json!({
        "type": "MODIFIED",
        "object": {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {
                "name": "cart", "namespace": "shop", "uid": "6c3e2a1b-8f4d-4e2a-9b1c-2d3e4f5a6b7c",
                "resourceVersion": "918273645", "creationTimestamp": "2026-11-29T15:00:00Z",
                "labels": { "app": "cart" }
            },
            "subsets": [{ "addresses": addresses, "ports": [{ "name": "http", "port": 8080, "protocol": "TCP" }] }]
        }
    });
    obj.to_string().len()
}

/// A watch event carrying one EndpointSlice (discovery.k8s.io/v1).
fn slice_object(pods: &[Pod]) -> usize {
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|p| {
            json!({
                "addresses": [p.ip],
                "conditions": { "ready": true, "serving": true, "terminating": false },
                "nodeName": p.node, "zone": p.zone, "targetRef": target_ref(p)
            })
        })
        .collect();
    let obj = json!({
        "type": "MODIFIED",
        "object": {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "cart-x7k2p", "generateName": "cart-", "namespace": "shop",
                "uid": "1f2e3d4c-5b6a-4798-8a9b-0c1d2e3f4a5b", "resourceVersion": "918273645",
                "generation": 42, "creationTimestamp": "2026-11-29T15:00:00Z",
                "labels": {
                    "kubernetes.io/service-name": "cart",
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"
                },
                "ownerReferences": [{
                    "apiVersion": "v1", "kind": "Service", "name": "cart",
                    "uid": "6c3e2a1b-8f4d-4e2a-9b1c-2d3e4f5a6b7c", "controller": true, "blockOwnerDeletion": true
                }]
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{ "name": "http", "port": 8080, "protocol": "TCP" }]
        }
    });
    obj.to_string().len()
}

fn wire_endpoint(p: &Pod, slice: u64) -> v1::Endpoint {
    v1::Endpoint {
        id: p.name.clone(),
        addresses: vec![p.ip.clone()],
        port: 8080,
        weight: 1,
        zone: p.zone.to_owned(),
        node: p.node.clone(),
        ready: true,
        serving: true,
        terminating: false,
        slice: format!("cart-{slice:05}"),
        packed_addresses: Vec::new(),
        starting: false,
    }
}

/// A meshless delta as framed on the stream to a proxy that reads the
/// compact encoding (every meshless proxy: `Hello.compact`): the
/// `ServerMessage` with the delta as the distributor encodes it
/// (`meshless_api::encode_compact`), plus gRPC's 5-byte message prefix.
fn delta_bytes(upserted: Vec<v1::Endpoint>, removed: Vec<String>, reset: bool) -> usize {
    let delta = v1::Delta {
        version: 918_273_645,
        service: "shop/cart".into(),
        upserted,
        removed,
        reset,
        activation_error: String::new(),
        settings: None,
        subset_index: None,
    };
    let msg = v1::ServerMessage {
        msg: Some(v1::server_message::Msg::Delta(
            meshless_api::encode_compact(&delta),
        )),
    };
    msg.encoded_len() + 5
}

/// Runs the model.
pub fn model(a: &DistributionWorkload) -> Result<Vec<Row>, SimError> {
    if a.nodes == 0 {
        return Err(SimError::new("nodes", "must be at least 1"));
    }
    if a.endpoints == 0 {
        return Err(SimError::new("endpoints", "must be at least 1"));
    }
    if a.slice_size == 0 || a.slice_size > 1000 {
        return Err(SimError::new("slice-size", "must be 1..=1000"));
    }
    let (n, e, s) = (a.nodes, a.endpoints, a.slice_size);
    let all = pods(e, a.seed);
    let slices = e.div_ceil(s);
    let full_object = endpoints_object(&all) as u64;
    let slice_of_s = slice_object(&all[..s.min(e) as usize]) as u64;
    let slice_of_1 = slice_object(&all[..1]) as u64;
    // One change: one endpoint's data (e.g. readiness) changes.
    let one_delta = delta_bytes(vec![wire_endpoint(&all[0], 0)], Vec::new(), false) as u64;
    // Rolling update step: a new pod replaces an old one.
    let replacement = pods(1, a.seed ^ 0x5eed);
    let replace_delta = delta_bytes(
        vec![wire_endpoint(&replacement[0], 0)],
        vec![all[0].name.clone()],
        false,
    ) as u64;
    // Service created: one reset delta with everything.
    let created_delta = delta_bytes(
        all.iter()
            .enumerate()
            .map(|(i, p)| wire_endpoint(p, i as u64 / s))
            .collect(),
        Vec::new(),
        true,
    ) as u64;
    let scheme_names = [
        "one Endpoints object".to_owned(),
        format!("EndpointSlices of {s}"),
        "EndpointSlices of 1".to_owned(),
        "meshless deltas".to_owned(),
    ];
    let row = |scenario, k: usize, writes: u64, size: u64, talk| Row {
        scenario,
        scheme: scheme_names[k].clone(),
        writes,
        bytes_per_write: size,
        events_per_watcher: writes,
        total_events: writes * n,
        total_bytes: writes * size * n,
        talk_estimate: talk,
    };
    let mut rows = vec![
        row("one endpoint changes", 0, 1, full_object, Some("~10 GB")),
        row("one endpoint changes", 1, 1, slice_of_s, Some("~50 MB")),
        row("one endpoint changes", 2, 1, slice_of_1, Some("~5 MB")),
        row("one endpoint changes", 3, 1, one_delta, None),
        row("rolling update", 0, e, full_object, Some("~200 TB")),
        row("rolling update", 1, e, slice_of_s, Some("~1 TB")),
        row("rolling update", 2, e, slice_of_1, Some("~100 GB")),
        row("rolling update", 3, e, replace_delta, None),
        row(
            "service created",
            0,
            1,
            full_object,
            Some("1 write / 5k events"),
        ),
        row(
            "service created",
            1,
            slices,
            slice_of_s,
            Some("200 writes / 1M events"),
        ),
        row(
            "service created",
            2,
            e,
            slice_of_1,
            Some("20k writes / 100M events"),
        ),
        row("service created", 3, 1, created_delta, None),
    ];
    if a.subset_size > 0 {
        subset_rows(a, &all, &mut rows);
    }
    Ok(rows)
}

/// Rows for meshless deltas with subsets of `a.subset_size`, each inserted
/// after its scenario's last row: a node receives a delta only when its
/// subset is touched (see [`crate::subset_cost`]).
fn subset_rows(a: &DistributionWorkload, all: &[Pod], rows: &mut Vec<Row>) {
    let (n, e, s) = (a.nodes, a.endpoints, a.slice_size);
    let k = a.subset_size.min(e) as usize;
    let ids: Vec<String> = all.iter().map(|p| p.name.clone()).collect();
    let new_pods = pods(e, a.seed ^ 0x5eed);
    let new_ids: Vec<String> = new_pods.iter().map(|p| p.name.clone()).collect();
    // The same deltas as the full-stream rows: one endpoint changes, or one
    // member leaves and one joins the subset.
    let one_delta = delta_bytes(vec![wire_endpoint(&all[0], 0)], Vec::new(), false) as u64;
    let replace_delta = delta_bytes(
        vec![wire_endpoint(&new_pods[0], 0)],
        vec![all[0].name.clone()],
        false,
    ) as u64;
    let created_delta = delta_bytes(
        all[..k]
            .iter()
            .enumerate()
            .map(|(i, p)| wire_endpoint(p, i as u64 / s))
            .collect(),
        Vec::new(),
        true,
    ) as u64;
    let scheme = format!("meshless deltas, subsets of {}", a.subset_size);
    let row = |scenario, writes, size, events: u64| Row {
        scenario,
        scheme: scheme.clone(),
        writes,
        bytes_per_write: size,
        events_per_watcher: events.div_ceil(n),
        total_events: events,
        total_bytes: events * size,
        talk_estimate: None,
    };
    let holders = crate::subset_cost::holders(&ids, 0, n, k);
    let rolling = crate::subset_cost::rolling_update_messages(&ids, &new_ids, n, k);
    for r in [
        row("one endpoint changes", 1, one_delta, holders),
        row("rolling update", e, replace_delta, rolling),
        row("service created", 1, created_delta, n),
    ] {
        let at = rows
            .iter()
            .rposition(|x| x.scenario == r.scenario)
            .map_or(rows.len(), |i| i + 1);
        rows.insert(at, r);
    }
}

/// Bytes in a human unit (decimal, as the talk uses).
pub fn human(bytes: u64) -> String {
    let units = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1000.0 && u < units.len() - 1 {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// The model's rows with the scenario they describe, as `simulate
/// distribution` prints them: JSON `{nodes, endpoints, slice_size, rows}`
/// or tables through `Display`.
#[derive(Debug, Clone, Serialize)]
pub struct DistributionReport {
    pub nodes: u64,
    pub endpoints: u64,
    pub slice_size: u64,
    /// `--subset-size`; 0 when subset rows are off.
    pub subset_size: u64,
    pub rows: Vec<Row>,
}

/// Runs the model into a report.
pub fn report(a: &DistributionWorkload) -> Result<DistributionReport, SimError> {
    Ok(DistributionReport {
        nodes: a.nodes,
        endpoints: a.endpoints,
        slice_size: a.slice_size,
        subset_size: a.subset_size,
        rows: model(a)?,
    })
}

impl fmt::Display for DistributionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} endpoints, {} nodes watching, slices of {}; sizes from encoded objects",
            self.endpoints, self.nodes, self.slice_size
        )?;
        let mut scenario = "";
        for r in &self.rows {
            if r.scenario != scenario {
                scenario = r.scenario;
                write!(f, "\n{scenario}")?;
                write!(
                    f,
                    "\n  {:<32} {:>9} {:>12} {:>12} {:>14} {:>12}  talk",
                    "scheme", "writes", "bytes/write", "events/node", "total events", "total bytes"
                )?;
            }
            write!(
                f,
                "\n  {:<32} {:>9} {:>12} {:>12} {:>14} {:>12}  {}",
                r.scheme,
                r.writes,
                human(r.bytes_per_write),
                r.events_per_watcher,
                r.total_events,
                human(r.total_bytes),
                r.talk_estimate.unwrap_or("")
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_columns_land_near_the_talk_and_deltas_are_far_smaller() {
        let rows = model(&DistributionWorkload {
            nodes: 5000,
            endpoints: 20_000,
            slice_size: 100,
            seed: 1,
            subset_size: 0,
        })
        .expect("model");
        let total = |scenario: &str, k: usize| {
            rows.iter()
                .filter(|r| r.scenario == scenario)
                .nth(k)
                .map(|r| r.total_bytes)
                .unwrap_or(0)
        };
        // One change: ~10 GB / ~50 MB / ~5 MB in the talk; within 3x.
        let near = |x: u64, want: f64| (x as f64) > want / 3.0 && (x as f64) < want * 3.0;
        for (scenario, k, want) in [
            ("one endpoint changes", 0, 10e9),
            ("one endpoint changes", 1, 50e6),
            ("one endpoint changes", 2, 5e6),
            ("rolling update", 1, 1e12),
        ] {
            let got = total(scenario, k);
            assert!(near(got, want), "{scenario} [{k}]: {got}");
        }
        assert!(
            total("one endpoint changes", 3) < 1_000_000,
            "deltas: under 1 MB for one change"
        );
        assert!(total("rolling update", 3) * 50 < total("rolling update", 1));
        let created = rows
            .iter()
            .filter(|r| r.scenario == "service created")
            .collect::<Vec<_>>();
        assert_eq!(created[1].writes, 200);
        assert_eq!(created[1].total_events, 1_000_000);
    }

    #[test]
    fn a_subset_of_everything_costs_what_the_full_stream_costs() {
        let rows = model(&DistributionWorkload {
            nodes: 7,
            endpoints: 30,
            slice_size: 10,
            seed: 3,
            subset_size: 30,
        })
        .expect("model");
        for scenario in ["one endpoint changes", "rolling update"] {
            let of = |scheme: &str| {
                rows.iter()
                    .find(|r| r.scenario == scenario && r.scheme == scheme)
                    .map(|r| (r.total_events, r.total_bytes))
                    .unwrap_or_else(|| panic!("{scenario}: no {scheme} row"))
            };
            assert_eq!(
                of("meshless deltas"),
                of("meshless deltas, subsets of 30"),
                "{scenario}"
            );
        }
    }
}
