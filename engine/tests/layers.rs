//! The engine's modules form layers (documented at the top of `src/lib.rs`): a module
//! may use its own layer and the ones below, never one above. This test reads every
//! `src/**/*.rs`, resolves each `use` path and each inline `crate::` path to the module
//! that defines it (looking through the re-exports of the hub modules `lib.rs` and
//! `kv/mod.rs`), and fails on any import that runs upwards or names a module missing
//! from [`LAYERS`].

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Module path prefix -> layer, lowest first. The longest matching prefix decides; a new
/// module goes in the lowest layer whose modules it needs (see `src/lib.rs`).
const LAYERS: &[(&str, usize)] = &[
    // 0. foundation: config, checkpoint files, KV layout, plain algorithms.
    ("config", 0),
    ("rope", 0),
    ("checkpoint", 0),
    ("sampling", 0),
    ("embedded", 0),
    ("kv::layout", 0),
    ("kv::layout_table", 0),
    ("kv::sizing", 0),
    ("kv::fp8", 0),
    ("kv::peer", 0),
    ("kv::metrics", 0),
    // 1. backend: the traits of numeric ops, KV storage and step running; the CPU backend.
    ("backend", 1),
    // 2. pools: page/state allocation, device and host pools, the step audit.
    ("kv::allocator", 2),
    ("kv::device", 2),
    ("kv::host", 2),
    ("kv::audit", 2),
    // 3. model: parameters and the forward pass.
    ("model", 3),
    // 4. engine: sequences, batched forward, single-request drivers.
    ("engine", 4),
    ("generate", 4),
    // 5. prefix cache.
    ("kv::prefix", 5),
];

/// Modules that only declare and re-export; imports through them resolve to the item's
/// defining module.
const HUBS: &[&str] = &["", "kv"];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .filter(|(m, _)| module == *m || module.starts_with(&format!("{m}::")))
        .max_by_key(|(m, _)| m.len())
        .map(|&(_, l)| l)
}

/// `src/a/b.rs` and `src/a/b/mod.rs` -> `a::b`; `src/lib.rs` -> ``.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts.join("::")
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without `//` comments (doc comments included).
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Expand one use tree (`a::{b, c::{d, e as f}, self}`) into full paths.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or(tree).trim();
        return vec![path.to_string()];
    };
    let prefix = tree[..open].trim_end_matches("::").trim();
    let inner = &tree[open + 1..tree.rfind('}').unwrap()];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(expand)
        .map(|p| match p.as_str() {
            "self" => prefix.to_string(),
            _ => format!("{prefix}::{p}"),
        })
        .collect()
}

/// Every `use` tree of `code` (its text after `use`, up to `;`), and the code without them.
fn use_trees(code: &str) -> (Vec<String>, String) {
    let mut trees = Vec::new();
    let mut other = String::new();
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let at_start = rest[..i]
            .chars()
            .last()
            .is_none_or(|c| c.is_whitespace() || c == ')' || c == ';' || c == '{');
        let after = &rest[i + 4..];
        match after.find(';') {
            Some(end) if at_start => {
                other.push_str(&rest[..i]);
                trees.push(after[..end].to_string());
                rest = &after[end..];
            }
            _ => {
                other.push_str(&rest[..i + 4]);
                rest = after;
            }
        }
    }
    other.push_str(rest);
    (trees, other)
}

/// A file's code up to its test module, without comments: unit tests sit at the end of a
/// file and import through `super`, which this checker does not track into inline modules.
fn code_of(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let end = text.find("#[cfg(test)]").unwrap_or(text.len());
    strip_comments(&text[..end])
}

/// Inline paths `crate::a::b` in code outside `use` statements.
fn inline_crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let before = code[..i].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let path: String = code[i..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        out.push(path.trim_end_matches(':').to_string());
    }
    out
}

struct Crate {
    /// Module paths of every file.
    modules: Vec<String>,
    /// `hub::Name` -> the absolute path it re-exports.
    reexports: HashMap<String, String>,
}

impl Crate {
    /// The absolute path (no `crate::`) an import in `module` names, or `None` when it
    /// names another crate.
    fn absolute(&self, module: &str, path: &str) -> Option<String> {
        let segs: Vec<&str> = path.split("::").collect();
        let mut base: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
        let mut i = 0;
        match segs.first().copied() {
            Some("crate") => {
                base.clear();
                i = 1;
            }
            Some("self") => i = 1,
            Some("super") => {
                while segs.get(i) == Some(&"super") {
                    base.pop();
                    i += 1;
                }
            }
            Some(first) => {
                let mut child = base.clone();
                child.push(first);
                if !self.modules.contains(&child.join("::")) {
                    return None;
                }
            }
            None => return None,
        }
        base.extend(&segs[i..]);
        Some(base.join("::"))
    }

