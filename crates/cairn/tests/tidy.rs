//! House rules that a reviewer would otherwise have to check by eye.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn workspace_sources() -> Vec<PathBuf> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let mut files = Vec::new();
    rust_files(&crates, &mut files);
    assert!(
        files.len() > 20,
        "found only {} files under {}",
        files.len(),
        crates.display()
    );
    files
}

#[test]
fn every_module_opens_with_a_doc_comment() {
    let missing: Vec<_> = workspace_sources()
        .into_iter()
        .filter(|f| !std::fs::read_to_string(f).unwrap().starts_with("//!"))
        .collect();
    assert!(
        missing.is_empty(),
        "files without a leading `//!` line: {missing:?}"
    );
}

#[test]
fn no_unfinished_code_on_main() {
    let needles = [concat!("todo", "!("), concat!("unimplemented", "!(")];
    let offenders: Vec<_> = workspace_sources()
        .into_iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            needles.iter().any(|n| text.contains(n))
        })
        .collect();
    assert!(offenders.is_empty(), "unfinished code in {offenders:?}");
}
