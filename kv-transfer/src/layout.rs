//! Layouts on the wire: [`KvLayout::fields`] plus the fingerprint and the two sizes.

use crate::TransferError;
use pdserve_engine::kv::{KvLayout, LayoutError};
use pdserve_proto::pb;

pub fn layout_info(layout: &KvLayout) -> pb::KvLayoutInfo {
    pb::KvLayoutInfo {
        fingerprint: layout.fingerprint(),
        fields: layout
            .fields()
            .into_iter()
            .map(|(name, value)| pb::LayoutField { name, value })
            .collect(),
        page_bytes: layout.page_bytes as u64,
        state_bytes: layout.state_bytes as u64,
    }
}

/// Refuse a peer layout that differs from ours in any named field (or in its fingerprint).
pub fn check_peer(ours: &KvLayout, theirs: &pb::KvLayoutInfo) -> Result<(), TransferError> {
    let fields: Vec<(String, String)> = theirs
        .fields
        .iter()
        .map(|f| (f.name.clone(), f.value.clone()))
        .collect();
    ours.check_peer_fields(&fields)?;
    let fp = ours.fingerprint();
    if theirs.fingerprint != fp {
        return Err(LayoutError::Mismatch {
            field: "fingerprint".into(),
            ours: fp,
            theirs: theirs.fingerprint.clone(),
        }
        .into());
    }
    Ok(())
}
