//! Kernel sources and their NVRTC compilation (PTX for the device's compute capability),
//! cached on disk by a hash of source, options and NVRTC version.

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

const COMMON: &str = include_str!("cu/common.cuh");

/// Every kernel module: (name, source without the common header).
pub const MODULES: &[(&str, &str)] = &[
    ("elementwise", include_str!("cu/elementwise.cu")),
    ("norm_rope", include_str!("cu/norm_rope.cu")),
    ("hc", include_str!("cu/hc.cu")),
    ("compress", include_str!("cu/compress.cu")),
    ("indexer", include_str!("cu/indexer.cu")),
    ("attention", include_str!("cu/attention.cu")),
    ("attention_split", include_str!("cu/attention_split.cu")),
    // The wgmma kernel after the mma.sync ones, whose helpers it shares.
    (
        "attention_mma",
        concat!(
            include_str!("cu/attention_mma.cu"),
            include_str!("cu/attention_wgmma.cu")
        ),
    ),
    ("moe", include_str!("cu/moe.cu")),
    ("moe_mma", include_str!("cu/moe_mma.cu")),
    ("quant", include_str!("cu/quant.cu")),
    ("random", include_str!("cu/random.cu")),
    ("audit", include_str!("cu/audit.cu")),
    ("sample", include_str!("cu/sample.cu")),
];

/// The modules with Hopper's arch-specific instructions (wgmma): compiled for `compute_90a`
/// on a compute-capability 9.0 device, where those kernels run; elsewhere for the device's
/// arch, their bodies built without them (they trap, and the host never launches them).
const ARCH_SPECIFIC: &[&str] = &["attention_mma"];

/// The arch module `name` compiles for on a device of `arch` (`compute_90`, ...).
pub fn module_arch(name: &str, arch: &str) -> String {
    if arch == "compute_90" && ARCH_SPECIFIC.contains(&name) {
        "compute_90a".into()
    } else {
        arch.into()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("NVRTC (libnvrtc.so) is not installed or not on the library path")]
    NvrtcMissing,
    #[error("NVRTC failed on module `{module}` for {arch}: {log}")]
    Nvrtc {
        module: String,
        arch: String,
        log: String,
    },
}

/// Whether the NVRTC library can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    #[allow(unsafe_code)]
    // SAFETY: only probes whether the dynamic library loads.
    unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    }
}

/// Full source text of a module (common header prepended).
pub fn full_source(src: &str) -> String {
    format!("{COMMON}\n{src}")
}

/// Compile one module to PTX for `arch` (e.g. `compute_90`).
pub fn compile_module(name: &str, src: &str, arch: &str) -> Result<String, CompileError> {
    if !nvrtc_present() {
        return Err(CompileError::NvrtcMissing);
    }
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        fmad: Some(true),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(full_source(src), opts).map_err(|e| {
        let log = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        CompileError::Nvrtc {
            module: name.into(),
            arch: arch.into(),
            log,
        }
    })?;
    Ok(ptx.to_src())
}

/// Default cache folder: `$PDSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pdserve/kernels`,
/// else `~/.cache/pdserve/kernels`, else the temp dir.
pub fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PDSERVE_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("pdserve").join("kernels")
}

fn cache_key(name: &str, src: &str, arch: &str) -> String {
    let mut h = Sha256::new();
    h.update(full_source(src).as_bytes());
    h.update(arch.as_bytes());
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    let d = h.finalize();
    let hex: String = d.iter().take(12).map(|b| format!("{b:02x}")).collect();
    format!("{name}-{arch}-{hex}.ptx")
}

/// PTX of a module, from the cache when present, else compiled and stored (a cache that
/// cannot be written only costs a recompile next time).
pub fn cached_ptx(name: &str, src: &str, arch: &str, dir: &Path) -> Result<String, CompileError> {
    let path = dir.join(cache_key(name, src, arch));
    if let Ok(text) = std::fs::read_to_string(&path) {
        if text.contains(".entry") {
            return Ok(text);
        }
    }
    let t0 = std::time::Instant::now();
    let ptx = compile_module(name, src, arch)?;
    tracing::debug!(
        module = name,
        arch,
        secs = t0.elapsed().as_secs_f32(),
        "NVRTC compiled"
    );
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let stored = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&tmp, &ptx))
        .and_then(|_| std::fs::rename(&tmp, &path));
    if let Err(e) = stored {
        tracing::warn!(path = %path.display(), error = %e, "kernel cache not written");
    }
    Ok(ptx)
}
