//! The codec's cost over httparse alone: a request head (wrk's GET and a
//! 12-field browser GET) parsed and framed by `meshless_h1::request::parse`
//! against `httparse::Request::parse`, and a chunked body decoded by
//! `meshless_h1::chunked::Decoder` against a bare `parse_chunk_size` loop.
//!
//! Run: `cargo bench -p meshless-h1 --bench parse`.
#![allow(clippy::unwrap_used, missing_debug_implementations)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use meshless_h1::chunked::{Decoder, Step};
use meshless_h1::request::{self, Limits, Parsed};

const WRK: &[u8] = b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n";

const BROWSER: &[u8] = b"GET /assets/app.js?v=3 HTTP/1.1\r\n\
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
fn chunked_body() -> Vec<u8> {
    let mut body = Vec::new();
    for _ in 0..16 {
        body.extend_from_slice(b"400\r\n");
        body.extend_from_slice(&[b'x'; 1024]);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"0\r\n\r\n");
    body
}

fn heads(c: &mut Criterion) {
    let limits = Limits::default();
    let mut group = c.benchmark_group("head");
    for (name, raw) in [("wrk", WRK), ("browser", BROWSER)] {
        group.throughput(Throughput::Bytes(raw.len() as u64));
        group.bench_function(format!("httparse/{name}"), |b| {
            let mut slots = [httparse::EMPTY_HEADER; 100];
            b.iter(|| {
                let mut req = httparse::Request::new(&mut slots);
                black_box(req.parse(black_box(raw)).unwrap());
            });
        });
        group.bench_function(format!("meshless-h1/{name}"), |b| {
            let mut slots = [httparse::EMPTY_HEADER; 100];
            b.iter(
                || match request::parse(black_box(raw), &mut slots, &limits) {
                    Ok(Parsed::Complete { head, consumed }) => {
                        black_box((head.framing, consumed));
                    }
                    other => panic!("{other:?}"),
                },
            );
        });
    }
    group.finish();
}

fn chunked(c: &mut Criterion) {
    let body = chunked_body();
    let mut group = c.benchmark_group("chunked");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("httparse/16x1KiB", |b| {
        b.iter(|| {
            let mut pos = 0;
            let mut data = 0u64;
            loop {
                let (used, size) = match httparse::parse_chunk_size(&body[pos..]).unwrap() {
                    httparse::Status::Complete(x) => x,
                    httparse::Status::Partial => unreachable!(),
                };
                pos += used;
                if size == 0 {
                    pos += 2;
                    break;
                }
                data += size;
                pos += size as usize + 2;
            }
            black_box((pos, data));
        });
    });
    group.bench_function("meshless-h1/16x1KiB", |b| {
        b.iter(|| {
            let mut decoder = Decoder::new(100);
            let mut pos = 0;
            let mut data = 0usize;
            loop {
                match decoder.decode(black_box(&body[pos..])).unwrap() {
                    Step::Data(r) => {
                        data += r.len();
                        pos += r.end;
                    }
                    Step::Done { consumed, .. } => {
                        pos += consumed;
                        break;
                    }
                    Step::Incomplete { .. } => unreachable!(),
                }
            }
            black_box((pos, data));
        });
    });
    group.finish();
}

criterion_group!(benches, heads, chunked);
criterion_main!(benches);
