//! Where a message body ends (RFC 9112 section 6), decided from the head's
//! fields exactly as hyper 1 decides it — the differential test
//! (`tests/differential.rs`) holds the two to the same answer — plus what
//! else the head asks of the connection: keep-alive, `Expect:
//! 100-continue`, an upgrade.
//!
//! Requests (hyper's `role::Server::parse`), fields in wire order:
//! - `Transfer-Encoding` on HTTP/1.0 is refused. On HTTP/1.1 each
//!   `Transfer-Encoding` line replaces the verdict of the one before: the
//!   body is chunked when the *last* line's last coding is `chunked`
//!   (case-insensitive, spaces trimmed); any other last coding is refused.
//! - `Content-Length` is digits only (no sign, no spaces inside, no list:
//!   `5,5` is refused). Several lines must agree; only the first is kept.
//!   Before a `Transfer-Encoding` each must be valid; after one, any value
//!   is ignored.
//! - Both together: the body is chunked, every `Content-Length` is dropped
//!   from the forwarded head, and the connection closes after the message.
//! - Neither: no body.
//!
//! Responses (hyper's `role::Client::decoder`): `101` and a `2xx` to
//! `CONNECT` are upgrades with no body; other `1xx`, `204`, `304` and a
//! response to `HEAD` have none (their length fields are not read); any
//! `Transfer-Encoding` on HTTP/1.0 is refused, else chunked when the last
//! line's last coding is `chunked`, else read to the close; otherwise the
//! `Content-Length` values (comma lists allowed here) must all agree;
//! with neither, read to the close.

use http::{Method, StatusCode, Version};
use httparse::Header;

use crate::error::Error;

/// hyper's largest body length (`DecodedLength::MAX_LEN`); a
/// `Content-Length` above it is refused.
const MAX_LEN: u64 = u64::MAX - 2;

/// How a message's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// No body: the next message starts right after the head.
    Empty,
    /// Exactly this many bytes (never 0: that is `Empty`).
    Length(u64),
    /// The chunked coding, decoded by [`crate::chunked::Decoder`].
    Chunked,
    /// Everything until the connection closes (responses only).
    CloseDelimited,
}

/// Which `Content-Length` lines the forwarded head keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepLength {
    /// Every line (responses: hyper forwards them as they came).
    All,
    /// The first only (requests: repeats that agree are dropped).
    First,
    /// None (a chunked request that also had one).
    None,
}

/// The framing decision for one message head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    /// Where the body ends.
    pub body: Body,
    /// Whether the connection may carry another message after this one.
    pub keep_alive: bool,
    /// A request with a body asked for `100 Continue` (HTTP/1.1 only).
    pub expect_continue: bool,
    /// A request that asks to upgrade (`Upgrade` on HTTP/1.1, or
    /// `CONNECT`), or a response that upgrades (`101`, `2xx` to
    /// `CONNECT`). The serving path hands these to hyper.
    pub upgrade: bool,
    /// A `1xx` response other than `101`: another head follows.
    pub informational: bool,
    /// Which `Content-Length` lines to forward.
    pub keep_length: KeepLength,
}

impl Framing {
    /// The header fields to forward: all but the `Content-Length` lines
    /// the decision dropped.
    pub fn forwarded<'a, 'b>(
        &self,
        headers: &'a [Header<'b>],
    ) -> impl Iterator<Item = &'a Header<'b>> + 'a {
        let keep = self.keep_length;
        let mut seen = false;
        headers.iter().filter(move |h| {
            if !h.name.eq_ignore_ascii_case("content-length") {
                return true;
            }
            let first = !seen;
            seen = true;
            match keep {
                KeepLength::All => true,
                KeepLength::First => first,
                KeepLength::None => false,
            }
        })
    }
}

