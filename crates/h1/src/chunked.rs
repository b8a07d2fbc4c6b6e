//! An incremental decoder of the chunked transfer coding (RFC 9112 7.1)
//! that accepts and refuses what hyper 1's decoder does.
//!
//! It reads from whatever part of the body the caller has buffered and
//! yields the data as ranges of that input (zero-copy); it holds no buffer
//! and allocates nothing per chunk. Size lines go to
//! `httparse::parse_chunk_size`, with hyper's extra rules around it: the
//! line starts with a hex digit, leading zeros are not digits that count
//! toward httparse's 16, no bare LF in an extension, at most 16 KiB of
//! extension bytes in the whole body. The trailer section is found as
//! hyper finds it (lines end in CRLF, a bare LF stays inside a line),
//! bounded (16 KiB, `max_trailers` lines), and its fields parsed by
//! `httparse::parse_headers`.
//!
//! Stricter than hyper on purpose: a size line longer than
//! [`MAX_SIZE_LINE`] (hyper takes any number of leading zeros or spaces).
//!
//! Linear however the bytes arrive: a size line or trailer section that
//! comes a byte per read is scanned on from where the last call stopped,
//! not from its start. httparse reads a size line once it has ended (or
//! while it is at most [`EAGER_LINE`] bytes, so a line that cannot be a
//! size is refused as soon as hyper refuses it); a longer line with a bad
//! byte is refused when it ends or reaches [`MAX_SIZE_LINE`].

use std::ops::Range;

use crate::error::Error;

/// hyper's limit on the extension bytes of a whole body.
const MAX_EXTENSION_BYTES: u64 = 16 * 1024;

/// hyper's limit on the bytes of the trailer section (`TRAILER_LIMIT`).
pub const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// The longest size line taken: room for the extension limit, 16 digits
/// and some spaces.
pub const MAX_SIZE_LINE: usize = MAX_EXTENSION_BYTES as usize + 64;

/// A size line is given to httparse on every call while it is at most
/// this long (without its leading zeros); longer, only once it has ended.
pub const EAGER_LINE: usize = 64;

/// What one [`Decoder::decode`] call found at the start of its input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// `input[range]` is body data; `range.end` bytes are consumed.
    Data(Range<usize>),
    /// More input is needed; `consumed` bytes (framing only) are used up.
    Incomplete { consumed: usize },
    /// The body ended after `consumed` bytes; `input[trailers]` is its
    /// trailer section with the final empty line (an empty range when
    /// there are no trailers; see [`parse_trailers`]).
    Done {
        consumed: usize,
        trailers: Range<usize>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a size line.
    Size,
    /// Inside a chunk's data, this many bytes to go.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailers or the final CRLF.
    Trailers,
    /// The body is complete.
    Done,
}

/// The state of one chunked body between calls (a few words; no buffer).
#[derive(Debug, Clone)]
pub struct Decoder {
    state: State,
    extension_bytes: u64,
    max_trailers: usize,
    scan: Scan,
    /// Input bytes looked at, for the tests of linearity.
    #[cfg(test)]
    examined: u64,
}

/// How far the line being read (a size line, or the trailer section) has
/// been scanned: the next call goes on from there. The caller gives the
/// line again from its start (`Step::Incomplete` consumes none of it).
#[derive(Debug, Clone, Copy, Default)]
struct Scan {
    /// Bytes from the line's start looked at without finding its end.
    seen: usize,
    /// Size line: its leading zeros counted so far; final once `zeros_done`.
    zeros: usize,
    zeros_done: bool,
    /// Trailer section: the state after `seen` bytes, and its lines.
    trailer: Trailer,
    lines: usize,
}

impl Decoder {
    /// A decoder for a body whose trailer section may hold up to
    /// `max_trailers` fields (hyper: its `max_headers`, default 100).
    pub fn new(max_trailers: usize) -> Self {
        Self {
            state: State::Size,
            extension_bytes: 0,
            max_trailers,
            scan: Scan::default(),
            #[cfg(test)]
            examined: 0,
        }
    }

    /// Counts `n` input bytes looked at (tests only).
    fn examine(&mut self, n: usize) {
        #[cfg(test)]
        {
            self.examined += n as u64;
        }
        let _ = n;
    }

