//! meshless's HTTP/1.1 codec: message heads parsed by `httparse` (the
//! parser hyper uses; no grammar is hand-written here), the body framing
//! of RFC 9112 section 6 decided exactly as hyper 1 decides it, and an
//! incremental chunked decoder — all over a buffer the caller lends, with
//! header fields and body data handed back as slices of it. Nothing here
//! holds a buffer between calls, so a connection that waits for its next
//! request needs none.
//!
//! The promise, proven by `tests/differential.rs` (hyper's server and
//! client connections fed the same bytes) and the fuzz targets in
//! `fuzz/`: the same accept/reject decision and the same message
//! boundaries as hyper plus the proxy's screen stage, except for the few
//! cases listed there where the codec is stricter on purpose.
//!
//! In the serving path on listeners with `http1: meshless`
//! (`crates/proxy/src/h1serve/`), and upstream on clusters with `http1:
//! meshless` (`crates/proxy/src/upstream/h1.rs`).

pub mod check;
pub mod chunked;
pub mod error;
pub mod framing;
pub mod request;
pub mod response;

pub use error::Error;
pub use framing::{Body, Framing};
pub use request::{Limits, Parsed, RequestHead};
pub use response::{ResponseHead, ResponseLimits};
