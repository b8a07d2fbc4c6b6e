//! The codec against hyper 1, byte stream for byte stream.
//!
//! Requests: the same bytes go to hyper's `server::conn::http1` (over an
//! in-memory duplex, built as the proxy builds it: a read buffer of
//! `max_header_bytes + max_uri_bytes + 1024`, 100 header slots) behind a
//! service that applies the proxy's screen limits (`414` for a path and
//! query over `max_uri_bytes`, `431` for more than `max_headers` fields or
//! `max_header_bytes`, `501` for `CONNECT`, each closing the connection)
//! and otherwise reads the whole body; and to `meshless_h1::check`'s
//! stream parser. Both must give the same messages (request line, the
//! forwarded fields, body, trailers, whether the body completed) and the
//! same end (clean, refused, `CONNECT`).
//!
//! Responses: one response (after any `1xx`) read by hyper's
//! `client::conn::http1` for a request with a given method, against the
//! codec's first final response. (hyper's client does not pipeline, and
//! bytes after a response it did not ask for are its error, not framing.)
//!
//! Where the codec is stricter than hyper on purpose, the case is in
//! [`STRICTER`] with its reason; there is no case where it is looser.
#![allow(clippy::unwrap_used)]

mod sides;

use http::Method;
use proptest::prelude::*;
use sides::*;

/// Inputs where the codec is stricter than hyper on purpose, and why.
const STRICTER: &[(&str, &str)] = &[
    (
        "a chunk-size line over 16 KiB + 64 bytes of leading zeros or spaces",
        "hyper reads any number of them byte by byte; a buffer-lending codec must bound the line",
    ),
    (
        "a head longer than the read buffer that hyper still parses when one read brought it whole",
        "hyper's limit depends on how the bytes were split into reads; the codec's is the byte count",
    ),
];

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn same(rt: &tokio::runtime::Runtime, name: &str, input: &[u8]) {
    let theirs = rt.block_on(hypers(input.to_vec()));
    let mine = ours(input);
    assert_eq!(
        mine,
        theirs,
        "{name}: codec (left) and hyper (right) differ on {:?}",
        String::from_utf8_lossy(input)
    );
}

