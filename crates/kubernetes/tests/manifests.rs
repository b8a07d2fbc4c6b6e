//! `deploy/`: `kubectl kustomize` renders the base and the example overlay;
//! every rendered document parses as its k8s-openapi type with no field
//! the type does not know (a typo such as `terminationGracePeriod` fails),
//! and the configs in the ConfigMaps are valid meshless configs.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use meshless_control::config::ControlConfig;
use meshless_proxy::ProxyConfig;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The rendered documents, or `None` when kubectl is not installed.
fn render(dir: &str) -> Option<Vec<Value>> {
    let out = match Command::new("kubectl")
        .arg("kustomize")
        .arg(repo().join(dir))
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!(
                "SKIPPED: kubectl is not installed (.ci/run installs it); {dir} not rendered"
            );
            return None;
        }
        Err(e) => panic!("kubectl: {e}"),
    };
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    Some(
        text.split("\n---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_saphyr::from_str::<Value>(d).unwrap())
            .collect(),
    )
}

/// Paths present in `original` but not in `typed` (the type dropped them: unknown).
fn unknown_fields(original: &Value, typed: &Value, at: &str, out: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(o), Value::Object(t)) => {
            for (k, v) in o {
                match t.get(k) {
                    Some(tv) => unknown_fields(v, tv, &format!("{at}.{k}"), out),
                    None if !v.is_null() => out.push(format!("{at}.{k}")),
                    None => {}
                }
            }
        }
        (Value::Array(o), Value::Array(t)) => {
            for (i, (v, tv)) in o.iter().zip(t).enumerate() {
                unknown_fields(v, tv, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn check_typed<K: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) -> K {
    let typed: K = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{} {}: {e}", doc["kind"], doc["metadata"]["name"]));
    let mut unknown = Vec::new();
    unknown_fields(
        doc,
        &serde_json::to_value(&typed).unwrap(),
        "",
        &mut unknown,
    );
    assert!(
        unknown.is_empty(),
        "{} {}: unknown fields {unknown:?}",
        doc["kind"],
        doc["metadata"]["name"]
    );
    typed
}

fn check_all(docs: &[Value]) -> Vec<String> {
    let mut kinds = Vec::new();
    for doc in docs {
        let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "Namespace" => drop(check_typed::<Namespace>(doc)),
            "ServiceAccount" => drop(check_typed::<ServiceAccount>(doc)),
            "ClusterRole" => drop(check_typed::<ClusterRole>(doc)),
            "ClusterRoleBinding" => drop(check_typed::<ClusterRoleBinding>(doc)),
            "Role" => drop(check_typed::<Role>(doc)),
            "RoleBinding" => drop(check_typed::<RoleBinding>(doc)),
            "Service" => drop(check_typed::<Service>(doc)),
            "PodDisruptionBudget" => drop(check_typed::<PodDisruptionBudget>(doc)),
            "ConfigMap" => check_config_map(&check_typed::<ConfigMap>(doc)),
            "Deployment" => check_control(&check_typed::<Deployment>(doc)),
            "DaemonSet" => check_proxy(&check_typed::<DaemonSet>(doc)),
            other => panic!("no check for kind {other}"),
        }
        kinds.push(kind);
    }
    kinds.sort();
    kinds
}

fn check_config_map(cm: &ConfigMap) {
    let data = cm.data.clone().unwrap_or_default();
    if let Some(text) = data.get("control.yaml") {
        let c = ControlConfig::parse(text, "control.yaml").unwrap();
        assert!(
            c.kubernetes.is_some(),
            "the in-cluster control plane watches the cluster"
        );
    }
    if let Some(text) = data.get("proxy.yaml") {
        ProxyConfig::parse(text, "proxy.yaml").unwrap();
    }
}

fn check_control(d: &Deployment) {
    let spec = d.spec.as_ref().unwrap();
    assert!(
        spec.replicas.unwrap_or(1) >= 2,
        "two replicas at least: one leads, both serve"
    );
    let pod = spec.template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    let probe = c
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(probe.path.as_deref(), Some("/ready"));
    assert!(
        c.resources.as_ref().unwrap().requests.is_some(),
        "resource requests"
    );
    let env: Vec<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
    assert!(
        env.contains(&"POD_NAME") && env.contains(&"POD_NAMESPACE"),
        "{env:?}"
    );
}

fn check_proxy(ds: &DaemonSet) {
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let grace = pod.termination_grace_period_seconds.unwrap();
    assert!(
        grace > 30,
        "grace {grace}s must exceed the proxy's 30s drain"
    );
    let env = pod.containers[0].env.clone().unwrap_or_default();
    let node = env.iter().find(|e| e.name == "MESHLESS_NODE_NAME").unwrap();
    let field = node
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
}

#[test]
fn the_base_and_the_overlay_render_to_valid_objects_and_configs() {
    let Some(base) = render("deploy/base") else {
        return;
    };
    let kinds = check_all(&base);
    for want in [
        "ClusterRole",
        "ConfigMap",
        "DaemonSet",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "ServiceAccount",
    ] {
        assert!(
            kinds.iter().any(|k| k == want),
            "{want} missing from {kinds:?}"
        );
    }
    let Some(overlay) = render("deploy/overlays/example") else {
        return;
    };
    check_all(&overlay);
    let ds = overlay.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    assert_eq!(ds["spec"]["template"]["spec"]["hostNetwork"], true);
    let image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap();
    assert!(image.ends_with("meshless:0.1.0"), "{image}");
}

#[test]
fn unknown_fields_are_found() {
    let doc: Value = serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "x", "lables": {"a": "b"}}});
    let typed: ServiceAccount = serde_json::from_value(doc.clone()).unwrap();
    let mut unknown = Vec::new();
    unknown_fields(
        &doc,
        &serde_json::to_value(&typed).unwrap(),
        "",
        &mut unknown,
    );
    assert_eq!(unknown, [".metadata.lables"]);
}