    /// Whether the whole body has been decoded.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Decodes from the start of `input` (the body bytes not yet
    /// consumed) up to the first data, the end of the body, or the end of
    /// the input. Call again with `input[consumed..]` and more bytes.
    pub fn decode(&mut self, input: &[u8]) -> Result<Step, Error> {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            match self.state {
                State::Done => {
                    return Ok(Step::Done {
                        consumed: pos,
                        trailers: pos..pos,
                    });
                }
                State::Size => match self.size_line(rest)? {
                    None => return Ok(Step::Incomplete { consumed: pos }),
                    Some((used, 0)) => {
                        pos += used;
                        self.state = State::Trailers;
                    }
                    Some((used, size)) => {
                        pos += used;
                        self.state = State::Data(size);
                    }
                },
                State::Data(left) => {
                    if rest.is_empty() {
                        return Ok(Step::Incomplete { consumed: pos });
                    }
                    let take = usize::try_from(left).map_or(rest.len(), |l| l.min(rest.len()));
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        State::DataEnd
                    } else {
                        State::Data(left)
                    };
                    return Ok(Step::Data(pos..pos + take));
                }
                State::DataEnd => match crlf(rest, "chunk data CRLF")? {
                    None => return Ok(Step::Incomplete { consumed: pos }),
                    Some(()) => {
                        pos += 2;
                        self.state = State::Size;
                    }
                },
                State::Trailers => {
                    return match self.trailer_section(rest)? {
                        None => Ok(Step::Incomplete { consumed: pos }),
                        Some((used, fields)) => {
                            self.state = State::Done;
                            Ok(Step::Done {
                                consumed: pos + used,
                                trailers: pos + fields.start..pos + fields.end,
                            })
                        }
                    };
                }
            }
        }
    }

    /// The size line at the start of `rest`: `(bytes, size)`, or `None`
    /// until it is complete. Each byte is scanned once across calls
    /// ([`Scan`]); httparse reads the line when it has ended, or while it
    /// is short.
    fn size_line(&mut self, rest: &[u8]) -> Result<Option<(usize, u64)>, Error> {
        let Some(&first) = rest.first() else {
            return Ok(None);
        };
        if !first.is_ascii_hexdigit() {
            return Err(Error::Chunked("size line must start with a hex digit"));
        }
        // Leading zeros do not change the size; httparse counts them as
        // digits (at most 16), hyper does not.
        // Bounded: a line of zeros alone can be too long.
        if !self.scan.zeros_done {
            let from = self.scan.zeros.min(rest.len());
            let more = rest[from..]
                .iter()
                .take(MAX_SIZE_LINE - from)
                .take_while(|&&b| b == b'0')
                .count();
            self.examine(more + 1);
            self.scan.zeros = from + more;
            if self.scan.zeros == MAX_SIZE_LINE {
                return Err(Error::Chunked("size line too long"));
            }
            self.scan.zeros_done = self.scan.zeros < rest.len();
        }
        let zeros = self.scan.zeros;
        // The line's end (CR, or a bare LF), searched on from where the
        // last call stopped.
        let from = self.scan.seen.max(zeros).min(rest.len());
        let upto = rest.len().min(MAX_SIZE_LINE).max(from);
        let end = rest[from..upto]
            .iter()
            .position(|&b| b == b'\r' || b == b'\n');
        self.examine(upto - from);
        self.scan.seen = end.map_or(upto, |i| from + i);
        let line = &rest[zeros..];
        if end.is_none() && line.len() > EAGER_LINE {
            return if rest.len() >= MAX_SIZE_LINE {
                Err(Error::Chunked("size line too long"))
            } else {
                Ok(None)
            };
        }
        self.examine(line.len());
        match httparse::parse_chunk_size(line) {
            Ok(httparse::Status::Complete((used, _))) if zeros + used > MAX_SIZE_LINE => {
                Err(Error::Chunked("size line too long"))
            }
            Ok(httparse::Status::Complete((used, size))) => {
                let text = &line[..used - 2];
                if text.contains(&b'\n') {
                    return Err(Error::Chunked("bare LF in a chunk extension"));
                }
                self.count_extension(text)?;
                self.scan = Scan::default();
                Ok(Some((zeros + used, size)))
            }
            Ok(httparse::Status::Partial) => {
                if rest.len() >= MAX_SIZE_LINE || line.contains(&b'\n') {
                    Err(Error::Chunked("size line too long or bare LF"))
                } else {
                    Ok(None)
                }
            }
            Err(httparse::InvalidChunkSize) => Err(Error::Chunked("invalid size line")),
        }
    }

    /// The trailer section at the start of `rest` (after the last chunk's
    /// size line): `(bytes used, range of the section)`, or `None` until
    /// complete. hyper's state machine: lines end in CRLF (a bare LF stays
    /// inside its line), the section in an empty line; at most
    /// `max_trailers` lines, fewer than [`MAX_TRAILER_BYTES`] bytes. Goes
    /// on from where the last call stopped ([`Scan`]).
    fn trailer_section(&mut self, rest: &[u8]) -> Result<Option<(usize, Range<usize>)>, Error> {
        if self.scan.seen == 0 && rest.first() == Some(&b'\r') {
            return Ok(crlf(rest, "final CRLF")?.map(|()| (2, 0..0)));
        }
        let (mut state, mut lines) = (self.scan.trailer, self.scan.lines);
        let from = self.scan.seen.min(rest.len());
        self.examine(rest.len() - from);
        for (i, &b) in rest.iter().enumerate().skip(from) {
            if i + 1 >= MAX_TRAILER_BYTES {
                return Err(Error::Chunked("trailers over 16 KiB"));
            }
            state = match (state, b) {
                (Trailer::Line, b'\r') => Trailer::Lf,
                (Trailer::Line, _) => Trailer::Line,
                (Trailer::Lf, b'\n') if lines < self.max_trailers => {
                    lines += 1;
                    Trailer::EndCr
                }
                (Trailer::Lf, _) => return Err(Error::Chunked("trailer line end or count")),
                (Trailer::EndCr, b'\r') => Trailer::EndLf,
                (Trailer::EndCr, _) => Trailer::Line,
                (Trailer::EndLf, b'\n') => {
                    let section = &rest[..=i];
                    self.examine(section.len());
                    check_trailers(section, lines)?;
                    self.scan = Scan::default();
                    return Ok(Some((i + 1, 0..i + 1)));
                }
                (Trailer::EndLf, _) => return Err(Error::Chunked("final CRLF")),
            };
        }
        self.scan.seen = rest.len();
        self.scan.trailer = state;
        self.scan.lines = lines;
        Ok(None)
    }

    /// Adds the extension bytes of a size line (after its first `;`) to
    /// the body's total, refused at hyper's limit.
    fn count_extension(&mut self, line: &[u8]) -> Result<(), Error> {
        if let Some(semi) = line.iter().position(|&b| b == b';') {
            self.extension_bytes += (line.len() - semi - 1) as u64;
            if self.extension_bytes >= MAX_EXTENSION_BYTES {
                return Err(Error::Chunked("chunk extensions over 16 KiB"));
            }
        }
        Ok(())
    }
}