/// The malformed and fault-suite requests of crates/proxy/tests, and the
/// request-smuggling classics.
fn named_cases() -> Vec<(String, Vec<u8>)> {
    let big_header = format!(
        "GET / HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    let mut many = String::from("GET / HTTP/1.1\r\nHost: t\r\n");
    for i in 0..2000 {
        many.push_str(&format!("X-H{i}: 1\r\n"));
    }
    many.push_str("\r\n");
    let long_uri = format!(
        "GET /{} HTTP/1.1\r\nHost: t\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    let post =
        |fields: &str, body: &str| format!("POST / HTTP/1.1\r\nHost: t\r\n{fields}\r\n{body}");
    let next = "GET /next HTTP/1.1\r\nHost: t\r\n\r\n";
    let mut cases: Vec<(String, String)> = vec![
        // crates/proxy/tests/malformed.rs
        (
            "CL and TE together".into(),
            post(
                "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
                &format!("0\r\n\r\n{}", "GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n"),
            ),
        ),
        (
            "two Content-Lengths".into(),
            post("Content-Length: 4\r\nContent-Length: 5\r\n", "abcde"),
        ),
        (
            "obfuscated TE value".into(),
            post("Transfer-Encoding: xchunked\r\n", "0\r\n\r\n"),
        ),
        (
            "TE chunked not last".into(),
            post("Transfer-Encoding: chunked, identity\r\n", "0\r\n\r\n"),
        ),
        (
            "space before colon".into(),
            post("Transfer-Encoding : chunked\r\n", "0\r\n\r\n"),
        ),
        (
            "NUL in a header".into(),
            "GET / HTTP/1.1\r\nHost: t\r\nX-A: a\0b\r\n\r\n".into(),
        ),
        (
            "obs-fold".into(),
            "GET / HTTP/1.1\r\nHost: t\r\nX-A: a\r\n b\r\n\r\n".into(),
        ),
        ("200 KB header".into(), big_header),
        ("2,000 headers".into(), many),
        ("200 KB URI".into(), long_uri),
        (
            "negative Content-Length".into(),
            post("Content-Length: -1\r\n", ""),
        ),
        (
            "bad chunk size".into(),
            post("Transfer-Encoding: chunked\r\n", "5\r\nhello\r\nZZZ\r\n"),
        ),
        (
            "chunk size overflow".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                "FFFFFFFFFFFFFFFFFFFF\r\nx\r\n",
            ),
        ),
        ("HTTP/0.9".into(), "GET /\r\n\r\n".into()),
        (
            "two Hosts".into(),
            "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n".into(),
        ),
        (
            "Host vs absolute URI".into(),
            "GET http://a.example/ HTTP/1.1\r\nHost: b.example\r\n\r\n".into(),
        ),
        // crates/proxy/tests/faults.rs
        (
            "abandoned mid-head".into(),
            "GET /?delay_ms=5 HTTP/1.1\r\nHost: t\r\nX-Half: ".into(),
        ),
        (
            "abandoned mid-body".into(),
            post("Content-Length: 100000\r\n", "some of it"),
        ),
        (
            "plain GET".into(),
            "GET /cold/x HTTP/1.1\r\nHost: t\r\n\r\n".into(),
        ),
        // Smuggling classics.
        (
            "CL.TE".into(),
            post(
                "Content-Length: 13\r\nTransfer-Encoding: chunked\r\n",
                "0\r\n\r\nSMUGGLED",
            ),
        ),
        (
            "TE.CL".into(),
            post(
                "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
                &format!("8\r\nSMUGGLED\r\n0\r\n\r\n{next}"),
            ),
        ),
        (
            "TE.TE duplicate, identity last".into(),
            post(
                "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
                "0\r\n\r\n",
            ),
        ),
        (
            "TE.TE duplicate, chunked last".into(),
            post(
                "Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
                &format!("0\r\n\r\n{next}"),
            ),
        ),
        (
            "TE leading space".into(),
            post(
                "Transfer-Encoding:  chunked\r\n",
                &format!("0\r\n\r\n{next}"),
            ),
        ),
        (
            "TE tab".into(),
            post(
                "Transfer-Encoding:\tchunked\r\n",
                &format!("0\r\n\r\n{next}"),
            ),
        ),
        (
            "TE Chunked".into(),
            post(
                "Transfer-Encoding: Chunked\r\n",
                &format!("3\r\nabc\r\n0\r\n\r\n{next}"),
            ),
        ),
        (
            "TE gzip, chunked".into(),
            post(
                "Transfer-Encoding: gzip, chunked\r\n",
                &format!("3\r\nabc\r\n0\r\n\r\n{next}"),
            ),
        ),
        (
            "TE chunked, chunked".into(),
            post(
                "Transfer-Encoding: chunked, chunked\r\n",
                &format!("0\r\n\r\n{next}"),
            ),
        ),
        (
            "TE with NUL".into(),
            post("Transfer-Encoding: chunked\0\r\n", "0\r\n\r\n"),
        ),
        (
            "TE vertical tab".into(),
            post("Transfer-Encoding: \x0bchunked\r\n", "0\r\n\r\n"),
        ),
        (
            "TE obs-fold".into(),
            post("Transfer-Encoding:\r\n chunked\r\n", "0\r\n\r\n"),
        ),
        (
            "TE name with space".into(),
            post("Transfer Encoding: chunked\r\n", "0\r\n\r\n"),
        ),
        (
            "TE on HTTP/1.0".into(),
            "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".into(),
        ),
        ("CL +5".into(), post("Content-Length: +5\r\n", "hello")),
        (
            "CL leading space".into(),
            post("Content-Length:  5\r\n", &format!("hello{next}")),
        ),
        ("CL 5,5".into(), post("Content-Length: 5,5\r\n", "hello")),
        ("CL 5, 6".into(), post("Content-Length: 5, 6\r\n", "hello!")),
        ("CL 0x5".into(), post("Content-Length: 0x5\r\n", "hello")),
        (
            "CL huge".into(),
            post("Content-Length: 99999999999999999999999\r\n", "x"),
        ),
        (
            "CL u64 max".into(),
            post("Content-Length: 18446744073709551615\r\n", "x"),
        ),
        (
            "CL u64 max - 2".into(),
            post("Content-Length: 18446744073709551613\r\n", "x"),
        ),
        (
            "CL equal twice".into(),
            post(
                "Content-Length: 5\r\nContent-Length: 5\r\n",
                &format!("hello{next}"),
            ),
        ),
        ("CL empty".into(), post("Content-Length: \r\n", "")),
        (
            "CL leading zeros".into(),
            post("Content-Length: 005\r\n", &format!("hello{next}")),
        ),
        (
            "bare LF head".into(),
            format!("GET / HTTP/1.1\nHost: t\n\n{next}"),
        ),
        (
            "bare LF in a field".into(),
            "GET / HTTP/1.1\r\nHost: t\nX: y\r\n\r\n".into(),
        ),
        (
            "CR in a value".into(),
            "GET / HTTP/1.1\r\nHost: t\r\nX: a\rb\r\n\r\n".into(),
        ),
        ("leading empty lines".into(), format!("\r\n\r\n{next}")),
        (
            "chunk size leading zeros".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("0005\r\nhello\r\n000\r\n\r\n{next}"),
            ),
        ),
        (
            "chunk size 40 zeros".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("{}5\r\nhello\r\n0\r\n\r\n{next}", "0".repeat(40)),
            ),
        ),
        (
            "chunk size 0x".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                "0x5\r\nhello\r\n0\r\n\r\n",
            ),
        ),
        (
            "chunk size negative".into(),
            post("Transfer-Encoding: chunked\r\n", "-5\r\nhello\r\n0\r\n\r\n"),
        ),
        (
            "chunk size 16 digits".into(),
            post("Transfer-Encoding: chunked\r\n", "FFFFFFFFFFFFFFFF\r\nx"),
        ),
        (
            "chunk size empty".into(),
            post("Transfer-Encoding: chunked\r\n", "\r\nhello\r\n0\r\n\r\n"),
        ),
        (
            "chunk size leading space".into(),
            post("Transfer-Encoding: chunked\r\n", " 5\r\nhello\r\n0\r\n\r\n"),
        ),
        (
            "chunk size trailing space".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("5 \t \r\nhello\r\n0\r\n\r\n{next}"),
            ),
        ),
        (
            "chunk extension".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("5;a=b;c=\"d e\"\r\nhello\r\n0;x\r\n\r\n{next}"),
            ),
        ),
        (
            "chunk extension after space".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("5 ;a\r\nhello\r\n0\r\n\r\n{next}"),
            ),
        ),
        (
            "chunk extension bare LF".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                "5;a\nb\r\nhello\r\n0\r\n\r\n",
            ),
        ),
        (
            "chunk size bare LF".into(),
            post("Transfer-Encoding: chunked\r\n", "5\nhello\r\n0\r\n\r\n"),
        ),
        (
            "chunk data without CRLF".into(),
            post("Transfer-Encoding: chunked\r\n", "5\r\nhelloX\r\n0\r\n\r\n"),
        ),
        (
            "chunk data bare LF".into(),
            post("Transfer-Encoding: chunked\r\n", "5\r\nhello\n0\r\n\r\n"),
        ),
        (
            "trailers".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("5\r\nhello\r\n0\r\nX-T: 1\r\nY-T: 2\r\n\r\n{next}"),
            ),
        ),
        (
            "trailer bare LF".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("0\r\nX-T: 1\nY: 2\r\n\r\n{next}"),
            ),
        ),
        (
            "trailer bare LF then empty".into(),
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("0\r\nX-T: 1\n\r\n\r\n{next}"),
            ),
        ),
        (
            "trailer invalid".into(),
            post("Transfer-Encoding: chunked\r\n", "0\r\nX T: 1\r\n\r\n"),
        ),
        (
            "trailer CR without LF".into(),
            post("Transfer-Encoding: chunked\r\n", "0\r\nX: 1\rY\r\n\r\n"),
        ),
        (
            "missing final CRLF".into(),
            post("Transfer-Encoding: chunked\r\n", "5\r\nhello\r\n0\r\n"),
        ),
        (
            "final CR only".into(),
            post("Transfer-Encoding: chunked\r\n", "0\r\n\rX"),
        ),
        (
            "Connection: close stops".into(),
            format!("GET / HTTP/1.1\r\nConnection: close\r\n\r\n{next}"),
        ),
        (
            "HTTP/1.0 stops".into(),
            format!("GET / HTTP/1.0\r\n\r\n{next}"),
        ),
        (
            "HTTP/1.0 keep-alive".into(),
            format!("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n{next}"),
        ),
        (
            "close then keep-alive".into(),
            format!("GET / HTTP/1.0\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n{next}"),
        ),
        (
            "Expect 100-continue".into(),
            post(
                "Expect: 100-continue\r\nContent-Length: 2\r\n",
                &format!("hi{next}"),
            ),
        ),
        (
            "Upgrade (answered 200)".into(),
            format!("GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n{next}"),
        ),
        (
            "CONNECT".into(),
            "CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n".into(),
        ),
        (
            "HTTP/2.0 request line".into(),
            "GET / HTTP/2.0\r\n\r\n".into(),
        ),
        ("HTTP/1.2".into(), "GET / HTTP/1.2\r\n\r\n".into()),
        (
            "h2 preface".into(),
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".into(),
        ),
        (
            "OPTIONS *".into(),
            format!("OPTIONS * HTTP/1.1\r\n\r\n{next}"),
        ),
        (
            "target with fragment".into(),
            "GET /a#b HTTP/1.1\r\n\r\n".into(),
        ),
        (
            "target bad percent".into(),
            format!("GET /%zz HTTP/1.1\r\n\r\n{next}"),
        ),
        (
            "absolute no path".into(),
            format!("GET http://a.example HTTP/1.1\r\n\r\n{next}"),
        ),
        (
            "lowercase method".into(),
            format!("get / HTTP/1.1\r\n\r\n{next}"),
        ),
        (
            "extension method".into(),
            format!("PURGEALLTHETHINGSNOW / HTTP/1.1\r\n\r\n{next}"),
        ),
        (
            "empty header value".into(),
            format!("GET / HTTP/1.1\r\nX:\r\n\r\n{next}"),
        ),
        (
            "obs-text value".into(),
            format!("GET / HTTP/1.1\r\nX: caf\u{e9}\r\n\r\n{next}"),
        ),
        (
            "URI 8192 path".into(),
            format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(8191)),
        ),
        (
            "URI 8193 path".into(),
            format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(8192)),
        ),
        (
            "100 headers".into(),
            format!("GET / HTTP/1.1\r\n{}\r\n", "x: 1\r\n".repeat(100)),
        ),
        (
            "101 headers".into(),
            format!("GET / HTTP/1.1\r\n{}\r\n", "x: 1\r\n".repeat(101)),
        ),
        (
            "100 headers plus a repeated length".into(),
            post(
                &format!(
                    "{}Content-Length: 1\r\nContent-Length: 1\r\n",
                    "x: 1\r\n".repeat(98)
                ),
                "a",
            ),
        ),
        (
            "16 KiB of fields".into(),
            format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "v".repeat(16384 - 7)),
        ),
        (
            "16 KiB + 1 of fields".into(),
            format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "v".repeat(16384 - 6)),
        ),
        ("empty input".into(), String::new()),
        ("only CRLF".into(), "\r\n".into()),
    ];
    // Extension bytes at hyper's 16 KiB limit, just under and at it.
    let ext = |n: usize| {
        post(
            "Transfer-Encoding: chunked\r\n",
            &format!("1;{}\r\nx\r\n0\r\n\r\n", "e".repeat(n)),
        )
    };
    cases.push(("extensions 16383 bytes".into(), ext(16382)));
    cases.push(("extensions 16384 bytes".into(), ext(16384)));
    let trailer = |n: usize| {
        post(
            "Transfer-Encoding: chunked\r\n",
            &format!("0\r\nx: {}\r\n\r\n", "t".repeat(n)),
        )
    };
    cases.push(("trailers just under 16 KiB".into(), trailer(16384 - 10)));
    cases.push(("trailers at 16 KiB".into(), trailer(16384 - 9)));
    let lines = |n: usize| {
        post(
            "Transfer-Encoding: chunked\r\n",
            &format!("0\r\n{}\r\n", "t: 1\r\n".repeat(n)),
        )
    };
    cases.push(("100 trailer lines".into(), lines(100)));
    cases.push(("101 trailer lines".into(), lines(101)));
    cases
        .into_iter()
        .map(|(n, s)| (n, s.into_bytes()))
        .collect()
}

