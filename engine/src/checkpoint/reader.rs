//! A checkpoint folder: memory-mapped safetensors files (single or sharded), seen through
//! canonical tensor names ([`names::canonical`]): upstream DeepSeek names, the names
//! transformers' `save_pretrained` writes, and transformers' module names all load, and
//! per-expert tensors are presented as the packed `experts.gate_up_proj` / `down_proj`.
//! A quantized weight `X.weight` (FP8 e4m3, or FP4 packed in `I8`) is paired with its
//! ue8m0 `X.scale` on disk; the pair reads as one f32 tensor in the weight's logical shape,
//! and the scale has no canonical name of its own.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::SafeTensors;

use super::dequant::{fp4_group_scaled, fp8_block_scaled};
use super::names::{canonical, Canonical, ExpertPart};
use super::stored::StoredWeight;
use super::{CheckpointError, DiskDtype, WeightFormat, CONVERT_CHUNK, INDEX_FILE, SINGLE_FILE};

/// A checkpoint tensor converted to f32 on the host, in its stored shape.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Zero-copy view of a tensor's bytes inside the mapped file (little-endian, row-major).
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    pub dtype: DiskDtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

#[derive(Debug)]
struct Entry {
    shard: usize,
    dtype: DiskDtype,
    shape: Vec<usize>,
    /// Absolute byte range inside the shard's mapping.
    start: usize,
    end: usize,
}

#[derive(Debug)]
struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// An opened checkpoint directory. Tensor data stays in the page cache until converted.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensors as stored, by disk name.
    disk: BTreeMap<String, Entry>,
    /// Canonical name -> where its data comes from.
    canon: BTreeMap<String, Source>,
    /// Disk name of a quantized weight -> disk name of its `.scale`.
    scales: BTreeMap<String, String>,
}

/// One stored tensor behind a canonical name (several for per-expert tensors).
#[derive(Debug, Clone, Copy)]
pub struct StoredPart<'a> {
    /// Disk name.
    pub name: &'a str,
    pub dtype: DiskDtype,
    /// Shape as stored (an FP4 weight stores half its columns).
    pub shape: &'a [usize],
    /// The `.scale` tensor stored next to it, if any.
    pub scale: Option<StoredScale<'a>>,
}

/// A stored `.scale` tensor.
#[derive(Debug, Clone, Copy)]
pub struct StoredScale<'a> {
    pub name: &'a str,
    pub dtype: DiskDtype,
    pub shape: &'a [usize],
}

/// Disk name of the scale that belongs to weight `disk`: `X.weight` -> `X.scale`.
pub fn scale_name(disk: &str) -> Option<String> {
    disk.strip_suffix(".weight")
        .map(|stem| format!("{stem}.scale"))
}

/// Weight disk name -> scale disk name, for every stored `X.scale` next to an `X.weight`.
fn pair_scales(disk: &BTreeMap<String, Entry>) -> BTreeMap<String, String> {
    disk.keys()
        .filter_map(|w| {
            let s = scale_name(w)?;
            disk.contains_key(&s).then(|| (w.clone(), s))
        })
        .collect()
}

/// Where a canonical tensor's data lives.
#[derive(Debug)]
enum Source {
    Disk(String),
    /// Per-expert 2-D disk tensors stacked on a new leading axis; each expert's parts
    /// (gate then up, or down alone) concatenated along rows.
    Stacked(Vec<Vec<String>>),
}

#[allow(unsafe_code)]
fn map_file(path: &Path) -> Result<Mmap, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: the map is read-only and every access is bounds-checked against the header that
    // safetensors validated. Checkpoint files must not be truncated or rewritten while the
    // server has them open; that is the documented contract of memory-mapping a file.
    unsafe { Mmap::map(&file) }.map_err(io)
}

/// dtype, shape, absolute start, absolute end.
type HeaderEntry = (DiskDtype, Vec<usize>, usize, usize);

/// Parsed safetensors header of one mapped file, by tensor name.
fn read_header(path: &Path, map: &Mmap) -> Result<HashMap<String, HeaderEntry>, CheckpointError> {
    let (n, meta) = SafeTensors::read_metadata(map).map_err(|source| CheckpointError::Format {
        path: path.to_path_buf(),
        source,
    })?;
    let base = 8 + n;
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let (s, e) = info.data_offsets;
            (name, (info.dtype, info.shape.clone(), base + s, base + e))
        })
        .collect())
}

