//! The fake API server's objects: one global `resourceVersion` (as etcd's
//! revision), the event log watches replay from, and compaction (a watch
//! from a version older than the log answers `410 Gone`).

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Where an object lives: resource (plural), namespace, name.
pub type ObjectKey = (String, String, String);

/// One entry of the event log.
#[derive(Debug, Clone)]
pub struct LogEntry {
    /// Position in the log: grows by one per entry, never reused.
    pub seq: u64,
    pub version: u64,
    /// The resource (plural) it concerns; `None` for a bookmark (every resource).
    pub resource: Option<String>,
    pub namespace: String,
    /// `ADDED`, `MODIFIED`, `DELETED` or `BOOKMARK`.
    pub kind: &'static str,
    pub object: Value,
}

/// Objects, versions and the event log.
#[derive(Debug, Default)]
pub struct Store {
    pub version: u64,
    pub objects: BTreeMap<ObjectKey, Value>,
    pub log: Vec<LogEntry>,
    /// The last `seq` given out.
    pub seq: u64,
    /// Watches from a version below this answer 410 Gone.
    pub oldest: u64,
    /// `(apiVersion, kind)` of each resource seen, for bookmarks and lists.
    pub kinds: BTreeMap<String, (String, String)>,
}

fn text(v: &Value, pointer: &str) -> String {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

impl Store {
    /// Adds or replaces `object` (JSON of a k8s-openapi type) under
    /// `resource`; stamps a fresh resourceVersion and logs the event.
    pub fn apply(&mut self, resource: &str, mut object: Value) -> Value {
        self.version += 1;
        let namespace = text(&object, "/metadata/namespace");
        let name = text(&object, "/metadata/name");
        object["metadata"]["resourceVersion"] = json!(self.version.to_string());
        let key = (resource.to_owned(), namespace.clone(), name);
        let existed = self.objects.contains_key(&key);
        if !existed && object.pointer("/metadata/uid").is_none() {
            object["metadata"]["uid"] = json!(format!("uid-{}", self.version));
        }
        self.kinds.insert(
            resource.to_owned(),
            (text(&object, "/apiVersion"), text(&object, "/kind")),
        );
        self.objects.insert(key, object.clone());
        self.push(LogEntry {
            seq: 0,
            version: self.version,
            resource: Some(resource.to_owned()),
            namespace,
            kind: if existed { "MODIFIED" } else { "ADDED" },
            object: object.clone(),
        });
        object
    }

    /// Removes an object, then (as the garbage collector's background
    /// cascade does) every object of its namespace whose
    /// `ownerReferences` name its uid; returns it (with its deletion's
    /// version).
    pub fn delete(&mut self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let object = self.delete_one(resource, namespace, name)?;
        let uid = object.pointer("/metadata/uid").cloned();
        let dependents: Vec<ObjectKey> = self
            .objects
            .iter()
            .filter(|((_, ns, _), o)| ns == namespace && uid.is_some() && owned_by(o, &uid))
            .map(|(k, _)| k.clone())
            .collect();
        for (r, ns, n) in dependents {
            self.delete(&r, &ns, &n);
        }
        Some(object)
    }

    fn delete_one(&mut self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        let mut object = self.objects.remove(&key)?;
        self.version += 1;
        object["metadata"]["resourceVersion"] = json!(self.version.to_string());
        self.push(LogEntry {
            seq: 0,
            version: self.version,
            resource: Some(resource.to_owned()),
            namespace: namespace.to_owned(),
            kind: "DELETED",
            object: object.clone(),
        });
        Some(object)
    }

    /// Logs a bookmark at the current version (objects unchanged).
    pub fn bookmark(&mut self) {
        self.push(LogEntry {
            seq: 0,
            version: self.version,
            resource: None,
            namespace: String::new(),
            kind: "BOOKMARK",
            object: Value::Null,
        });
    }

    fn push(&mut self, mut entry: LogEntry) {
        self.seq += 1;
        entry.seq = self.seq;
        self.log.push(entry);
    }

    /// Where a watch from `version` starts in the log: the `seq` of the
    /// last entry it has already seen. `None` when the log no longer
    /// reaches back to `version` (410 Gone).
    pub fn start_seq(&self, version: u64) -> Option<u64> {
        if version < self.oldest {
            return None;
        }
        let seen = self.log.iter().take_while(|e| e.version <= version).last();
        Some(seen.map_or(self.seq - self.log.len() as u64, |e| e.seq))
    }

    /// Forgets the log: watches resuming from any earlier version get 410.
    pub fn compact(&mut self) {
        self.version += 1;
        self.oldest = self.version;
        self.log.clear();
    }

    /// The objects of `resource` in `namespace` (every namespace when
    /// `None`) matching `selector`, sorted by namespace and name.
    pub fn list(&self, resource: &str, namespace: Option<&str>, selector: &Selector) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((r, ns, _), o)| {
                r == resource && namespace.is_none_or(|n| n == ns) && selector.matches(o)
            })
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// The watch events logged after `seq` for one watch, and the last
    /// `seq` they cover.
    pub fn events_after(&self, seq: u64, watch: &WatchScope) -> (Vec<Value>, u64) {
        let events = self
            .log
            .iter()
            .filter(|e| e.seq > seq)
            .filter_map(|e| self.event_json(e, watch))
            .collect();
        (events, self.seq.max(seq))
    }

    fn event_json(&self, e: &LogEntry, w: &WatchScope) -> Option<Value> {
        match &e.resource {
            None if w.bookmarks => {
                let (api_version, kind) = self.kinds.get(&w.resource).cloned().unwrap_or_default();
                Some(json!({"type": "BOOKMARK", "object": {
                    "apiVersion": api_version, "kind": kind,
                    "metadata": {"resourceVersion": e.version.to_string()}}}))
            }
            None => None,
            Some(r) => {
                let in_scope = *r == w.resource
                    && w.namespace.as_deref().is_none_or(|n| n == e.namespace)
                    && w.selector.matches(&e.object);
                in_scope.then(|| json!({"type": e.kind, "object": e.object}))
            }
        }
    }
}

