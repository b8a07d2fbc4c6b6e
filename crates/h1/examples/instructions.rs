//! Runs one of the parse bench's cases `N` times, for counting
//! instructions under callgrind (stable on a loaded machine, unlike time):
//! run it with two `N`s and divide the difference by their difference.
//!
//! ```sh
//! cargo build --release -p meshless-h1 --example instructions
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/instructions h1-wrk 10000
//! ```
//! Cases: `{httparse,h1}-{wrk,browser,chunked}`.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use meshless_h1::chunked::{Decoder, Step};
use meshless_h1::request::{self, Limits, Parsed};

#[path = "../benches/inputs/mod.rs"]
mod inputs;

fn httparse_head(raw: &[u8]) {
    let mut slots = [httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut slots);
    black_box(req.parse(black_box(raw)).unwrap());
}

fn h1_head(raw: &[u8], limits: &Limits) {
    let mut slots = [httparse::EMPTY_HEADER; 100];
    match request::parse(black_box(raw), &mut slots, limits).unwrap() {
        Parsed::Complete { head, consumed } => {
            black_box((head.framing, consumed));
        }
        Parsed::Incomplete => panic!("incomplete"),
    }
}

fn httparse_chunked(body: &[u8]) {
    let mut pos = 0;
    loop {
        let httparse::Status::Complete((used, size)) =
            httparse::parse_chunk_size(black_box(&body[pos..])).unwrap()
        else {
            panic!("partial");
        };
        pos += used;
        if size == 0 {
            break;
        }
        pos += size as usize + 2;
    }
    black_box(pos);
}

fn h1_chunked(body: &[u8]) {
    let mut decoder = Decoder::new(100);
    let mut pos = 0;
    loop {
        match decoder.decode(black_box(&body[pos..])).unwrap() {
            Step::Data(r) => pos += r.end,
            Step::Done { consumed, .. } => {
                black_box(pos + consumed);
                return;
            }
            Step::Incomplete { .. } => panic!("incomplete"),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let case = args.get(1).map_or("h1-wrk", String::as_str);
    let n: usize = args.get(2).map_or(1000, |n| n.parse().unwrap());
    let limits = Limits::default();
    let body = inputs::chunked_body();
    for _ in 0..n {
        match case {
            "httparse-wrk" => httparse_head(inputs::WRK),
            "httparse-browser" => httparse_head(inputs::BROWSER),
            "h1-wrk" => h1_head(inputs::WRK, &limits),
            "h1-browser" => h1_head(inputs::BROWSER, &limits),
            "httparse-chunked" => httparse_chunked(&body),
            "h1-chunked" => h1_chunked(&body),
            other => panic!("unknown case {other}"),
        }
    }
}
