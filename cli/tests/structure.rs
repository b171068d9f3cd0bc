//! The project's structure, drawn from its imports (docs/architecture.md): inside every
//! crate of the workspace no files import each other in a circle, the engine's modules
//! import only their own layer or lower ones, and the crates depend on each other only
//! downwards (the router needs no engine).
//!
//! Each `src/**/*.rs` file is a module; every `use crate::...`, `use super::...`,
//! `use self::...` and inline `crate::...` path is resolved to the file that defines the
//! item, looking through `pub use` re-exports (so importing `crate::kv::PageId` from a
//! `kv/mod.rs` that re-exports it from `kv/layout.rs` is an edge to `kv/layout.rs`). A
//! strongly connected component of more than one file is a circle and fails the test. A
//! `pub use` is a facade, not a dependency: it adds no edge of its own.
//! `STRUCTURE_ROOT` checks another checkout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    std::env::var_os("STRUCTURE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}

/// The workspace's member folders, from the root Cargo.toml.
fn members(root: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let list = text.split("members").nth(1).expect("workspace members");
    let list = &list[list.find('[').unwrap() + 1..list.find(']').unwrap()];
    list.split(',')
        .map(|s| s.trim().trim_matches('"'))
        .filter(|s| !s.is_empty())
        .map(|s| root.join(s))
        .collect()
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// `src/a/b.rs` and `src/a/b/mod.rs` -> `a::b`; `src/lib.rs` and `src/main.rs` -> ``.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts.join("::")
}

/// Source without comments and string literals, and without inline `#[cfg(test)] mod`
/// blocks (a file's unit tests are not part of the structure; their `super::` is the file).
fn strip(src: &str) -> String {
    drop_test_modules(&strip_comments(src))
}

