//! No import circles between the files of a crate: for every crate of the
//! workspace, each top-level module (one file, or a directory with its
//! `mod.rs`) is a node, and each `crate::x` path outside comments and the
//! `#[cfg(test)]` tail of a file is an edge to module `x`. A circle means
//! two modules each need the other: split out what they share.
//!
//! Run alone: `cargo test -p meshless-control --test import_cycles`
//! (`IMPORT_CYCLES_CRATES_DIR=/other/crates` checks another checkout).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module names referred to as `crate::NAME` or inside
/// `crate::{A, B::C}` groups in `text`.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut at_start = true;
            let mut name = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
                if depth == 1 && at_start && (c.is_alphanumeric() || c == '_') {
                    name.push(c);
                    continue;
                }
                if !name.is_empty() {
                    out.insert(std::mem::take(&mut name));
                }
                at_start = depth == 1 && (c == ',' || (c.is_whitespace() && at_start));
            }
            if !name.is_empty() {
                out.insert(name);
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// The code of a file without comment lines and without its test tail.
fn code(text: &str) -> String {
    text.lines()
        .take_while(|l| l.trim() != "#[cfg(test)]")
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module -> modules it refers to, for the crate whose sources are in `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap_or(&path);
            let first = rel
                .components()
                .next()
                .map(|c| {
                    c.as_os_str()
                        .to_string_lossy()
                        .trim_end_matches(".rs")
                        .to_owned()
                })
                .unwrap_or_default();
            if first == "lib" || first == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let refs = crate_refs(&code(&text));
            let node = g.entry(first.clone()).or_default();
            node.extend(refs.into_iter().filter(|r| *r != first));
        }
    }
    g
}

/// One circle, if any: the modules along it.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_owned(), 1);
        path.push(n.to_owned());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()) {
                Some(1) => {
                    let start = path.iter().position(|p| p == m).unwrap_or(0);
                    let mut cycle = path[start..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None if g.contains_key(m.as_str()) => {
                    if let Some(c) = visit(m, g, state, path) {
                        return Some(c);
                    }
                }
                None => {}
            }
        }
        path.pop();
        state.insert(n.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if !state.contains_key(n.as_str())
            && let Some(c) = visit(n, g, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

/// The workspace's `crates/`, or `IMPORT_CYCLES_CRATES_DIR` to check another tree.
fn crates_dir() -> PathBuf {
    std::env::var_os("IMPORT_CYCLES_CRATES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}

#[test]
fn the_checker_finds_a_circle_and_reads_groups() {
    assert_eq!(
        crate_refs("use crate::{api::{A, B}, store::Store};\nuse crate::x::y;"),
        ["api", "store", "x"]
            .into_iter()
            .map(String::from)
            .collect()
    );
    let mut g = BTreeMap::new();
    g.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    g.insert("b".to_owned(), BTreeSet::from(["c".to_owned()]));
    g.insert("c".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    g.insert("c".to_owned(), BTreeSet::new());
    assert_eq!(find_cycle(&g), None);
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut found = Vec::new();
    let mut checked = 0;
    for e in std::fs::read_dir(crates_dir()).expect("crates/").flatten() {
        let src = e.path().join("src");
        if !src.is_dir() {
            continue;
        }
        checked += 1;
        if let Some(c) = find_cycle(&graph(&src)) {
            found.push(format!(
                "{}: {}",
                e.file_name().to_string_lossy(),
                c.join(" -> ")
            ));
        }
    }
    assert!(checked >= 2, "read {checked} crates");
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}
