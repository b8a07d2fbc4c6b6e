//! Parses the input as the requests of one connection and asserts the
//! codec's invariants (`meshless_h1::check`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    meshless_h1::check::fuzz_request(data);
});