#[test]
fn named_cases_frame_as_hyper_frames_them() {
    let rt = runtime();
    for (name, input) in named_cases() {
        same(&rt, &name, &input);
    }
}

#[test]
fn the_stricter_cases_are_stricter_and_only_those() {
    // A size line of 17 KiB of zeros: hyper takes it, the codec refuses.
    let zeros = format!(
        "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{}5\r\nhello\r\n0\r\n\r\n",
        "0".repeat(17 * 1024)
    );
    let rt = runtime();
    let theirs = rt.block_on(hypers(zeros.clone().into_bytes()));
    assert_eq!(theirs.end, Ending::Clean, "{STRICTER:?}");
    assert_eq!(ours(zeros.as_bytes()).end, Ending::Refused);
    // A head of 28 KiB (over the 25 KiB read buffer) whose fields count
    // under the screen's limits: spaces around values are not counted.
    let padded = format!("GET / HTTP/1.1\r\nx: {}1\r\n\r\n", " ".repeat(28 * 1024));
    let theirs = rt.block_on(hypers(padded.clone().into_bytes()));
    assert_eq!(theirs.end, Ending::Clean, "{STRICTER:?}");
    assert_eq!(theirs.messages.len(), 1);
    assert_eq!(ours(padded.as_bytes()).end, Ending::Refused);
}

