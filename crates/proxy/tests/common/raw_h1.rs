//! A raw HTTP/1.1 response reader for tests that write requests by hand
//! on a socket: httparse for the head, then the body by its
//! `content-length`, its chunks, or to the end of the connection.

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::DEADLINE;

/// One response read off `s`: status, headers (lower-case names), body.
/// `rest` carries bytes read past it to the next call.
pub struct Reader {
    pub rest: Vec<u8>,
}

#[derive(Debug)]
pub struct Resp {
    /// The status line's minor version: `HTTP/1.0` is 0.
    pub version: u8,
    pub status: u16,
    pub reason: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Reader {
    pub fn new() -> Self {
        Self { rest: Vec::new() }
    }

    /// Reads until `done` says how many bytes of `rest` it needs; `None`
    /// when the connection closed first.
    pub async fn fill(&mut self, s: &mut TcpStream) -> Option<()> {
        let mut buf = [0u8; 8192];
        let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
            .await
            .expect("no answer within the deadline")
            .ok()?;
        if n == 0 {
            return None;
        }
        self.rest.extend_from_slice(&buf[..n]);
        Some(())
    }

    pub async fn response(&mut self, s: &mut TcpStream, head_request: bool) -> Option<Resp> {
        let (status, headers, used) = loop {
            let mut fields = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut fields);
            if let httparse::Status::Complete(n) = r.parse(&self.rest).expect("a response head") {
                let headers = r
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect::<Vec<_>>();
                let reason = r.reason.unwrap_or_default().to_owned();
                break (
                    (
                        r.version.expect("a version"),
                        r.code.expect("a status"),
                        reason,
                    ),
                    headers,
                    n,
                );
            }
            self.fill(s).await?;
        };
        self.rest.drain(..used);
        let (version, status, reason) = status;
        let mut resp = Resp {
            version,
            status,
            reason,
            headers,
            body: Vec::new(),
        };
        if status == 100 || head_request || status == 204 || status == 304 {
            return Some(resp);
        }
        if let Some(n) = resp.header("content-length") {
            let n: usize = n.parse().expect("a content-length");
            while self.rest.len() < n {
                self.fill(s).await?;
            }
            resp.body = self.rest.drain(..n).collect();
        } else if resp.header("transfer-encoding") == Some("chunked") {
            loop {
                let line_end = loop {
                    if let Some(i) = self.rest.windows(2).position(|w| w == b"\r\n") {
                        break i;
                    }
                    self.fill(s).await?;
                };
                let line = std::str::from_utf8(&self.rest[..line_end]).expect("a chunk size");
                let size = usize::from_str_radix(line, 16).expect("a hex chunk size");
                while self.rest.len() < line_end + 2 + size + 2 {
                    self.fill(s).await?;
                }
                resp.body
                    .extend_from_slice(&self.rest[line_end + 2..line_end + 2 + size]);
                self.rest.drain(..line_end + 2 + size + 2);
                if size == 0 {
                    break;
                }
            }
        } else {
            while self.fill(s).await.is_some() {}
            resp.body = std::mem::take(&mut self.rest);
        }
        Some(resp)
    }
}