    /// Follow hub re-exports until the path names an item where it is defined.
    fn resolve(&self, mut path: String) -> String {
        for _ in 0..8 {
            let segs: Vec<&str> = path.split("::").collect();
            let hit = (1..=segs.len()).rev().find_map(|n| {
                let key = segs[..n].join("::");
                self.reexports.get(&key).map(|t| (n, t.clone()))
            });
            match hit {
                Some((n, target)) => {
                    let mut p = vec![target];
                    p.extend(segs[n..].iter().map(|s| s.to_string()));
                    path = p.join("::");
                }
                None => return path,
            }
        }
        path
    }
}

#[test]
fn no_module_imports_a_higher_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let modules: Vec<String> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut krate = Crate {
        modules: modules.clone(),
        reexports: HashMap::new(),
    };
    // Hub re-exports first (they may name each other).
    for (f, m) in files.iter().zip(&modules) {
        if !HUBS.contains(&m.as_str()) {
            continue;
        }
        let code = code_of(f);
        for line in code.split(';') {
            let line = line.trim();
            let Some(tree) = line.strip_prefix("pub use ") else {
                continue;
            };
            for p in expand(tree) {
                let Some(abs) = krate.absolute(m, &p) else {
                    continue;
                };
                let name = p.rsplit("::").next().unwrap_or(&p).to_string();
                let alias = tree_alias(tree, &name);
                let key = if m.is_empty() {
                    alias
                } else {
                    format!("{m}::{alias}")
                };
                krate.reexports.insert(key, abs);
            }
        }
    }
    let mut errors = Vec::new();
    for (f, m) in files.iter().zip(&modules) {
        if HUBS.contains(&m.as_str()) {
            continue;
        }
        let Some(own) = layer_of(m) else {
            errors.push(format!(
                "{}: module `{m}` has no layer in LAYERS",
                f.display()
            ));
            continue;
        };
        let (trees, rest) = use_trees(&code_of(f));
        let mut paths: Vec<String> = trees.iter().flat_map(|t| expand(t)).collect();
        paths.extend(inline_crate_paths(&rest));
        for p in paths {
            let Some(abs) = krate.absolute(m, &p) else {
                continue;
            };
            let target = krate.resolve(abs);
            if target.is_empty() || target == *m || target.starts_with(&format!("{m}::")) {
                continue;
            }
            match layer_of(&target) {
                Some(l) if l <= own => {}
                Some(l) => errors.push(format!(
                    "{}: `{m}` (layer {own}) imports `{target}` (layer {l})",
                    f.display()
                )),
                None => errors.push(format!(
                    "{}: `{m}` imports `{target}`, which has no layer in LAYERS",
                    f.display()
                )),
            }
        }
    }
    assert!(
        errors.is_empty(),
        "layer violations:\n{}",
        errors.join("\n")
    );
}

/// The name `name` is re-exported under in a `pub use` tree (`x as y` -> `y`).
fn tree_alias(tree: &str, name: &str) -> String {
    let pat = format!("{name} as ");
    match tree.find(&pat) {
        Some(i) => tree[i + pat.len()..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect(),
        None => name.to_string(),
    }
}

#[test]
fn the_checker_sees_an_upward_import() {
    // The checker's own parts on a made-up file: a backend module importing the engine.
    let code = strip_comments("use crate::engine::{Engine, EngineError}; // use crate::x;\n");
    let (trees, rest) = use_trees(&code);
    let paths: Vec<String> = trees.iter().flat_map(|t| expand(t)).collect();
    assert_eq!(
        paths,
        vec!["crate::engine::Engine", "crate::engine::EngineError"]
    );
    assert!(inline_crate_paths(&rest).is_empty());
    assert_eq!(
        inline_crate_paths("let x = crate::model::Model::new();"),
        vec!["crate::model::Model::new"]
    );
    assert_eq!(layer_of("engine"), Some(4));
    assert!(layer_of("backend::cpu").unwrap() < layer_of("engine").unwrap());
    assert_eq!(
        expand("super::{a::{b, c as d}, self}"),
        vec!["super::a::b", "super::a::c", "super"]
    );
}
