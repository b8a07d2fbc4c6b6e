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

mod inputs;
use inputs::{BROWSER, WRK, chunked_body};

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
