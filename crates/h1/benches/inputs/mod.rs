//! The inputs of the parse bench and the instruction counter
//! (`examples/instructions.rs`).

/// wrk's request.
pub const WRK: &[u8] = b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n";

/// A browser's GET with 12 fields.
pub const BROWSER: &[u8] = b"GET /assets/app.js?v=3 HTTP/1.1\r\n\
Host: www.example.com\r\n\
User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0\r\n\
Accept: */*\r\n\
Accept-Language: en-US,en;q=0.5\r\n\
Accept-Encoding: gzip, deflate, br, zstd\r\n\
Referer: https://www.example.com/\r\n\
Connection: keep-alive\r\n\
Cookie: session=3f2a9c1e7b; theme=dark; consent=1\r\n\
Sec-Fetch-Dest: script\r\n\
Sec-Fetch-Mode: no-cors\r\n\
Sec-Fetch-Site: same-origin\r\n\
If-None-Match: \"5d8c72a5edda8\"\r\n\r\n";

/// 16 chunks of 1 KiB, the last chunk and no trailers.
pub fn chunked_body() -> Vec<u8> {
    let mut body = Vec::new();
    for _ in 0..16 {
        body.extend_from_slice(b"400\r\n");
        body.extend_from_slice(&[b'x'; 1024]);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"0\r\n\r\n");
    body
}