/// Fragments requests are assembled from.
fn request_strategy() -> impl Strategy<Value = Vec<u8>> {
    let line = prop::sample::select(vec![
        "GET / HTTP/1.1",
        "POST /a?b=c HTTP/1.1",
        "PUT http://a.example/x HTTP/1.1",
        "HEAD / HTTP/1.0",
        "POST / HTTP/1.0",
        "GET  / HTTP/1.1",
        "GET / HTTP/1.1 ",
        "G@T / HTTP/1.1",
        "OPTIONS * HTTP/1.1",
        "CONNECT a.example:443 HTTP/1.1",
        "GET /%7 HTTP/1.1",
        "GET / HTTP/1.3",
    ]);
    let field = prop::sample::select(vec![
        "Host: t",
        "Content-Length: 5",
        "Content-Length: 0",
        "Content-Length: 3",
        "Content-Length: +5",
        "Content-Length:  5 ",
        "Content-Length: 5,5",
        "Content-Length: 05",
        "Content-Length: 99999999999999999999",
        "Transfer-Encoding: chunked",
        "Transfer-Encoding: Chunked",
        "Transfer-Encoding: xchunked",
        "Transfer-Encoding:  chunked",
        "Transfer-Encoding: chunked, identity",
        "Transfer-Encoding: gzip, chunked",
        "Transfer-Encoding: identity",
        "Transfer-Encoding : chunked",
        "Transfer-Encoding:\r\n chunked",
        "Connection: close",
        "Connection: keep-alive",
        "Connection: Upgrade",
        "Upgrade: websocket",
        "Expect: 100-continue",
        "X-A: a\0b",
        "X-A: a\rb",
        "X-A: \u{e9}",
        "X-A:",
        "X-A b: c",
        "Trailer: X-T",
    ]);
    let body = prop::sample::select(vec![
        "",
        "hello",
        "abc",
        "0\r\n\r\n",
        "5\r\nhello\r\n0\r\n\r\n",
        "5;e=1\r\nhello\r\n0\r\n\r\n",
        "05\r\nhello\r\n00\r\n\r\n",
        "5 \r\nhello\r\n0\r\n\r\n",
        "0x5\r\nhello\r\n0\r\n\r\n",
        "-5\r\nhello\r\n0\r\n\r\n",
        "FFFFFFFFFFFFFFFFFF\r\nx\r\n",
        "5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
        "5\r\nhello\r\n0\r\nX-T: 1\n\r\n\r\n",
        "5\r\nhello\r\n0\r\n",
        "5\r\nhelloXX0\r\n\r\n",
        "5;a\nb\r\nhello\r\n0\r\n\r\n",
        "3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        "SMUGGLED",
    ]);
    let eol = prop::sample::select(vec!["\r\n", "\r\n", "\r\n", "\n"]);
    let message = (
        line,
        prop::collection::vec((field, eol.clone()), 0..6),
        eol,
        body,
    )
        .prop_map(|(line, fields, end, body)| {
            let mut m = format!("{line}\r\n");
            for (f, e) in fields {
                m.push_str(f);
                m.push_str(e);
            }
            m.push_str(end);
            m.push_str(body);
            m
        });
    (prop::collection::vec(message, 1..4), any::<u8>()).prop_map(|(ms, cut)| {
        let mut all = ms.concat().into_bytes();
        // Sometimes the client stops early.
        if cut < 32 && !all.is_empty() {
            all.truncate(all.len() * usize::from(cut) / 32);
        }
        all
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
    #[test]
    fn generated_requests_frame_as_hyper_frames_them(input in request_strategy()) {
        let rt = runtime();
        let theirs = rt.block_on(hypers(input.clone()));
        prop_assert_eq!(ours(&input), theirs, "{:?}", String::from_utf8_lossy(&input));
    }
}

fn same_response(rt: &tokio::runtime::Runtime, input: &[u8], method: &Method) {
    let theirs = rt.block_on(hyper_response(input.to_vec(), method.clone()));
    let mine = our_response(input, method);
    assert_eq!(
        mine,
        theirs,
        "{method}: codec (left) and hyper (right) differ on {:?}",
        String::from_utf8_lossy(input)
    );
}

#[test]
fn named_responses_frame_as_hyper_frames_them() {
    let rt = runtime();
    let cases: &[(&str, &str)] = &[
        ("GET", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
        ("GET", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel"),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\nhello",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello!",
        ),
        ("GET", "HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello"),
        ("GET", "HTTP/1.1 200 OK\r\nContent-Length: \r\n\r\nhello"),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX: y\r\n\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nraw to the end",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\nraw",
        ),
        (
            "GET",
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
        ("GET", "HTTP/1.0 200 OK\r\n\r\nto the end"),
        ("GET", "HTTP/1.1 200 OK\r\n\r\nto the end"),
        (
            "GET",
            "HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
        ),
        ("HEAD", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),
        ("HEAD", "HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"),
        ("CONNECT", "HTTP/1.1 200 Connection Established\r\n\r\n"),
        (
            "CONNECT",
            "HTTP/1.1 407 Auth\r\nContent-Length: 2\r\n\r\nno",
        ),
        (
            "GET",
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        ),
        (
            "GET",
            "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
        ),
        ("GET", "HTTP/1.1 999 Odd\r\nContent-Length: 0\r\n\r\n"),
        ("GET", "HTTP/1.1 099 Low\r\nContent-Length: 0\r\n\r\n"),
        ("GET", "HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n"),
        ("GET", "HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n"),
        ("GET", "HTTP/2 200 OK\r\n\r\n"),
        ("GET", "HTTP/1.1 200 OK\nContent-Length: 2\n\nok"),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 0\r\n\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nX : a\r\nContent-Length: 0\r\n\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZ\r\n",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551615\r\n\r\nx",
        ),
        (
            "GET",
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        ),
        ("GET", ""),
        ("GET", "HTTP/1.1 200 OK\r\n"),
    ];
    for (method, input) in cases {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        same_response(&rt, input.as_bytes(), &method);
    }
}

fn response_strategy() -> impl Strategy<Value = (Vec<u8>, Method)> {
    let status = prop::sample::select(vec![
        "HTTP/1.1 200 OK",
        "HTTP/1.0 200 OK",
        "HTTP/1.1 204 No Content",
        "HTTP/1.1 304 Not Modified",
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK",
        "HTTP/1.1 101 Switching Protocols",
        "HTTP/1.1 404",
        "HTTP/1.1 000 Zero",
        "HTTP/1.2 200 OK",
        "HTTP/1.1 2000 OK",
    ]);
    let field = prop::sample::select(vec![
        "Content-Length: 5",
        "Content-Length: 0",
        "Content-Length: 5, 5",
        "Content-Length: 5,6",
        "Content-Length: -5",
        "Transfer-Encoding: chunked",
        "Transfer-Encoding: CHUNKED",
        "Transfer-Encoding: gzip",
        "Transfer-Encoding: chunked, gzip",
        "Connection: close",
        "Connection: keep-alive",
        "X-A: a\0b",
        "X-A:",
        "Trailer: X-T",
    ]);
    let body = prop::sample::select(vec![
        "",
        "hello",
        "hel",
        "5\r\nhello\r\n0\r\n\r\n",
        "5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
        "05;x\r\nhello\r\n0\r\n\r\n",
        "5\r\nhello\r\n",
        "G\r\n",
    ]);
    let method = prop::sample::select(vec![
        Method::GET,
        Method::HEAD,
        Method::CONNECT,
        Method::POST,
    ]);
    (status, prop::collection::vec(field, 0..4), body, method).prop_map(|(s, fs, b, m)| {
        let mut r = format!("{s}\r\n");
        for f in fs {
            r.push_str(f);
            r.push_str("\r\n");
        }
        r.push_str("\r\n");
        r.push_str(b);
        (r.into_bytes(), m)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]
    #[test]
    fn generated_responses_frame_as_hyper_frames_them((input, method) in response_strategy()) {
        let rt = runtime();
        let theirs = rt.block_on(hyper_response(input.clone(), method.clone()));
        prop_assert_eq!(our_response(&input, &method), theirs, "{} {:?}", method, String::from_utf8_lossy(&input));
    }
}

/// The fuzz corpora's inputs (`fuzz/corpus/<target>/`, or
/// `$MESHLESS_H1_CORPUS/<target>/` to run a fuzzer's whole working corpus),
/// first byte split off as the fuzz targets split it.
fn corpus(target: &str) -> Vec<(String, u8, Vec<u8>)> {
    let base = std::env::var_os("MESHLESS_H1_CORPUS").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus"),
        std::path::PathBuf::from,
    );
    let dir = base.join(target);
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        if let Some((&pick, rest)) = bytes.split_first() {
            out.push((path.display().to_string(), pick, rest.to_vec()));
        }
    }
    out.sort();
    out
}

#[test]
fn the_fuzz_corpus_frames_as_hyper_frames_it() {
    let rt = runtime();
    for (name, pick, input) in corpus("h1_request") {
        let limits = meshless_h1::check::fuzz_limits(pick);
        let theirs = rt.block_on(hypers_with(input.clone(), limits));
        let mine = ours_with(&input, &limits);
        assert_eq!(
            mine,
            theirs,
            "{name}: {:?}",
            String::from_utf8_lossy(&input)
        );
    }
    for (_, pick, input) in corpus("h1_response") {
        let method = [Method::GET, Method::HEAD, Method::CONNECT, Method::POST]
            [usize::from(pick % 4)]
        .clone();
        same_response(&rt, &input, &method);
    }
}
