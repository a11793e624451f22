//! The workspace's layering, read from its sources: no two files of a crate import each
//! other in a circle, and the aggregator imports `fedpo-device` only to simulate devices.
//!
//! A file's imports are the modules its non-test code names through `crate::` or
//! `super::` (in `use` lines and in paths). A module and the modules nested in it are one
//! unit here: a parent declares its children and they see its private items, which is how
//! Rust splits one concept over files, not a dependency between two concepts.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Every crate's `src` directory.
fn crate_sources() -> Vec<PathBuf> {
    let root = workspace();
    let mut dirs: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.push(root.join("aggregator/src"));
    dirs.sort();
    dirs
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/a/b.rs` and `src/a/b/mod.rs` are `["a", "b"]`; `lib.rs` and `main.rs` are the root.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

/// The file's code before its unit tests.
fn non_test_code(text: &str) -> &str {
    let end = ["#[cfg(test)]\nmod tests", "#[cfg(test)]\npub(crate) mod tests", "#[cfg(test)]\nmod test"]
        .iter()
        .filter_map(|m| text.find(m))
        .min()
        .unwrap_or(text.len());
    &text[..end]
}

/// The paths a file names through `crate::` and `super::`, as module paths (not resolved
/// to files yet; a path may end in an item's name). Braced groups are expanded.
fn named_paths(module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        for (start, _) in line.match_indices("crate::").chain(line.match_indices("super::")) {
            // `fedpo_process::...` or `candle_core::...` end in `crate`-less names; only a
            // path that starts at a word boundary is this crate's.
            if start > 0 && line.as_bytes()[start - 1].is_ascii_alphanumeric() | (line.as_bytes()[start - 1] == b'_') {
                continue;
            }
            if line[start..].starts_with("super::") && start >= 7 && line[..start].ends_with("super::") {
                continue; // the second `super` of `super::super::`, taken with the first
            }
            let rest = &line[start..];
            let mut base: Vec<String> = Vec::new();
            let mut tail = rest;
            if let Some(after) = tail.strip_prefix("crate::") {
                tail = after;
            } else {
                base = module.to_vec();
                while let Some(after) = tail.strip_prefix("super::") {
                    base.pop();
                    tail = after;
                }
            }
            let segment: String = tail.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
            let mut path = base;
            path.extend(segment.split("::").filter(|s| !s.is_empty()).map(str::to_string));
            out.push(path.clone());
            // `crate::a::{b, c::d}`: the group's first-level names, each a possible module
            if tail[segment.len()..].starts_with('{') {
                let group: String = tail[segment.len() + 1..].chars().take_while(|c| *c != '}').collect();
                for item in group.split(',') {
                    let first: String = item.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    if !first.is_empty() && first != "self" {
                        let mut p = path.clone();
                        p.push(first);
                        out.push(p);
                    }
                }
            }
        }
    }
    out
}

/// The modules that files import, per crate: module -> modules it names, with nested
/// modules left out.
fn import_graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let text = fs::read_to_string(file).unwrap();
        let edges = graph.entry(module.clone()).or_default();
        for path in named_paths(&module, non_test_code(&text)) {
            // the longest prefix that is a module with a file of its own
            let Some(target) = (0..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| modules.contains(p)) else {
                continue;
            };
            let nested = target.starts_with(&module) || module.starts_with(&target);
            if !nested {
                edges.insert(target);
            }
        }
    }
    graph
}

/// A circle of modules, if there is one (depth-first search).
fn find_circle(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        node: &Vec<String>,
        graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        stack: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            return Some(stack[at..].to_vec());
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(circle) = visit(next, graph, stack, done) {
                return Some(circle);
            }
        }
        stack.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_two_files_of_a_crate_import_each_other_in_a_circle() {
    let mut circles = Vec::new();
    for src in crate_sources() {
        let graph = import_graph(&src);
        assert!(graph.len() > 3, "{}: too few modules found", src.display());
        if let Some(circle) = find_circle(&graph) {
            let names: Vec<String> =
                circle.iter().map(|m| if m.is_empty() { "(root)".to_string() } else { m.join("::") }).collect();
            circles.push(format!("{}: {}", src.parent().unwrap().display(), names.join(" -> ")));
        }
    }
    assert!(circles.is_empty(), "modules that import each other in a circle:\n{}", circles.join("\n"));
}

#[test]
fn the_circle_finder_finds_a_circle_through_three_files_and_ignores_nesting() {
    let m = |s: &str| s.split("::").filter(|p| !p.is_empty()).map(str::to_string).collect::<Vec<_>>();
    let code = "use crate::b::Thing;\nuse super::{c, d::E};\nfn f() { crate::x::y(); }\n";
    let named = named_paths(&m("a::inner"), code);
    assert!(named.contains(&m("b::Thing")) && named.contains(&m("a::c")) && named.contains(&m("a::d")));
    assert!(named.contains(&m("x::y")));
    let graph: BTreeMap<_, BTreeSet<_>> =
        [(m("a"), [m("b")].into()), (m("b"), [m("c")].into()), (m("c"), [m("a")].into()), (m("d"), BTreeSet::new())]
            .into();
    assert_eq!(find_circle(&graph).map(|c| c.len()), Some(3));
    let acyclic: BTreeMap<_, BTreeSet<_>> = [(m("a"), [m("b")].into()), (m("b"), BTreeSet::new())].into();
    assert_eq!(find_circle(&acyclic), None);
}

#[test]
fn outside_simulate_the_aggregator_does_not_import_fedpo_device() {
    let src = workspace().join("aggregator/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| {
            let rel = f.strip_prefix(&src).unwrap();
            !(rel.starts_with("simulate") || rel == Path::new("simulate.rs"))
        })
        .filter(|f| non_test_code(&fs::read_to_string(f).unwrap()).contains("fedpo_device"))
        .map(|f| f.display().to_string())
        .collect();
    assert!(offenders.is_empty(), "files outside simulate/ that import fedpo_device: {offenders:?}");
}