fn drop_test_modules(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(at) = rest.find("#[cfg(test)]") {
        let after = &rest[at + "#[cfg(test)]".len()..];
        let head = after.trim_start();
        let is_mod = head.starts_with("mod ") || head.starts_with("pub mod ");
        let open = after.find('{');
        let semi = after.find(';');
        match (is_mod, open) {
            (true, Some(o)) if semi.is_none_or(|s| s > o) => {
                out.push_str(&rest[..at]);
                let body = &after[o..];
                let mut depth = 0usize;
                let mut end = body.len();
                for (i, c) in body.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                rest = &body[end..];
            }
            _ => {
                out.push_str(&rest[..at + "#[cfg(test)]".len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            while i + 1 < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'r' && b[i..].starts_with(b"r#\"") {
            let end = src[i + 3..].find("\"#").map_or(b.len(), |e| i + 3 + e + 2);
            i = end;
            out.push_str("\"\"");
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// `use` trees expanded to full paths, each with the name it binds: `a::{b, c::d as e}` ->
/// (`a::b`, `b`), (`a::c::d`, `e`).
fn expand(tree: &str) -> Vec<(String, String)> {
    let tree = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let tree: String = tree
        .replace(" as ", "@")
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let mut out = Vec::new();
    expand_into("", &tree, &mut out);
    out
}

fn expand_into(prefix: &str, tree: &str, out: &mut Vec<(String, String)>) {
    for part in split_top(tree) {
        if let Some(open) = part.find('{') {
            let head = part[..open].trim_end_matches("::");
            let inner = &part[open + 1..part.len() - 1];
            expand_into(&join(prefix, head), inner, out);
        } else {
            let mut words = part.split('@');
            let name = words.next().unwrap_or(part);
            let path = if name == "self" {
                prefix.to_string()
            } else {
                join(prefix, name)
            };
            let bound = words
                .next()
                .or_else(|| path.rsplit("::").next())
                .unwrap_or_default()
                .to_string();
            if !path.is_empty() {
                out.push((path, bound));
            }
        }
    }
}

fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}::{b}"),
    }
}

/// Split at commas outside braces.
fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().filter(|p| !p.is_empty()).collect()
}

/// A path as written in module `module` -> an absolute path inside the crate, or None
/// for paths into other crates.
fn absolute(module: &str, path: &str) -> Option<Vec<String>> {
    let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut base: Vec<String> = module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let mut rest = &segs[..];
    match rest.first() {
        Some(&"crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some(&"self") => rest = &rest[1..],
        Some(&"super") => {
            while rest.first() == Some(&"super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().map(|s| s.to_string()));
    Some(base)
}

struct Crate {
    /// module path -> file
    files: BTreeMap<String, PathBuf>,
    /// module path -> (re-exported name -> absolute target path)
    reexports: HashMap<String, HashMap<String, Vec<String>>>,
    /// module path -> absolute paths it uses
    uses: HashMap<String, Vec<Vec<String>>>,
}

/// Every `use` statement of `text` (whether it is `pub`, and its tree), and the text
/// without them (where inline `crate::` paths are looked for).
fn use_statements(text: &str) -> (Vec<(bool, String)>, String) {
    let mut out = Vec::new();
    let mut other = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = find_use(rest) {
        let is_pub =
            rest[..pos].trim_end().ends_with("pub") || rest[..pos].trim_end().ends_with(')');
        other.push_str(&rest[..pos]);
        let after = &rest[pos + 4..];
        let end = after.find(';').unwrap_or(after.len());
        out.push((is_pub, after[..end].to_string()));
        rest = &after[end..];
    }
    other.push_str(rest);
    (out, other)
}

/// Position of the next `use ` keyword that starts a statement.
fn find_use(s: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(p) = s[from..].find("use ") {
        let at = from + p;
        let before = s[..at].chars().next_back();
        if before.is_none_or(|c| !(c.is_alphanumeric() || c == '_')) {
            return Some(at);
        }
        from = at + 4;
    }
    None
}

fn inline_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(p) = text[from..].find("crate::") {
        let at = from + p;
        let before = text[..at].chars().next_back();
        let end = text[at..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .map_or(text.len(), |e| at + e);
        if before.is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == '$')) {
            out.push(text[at..end].trim_end_matches(':').to_string());
        }
        from = end.max(at + 7);
    }
    out
}

fn load(dir: &Path) -> Crate {
    let src = dir.join("src");
    let mut list = Vec::new();
    rs_files(&src, &mut list);
    let mut krate = Crate {
        files: BTreeMap::new(),
        reexports: HashMap::new(),
        uses: HashMap::new(),
    };
    for f in list {
        // A second binary root (src/bin/*) is its own crate: skip it.
        if f.strip_prefix(&src).unwrap().starts_with("bin") {
            continue;
        }
        let module = module_of(&src, &f);
        let text = strip(&std::fs::read_to_string(&f).unwrap());
        let mut uses = Vec::new();
        let mut re = HashMap::new();
        let (statements, rest) = use_statements(&text);
        for (is_pub, tree) in statements {
            for (p, bound) in expand(&tree) {
                let Some(abs) = written_path(&src, &module, &p) else {
                    continue;
                };
                if is_pub {
                    re.insert(bound, abs);
                } else {
                    uses.push(abs);
                }
            }
        }
        for p in inline_paths(&rest) {
            if let Some(abs) = absolute(&module, &p) {
                uses.push(abs);
            }
        }
        krate.reexports.insert(module.clone(), re);
        krate.uses.insert(module.clone(), uses);
        krate.files.insert(module, f);
    }
    krate
}

/// A path as written in `module` (`crate::`, `self::`, `super::`, or a child module's
/// name as in `use device::X`) -> an absolute path inside the crate; None for other crates.
fn written_path(src: &Path, module: &str, path: &str) -> Option<Vec<String>> {
    if let Some(abs) = absolute(module, path) {
        return Some(abs);
    }
    let first = path.split("::").next()?;
    let child = join(module, first);
    krate_has_child(src, &child).then(|| {
        child
            .split("::")
            .map(String::from)
            .chain(path.split("::").skip(1).map(String::from))
            .collect()
    })
}

fn krate_has_child(src: &Path, module: &str) -> bool {
    let rel = module.replace("::", "/");
    src.join(format!("{rel}.rs")).exists() || src.join(&rel).join("mod.rs").exists()
}

/// The module defining the item at `path`, through re-exports.
fn resolve(k: &Crate, path: &[String], depth: usize) -> Option<String> {
    let mut best = None;
    for n in (0..=path.len()).rev() {
        let m = path[..n].join("::");
        if k.files.contains_key(&m) {
            best = Some((m, n));
            break;
        }
    }
    let (m, n) = best?;
    if depth < 8 && n < path.len() {
        if let Some(target) = k.reexports.get(&m).and_then(|r| r.get(&path[n])) {
            let mut full = target.clone();
            full.extend(path[n + 1..].iter().cloned());
            if full != path {
                if let Some(r) = resolve(k, &full, depth + 1) {
                    return Some(r);
                }
            }
        }
    }
    Some(m)
}

fn edges(k: &Crate) -> BTreeMap<String, BTreeSet<String>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, uses) in &k.uses {
        let entry = g.entry(m.clone()).or_default();
        for u in uses {
            if let Some(t) = resolve(k, u, 0) {
                // A module using its own children or its parent's items through itself.
                if &t != m {
                    entry.insert(t);
                }
            }
        }
    }
    g
}

/// Strongly connected components with more than one module (Tarjan).
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: HashMap<&'a str, usize>,
        low: HashMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.g.get(v) {
            for w in ws {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

// The engine's layers (documented at the top of engine/src/lib.rs): a module may use its
// own layer and the ones below, never one above.

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
    ("kv::fp8_kv", 0),
    ("numerics", 0),
    ("kv::peer", 0),
    ("kv::metrics", 0),
    ("kv::checksum", 0),
    ("kv::canary_regions", 0),
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

/// Modules that only declare and re-export (facades): not checked as importers.
const HUBS: &[&str] = &["", "kv"];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .filter(|(m, _)| module == *m || module.starts_with(&format!("{m}::")))
        .max_by_key(|(m, _)| m.len())
        .map(|&(_, l)| l)
}

/// Every import of `graph` that runs to a higher layer, or from or to a module with no layer.
fn layer_violations(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut errors = Vec::new();
    for (m, targets) in graph {
        if HUBS.contains(&m.as_str()) {
            continue;
        }
        let Some(own) = layer_of(m) else {
            errors.push(format!("module `{m}` has no layer in LAYERS"));
            continue;
        };
        for t in targets {
            match layer_of(t) {
                Some(l) if l <= own => {}
                Some(l) => errors.push(format!("`{m}` (layer {own}) imports `{t}` (layer {l})")),
                None => errors.push(format!("`{m}` imports `{t}`, which has no layer in LAYERS")),
            }
        }
    }
    errors
}

#[test]
fn no_engine_module_imports_a_higher_layer() {
    let k = load(&root().join("engine"));
    let errors = layer_violations(&edges(&k));
    assert!(
        errors.is_empty(),
        "layer violations:\n{}",
        errors.join("\n")
    );
}

#[test]
fn no_crate_has_files_that_import_each_other_in_a_circle() {
    let root = root();
    let mut found = Vec::new();
    for dir in members(&root) {
        let k = load(&dir);
        assert!(!k.files.is_empty(), "{} has no sources", dir.display());
        for c in circles(&edges(&k)) {
            found.push(format!("{}: {}", dir.display(), c.join(" <-> ")));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn the_router_depends_on_no_engine() {
    let toml = std::fs::read_to_string(root().join("router/Cargo.toml")).unwrap();
    let deps = toml.split("[dev-dependencies]").next().unwrap_or("");
    for banned in ["pdserve-engine", "pdserve-kernels"] {
        assert!(!deps.contains(banned), "router depends on {banned}");
    }
}

#[test]
fn the_checker_sees_circles_and_resolves_reexports() {
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    g.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(circles(&g), vec![vec!["a".to_string(), "b".to_string()]]);
    let mut up = BTreeMap::new();
    up.insert(
        "backend::shapes".to_string(),
        BTreeSet::from(["engine".to_string()]),
    );
    up.insert(
        "engine".to_string(),
        BTreeSet::from(["backend".to_string()]),
    );
    up.insert("nowhere".to_string(), BTreeSet::new());
    assert_eq!(
        layer_violations(&up),
        vec![
            "`backend::shapes` (layer 1) imports `engine` (layer 4)".to_string(),
            "module `nowhere` has no layer in LAYERS".to_string(),
        ]
    );
    assert_eq!(
        expand("crate::kv::{device::DevicePool, pool::{self, PageId as P}}"),
        [
            ("crate::kv::device::DevicePool", "DevicePool"),
            ("crate::kv::pool", "pool"),
            ("crate::kv::pool::PageId", "P"),
        ]
        .map(|(p, n)| (p.to_string(), n.to_string()))
    );
    let stripped =
        strip("use crate::a;\n#[cfg(test)]\nmod tests {\n    use super::*; { }\n}\nuse crate::b;");
    assert!(!stripped.contains("super"), "{stripped}");
    assert!(stripped.contains("crate::a") && stripped.contains("crate::b"));
    assert_eq!(
        absolute("kv::prefix::evict", "super::super::layout::X"),
        Some(vec!["kv".into(), "layout".into(), "X".into()])
    );
}
