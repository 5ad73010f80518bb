//! The README's DRA example is one the code accepts: each of its YAML documents is, line
//! for line (comments, blank lines and namespaces aside), a document of
//! examples/dra/claims.yaml, which node-daemon/tests/dra.rs passes through the real
//! apiserver's validation and the driver's config check.

use std::path::Path;

/// The lines that carry content: comments, trailing spaces and `namespace:` lines dropped.
fn content(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| match l.find(" #") {
            Some(i) => &l[..i],
            None => l,
        })
        .map(str::trim_end)
        .filter(|l| !l.is_empty() && !l.trim_start().starts_with('#'))
        .filter(|l| !l.trim_start().starts_with("namespace:"))
        .map(str::to_string)
        .collect()
}

/// The YAML block of the README's section `heading`.
fn readme_block(readme: &str, heading: &str) -> Option<String> {
    let section = readme.split_once(heading)?.1;
    let block = section.split_once("```yaml\n")?.1;
    Some(block.split_once("```")?.0.to_string())
}

#[test]
fn the_readme_claim_is_a_checked_example() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let examples =
        std::fs::read_to_string(root.join("examples/dra/claims.yaml")).expect("the examples");
    let block = readme_block(&readme, "## Or a ResourceClaim (DRA").expect("the DRA section");
    let docs: Vec<Vec<String>> = examples.split("\n---\n").map(content).collect();
    let shown: Vec<Vec<String>> = block.split("\n---\n").map(content).collect();
    assert_eq!(shown.len(), 2, "a template and a pod: {block}");
    for doc in &shown {
        assert!(
            docs.contains(doc),
            "not a document of examples/dra/claims.yaml:\n{}",
            doc.join("\n")
        );
    }
}

#[test]
fn a_changed_line_is_caught() {
    let a = content("kind: Pod # x\nmetadata:\n  name: a\n  namespace: n\n");
    assert_eq!(a, ["kind: Pod", "metadata:", "  name: a"]);
    assert_ne!(a, content("kind: Pod\nmetadata:\n  name: b\n"));
}
