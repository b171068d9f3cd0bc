//! Shape checks every backend runs before an op, so all backends refuse the same inputs
//! with the same error. Dimensions are `(rows, cols)`; vectors are passed by length.

use super::{BResult, BackendError};

pub fn shape_err(op: &'static str, detail: String) -> BackendError {
    BackendError::Shape { op, detail }
}

/// Every token id must index a row of the `vocab`-row table.
pub fn check_embed(vocab: usize, tokens: &[u32]) -> BResult<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(shape_err("embed", format!("token id {t} >= vocab {vocab}"))),
        None => Ok(()),
    }
}

/// `x @ w^T` needs equal inner dimensions.
pub fn check_matmul(x: (usize, usize), w: (usize, usize)) -> BResult<()> {
    if x.1 != w.1 {
        return Err(shape_err(
            "matmul",
            format!("[{},{}] x [{},{}]^T", x.0, x.1, w.0, w.1),
        ));
    }
    Ok(())
}

/// Block-diagonal `x @ w^T`: `groups` column blocks of `x`, row blocks of `w`.
pub fn check_grouped_matmul(x: (usize, usize), w: (usize, usize), groups: usize) -> BResult<()> {
    if groups == 0
        || !x.1.is_multiple_of(groups)
        || !w.0.is_multiple_of(groups)
        || w.1 * groups != x.1
    {
        return Err(shape_err(
            "grouped_matmul",
            format!("x [{},{}], w [{},{}], {groups} groups", x.0, x.1, w.0, w.1),
        ));
    }
    Ok(())
}

pub fn check_rms_norm(cols: usize, weight_len: Option<usize>, group: usize) -> BResult<()> {
    if group == 0 || !cols.is_multiple_of(group) || weight_len.is_some_and(|n| n != group) {
        return Err(shape_err("rms_norm", format!("cols {cols} group {group}")));
    }
    Ok(())
}

pub fn check_rope(
    x: (usize, usize),
    head_dim: usize,
    positions: usize,
    rope_dim: usize,
) -> BResult<()> {
    if head_dim == 0 || !x.1.is_multiple_of(head_dim) || positions != x.0 || rope_dim > head_dim {
        return Err(shape_err(
            "rope",
            format!("[{},{}] head_dim {head_dim}", x.0, x.1),
        ));
    }
    Ok(())
}

/// Hyper-connection mapping: `mix` holds `(2+hc)*hc` logits per stream row.
pub fn check_hc_pre(
    streams: (usize, usize),
    mix: (usize, usize),
    base: usize,
    scale: usize,
    hc: usize,
) -> BResult<()> {
    if hc == 0
        || mix.1 != (2 + hc) * hc
        || base != mix.1
        || scale != 3
        || mix.0 != streams.0
        || !streams.1.is_multiple_of(hc)
    {
        return Err(shape_err(
            "hc_pre",
            format!("mix cols {} for hc {hc}", mix.1),
        ));
    }
    Ok(())
}

/// Sublayer output `out` mixed back into `hc` streams with `post` (`hc`) and `comb` (`hc*hc`) per row.
pub fn check_hc_post(
    streams: (usize, usize),
    out: (usize, usize),
    post: usize,
    comb: usize,
    hc: usize,
) -> BResult<()> {
    if streams.1 != hc * out.1
        || streams.0 != out.0
        || post != out.0 * hc
        || comb != out.0 * hc * hc
    {
        return Err(shape_err(
            "hc_post",
            format!("streams cols {} out cols {}", streams.1, out.1),
        ));
    }
    Ok(())
}

/// Final collapse: `mix` holds `hc` logits per stream row.
pub fn check_hc_head(
    streams: (usize, usize),
    mix: (usize, usize),
    base: usize,
    scale: usize,
    hc: usize,
) -> BResult<()> {
    if hc == 0
        || mix.1 != hc
        || base != hc
        || scale == 0
        || mix.0 != streams.0
        || !streams.1.is_multiple_of(hc)
    {
        return Err(shape_err(
            "hc_head",
            format!("mix cols {} for hc {hc}", mix.1),
        ));
    }
    Ok(())
}

/// A compressor ring write: projections of `width` columns, one row per plan row, into a
/// ring of at least one slot.
pub fn check_compress_ring(
    layer: usize,
    (width, slots): (usize, usize),
    proj_kv: (usize, usize),
    proj_gate: (usize, usize),
    plan_rows: usize,
) -> BResult<()> {
    if slots == 0
        || proj_kv.1 != width
        || proj_gate.1 != width
        || proj_kv.0 != plan_rows
        || proj_gate.0 != plan_rows
    {
        return Err(shape_err(
            "compress_ring",
            format!(
                "layer {layer}: rows of {} / {} for width {width}, {slots} slots",
                proj_kv.1, proj_gate.1
            ),
        ));
    }
    Ok(())
}
