//! The fuzz targets' function over the committed seed corpus
//! (`fuzz/corpus/<target>/`), so CI exercises what the fuzzer found
//! without running it. Each file is one input, crash reproducers included.

use std::path::PathBuf;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut files: Vec<(PathBuf, Vec<u8>)> = entries
        .map(|e| e.expect("directory entry").path())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "{} holds {} inputs",
        dir.display(),
        files.len()
    );
    files
}

#[test]
fn request_corpus_keeps_the_invariants() {
    for (path, bytes) in inputs("h1_request") {
        eprintln!("{}", path.display());
        meshless_h1::check::fuzz_request(&bytes);
    }
}

#[test]
fn response_corpus_keeps_the_invariants() {
    for (path, bytes) in inputs("h1_response") {
        eprintln!("{}", path.display());
        meshless_h1::check::fuzz_response(&bytes);
    }
}

/// One edit of a seed: overwrite, insert or delete a byte at a position.
#[derive(Debug, Clone)]
enum Edit {
    Set(usize, u8),
    Insert(usize, u8),
    Delete(usize),
}

fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut out = seed.to_vec();
    for edit in edits {
        let len = out.len().max(1);
        match *edit {
            Edit::Set(at, b) if !out.is_empty() => out[at % len] = b,
            Edit::Insert(at, b) => out.insert(at % (out.len() + 1), b),
            Edit::Delete(at) if !out.is_empty() => {
                out.remove(at % len);
            }
            _ => {}
        }
    }
    out
}

fn edits() -> impl proptest::strategy::Strategy<Value = Vec<Edit>> {
    use proptest::prelude::*;
    // Bytes that matter to HTTP/1 framing, and any byte.
    let byte = prop_oneof![
        prop::sample::select(b"\r\n :;,0159aAfFxX-+\t\0\x0b".to_vec()),
        any::<u8>(),
    ];
    let edit = prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(a, b)| Edit::Set(a, b)),
        (any::<usize>(), byte).prop_map(|(a, b)| Edit::Insert(a, b)),
        any::<usize>().prop_map(Edit::Delete),
    ];
    prop::collection::vec(edit, 1..8)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 3000, ..Default::default() })]

    /// A fuzz smoke run that needs no nightly toolchain: seeds with a few
    /// random edits, through both targets' invariants.
    #[test]
    fn edited_seeds_keep_the_invariants(seed in 0usize..1000, edits in edits()) {
        for target in ["h1_request", "h1_response"] {
            let seeds = inputs(target);
            let input = mutate(&seeds[seed % seeds.len()].1, &edits);
            if target == "h1_request" {
                meshless_h1::check::fuzz_request(&input);
            } else {
                meshless_h1::check::fuzz_response(&input);
            }
        }
    }
}
