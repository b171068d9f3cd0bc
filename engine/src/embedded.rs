//! The small DeepSeek-V4 model shipped inside the binary (random weights, bf16; see
//! `models/embedded/README.md`). It is written once to a cache folder so every loader
//! path (safetensors mmap, tokenizer.json) is the same as for any other model.

use sha2::{Digest, Sha256};
use std::path::PathBuf;

const FILES: [(&str, &[u8]); 4] = [
    (
        "config.json",
        include_bytes!("../../models/embedded/config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../models/embedded/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../models/embedded/tokenizer.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../../models/embedded/chat_template.jinja"),
    ),
];

#[derive(Debug, thiserror::Error)]
#[error("writing the embedded model to {path}: {source}")]
pub struct EmbeddedError {
    path: PathBuf,
    source: std::io::Error,
}

fn content_hash() -> String {
    let mut h = Sha256::new();
    for (name, bytes) in FILES {
        h.update(name.as_bytes());
        h.update(bytes);
    }
    h.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Cache root: `$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`,
/// else the system temp folder.
pub fn cache_root() -> PathBuf {
    if let Some(d) = std::env::var_os("PDSERVE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("pdserve");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("pdserve");
    }
    std::env::temp_dir().join("pdserve")
}

fn is_complete(dir: &std::path::Path) -> bool {
    FILES
        .iter()
        .all(|(n, b)| std::fs::metadata(dir.join(n)).is_ok_and(|m| m.len() == b.len() as u64))
}

/// Folder holding the embedded model, written on first use. Concurrent first uses are
/// safe: each writes a private temp folder and renames it into place; a complete copy
/// is never removed.
pub fn model_dir() -> Result<PathBuf, EmbeddedError> {
    let dir = cache_root().join(format!("embedded-{}", content_hash()));
    if is_complete(&dir) {
        return Ok(dir);
    }
    let err = |path: PathBuf| move |source| EmbeddedError { path, source };
    let parent = cache_root();
    std::fs::create_dir_all(&parent).map_err(err(parent.clone()))?;
    let tmp = parent.join(format!(
        ".embedded-tmp-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&tmp).map_err(err(tmp.clone()))?;
    for (name, bytes) in FILES {
        std::fs::write(tmp.join(name), bytes).map_err(err(tmp.join(name)))?;
    }
    if std::fs::rename(&tmp, &dir).is_ok() {
        return Ok(dir);
    }
    if is_complete(&dir) {
        // Another process put a complete copy in place first.
        let _ = std::fs::remove_dir_all(&tmp);
        return Ok(dir);
    }
    // A partial copy from an interrupted run: replace it.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(err(dir.clone()))?;
    Ok(dir)
}