impl Checkpoint {
    /// Open `dir/model.safetensors`, or else the shards named by `dir/model.safetensors.index.json`
    /// (`weight_map`: tensor name -> file name). Only the headers are read here.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            shards: Vec::new(),
            disk: BTreeMap::new(),
            canon: BTreeMap::new(),
            scales: BTreeMap::new(),
        };
        if single.is_file() {
            let map = map_file(&single)?;
            for (name, (dtype, shape, start, end)) in read_header(&single, &map)? {
                ckpt.disk.insert(
                    name,
                    Entry {
                        shard: 0,
                        dtype,
                        shape,
                        start,
                        end,
                    },
                );
            }
            ckpt.shards.push(Shard { path: single, map });
            ckpt.scales = pair_scales(&ckpt.disk);
            ckpt.canon = build_canonical(&ckpt.disk, &ckpt.scales)?;
            return Ok(ckpt);
        }
        if !index.is_file() {
            return Err(CheckpointError::NoCheckpoint {
                dir: dir.to_path_buf(),
            });
        }
        let bad = |reason: String| CheckpointError::Index {
            path: index.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&index).map_err(|source| CheckpointError::Io {
            path: index.clone(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let Some(weight_map) = json.get("weight_map").and_then(|w| w.as_object()) else {
            return Err(bad("missing `weight_map` object".into()));
        };
        // file name -> tensor names it should hold
        let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, file) in weight_map {
            let Some(file) = file.as_str() else {
                return Err(bad(format!(
                    "weight_map[{name:?}] is not a file name: {file}"
                )));
            };
            by_file.entry(file).or_default().push(name);
        }
        for (file, names) in by_file {
            let path = dir.join(file);
            let map = map_file(&path)?;
            let mut header = read_header(&path, &map)?;
            let shard = ckpt.shards.len();
            for name in names {
                let Some((dtype, shape, start, end)) = header.remove(name) else {
                    return Err(bad(format!(
                        "tensor `{name}` is mapped to {file}, which does not contain it"
                    )));
                };
                ckpt.disk.insert(
                    name.to_string(),
                    Entry {
                        shard,
                        dtype,
                        shape,
                        start,
                        end,
                    },
                );
            }
            ckpt.shards.push(Shard { path, map });
        }
        ckpt.scales = pair_scales(&ckpt.disk);
        ckpt.canon = build_canonical(&ckpt.disk, &ckpt.scales)?;
        Ok(ckpt)
    }

    /// The directory this checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Files backing this checkpoint, in shard order.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// Every canonical tensor name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.canon.keys().cloned().collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.canon.contains_key(name)
    }

    /// Disk names behind a canonical name, in data order.
    fn part_names(&self, name: &str) -> Vec<&String> {
        match self.canon.get(name) {
            Some(Source::Disk(d)) => vec![d],
            Some(Source::Stacked(experts)) => experts.iter().flatten().collect(),
            None => Vec::new(),
        }
    }

    /// Disk entries behind a canonical name, in data order.
    fn parts(&self, name: &str) -> Vec<&Entry> {
        self.part_names(name)
            .into_iter()
            .filter_map(|d| self.disk.get(d))
            .collect()
    }

    /// The stored tensors behind canonical `name`, each with its paired scale.
    pub fn stored_parts(&self, name: &str) -> Vec<StoredPart<'_>> {
        self.part_names(name)
            .into_iter()
            .filter_map(|d| {
                let e = self.disk.get(d)?;
                let scale = self.scales.get(d).and_then(|s| {
                    let se = self.disk.get(s)?;
                    Some(StoredScale {
                        name: s,
                        dtype: se.dtype,
                        shape: &se.shape,
                    })
                });
                Some(StoredPart {
                    name: d,
                    dtype: e.dtype,
                    shape: &e.shape,
                    scale,
                })
            })
            .collect()
    }

    /// The shape a disk tensor has once decoded: an FP4 weight (`I8` with a scale) holds
    /// two elements per stored byte.
    fn logical_shape(&self, disk: &str) -> Option<Vec<usize>> {
        let e = self.disk.get(disk)?;
        let mut shape = e.shape.clone();
        if e.dtype == DiskDtype::I8 && self.scales.contains_key(disk) {
            if let Some(cols) = shape.last_mut() {
                *cols *= 2;
            }
        }
        Some(shape)
    }

    /// Shape of canonical `name` as [`Checkpoint::tensor_f32`] returns it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self.canon.get(name)? {
            Source::Disk(d) => self.logical_shape(d),
            Source::Stacked(experts) => {
                let first = self.logical_shape(experts.first()?.first()?)?;
                let per_expert = experts[0].len();
                Some(vec![experts.len(), per_expert * first[0], first[1]])
            }
        }
    }

    pub fn dtype(&self, name: &str) -> Option<DiskDtype> {
        self.parts(name).first().map(|e| e.dtype)
    }

    /// Stored size of one tensor in bytes, its scales included (0 when absent).
    pub fn tensor_bytes(&self, name: &str) -> u64 {
        self.part_names(name)
            .into_iter()
            .flat_map(|d| std::iter::once(d).chain(self.scales.get(d)))
            .filter_map(|d| self.disk.get(d))
            .map(|e| (e.end - e.start) as u64)
            .sum()
    }

    /// Stored size of all tensors in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.disk.values().map(|e| (e.end - e.start) as u64).sum()
    }

    /// The stored bytes of a tensor kept whole on disk, without conversion.
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>, CheckpointError> {
        match self.canon.get(name) {
            Some(Source::Disk(d)) => self.raw_disk(d),
            Some(Source::Stacked(_)) => Err(corrupt(
                name,
                "stacked from per-expert tensors on disk; read it with tensor_f32".into(),
            )),
            None => Err(CheckpointError::NotFound {
                name: name.to_string(),
            }),
        }
    }

    fn raw_disk(&self, name: &str) -> Result<RawTensor<'_>, CheckpointError> {
        let entry = self
            .disk
            .get(name)
            .ok_or_else(|| CheckpointError::NotFound {
                name: name.to_string(),
            })?;
        let bytes = self
            .shards
            .get(entry.shard)
            .and_then(|s| s.map.get(entry.start..entry.end))
            .ok_or_else(|| corrupt(name, "data range lies outside its file".into()))?;
        let numel: usize = entry.shape.iter().product();
        let expected = numel
            .checked_mul(entry.dtype.bitsize())
            .map(|bits| bits.div_ceil(8));
        if expected != Some(bytes.len()) {
            return Err(corrupt(
                name,
                format!("{} bytes stored for shape {:?}", bytes.len(), entry.shape),
            ));
        }
        Ok(RawTensor {
            dtype: entry.dtype,
            shape: &entry.shape,
            bytes,
        })
    }

    /// A float tensor (F32, BF16 or F16 on disk, or a quantized weight with its scale)
    /// converted to f32.
    pub fn tensor_f32(&self, name: &str) -> Result<CheckpointTensor, CheckpointError> {
        match self.canon.get(name) {
            Some(Source::Stacked(experts)) => {
                let shape = self.shape(name).ok_or_else(|| CheckpointError::NotFound {
                    name: name.to_string(),
                })?;
                let mut data = Vec::with_capacity(shape.iter().product());
                for d in experts.iter().flatten() {
                    data.extend(self.disk_f32(d)?.data);
                }
                Ok(CheckpointTensor { shape, data })
            }
            Some(Source::Disk(d)) => self.disk_f32(d),
            None => Err(CheckpointError::NotFound {
                name: name.to_string(),
            }),
        }
    }

    fn disk_f32(&self, name: &str) -> Result<CheckpointTensor, CheckpointError> {
        let raw = self.raw_disk(name)?;
        let decode: fn(&[u8]) -> f32 = match raw.dtype {
            DiskDtype::F32 => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            DiskDtype::BF16 => |b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            DiskDtype::F16 => |b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            DiskDtype::F8_E4M3 | DiskDtype::I8 if self.scales.contains_key(name) => {
                return self.dequantized(name, raw);
            }
            dtype => {
                return Err(CheckpointError::Dtype {
                    name: name.to_string(),
                    dtype,
                    expected: "F32, BF16 or F16 (or F8_E4M3 / I8 with a .scale)",
                })
            }
        };
        let size = raw.dtype.bitsize() / 8;
        let mut data = vec![0f32; raw.bytes.len() / size];
        data.par_chunks_mut(CONVERT_CHUNK)
            .zip(raw.bytes.par_chunks(CONVERT_CHUNK * size))
            .for_each(|(out, bytes)| {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(size)) {
                    *o = decode(b);
                }
            });
        Ok(CheckpointTensor {
            shape: raw.shape.to_vec(),
            data,
        })
    }

    /// A quantized 2-D weight (`F8_E4M3` block-scaled, or `I8`-packed FP4) decoded with its
    /// paired `F8_E8M0` scale (see [`super::dequant`]).
    fn dequantized(
        &self,
        name: &str,
        raw: RawTensor<'_>,
    ) -> Result<CheckpointTensor, CheckpointError> {
        let scale_disk = self
            .scales
            .get(name)
            .ok_or_else(|| corrupt(name, format!("{:?} weight without its .scale", raw.dtype)))?;
        let scale = self.raw_disk(scale_disk)?;
        if scale.dtype != DiskDtype::F8_E8M0 {
            return Err(CheckpointError::Dtype {
                name: scale_disk.clone(),
                dtype: scale.dtype,
                expected: "F8_E8M0",
            });
        }
        let &[rows, stored_cols] = raw.shape else {
            return Err(corrupt(
                name,
                format!("quantized weight of shape {:?} is not 2-D", raw.shape),
            ));
        };
        let (cols, data) = if raw.dtype == DiskDtype::F8_E4M3 {
            (
                stored_cols,
                fp8_block_scaled(raw.bytes, rows, stored_cols, scale.bytes),
            )
        } else {
            let cols = 2 * stored_cols;
            (cols, fp4_group_scaled(raw.bytes, rows, cols, scale.bytes))
        };
        Ok(CheckpointTensor {
            shape: vec![rows, cols],
            data: data.map_err(|reason| corrupt(name, reason))?,
        })
    }

    /// Canonical `name` as stored when it is quantized (FP8 block-scaled or FP4, every
    /// part with its scale), parts concatenated along rows with one scale grid per part;
    /// `None` for a float tensor. For a backend that computes on the stored bytes.
    pub fn stored_weight(&self, name: &str) -> Result<Option<StoredWeight>, CheckpointError> {
        let parts = self.part_names(name);
        let Some(first) = parts.first() else {
            return Err(CheckpointError::NotFound {
                name: name.to_string(),
            });
        };
        let quantized = |d: &str| {
            self.scales.contains_key(d)
                && matches!(
                    self.disk.get(d).map(|e| e.dtype),
                    Some(DiskDtype::F8_E4M3 | DiskDtype::I8)
                )
        };
        if !quantized(first) {
            return Ok(None);
        }
        let mut out: Option<StoredWeight> = None;
        for d in parts {
            let raw = self.raw_disk(d)?;
            let scale_name = self
                .scales
                .get(d)
                .ok_or_else(|| corrupt(d, "quantized part without its .scale".into()))?;
            let scale = self.raw_disk(scale_name)?;
            let (format, cols) = match (raw.dtype, raw.shape) {
                (DiskDtype::F8_E4M3, &[_, c]) => (WeightFormat::Fp8Block, c),
                (DiskDtype::I8, &[_, c]) => (WeightFormat::Fp4Packed, 2 * c),
                (dtype, shape) => {
                    return Err(corrupt(
                        d,
                        format!("{dtype:?} part of shape {shape:?} next to quantized parts"),
                    ))
                }
            };
            if scale.dtype != DiskDtype::F8_E8M0 {
                return Err(CheckpointError::Dtype {
                    name: scale_name.clone(),
                    dtype: scale.dtype,
                    expected: "F8_E8M0",
                });
            }
            // A NaN scale (0xff) decodes to NaN weights: refused here, naming the weight,
            // whichever backend computes on the bytes.
            if let Some(i) = scale.bytes.iter().position(|&b| b == 0xff) {
                return Err(corrupt(d, format!("scale element {i} is NaN (0xff)")));
            }
            let rows = raw.shape[0];
            let w = out.get_or_insert_with(|| StoredWeight {
                format,
                rows: 0,
                cols,
                group_rows: rows,
                data: Vec::new(),
                scale: Vec::new(),
            });
            if (w.format, w.cols, w.group_rows) != (format, cols, rows) {
                return Err(corrupt(
                    d,
                    format!("{format:?} {rows}x{cols} part unlike the first part of `{name}`"),
                ));
            }
            w.rows += rows;
            w.data.extend_from_slice(raw.bytes);
            w.scale.extend_from_slice(scale.bytes);
        }
        if let Some(w) = &out {
            w.check().map_err(|reason| corrupt(name, reason))?;
        }
        Ok(out)
    }

    /// An integer tensor (I64 or I32 on disk), e.g. `tid2eid`.
    pub fn tensor_i64(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>), CheckpointError> {
        let raw = self.raw(name)?;
        let data: Vec<i64> = match raw.dtype {
            DiskDtype::I64 => raw
                .bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                .collect(),
            DiskDtype::I32 => raw
                .bytes
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
            dtype => {
                return Err(CheckpointError::Dtype {
                    name: name.to_string(),
                    dtype,
                    expected: "I64 or I32",
                })
            }
        };
        Ok((raw.shape.to_vec(), data))
    }
}

