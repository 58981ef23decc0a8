//! The policies the README and the docs show: each loads as it is written, without a warning,
//! so a user who copies one starts from a policy the crate takes as meant.

use tower_fairshare::Policy;

/// Every ```toml block of `text` that holds a `[[tool]]`, with the line it starts on.
fn policies(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut block: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        match (&mut block, line.trim_start()) {
            (None, l) if l.starts_with("```toml") => block = Some((n + 2, String::new())),
            (Some(_), l) if l.starts_with("```") => {
                let (at, b) = block.take().expect("in a block");
                if b.contains("[[tool]]") {
                    out.push((at, b));
                }
            }
            (Some((_, b)), _) => {
                b.push_str(line);
                b.push('\n');
            }
            (None, _) => {}
        }
    }
    out
}

#[test]
fn every_policy_the_docs_show_loads_without_a_warning() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut files = vec![format!("{root}/README.md")];
    for entry in std::fs::read_dir(format!("{root}/docs")).expect("docs/") {
        let path = entry.expect("a docs entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path.display().to_string());
        }
    }
    let mut checked = 0;
    let mut wrong = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("readable");
        for (line, toml) in policies(&text) {
            checked += 1;
            match Policy::from_toml_str(&toml) {
                Ok(p) if p.warnings().is_empty() => {}
                Ok(p) => wrong.push(format!("{file}:{line}: warns {:?}", p.warnings())),
                Err(e) => wrong.push(format!("{file}:{line}: {e}")),
            }
        }
    }
    // README, policy, leases and model calls show one each at least.
    assert!(checked >= 4, "only {checked} policies found in {files:?}");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_block_is_read_from_its_fence_to_the_next() {
    let text = "a\n```toml\n[[tool]]\nname = \"x\"\n```\n```toml\n[dependencies]\n```\n";
    assert_eq!(
        policies(text),
        vec![(3, "[[tool]]\nname = \"x\"\n".to_owned())]
    );
}
