//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's
//! `leaderelection` does: the holder renews every `retry_period`; another
//! replica takes the Lease over only when the record (holder, renew time)
//! has not changed for `lease_duration`, measured on its own clock (so
//! clock skew between replicas does not matter); every write carries the
//! `resourceVersion` it read, so two replicas cannot both win (the API
//! server answers 409 to the second). A holder that could not renew for
//! `renew_deadline` (2/3 of the duration) stops acting as leader before
//! anyone else may take over; each round is bounded by that deadline too,
//! so a round whose API call hangs cannot keep a replica leading. On stop
//! the holder releases the Lease.
//!
//! The holder writes its registration API's address in the Lease
//! ([`API_ADDRESS_ANNOTATION`]); followers read it to forward their
//! proxies' load and activation requests to the leader.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use meshless_control::kubernetes::LeaderElection;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

/// The Lease annotation holding the leader's registration API address.
pub const API_ADDRESS_ANNOTATION: &str = "meshless.io/api-address";

/// The Lease record another replica watches for change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    holder: Option<String>,
    renew: Option<MicroTime>,
}

fn now() -> MicroTime {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    MicroTime(Timestamp::from_millisecond(ms).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// One replica's elector.
#[derive(Debug)]
pub struct Elector {
    api: Api<Lease>,
    cfg: LeaderElection,
    identity: String,
    /// The last record seen and when it was first seen with that value.
    observed: Option<(Record, Instant)>,
    last_renew: Option<Instant>,
    /// This replica's registration API address, written while it leads.
    advertise: Option<String>,
    /// The current leader's address while another replica leads.
    leader_api: Arc<Mutex<Option<String>>>,
}

impl Elector {
    /// An elector for `identity` on the Lease `cfg` names in `api`'s namespace.
    pub fn new(api: Api<Lease>, cfg: LeaderElection, identity: String) -> Self {
        Self {
            api,
            cfg,
            identity,
            observed: None,
            last_renew: None,
            advertise: None,
            leader_api: Arc::new(Mutex::new(None)),
        }
    }

    /// Advertises `address` (this replica's API) in the Lease while it
    /// leads, and sets `leader_api` to the leader's while another leads.
    pub fn with_addresses(
        mut self,
        address: Option<String>,
        leader_api: Arc<Mutex<Option<String>>>,
    ) -> Self {
        self.advertise = address;
        self.leader_api = leader_api;
        self
    }

    fn set_leader_api(&self, address: Option<String>) {
        *self
            .leader_api
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = address;
    }

    /// The metadata of a Lease this replica writes: its address annotated.
    fn stamp(&self, meta: &mut ObjectMeta) {
        let annotations = meta.annotations.get_or_insert_with(Default::default);
        match &self.advertise {
            Some(a) => {
                annotations.insert(API_ADDRESS_ANNOTATION.to_owned(), a.clone());
            }
            None => {
                annotations.remove(API_ADDRESS_ANNOTATION);
            }
        }
    }

    fn spec(&self, transitions: i32, acquired: Option<MicroTime>) -> LeaseSpec {
        let t = now();
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.cfg.lease_duration.as_secs().max(1) as i32),
            acquire_time: Some(acquired.unwrap_or_else(|| t.clone())),
            renew_time: Some(t),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// One round: create, renew or take over the Lease. Returns whether
    /// this replica holds it now.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let name = self.cfg.lease_name.clone();
        let Some(mut lease) = self.api.get_opt(&name).await? else {
            let mut lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(0, None)),
            };
            self.stamp(&mut lease.metadata);
            self.set_leader_api(None);
            return self.write(self.api.create(&PostParams::default(), &lease).await);
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let record = Record {
            holder: spec.holder_identity.clone().filter(|h| !h.is_empty()),
            renew: spec.renew_time.clone(),
        };
        if self.observed.as_ref().is_none_or(|(r, _)| *r != record) {
            self.observed = Some((record.clone(), Instant::now()));
        }
        let mine = record.holder.as_deref() == Some(self.identity.as_str());
        let expired = record.holder.is_none()
            || self
                .observed
                .as_ref()
                .is_some_and(|(_, at)| at.elapsed() >= self.cfg.lease_duration);
        if !mine && !expired {
            let address = lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(API_ADDRESS_ANNOTATION))
                .cloned();
            self.set_leader_api(address);
            return Ok(false);
        }
        self.set_leader_api(None);
        self.stamp(&mut lease.metadata);
        let transitions = spec.lease_transitions.unwrap_or(0);
        lease.spec = Some(if mine {
            self.spec(transitions, spec.acquire_time)
        } else {
            self.spec(transitions + 1, None)
        });
        let written = self
            .api
            .replace(&name, &PostParams::default(), &lease)
            .await;
        self.write(written)
    }

    /// A create or replace: won, lost to a concurrent writer (409), or failed.
    fn write(&mut self, result: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
        match result {
            Ok(_) => {
                self.last_renew = Some(Instant::now());
                Ok(true)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether a holder whose last renew succeeded at `last_renew` may
    /// still act: within 2/3 of the lease duration (client-go's renew deadline).
    fn still_leading(&self) -> bool {
        self.last_renew
            .is_some_and(|t| t.elapsed() < self.cfg.lease_duration * 2 / 3)
    }

    /// How long one round may take: while leading, until the renew
    /// deadline (so the flag drops by then even if the API call hangs);
    /// else the renew deadline.
    fn round_deadline(&self) -> std::time::Duration {
        let deadline = self.cfg.lease_duration * 2 / 3;
        match self.last_renew {
            Some(t) if self.still_leading() => deadline.saturating_sub(t.elapsed()),
            _ => deadline,
        }
    }

    /// Gives the Lease up (holder cleared) if this replica holds it.
    pub async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.cfg.lease_name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = Some(now());
        let _ = self
            .api
            .replace(&self.cfg.lease_name, &PostParams::default(), &lease)
            .await;
        self.last_renew = None;
    }

    /// Runs rounds every `retry_period` until `stop`; `leader` (and the
    /// `gauge`) say whether this replica may act. Releases on stop.
    pub async fn run(
        mut self,
        leader: Arc<AtomicBool>,
        gauge: Gauge,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(self.cfg.retry_period);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = crate::stopped(&mut stop) => break,
            }
            let holds = match tokio::time::timeout(
                self.round_deadline(),
                self.try_acquire_or_renew(),
            )
            .await
            {
                Ok(Ok(h)) => h,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "leader election: cannot reach the Lease");
                    self.still_leading()
                }
                Err(_) => {
                    tracing::warn!("leader election: the round got no answer in time");
                    self.still_leading()
                }
            };
            if holds != leader.swap(holds, Ordering::SeqCst) {
                tracing::info!(identity = %self.identity, leader = holds, "leader election");
            }
            gauge.set(i64::from(holds));
        }
        leader.store(false, Ordering::SeqCst);
        gauge.set(0);
        let deadline = self.cfg.lease_duration * 2 / 3;
        let _ = tokio::time::timeout(deadline, self.release()).await;
    }
}