/// The framing of a request with `version`, `method` and `headers`.
pub fn request(
    version: Version,
    method: &Method,
    headers: &[Header<'_>],
) -> Result<Framing, Error> {
    let http11 = version == Version::HTTP_11;
    let mut keep_alive = http11;
    let mut saw_close = false;
    let (mut is_te, mut is_te_chunked, mut is_cl) = (false, false, false);
    let mut length: Option<u64> = None;
    let mut expect_continue = false;
    let mut upgrade = method == Method::CONNECT;
    for h in headers {
        let name = h.name;
        if name.eq_ignore_ascii_case("transfer-encoding") {
            if !http11 {
                return Err(Error::TransferEncoding);
            }
            is_te = true;
            length = None;
            is_te_chunked = last_coding_is_chunked(h.value);
        } else if name.eq_ignore_ascii_case("content-length") {
            is_cl = true;
            if is_te {
                continue;
            }
            let n = digits(h.value).ok_or(Error::ContentLength)?;
            match length {
                Some(prev) if prev != n => return Err(Error::ContentLength),
                Some(_) => {}
                None if n > MAX_LEN => return Err(Error::HeadTooLarge),
                None => length = Some(n),
            }
        } else if name.eq_ignore_ascii_case("connection") {
            connection(h.value, &mut keep_alive, &mut saw_close);
        } else if name.eq_ignore_ascii_case("expect") {
            expect_continue = h.value.eq_ignore_ascii_case(b"100-continue");
        } else if name.eq_ignore_ascii_case("upgrade") {
            upgrade = http11;
        }
    }
    if is_te && !is_te_chunked {
        return Err(Error::TransferEncoding);
    }
    let body = if is_te {
        Body::Chunked
    } else {
        match length {
            Some(0) | None => Body::Empty,
            Some(n) => Body::Length(n),
        }
    };
    Ok(Framing {
        body,
        keep_alive: keep_alive && !(is_te && is_cl),
        // hyper ignores the expectation of a message with no body, and
        // of HTTP/1.0.
        expect_continue: expect_continue && http11 && body != Body::Empty,
        upgrade,
        informational: false,
        keep_length: if is_te {
            KeepLength::None
        } else {
            KeepLength::First
        },
    })
}

/// The framing of a response with `version`, `status` and `headers` to a
/// request with `method`.
pub fn response(
    version: Version,
    status: StatusCode,
    method: &Method,
    headers: &[Header<'_>],
) -> Result<Framing, Error> {
    let mut keep_alive = version == Version::HTTP_11;
    let mut saw_close = false;
    // One pass over the fields (this runs for every response): the
    // `Connection` lines, the last `Transfer-Encoding` line, and the
    // `Content-Length` lines folded as they come, their verdict used only
    // when the status and the encoding leave the length to decide.
    let mut last_te: Option<&[u8]> = None;
    let mut length = Ok(None);
    for h in headers {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            length = length.and_then(|l| response_length(l, h.value));
        } else if name.eq_ignore_ascii_case("connection") {
            connection(h.value, &mut keep_alive, &mut saw_close);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            last_te = Some(h.value);
        }
    }
    let framing = |body: Body, upgrade: bool, informational: bool| Framing {
        body,
        keep_alive: keep_alive && !upgrade && body != Body::CloseDelimited,
        expect_continue: false,
        upgrade,
        informational,
        keep_length: KeepLength::All,
    };
    let code = status.as_u16();
    match code {
        101 => return Ok(framing(Body::Empty, true, false)),
        100..=199 => return Ok(framing(Body::Empty, false, true)),
        204 | 304 => return Ok(framing(Body::Empty, false, false)),
        _ => {}
    }
    if method == Method::HEAD {
        return Ok(framing(Body::Empty, false, false));
    }
    if method == Method::CONNECT && (200..300).contains(&code) {
        return Ok(framing(Body::Empty, true, false));
    }
    if let Some(last_te) = last_te {
        if version == Version::HTTP_10 {
            return Err(Error::TransferEncoding);
        }
        let body = if last_coding_is_chunked(last_te) {
            Body::Chunked
        } else {
            Body::CloseDelimited
        };
        return Ok(framing(body, false, false));
    }
    let body = match length? {
        Some(n) if n > MAX_LEN => return Err(Error::HeadTooLarge),
        Some(0) => Body::Empty,
        Some(n) => Body::Length(n),
        None => Body::CloseDelimited,
    };
    Ok(framing(body, false, false))
}

/// Folds one `Content-Length` line of a response into the length of the
/// lines before it (`None`: no line yet): each a comma list of digits,
/// all agreeing (hyper's `content_length_parse_all`).
fn response_length(before: Option<u64>, value: &[u8]) -> Result<Option<u64>, Error> {
    let agree = |length: Option<u64>, n: u64| match length {
        Some(prev) if prev != n => Err(Error::ContentLength),
        _ => Ok(Some(n)),
    };
    // Nearly every line is one number: no split, no trim.
    if let Some(n) = digits(value) {
        return agree(before, n);
    }
    let line = visible(value).ok_or(Error::ContentLength)?;
    let mut length = before;
    for item in line.split(',') {
        let n = digits(item.trim().as_bytes()).ok_or(Error::ContentLength)?;
        length = agree(length, n)?;
    }
    Ok(length)
}

/// One `Connection` line: `close` anywhere closes for good; on HTTP/1.0
/// `keep-alive` keeps the connection open (until a `close`).
fn connection(value: &[u8], keep_alive: &mut bool, saw_close: &mut bool) {
    if *saw_close || has_token(value, "close") {
        *saw_close = true;
        *keep_alive = false;
    } else if !*keep_alive {
        *keep_alive = has_token(value, "keep-alive");
    }
}

/// The value as text when every byte is visible ASCII or a tab (what
/// `HeaderValue::to_str` accepts); values with other bytes carry no token.
fn visible(value: &[u8]) -> Option<&str> {
    if value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
    {
        std::str::from_utf8(value).ok()
    } else {
        None
    }
}

/// Whether the comma list `value` holds `token` (ASCII, compared
/// case-insensitively), items trimmed of spaces and tabs. A value with a
/// byte other than visible ASCII or tab holds no token, as
/// `HeaderValue::to_str` (which hyper reads these lists with) refuses it.
/// On bytes, with no UTF-8 check and no `str` searcher: every response
/// runs it on its `Connection` line.
pub fn has_token(value: &[u8], token: &str) -> bool {
    let token = token.as_bytes();
    value
        .split(|&b| b == b',')
        .any(|item| item.trim_ascii().eq_ignore_ascii_case(token))
        && value
            .iter()
            .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
}

/// Whether the last coding of a `Transfer-Encoding` line is `chunked`, as
/// hyper decides it: only over visible ASCII (and tab), so a line with any
/// other byte is not chunked.
pub fn last_coding_is_chunked(value: &[u8]) -> bool {
    visible(value)
        .and_then(|s| s.rsplit(',').next())
        .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"))
}

/// A decimal length: one or more ASCII digits, nothing else, no overflow.
pub(crate) fn digits(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() {
        return None;
    }
    bytes.iter().try_fold(0u64, |n, &b| {
        if b.is_ascii_digit() {
            n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `has_token` as `str` methods say it, over the text `HeaderValue::to_str`
    /// accepts (visible ASCII and tab).
    fn has_token_by_str(value: &[u8], token: &str) -> bool {
        visible(value).is_some_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    }

    #[test]
    fn a_token_is_found_in_any_item_whatever_its_case_and_spacing() {
        for (value, token, found) in [
            (&b"close"[..], "close", true),
            (b"Keep-Alive", "keep-alive", true),
            (b"keep-alive, Upgrade", "upgrade", true),
            (b" \tCLOSE\t ", "close", true),
            (b"foo,,close,", "close", true),
            (b"closed", "close", false),
            (b"clo se", "close", false),
            (b"", "close", false),
            (b",", "close", false),
            // Not text `to_str` accepts: no token at all.
            (b"close, \xc3\xa9", "close", false),
            (b"close\x0b", "close", false),
            (b"close,\x7f", "close", false),
        ] {
            assert_eq!(has_token(value, token), found, "{value:?} {token}");
            assert_eq!(has_token_by_str(value, token), found, "{value:?} {token}");
        }
    }

    proptest::proptest! {
        /// The byte scan answers as the `str` definition does, on lists
        /// of tokens, spaces, tabs and commas and on any bytes.
        #[test]
        fn has_token_agrees_with_its_str_definition(
            items in proptest::collection::vec("[ \t]{0,2}(close|keep-alive|Close|CLOSE|upgrade|clos|closes|x)[ \t]{0,2}", 0..5),
            noise in proptest::collection::vec(proptest::num::u8::ANY, 0..12),
            token in "(close|keep-alive|upgrade)",
        ) {
            let list = items.join(",");
            proptest::prop_assert_eq!(has_token(list.as_bytes(), &token), has_token_by_str(list.as_bytes(), &token));
            proptest::prop_assert_eq!(has_token(&noise, &token), has_token_by_str(&noise, &token));
            let mut mixed = list.into_bytes();
            mixed.extend_from_slice(&noise);
            proptest::prop_assert_eq!(has_token(&mixed, &token), has_token_by_str(&mixed, &token));
        }
    }

    fn h<'a>(name: &'a str, value: &'a str) -> Header<'a> {
        Header {
            name,
            value: value.as_bytes(),
        }
    }

    fn req(headers: &[Header<'_>]) -> Result<Framing, Error> {
        request(Version::HTTP_11, &Method::POST, headers)
    }

    #[test]
    fn transfer_encoding_wins_over_length_and_closes() {
        let f = req(&[h("content-length", "4"), h("transfer-encoding", "chunked")]);
        let f = f.expect("framed");
        assert_eq!(f.body, Body::Chunked);
        assert!(!f.keep_alive);
        let hs = [h("content-length", "4"), h("transfer-encoding", "chunked")];
        assert_eq!(f.forwarded(&hs).count(), 1);
        // A bad length after the encoding is never read.
        let f = req(&[h("transfer-encoding", "chunked"), h("content-length", "x")]);
        assert_eq!(f.map(|f| f.body), Ok(Body::Chunked));
        // Before it, it is.
        let f = req(&[h("content-length", "x"), h("transfer-encoding", "chunked")]);
        assert_eq!(f, Err(Error::ContentLength));
    }

    #[test]
    fn only_a_final_chunked_frames_a_request() {
        for ok in ["chunked", "Chunked", "gzip, chunked", "gzip,chunked "] {
            assert_eq!(
                req(&[h("transfer-encoding", ok)]).map(|f| f.body),
                Ok(Body::Chunked),
                "{ok}"
            );
        }
        for bad in [
            "xchunked",
            "chunked, identity",
            "identity",
            "",
            "chunked;q=1",
        ] {
            assert_eq!(
                req(&[h("transfer-encoding", bad)]),
                Err(Error::TransferEncoding),
                "{bad}"
            );
        }
        // The last line decides.
        let two = [
            h("transfer-encoding", "chunked"),
            h("transfer-encoding", "gzip"),
        ];
        assert_eq!(req(&two), Err(Error::TransferEncoding));
        let two = [
            h("transfer-encoding", "gzip"),
            h("transfer-encoding", "chunked"),
        ];
        assert_eq!(req(&two).map(|f| f.body), Ok(Body::Chunked));
        let te10 = request(
            Version::HTTP_10,
            &Method::POST,
            &[h("transfer-encoding", "chunked")],
        );
        assert_eq!(te10, Err(Error::TransferEncoding));
    }

    /// A response's lengths: comma lists, every item of every line
    /// agreeing (within a line too), the first error in field order, and
    /// none of it read when the status or an encoding decides.
    #[test]
    fn response_lengths_agree_within_and_across_lines() {
        let resp = |fields: &[Header<'_>]| {
            response(Version::HTTP_11, StatusCode::OK, &Method::GET, fields).map(|f| f.body)
        };
        let cl = |v| h("content-length", v);
        assert_eq!(resp(&[cl("5")]), Ok(Body::Length(5)));
        assert_eq!(resp(&[cl("5, 5"), cl("5")]), Ok(Body::Length(5)));
        assert_eq!(resp(&[cl(" 5 ,5")]), Ok(Body::Length(5)));
        assert_eq!(resp(&[cl("0")]), Ok(Body::Empty));
        for bad in [
            &[cl("5, 6")][..],
            &[cl("5"), cl("6")],
            &[cl("5"), cl("5,6")],
            &[cl("6,5"), cl("5")],
        ] {
            assert_eq!(resp(bad), Err(Error::ContentLength), "{bad:?}");
        }
        assert_eq!(
            resp(&[cl("x"), cl("18446744073709551615")]),
            Err(Error::ContentLength)
        );
        assert_eq!(
            resp(&[cl("18446744073709551615")]),
            Err(Error::HeadTooLarge)
        );
        // An encoding decides, and a bad length is never read.
        let te = [cl("x"), h("transfer-encoding", "chunked")];
        assert_eq!(resp(&te), Ok(Body::Chunked));
        let no_content = response(
            Version::HTTP_11,
            StatusCode::NO_CONTENT,
            &Method::GET,
            &[cl("x")],
        );
        assert_eq!(no_content.map(|f| f.body), Ok(Body::Empty));
    }

    #[test]
    fn lengths_are_digits_and_agree() {
        for bad in ["+5", "-1", "5,5", "0x5", " ", "5 5", "99999999999999999999"] {
            assert_eq!(
                req(&[h("content-length", bad)]),
                Err(Error::ContentLength),
                "{bad}"
            );
        }
        let two = [h("content-length", "5"), h("content-length", "5")];
        let f = req(&two).expect("agree");
        assert_eq!(f.body, Body::Length(5));
        assert_eq!(f.forwarded(&two).count(), 1);
        let two = [h("content-length", "5"), h("content-length", "6")];
        assert_eq!(req(&two), Err(Error::ContentLength));
        assert_eq!(
            req(&[h("content-length", "0")]).map(|f| f.body),
            Ok(Body::Empty)
        );
    }

    #[test]
    fn keep_alive_follows_version_and_connection() {
        let close = req(&[h("connection", "keep-alive, Close")]).expect("ok");
        assert!(!close.keep_alive);
        let later = req(&[h("connection", "close"), h("connection", "keep-alive")]);
        assert!(!later.expect("ok").keep_alive);
        let old = request(Version::HTTP_10, &Method::GET, &[]).expect("ok");
        assert!(!old.keep_alive);
        let old = request(
            Version::HTTP_10,
            &Method::GET,
            &[h("connection", "keep-alive")],
        );
        assert!(old.expect("ok").keep_alive);
    }

    #[test]
    fn responses_without_a_body() {
        let get = Method::GET;
        let te = [h("transfer-encoding", "chunked")];
        for code in [204, 304] {
            let s = StatusCode::from_u16(code).expect("code");
            assert_eq!(
                response(Version::HTTP_11, s, &get, &te).map(|f| f.body),
                Ok(Body::Empty)
            );
        }
        let head = response(Version::HTTP_11, StatusCode::OK, &Method::HEAD, &te);
        assert_eq!(head.map(|f| f.body), Ok(Body::Empty));
        let tunnel = response(Version::HTTP_11, StatusCode::OK, &Method::CONNECT, &[]).expect("ok");
        assert!(tunnel.upgrade && !tunnel.keep_alive);
        let cont = response(Version::HTTP_11, StatusCode::CONTINUE, &get, &[]).expect("ok");
        assert!(cont.informational);
        let eof = response(Version::HTTP_11, StatusCode::OK, &get, &[]).expect("ok");
        assert_eq!(eof.body, Body::CloseDelimited);
        assert!(!eof.keep_alive);
        let list = [h("content-length", "5, 5"), h("content-length", "5")];
        let n = response(Version::HTTP_11, StatusCode::OK, &get, &list);
        assert_eq!(n.map(|f| f.body), Ok(Body::Length(5)));
    }
}