fn corrupt(name: &str, reason: String) -> CheckpointError {
    CheckpointError::Corrupt {
        name: name.to_string(),
        reason,
    }
}

/// Group disk names by canonical name; per-expert tensors must form complete, uniform sets.
/// Scales paired with a weight (`scales`' values) belong to that weight and are skipped.
fn build_canonical(
    disk: &BTreeMap<String, Entry>,
    scales: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, Source>, CheckpointError> {
    let mut canon = BTreeMap::new();
    let paired: std::collections::BTreeSet<&String> = scales.values().collect();
    // packed name -> expert -> [gate/down, up] disk names
    let mut packed: BTreeMap<String, BTreeMap<usize, [Option<String>; 2]>> = BTreeMap::new();
    let mut ignored = 0usize;
    for name in disk.keys().filter(|n| !paired.contains(n)) {
        match canonical(name) {
            Canonical::Ignored => ignored += 1,
            Canonical::Whole(c) => {
                if let Some(Source::Disk(other)) =
                    canon.insert(c.clone(), Source::Disk(name.clone()))
                {
                    return Err(corrupt(
                        &c,
                        format!("stored twice, as `{other}` and as `{name}`"),
                    ));
                }
            }
            Canonical::Expert {
                packed: p,
                expert,
                part,
            } => {
                let slot = usize::from(part == ExpertPart::Up);
                let parts = packed.entry(p).or_default().entry(expert).or_default();
                if let Some(other) = parts[slot].replace(name.clone()) {
                    return Err(corrupt(
                        name,
                        format!("expert {expert} part stored twice (also `{other}`)"),
                    ));
                }
            }
        }
    }
    if ignored > 0 {
        tracing::info!("ignoring {ignored} multi-token-prediction (mtp.*) tensors");
    }
    for (p, experts) in packed {
        if canon.contains_key(&p) {
            return Err(corrupt(&p, "stored both packed and per expert".into()));
        }
        let n_parts = if p.ends_with("gate_up_proj") { 2 } else { 1 };
        let mut stacked = Vec::with_capacity(experts.len());
        let mut first: Option<(&Vec<usize>, DiskDtype)> = None;
        for (i, (e, parts)) in experts.into_iter().enumerate() {
            if e != i {
                return Err(corrupt(&p, format!("per-expert tensors skip expert {i}")));
            }
            let names: Vec<String> = parts.into_iter().take(n_parts).flatten().collect();
            if names.len() != n_parts {
                return Err(corrupt(
                    &p,
                    format!("expert {e} lacks its w1 (gate) or w3 (up) tensor"),
                ));
            }
            for n in &names {
                let entry = disk
                    .get(n)
                    .ok_or_else(|| CheckpointError::NotFound { name: n.clone() })?;
                let this = (&entry.shape, entry.dtype);
                if entry.shape.len() != 2 || first.is_some_and(|f| f != this) {
                    return Err(corrupt(
                        n,
                        format!(
                            "shape {:?} / dtype {:?} differs from the other experts'",
                            entry.shape, entry.dtype
                        ),
                    ));
                }
                first.get_or_insert(this);
            }
            stacked.push(names);
        }
        canon.insert(p, Source::Stacked(stacked));
    }
    Ok(canon)
}