/// Whether `object` names `uid` among its `ownerReferences`.
fn owned_by(object: &Value, uid: &Option<Value>) -> bool {
    object
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .is_some_and(|refs| refs.iter().any(|r| r.get("uid") == uid.as_ref()))
}

/// What one watch asked for.
#[derive(Debug, Clone)]
pub struct WatchScope {
    pub resource: String,
    pub namespace: Option<String>,
    pub selector: Selector,
    pub bookmarks: bool,
}

/// An equality-based label selector: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-separated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(Vec<(String, Requirement)>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String),
    NotEquals(String),
    Exists,
    Absent,
}

impl Selector {
    /// Parses a selector; unknown syntax (set-based `in`, `notin`) is `Err`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut out = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let req = if let Some((k, v)) = part.split_once("!=") {
                (
                    k.trim().to_owned(),
                    Requirement::NotEquals(v.trim().to_owned()),
                )
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                (
                    k.trim().to_owned(),
                    Requirement::Equals(v.trim().to_owned()),
                )
            } else if let Some(k) = part.strip_prefix('!') {
                (k.trim().to_owned(), Requirement::Absent)
            } else if part.contains(' ') {
                return Err(format!("unsupported selector {part:?}"));
            } else {
                (part.to_owned(), Requirement::Exists)
            };
            out.push(req);
        }
        Ok(Self(out))
    }

    /// Whether `object`'s labels satisfy every requirement.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        self.0.iter().all(|(k, req)| {
            let v = labels.and_then(|l| l.get(k)).and_then(Value::as_str);
            match req {
                Requirement::Equals(want) => v == Some(want.as_str()),
                Requirement::NotEquals(want) => v != Some(want.as_str()),
                Requirement::Exists => v.is_some(),
                Requirement::Absent => v.is_none(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_match_labels() {
        let o = json!({"metadata": {"labels": {"app": "web", "tier": "front"}}});
        let m = |s: &str| Selector::parse(s).map(|sel| sel.matches(&o));
        assert_eq!(m(""), Ok(true));
        assert_eq!(m("app=web"), Ok(true));
        assert_eq!(m("app==web,tier=front"), Ok(true));
        assert_eq!(m("app=db"), Ok(false));
        assert_eq!(m("app!=db"), Ok(true));
        assert_eq!(m("tier"), Ok(true));
        assert_eq!(m("!tier"), Ok(false));
        assert!(m("app in (web)").is_err());
    }

    #[test]
    fn deleting_an_owner_deletes_its_dependents_only() {
        let mut s = Store::default();
        let d = s.apply(
            "deployments",
            json!({"metadata": {"namespace": "ns", "name": "web"}}),
        );
        let uid = d["metadata"]["uid"].clone();
        let owned = |name: &str, uid: &Value| {
            json!({"metadata": {"namespace": "ns", "name": name,
                "ownerReferences": [{"kind": "Deployment", "name": "web", "uid": uid}]}})
        };
        s.apply("pods", owned("web-act-1", &uid));
        s.apply("pods", owned("other", &json!("uid-elsewhere")));
        s.apply(
            "pods",
            json!({"metadata": {"namespace": "ns2", "name": "web-act-1",
                "ownerReferences": [{"uid": uid}]}}),
        );
        assert!(s.delete("deployments", "ns", "web").is_some());
        let left: Vec<&ObjectKey> = s.objects.keys().collect();
        assert_eq!(
            left,
            [
                &("pods".to_owned(), "ns".to_owned(), "other".to_owned()),
                &("pods".to_owned(), "ns2".to_owned(), "web-act-1".to_owned())
            ]
        );
        let deleted: Vec<&str> = s
            .log
            .iter()
            .filter(|e| e.kind == "DELETED")
            .map(|e| e.object["metadata"]["name"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(deleted, ["web", "web-act-1"], "a DELETED event for each");
    }

    #[test]
    fn versions_grow_and_compaction_forgets_the_log() {
        let mut s = Store::default();
        let a = s.apply(
            "services",
            json!({"metadata": {"namespace": "ns", "name": "a"}}),
        );
        assert_eq!(a["metadata"]["resourceVersion"], "1");
        s.apply(
            "services",
            json!({"metadata": {"namespace": "ns", "name": "a"}}),
        );
        let w = WatchScope {
            resource: "services".into(),
            namespace: None,
            selector: Selector::default(),
            bookmarks: true,
        };
        let from = s.start_seq(0).expect("in the log");
        let (events, _) = s.events_after(from, &w);
        let kinds: Vec<Value> = events.iter().map(|e| e["type"].clone()).collect();
        assert_eq!(kinds, [json!("ADDED"), json!("MODIFIED")]);
        let from1 = s.start_seq(1).expect("in the log");
        assert_eq!(
            s.events_after(from1, &w).0.len(),
            1,
            "from version 1: the MODIFIED"
        );
        s.compact();
        assert_eq!(s.start_seq(2), None, "410 Gone");
        let from = s.start_seq(s.oldest).expect("current");
        assert!(s.delete("services", "ns", "a").is_some());
        s.bookmark();
        let (events, last) = s.events_after(from, &w);
        assert_eq!(events[0]["type"], "DELETED");
        assert_eq!(events[1]["type"], "BOOKMARK");
        assert!(s.events_after(last, &w).0.is_empty(), "nothing twice");
    }
}
