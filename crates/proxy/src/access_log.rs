//! JSON access-log lines, written by a background thread so the request
//! path never blocks on output: the queue is bounded, and a line that finds
//! it full is dropped and counted (`meshless_proxy_access_log_dropped_total`).

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use prometheus_client::metrics::counter::Counter;
use serde::Serialize;

use crate::config::AccessLog;

/// One finished request.
#[derive(Debug, Serialize)]
pub struct AccessRecord<'a> {
    /// RFC 3339 time the request finished.
    pub time: String,
    pub listener: &'a str,
    /// The client's IP address (from a trusted PROXY header or
    /// `X-Forwarded-For` hop when so configured, else the peer's).
    pub client: &'a str,
    pub route: &'a str,
    pub cluster: &'a str,
    pub endpoint: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub status: u16,
    /// Response body bytes sent.
    pub bytes: u64,
    /// Milliseconds from request received to response end.
    pub duration_ms: f64,
    pub request_id: &'a str,
    /// Upstream attempts (1 + retries).
    pub attempts: u32,
    /// `client_abort` (the client left before the response ended) or
    /// `client_error` (its request body was malformed or cut); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fault: Option<&'static str>,
    /// How the proxy ended a response it had begun, when neither the
    /// response nor the client did: `reset` (the upstream broke it off)
    /// or `timeout` (the request deadline cut it). `status` and `bytes`
    /// are then those of the part sent; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cut: Option<&'static str>,
    /// A gRPC call's `grpc-status` (from the upstream's trailers or
    /// trailers-only answer, or the proxy's own answer); absent for other
    /// requests and for a call cut before any status (`status` then holds
    /// its HTTP equivalent, as in the metrics).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_status: Option<u32>,
}

/// One finished TCP flow of a `tcp` listener (HAProxy's `option tcplog`).
#[derive(Debug, Serialize)]
pub struct FlowRecord<'a> {
    /// RFC 3339 time the flow ended.
    pub time: String,
    pub listener: &'a str,
    /// `tcp`: a flow's line (request lines have `method` instead).
    pub protocol: &'static str,
    /// The client's IP address.
    pub client: &'a str,
    pub cluster: &'a str,
    /// The endpoint the flow went to; `-` when none was connected.
    pub endpoint: &'a str,
    /// Bytes read from the client (and sent on to the endpoint).
    pub bytes_received: u64,
    /// Bytes read from the endpoint (and sent on to the client).
    pub bytes_sent: u64,
    /// Milliseconds from the endpoint's connection to the flow's end (0
    /// when none was connected).
    pub duration_ms: f64,
    /// How it ended: `closed`, `error`, `idle_timeout`,
    /// `endpoint_drained`, `listener_drained` or `no_endpoint` (the
    /// `end` label of `meshless_proxy_tcp_flows_ended_total`).
    pub end: &'static str,
}

/// Where access-log lines go.
#[derive(Debug)]
pub struct AccessLogger {
    target: AccessLog,
    sender: Option<mpsc::SyncSender<String>>,
    /// Lines the writer failed to write (a full disk), not yet counted in
    /// the dropped counter (the writer has none; [`AccessLogger::log`]
    /// moves them there).
    failed: Arc<AtomicU64>,
    /// The open file's device and inode (a file target): a file at the
    /// path that is another one (renamed away by logrotate) is reopened.
    file_id: Option<(u64, u64)>,
}

/// Lines queued for the writer at most; more are dropped.
pub const QUEUE: usize = 16 * 1024;

impl AccessLogger {
    /// Opens the target (a file is created or appended to).
    pub fn open(target: &AccessLog) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let mut file_id = None;
        let sink: Option<Box<dyn Write + Send>> = match target {
            AccessLog::Off => None,
            AccessLog::Stdout => Some(Box::new(std::io::stdout())),
            AccessLog::File(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?;
                file_id = file.metadata().ok().map(|m| (m.dev(), m.ino()));
                Some(Box::new(file))
            }
        };
        let failed = Arc::new(AtomicU64::new(0));
        let name = match target {
            AccessLog::File(path) => path.clone(),
            _ => "stdout".to_owned(),
        };
        let sender = sink.map(|mut sink| {
            let (tx, rx) = mpsc::sync_channel::<String>(QUEUE);
            let failed = Arc::clone(&failed);
            std::thread::Builder::new()
                .name("access-log".into())
                .spawn(move || {
                    // Warned once per run of failures (again after a
                    // success), not per line.
                    let mut failing = false;
                    let mut write = |sink: &mut Box<dyn Write + Send>, line: &str| {
                        match sink.write_all(line.as_bytes()) {
                            Ok(()) => failing = false,
                            Err(e) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                                if !std::mem::replace(&mut failing, true) {
                                    tracing::warn!(path = %name, error = %e, "access log: lines are lost (counted in meshless_proxy_access_log_dropped_total)");
                                }
                            }
                        }
                    };
                    while let Ok(line) = rx.recv() {
                        write(&mut sink, &line);
                        // Drain what is queued before flushing.
                        while let Ok(line) = rx.try_recv() {
                            write(&mut sink, &line);
                        }
                        let _ = sink.flush();
                    }
                })
                .map(|_| tx)
        });
        Ok(Self {
            target: target.clone(),
            sender: sender.and_then(Result::ok),
            failed,
            file_id,
        })
    }

    /// Whether the target is a file and its path no longer names the file
    /// open here (renamed or removed, as logrotate does).
    pub fn moved(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        let AccessLog::File(path) = &self.target else {
            return false;
        };
        std::fs::metadata(path).map_or(true, |m| Some((m.dev(), m.ino())) != self.file_id)
    }

    /// The configured target.
    pub fn target(&self) -> &AccessLog {
        &self.target
    }

    /// Whether lines are written at all.
    pub fn enabled(&self) -> bool {
        self.sender.is_some()
    }

    /// Queues one line (a request's [`AccessRecord`] or a flow's
    /// [`FlowRecord`]); a line that finds the queue full is dropped and
    /// counted in `dropped` (`meshless_proxy_access_log_dropped_total`),
    /// and so are the lines the writer failed to write since the last call.
    pub fn log<R: Serialize>(&self, record: &R, dropped: &Counter) {
        if let Some(tx) = &self.sender
            && let Ok(mut line) = serde_json::to_string(record)
        {
            line.push('\n');
            if let Err(mpsc::TrySendError::Full(_)) = tx.try_send(line) {
                dropped.inc();
            }
        }
        let failed = self.failed.swap(0, Ordering::Relaxed);
        if failed > 0 {
            dropped.inc_by(failed);
        }
    }
}

/// The time of a line: now, RFC 3339 with milliseconds.
pub fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}