/// `Some(())` when `rest` starts with CRLF, `None` when too short to tell.
fn crlf(rest: &[u8], what: &'static str) -> Result<Option<()>, Error> {
    match rest {
        [] | [b'\r'] => Ok(None),
        [b'\r', b'\n', ..] => Ok(Some(())),
        _ => Err(Error::Chunked(what)),
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Trailer {
    #[default]
    Line,
    Lf,
    EndCr,
    EndLf,
}

/// hyper parses the section (final empty line included) with room for
/// exactly as many fields as it counted lines.
fn check_trailers(section: &[u8], lines: usize) -> Result<(), Error> {
    let mut fields = vec![httparse::EMPTY_HEADER; lines];
    match httparse::parse_headers(section, &mut fields) {
        Ok(httparse::Status::Complete(_)) => Ok(()),
        _ => Err(Error::Chunked("invalid trailer fields")),
    }
}

/// The trailer fields of a `Done` step's `trailers` range, parsed into
/// `slots` (give as many as the decoder's `max_trailers`).
pub fn parse_trailers<'h, 'b>(
    section: &'b [u8],
    slots: &'h mut [httparse::Header<'b>],
) -> Result<&'h [httparse::Header<'b>], Error> {
    if section.is_empty() {
        return Ok(&[]);
    }
    match httparse::parse_headers(section, slots) {
        Ok(httparse::Status::Complete((_, fields))) => Ok(fields),
        _ => Err(Error::Chunked("invalid trailer fields")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `wire` to a decoder in reads cut at `cuts`, as a connection
    /// would: unconsumed bytes stay in the buffer, new ones append.
    fn decode_in_reads(wire: &[u8], cuts: &[usize]) -> Result<(Vec<u8>, usize), Error> {
        let mut decoder = Decoder::new(100);
        let mut ends: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        ends.push(wire.len());
        ends.sort_unstable();
        let (mut pos, mut data) = (0, Vec::new());
        for end in ends {
            loop {
                match decoder.decode(&wire[pos..end])? {
                    Step::Data(r) => {
                        data.extend_from_slice(&wire[pos..end][r.clone()]);
                        pos += r.end;
                    }
                    Step::Incomplete { consumed } => {
                        pos += consumed;
                        break;
                    }
                    Step::Done { consumed, .. } => return Ok((data, pos + consumed)),
                }
            }
        }
        Err(Error::Chunked("truncated"))
    }

    proptest! {
        /// RFC 9112 7.1: a body written as chunks (any sizes, leading
        /// zeros, extensions, trailers) decodes to the concatenated data,
        /// ending exactly at the end of the body, however it is read.
        #[test]
        fn chunks_decode_to_their_data_across_any_reads(
            chunks in prop::collection::vec((prop::collection::vec(any::<u8>(), 1..300), 0usize..3, any::<bool>()), 0..8),
            trailer in any::<bool>(),
            cuts in prop::collection::vec(any::<usize>(), 0..6),
        ) {
            let mut wire = Vec::new();
            let mut expected = Vec::new();
            for (data, zeros, ext) in &chunks {
                wire.extend_from_slice("0".repeat(*zeros).as_bytes());
                wire.extend_from_slice(format!("{:x}", data.len()).as_bytes());
                if *ext {
                    wire.extend_from_slice(b";name=\"v a l\"");
                }
                wire.extend_from_slice(b"\r\n");
                wire.extend_from_slice(data);
                wire.extend_from_slice(b"\r\n");
                expected.extend_from_slice(data);
            }
            wire.extend_from_slice(b"0\r\n");
            if trailer {
                wire.extend_from_slice(b"x-sum: 1\r\n");
            }
            wire.extend_from_slice(b"\r\n");
            let body_len = wire.len();
            wire.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
            let (data, used) = decode_in_reads(&wire, &cuts).expect("decoded");
            prop_assert_eq!(data, expected);
            prop_assert_eq!(used, body_len);
        }
    }

    /// Feeds `wire` one byte per read; the decoder's count of bytes
    /// looked at, and whether the body decoded.
    fn examined_byte_by_byte(wire: &[u8]) -> (u64, Result<(), Error>) {
        let mut decoder = Decoder::new(100);
        let mut pos = 0;
        for end in 1..=wire.len() {
            loop {
                match decoder.decode(&wire[pos..end]) {
                    Err(e) => return (decoder.examined, Err(e)),
                    Ok(Step::Data(r)) => pos += r.end,
                    Ok(Step::Incomplete { consumed }) => {
                        pos += consumed;
                        break;
                    }
                    Ok(Step::Done { .. }) => return (decoder.examined, Ok(())),
                }
            }
        }
        (decoder.examined, Err(Error::Chunked("truncated")))
    }

    /// A size line (long extension, many leading zeros) or trailer
    /// section that arrives a byte per read is scanned on, not again from
    /// its start: the bytes looked at stay a small multiple of the input
    /// (rescanning would be about n²/2: some 100 million here).
    #[test]
    fn a_line_that_trickles_in_is_scanned_in_linear_time() {
        let long_ext = format!("5;{}\r\nhello\r\n0\r\n\r\n", "e".repeat(15_000));
        let zeros = format!("{}5\r\nhello\r\n0\r\n\r\n", "0".repeat(16_000));
        let spaces = format!("5{};x\r\nhello\r\n0\r\n\r\n", " ".repeat(16_000));
        let trailers = format!("0\r\nx-a: {}\r\nx-b: 1\r\n\r\n", "v".repeat(15_000));
        for wire in [long_ext, zeros, spaces, trailers] {
            let (examined, decoded) = examined_byte_by_byte(wire.as_bytes());
            assert_eq!(decoded, Ok(()), "{}", &wire[..20]);
            let bound = 4 * wire.len() as u64 + 64 * EAGER_LINE as u64;
            assert!(
                examined <= bound,
                "{examined} bytes looked at for {}",
                wire.len()
            );
        }
        // Refused as before: a bad byte past the eager part of the line
        // when the line ends, a line that never ends at the limit.
        let bad = format!("5;{}\rx", "e".repeat(100));
        assert!(examined_byte_by_byte(bad.as_bytes()).1.is_err());
        let endless = format!("5 {}", " ".repeat(MAX_SIZE_LINE));
        let (examined, decoded) = examined_byte_by_byte(endless.as_bytes());
        assert_eq!(decoded, Err(Error::Chunked("size line too long")));
        assert!(examined <= 4 * endless.len() as u64 + 64 * EAGER_LINE as u64);
    }

    #[test]
    fn data_is_a_range_of_the_input() {
        let mut d = Decoder::new(100);
        let wire = b"3\r\nabc\r\n0\r\n\r\n";
        assert_eq!(d.decode(wire), Ok(Step::Data(3..6)));
        let rest = &wire[6..];
        assert_eq!(
            d.decode(rest),
            Ok(Step::Done {
                consumed: rest.len(),
                trailers: 5..5
            })
        );
    }

    #[test]
    fn hyper_rules_around_parse_chunk_size() {
        let refused = |wire: &[u8]| Decoder::new(100).decode(wire).is_err();
        assert!(refused(b"\r\n"));
        assert!(refused(b" 5\r\n"));
        assert!(refused(b"5;a\nb\r\n"));
        assert!(refused(b"0x5\r\n"));
        assert!(!refused(
            &[b"0".repeat(40).as_slice(), b"5\r\nhello"].concat()
        ));
        assert!(refused(&b"0".repeat(MAX_SIZE_LINE)));
    }
}
