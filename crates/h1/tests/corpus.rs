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
