//! A lagging subscriber through real sockets (127.0.0.1, port 0): one of
//! two subscribers of a service stops reading its stream (kept open, so
//! HTTP/2 flow control backs up to the plane) while many more writes than
//! the delta log holds are made. The other receives every write, one
//! delta each, while the first is stalled; once the stalled one reads
//! again, its missed deltas arrive coalesced into a reset
//! (`meshless_control_coalesced_total` rises) and it holds exactly the
//! final endpoints (`distributor.rs`, `delta_log.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use meshless_api::v1::{self, ClientMessage, client_message, server_message};
use meshless_control::api::{EndpointInput, ServiceInput};
use meshless_control::client::ApiClient;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use tokio_stream::wrappers::ReceiverStream;

const SVC: &str = "shop/cart";
/// A read that takes longer fails the test (a hang, not a slow read).
const DEADLINE: Duration = Duration::from_secs(30);
/// The delta log's size (`history`; the log holds at least 16).
const HISTORY: usize = 16;
/// The stalled client's HTTP/2 stream window: the plane can send it this
/// many bytes (a few dozen deltas) before flow control stops its stream.
const STALLED_WINDOW: u32 = 4096;
/// Writes made while one subscriber is stalled: far more than its window
/// and the log together hold.
const WRITES: u32 = 400;
/// Endpoint ids written to (each write changes or removes one of them).
const IDS: u32 = 10;

/// id -> (port, weight, addresses): what a subscriber (or the registry)
/// holds of the service.
type View = BTreeMap<String, (u32, u32, Vec<String>)>;

/// One subscriber's stream and what it holds.
struct Subscriber {
    inbound: tonic::Streaming<v1::ServerMessage>,
    /// Kept open: a closed inbound side ends the stream.
    _tx: tokio::sync::mpsc::Sender<ClientMessage>,
    view: View,
    /// The highest version applied (deltas and `SnapshotDone`).
    version: u64,
    /// Deltas received, and how many of them were resets.
    deltas: usize,
    resets: usize,
}

impl Subscriber {
    /// Opens a stream for `SVC` on its own connection, with an HTTP/2
    /// stream window of `window` bytes (`None`: hyper's default).
    async fn open(grpc: SocketAddr, window: Option<u32>) -> Self {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .expect("endpoint")
            .initial_stream_window_size(window)
            .connect()
            .await
            .expect("connect");
        let mut client = meshless_api::DistributionClient::new(channel);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let hello = v1::Hello {
            node: "n".into(),
            services: vec![SVC.into()],
            ..v1::Hello::default()
        };
        tx.send(ClientMessage {
            msg: Some(client_message::Msg::Hello(hello)),
        })
        .await
        .expect("hello");
        let inbound = client
            .stream(ReceiverStream::new(rx))
            .await
            .expect("stream")
            .into_inner();
        Self {
            inbound,
            _tx: tx,
            view: View::new(),
            version: 0,
            deltas: 0,
            resets: 0,
        }
    }

    /// Reads one message and applies it (the proxy's rule: a reset
    /// clears; upserts, then removals); returns the delta if it was one.
    async fn next(&mut self) -> Option<v1::Delta> {
        let msg = tokio::time::timeout(DEADLINE, self.inbound.message())
            .await
            .expect("a message before the deadline")
            .expect("stream ok")
            .expect("stream open");
        match msg.msg {
            Some(server_message::Msg::Delta(b)) => {
                let d = meshless_api::decode_delta(&b).expect("decodes");
                assert_eq!(d.service, SVC);
                assert!(
                    d.version > self.version || (d.reset && d.version >= self.version),
                    "versions only grow: {} after {}",
                    d.version,
                    self.version
                );
                self.deltas += 1;
                if d.reset {
                    self.resets += 1;
                    self.view.clear();
                }
                for e in &d.upserted {
                    let fields = (e.port, e.weight, e.addresses.clone());
                    self.view.insert(e.id.clone(), fields);
                }
                for id in &d.removed {
                    self.view.remove(id);
                }
                self.version = self.version.max(d.version);
                Some(d)
            }
            Some(server_message::Msg::SnapshotDone(done)) => {
                self.version = self.version.max(done.version);
                None
            }
            _ => None,
        }
    }

    /// Reads until the snapshot is done.
    async fn snapshot(&mut self) {
        loop {
            let msg = tokio::time::timeout(DEADLINE, self.inbound.message())
                .await
                .expect("the snapshot before the deadline")
                .expect("stream ok")
                .expect("stream open");
            match msg.msg {
                Some(server_message::Msg::Delta(b)) => {
                    let d = meshless_api::decode_delta(&b).expect("decodes");
                    assert!(d.reset, "the snapshot is a reset");
                    self.view = d
                        .upserted
                        .into_iter()
                        .map(|e| (e.id, (e.port, e.weight, e.addresses)))
                        .collect();
                }
                Some(server_message::Msg::SnapshotDone(done)) => {
                    self.version = done.version;
                    return;
                }
                _ => {}
            }
        }
    }

