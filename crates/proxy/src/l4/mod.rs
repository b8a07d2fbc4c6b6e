//! L4 (TCP) listeners: each accepted connection is a flow, sent whole to
//! one endpoint of the listener's cluster, chosen by the cluster's
//! balancer over the flow key (`source_ip` or `source_ip_port`). With
//! `policy: maglev`, every meshless instance given the same endpoints
//! sends a flow to the same endpoint, so an L4 tier of any size agrees and
//! losing an instance moves no flow (Envoy's `tcp_proxy` with a Maglev
//! cluster and `hash_policy: source_ip`; HAProxy `mode tcp` with
//! `balance source` and `hash-type consistent`).
//!
//! Connection tracking: a flow holds its endpoint's [`InFlight`] guard
//! (the load least-request and bounded load read) and its socket for its
//! whole life, whatever the tables do; an endpoint that leaves its cluster
//! or starts terminating gets no new flow (it is out of the table), and
//! its open flows live until they close or the proxy's `drain_timeout`
//! has passed since it left ([`tracking`]).
//!
//! [`InFlight`]: meshless_balance::InFlight

pub mod connect;

pub mod pipe;
pub mod tracking;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use meshless_balance::{Outcome, hash_key};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::proxy_protocol::{self, ProxyProtocolVersion};
use crate::request::Downstream;
use pipe::{Activity, Metered, Side};

/// Bytes buffered per direction of a flow: HAProxy's `tune.bufsize`
/// (tokio's default is 8 KiB; 16 KiB halves the reads and writes of a
/// bulk flow for 32 KiB per open flow).
const BUFFER: usize = 16 * 1024;

pub use crate::protocol::{FlowKey, TcpProxy};

impl FlowKey {
    /// The hash of `client` under this key: xxh3 of the address bytes (16
    /// for IPv6, 4 for IPv4, IPv4-mapped IPv6 taken as IPv4), then the
    /// port big-endian for `source_ip_port`. Equal in every process and
    /// release.
    pub fn hash(self, client: SocketAddr) -> u64 {
        let mut bytes = [0u8; 18];
        let n = match client.ip().to_canonical() {
            IpAddr::V4(a) => {
                bytes[..4].copy_from_slice(&a.octets());
                4
            }
            IpAddr::V6(a) => {
                bytes[..16].copy_from_slice(&a.octets());
                16
            }
        };
        let n = match self {
            FlowKey::SourceIp => n,
            FlowKey::SourceIpPort => {
                bytes[n..n + 2].copy_from_slice(&client.port().to_be_bytes());
                n + 2
            }
        };
        hash_key(&bytes[..n])
    }
}

/// Records how a flow ended (metrics, and an access-log line when the
/// log is on); dropped before [`FlowEnd::set`], it counts
/// `listener_drained` (its listener closed it at the end of a drain).
struct FlowEnd<'a> {
    downstream: &'a Downstream,
    cluster: &'a str,
    end: &'static str,
    client: SocketAddr,
    /// The endpoint, once connected.
    endpoint: Option<meshless_model::EndpointId>,
    /// Its bytes, once connected.
    activity: Option<Arc<Activity>>,
}

impl FlowEnd<'_> {
    fn set(mut self, end: &'static str) {
        self.end = end;
    }
}

impl Drop for FlowEnd<'_> {
    fn drop(&mut self) {
        let state = &self.downstream.state;
        state
            .metrics
            .edge
            .flow_ended(&self.downstream.name, self.cluster, self.end);
        let logger = state.access_log.load();
        if !logger.enabled() {
            return;
        }
        let (received, sent) = self.activity.as_ref().map_or((0, 0), |a| a.bytes());
        let duration = self
            .activity
            .as_ref()
            .map_or(std::time::Duration::ZERO, |a| a.began().elapsed());
        let client = self.client.ip().to_string();
        let record = crate::access_log::FlowRecord {
            time: crate::access_log::now(),
            listener: &self.downstream.name,
            protocol: "tcp",
            client: &client,
            cluster: self.cluster,
            endpoint: self.endpoint.as_ref().map_or("-", |e| e.as_str()),
            bytes_received: received,
            bytes_sent: sent,
            duration_ms: duration.as_secs_f64() * 1000.0,
            end: self.end,
        };
        logger.log(&record, &state.metrics.access_log_dropped);
    }
}

/// Serves one accepted connection from `client` on a `tcp` listener until
/// the flow ends. `draining` is held to the end: the listener's drain
/// waits for open flows (they are not asked to stop; the drain timeout
/// closes what is left).
pub async fn serve(
    downstream: Arc<Downstream>,
    stream: TcpStream,
    client: SocketAddr,
    draining: watch::Receiver<crate::connection::Drain>,
) {
    let _draining = draining;
    let settings = downstream.settings();
    let Some(tcp) = settings.tcp.as_ref() else {
        return;
    };
    let state = &downstream.state;
    let snapshot = state.snapshot.load_full();
    let mut end = FlowEnd {
        downstream: &downstream,
        cluster: &tcp.cluster,
        end: "listener_drained",
        client,
        endpoint: None,
        activity: None,
    };
    let Some(cluster) = snapshot.clusters.get(&tcp.cluster).cloned() else {
        return end.set("no_endpoint");
    };
    let key = tcp.flow_key.hash(client);
    let node = &snapshot.config.node;
    let opened = connect::open(state, &cluster, key, tcp.connect_attempts, node).await;
    let Some((mut upstream, mut guard)) = opened else {
        return end.set("no_endpoint");
    };
    if cluster.config.proxy_protocol == Some(ProxyProtocolVersion::V2) {
        let destination = stream.local_addr().unwrap_or(client);
        let header = proxy_protocol::encode(client, destination);
        if upstream.write_all(&header).await.is_err() {
            guard.finish(Outcome::Reset);
            return end.set("error");
        }
    }
    // A connected flow is a success for outlier detection (Envoy's
    // tcp_proxy reports `LocalOriginConnectSuccess`), recorded now, at
    // connect: what it carries is not the proxy's to judge. The guard
    // keeps the flow's load until the flow ends.
    guard.report_now(Outcome::Status(200));
    let endpoint = guard.endpoint_id().clone();
    end.endpoint = Some(endpoint.clone());
    let _active = state
        .metrics
        .edge
        .flow_opened(&downstream.name, &cluster.name);
    let activity = Activity::new();
    end.activity = Some(Arc::clone(&activity));
    let metrics = &state.metrics.edge;
    let mut down = Metered::new(
        stream,
        metrics.bytes(&downstream.name, "downstream_rx"),
        Arc::clone(&activity),
        Side::Downstream,
    );
    let mut up = Metered::new(
        upstream,
        metrics.bytes(&downstream.name, "downstream_tx"),
        Arc::clone(&activity),
        Side::Upstream,
    );
    let ended = tokio::select! {
        copied = tokio::io::copy_bidirectional_with_sizes(&mut down, &mut up, BUFFER, BUFFER) => match copied {
            Ok(_) => "closed",
            Err(_) => "error",
        },
        () = activity.idle_for(tcp.idle_timeout) => "idle_timeout",
        () = tracking::until_drained(state, &cluster.name, &endpoint) => "endpoint_drained",
    };
    end.set(ended);
    drop(guard);
}
