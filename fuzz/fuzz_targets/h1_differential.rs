//! The differential test as a fuzz target: the input goes to hyper 1 and
//! to the codec, which must frame it the same (see
//! crates/h1/tests/differential.rs, whose two sides this reuses). The
//! first byte picks requests (high bit clear; low bit: small limits) or
//! responses (high bit set; low two bits: the request method).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(unreachable_pub)]
#[path = "../../crates/h1/tests/sides/mod.rs"]
mod sides;

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, input)) = data.split_first() else {
        return;
    };
    RUNTIME.with(|rt| {
        if pick & 0x80 == 0 {
            let limits = meshless_h1::check::fuzz_limits(pick);
            let theirs = rt.block_on(sides::hypers_with(input.to_vec(), limits));
            let mine = sides::ours_with(input, &limits);
            assert_eq!(mine, theirs, "{:?}", String::from_utf8_lossy(input));
        } else {
            let methods = [
                http::Method::GET,
                http::Method::HEAD,
                http::Method::CONNECT,
                http::Method::POST,
            ];
            let method = methods[usize::from(pick % 4)].clone();
            let theirs = rt.block_on(sides::hyper_response(input.to_vec(), method.clone()));
            let mine = sides::our_response(input, &method);
            assert_eq!(
                mine,
                theirs,
                "{method} {:?}",
                String::from_utf8_lossy(input)
            );
        }
    });
});