    /// Reads until a version at or above `version` has been applied.
    async fn read_until(&mut self, version: u64) {
        while self.version < version {
            self.next().await;
        }
    }
}

/// The value of the counter `name` in Prometheus text.
fn counter(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name} in the metrics:\n{text}"))
        .trim()
        .parse()
        .expect("an integer")
}

async fn coalesced(c: &ApiClient) -> u64 {
    let text = c.metrics().await.expect("metrics");
    counter(&text, "meshless_control_coalesced_total")
}

/// What the registration API holds of the service.
async fn registry_view(c: &ApiClient) -> View {
    let view = c.service(SVC).await.expect("view");
    view.endpoints
        .into_iter()
        .map(|e| {
            let addresses = e.addresses.iter().map(ToString::to_string).collect();
            (e.id, (u32::from(e.port), e.weight, addresses))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_subscriber_is_coalesced_and_the_other_gets_every_write() {
    tokio::time::timeout(Duration::from_secs(60), stalled_and_reading())
        .await
        .expect("the test finished within 60 s");
}

async fn stalled_and_reading() {
    let text = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nhistory: {HISTORY}\n"
    );
    let config = ControlConfig::parse(&text, "test").expect("config");
    let plane = ControlPlane::start(config).await.expect("start");
    let c = ApiClient::new(plane.api_addr());
    c.put_service(SVC, &ServiceInput::default())
        .await
        .expect("service");
    // Both subscribers hold the (empty) snapshot; then one stops reading.
    let mut stalled = Subscriber::open(plane.grpc_addr(), Some(STALLED_WINDOW)).await;
    let mut reading = Subscriber::open(plane.grpc_addr(), None).await;
    stalled.snapshot().await;
    reading.snapshot().await;
    assert!(stalled.view.is_empty() && reading.view.is_empty());
    let coalesced_before = coalesced(&c).await;

    // Writes, each waiting for the reading subscriber to apply it: it
    // gets every write as its own delta, in order, while the other's
    // stream is backed up.
    let started = Instant::now();
    let mut model = View::new();
    let mut last = 0;
    for i in 0..WRITES {
        let id = format!("cart-{}", i % IDS);
        let version = if i % 5 == 4 && model.contains_key(&id) {
            model.remove(&id);
            c.delete_endpoint(SVC, &id).await.expect("delete")
        } else {
            let port = 8000 + u16::try_from(i).expect("port");
            let address: std::net::IpAddr = [10, 0, 0, (i % IDS) as u8].into();
            let e = EndpointInput {
                weight: 1 + i % 7,
                ..EndpointInput::new(id.clone(), address, port)
            };
            model.insert(id, (u32::from(port), e.weight, vec![address.to_string()]));
            c.put_endpoint(SVC, &e).await.expect("put")
        };
        assert!(version > last, "versions grow");
        last = version;
        let d = loop {
            if let Some(d) = reading.next().await {
                break d;
            }
        };
        assert!(!d.reset, "write {i}: a delta, not a reset: it never lagged");
        assert_eq!(d.version, version, "write {i}: its own delta, in order");
        assert_eq!(reading.view, model, "write {i}: the reader holds it");
    }
    let writes_took = started.elapsed();
    assert_eq!(reading.deltas, WRITES as usize, "one delta per write");
    assert_eq!(reading.resets, 0);
    // The model is what the registry holds: the final endpoint set.
    let final_set = registry_view(&c).await;
    assert_eq!(model, final_set);
    assert!(!final_set.is_empty());
    assert_eq!(reading.view, final_set, "converged while the other stalls");

    // The stalled one reads again: whatever its window and the plane held
    // for it, then one reset in place of the deltas it fell behind on.
    let coalesced_stalled = coalesced(&c).await;
    stalled.read_until(last).await;
    assert_eq!(stalled.version, last);
    assert_eq!(
        stalled.view, final_set,
        "the stalled subscriber converges to the final endpoints"
    );
    assert!(
        stalled.resets >= 1,
        "caught up by a reset, not by every delta"
    );
    assert!(
        stalled.deltas < WRITES as usize,
        "missed deltas were coalesced: {} deltas for {WRITES} writes",
        stalled.deltas
    );
    // The lag was found when it read again: the log had moved on.
    let coalesced_after = coalesced(&c).await;
    assert!(
        coalesced_after > coalesced_stalled && coalesced_after > coalesced_before,
        "coalesced: {coalesced_before} before, {coalesced_stalled} while stalled, {coalesced_after} after"
    );
    eprintln!(
        "{WRITES} writes in {writes_took:?}; stalled subscriber: {} deltas ({} resets); \
         coalesced {coalesced_before} -> {coalesced_stalled} -> {coalesced_after}",
        stalled.deltas, stalled.resets
    );
    plane.shutdown().await;
}
